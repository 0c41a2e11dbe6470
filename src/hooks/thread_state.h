#pragma once

// What runs on this thread, for every layer of the runtime, in one place.
//
// Note [One per-thread state]
// A saved tensor's way through prefire depends on what this thread is doing:
// which hook context receives saves (hook_stack.h), which checkpoint's
// forward runs (a checkpoint made inside it is nested), whether a
// recomputation runs (checkpoints made inside it are its own), which
// session a prefire recomputes into (a nested checkpoint's inputs come from
// its parent in that session), which SessionScope is open and which
// HandleCollector gathers handles. All of it is one struct, so that what a
// thread can be doing is read in one place and every field is set and put
// back by a scope of its layer. The struct is constant-initialized and
// trivially destructible: reading it is a plain thread-local access, no
// initialization guard (the hook query every saved tensor makes outside
// checkpoints reads one field). Caches that are not state of what runs stay
// with their code: the CUDA layer's open pool windows and warmed devices
// (cuda/prefire_stream.cpp) and the last generator snapshot
// (checkpoint/state_capture.cpp). The CUDA autograd device threads see none
// of the caller's state, which is why sessions bind through a field of each
// checkpoint instead (Note [Session binding] in session/session.h).

namespace prefire {
class HandleCollector;
class SessionScope;
}  // namespace prefire

namespace prefire::detail {

class Frame;
class HookContext;
class HookContextScope;
struct SessionCore;

struct ThreadState {
  // hooks: the intrusive stack of hook contexts and, cached, its innermost context.
  HookContextScope* hook_scope = nullptr;
  HookContext* hook_context = nullptr;
  // checkpoint: the innermost frame whose forward runs here, and how many recomputations run here.
  Frame* forward = nullptr;
  int recompute_depth = 0;
  // sessions: the session a prefire recomputes into here, the open SessionScope, the innermost collector.
  const SessionCore* prefiring = nullptr;
  const SessionScope* session_scope = nullptr;
  HandleCollector* collector = nullptr;
};

extern constinit thread_local ThreadState tls_thread_state;

/// This thread's state.
inline ThreadState& this_thread() noexcept { return tls_thread_state; }

/// Sets `field` to `value` for the lifetime of the guard and puts back what
/// it was; for the fields whose scopes nest last-in first-out.
template <typename T>
class ThreadStateGuard {
 public:
  ThreadStateGuard(T& field, T value) noexcept : field_(field), previous_(field) { field_ = value; }
  ~ThreadStateGuard() { field_ = previous_; }
  ThreadStateGuard(const ThreadStateGuard&) = delete;
  ThreadStateGuard& operator=(const ThreadStateGuard&) = delete;

 private:
  T& field_;
  T previous_;
};

}  // namespace prefire::detail
