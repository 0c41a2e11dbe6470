#include "hooks/hook_stack.h"

#include "hooks/thread_stack.h"
#include "hooks/thread_state.h"

#include <atomic>

namespace prefire::detail {

// The stack is intrusive: each scope links to the scope below it. The
// innermost context is cached for the query every saved tensor makes.
HookContext* current_hook_context() noexcept { return this_thread().hook_context; }

namespace {
std::atomic<HookSource*> g_source{nullptr};
}

void set_hook_source(HookSource* source) noexcept { g_source.store(source, std::memory_order_release); }
HookSource* hook_source() noexcept { return g_source.load(std::memory_order_acquire); }

HookContextScope::HookContextScope(HookContext* context)
    : context_(context), source_(hook_source()), below_(this_thread().hook_scope) {
  if (source_ != nullptr) source_->enter();  // before linking: a throw leaves nothing behind
  ThreadState& thread = this_thread();
  thread.hook_scope = this;
  thread.hook_context = context;
}

HookContextScope::~HookContextScope() {
  ThreadState& thread = this_thread();
  if (!unlink_from_stack(thread.hook_scope, this, [](HookContextScope& s) -> HookContextScope*& { return s.below_; })) {
    fatal_misuse(
        "a saved-tensor hook context (a checkpoint's forward, a recomputation or a SavedTensorMeter) ended on "
        "another thread than the one it started on; stop a SavedTensorMeter on the thread that made it");
  }
  thread.hook_context = thread.hook_scope != nullptr ? thread.hook_scope->context_ : nullptr;
  if (source_ != nullptr) source_->leave();
}

bool HookContextScope::on_this_thread() const noexcept {
  for (const HookContextScope* s = this_thread().hook_scope; s != nullptr; s = s->below_) {
    if (s == this) return true;
  }
  return false;
}

}  // namespace prefire::detail
