#include "session.h"

#include <prefire/errors.h>

#include "../profiling/nvtx.h"
#include "frame.h"

#include <stdexcept>
#include <string>
#include <unordered_map>

namespace prefire {
namespace detail {
namespace {

std::mutex g_registry_mu;
std::unordered_map<SessionId, std::shared_ptr<Session>>& registry() {
  static auto* sessions = new std::unordered_map<SessionId, std::shared_ptr<Session>>();  // never destroyed
  return *sessions;
}

thread_local const SessionScope* tls_open_scope = nullptr;

void prune_expired_locked(Session& s) {
  std::erase_if(s.frames, [](const std::weak_ptr<Frame>& f) { return f.expired(); });
}

}  // namespace

bool Session::register_frame_locked(const std::shared_ptr<Frame>& frame) {
  if (!frame->attach(*this)) return false;
  if (frames.size() >= 64 && frames.size() % 64 == 0) prune_expired_locked(*this);
  frames.push_back(frame);
  if (scope_open) frame->bind(this);
  return true;
}

void check_session_id(SessionId id, const char* what) {
  if (id < 0) {
    throw std::invalid_argument(std::string("prefire::") + what + ": session id must be >= 0, got " +
                                std::to_string(id));
  }
}

std::shared_ptr<Session> session_for(SessionId id) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto& slot = registry()[id];
  if (!slot) slot = std::make_shared<Session>(id);
  return slot;
}

std::shared_ptr<Session> find_session(SessionId id) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto it = registry().find(id);
  return it == registry().end() ? nullptr : it->second;
}

bool session_scope_open_on_this_thread() { return tls_open_scope != nullptr; }

}  // namespace detail

SessionScope::SessionScope(SessionId id, SessionOptions options) {
  PREFIRE_NVTX_RANGE("prefire::SessionScope(open)", id);
  detail::check_session_id(id, "SessionScope");
  if (detail::tls_open_scope != nullptr) {
    throw CheckpointError("prefire::SessionScope: nested session scopes: session " +
                          std::to_string(detail::tls_open_scope->id()) + " is already open on this thread; close it "
                          "before opening session " + std::to_string(id));
  }
  auto session = detail::session_for(id);
  {
    std::lock_guard<std::mutex> lock(session->mu);
    if (session->scope_open) {
      throw CheckpointError("prefire::SessionScope: session " + std::to_string(id) +
                            " already has an open scope (on another thread); one scope per session at a time");
    }
    session->scope_open = true;
    session->retain_on_unpack.store(options.retain_on_unpack, std::memory_order_release);
    detail::prune_expired_locked(*session);
    for (const auto& weak : session->frames) {
      if (auto frame = weak.lock()) frame->bind(session.get());
    }
  }
  session_ = std::move(session);
  detail::tls_open_scope = this;
}

SessionScope::~SessionScope() {
  PREFIRE_NVTX_RANGE("prefire::SessionScope(close)", session_->id);
  std::lock_guard<std::mutex> lock(session_->mu);
  for (const auto& weak : session_->frames) {
    if (auto frame = weak.lock()) frame->unbind();
  }
  session_->scope_open = false;
  detail::tls_open_scope = nullptr;
}

SessionId SessionScope::id() const { return session_->id; }

void clear_session(SessionId id) {
  PREFIRE_NVTX_RANGE("prefire::clear_session", id);
  detail::check_session_id(id, "clear_session");
  auto session = detail::find_session(id);
  if (!session) return;
  std::vector<std::weak_ptr<detail::Frame>> frames;
  {
    std::lock_guard<std::mutex> lock(session->mu);
    if (session->scope_open) {
      throw CheckpointError("prefire::clear_session: session " + std::to_string(id) +
                            " has an open SessionScope; clear it after the scope closes");
    }
    frames.swap(session->frames);
  }
  for (const auto& weak : frames) {
    if (auto frame = weak.lock()) frame->detach(*session);
  }
}

void set_session_budget(SessionId id, std::optional<int64_t> bytes) {
  detail::check_session_id(id, "set_session_budget");
  if (bytes && *bytes < 0) {
    throw std::invalid_argument("prefire::set_session_budget: bytes must be >= 0 (or std::nullopt for no cap), got " +
                                std::to_string(*bytes));
  }
  auto session = detail::session_for(id);
  std::lock_guard<std::mutex> lock(session->mu);
  session->budget = bytes;
}

SessionStats session_stats(SessionId id) {
  detail::check_session_id(id, "session_stats");
  SessionStats stats;
  auto session = detail::find_session(id);
  if (!session) return stats;
  std::lock_guard<std::mutex> lock(session->mu);
  stats.current_bytes = session->bytes->current();
  stats.peak_bytes = session->bytes->peak();
  stats.pool_bytes = session->pool_bytes->current();
  stats.prefires = session->prefires.load();
  stats.lazy_recomputes = session->lazy_recomputes.load();
  stats.hits = session->hits.load();
  stats.refused_prefires = session->refused_prefires.load();
  for (const auto& weak : session->frames) stats.checkpoints += weak.expired() ? 0 : 1;
  stats.budget_bytes = session->budget;
  return stats;
}

}  // namespace prefire
