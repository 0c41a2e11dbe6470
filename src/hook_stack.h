#pragma once

// The thread-local stack of hook contexts that receives every tensor autograd
// saves while a checkpoint runs, independent of how the hooks reach prefire
// (today: the engine subclass in engine.cpp; later: Python's default hooks).
//
// Note [One stack of hook contexts]
// Forward frames (a checkpoint's forward run) and recompute captures (a
// frame's recomputation) share ONE stack, and the innermost entry receives the
// saved tensor. While an outer frame recomputes, an inner checkpoint inside it
// creates a new frame whose saves must go to that inner frame; once the inner
// forward returns, the outer capture receives the saves again. Asking "am I
// recomputing?" before "am I inside a forward frame?" gets this wrong and hands
// a backward node a tensor of another slot.

#include <ATen/core/Tensor.h>

#include <memory>

namespace prefire::detail {

/// A saved tensor as prefire keeps it: what a pack produced and the matching
/// unpack consumes. Destroyed when autograd releases the saved tensor.
class PackedTensor {
 public:
  virtual ~PackedTensor() = default;
  virtual at::Tensor unpack() = 0;
};

/// An entry of the stack: decides what happens to a tensor autograd saves.
class HookContext {
 public:
  virtual std::unique_ptr<PackedTensor> pack(const at::Tensor& tensor) = 0;

 protected:
  ~HookContext() = default;
};

/// The innermost context of this thread, or nullptr when no checkpoint runs.
/// This is the whole cost prefire adds to a saved tensor outside checkpoints.
HookContext* current_hook_context() noexcept;

/// Pushes `context` for the lifetime of the scope. Scopes normally leave in
/// LIFO order; one that leaves early is unlinked where it is (see Note
/// [Scopes that leave out of order] in thread_stack.h). Leaving on another
/// thread than the one that entered is a fatal misuse.
class HookContextScope {
 public:
  explicit HookContextScope(HookContext* context) noexcept;
  ~HookContextScope();
  HookContextScope(const HookContextScope&) = delete;
  HookContextScope& operator=(const HookContextScope&) = delete;

  /// Whether this scope is on the calling thread's stack.
  bool on_this_thread() const noexcept;

 private:
  HookContext* context_;
  HookContextScope* below_;
};

}  // namespace prefire::detail
