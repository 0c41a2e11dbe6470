#pragma once

// A session's state and the process-wide registry of sessions.
//
// Note [Session binding]
// An unpack must find its session on whatever thread autograd runs it (the
// CUDA device threads do not see the caller's thread-locals). So a SessionScope
// writes "bound" into a field of every checkpoint registered to the session,
// and the unpack hot path reads that field and then, under the checkpoint's
// own lock, copies the checkpoint's registration (a Registration: the
// session's counters and the recomputation kept for it): no thread-local
// lookup, no global lock. Calls go one way: the session layer registers,
// binds and unregisters frames; a frame only writes its session's counters
// through the registration. An unpack that copied the registration keeps it
// alive, so a session cleared while a pass still runs on another thread
// (possible once the scope has closed) never pulls memory from under that
// unpack: the pass finishes from what it holds and recomputes the rest per
// graph task, and the memory goes when the pass lets go of it.
//
// Note [Session registry]
// Sessions are created on first use. A session ends (leaves the registry) at
// clear_session() if it is empty then: no live registered checkpoint, no
// open scope, no prefire in flight (a prefire that settles later ends it
// then). Its counters live as long as it does, so a pass's statistics can be
// read after the pass and before the clear. A budget is not the session's
// but its id's: the registry keeps budgets apart, per id, from
// set_session_budget() until it removes them, and every session of that id
// takes it when created. So a budgeted session ends at its clear like any
// other, and what stays per id is one number the caller set and removes. Sessions that are never cleared are
// found by a sweep whenever the registry has doubled since the last one and
// end if they are empty (their checkpoints' graphs were freed), so the
// registry stays within twice the live sessions (amortized O(1) per new
// session). Every operation locks the session it found and retries if that
// session ended meanwhile (`ended`), so nothing registers to a session
// nobody can find.
//
// Note [The last pass lets go when it ends]
// A scope with retain_on_unpack=false is a session's last pass (W after B).
// What it hands out stays in the session until autograd releases the saved
// tensor that refers to it (right after the node that unpacked it ran, in a
// backward without retain_graph) or the scope closes, whichever comes first;
// then it is gone for good, and a later pass that unpacks it gets a
// CheckpointError. Not released at the unpack itself: one pass may unpack a
// saved tensor more than once. torch.utils.checkpoint nested inside a prefire
// checkpoint recomputes once per graph task from its saved inputs, which the
// prefire checkpoint holds, and torch's split W pass
// (stage_backward_weight) runs one graph task per weight group; a pass that
// released at the first unpack would fail that torch checkpoint's second
// recomputation.
//
// Note [Session budgets]
// A prefire is admitted when the session's current bytes, plus the bytes
// charged to prefires still running, plus the forward bytes of what it would
// recompute, fit the budget; the check and the charge are one step under the
// session's lock, so concurrent prefires cannot overshoot together. The
// charge is dropped when the prefire ends (its tensors then count as current
// bytes). Lazy recomputation into a session (attach) is not budgeted.
//
// Note [A session shares what is registered to it]
// A session serves only the checkpoints registered to it (prefire, attach)
// before or during its passes. A scope around backward passes does not
// register the checkpoints they recompute: the unpack that would have to
// runs on whatever thread autograd picks (CUDA: a device thread), which does
// not see the scope, so joining there would share on the CPU and silently
// not on a GPU. Instead the two ways to lose the work are made loud:
//  * A scope that ends with no checkpoint registered while it was open, and
//    during which some recomputation was keyed by a graph task (no session),
//    warns once per process: the user opened sessions around B and W and
//    expected them to share, and each pass recomputed. The count is
//    process-wide (a recomputation on another thread may be the one seen);
//    a scope with nothing registered shares nothing, so a warning there is
//    never about a scope that did its job.
//  * A prefire whose recomputation no pass of its session unpacked is
//    counted (RuntimeStats::wasted_prefires) and warned about once per
//    process when its registration goes: at clear_session(), or when its
//    graph is freed (a backward outside the session's scope).
//    SessionStats::unused_prefires says how many are pending now. A caller
//    that lets prefires go on purpose (prefire.pipelining's budget making
//    room for a B) says so with discard_session(), which reports nothing.
//
// Lock order: registry, then a session, then a frame, then a recomputation's
// single flight. No lock is held while user code (checkpointed functions,
// context hooks, observers) runs.

#include <prefire/session.h>

#include "checkpoint/registration.h"

#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace prefire::detail {

class Frame;

class Session {
 public:
  explicit Session(SessionId session_id) : core(std::make_shared<SessionCore>(session_id)) {}

  const std::shared_ptr<SessionCore> core;
  SessionId id() const { return core->id; }

  std::mutex mu;  // guards the fields below
  /// A registered checkpoint, with what the latest pass read of it (kept
  /// while the entry is: see Note [A session keeps what the next pass reads]).
  struct Registered {
    std::weak_ptr<Frame> frame;
    std::shared_ptr<SlotReads> reads;
  };
  std::vector<Registered> frames;  // registered checkpoints, nested ones included, in order
  bool scope_open = false;
  // Of the open scope; see Note [A session shares what is registered to it].
  bool scope_had_checkpoints = false;  // a checkpoint was registered while it was open
  int64_t unshared_at_open = 0;        // count: unshared_recomputations() when it opened
  std::optional<int64_t> budget;  // bytes: the registry's budget of this id, copied to be read under `mu`
  int64_t charged = 0;            // bytes: forward bytes of prefires running now; see Note [Session budgets]
  bool ended = false;             // left the registry; see Note [Session registry]

  /// Registers every frame of `frames` (a checkpoint and its nested ones),
  /// binding them when a scope is open, and returns their registrations. All or
  /// nothing: on a CheckpointError (a frame registered to another session)
  /// nothing this call registered stays. `added` receives the frames that
  /// were not registered before. Caller holds `mu`.
  std::vector<std::shared_ptr<Registration>> register_locked(const std::vector<std::shared_ptr<Frame>>& frames,
                                                             std::vector<std::shared_ptr<Frame>>& added);
  /// Unregisters `frames` (dropping what the session holds for them). Caller holds `mu`.
  void unregister_locked(const std::vector<std::shared_ptr<Frame>>& frames);
  /// Forgets checkpoints whose graphs were freed. Caller holds `mu`.
  void prune_locked();
  /// Whether the session may leave the registry (after pruning). Caller holds `mu`.
  bool empty_locked();
};

/// Whether `mask` has a flag per saved tensor of each of `frames`, in order
/// (keep_only()'s and SessionOptions::next_pass_reads's test).
bool fits(const std::vector<Session::Registered>& frames, const SavedTensorMask& mask);

/// std::invalid_argument unless `id` >= 0; `what` names the caller.
void check_session_id(SessionId id, const char* what);
/// The session `id`, created on first use, with its mutex held by `lock`.
std::shared_ptr<Session> lock_session(SessionId id, std::unique_lock<std::mutex>& lock);
/// The session `id` with its mutex held by `lock`, or nullptr when there is none.
std::shared_ptr<Session> lock_existing_session(SessionId id, std::unique_lock<std::mutex>& lock);
/// Removes `session` from the registry if it is empty. Caller holds no lock.
void end_if_empty(const std::shared_ptr<Session>& session) noexcept;
/// Sessions in the registry now.
size_t session_registry_size();

}  // namespace prefire::detail
