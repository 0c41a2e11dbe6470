#pragma once

// The CUDA caching allocator's statistics, for prefire::allocator_bytes()
// (memory/allocator_meter.cpp): c10 only, and a build without CUDA gets
// functions that say so.

#include <c10/core/Device.h>

#include <cstdint>
#include <utility>

namespace prefire::detail {

/// (current, peak) allocated bytes of CUDA device `index` (-1: the current
/// device). std::runtime_error without CUDA.
std::pair<int64_t, int64_t> cuda_allocated_bytes(c10::DeviceIndex index);
/// Resets the caching allocator's peak statistics of device `index`.
void cuda_reset_peak(c10::DeviceIndex index);

}  // namespace prefire::detail
