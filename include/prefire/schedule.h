#pragma once

// Scheduling recomputation: collect the checkpoints a forward creates, then
// recompute them ahead of backward ("prefire") into a session (session.h).

#include <prefire/session.h>

#include <memory>
#include <vector>

namespace prefire {

namespace detail {
class Frame;
struct HandleAccess;
}  // namespace detail

/// A weak reference to one checkpoint. It never keeps the checkpoint's graph
/// alive; once the graph is freed the handle is expired.
class CheckpointHandle {
 public:
  /// A handle from nowhere: every scheduling call rejects it.
  CheckpointHandle() = default;

  /// The checkpoint's graph has been freed (or the handle is default-made).
  bool expired() const { return frame_.expired(); }
  /// Made by a HandleCollector (false for a default-made handle).
  bool valid() const { return valid_; }

 private:
  friend struct detail::HandleAccess;
  std::weak_ptr<detail::Frame> frame_;
  bool valid_ = false;
};

/// Gathers a handle for every checkpoint created on this thread while it
/// lives (outside recomputations). Scopes nest; the innermost one receives
/// the handles. Must be destroyed in LIFO order with other collectors.
class HandleCollector {
 public:
  HandleCollector();
  ~HandleCollector();
  HandleCollector(const HandleCollector&) = delete;
  HandleCollector& operator=(const HandleCollector&) = delete;

  /// In creation order.
  const std::vector<CheckpointHandle>& handles() const { return handles_; }

 private:
  friend struct detail::HandleAccess;
  std::vector<CheckpointHandle> handles_;
  HandleCollector* previous_;
};

enum class PrefireStatus {
  kRecomputed,        ///< recomputed now and held by the session
  kAlreadyResident,   ///< the session already held it: nothing done
  kRefusedOverBudget, ///< would exceed the session's budget: stays lazy
  kExpired,           ///< the checkpoint's graph is gone: nothing to do
};
const char* to_string(PrefireStatus status);

/// Registers the handle's checkpoint to session `id` and recomputes it now,
/// on the calling thread, under the state captured at its forward. The
/// session holds the result until clear_session(id) (or until its unpack with
/// retain_on_unpack=false). A second prefire of the same handle into the same
/// session is a no-op.
///
/// Raises std::invalid_argument for a default-made handle or a negative id,
/// CheckpointError when the checkpoint is registered to another session, and
/// whatever the recomputation raises (after which the session holds nothing
/// for it and clear_session works as usual).
PrefireStatus prefire(const CheckpointHandle& handle, SessionId id);

/// Registers the handle's checkpoint to session `id` without recomputing: the
/// first unpack under a SessionScope of `id` recomputes it into the session.
/// Returns false when the handle is expired. Same errors as prefire().
bool attach(const CheckpointHandle& handle, SessionId id);

}  // namespace prefire
