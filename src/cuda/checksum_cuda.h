#pragma once

// The CUDA half of tensor_checksum (checkpoint/checksum.h).

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace prefire::detail {

/// The checksum of a contiguous CUDA tensor's bytes, by the kernel on the
/// current stream of its device; waits for the result. Raises when prefire
/// was built without CUDA.
uint64_t cuda_tensor_checksum(const at::Tensor& contiguous);

}  // namespace prefire::detail
