#include <prefire/errors.h>
#include <prefire/schedule.h>

#include "../profiling/nvtx.h"
#include "frame.h"
#include "schedule_internal.h"
#include "session.h"

#include <c10/util/Exception.h>

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
};

void collect(const std::shared_ptr<Frame>& frame) {
  if (HandleCollector* c = tls_collector) HandleAccess::add(*c, frame);
}

}  // namespace detail

HandleCollector::HandleCollector() : previous_(detail::tls_collector) { detail::tls_collector = this; }

HandleCollector::~HandleCollector() {
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(detail::tls_collector == this, "HandleCollectors closed out of order");
  detail::tls_collector = previous_;
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
  auto session = detail::session_for(id);
  std::lock_guard<std::mutex> lock(session->mu);
  session->register_frame_locked(frame);
  return true;
}

PrefireStatus prefire(const CheckpointHandle& handle, SessionId id) {
  PREFIRE_NVTX_RANGE("prefire::prefire", id);
  detail::check_session_id(id, "prefire");
  auto frame = detail::HandleAccess::frame(handle, "prefire");
  if (!frame) return PrefireStatus::kExpired;
  auto session = detail::session_for(id);
  {
    std::lock_guard<std::mutex> lock(session->mu);
    frame->check_registrable_to(*session);  // before the budget: a conflict is an error, not a refusal
    if (!frame->resident_in(*session) && session->budget &&
        session->bytes->current() + frame->expected_bytes() > *session->budget) {
      session->refused_prefires.fetch_add(1, std::memory_order_relaxed);
      return PrefireStatus::kRefusedOverBudget;
    }
    session->register_frame_locked(frame);
  }
  if (!frame->prefire()) return PrefireStatus::kAlreadyResident;
  session->prefires.fetch_add(1, std::memory_order_relaxed);
  return PrefireStatus::kRecomputed;
}

}  // namespace prefire
