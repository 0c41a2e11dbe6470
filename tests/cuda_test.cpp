// The CUDA runtime on a real GPU: prefire on the prefire stream (prefire's
// own, not one of c10's pool streams) with event handoff, Philox state
// restore (dropout masks), CUDA autocast restore and the cast cache left
// alone, the session buffer pool (pool bytes in the session stats, its memory
// given back by empty_cache() once every session is cleared, no library
// workspace made inside a thread's first window), reserved memory
// stable after warm-up, and the checksum kernel against the CPU loop. Every test
// skips without a GPU (GTEST_SKIP), and the file compiles to skips alone in a
// build without CUDA.
//
// Not covered here: multi-GPU prefire (one device per prefire by design),
// timing (benchmarks/overlap_benchmark.cpp).

#include "test_support.h"

#if PREFIRE_WITH_CUDA
#include "checkpoint/checksum.h"

#include <prefire/cuda_stream.h>

#include <ATen/autocast_mode.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace prefire::testing {
namespace {

#if PREFIRE_WITH_CUDA

constexpr int64_t kDim = 64;
const c10::Device kCuda(c10::kCUDA, 0);

/// A stage of blocks moved to the GPU; the parameters stay leaves.
struct CudaStage {
  std::vector<Block> blocks;
  explicit CudaStage(int layers, double dropout) {
    for (int i = 0; i < layers; ++i) blocks.push_back(std::move(Block(kDim, dropout).to(kCuda)));
  }
  TensorList params() const {
    TensorList all;
    for (const auto& b : blocks) all = concat(all, b.params());
    return all;
  }
  at::Tensor forward(at::Tensor x, bool checkpointed, CheckpointFn wrap = nullptr) const {
    for (const auto& b : blocks) x = checkpointed ? checkpoint(wrap ? wrap : b.fn(), {x})[0] : b.forward(x);
    return x;
  }
};

int64_t reserved_bytes() {
  c10::cuda::getCurrentCUDAStream().synchronize();
  prefire_stream(0).synchronize();
  auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
  return stats.reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
}

struct SplitResult {
  TensorList dx, dw;
};

SplitResult split_backward(const at::Tensor& x, const at::Tensor& y, const at::Tensor& gy, const TensorList& params,
                           std::optional<SessionId> session) {
  SplitResult r;
  {
    std::optional<SessionScope> scope;
    if (session) scope.emplace(*session, SessionOptions{true});
    r.dx = torch::autograd::grad({y}, {x}, {gy}, true);
  }
  {
    std::optional<SessionScope> scope;
    if (session) scope.emplace(*session, SessionOptions{false});
    r.dw = torch::autograd::grad({y}, params, {gy});
  }
  return r;
}

TEST(Cuda, PrefireOnSideStreamMatchesUncheckedAndRecomputesOnce) {
  PREFIRE_REQUIRE_GPU();
  at::manual_seed(1);
  CudaStage stage(3, 0.1);
  auto x = at::randn({4, 32, kDim}, kCuda).requires_grad_(true);
  auto gy = at::randn({4, 32, kDim}, kCuda);
  at::manual_seed(2);
  auto ref = split_backward(x, stage.forward(x, false), gy, stage.params(), std::nullopt);

  at::manual_seed(2);
  HandleCollector collect;
  auto y = stage.forward(x, true);
  at::rand({1 << 20}, kCuda);  // other Philox work between forward and prefire
  int64_t before = runtime_stats().recomputations;
  PoolSetting pool(true);
  for (const auto& h : collect.handles()) ASSERT_EQ(prefire(h, 100), PrefireStatus::kRecomputed);
  EXPECT_GT(session_stats(100).pool_bytes, 0) << "prefire allocations did not land in the session pool";
  auto got = split_backward(x, y, gy, stage.params(), 100);
  EXPECT_EQ(runtime_stats().recomputations - before, 3);
  expect_all_close(got.dx, ref.dx);
  expect_all_close(got.dw, ref.dw);
  clear_session(100);
}

TEST(Cuda, PrefireRunsOnTheDedicatedStreamAndLazyOnTheBackwardStream) {
  PREFIRE_REQUIRE_GPU();
  CudaStage stage(1, 0.0);
  std::vector<c10::cuda::CUDAStream> streams;
  CheckpointFn fn = [&](const TensorList& in) {
    streams.push_back(c10::cuda::getCurrentCUDAStream());
    return TensorList{stage.blocks[0].forward(in[0])};
  };
  auto x = at::randn({2, 8, kDim}, kCuda).requires_grad_(true);
  HandleCollector collect;
  auto y = checkpoint(fn, {x})[0];  // forward: streams[0]
  prefire(collect.handles().at(0), 101);  // streams[1]
  ASSERT_EQ(streams.size(), 2u);
  EXPECT_NE(streams[1], streams[0]) << "prefire ran on the caller's stream";
  EXPECT_EQ(streams[1], prefire_stream(0)) << "prefire ran on another stream than prefire_stream()";
  { SessionScope s(101, {false}); torch::autograd::grad({y.sum()}, {x}); }
  clear_session(101);

  auto y2 = checkpoint(fn, {x})[0];  // streams[2]
  torch::autograd::grad({y2.sum()}, {x});  // lazy: streams[3]
  ASSERT_EQ(streams.size(), 4u);
  EXPECT_EQ(streams[3], c10::cuda::getCurrentCUDAStream()) << "lazy recompute left the backward's stream";
}

TEST(Cuda, DropoutMasksIdenticalAfterOtherRngWorkAndCallerStateRestored) {
  PREFIRE_REQUIRE_GPU();
  auto x = at::randn({64, 256}, kCuda).requires_grad_(true);
  CheckpointFn fn = [](const TensorList& in) { return TensorList{at::dropout(in[0], 0.5, true).sin()}; };
  at::manual_seed(3);
  auto expected = torch::autograd::grad({fn({x})[0].sum()}, {x})[0];
  at::manual_seed(3);
  HandleCollector collect;
  auto y = checkpoint(fn, {x})[0];
  at::rand({12345}, kCuda);
  auto gen = at::globalContext().defaultGenerator(kCuda);
  at::Tensor before;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    before = gen.get_state();
  }
  prefire(collect.handles().at(0), 102);
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    EXPECT_TRUE(at::equal(gen.get_state(), before)) << "prefire left the forward's Philox seed/offset behind";
  }
  TensorList g;
  { SessionScope s(102, {false}); g = torch::autograd::grad({y.sum()}, {x}); }
  EXPECT_TRUE(at::equal(g[0], expected));
  clear_session(102);
}

TEST(Cuda, Bf16AutocastRestoredWhenPrefireRunsOutsideAutocast) {
  PREFIRE_REQUIRE_GPU();
  auto x = at::randn({16, 64}, kCuda).requires_grad_(true);
  auto w = at::randn({64, 64}, kCuda).requires_grad_(true);
  CheckpointFn fn = [&](const TensorList& in) { return TensorList{at::linear(in[0], w).relu()}; };
  auto set_autocast = [](bool on) {
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCUDA, on);
    if (!on) at::autocast::clear_cache();
  };
  set_autocast(true);
  auto y_ref = fn({x})[0];
  HandleCollector collect;
  auto y = checkpoint(fn, {x})[0];
  set_autocast(false);
  ASSERT_EQ(y.scalar_type(), at::kBFloat16);
  auto expected = torch::autograd::grad({y_ref.to(at::kFloat).sum()}, {x, w});
  // Outside autocast: recomputed in float32 the metadata check would raise.
  prefire(collect.handles().at(0), 103);
  TensorList g;
  { SessionScope s(103, {false}); g = torch::autograd::grad({y.to(at::kFloat).sum()}, {x, w}); }
  expect_all_close(g, expected, 1e-3, 1e-3);
  clear_session(103);
}

TEST(Cuda, PrefireStreamIsPrefiresOwnNotOneOfC10sPoolStreams) {
  PREFIRE_REQUIRE_GPU();
  auto mine = prefire_stream(0);
  EXPECT_EQ(mine, prefire_stream(0)) << "one prefire stream per device";
  EXPECT_NE(mine, c10::cuda::getDefaultCUDAStream(0));
  for (bool high : {false, true}) {
    for (int i = 0; i < 64; ++i) {  // twice round every pool of 32
      EXPECT_NE(c10::cuda::getStreamFromPool(high, 0), mine) << "the prefire stream is shared with c10's pool";
    }
  }
}

TEST(Cuda, ReservedMemoryStableAfterWarmup) {
  PREFIRE_REQUIRE_GPU();
  for (bool pool_on : {false, true}) {
    SCOPED_TRACE(pool_on ? "session pool on" : "session pool off");
    c10::cuda::CUDACachingAllocator::emptyCache();  // earlier tests' released pools
    PoolSetting pool(pool_on);
    CudaStage stage(4, 0.1);
    auto x = at::randn({8, 64, kDim}, kCuda).requires_grad_(true);
    auto gy = at::randn({8, 64, kDim}, kCuda);
    // Session 105 stays open across iterations (a micro-batch in flight over
    // the step boundary), so with the pool on one pool serves every step.
    HandleCollector carried;
    auto y_carried = stage.forward(x, true);
    for (const auto& h : carried.handles()) prefire(h, 105);
    int64_t after_warmup = 0;
    for (int iteration = 1; iteration <= 12; ++iteration) {
      HandleCollector collect;
      auto y = stage.forward(x, true);
      for (const auto& h : collect.handles()) prefire(h, 104);
      split_backward(x, y, gy, stage.params(), 104);
      clear_session(104);
      if (iteration == 3) after_warmup = reserved_bytes();
    }
    EXPECT_EQ(reserved_bytes(), after_warmup) << "reserved memory grew after warm-up";
    EXPECT_EQ(session_pool_reserved_bytes() > 0, pool_on);
    EXPECT_EQ(session_stats(105).pool_bytes > 0, pool_on);
    clear_session(105);
  }
}

TEST(Cuda, SessionPoolMemoryReturnsOnEmptyCacheOnceEverySessionIsCleared) {
  PREFIRE_REQUIRE_GPU();
  CudaStage stage(3, 0.1);
  auto x = at::randn({8, 64, kDim}, kCuda).requires_grad_(true);
  auto gy = at::randn({8, 64, kDim}, kCuda);
  auto forward_and_prefire = [&](SessionId id) {
    HandleCollector collect;
    auto y = stage.forward(x, true);
    for (const auto& h : collect.handles()) prefire(h, id);
    if (session_pool_enabled()) EXPECT_GT(session_stats(id).pool_bytes, 0) << "session " << id;
    return y;
  };
  // What lives for the process first: cuBLAS workspaces of every thread and
  // stream this test uses (the backward runs on autograd's device thread).
  split_backward(x, forward_and_prefire(109), gy, stage.params(), 109);
  clear_session(109);
  c10::cuda::CUDACachingAllocator::emptyCache();
  const int64_t baseline = reserved_bytes();
  {
    PoolSetting pool(true);
    split_backward(x, forward_and_prefire(106), gy, stage.params(), 106);
    auto y107 = forward_and_prefire(107);  // its backward comes after session 106 is cleared
    clear_session(106);
    c10::cuda::CUDACachingAllocator::emptyCache();
    EXPECT_GT(session_pool_reserved_bytes(), 0) << "session 107's prefired tensors lost their pool";
    split_backward(x, y107, gy, stage.params(), 107);
    clear_session(107);
  }
  c10::cuda::CUDACachingAllocator::emptyCache();
  EXPECT_EQ(session_pool_reserved_bytes(), 0) << "empty_cache() did not give the session pool back";
  EXPECT_EQ(reserved_bytes(), baseline);
}

// cuBLAS and cuBLASLt keep a workspace per (thread's handle, stream) for the
// life of the process. A new thread gets new handles, so its first prefire
// with the pool on is where they would be made inside a window and pin the
// pool (a GPU run once found 2 MiB left there, docs/benchmarks.md).
TEST(Cuda, NewThreadsFirstPoolWindowLeavesNoLibraryWorkspaceInThePool) {
  PREFIRE_REQUIRE_GPU();
  CudaStage stage(2, 0.0);
  auto x = at::randn({8, 64, kDim}, kCuda).requires_grad_(true);
  auto gy = at::randn({8, 64, kDim}, kCuda);
  c10::cuda::CUDACachingAllocator::emptyCache();
  ASSERT_EQ(session_pool_reserved_bytes(), 0) << "an earlier test left memory in a session pool";
  std::thread worker([&] {
    PoolSetting pool(true);
    HandleCollector collect;
    auto y = stage.forward(x, true);  // linear layers with a bias: addmm
    for (const auto& h : collect.handles()) prefire(h, 110);
    EXPECT_GT(session_stats(110).pool_bytes, 0);
    split_backward(x, y, gy, stage.params(), 110);
    clear_session(110);
  });
  worker.join();
  c10::cuda::CUDACachingAllocator::emptyCache();
  EXPECT_EQ(session_pool_reserved_bytes(), 0) << "the thread's first window left memory in the session pool";
}

TEST(Cuda, AutocastRecomputationNeitherReadsNorClearsTheCastCache) {
  PREFIRE_REQUIRE_GPU();
  auto x = at::randn({16, 64}, kCuda).requires_grad_(true);
  auto w = at::randn({64, 64}, kCuda).requires_grad_(true);
  int calls = 0;
  at::Tensor cast_in_recompute;
  CheckpointFn fn = [&](const TensorList& in) {
    if (++calls == 2) cast_in_recompute = at::autocast::cached_cast(at::kBFloat16, w, at::kCUDA);
    return TensorList{at::linear(in[0], w).relu()};
  };
  at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
  at::autocast::set_autocast_enabled(at::kCUDA, true);
  at::autocast::increment_nesting();  // this thread's region, open across the prefire
  auto cached = at::autocast::cached_cast(at::kBFloat16, w, at::kCUDA);
  HandleCollector collect;
  auto y = checkpoint(fn, {x})[0];
  prefire(collect.handles().at(0), 108);
  ASSERT_EQ(calls, 2);
  EXPECT_NE(cast_in_recompute.data_ptr(), cached.data_ptr()) << "the prefire read the main stream's cached cast";
  EXPECT_EQ(at::autocast::cached_cast(at::kBFloat16, w, at::kCUDA).data_ptr(), cached.data_ptr())
      << "the prefire cleared the region's cast cache";
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(at::kCUDA, false);
  { SessionScope s(108, {false}); torch::autograd::grad({y.to(at::kFloat).sum()}, {x, w}); }
  clear_session(108);
}

TEST(Cuda, ChecksumKernelEqualsCpuHashForSameBytes) {
  PREFIRE_REQUIRE_GPU();
  for (int64_t n : {1, 7, 8, 9, 255, 4096, 1000003}) {
    auto bytes = at::randint(0, 256, {n}, at::TensorOptions().dtype(at::kByte));
    uint64_t cpu = detail::tensor_checksum(bytes);
    EXPECT_EQ(detail::tensor_checksum(bytes.to(kCuda)), cpu) << n << " bytes";
    if (n > 1) {  // a misaligned start takes the kernel's byte-load path
      auto tail = bytes.narrow(0, 1, n - 1);
      EXPECT_EQ(detail::tensor_checksum(bytes.to(kCuda).narrow(0, 1, n - 1)), detail::tensor_checksum(tail));
    }
  }
  auto f = at::randn({33, 17}, kCuda);
  EXPECT_EQ(detail::tensor_checksum(f), detail::tensor_checksum(f.cpu()));
}

TEST(Cuda, ChecksumModeCatchesDropoutWithoutRngRestoreOnGpu) {
  PREFIRE_REQUIRE_GPU();
  auto x = at::randn({64, 64}, kCuda).requires_grad_(true);
  CheckpointOptions options;
  options.preserve_rng_state = false;
  options.determinism_check = DeterminismCheck::kChecksum;
  auto y = checkpoint([](const TensorList& in) { return TensorList{at::dropout(in[0], 0.5, true).sin()}; }, {x},
                      options)[0];
  EXPECT_THROW(torch::autograd::grad({y.sum()}, {x}), CheckpointError);
}

TEST(Cuda, AllocatorBytesAreTheCachingAllocatorsAllocatedBytes) {
  PREFIRE_REQUIRE_GPU();
  const c10::Device device(c10::DeviceType::CUDA, 0);
  reset_allocator_peak(device);
  const AllocatorBytes before = allocator_bytes(device);
  EXPECT_EQ(before.peak, before.current);
  {
    auto t = at::empty({1 << 20}, at::TensorOptions().device(kCuda).dtype(at::kFloat));  // 4 MiB, one block
    EXPECT_EQ(allocator_bytes(device).current - before.current, 4 << 20);
  }
  const AllocatorBytes after = allocator_bytes(device);
  EXPECT_EQ(after.current, before.current);
  EXPECT_EQ(after.peak - before.current, 4 << 20);
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
  EXPECT_EQ(after.peak, stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak);
}

#else

TEST(Cuda, AllocatorBytesNeedACudaBuild) {
  EXPECT_THROW(allocator_bytes(c10::Device(c10::DeviceType::CUDA, 0)), std::runtime_error);
}

TEST(Cuda, BuiltWithoutCuda) { GTEST_SKIP() << "prefire was built without its CUDA parts"; }

#endif

}  // namespace
}  // namespace prefire::testing
