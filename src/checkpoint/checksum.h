#pragma once

// Checksums of saved tensors for determinism_check = checksum. The value is
// defined in kernels/checksum_hash.h; the CPU loop and the CUDA kernel give
// the same value for the same bytes.

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>

namespace prefire::detail {

/// Checksum of `nbytes` host bytes.
uint64_t bytes_checksum(const void* data, size_t nbytes);

/// Checksum of the bytes of `t` in its logical element order (the bytes of
/// t.contiguous()). A CUDA tensor is hashed by the kernel on the current
/// stream, and the call waits for the result.
uint64_t tensor_checksum(const at::Tensor& t);

}  // namespace prefire::detail
