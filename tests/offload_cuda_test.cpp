// Offloaded checkpoints on the pinned host tier (CUDA tensors): gradients
// bit-equal to the unchecked stage in every path (plain backward, B and W
// sharing one fetch, prefetched on the prefire stream with and without the
// session pool, lazy on backward's stream, inputs only, dropout), the saved
// device bytes given back to the caching allocator once their copies are
// done, a tier much smaller than a step's saved bytes reused region by region
// across steps without a byte read back wrong, and the tier's errors. Every
// test needs a GPU and skips without one, except the errors a machine without
// one gives (they run everywhere).
//
// Not covered here: the host file tier (offload_test.cpp), timing (the pinned
// tier's copies overlapping compute: benchmarks, on a GPU).

#include "test_support.h"

#include <prefire/offload.h>
#include <prefire/split_backward.h>

#if PREFIRE_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace prefire::testing {
namespace {

using ::testing::HasSubstr;

TEST(CudaOffload, ThePinnedTierSaysWhyItCannotBeMadeHere) {
  EXPECT_THAT(message_of<std::invalid_argument>([] { OffloadTier::pinned_host(100); }),
              HasSubstr("at least one page"));
  if (cuda_available()) GTEST_SKIP() << "a CUDA device is here: the tier can be made";
#if PREFIRE_WITH_CUDA
  EXPECT_THAT(message_of([] { OffloadTier::pinned_host(1 << 20); }), HasSubstr("no CUDA device"));
#else
  EXPECT_THAT(message_of([] { OffloadTier::pinned_host(1 << 20); }), HasSubstr("CUDA parts"));
#endif
}

#if PREFIRE_WITH_CUDA

constexpr int64_t kDim = 64;
constexpr int64_t kTierBytes = 256 << 20;
const c10::Device kCuda(c10::kCUDA, 0);

CheckpointOptions offload_to(std::shared_ptr<OffloadTier> t, bool inputs_only = false) {
  CheckpointOptions options;
  options.offload_to = std::move(t);
  options.offload_inputs_only = inputs_only;
  return options;
}

/// dx and dw of `stage` on x (seeded by `seed`): in one backward, or split
/// into B and W sharing session `session` (prefetched ahead when `prefetch`,
/// else attached); the blocks offloaded with `options`, or unchecked when
/// options.offload_to is null.
std::pair<TensorList, TensorList> run(const Stage& stage, uint64_t seed, const CheckpointOptions& options,
                                      std::optional<SessionId> session, bool prefetch,
                                      std::atomic<int>* runs = nullptr) {
  at::manual_seed(seed);
  auto x = at::randn({4, 32, kDim}, kCuda).requires_grad_(true);
  auto gy = at::randn({4, 32, kDim}, kCuda);
  at::manual_seed(seed + 1);
  at::Tensor y = x;
  std::vector<CheckpointHandle> handles;
  {
    HandleCollector collect;
    for (const auto& b : stage.blocks) {
      y = options.offload_to ? checkpoint(runs ? counted(b.fn(), *runs) : b.fn(), {y}, options)[0] : b.forward(y);
    }
    handles = collect.handles();
  }
  at::rand({1 << 20}, kCuda);  // other Philox work between forward and backward
  if (!session) {
    TensorList all = torch::autograd::grad({y}, concat({x}, stage.params()), {gy});
    return {TensorList(all.begin(), all.begin() + 1), TensorList(all.begin() + 1, all.end())};
  }
  for (const auto& h : handles) {
    if (prefetch) {
      EXPECT_EQ(prefire(h, *session), PrefireStatus::kRecomputed);
    } else {
      EXPECT_TRUE(attach(h, *session));
    }
  }
  SplitBackward b;
  {
    SessionScope scope(*session, {/*retain_on_unpack=*/true});
    b = backward_input({y}, {gy}, {x}, stage.params());
  }
  TensorList dw;
  {
    SessionScope scope(*session, {/*retain_on_unpack=*/false});
    dw = b.weight_pass.run();
  }
  clear_session(*session);
  return {b.input_grads, dw};
}

TEST(CudaOffload, PlainBackwardEqualsUncheckedAndNeverRunsTheFunctionAgain) {
  PREFIRE_REQUIRE_GPU();
  at::manual_seed(1);
  Stage stage(3, /*dropout=*/0.1, kDim);
  stage.to(kCuda);
  const auto [dx_ref, dw_ref] = run(stage, 2, {}, std::nullopt, false);
  auto t = OffloadTier::pinned_host(kTierBytes);
  std::atomic<int> runs{0};
  const RuntimeStats before = runtime_stats();
  const auto [dx, dw] = run(stage, 2, offload_to(t), std::nullopt, false, &runs);
  // The same kernels on the same bytes: a fetch gives back forward's bits.
  expect_all_equal(dx, dx_ref);
  expect_all_equal(dw, dw_ref);
  EXPECT_EQ(runs, 3) << "forward only";
  EXPECT_EQ(runtime_stats().offload_fetches - before.offload_fetches, 3);
  EXPECT_EQ(runtime_stats().recomputations, before.recomputations);
  t->synchronize();
  EXPECT_GT(t->bytes_written(), 0);
  EXPECT_EQ(t->bytes_read(), t->bytes_written());
  EXPECT_EQ(t->used_bytes(), 0) << "the tier's regions went with the graph";
}

TEST(CudaOffload, SavedDeviceBytesGoBackToTheCachingAllocatorOnceCopied) {
  PREFIRE_REQUIRE_GPU();
  at::manual_seed(3);
  Block block(kDim, 0.1);
  block.to(kCuda);
  auto t = OffloadTier::pinned_host(kTierBytes);
  auto x = at::randn({8, 128, kDim}, kCuda).requires_grad_(true);
  auto held_after_forward = [&](int mode) {  // 0 unchecked, 1 recompute, 2 offload
    c10::cuda::getCurrentCUDAStream().synchronize();
    const int64_t start = allocator_bytes(kCuda).current;
    at::Tensor y = mode == 0 ? block.forward(x)
                   : mode == 1 ? checkpoint(block.fn(), {x})[0]
                               : checkpoint(block.fn(), {x}, offload_to(t))[0];
    t->synchronize();
    return std::make_pair(allocator_bytes(kCuda).current - start, y);
  };
  block.forward(x);  // cuBLAS's workspace for this stream, made before anything is measured
  auto [unchecked, y0] = held_after_forward(0);
  auto [recomputed, y1] = held_after_forward(1);
  auto [offloaded, y2] = held_after_forward(2);
  EXPECT_EQ(offloaded, recomputed) << "an offloaded block holds on the device what a recomputed one does";
  EXPECT_LT(offloaded, unchecked);
  EXPECT_GE(t->bytes_written(), unchecked - offloaded) << "the tier holds what the unchecked block kept";
}

TEST(CudaOffload, BAndWShareOneFetchPrefetchedWithAndWithoutThePoolOrLazy) {
  PREFIRE_REQUIRE_GPU();
  at::manual_seed(4);
  Stage stage(3, 0.1, kDim);
  stage.to(kCuda);
  const auto [dx_ref, dw_ref] = run(stage, 5, {}, std::nullopt, false);
  struct Case {
    bool prefetch, pool;
  };
  for (const Case c : {Case{true, false}, Case{true, true}, Case{false, false}}) {
    SCOPED_TRACE(::testing::Message() << "prefetch " << c.prefetch << ", pool " << c.pool);
    PoolSetting pool(c.pool);
    auto t = OffloadTier::pinned_host(kTierBytes);
    std::atomic<int> runs{0};
    const RuntimeStats before = runtime_stats();
    const auto [dx, dw] = run(stage, 5, offload_to(t), 700, c.prefetch, &runs);
    expect_all_equal(dx, dx_ref);
    expect_all_equal(dw, dw_ref);
    EXPECT_EQ(runs, 3);
    EXPECT_EQ(runtime_stats().offload_fetches - before.offload_fetches, 3) << "one fetch per block for B and W";
    EXPECT_EQ(runtime_stats().recomputed_bytes, 0) << "clear_session let go of every fetched copy";
  }
}

TEST(CudaOffload, InputsOnlyRecomputesFromInputsReadBackAndEqualsUnchecked) {
  PREFIRE_REQUIRE_GPU();
  at::manual_seed(6);
  Stage stage(3, 0.1, kDim);
  stage.to(kCuda);
  const auto [dx_ref, dw_ref] = run(stage, 7, {}, std::nullopt, false);
  for (bool prefetch : {true, false}) {
    auto t = OffloadTier::pinned_host(kTierBytes);
    std::atomic<int> runs{0};
    const auto [dx, dw] = run(stage, 7, offload_to(t, /*inputs_only=*/true), 701, prefetch, &runs);
    // Recomputed kernels may run on the prefire stream: close, as cuda_test.cpp compares recomputations.
    expect_all_close(dx, dx_ref);
    expect_all_close(dw, dw_ref);
    EXPECT_EQ(runs, 6) << "forward and one recomputation per block";
    EXPECT_GT(t->bytes_read(), 0);
  }
}

TEST(CudaOffload, ASmallTierIsReusedAcrossStepsWithoutAByteReadBackWrong) {
  PREFIRE_REQUIRE_GPU();
  at::manual_seed(8);
  Stage stage(2, 0.1, kDim);
  stage.to(kCuda);
  const auto [dx_ref, dw_ref] = run(stage, 9, {}, std::nullopt, false);
  // One step's copies fit, a second step's would not: every step reuses the
  // regions the previous one freed, while its prefetches may still be queued.
  auto probe = OffloadTier::pinned_host(kTierBytes);
  run(stage, 9, offload_to(probe), std::nullopt, false);
  auto t = OffloadTier::pinned_host(probe->peak_used_bytes() + 4096);
  for (int step = 0; step < 20; ++step) {
    const auto [dx, dw] = run(stage, 9, offload_to(t), 702, /*prefetch=*/step % 2 == 0);
    expect_all_equal(dx, dx_ref);
    expect_all_equal(dw, dw_ref);
  }
}

TEST(CudaOffload, AFullTierFailsTheForwardAndAHostTensorIsRefused) {
  PREFIRE_REQUIRE_GPU();
  Block block(kDim, 0.0);
  block.to(kCuda);
  auto small = OffloadTier::pinned_host(4 * 4096);
  auto x = at::randn({8, 128, kDim}, kCuda).requires_grad_(true);
  const std::string full = message_of([&] { checkpoint(block.fn(), {x}, offload_to(small)); });
  EXPECT_THAT(full, HasSubstr("is full"));
  EXPECT_THAT(full, HasSubstr("pinned host memory"));
  small->synchronize();
  EXPECT_EQ(small->used_bytes(), 0) << "the failed forward's regions went with it";
  Block host(kDim, 0.0);
  auto t = OffloadTier::pinned_host(kTierBytes);
  EXPECT_THAT(message_of([&] { checkpoint(host.fn(), {at::randn({2, 4, kDim}).requires_grad_(true)}, offload_to(t)); }),
              HasSubstr("not on a CUDA device"));
  auto file = OffloadTier::host_file(::testing::TempDir(), kTierBytes);
  EXPECT_THAT(message_of([&] { checkpoint(block.fn(), {x}, offload_to(file)); }), HasSubstr("not on the CPU"));
}

TEST(CudaOffload, NestedInAPrefiredRecomputationWithThePoolEqualsUnchecked) {
  PREFIRE_REQUIRE_GPU();
  at::manual_seed(10);
  Block a(kDim, 0.1), c(kDim, 0.1);
  a.to(kCuda);
  c.to(kCuda);
  auto x = at::randn({4, 32, kDim}, kCuda).requires_grad_(true);
  const TensorList wrt = concat({x}, concat(a.params(), c.params()));
  auto gy = at::randn({4, 32, kDim}, kCuda);
  at::manual_seed(11);
  const TensorList expected = torch::autograd::grad({c.forward(a.forward(x))}, wrt, {gy});
  auto t = OffloadTier::pinned_host(kTierBytes);
  // The outer checkpoint's prefire runs the inner offloaded one's forward again, inside the pool's window:
  // the copies queued there must not let their storages be reused early.
  CheckpointFn both = [&](const TensorList& in) {
    return TensorList{c.forward(checkpoint(a.fn(), in, offload_to(t))[0])};
  };
  PoolSetting pool(true);
  at::manual_seed(11);
  HandleCollector collect;
  at::Tensor y = checkpoint(both, {x})[0];
  ASSERT_EQ(collect.handles().size(), 1u);
  ASSERT_EQ(prefire(collect.handles()[0], 703), PrefireStatus::kRecomputed);
  TensorList got;
  {
    SessionScope scope(703);
    got = torch::autograd::grad({y}, wrt, {gy});
  }
  clear_session(703);
  expect_all_close(got, expected);
}

TEST(CudaOffload, MeasuredCopySecondsArePositive) {
  PREFIRE_REQUIRE_GPU();
  auto t = OffloadTier::pinned_host(kTierBytes);
  EXPECT_GT(t->measure_copy_seconds(64 << 20), 0.0);
  EXPECT_EQ(t->used_bytes(), 0);
}

#endif

}  // namespace
}  // namespace prefire::testing
