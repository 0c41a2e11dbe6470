#include "device.h"

#if PREFIRE_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace prefire_bench {

void synchronize(const at::Device& device) {
#if PREFIRE_WITH_CUDA
  if (device.is_cuda()) c10::cuda::device_synchronize();
#endif
}

void reset_peaks(const at::Device& device) {
#if PREFIRE_WITH_CUDA
  if (device.is_cuda()) {
    synchronize(device);
    c10::cuda::CUDACachingAllocator::emptyCache();
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index() < 0 ? 0 : device.index());
  }
#endif
}

int64_t device_peak_reserved_bytes(const at::Device& device) {
#if PREFIRE_WITH_CUDA
  if (device.is_cuda()) {
    synchronize(device);
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
    return stats.reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
  }
#endif
  return -1;
}

}  // namespace prefire_bench
