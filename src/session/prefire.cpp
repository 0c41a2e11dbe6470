// Note [Nested checkpoints in sessions]
// A checkpoint created inside another's forward is nested: the outer frame
// lists it (weakly) and no collector sees it, so handles name outermost
// checkpoints only. Registering a checkpoint to a session (prefire, attach)
// registers its nested checkpoints too, all or nothing, and a prefire
// recomputes them after their parent, so each nested checkpoint runs once per
// micro-batch, shared by B and W like its parent: while a prefire of session S
// runs on this thread, a nested checkpoint's inputs (saved tensors of its
// parent) are served from the parent's recomputation in S
// (ThreadState::prefiring, hooks/thread_state.h). Checkpoints created while
// a recomputation runs belong to that recomputation's throw-away graph and
// are neither collected nor nested.

#include <prefire/errors.h>
#include <prefire/schedule.h>

#include "checkpoint/frame.h"
#include "checkpoint/handle_collector.h"
#include "hooks/thread_state.h"
#include "profiling/nvtx.h"
#include "session/session.h"

#include <stdexcept>

namespace prefire {

const char* to_string(PrefireStatus status) {
  switch (status) {
    case PrefireStatus::kRecomputed:
      return "recomputed";
    case PrefireStatus::kAlreadyResident:
      return "already resident";
    case PrefireStatus::kRefusedOverBudget:
      return "refused over budget";
    case PrefireStatus::kExpired:
      return "expired";
  }
  return "invalid";
}

bool attach(const CheckpointHandle& handle, SessionId id) {
  PREFIRE_NVTX_RANGE("prefire::attach", id);
  detail::check_session_id(id, "attach");
  auto frame = detail::HandleAccess::frame(handle, "attach");
  if (!frame) return false;
  const auto frames = frame->with_nested();
  std::unique_lock<std::mutex> lock;
  auto session = detail::lock_session(id, lock);
  std::vector<std::shared_ptr<detail::Frame>> added;
  session->register_locked(frames, added);
  return true;
}

int64_t kept_bytes(const CheckpointHandle& handle) {
  auto frame = detail::HandleAccess::frame(handle, "kept_bytes");
  return frame ? frame->kept_bytes() : 0;
}

PrefireStatus prefire(const CheckpointHandle& handle, SessionId id) {
  PREFIRE_NVTX_RANGE("prefire::prefire", id);
  detail::check_session_id(id, "prefire");
  auto frame = detail::HandleAccess::frame(handle, "prefire");
  if (!frame) return PrefireStatus::kExpired;
  const auto frames = frame->with_nested();  // parents first: a nested checkpoint's inputs come from its parent

  std::shared_ptr<detail::Session> session;
  std::vector<std::shared_ptr<detail::Registration>> registrations;
  std::vector<std::shared_ptr<detail::Frame>> added;
  int64_t charge = 0;  // bytes; see Note [Session budgets] in session/session.h
  {
    std::unique_lock<std::mutex> lock;
    session = detail::lock_session(id, lock);
    // Registering first reports a checkpoint of another session as an error,
    // even where the budget would refuse it.
    registrations = session->register_locked(frames, added);
    bool pending = false;
    for (size_t i = 0; i < frames.size(); ++i) {
      if (registrations[i]->recomputation.done()) continue;
      pending = true;
      charge += frames[i]->expected_bytes();
    }
    if (!pending) return PrefireStatus::kAlreadyResident;
    if (session->budget && session->core->bytes->current() + session->charged + charge > *session->budget) {
      session->core->refused_prefires.fetch_add(1, std::memory_order_relaxed);
      session->unregister_locked(added);  // a refused checkpoint stays lazy, keyed by graph task
      return PrefireStatus::kRefusedOverBudget;
    }
    session->charged += charge;
  }

  // No lock held from here on: recomputations run user code.
  auto settle = [&](bool failed) noexcept {
    bool unused = false;
    {
      std::lock_guard<std::mutex> lock(session->mu);
      session->charged -= charge;
      if (failed) session->unregister_locked(added);  // a failed prefire leaves nothing registered
      unused = session->frames.empty() && session->charged == 0;
    }
    // A session cleared while this prefire ran (or one a failed prefire
    // created) waited for the charge to go: it leaves the registry now. The
    // registry's lock is taken only then, not on every prefire.
    if (unused) detail::end_if_empty(session);
  };
  bool recomputed = false;
  try {
    // See Note [A nested prefire takes its inputs on the prefire stream] in checkpoint/frame.cpp.
    detail::ThreadStateGuard<const detail::SessionCore*> prefiring(detail::this_thread().prefiring,
                                                                   session->core.get());
    for (size_t i = 0; i < frames.size(); ++i) recomputed = frames[i]->prefire(*registrations[i]) || recomputed;
  } catch (...) {
    settle(/*failed=*/true);
    throw;
  }
  settle(/*failed=*/false);
  return recomputed ? PrefireStatus::kRecomputed : PrefireStatus::kAlreadyResident;
}

}  // namespace prefire
