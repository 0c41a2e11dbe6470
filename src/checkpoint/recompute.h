#pragma once

// The recompute driver: runs a checkpoint's function again under the state
// its forward captured, checks every tensor the run saves against forward's
// slot, stores it into a Recomputation and stops once the slots are filled
// (Note [Early stop] in checkpoint/frame.cpp). It reads what the frame
// produced (RecomputeSource) and never calls the frame.

#include <prefire/checkpoint.h>
#include <prefire/observer.h>
#include <prefire/session.h>

#include "checkpoint/frame_inputs.h"
#include "checkpoint/offloaded_slots.h"
#include "checkpoint/recomputation.h"
#include "checkpoint/slots.h"
#include "checkpoint/state_capture.h"

#include <optional>

namespace prefire::detail {

/// What a recomputation is made from: the frame's function, options, captured
/// state, inputs and slots; for an offloaded frame, its offloaded slots, which
/// fill the recomputation instead (Note [Offloading a checkpoint] in
/// checkpoint/offloaded_slots.cpp). Read-only once the frame's forward is done.
struct RecomputeSource {
  const CheckpointFn& fn;
  const CheckpointOptions& options;
  const CapturedState& state;
  const FrameInputs& inputs;
  const SlotTable& slots;
  OffloadedSlots* offloaded = nullptr;
};

/// Fills `r` with a recomputation of `source`'s first `extent.slots` slots
/// unless it is done (Note [Single-flight recomputation]); a prefire runs on
/// the prefire stream of the inputs' CUDA device, if any. An offloaded source
/// is fetched instead (a prefire: prefetched). Returns the
/// observer's event when this call recomputed. Raises CheckpointError when
/// the recomputation saves other tensors than forward did (as
/// options.determinism_check says), and what `fn` raises.
std::optional<RecomputeEvent> recompute_once(const RecomputeSource& source, Recomputation& r,
                                             RecomputeEvent::Kind kind, std::optional<SessionId> session,
                                             const Extent& extent);

/// Whether a recomputation runs on this thread.
bool recomputing_on_this_thread();

}  // namespace prefire::detail
