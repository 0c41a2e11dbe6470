#pragma once

// What a binding of prefire needs of its internals to hand it saved tensors
// (the Python package's extension module: Note [Hooks in a Python process]
// in python/src/module.cpp), named here so that it includes no header of
// src/. Not an API for programs: prefire.h does not include it, and it may
// change with any release.

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace prefire::detail {

/// A saved tensor as prefire keeps it: what a pack produced and the matching
/// unpack consumes. Destroyed when autograd releases the saved tensor.
class PackedTensor {
 public:
  virtual ~PackedTensor() = default;
  virtual at::Tensor unpack() = 0;
};

/// Thrown by a recomputation's pack to end it early (Note [Early stop] in
/// checkpoint/frame.cpp). Not a std::exception, so that user code catching
/// those lets it through; a hook source that crosses other frames carries it
/// across.
struct StopRecompute {};

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

/// Where saved tensors come from when no engine of prefire's hands them over:
/// told when a context scope starts and ends on the calling thread, so that
/// it routes saves to current_hook_context() while any scope is open.
class HookSource {
 public:
  virtual void enter() = 0;
  virtual void leave() noexcept = 0;

 protected:
  ~HookSource() = default;
};

/// Installs `source` process-wide (nullptr: none). For the Python package;
/// set once, before the first checkpoint.
void set_hook_source(HookSource* source) noexcept;
/// The installed source, or nullptr.
HookSource* hook_source() noexcept;

/// Counts `tensors` in the SavedTensorMeter this thread's saves go to now
/// (its census, and RuntimeStats::held_bytes) as if autograd had saved them,
/// until the returned tensors are destroyed. Nothing is counted (the result
/// is empty) where the innermost hook context is not a meter: none, or a
/// checkpoint's forward or recomputation, whose saves are its own. Memory a
/// checkpoint keeps outside autograd, counted where its saved tensors would
/// be: Note [Selective checkpointing inside prefire] in
/// python/prefire/_checkpoint.py, the one user.
std::vector<std::unique_ptr<PackedTensor>> count_in_meter(const std::vector<at::Tensor>& tensors);

}  // namespace prefire::detail
