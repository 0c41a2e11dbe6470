#include "hook_stack.h"

#include "thread_stack.h"

#include <atomic>

namespace prefire::detail {
namespace {
// The stack is intrusive: each scope links to the scope below it.
thread_local HookContextScope* tls_top = nullptr;
// The innermost context, cached for the query every saved tensor makes.
thread_local HookContext* tls_top_context = nullptr;
}  // namespace

HookContext* current_hook_context() noexcept { return tls_top_context; }

namespace {
std::atomic<HookSource*> g_source{nullptr};
}

void set_hook_source(HookSource* source) noexcept { g_source.store(source, std::memory_order_release); }
HookSource* hook_source() noexcept { return g_source.load(std::memory_order_acquire); }

HookContextScope::HookContextScope(HookContext* context)
    : context_(context), source_(hook_source()), below_(tls_top) {
  if (source_ != nullptr) source_->enter();  // before linking: a throw leaves nothing behind
  tls_top = this;
  tls_top_context = context;
}

HookContextScope::~HookContextScope() {
  if (!unlink_from_stack(tls_top, this, [](HookContextScope& s) -> HookContextScope*& { return s.below_; })) {
    fatal_misuse(
        "a saved-tensor hook context (a checkpoint's forward, a recomputation or a SavedTensorMeter) ended on "
        "another thread than the one it started on; stop a SavedTensorMeter on the thread that made it");
  }
  tls_top_context = tls_top != nullptr ? tls_top->context_ : nullptr;
  if (source_ != nullptr) source_->leave();
}

bool HookContextScope::on_this_thread() const noexcept {
  for (const HookContextScope* s = tls_top; s != nullptr; s = s->below_) {
    if (s == this) return true;
  }
  return false;
}

}  // namespace prefire::detail
