#include "cuda/device_allocator.h"

#if PREFIRE_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <stdexcept>

namespace prefire::detail {

#if PREFIRE_WITH_CUDA

namespace {
c10::DeviceIndex resolve(c10::DeviceIndex index) { return index < 0 ? c10::cuda::current_device() : index; }
}  // namespace

std::pair<int64_t, int64_t> cuda_allocated_bytes(c10::DeviceIndex index) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(resolve(index));
  const auto& stat = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
  return {stat.current, stat.peak};
}

void cuda_reset_peak(c10::DeviceIndex index) { c10::cuda::CUDACachingAllocator::resetPeakStats(resolve(index)); }

#else  // !PREFIRE_WITH_CUDA

std::pair<int64_t, int64_t> cuda_allocated_bytes(c10::DeviceIndex) {
  throw std::runtime_error("prefire::allocator_bytes: prefire was built without CUDA");
}

void cuda_reset_peak(c10::DeviceIndex) {
  throw std::runtime_error("prefire::reset_allocator_peak: prefire was built without CUDA");
}

#endif

}  // namespace prefire::detail
