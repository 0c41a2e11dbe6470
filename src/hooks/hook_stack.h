#pragma once

// The thread-local stack of hook contexts that receives every tensor autograd
// saves while a checkpoint runs, independent of how the hooks reach prefire
// (in C++ programs: the engine subclass in autograd_engine.cpp; in Python processes:
// torch's default saved-tensor hooks, pushed by a HookSource, see Note
// [Hooks in a Python process] in python/src/module.cpp).
//
// Note [One stack of hook contexts]
// Forward frames (a checkpoint's forward run) and recompute captures (a
// frame's recomputation) share ONE stack, and the innermost entry receives the
// saved tensor. While an outer frame recomputes, an inner checkpoint inside it
// creates a new frame whose saves must go to that inner frame; once the inner
// forward returns, the outer capture receives the saves again. Asking "am I
// recomputing?" before "am I inside a forward frame?" gets this wrong and hands
// a backward node a tensor of another slot.

#include <prefire/detail/hooks.h>

#include <ATen/core/Tensor.h>

#include <memory>

namespace prefire::detail {

// PackedTensor, StopRecompute, HookContext, current_hook_context(), HookSource
// and set_hook_source(): prefire/detail/hooks.h (what the Python binding needs).

/// A saved tensor kept as it is (a recomputation's own graph's; a parameter
/// among an offloaded checkpoint's inputs).
class KeptTensor final : public PackedTensor {
 public:
  explicit KeptTensor(at::Tensor t) : tensor_(std::move(t)) {}
  at::Tensor unpack() override { return tensor_; }

 private:
  at::Tensor tensor_;
};

/// Pushes `context` for the lifetime of the scope. Scopes normally leave in
/// LIFO order; one that leaves early is unlinked where it is (see Note
/// [Scopes that leave out of order] in thread_stack.h). Leaving on another
/// thread than the one that entered is a fatal misuse. With a HookSource
/// installed, the scope enters it first (which may throw) and leaves it last.
class HookContextScope {
 public:
  explicit HookContextScope(HookContext* context);
  ~HookContextScope();
  HookContextScope(const HookContextScope&) = delete;
  HookContextScope& operator=(const HookContextScope&) = delete;

  /// Whether this scope is on the calling thread's stack.
  bool on_this_thread() const noexcept;

 private:
  HookContext* context_;
  HookSource* source_;
  HookContextScope* below_;
};

}  // namespace prefire::detail
