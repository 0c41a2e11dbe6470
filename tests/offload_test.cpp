// Offloaded checkpoints on the host file tier, whole or inputs only: gradients bit-equal to the
// unchecked block in every path (plain backward, B and W sharing one fetch in
// a session, prefetch ahead, nested with recomputed checkpoints, dropout),
// the function never runs again, the saved bytes leave the CPU allocator once
// their copies are written, and the tier's errors (no directory, full, a
// tensor modified in place) are raised before anything wrong is read back.
//
// Not covered here: the Python keyword (tests/python/test_offload.py).

#include "test_support.h"

#include <prefire/offload.h>
#include <prefire/split_backward.h>

namespace prefire::testing {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kDim = 16;
constexpr int64_t kTierBytes = 64 << 20;

std::shared_ptr<OffloadTier> tier(int64_t capacity = kTierBytes) {
  return OffloadTier::host_file(::testing::TempDir(), capacity);
}

CheckpointOptions offload_to(std::shared_ptr<OffloadTier> t) {
  CheckpointOptions options;
  options.offload_to = std::move(t);
  return options;
}

at::Tensor input(uint64_t seed) {
  at::manual_seed(seed);
  return at::randn({2, 5, kDim}).requires_grad_(true);
}

TEST(Offload, PlainBackwardEqualsUncheckedAndNeverRunsTheFunctionAgain) {
  at::manual_seed(1);
  Block block(kDim, /*dropout=*/0.2);
  auto t = tier();
  auto x = input(2);
  auto wrt = concat({x}, block.params());
  at::manual_seed(7);
  auto expected = grads(block.forward(x), wrt);

  std::atomic<int> runs{0};
  const RuntimeStats before = runtime_stats();
  at::manual_seed(7);
  auto y = checkpoint(counted(block.fn(), runs), {x}, offload_to(t))[0];
  expect_all_equal(grads(y, wrt), expected);
  EXPECT_EQ(runs, 1) << "an offloaded block is fetched, not recomputed";
  const RuntimeStats after = runtime_stats();
  EXPECT_EQ(after.recomputations, before.recomputations);
  EXPECT_EQ(after.offload_fetches, before.offload_fetches + 1);
  EXPECT_GT(t->bytes_written(), 0);
  EXPECT_EQ(t->bytes_read(), t->bytes_written()) << "every storage written is read back once";
}

TEST(Offload, SavedBytesLeaveTheCpuAllocatorOnceTheirCopiesAreWritten) {
  count_cpu_allocations();
  at::manual_seed(3);
  Block block(kDim, 0.1);
  auto t = tier();
  auto x = input(4);
  auto heap_after_forward = [&](int mode) {  // 0 unchecked, 1 recompute, 2 offload
    const int64_t start = allocator_bytes(c10::kCPU).current;
    at::Tensor y = mode == 0 ? block.forward(x)
                   : mode == 1 ? checkpoint(block.fn(), {x})[0]
                               : checkpoint(block.fn(), {x}, offload_to(t))[0];
    t->synchronize();
    return std::make_pair(allocator_bytes(c10::kCPU).current - start, y);
  };
  auto [unchecked, y0] = heap_after_forward(0);
  auto [recomputed, y1] = heap_after_forward(1);
  auto [offloaded, y2] = heap_after_forward(2);
  EXPECT_EQ(offloaded, recomputed) << "an offloaded block holds on the heap what a recomputed one does";
  EXPECT_EQ(unchecked - offloaded, t->bytes_written()) << "the tier holds what the unchecked block kept on the heap";
  EXPECT_GT(t->used_bytes(), 0);
  auto wrt = concat({x}, block.params());
  y0 = at::Tensor();
  y1 = at::Tensor();
  grads(y2, wrt);
  y2 = at::Tensor();
  EXPECT_EQ(t->used_bytes(), 0) << "the tier's regions go with the graph";
}


/// dx and dw of a stage of `blocks` blocks: B and W split, sharing session
/// `session` (prefetched ahead when `prefetch`, else attached: the first pass
/// fetches), the blocks offloaded to `t` or, with t == nullptr, unchecked.
std::pair<TensorList, TensorList> split(const Stage& stage, uint64_t seed, const std::shared_ptr<OffloadTier>& t,
                                        SessionId session, bool prefetch, std::atomic<int>* runs = nullptr,
                                        bool inputs_only = false) {
  CheckpointOptions options = offload_to(t);
  options.offload_inputs_only = inputs_only;
  auto x = input(seed);
  at::manual_seed(seed + 100);
  auto gy = at::randn({2, 5, kDim});
  at::manual_seed(seed + 200);
  at::Tensor y;
  std::vector<CheckpointHandle> handles;
  {
    HandleCollector collect;
    y = x;
    for (const auto& b : stage.blocks) {
      y = t ? checkpoint(runs ? counted(b.fn(), *runs) : b.fn(), {y}, options)[0] : b.forward(y);
    }
    handles = collect.handles();
  }
  for (const auto& h : handles) {
    if (prefetch) {
      EXPECT_EQ(prefire(h, session), PrefireStatus::kRecomputed);
    } else {
      EXPECT_TRUE(attach(h, session));
    }
  }
  SplitBackward b;
  {
    SessionScope scope(session, {/*retain_on_unpack=*/true});
    b = backward_input({y}, {gy}, {x}, stage.params());
  }
  TensorList dw;
  {
    SessionScope scope(session, {/*retain_on_unpack=*/false});
    dw = b.weight_pass.run();
  }
  clear_session(session);
  return {b.input_grads, dw};
}

TEST(Offload, BAndWShareOneFetchPrefetchedOrLazyAndEqualUnchecked) {
  at::manual_seed(5);
  Stage stage(3, /*dropout=*/0.1, kDim);
  auto [dx_ref, dw_ref] = split(stage, 6, nullptr, 600, false);
  for (bool prefetch : {true, false}) {
    auto t = tier();
    std::atomic<int> runs{0};
    const RuntimeStats before = runtime_stats();
    auto [dx, dw] = split(stage, 6, t, 600, prefetch, &runs);
    expect_all_equal(dx, dx_ref);
    expect_all_equal(dw, dw_ref);
    const RuntimeStats after = runtime_stats();
    EXPECT_EQ(runs, 3) << "forward only";
    EXPECT_EQ(after.offload_fetches - before.offload_fetches, 3) << "one fetch per block for B and W";
    EXPECT_EQ(after.unshared_recomputations, before.unshared_recomputations);
    EXPECT_EQ(after.recomputed_bytes, 0) << "clear_session let go of every fetched copy";
  }
}

/// `block` run on `x` offloaded to `t`, and its handle.
std::pair<at::Tensor, CheckpointHandle> offloaded_with_handle(const Block& block, const at::Tensor& x,
                                                              const std::shared_ptr<OffloadTier>& t) {
  HandleCollector collect;
  at::Tensor y = checkpoint(block.fn(), {x}, offload_to(t))[0];
  EXPECT_EQ(collect.handles().size(), 1u);
  return {y, collect.handles().at(0)};
}

TEST(Offload, APrefetchIsHeldByTheSessionAndServesItsBackward) {
  at::manual_seed(8);
  Block block(kDim, 0.0);
  auto t = tier();
  auto x = input(9);
  auto [y, handle] = offloaded_with_handle(block, x, t);
  const auto expected = grads(block.forward(x), concat({x}, block.params()));
  t->synchronize();
  const int64_t read_before = t->bytes_read();
  ASSERT_EQ(prefire(handle, 601), PrefireStatus::kRecomputed);
  EXPECT_EQ(prefire(handle, 601), PrefireStatus::kAlreadyResident);
  EXPECT_GT(session_stats(601).current_bytes, 0) << "the prefetched storages are held by the session";
  TensorList got;
  {
    SessionScope scope(601);
    got = grads(y, concat({x}, block.params()));
  }
  EXPECT_GT(t->bytes_read(), read_before);
  expect_all_equal(got, expected);
  clear_session(601);
}

TEST(Offload, NestedWithRecomputedCheckpointsEitherWayEqualsUnchecked) {
  at::manual_seed(10);
  Block a(kDim, 0.2), c(kDim, 0.2);
  auto x = input(11);
  const TensorList wrt = concat({x}, concat(a.params(), c.params()));
  at::manual_seed(12);
  const auto expected = grads(c.forward(a.forward(x)), wrt);
  auto t = tier();
  for (bool outer_offloaded : {true, false}) {
    const CheckpointOptions outer = outer_offloaded ? offload_to(t) : CheckpointOptions{};
    const CheckpointOptions inner = outer_offloaded ? CheckpointOptions{} : offload_to(t);
    CheckpointFn both = [&](const TensorList& in) {
      return TensorList{checkpoint(c.fn(), {checkpoint(a.fn(), in, inner)[0]}, inner)[0]};
    };
    at::manual_seed(12);
    auto y = checkpoint(both, {x}, outer)[0];
    expect_all_equal(grads(y, wrt), expected);
  }
}

TEST(Offload, RetainGraphSecondBackwardFetchesAgain) {
  at::manual_seed(13);
  Block block(kDim, 0.1);
  auto t = tier();
  auto x = input(14);
  const TensorList wrt = concat({x}, block.params());
  at::manual_seed(15);
  const auto expected = grads(block.forward(x), wrt);
  at::manual_seed(15);
  auto y = checkpoint(block.fn(), {x}, offload_to(t))[0];
  const int64_t before = runtime_stats().offload_fetches;
  expect_all_equal(grads(y, wrt, /*retain_graph=*/true), expected);
  expect_all_equal(grads(y, wrt), expected);
  EXPECT_EQ(runtime_stats().offload_fetches - before, 2);
}

TEST(Offload, QueuedCopiesCountAsHeldUntilWrittenAndBackpressureBoundsThem) {
  // a paced tier: each block's copies take ~10 ms, so they lag a chain's forward
  auto t = OffloadTier::host_file(::testing::TempDir(), kTierBytes, /*bytes_per_second=*/1e6);
  at::manual_seed(3);
  std::vector<std::unique_ptr<Block>> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(std::make_unique<Block>(kDim, /*dropout=*/0.0));
  auto x = input(4);
  auto chain = [&] {
    auto y = x;
    for (auto& b : blocks) {
      y = checkpoint(b->fn(), {y}, offload_to(t))[0];
      if (t->max_pending_bytes() == 0) EXPECT_EQ(t->pending_bytes(), 0) << "written before forward goes on";
    }
    return y;
  };
  const int64_t held = runtime_stats().held_bytes;
  auto y = chain();
  EXPECT_GT(t->pending_bytes(), 0);
  EXPECT_GE(runtime_stats().held_bytes - held, t->pending_bytes()) << "a queued storage is held";
  t->synchronize();
  EXPECT_EQ(t->pending_bytes(), 0);
  EXPECT_EQ(runtime_stats().held_bytes, held);
  y.sum().backward();

  t->set_max_pending_bytes(0);
  y = chain();
  y.sum().backward();
  EXPECT_THROW(t->set_max_pending_bytes(-1), std::invalid_argument);
  EXPECT_THROW(OffloadTier::host_file(::testing::TempDir(), kTierBytes, -1.0), std::invalid_argument);
}

TEST(Offload, AStorageSavedBySeveralCheckpointsIsWrittenOnce) {
  auto t = tier();
  auto x = input(5);
  auto mask = at::rand({5, kDim}).gt(0.5).to(at::kFloat);
  auto masked = [&](const at::Tensor& m) {
    return [m](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{in[0].sin() * m}; };
  };
  auto y = x;
  for (int i = 0; i < 3; ++i) y = checkpoint(masked(mask), {y}, offload_to(t))[0];  // each saves its input, mask
  t->synchronize();
  EXPECT_EQ(t->bytes_written(), 2 * x.nbytes() + mask.nbytes()) << "x is kept (a leaf); the mask written once";
  auto wrt = std::vector<at::Tensor>{x};
  auto expected = x.sin().mul(mask).sin().mul(mask).sin().mul(mask);
  expect_all_equal(grads(y, wrt), grads(expected, wrt));
}

TEST(Offload, AFullTierFailsTheForwardWithTheReasonAndHoldsNothingAfter) {
  at::manual_seed(16);
  Block block(64, 0.0);
  auto t = tier(4 * 4096);
  auto x = at::randn({4, 32, 64}).requires_grad_(true);
  const std::string message = message_of([&] { checkpoint(block.fn(), {x}, offload_to(t)); });
  EXPECT_THAT(message, HasSubstr("is full"));
  EXPECT_THAT(message, HasSubstr(::testing::TempDir()));
  t->synchronize();
  EXPECT_EQ(t->used_bytes(), 0) << "the failed forward's regions went with it";
  // The same block fits a larger tier.
  auto big = tier();
  auto y = checkpoint(block.fn(), {x}, offload_to(big))[0];
  EXPECT_EQ(grads(y, {x}).size(), 1u);
}

TEST(Offload, ATierThatCannotBeMadeSaysWhereAndWhy) {
  EXPECT_THAT(message_of([] { OffloadTier::host_file("/nonexistent/prefire-tier", 1 << 20); }),
              HasSubstr("/nonexistent/prefire-tier"));
  EXPECT_THAT(message_of<std::invalid_argument>([] { OffloadTier::host_file(::testing::TempDir(), 100); }),
              HasSubstr("at least one page"));
}

TEST(Offload, ASavedTensorModifiedInPlaceAfterForwardIsReportedAtBackward) {
  auto t = tier();
  auto x = input(17);
  CheckpointFn fn = [](const TensorList& in) { return TensorList{at::exp(in[0])}; };  // exp saves its output
  auto y = checkpoint(fn, {x}, offload_to(t))[0];
  {
    c10::AutoGradMode no_grad(false);
    y.add_(1);
  }
  EXPECT_THAT(message_of([&] { grads(y, {x}); }), HasSubstr("modified in place"));
}

TEST(Offload, APrefetchNoPassUsedIsReleasedAtClearAndTheTierWhenTheGraphGoes) {
  at::manual_seed(18);
  Block block(kDim, 0.1);
  auto t = tier();
  auto x = input(19);
  auto [y, handle] = offloaded_with_handle(block, x, t);
  const int64_t wasted = runtime_stats().wasted_prefires;
  ASSERT_EQ(prefire(handle, 602), PrefireStatus::kRecomputed);
  EXPECT_GT(runtime_stats().recomputed_bytes, 0);
  clear_session(602);
  EXPECT_EQ(runtime_stats().recomputed_bytes, 0);
  EXPECT_EQ(runtime_stats().wasted_prefires, wasted + 1);
  t->synchronize();
  EXPECT_GT(t->used_bytes(), 0) << "the tier keeps the copies while the graph lives";
  y = at::Tensor();
  EXPECT_EQ(t->used_bytes(), 0);
}

CheckpointOptions inputs_only(std::shared_ptr<OffloadTier> t) {
  CheckpointOptions options = offload_to(std::move(t));
  options.offload_inputs_only = true;
  return options;
}

TEST(OffloadInputsOnly, AChainRecomputesOnceFromInputsReadBackAndTheInputsLeaveTheHeap) {
  count_cpu_allocations();
  at::manual_seed(20);
  Stage stage(3, /*dropout=*/0.2, kDim);
  auto t = tier();
  auto x = input(21);
  const TensorList wrt = concat({x}, stage.params());
  at::manual_seed(22);
  const auto expected = grads(stage.forward(x, false), wrt);

  auto heap_after_forward = [&](const CheckpointOptions& options) {
    const int64_t start = allocator_bytes(c10::kCPU).current;
    at::manual_seed(22);
    at::Tensor y = stage.forward(x, true, options);
    t->synchronize();
    return std::make_pair(allocator_bytes(c10::kCPU).current - start, y);
  };
  auto [recomputed, y1] = heap_after_forward({});
  auto [offloaded, y2] = heap_after_forward(inputs_only(t));
  // x is the caller's leaf (kept by reference); the inputs of blocks 2 and 3 go to the tier.
  EXPECT_EQ(t->bytes_written(), 2 * x.nbytes());
  EXPECT_EQ(recomputed - offloaded, t->bytes_written()) << "the checkpoints' inputs left the heap";
  y1 = at::Tensor();
  const int64_t recomputations = runtime_stats().recomputations;
  expect_all_equal(grads(y2, wrt), expected);
  EXPECT_EQ(runtime_stats().recomputations - recomputations, 3) << "each block recomputes once, from its inputs";
  EXPECT_EQ(t->bytes_read(), t->bytes_written());
}

TEST(OffloadInputsOnly, BAndWShareOneRecomputationPrefiredOrLazy) {
  at::manual_seed(23);
  Stage stage(3, 0.1, kDim);
  auto [dx_ref, dw_ref] = split(stage, 24, nullptr, 603, false);
  for (bool prefired : {true, false}) {
    auto t = tier();
    std::atomic<int> runs{0};
    auto [dx, dw] = split(stage, 24, t, 603, prefired, &runs, /*inputs_only=*/true);
    expect_all_equal(dx, dx_ref);
    expect_all_equal(dw, dw_ref);
    EXPECT_EQ(runs, 6) << "forward and one recomputation per block";
  }
}

TEST(OffloadInputsOnly, WithoutATierIsRefused) {
  CheckpointOptions options;
  options.offload_inputs_only = true;
  Block block(kDim);
  EXPECT_THAT(message_of<std::invalid_argument>([&] { checkpoint(block.fn(), {input(25)}, options); }),
              HasSubstr("offload_to"));
}
}  // namespace
}  // namespace prefire::testing
