#pragma once

// The few device facts prefire-bench reports, on CPU and (when built with
// CUDA) on a GPU.

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace prefire_bench {

/// Waits for the device's queued work (no-op on CPU).
void synchronize(const at::Device& device);
/// Starts a new allocator peak window (CUDA) or resets the process's peak RSS
/// (CPU, where the kernel allows it).
void reset_peaks(const at::Device& device);
/// CUDA: the allocator's peak allocated bytes since reset_peaks; CPU: -1.
int64_t device_peak_bytes(const at::Device& device);
/// CUDA: the allocator's peak reserved bytes since reset_peaks (which empties
/// its cache first, so each mode starts from nothing cached); CPU: -1.
int64_t device_peak_reserved_bytes(const at::Device& device);
/// The process's peak resident set size since reset_peaks (VmHWM), or -1.
int64_t peak_rss_bytes();

}  // namespace prefire_bench
