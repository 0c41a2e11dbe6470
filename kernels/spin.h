#pragma once

// A kernel that occupies one SM for a given number of clock cycles: a
// stand-in for an idle window on a stream (a pipeline receive, a collective)
// in the overlap benchmark.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace prefire::kernels {

/// Enqueues one single-thread block on `stream` that spins for `cycles` SM
/// clock cycles. Returns the launch status.
cudaError_t launch_spin(int64_t cycles, cudaStream_t stream);

}  // namespace prefire::kernels
