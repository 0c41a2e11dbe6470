#include "device.h"

#include <fstream>
#include <string>

#include <malloc.h>

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
  // Hand freed heap back to the kernel first, so the mode before does not set
  // this one's peak; then "5" resets VmHWM to the current RSS (Linux >= 4.0).
  malloc_trim(0);
  std::ofstream("/proc/self/clear_refs") << "5";
}

namespace {
// The allocator's peak of one statistic (allocated or reserved), -1 on CPU.
enum class Peak { kAllocated, kReserved };
int64_t allocator_peak(const at::Device& device, Peak which) {
#if PREFIRE_WITH_CUDA
  if (device.is_cuda()) {
    synchronize(device);
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
    const auto& stat = which == Peak::kAllocated ? stats.allocated_bytes : stats.reserved_bytes;
    return stat[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
  }
#endif
  return -1;
}
}  // namespace

int64_t device_peak_bytes(const at::Device& device) { return allocator_peak(device, Peak::kAllocated); }

int64_t device_peak_reserved_bytes(const at::Device& device) { return allocator_peak(device, Peak::kReserved); }

int64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "VmHWM:") {
      int64_t kib = -1;
      status >> kib;
      return kib < 0 ? -1 : kib * 1024;
    }
    std::getline(status, key);
  }
  return -1;
}

}  // namespace prefire_bench
