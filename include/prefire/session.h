#pragma once

// Sessions: recomputations cached under a stable id, so that the separate
// backward passes of one micro-batch (dx then dw, as zero-bubble pipeline
// schedules run them) share one recomputation per checkpoint.
//
// A session holds the checkpoints registered to it (prefire::prefire or
// prefire::attach, schedule.h). A SessionScope binds the session to those
// checkpoints for its lifetime; an unpack of a bound checkpoint, on any thread,
// is served from the session: recomputed there on first need (or earlier, by
// prefire) and kept as `retain_on_unpack` says until clear_session(), or until
// the checkpoint's graph is freed (nothing can unpack it then).

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace prefire {

/// A session's id: a non-negative integer, stable across the passes of one
/// micro-batch (its index is a natural choice). Negative ids are invalid.
using SessionId = int64_t;

/// Per checkpoint registered to a session, in the order they were registered
/// (each checkpoint followed by its nested ones, parents first): a flag per
/// tensor autograd saved in its forward, by slot.
using SavedTensorMask = std::vector<std::vector<bool>>;

struct SessionOptions {
  /// false: a recomputed tensor is released on its first unpack (the last
  /// pass that needs the session). true: kept until clear_session(), so a
  /// later pass (the dw pass after the dx pass) finds it.
  bool retain_on_unpack = false;
  /// With retain_on_unpack: what the next pass will read, as keep_only()
  /// takes it. A saved tensor it leaves out is let go at its unpack in this
  /// pass instead of being kept (a second unpack of it recomputes it for that
  /// backward alone, a trim miss), and what the session still holds of those
  /// when the scope closes goes then: the session ends the pass holding what
  /// keep_only(mask) after it would leave, without holding the rest through
  /// the pass. Empty: keep everything. A mask that does not fit the
  /// checkpoints registered when the scope opens lets nothing go
  /// (SessionScope::lets_go() is false); a mask with retain_on_unpack=false
  /// raises std::invalid_argument. See Note [A pass lets go of what the
  /// next pass will not read] in session/keep_only.cpp.
  SavedTensorMask next_pass_reads;
};

namespace detail {
class Session;
}

/// Binds session `id` to every checkpoint registered to it, at construction
/// and for checkpoints registered while the scope lives; unbinds them at
/// destruction. The binding is a field of each checkpoint, so a backward on
/// any thread (a std::thread, an autograd device thread) uses the session
/// while the scope lives.
///
/// Raises CheckpointError when a SessionScope is already open on this thread
/// (nested scopes) or when session `id` already has an open scope; raises
/// std::invalid_argument for a negative id. While the scope is open on this
/// thread, a forward's prefire::checkpoint() raises CheckpointError
/// (checkpoints nested in a checkpoint being recomputed are fine). Destroy it
/// on the thread that opened it; elsewhere is a fatal misuse.
class SessionScope {
 public:
  explicit SessionScope(SessionId id, SessionOptions options = {});
  ~SessionScope();
  SessionScope(const SessionScope&) = delete;
  SessionScope& operator=(const SessionScope&) = delete;

  SessionId id() const;
  /// Whether the scope lets go of what SessionOptions::next_pass_reads leaves
  /// out (false: no mask, or one that does not fit the session).
  bool lets_go() const { return lets_go_; }

 private:
  std::shared_ptr<detail::Session> session_;
  bool lets_go_ = false;
};

/// Drops every recomputed tensor session `id` holds and unregisters its
/// checkpoints; the id is then ready for the next iteration. A checkpoint
/// prefired into the session whose recomputation no pass used is counted in
/// RuntimeStats::wasted_prefires and warned about once per process (see
/// discard_session()). Idempotent, safe
/// after a partial or failed backward, a failed prefire or an unknown id.
/// The session ends here: its counters start from zero at its next use (read
/// session_stats() before clearing). A budget set for `id` stays for the
/// next session of `id` (set_session_budget).
///
/// A backward of the session that still runs on another thread (its scope
/// closed early) is not disturbed: it keeps the tensors it already took,
/// recomputes the rest per graph task, and the session's memory is freed
/// when that backward lets go of it. Raises CheckpointError while a
/// SessionScope of `id` is open, std::invalid_argument for a negative id.
void clear_session(SessionId id);

/// clear_session() for a caller that lets go of prefired recomputations on
/// purpose (a budget making room, a prefire that turned out not to be
/// needed): the same, except that a prefire no pass used is not counted in
/// RuntimeStats::wasted_prefires nor warned about. A prefire let go any other
/// way (clear_session(), a graph freed) is.
void discard_session(SessionId id);

/// Caps the bytes session `id` may hold through prefire: a prefire whose
/// checkpoint (with the checkpoints nested in it) would take the session above
/// `bytes`, counting what it holds and what running prefires will hold, is
/// refused and that checkpoint stays lazy (recomputed per backward graph task,
/// not cached). The charge of a prefire is the bytes its checkpoints held at
/// forward. Lazy recomputation into the session is not capped. The budget
/// belongs to the id, not to one session: it outlives clear_session() and
/// caps every later session of `id` until removed (std::nullopt); a caller
/// that budgets many ids removes each budget when done with it. `bytes` must
/// be >= 0.
void set_session_budget(SessionId id, std::optional<int64_t> bytes);

struct SessionStats {
  int64_t current_bytes = 0;     // bytes: storages of recomputed tensors the session holds now
  int64_t peak_bytes = 0;        // bytes: largest current_bytes since the session was first used
  int64_t pool_bytes = 0;        // bytes: the part of current_bytes prefired into the CUDA session buffer pool
  int64_t prefires = 0;          // count: checkpoints recomputed by prefire()
  int64_t lazy_recomputes = 0;   // count: checkpoints recomputed by their first unpack under a scope
  int64_t hits = 0;              // count: unpacks served from a recomputation already held
  int64_t refused_prefires = 0;  // count: prefire() calls refused by the budget
  int64_t trim_misses = 0;       // count: unpacks of a tensor keep_only() dropped (recomputed per graph task)
  int64_t checkpoints = 0;       // count: checkpoints registered now, nested ones included
  int64_t unused_prefires = 0;   // count: registered checkpoints prefired whose recomputation no pass has used yet
  std::optional<int64_t> budget_bytes;  // bytes: the cap, if any
};

/// The counters of session `id` (all zero when no session `id` exists; the
/// budget is reported either way).
/// Counts are cumulative since the session was created: by its first use
/// after it last ended (see clear_session). Any thread; never waits for a
/// recomputation.
SessionStats session_stats(SessionId id);

/// Which saved tensors the latest pass of session `id` (its latest
/// SessionScope, open or closed) unpacked. Empty when there is no session `id`.
SavedTensorMask pass_reads(SessionId id);

/// Lets session `id` hold, of what it recomputed, only the saved tensors
/// `keep` marks: the others are dropped now and for the rest of the session.
/// `keep` is what the next pass will read, as pass_reads() saw the same pass
/// of an earlier session of the same forward (the W pass after B). A dropped
/// tensor that is unpacked after all is recomputed for that backward alone
/// (per graph task, as without a session) and counted in
/// SessionStats::trim_misses: slower, never wrong. Returns false and drops
/// nothing when `keep` does not fit the session (another number of
/// checkpoints, or of saved tensors in one). See Note [A session keeps what
/// the next pass reads] in session/keep_only.cpp. Raises CheckpointError
/// while a SessionScope of `id` is open, std::invalid_argument for a negative id.
bool keep_only(SessionId id, const SavedTensorMask& keep);

}  // namespace prefire
