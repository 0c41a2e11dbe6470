#include "session/session.h"

#include <prefire/errors.h>

#include "checkpoint/frame.h"
#include "hooks/thread_stack.h"
#include "hooks/thread_state.h"
#include "profiling/nvtx.h"

#include <c10/util/Exception.h>

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
  std::unordered_map<SessionId, int64_t> budgets;  // bytes, by id, until removed; see Note [Session registry]
  size_t sweep_at = kFirstSweep;  // sessions: sweep when the registry reaches this size

  static Registry& get() {
    static auto* registry = new Registry();  // never destroyed: sessions may be used during exit
    return *registry;
  }

  // Caller holds mu and `session->mu`.
  void end_locked(Session& session) {
    session.ended = true;
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
      if (session->empty_locked()) end_locked(*session);
    }
    sweep_at = std::max(kFirstSweep, 2 * sessions.size());
  }

  std::shared_ptr<Session> get_or_create(SessionId id) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = sessions.find(id);
    if (it != sessions.end()) return it->second;
    if (sessions.size() >= sweep_at) sweep_locked();
    auto session = std::make_shared<Session>(id);
    if (auto budget = budgets.find(id); budget != budgets.end()) session->budget = budget->second;
    sessions.emplace(id, session);
    return session;
  }

  // The budget of `id` (a session's, and the next session's of that id).
  void set_budget(SessionId id, std::optional<int64_t> bytes) {
    std::lock_guard<std::mutex> lock(mu);
    if (bytes) {
      budgets[id] = *bytes;
    } else {
      budgets.erase(id);
    }
    auto it = sessions.find(id);
    if (it == sessions.end()) return;
    std::lock_guard<std::mutex> session_lock(it->second->mu);
    it->second->budget = bytes;
  }

  std::optional<int64_t> budget(SessionId id) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = budgets.find(id);
    return it == budgets.end() ? std::nullopt : std::optional<int64_t>(it->second);
  }

  std::shared_ptr<Session> find(SessionId id) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = sessions.find(id);
    return it == sessions.end() ? nullptr : it->second;
  }
};

// Whether `weak` refers to `frame` (also once expired).
bool refers_to(const std::weak_ptr<Frame>& weak, const std::shared_ptr<Frame>& frame) {
  return !weak.owner_before(frame) && !frame.owner_before(weak);
}

}  // namespace

std::vector<std::shared_ptr<Registration>> Session::register_locked(const std::vector<std::shared_ptr<Frame>>& to_add,
                                                                    std::vector<std::shared_ptr<Frame>>& added) {
  std::vector<std::shared_ptr<Registration>> registrations;
  registrations.reserve(to_add.size());
  try {
    for (const auto& frame : to_add) {
      auto [registration, is_new] = frame->register_to(core);
      registrations.push_back(std::move(registration));
      if (!is_new) continue;
      added.push_back(frame);
      if (frames.size() >= 64 && frames.size() % 64 == 0) prune_locked();
      frames.push_back({frame, registrations.back()->reads});
      if (scope_open) {
        frame->bind(true);
        scope_had_checkpoints = true;
      }
    }
  } catch (...) {
    unregister_locked(added);
    added.clear();
    throw;
  }
  return registrations;
}

void Session::unregister_locked(const std::vector<std::shared_ptr<Frame>>& to_remove) {
  for (const auto& frame : to_remove) {
    frame->unregister(*core);
    std::erase_if(frames, [&](const Registered& r) { return refers_to(r.frame, frame); });
  }
}

void Session::prune_locked() {
  std::erase_if(frames, [](const Registered& r) { return r.frame.expired(); });
}

bool Session::empty_locked() {
  prune_locked();
  return frames.empty() && !scope_open && charged == 0;
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
    if (!session->ended) return session;
    lock.unlock();  // it left the registry meanwhile: the next lookup creates a new one
  }
}

std::shared_ptr<Session> lock_existing_session(SessionId id, std::unique_lock<std::mutex>& lock) {
  auto session = Registry::get().find(id);
  if (!session) return nullptr;
  lock = std::unique_lock<std::mutex>(session->mu);
  if (!session->ended) return session;
  lock.unlock();
  return nullptr;  // ended after the lookup: no session with this id now
}

void end_if_empty(const std::shared_ptr<Session>& session) noexcept {
  Registry& registry = Registry::get();
  std::lock_guard<std::mutex> registry_lock(registry.mu);
  std::lock_guard<std::mutex> lock(session->mu);
  if (!session->ended && session->empty_locked()) registry.end_locked(*session);
}

size_t session_registry_size() {
  Registry& registry = Registry::get();
  std::lock_guard<std::mutex> lock(registry.mu);
  return registry.sessions.size();
}

}  // namespace detail

SessionScope::SessionScope(SessionId id, SessionOptions options) {
  PREFIRE_NVTX_RANGE("prefire::SessionScope(open)", id);
  detail::check_session_id(id, "SessionScope");
  if (!options.retain_on_unpack && !options.next_pass_reads.empty()) {
    throw std::invalid_argument("prefire::SessionScope: next_pass_reads is for a pass with retain_on_unpack=true "
                                "(a last pass lets go of everything it unpacks anyway)");
  }
  if (const SessionScope* open = detail::this_thread().session_scope) {
    throw CheckpointError("prefire::SessionScope: nested session scopes: session " +
                          std::to_string(open->id()) + " is already open on this thread; close it "
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
  session->scope_had_checkpoints = !session->frames.empty();
  session->unshared_at_open = detail::unshared_recomputations();
  // See Note [A pass lets go of what the next pass will not read] in session/keep_only.cpp.
  lets_go_ = options.retain_on_unpack && !options.next_pass_reads.empty() &&
             detail::fits(session->frames, options.next_pass_reads);
  for (size_t i = 0; i < session->frames.size(); ++i) {
    const auto& registered = session->frames[i];
    if (auto frame = registered.frame.lock()) {
      if (lets_go_) frame->keep_past_unpack(*session->core, std::move(options.next_pass_reads[i]));
      frame->bind(true);
    }
    registered.reads->clear();  // a pass begins
  }
  lock.unlock();
  session_ = std::move(session);
  detail::this_thread().session_scope = this;
}

SessionScope::~SessionScope() {
  PREFIRE_NVTX_RANGE("prefire::SessionScope(close)", session_->id());
  if (detail::this_thread().session_scope != this) {
    detail::fatal_misuse("the SessionScope of session " + std::to_string(session_->id()) +
                         " was destroyed on another thread than the one that opened it");
  }
  bool shared_nothing = false;
  {
    std::lock_guard<std::mutex> lock(session_->mu);
    // See Note [The last pass lets go when it ends].
    const bool last_pass = !session_->core->retain_on_unpack.load(std::memory_order_acquire);
    for (const auto& registered : session_->frames) {
      if (auto frame = registered.frame.lock()) {
        frame->bind(false);
        if (last_pass) frame->end_pass(*session_->core);
        if (lets_go_) frame->end_keeping_pass(*session_->core);
      }
    }
    session_->scope_open = false;
    shared_nothing = !session_->scope_had_checkpoints &&
                     detail::unshared_recomputations() > session_->unshared_at_open;
  }
  detail::this_thread().session_scope = nullptr;
  if (shared_nothing) {
    try {  // See Note [A session shares what is registered to it].
      TORCH_WARN_ONCE("prefire: session ", session_->id(), "'s scope ended with no checkpoint registered to it, while "
                      "backward recomputed checkpoints outside any session: a session shares only the checkpoints "
                      "registered to it before its passes, so each pass recomputed them. Register them with "
                      "prefire::prefire or prefire::attach (Python: prefire.prefire / prefire.attach on the handles "
                      "of prefire.collect()) before the first pass.");
    } catch (...) {  // a destructor never throws
    }
  }
}

SessionId SessionScope::id() const { return session_->id(); }

namespace detail {
namespace {

// clear_session() and discard_session(): `what` names the caller; with
// `discard`, prefired recomputations no pass used go unreported (see Note
// [A session shares what is registered to it] in session.h).
void end_session(SessionId id, const char* what, bool discard) {
  check_session_id(id, what);
  std::unique_lock<std::mutex> lock;
  auto session = lock_existing_session(id, lock);
  if (!session) return;
  if (session->scope_open) {
    throw CheckpointError(std::string("prefire::") + what + ": session " + std::to_string(id) +
                          " has an open SessionScope; clear it after the scope closes");
  }
  std::vector<Session::Registered> frames;
  frames.swap(session->frames);
  lock.unlock();
  for (const auto& registered : frames) {
    auto frame = registered.frame.lock();
    if (!frame) continue;
    if (discard) {
      if (auto registration = frame->registration_in(*session->core)) {
        registration->prefired.store(false, std::memory_order_relaxed);
      }
    }
    frame->unregister(*session->core);
  }
  end_if_empty(session);
}

}  // namespace
}  // namespace detail

void clear_session(SessionId id) {
  PREFIRE_NVTX_RANGE("prefire::clear_session", id);
  detail::end_session(id, "clear_session", /*discard=*/false);
}

void discard_session(SessionId id) {
  PREFIRE_NVTX_RANGE("prefire::discard_session", id);
  detail::end_session(id, "discard_session", /*discard=*/true);
}

void set_session_budget(SessionId id, std::optional<int64_t> bytes) {
  detail::check_session_id(id, "set_session_budget");
  if (bytes && *bytes < 0) {
    throw std::invalid_argument("prefire::set_session_budget: bytes must be >= 0 (or std::nullopt for no cap), got " +
                                std::to_string(*bytes));
  }
  detail::Registry::get().set_budget(id, bytes);
}

SessionStats session_stats(SessionId id) {
  detail::check_session_id(id, "session_stats");
  SessionStats stats;
  std::unique_lock<std::mutex> lock;
  auto session = detail::lock_existing_session(id, lock);
  if (!session) {
    stats.budget_bytes = detail::Registry::get().budget(id);  // the registry's lock, after the session's: none held
    return stats;
  }
  const detail::SessionCore& core = *session->core;
  stats.current_bytes = core.bytes->current();
  stats.peak_bytes = core.bytes->peak();
  stats.pool_bytes = core.pool_bytes->current();
  stats.prefires = core.prefires.load();
  stats.lazy_recomputes = core.lazy_recomputes.load();
  stats.hits = core.hits.load();
  stats.refused_prefires = core.refused_prefires.load();
  stats.trim_misses = core.trim_misses.load();
  for (const auto& registered : session->frames) {
    auto frame = registered.frame.lock();
    if (!frame) continue;
    stats.checkpoints += 1;
    auto registration = frame->registration_in(core);
    stats.unused_prefires += registration && registration->unused_prefire() ? 1 : 0;
  }
  stats.budget_bytes = session->budget;
  return stats;
}

}  // namespace prefire
