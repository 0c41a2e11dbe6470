#include "session.h"

#include <prefire/errors.h>

#include "../profiling/nvtx.h"
#include "frame.h"
#include "thread_stack.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace prefire {
namespace detail {
namespace {

// See Note [Session registry].
struct Registry {
  static constexpr size_t kFirstSweep = 64;  // sessions
  std::mutex mu;
  std::unordered_map<SessionId, std::shared_ptr<Session>> sessions;
  size_t sweep_at = kFirstSweep;  // sessions: sweep when the registry reaches this size

  static Registry& get() {
    static auto* registry = new Registry();  // never destroyed: sessions may be used during exit
    return *registry;
  }

  // Caller holds mu and `session->mu`.
  void retire_locked(Session& session) {
    session.retired = true;
    auto it = sessions.find(session.id());
    if (it != sessions.end() && it->second.get() == &session) sessions.erase(it);
  }

  // Caller holds mu.
  void sweep_locked() {
    std::vector<std::shared_ptr<Session>> all;
    all.reserve(sessions.size());
    for (const auto& [id, session] : sessions) all.push_back(session);
    for (const auto& session : all) {
      std::lock_guard<std::mutex> lock(session->mu);
      if (session->empty_locked()) retire_locked(*session);
    }
    sweep_at = std::max(kFirstSweep, 2 * sessions.size());
  }

  std::shared_ptr<Session> get_or_create(SessionId id) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = sessions.find(id);
    if (it != sessions.end()) return it->second;
    if (sessions.size() >= sweep_at) sweep_locked();
    auto session = std::make_shared<Session>(id);
    sessions.emplace(id, session);
    return session;
  }

  std::shared_ptr<Session> find(SessionId id) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = sessions.find(id);
    return it == sessions.end() ? nullptr : it->second;
  }
};

thread_local const SessionScope* tls_open_scope = nullptr;

// Whether `weak` refers to `frame` (also once expired).
bool refers_to(const std::weak_ptr<Frame>& weak, const std::shared_ptr<Frame>& frame) {
  return !weak.owner_before(frame) && !frame.owner_before(weak);
}

}  // namespace

std::vector<std::shared_ptr<SessionEntry>> Session::register_locked(const std::vector<std::shared_ptr<Frame>>& to_add,
                                                                    std::vector<std::shared_ptr<Frame>>& added) {
  std::vector<std::shared_ptr<SessionEntry>> entries;
  entries.reserve(to_add.size());
  try {
    for (const auto& frame : to_add) {
      auto [entry, is_new] = frame->register_to(core);
      entries.push_back(std::move(entry));
      if (!is_new) continue;
      added.push_back(frame);
      if (frames.size() >= 64 && frames.size() % 64 == 0) prune_locked();
      frames.push_back(frame);
      if (scope_open) frame->bind(true);
    }
  } catch (...) {
    unregister_locked(added);
    added.clear();
    throw;
  }
  return entries;
}

void Session::unregister_locked(const std::vector<std::shared_ptr<Frame>>& to_remove) {
  for (const auto& frame : to_remove) {
    frame->unregister_from(*core);
    std::erase_if(frames, [&](const std::weak_ptr<Frame>& f) { return refers_to(f, frame); });
  }
}

void Session::prune_locked() {
  std::erase_if(frames, [](const std::weak_ptr<Frame>& f) { return f.expired(); });
}

bool Session::empty_locked() {
  prune_locked();
  return frames.empty() && !scope_open && !budget && charged == 0;
}

void check_session_id(SessionId id, const char* what) {
  if (id < 0) {
    throw std::invalid_argument(std::string("prefire::") + what + ": session id must be >= 0, got " +
                                std::to_string(id));
  }
}

std::shared_ptr<Session> lock_session(SessionId id, std::unique_lock<std::mutex>& lock) {
  for (;;) {
    auto session = Registry::get().get_or_create(id);
    lock = std::unique_lock<std::mutex>(session->mu);
    if (!session->retired) return session;
    lock.unlock();  // it left the registry meanwhile: the next lookup creates a new one
  }
}

std::shared_ptr<Session> lock_existing_session(SessionId id, std::unique_lock<std::mutex>& lock) {
  auto session = Registry::get().find(id);
  if (!session) return nullptr;
  lock = std::unique_lock<std::mutex>(session->mu);
  if (!session->retired) return session;
  lock.unlock();
  return nullptr;  // retired after the lookup: no session with this id now
}

void retire_if_empty(const std::shared_ptr<Session>& session) noexcept {
  Registry& registry = Registry::get();
  std::lock_guard<std::mutex> registry_lock(registry.mu);
  std::lock_guard<std::mutex> lock(session->mu);
  if (!session->retired && session->empty_locked()) registry.retire_locked(*session);
}

size_t session_registry_size() {
  Registry& registry = Registry::get();
  std::lock_guard<std::mutex> lock(registry.mu);
  return registry.sessions.size();
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
  std::unique_lock<std::mutex> lock;
  auto session = detail::lock_session(id, lock);
  if (session->scope_open) {
    throw CheckpointError("prefire::SessionScope: session " + std::to_string(id) +
                          " already has an open scope (on another thread); one scope per session at a time");
  }
  session->scope_open = true;
  session->core->retain_on_unpack.store(options.retain_on_unpack, std::memory_order_release);
  session->prune_locked();
  for (const auto& weak : session->frames) {
    if (auto frame = weak.lock()) frame->bind(true);
  }
  lock.unlock();
  session_ = std::move(session);
  detail::tls_open_scope = this;
}

SessionScope::~SessionScope() {
  PREFIRE_NVTX_RANGE("prefire::SessionScope(close)", session_->id());
  if (detail::tls_open_scope != this) {
    detail::fatal_misuse("the SessionScope of session " + std::to_string(session_->id()) +
                         " was destroyed on another thread than the one that opened it");
  }
  {
    std::lock_guard<std::mutex> lock(session_->mu);
    // See Note [The last pass lets go when it ends].
    const bool last_pass = !session_->core->retain_on_unpack.load(std::memory_order_acquire);
    for (const auto& weak : session_->frames) {
      if (auto frame = weak.lock()) {
        frame->bind(false);
        if (last_pass) frame->end_pass(*session_->core);
      }
    }
    session_->scope_open = false;
  }
  detail::tls_open_scope = nullptr;
}

SessionId SessionScope::id() const { return session_->id(); }

void clear_session(SessionId id) {
  PREFIRE_NVTX_RANGE("prefire::clear_session", id);
  detail::check_session_id(id, "clear_session");
  std::unique_lock<std::mutex> lock;
  auto session = detail::lock_existing_session(id, lock);
  if (!session) return;
  if (session->scope_open) {
    throw CheckpointError("prefire::clear_session: session " + std::to_string(id) +
                          " has an open SessionScope; clear it after the scope closes");
  }
  std::vector<std::weak_ptr<detail::Frame>> frames;
  frames.swap(session->frames);
  lock.unlock();
  for (const auto& weak : frames) {
    if (auto frame = weak.lock()) frame->unregister_from(*session->core);
  }
  detail::retire_if_empty(session);
}

void set_session_budget(SessionId id, std::optional<int64_t> bytes) {
  detail::check_session_id(id, "set_session_budget");
  if (bytes && *bytes < 0) {
    throw std::invalid_argument("prefire::set_session_budget: bytes must be >= 0 (or std::nullopt for no cap), got " +
                                std::to_string(*bytes));
  }
  std::unique_lock<std::mutex> lock;
  auto session = detail::lock_session(id, lock);
  session->budget = bytes;
  lock.unlock();
  if (!bytes) detail::retire_if_empty(session);
}

SessionStats session_stats(SessionId id) {
  detail::check_session_id(id, "session_stats");
  SessionStats stats;
  std::unique_lock<std::mutex> lock;
  auto session = detail::lock_existing_session(id, lock);
  if (!session) return stats;
  const detail::SessionCore& core = *session->core;
  stats.current_bytes = core.bytes->current();
  stats.peak_bytes = core.bytes->peak();
  stats.pool_bytes = core.pool_bytes->current();
  stats.prefires = core.prefires.load();
  stats.lazy_recomputes = core.lazy_recomputes.load();
  stats.hits = core.hits.load();
  stats.refused_prefires = core.refused_prefires.load();
  for (const auto& weak : session->frames) stats.checkpoints += weak.expired() ? 0 : 1;
  stats.budget_bytes = session->budget;
  return stats;
}

}  // namespace prefire
