#include "hook_stack.h"

#include <c10/util/Exception.h>

namespace prefire::detail {
namespace {
// The stack is intrusive: each scope remembers the entry below it.
thread_local HookContext* tls_top = nullptr;
}  // namespace

HookContext* current_hook_context() noexcept { return tls_top; }

HookContextScope::HookContextScope(HookContext* context) noexcept
    : previous_(tls_top), context_(context) {
  tls_top = context;
}

HookContextScope::~HookContextScope() {
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(tls_top == context_, "hook contexts popped out of order");
  tls_top = previous_;
}

}  // namespace prefire::detail
