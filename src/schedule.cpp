// Note [Nested checkpoints in sessions]
// A checkpoint created inside another's forward is nested: the outer frame
// lists it (weakly) and no collector sees it, so handles name outermost
// checkpoints only. Registering a checkpoint to a session (prefire, attach)
// registers its nested checkpoints too, all or nothing, and a prefire
// recomputes them after their parent, so each nested checkpoint runs once per
// micro-batch, shared by B and W like its parent: while a prefire of session S
// runs on this thread, a nested checkpoint's inputs (saved tensors of its
// parent) are served from the parent's recomputation in S (PrefireSessionScope
// in frame.h). Checkpoints created while a recomputation runs belong to that
// recomputation's throw-away graph and are neither collected nor nested.

#include <prefire/errors.h>
#include <prefire/schedule.h>

#include "../profiling/nvtx.h"
#include "frame.h"
#include "schedule_internal.h"
#include "session.h"
#include "thread_stack.h"

#include <stdexcept>

namespace prefire {
namespace detail {
namespace {
thread_local HandleCollector* tls_collector = nullptr;
}

struct HandleAccess {
  static void add(HandleCollector& c, const std::shared_ptr<Frame>& frame) {
    CheckpointHandle h;
    h.frame_ = frame;
    h.valid_ = true;
    c.handles_.push_back(std::move(h));
  }
  // The frame behind a handle; nullptr when expired. Rejects default-made handles.
  static std::shared_ptr<Frame> frame(const CheckpointHandle& h, const char* what) {
    if (!h.valid_) {
      throw std::invalid_argument(std::string("prefire::") + what +
                                  ": the handle was default-constructed; take handles from HandleCollector::handles()");
    }
    return h.frame_.lock();
  }
  static HandleCollector*& below(HandleCollector& c) { return c.previous_; }
};

void collect(const std::shared_ptr<Frame>& frame) {
  if (HandleCollector* c = tls_collector) HandleAccess::add(*c, frame);
}

}  // namespace detail

HandleCollector::HandleCollector() : previous_(detail::tls_collector) { detail::tls_collector = this; }

HandleCollector::~HandleCollector() {
  // See Note [Scopes that leave out of order] in thread_stack.h.
  if (!detail::unlink_from_stack(detail::tls_collector, this, detail::HandleAccess::below)) {
    detail::fatal_misuse("a HandleCollector was destroyed on another thread than the one that made it");
  }
}

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
  std::vector<std::shared_ptr<detail::SessionEntry>> entries;
  std::vector<std::shared_ptr<detail::Frame>> added;
  int64_t charge = 0;  // bytes; see Note [Session budgets] in session.h
  {
    std::unique_lock<std::mutex> lock;
    session = detail::lock_session(id, lock);
    // Registering first reports a checkpoint of another session as an error,
    // even where the budget would refuse it.
    entries = session->register_locked(frames, added);
    bool pending = false;
    for (size_t i = 0; i < frames.size(); ++i) {
      if (entries[i]->recomputation.done()) continue;
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
    if (unused) detail::retire_if_empty(session);
  };
  bool recomputed = false;
  try {
    detail::PrefireSessionScope prefiring(session->core.get());
    for (size_t i = 0; i < frames.size(); ++i) recomputed = frames[i]->prefire(*entries[i]) || recomputed;
  } catch (...) {
    settle(/*failed=*/true);
    throw;
  }
  settle(/*failed=*/false);
  return recomputed ? PrefireStatus::kRecomputed : PrefireStatus::kAlreadyResident;
}

}  // namespace prefire
