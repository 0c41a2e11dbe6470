// Note [Counting the CPU allocator]
// CUDA's caching allocator keeps statistics of its own; ATen's CPU allocator
// keeps none that a program can read (its ProfiledCPUMemoryReporter counts
// only for the profiler). So count_cpu_allocations() installs an allocator
// that forwards to the one in use and counts: each block it hands out has a
// 64-byte header in front (the CPU allocator's alignment, so the tensor's
// data stays aligned) that holds the requested size, and the deleter, which
// gets only the data pointer, reads it back, subtracts it and gives the
// whole block to the inner allocator. Data and context are the same pointer,
// so the allocator offers the raw interface and its data pointers are
// "simple" as the default allocator's are (code that checks either keeps
// working). Installed once, at the highest priority, never removed: a block
// it allocated may be freed at any time, even at exit, so it and the
// counters are never destroyed. A zero-byte request gets a null pointer, as
// from the default allocator (oneDNN frees those through the raw interface
// too). Blocks allocated before it are freed by their own deleters and never
// touch the counters.

#include <prefire/allocator_meter.h>

#include "cuda/device_allocator.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <stdexcept>

namespace prefire {
namespace detail {
namespace {

constexpr size_t kHeader = 64;  // bytes: c10's CPU alignment; holds the requested size

struct Counters {
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};

  void add(int64_t bytes) noexcept {
    const int64_t now = current.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    int64_t seen = peak.load(std::memory_order_relaxed);
    while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
  }
  void sub(int64_t bytes) noexcept { current.fetch_sub(bytes, std::memory_order_relaxed); }
};

Counters& counters() {
  static auto* c = new Counters();  // never destroyed: blocks are freed during exit too
  return *c;
}

c10::Allocator* g_inner = nullptr;  // written once, before the counting allocator is installed

void delete_counted(void* data) noexcept {
  if (data == nullptr) return;  // a zero-byte block
  char* base = static_cast<char*>(data) - kHeader;
  size_t bytes = 0;
  std::memcpy(&bytes, base, sizeof(bytes));
  counters().sub(static_cast<int64_t>(bytes));
  g_inner->raw_deallocate(base);
}

class CountingCPUAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return {nullptr, nullptr, &delete_counted, c10::Device(c10::DeviceType::CPU)};
    char* base = static_cast<char*>(g_inner->raw_allocate(n + kHeader));
    std::memcpy(base, &n, sizeof(n));
    counters().add(static_cast<int64_t>(n));
    void* data = base + kHeader;
    return {data, data, &delete_counted, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_counted; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

std::once_flag g_installed;
std::atomic<bool> g_counting{false};

}  // namespace
}  // namespace detail

void count_cpu_allocations() {
  std::call_once(detail::g_installed, [] {
    c10::Allocator* inner = c10::GetCPUAllocator();
    if (inner->raw_deleter() == nullptr) {
      throw std::runtime_error("prefire::count_cpu_allocations: the CPU allocator in use has no raw interface to "
                               "forward to; its allocations cannot be counted");
    }
    detail::g_inner = inner;
    static auto* counting = new detail::CountingCPUAllocator();  // never destroyed; see the Note
    c10::SetCPUAllocator(counting, /*priority=*/UINT8_MAX);
    if (c10::GetCPUAllocator() != counting) {
      throw std::runtime_error("prefire::count_cpu_allocations: ATen kept another CPU allocator");
    }
    detail::g_counting.store(true, std::memory_order_release);
  });
}

AllocatorBytes allocator_bytes(c10::Device device) {
  if (device.is_cuda()) {
    auto [current, peak] = detail::cuda_allocated_bytes(device.index());
    return {current, peak};
  }
  if (!device.is_cpu()) {
    throw std::invalid_argument("prefire::allocator_bytes: CPU or CUDA devices only, got " + device.str());
  }
  if (!detail::g_counting.load(std::memory_order_acquire)) {
    throw std::logic_error("prefire::allocator_bytes: the CPU allocator is not counted; call "
                           "count_cpu_allocations() first, before the model is built");
  }
  auto& c = detail::counters();
  return {c.current.load(std::memory_order_relaxed), c.peak.load(std::memory_order_relaxed)};
}

void reset_allocator_peak(c10::Device device) {
  if (device.is_cuda()) {
    detail::cuda_reset_peak(device.index());
    return;
  }
  auto& c = detail::counters();
  c.peak.store(c.current.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

}  // namespace prefire
