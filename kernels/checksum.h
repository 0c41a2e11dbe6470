#pragma once

// Launcher for the checksum kernel (checksum_hash.h defines the value).
// Plain CUDA runtime types only: no torch headers on either side.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace prefire::kernels {

/// Adds the word terms of `nbytes` bytes at device address `data` into
/// `*sum_out` (device memory, 8 bytes), which the launcher zeroes first; all of
/// it enqueued on `stream`. The caller copies the sum back and applies
/// finalize_checksum(sum, nbytes). Returns the launch status.
cudaError_t launch_checksum(const void* data, size_t nbytes, unsigned long long* sum_out, cudaStream_t stream);

}  // namespace prefire::kernels
