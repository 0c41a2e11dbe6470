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

/// Gathers a handle for every outermost checkpoint created on this thread
/// while it lives: a checkpoint nested in another's forward is scheduled with
/// that outer checkpoint (prefire() and attach() take the nested ones along),
/// and checkpoints made inside a recomputation are never collected. Scopes
/// nest; the innermost one receives the handles. Destroy it on the thread
/// that made it (in any order with other collectors); elsewhere is a fatal
/// misuse.
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

/// Registers the handle's checkpoint and the checkpoints nested in it to
/// session `id` and recomputes them now, on the calling thread, under the
/// state captured at their forward (outer first). The session holds the
/// results until clear_session(id) (or until their unpack with
/// retain_on_unpack=false). A prefire of a checkpoint the session already
/// holds is a no-op (kAlreadyResident), also when another thread is
/// recomputing it right now: the call waits for that recomputation.
///
/// Budget: the bytes the checkpoints held at forward are charged against the
/// session's budget in the same step as the check, so concurrent prefires
/// into one session never exceed it together (see set_session_budget).
///
/// Threads and locks: any thread; no lock of prefire's is held while the
/// checkpointed function, its context hooks or the recompute observer run, so
/// they may call any public function (session_stats, runtime_stats, prefire
/// of another handle). Recomputations that restore generator state run one at
/// a time, process-wide (CheckpointOptions::preserve_rng_state).
///
/// Raises std::invalid_argument for a default-made handle or a negative id,
/// CheckpointError when a checkpoint is registered to another session or when
/// called from inside this checkpoint's own recomputation, and whatever the
/// recomputation raises; a prefire that raises leaves nothing registered that
/// it registered, and clear_session works as usual.
PrefireStatus prefire(const CheckpointHandle& handle, SessionId id);

/// Registers the handle's checkpoint and the checkpoints nested in it to
/// session `id` without recomputing: the first unpack under a SessionScope of
/// `id` recomputes each into the session. Returns false when the handle is
/// expired. Same argument and conflict errors as prefire(); all or nothing.
bool attach(const CheckpointHandle& handle, SessionId id);

/// Bytes keeping the handle's checkpointed block instead would hold: the
/// storages its forward saved, each once, as a SavedTensorMeter counts them
/// for the block run unchecked (the inputs it saved included, leaves that
/// require grad such as parameters not). A recomputation of it holds these
/// less its inputs (Note [Counting saved bytes] in
/// src/memory/storage_census.cpp). Checkpoints nested in it keep dropping
/// theirs, so those are not included. 0 when expired;
/// std::invalid_argument for a default-made handle. Any thread.
int64_t kept_bytes(const CheckpointHandle& handle);

}  // namespace prefire
