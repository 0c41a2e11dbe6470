#pragma once

// The few device facts prefire-bench reports, on CPU and (when built with
// CUDA) on a GPU. Live bytes come from prefire::allocator_bytes() (every
// allocation, on either device).

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace prefire_bench {

/// Waits for the device's queued work (no-op on CPU).
void synchronize(const at::Device& device);
/// CUDA: empties the caching allocator's cache and starts new peak windows,
/// so each mode starts from nothing cached. No-op on CPU.
void reset_peaks(const at::Device& device);
/// CUDA: the caching allocator's peak reserved bytes since the last peak
/// reset (reset_peaks, prefire::reset_allocator_peak); CPU: -1.
int64_t device_peak_reserved_bytes(const at::Device& device);

}  // namespace prefire_bench
