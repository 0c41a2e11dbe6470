#pragma once

// Handles: what a forward hands to a scheduler (HandleCollector) and what the
// scheduling calls (session/prefire.cpp) find behind a handle.

#include <prefire/schedule.h>

#include <memory>

namespace prefire::detail {

class Frame;

/// Gives `frame` to the innermost HandleCollector of this thread, if any.
void collect(const std::shared_ptr<Frame>& frame);

/// The private side of CheckpointHandle and HandleCollector.
struct HandleAccess {
  static void add(HandleCollector& c, const std::shared_ptr<Frame>& frame) {
    CheckpointHandle h;
    h.frame_ = frame;
    h.valid_ = true;
    c.handles_.push_back(std::move(h));
  }
  /// The frame behind a handle; nullptr when expired. std::invalid_argument
  /// for a default-made handle; `what` names the caller.
  static std::shared_ptr<Frame> frame(const CheckpointHandle& h, const char* what);
  static HandleCollector*& below(HandleCollector& c) { return c.previous_; }
};

}  // namespace prefire::detail
