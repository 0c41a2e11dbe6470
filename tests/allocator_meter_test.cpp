// The allocator meter (allocator_meter.h) on the CPU: it counts every storage
// ATen's CPU allocator hands out, whoever asks (autograd, an unchecked
// forward prefire's census never sees), hands out aligned memory that the
// raw interface can free, and keeps a peak window.
//
// Not covered here: CUDA (cuda_test.cpp), the meter before
// count_cpu_allocations() (it is installed for the whole process, by the
// first test that needs it).

#include "test_support.h"

#include <c10/core/CPUAllocator.h>

#include <cstdint>

namespace prefire::testing {
namespace {

const c10::Device kCpu(c10::DeviceType::CPU);

TEST(AllocatorMeter, CountsEveryCpuStorageWhileItLivesAndKeepsThePeak) {
  count_cpu_allocations();
  count_cpu_allocations();  // idempotent
  reset_allocator_peak(kCpu);
  const AllocatorBytes before = allocator_bytes(kCpu);
  EXPECT_EQ(before.peak, before.current);
  {
    auto a = at::empty({1000}, at::kFloat);
    EXPECT_EQ(allocator_bytes(kCpu).current - before.current, 4000);
    auto b = at::empty({10}, at::kDouble);
    EXPECT_EQ(allocator_bytes(kCpu).current - before.current, 4080);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data_ptr()) % 64, 0u);  // the CPU allocator's alignment
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data_ptr()) % 64, 0u);
  }
  const AllocatorBytes after = allocator_bytes(kCpu);
  EXPECT_EQ(after.current, before.current);
  EXPECT_EQ(after.peak - before.current, 4080);
  reset_allocator_peak(kCpu);
  EXPECT_EQ(allocator_bytes(kCpu).peak, after.current);
}

TEST(AllocatorMeter, TheRawInterfaceAllocatesAndFreesThroughIt) {
  count_cpu_allocations();
  c10::Allocator* allocator = c10::GetCPUAllocator();
  ASSERT_NE(allocator->raw_deleter(), nullptr);
  const int64_t before = allocator_bytes(kCpu).current;
  void* p = allocator->raw_allocate(100);
  EXPECT_EQ(allocator_bytes(kCpu).current - before, 100);
  allocator->raw_deallocate(p);
  EXPECT_EQ(allocator_bytes(kCpu).current, before);
  void* empty = allocator->raw_allocate(0);  // what oneDNN asks for and frees through the raw interface
  allocator->raw_deallocate(empty);
  EXPECT_EQ(allocator_bytes(kCpu).current, before);
  auto gelu = at::gelu(at::randn({2, 4}));  // a oneDNN kernel on the CPU
  EXPECT_TRUE(gelu.defined());
}

TEST(AllocatorMeter, SeesAnUncheckedForwardsActivationsThatPrefiresCensusDoesNot) {
  count_cpu_allocations();
  Stage stage(2, 0.0);
  at::manual_seed(1);
  auto x = at::randn({2, 5, 16}).requires_grad_(true);
  reset_allocator_peak(kCpu);
  const int64_t before = allocator_bytes(kCpu).current;
  const int64_t held = runtime_stats().held_bytes;
  auto y = stage.forward(x, /*checkpointed=*/false);
  const int64_t kept = allocator_bytes(kCpu).current - before;  // the saved activations and y
  EXPECT_EQ(runtime_stats().held_bytes, held);  // no checkpoint, no meter: the census sees nothing
  EXPECT_GT(kept, y.nbytes());
  auto y_checked = stage.forward(x, /*checkpointed=*/true);
  const int64_t kept_checked = allocator_bytes(kCpu).current - before - kept;
  EXPECT_LT(kept_checked, kept / 2);  // checkpointed blocks keep their inputs, not their activations
  y.reset();
  y_checked.reset();
  EXPECT_EQ(allocator_bytes(kCpu).current, before);  // every storage the forwards made is gone with their graphs
}

}  // namespace
}  // namespace prefire::testing
