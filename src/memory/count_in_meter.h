#pragma once

// Memory a checkpoint keeps outside autograd, counted where its saved
// tensors would be. See Note [Selective checkpointing inside prefire] in
// python/prefire/_checkpoint.py, the one user.

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace prefire::detail {

class PackedTensor;  // hooks/hook_stack.h

/// Counts `tensors` in the SavedTensorMeter this thread's saves go to now
/// (its census, and RuntimeStats::held_bytes) as if autograd had saved them,
/// until the returned tensors are destroyed. Nothing is counted (the result
/// is empty) where the innermost hook context is not a meter: none, or a
/// checkpoint's forward or recomputation, whose saves are its own.
std::vector<std::unique_ptr<PackedTensor>> count_in_meter(const std::vector<at::Tensor>& tensors);

}  // namespace prefire::detail
