// Scheduling: handle collection, prefire, sessions shared between the dx (B)
// and dw (W) passes of a split backward, lifetimes, budgets, misuse.
//
// Not covered here: CUDA streams and pools (cuda tests), the unpack cost with
// many sessions (benchmarks/unpack_benchmark.cpp).

#include "test_support.h"

#include <thread>

namespace prefire::testing {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kDim = 16;

int64_t recomputations() { return runtime_stats().recomputations; }

struct MicroBatch {
  at::Tensor x, y, gy;
};

MicroBatch make_micro_batch(uint64_t seed) {
  at::manual_seed(seed);
  auto x = at::randn({2, 5, kDim}).requires_grad_(true);
  return {x, at::Tensor(), at::randn({2, 5, kDim})};
}

TensorList b_pass(const MicroBatch& mb) { return torch::autograd::grad({mb.y}, {mb.x}, {mb.gy}, true); }
TensorList w_pass(const MicroBatch& mb, const Stage& s) {
  return torch::autograd::grad({mb.y}, s.params(), {mb.gy}, false, false, true);
}

/// dx and dw of the unchecked stage for `seed`'s micro-batch.
std::pair<TensorList, TensorList> reference(const Stage& stage, uint64_t seed) {
  auto mb = make_micro_batch(seed);
  at::manual_seed(seed + 100);
  mb.y = stage.forward(mb.x, false);
  auto dx = b_pass(mb);
  return {dx, w_pass(mb, stage)};
}

MicroBatch forward_collect(const Stage& stage, uint64_t seed, std::vector<CheckpointHandle>* handles,
                           CheckpointOptions options = {}) {
  auto mb = make_micro_batch(seed);
  at::manual_seed(seed + 100);
  HandleCollector collect;
  mb.y = stage.forward(mb.x, true, options);
  if (handles) *handles = collect.handles();
  return mb;
}

// ---- the B/W split ----------------------------------------------------------------

TEST(Schedule, SplitBackwardWithoutSessionRecomputesPerGraphTask) {
  Stage stage(3);
  auto [dx_ref, dw_ref] = reference(stage, 1);
  auto mb = forward_collect(stage, 1, nullptr);
  int64_t before = recomputations();
  expect_all_equal(b_pass(mb), dx_ref);
  expect_all_equal(w_pass(mb, stage), dw_ref);
  EXPECT_EQ(recomputations() - before, 2 * 3) << "graph-task keys: one recomputation per pass per checkpoint";
}

TEST(Schedule, PrefireAndSessionRecomputeOnceAndMatchBitForBit) {
  Stage stage(3);
  auto [dx_ref, dw_ref] = reference(stage, 2);
  std::vector<CheckpointHandle> handles;
  auto mb = forward_collect(stage, 2, &handles);
  ASSERT_EQ(handles.size(), 3u);
  at::rand({100});  // other random work between forward and prefire
  int64_t before = recomputations();
  for (const auto& h : handles) EXPECT_EQ(prefire(h, 2), PrefireStatus::kRecomputed);
  TensorList dx, dw;
  {
    SessionScope scope(2, {/*retain_on_unpack=*/true});
    dx = b_pass(mb);
  }
  {
    SessionScope scope(2, {/*retain_on_unpack=*/true});
    dw = w_pass(mb, stage);
  }
  EXPECT_EQ(recomputations() - before, 3) << "one recomputation per checkpoint, shared by B and W";
  expect_all_equal(dx, dx_ref);
  expect_all_equal(dw, dw_ref);
  auto stats = session_stats(2);
  EXPECT_EQ(stats.prefires, 3);
  EXPECT_EQ(stats.lazy_recomputes, 0);
  EXPECT_GT(stats.hits, 0);
  clear_session(2);
  EXPECT_EQ(session_stats(2).current_bytes, 0);
}

TEST(Schedule, KeptBytesAreWhatTheBlockUncheckedSavesAndItsRecomputationHoldsThemLessItsInput) {
  Stage stage(1);
  auto input = [] {
    auto mb = make_micro_batch(3);
    mb.x = mb.x * 2;  // not a leaf: a saved input counts
    return mb;
  };
  int64_t kept = 0;
  {
    auto mb = input();
    SavedTensorMeter meter;
    mb.y = stage.forward(mb.x, false);
    kept = meter.current_bytes();
  }
  std::vector<CheckpointHandle> handles;
  auto mb = input();
  {
    HandleCollector collect;
    mb.y = stage.forward(mb.x, true);
    handles = collect.handles();
  }
  ASSERT_EQ(handles.size(), 1u);
  const auto input_bytes = static_cast<int64_t>(mb.x.storage().nbytes());
  ASSERT_GT(kept, input_bytes);
  EXPECT_EQ(kept_bytes(handles[0]), kept) << "parameters alias leaves and do not count; the saved input does";
  EXPECT_EQ(prefire(handles[0], 3), PrefireStatus::kRecomputed);
  EXPECT_EQ(session_stats(3).current_bytes, kept - input_bytes) << "the recomputation uses the checkpoint's input";
  clear_session(3);
  EXPECT_THROW(kept_bytes(CheckpointHandle()), std::invalid_argument);
  mb = MicroBatch{};
  EXPECT_EQ(kept_bytes(handles[0]), 0) << "expired";
}

TEST(Schedule, SessionScopeAloneRecomputesOnFirstUnpackAndReusesInSecondPass) {
  Stage stage(2);
  auto [dx_ref, dw_ref] = reference(stage, 3);
  std::vector<CheckpointHandle> handles;
  auto mb = forward_collect(stage, 3, &handles);
  for (const auto& h : handles) EXPECT_TRUE(attach(h, 3));
  int64_t before = recomputations();
  TensorList dx, dw;
  {
    SessionScope scope(3, {true});
    dx = b_pass(mb);
  }
  EXPECT_EQ(recomputations() - before, 2);
  {
    SessionScope scope(3, {false});  // the last pass releases what it unpacks
    dw = w_pass(mb, stage);
  }
  EXPECT_EQ(recomputations() - before, 2);
  EXPECT_EQ(session_stats(3).lazy_recomputes, 2);
  expect_all_equal(dx, dx_ref);
  expect_all_equal(dw, dw_ref);
  clear_session(3);
}

TEST(Schedule, WPassOnAnotherThreadUsesTheSession) {
  Stage stage(2);
  auto [dx_ref, dw_ref] = reference(stage, 4);
  std::vector<CheckpointHandle> handles;
  auto mb = forward_collect(stage, 4, &handles);
  for (const auto& h : handles) prefire(h, 4);
  int64_t before = recomputations();
  TensorList dx, dw;
  {
    SessionScope scope(4, {true});
    dx = b_pass(mb);
    std::thread worker = pinned_thread([&] { dw = w_pass(mb, stage); });  // sees none of this thread's thread-locals
    worker.join();
  }
  EXPECT_EQ(recomputations() - before, 0);
  expect_all_equal(dx, dx_ref);
  expect_all_equal(dw, dw_ref);
  clear_session(4);
}

TEST(Schedule, InterleavedMicroBatchesStayIsolated) {
  // F0 F1 B0 B1 W0 W1, sessions 10 and 11.
  Stage stage(2);
  auto ref0 = reference(stage, 10), ref1 = reference(stage, 11);
  std::vector<CheckpointHandle> h0, h1;
  auto mb0 = forward_collect(stage, 10, &h0);
  auto mb1 = forward_collect(stage, 11, &h1);
  for (const auto& h : h0) prefire(h, 10);
  for (const auto& h : h1) prefire(h, 11);
  TensorList dx0, dx1, dw0, dw1;
  { SessionScope s(10, {true}); dx0 = b_pass(mb0); }
  { SessionScope s(11, {true}); dx1 = b_pass(mb1); }
  EXPECT_EQ(session_stats(10).checkpoints, 2);
  EXPECT_EQ(session_stats(11).checkpoints, 2);
  { SessionScope s(10, {false}); dw0 = w_pass(mb0, stage); }
  { SessionScope s(11, {false}); dw1 = w_pass(mb1, stage); }
  expect_all_equal(dx0, ref0.first);
  expect_all_equal(dw0, ref0.second);
  expect_all_equal(dx1, ref1.first);
  expect_all_equal(dw1, ref1.second);
  EXPECT_EQ(session_stats(10).checkpoints, 0) << "the W pass freed the graph, and its checkpoints with it";
  clear_session(10);
  clear_session(11);
}

TEST(Schedule, SameIdReusedOnNextIterationAfterClear) {
  Stage stage(2);
  for (uint64_t iteration = 0; iteration < 3; ++iteration) {
    auto ref = reference(stage, 20 + iteration);
    std::vector<CheckpointHandle> handles;
    auto mb = forward_collect(stage, 20 + iteration, &handles);
    for (const auto& h : handles) EXPECT_EQ(prefire(h, 20), PrefireStatus::kRecomputed);
    TensorList dx, dw;
    { SessionScope s(20, {true}); dx = b_pass(mb); }
    { SessionScope s(20, {true}); dw = w_pass(mb, stage); }
    expect_all_equal(dx, ref.first);
    expect_all_equal(dw, ref.second);
    EXPECT_EQ(session_stats(20).prefires, 2) << "counters of this iteration's session only";
    clear_session(20);
    EXPECT_EQ(session_stats(20).current_bytes, 0);
    EXPECT_EQ(session_stats(20).checkpoints, 0);
    EXPECT_EQ(session_stats(20).prefires, 0) << "a cleared session ends";
  }
}

// ---- lifetimes ---------------------------------------------------------------------

TEST(Schedule, RetainFalseReleasesEachTensorAtItsFirstUnpack) {
  Stage stage(2, 0.0);
  std::vector<CheckpointHandle> handles;
  auto mb = forward_collect(stage, 30, &handles);
  for (const auto& h : handles) prefire(h, 30);
  int64_t held = session_stats(30).current_bytes;
  EXPECT_GT(held, 0);
  { SessionScope s(30, {false}); torch::autograd::grad({mb.y}, concat({mb.x}, stage.params()), {mb.gy}); }
  EXPECT_EQ(session_stats(30).current_bytes, 0) << "retain_on_unpack=false kept tensors after their unpack";
  EXPECT_EQ(session_stats(30).peak_bytes, held);
  clear_session(30);
}

// See Note [The last pass lets go when it ends]: one pass may unpack a saved
// tensor more than once (two graph tasks over a retained graph here; in
// Python, torch's checkpoint nested in prefire's does it once per weight
// group of W), and lets go of everything when its scope closes.
TEST(Schedule, RetainFalsePassMayUnpackTwiceAndLetsGoWhenItEnds) {
  Stage stage(2, 0.0);
  auto ref = reference(stage, 35);
  std::vector<CheckpointHandle> handles;
  auto mb = forward_collect(stage, 35, &handles);
  for (const auto& h : handles) prefire(h, 35);
  TensorList first, second;
  {
    SessionScope s(35, {false});
    first = torch::autograd::grad({mb.y}, stage.params(), {mb.gy}, /*retain_graph=*/true);
    second = torch::autograd::grad({mb.y}, stage.params(), {mb.gy}, /*retain_graph=*/true);
    EXPECT_GT(session_stats(35).current_bytes, 0) << "released within the pass although the graph is kept";
  }
  expect_all_equal(first, ref.second);
  expect_all_equal(second, ref.second);
  EXPECT_EQ(session_stats(35).current_bytes, 0) << "the last pass kept tensors after its scope closed";
  EXPECT_EQ(session_stats(35).prefires, 2);
  EXPECT_EQ(session_stats(35).lazy_recomputes, 0);
  clear_session(35);
}

TEST(Schedule, RetainTrueKeepsTensorsUntilClearAndClearIsIdempotent) {
  Stage stage(2, 0.0);
  auto ref = reference(stage, 31);
  std::vector<CheckpointHandle> handles;
  auto mb = forward_collect(stage, 31, &handles);
  for (const auto& h : handles) prefire(h, 31);
  int64_t held = session_stats(31).current_bytes;
  { SessionScope s(31, {true}); b_pass(mb); }
  EXPECT_EQ(session_stats(31).current_bytes, held);
  EXPECT_EQ(runtime_stats().recomputed_bytes, held);
  clear_session(31);
  EXPECT_EQ(session_stats(31).current_bytes, 0);
  EXPECT_EQ(runtime_stats().recomputed_bytes, 0);
  clear_session(31);
  clear_session(12345);  // never used
  expect_all_equal(w_pass(mb, stage), ref.second);  // without the session: lazy, still right
}

TEST(Schedule, SessionReleasesTensorsOfAFreedGraphWithoutClear) {
  Stage stage(2, 0.0);
  std::vector<CheckpointHandle> handles;
  auto mb = forward_collect(stage, 38, &handles);
  for (const auto& h : handles) prefire(h, 38);
  { SessionScope s(38, {true}); b_pass(mb); }
  { SessionScope s(38, {true}); w_pass(mb, stage); }  // frees the graph
  EXPECT_TRUE(handles[0].expired());
  EXPECT_EQ(session_stats(38).current_bytes, 0) << "tensors nobody can unpack any more are still held";
  clear_session(38);
}

TEST(Schedule, SecondUnpackAfterReleasingUnpackRaises) {
  Stage stage(1, 0.0);
  std::vector<CheckpointHandle> handles;
  auto mb = forward_collect(stage, 32, &handles);
  prefire(handles[0], 32);
  { SessionScope s(32, {false}); b_pass(mb); }
  const std::string message = message_of([&] {
    SessionScope s(32, {false});
    w_pass(mb, stage);
  });
  EXPECT_THAT(message, HasSubstr("retain_on_unpack=true"));
  clear_session(32);
}

TEST(Schedule, ClearAfterPartialBackwardAndIdReusable) {
  Stage stage(2, 0.0);
  std::vector<CheckpointHandle> handles;
  auto mb = forward_collect(stage, 33, &handles);
  for (const auto& h : handles) prefire(h, 33);
  { SessionScope s(33, {true}); b_pass(mb); }  // W never runs
  clear_session(33);
  EXPECT_EQ(session_stats(33).current_bytes, 0);
  // The graph still exists: without the session, W recomputes lazily and is right.
  auto ref = reference(stage, 33);
  expect_all_equal(w_pass(mb, stage), ref.second);
  auto mb2 = forward_collect(stage, 34, &handles);
  for (const auto& h : handles) EXPECT_EQ(prefire(h, 33), PrefireStatus::kRecomputed);
  clear_session(33);
}

TEST(Schedule, ClearAfterExceptionInRecomputeAndAfterFailedPrefire) {
  int runs = 0;
  auto x = at::randn({4, 8}).requires_grad_(true);
  CheckpointFn flaky = [&](const TensorList& in) {
    if (runs++ == 1) throw std::runtime_error("boom in recompute");
    return TensorList{in[0].sin().cos()};
  };
  std::vector<CheckpointHandle> handles;
  at::Tensor y;
  {
    HandleCollector collect;
    y = checkpoint(flaky, {x})[0];
    handles = collect.handles();
  }
  EXPECT_THROW(prefire(handles[0], 35), std::runtime_error);  // failed prefire
  EXPECT_EQ(session_stats(35).current_bytes, 0);
  clear_session(35);
  // Registered again, lazily: the recompute now succeeds inside the scope.
  EXPECT_TRUE(attach(handles[0], 35));
  TensorList g;
  { SessionScope s(35, {false}); g = grads(y, {x}); }
  expect_all_equal(g, grads(x.sin().cos(), {x}));
  clear_session(35);

  // An exception inside a session recompute during backward.
  runs = 0;
  {
    HandleCollector collect;
    y = checkpoint(flaky, {x})[0];
    handles = collect.handles();
  }
  attach(handles[0], 36);
  {
    SessionScope s(36, {true});
    EXPECT_THROW(grads(y, {x}), std::runtime_error);
  }
  clear_session(36);
  EXPECT_EQ(session_stats(36).current_bytes, 0);
  prefire(handles[0], 36);  // reusable: the third run succeeds
  { SessionScope s(36, {false}); g = grads(y, {x}); }
  expect_all_equal(g, grads(x.sin().cos(), {x}));
  clear_session(36);
}

class ScheduleEarlyStop : public ::testing::TestWithParam<bool> {};

TEST_P(ScheduleEarlyStop, PrefireMatchesReferenceWithEarlyStop) {
  CheckpointOptions options;
  options.early_stop = GetParam();
  Stage stage(2);
  auto ref = reference(stage, 37);
  std::vector<CheckpointHandle> handles;
  auto mb = forward_collect(stage, 37, &handles, options);
  for (const auto& h : handles) prefire(h, 37);
  TensorList dx, dw;
  { SessionScope s(37, {true}); dx = b_pass(mb); }
  { SessionScope s(37, {false}); dw = w_pass(mb, stage); }
  expect_all_equal(dx, ref.first);
  expect_all_equal(dw, ref.second);
  clear_session(37);
}

INSTANTIATE_TEST_SUITE_P(EarlyStop, ScheduleEarlyStop, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "On" : "Off"; });

// ---- keeping only what the next pass reads (Note [A session keeps what the next pass reads]) ----

// A W that reads less than B: the weight gradients of the last block only.
TensorList w_last_block(const MicroBatch& mb, const Stage& s) {
  return torch::autograd::grad({mb.y}, s.blocks.back().params(), {mb.gy});
}

// B then W in session `id` over `mb`; the mask keep_only() gets between them
// (none: nothing dropped). Returns W's gradients.
TensorList b_then_w(const Stage& stage, const MicroBatch& mb, SessionId id, const SavedTensorMask* keep) {
  { SessionScope b(id, {/*retain_on_unpack=*/true}); b_pass(mb); }
  if (keep) EXPECT_TRUE(keep_only(id, *keep));
  SessionScope w(id, {/*retain_on_unpack=*/false});
  return w_last_block(mb, stage);
}

TEST(Schedule, KeepOnlyWhatAnEarlierWReadDropsTheRestAndWRecomputesNothing) {
  Stage stage(3, 0.0);
  at::manual_seed(40);
  auto ref_mb = make_micro_batch(40);
  ref_mb.y = stage.forward(ref_mb.x, false);
  const TensorList ref = w_last_block(ref_mb, stage);

  std::vector<CheckpointHandle> handles;
  auto first = forward_collect(stage, 40, &handles);
  for (const auto& h : handles) attach(h, 40);
  b_then_w(stage, first, 40, nullptr);
  const SavedTensorMask reads = pass_reads(40);
  ASSERT_EQ(reads.size(), 3u) << "one entry per checkpoint";
  const auto read_in = [&](size_t block) { return std::count(reads[block].begin(), reads[block].end(), true); };
  EXPECT_EQ(read_in(0), 0) << "W of the last block read the first block's tensors";
  EXPECT_EQ(read_in(1), 0);
  EXPECT_GT(read_in(2), 0);
  clear_session(40);

  auto second = forward_collect(stage, 40, &handles);
  for (const auto& h : handles) attach(h, 40);
  { SessionScope b(40, {true}); b_pass(second); }
  const int64_t whole = session_stats(40).current_bytes;
  EXPECT_FALSE(keep_only(40, SavedTensorMask(reads.begin(), reads.end() - 1))) << "a mask of another shape";
  EXPECT_EQ(session_stats(40).current_bytes, whole) << "a mask that does not fit dropped something";
  ASSERT_TRUE(keep_only(40, reads));
  const int64_t kept = session_stats(40).current_bytes;
  EXPECT_GT(kept, 0);
  EXPECT_LT(3 * kept, 2 * whole) << "two of three blocks' tensors dropped";
  const int64_t before = recomputations();
  TensorList dw;
  { SessionScope w(40, {false}); dw = w_last_block(second, stage); }
  expect_all_equal(dw, ref);
  EXPECT_EQ(recomputations() - before, 0);
  EXPECT_EQ(session_stats(40).trim_misses, 0);
  EXPECT_EQ(pass_reads(40), reads) << "W read what the earlier W read";
  clear_session(40);
}

TEST(Schedule, AnUnpackOfATensorKeepOnlyDroppedRecomputesItForThatBackwardAndCountsAMiss) {
  Stage stage(2, 0.1);
  const auto ref = reference(stage, 41);
  std::vector<CheckpointHandle> handles;
  auto mb = forward_collect(stage, 41, &handles);
  for (const auto& h : handles) attach(h, 41);
  TensorList dx;
  { SessionScope b(41, {true}); dx = b_pass(mb); }
  SavedTensorMask none;
  for (const auto& reads : pass_reads(41)) none.emplace_back(reads.size(), false);
  ASSERT_TRUE(keep_only(41, none));
  EXPECT_EQ(session_stats(41).current_bytes, 0);
  const int64_t before = recomputations();
  TensorList dw;
  { SessionScope w(41, {false}); dw = w_pass(mb, stage); }
  expect_all_equal(dx, ref.first);
  expect_all_equal(dw, ref.second);  // recomputed from the checkpoint's inputs, dropout masks and all
  EXPECT_EQ(recomputations() - before, 2) << "per graph task, once per checkpoint";
  EXPECT_GT(session_stats(41).trim_misses, 0);
  for (const auto& reads : pass_reads(41)) {
    EXPECT_GT(std::count(reads.begin(), reads.end(), true), 0) << "a miss is a read: the next mask keeps it";
  }
  clear_session(41);
}

TEST(Schedule, KeepOnlyAndPassReadsMisuse) {
  EXPECT_TRUE(pass_reads(42).empty()) << "no session 42";
  EXPECT_TRUE(keep_only(42, {})) << "nothing to keep of nothing";
  EXPECT_FALSE(keep_only(42, {{true}}));
  EXPECT_THROW(keep_only(-1, {}), std::invalid_argument);
  EXPECT_THROW(pass_reads(-1), std::invalid_argument);
  Stage stage(1, 0.0);
  std::vector<CheckpointHandle> handles;
  auto mb = forward_collect(stage, 42, &handles);
  attach(handles[0], 42);
  {
    SessionScope open(42, {true});
    EXPECT_THAT(message_of([&] { keep_only(42, pass_reads(42)); }), HasSubstr("open SessionScope"));
  }
  clear_session(42);
}

// ---- a pass that lets go of what the next pass will not read
// (Note [A pass lets go of what the next pass will not read]) ----

// What the W of the last block reads of a fresh session of `stage` (seed `seed`, session `id`).
SavedTensorMask w_last_block_reads(const Stage& stage, SessionId id, uint64_t seed) {
  std::vector<CheckpointHandle> handles;
  auto mb = forward_collect(stage, seed, &handles);
  for (const auto& h : handles) attach(h, id);
  b_then_w(stage, mb, id, nullptr);
  SavedTensorMask reads = pass_reads(id);
  clear_session(id);
  return reads;
}

TEST(Schedule, ABThatKnowsWhatWReadsLetsGoOfTheRestAsItUnpacksAndWRecomputesNothing) {
  Stage stage(3, 0.0);
  at::manual_seed(43);
  auto ref_mb = make_micro_batch(43);
  ref_mb.y = stage.forward(ref_mb.x, false);
  const TensorList ref_dx = b_pass(ref_mb);
  const TensorList ref_dw = w_last_block(ref_mb, stage);
  const SavedTensorMask reads = w_last_block_reads(stage, 43, 43);

  // The same B keeping everything, then trimmed after it ends.
  std::vector<CheckpointHandle> handles;
  auto whole = forward_collect(stage, 43, &handles);
  for (const auto& h : handles) attach(h, 43);
  { SessionScope b(43, {true}); b_pass(whole); }
  const int64_t whole_peak = session_stats(43).peak_bytes;
  ASSERT_TRUE(keep_only(43, reads));
  const int64_t kept = session_stats(43).current_bytes;
  clear_session(43);

  auto mb = forward_collect(stage, 43, &handles);
  for (const auto& h : handles) attach(h, 43);
  TensorList dx;
  {
    SessionScope b(43, {/*retain_on_unpack=*/true, /*next_pass_reads=*/reads});
    EXPECT_TRUE(b.lets_go());
    dx = b_pass(mb);
  }
  const SessionStats after_b = session_stats(43);
  EXPECT_EQ(after_b.current_bytes, kept) << "B ends holding what keep_only after it would leave";
  EXPECT_LT(after_b.peak_bytes, whole_peak) << "B held every block's recomputation until it ended";
  EXPECT_EQ(after_b.trim_misses, 0);
  EXPECT_EQ(after_b.lazy_recomputes, 3);
  const int64_t before = recomputations();
  TensorList dw;
  { SessionScope w(43, {false}); dw = w_last_block(mb, stage); }
  expect_all_equal(dx, ref_dx);
  expect_all_equal(dw, ref_dw);
  EXPECT_EQ(recomputations() - before, 0) << "W found what it reads";
  EXPECT_EQ(session_stats(43).trim_misses, 0);
  clear_session(43);
}

TEST(Schedule, ABThatUnpacksATensorItLetGoOfRecomputesItForItselfAndCountsAMiss) {
  CheckpointFn fn = [](const TensorList& in) { return TensorList{ReadsSavedTwice::apply(in[0].sin())}; };
  auto x = at::randn({4, kDim}).requires_grad_(true);
  const TensorList ref = grads(ReadsSavedTwice::apply(x.sin()), {x});
  HandleCollector collect;
  auto y = checkpoint(fn, {x})[0];
  attach(collect.handles()[0], 44);
  // W reads nothing: B lets go of both saved tensors (sin's input, exp's input) at their first unpack.
  const SavedTensorMask none{std::vector<bool>(2, false)};
  const int64_t before = recomputations();
  TensorList dx;
  {
    SessionScope b(44, {true, none});
    ASSERT_TRUE(b.lets_go());
    dx = grads(y, {x}, /*retain_graph=*/true);
  }
  expect_all_equal(dx, ref);
  EXPECT_EQ(session_stats(44).trim_misses, 1) << "exp's second unpack";
  EXPECT_EQ(recomputations() - before, 2) << "the session's, and the miss's for B's graph task";
  EXPECT_EQ(session_stats(44).current_bytes, 0);
  clear_session(44);
}

TEST(Schedule, AMaskThatDoesNotFitLetsNothingGoAndOneForALastPassIsRefused) {
  Stage stage(2, 0.0);
  const SavedTensorMask reads = w_last_block_reads(stage, 45, 45);
  std::vector<CheckpointHandle> handles;
  auto mb = forward_collect(stage, 45, &handles);
  for (const auto& h : handles) attach(h, 45);
  {
    SessionScope b(45, {true, SavedTensorMask(reads.begin(), reads.end() - 1)});
    EXPECT_FALSE(b.lets_go()) << "a mask for one checkpoint of two";
    b_pass(mb);
  }
  const SessionStats whole = session_stats(45);
  EXPECT_EQ(whole.current_bytes, whole.peak_bytes) << "B let go of something";
  EXPECT_THAT(message_of<std::invalid_argument>([&] { SessionScope w(45, {false, reads}); }),
              HasSubstr("retain_on_unpack"));
  { SessionScope w(45, {false}); w_last_block(mb, stage); }
  clear_session(45);
}

// ---- prefire -----------------------------------------------------------------------

TEST(Schedule, PrefireIsNoOpWhenAlreadyResident) {
  Stage stage(1);
  std::vector<CheckpointHandle> handles;
  auto mb = forward_collect(stage, 40, &handles);
  int64_t before = recomputations();
  EXPECT_EQ(prefire(handles[0], 40), PrefireStatus::kRecomputed);
  EXPECT_EQ(prefire(handles[0], 40), PrefireStatus::kAlreadyResident);
  EXPECT_EQ(recomputations() - before, 1);
  EXPECT_EQ(session_stats(40).prefires, 1);
  clear_session(40);
}

TEST(Schedule, PrefireOfExpiredHandleReportsExpiry) {
  std::vector<CheckpointHandle> handles;
  {
    Stage stage(1);
    auto mb = forward_collect(stage, 41, &handles);
    EXPECT_FALSE(handles[0].expired());
  }  // graph freed
  ASSERT_EQ(handles.size(), 1u);
  EXPECT_TRUE(handles[0].expired());
  EXPECT_EQ(prefire(handles[0], 41), PrefireStatus::kExpired);
  EXPECT_FALSE(attach(handles[0], 41));
}

TEST(Schedule, CheckpointRegisteredToAnotherSessionRaises) {
  Stage stage(1);
  std::vector<CheckpointHandle> handles;
  auto mb = forward_collect(stage, 42, &handles);
  prefire(handles[0], 42);
  const std::string message = message_of([&] { prefire(handles[0], 43); });
  EXPECT_THAT(message, HasSubstr("registered to session 42"));
  set_session_budget(43, 0);  // the conflict is reported even where the budget would refuse
  EXPECT_THROW(prefire(handles[0], 43), CheckpointError);
  set_session_budget(43, std::nullopt);
  clear_session(42);
  EXPECT_EQ(prefire(handles[0], 43), PrefireStatus::kRecomputed);
  clear_session(43);
}

TEST(Schedule, HandleCollectorsNestAndInnermostWins) {
  auto x = at::randn({3}).requires_grad_(true);
  CheckpointFn fn = [](const TensorList& in) { return TensorList{in[0].sin()}; };
  HandleCollector outer;
  auto a = checkpoint(fn, {x});
  {
    HandleCollector inner;
    auto b = checkpoint(fn, {x});
    auto c = checkpoint(fn, {x});
    EXPECT_EQ(inner.handles().size(), 2u);
  }
  auto d = checkpoint(fn, {x});
  EXPECT_EQ(outer.handles().size(), 2u);
  EXPECT_TRUE(outer.handles()[0].valid());
}

TEST(Schedule, CollectorsLeavingOutOfOrderLeaveTheOthersWorking) {
  auto x = at::randn({3}).requires_grad_(true);
  CheckpointFn fn = [](const TensorList& in) { return TensorList{in[0].sin()}; };
  auto outer = std::make_unique<HandleCollector>();
  auto inner = std::make_unique<HandleCollector>();
  outer.reset();  // below `inner`: unlinked where it is
  auto a = checkpoint(fn, {x});
  EXPECT_EQ(inner->handles().size(), 1u);
  {
    HandleCollector top;
    inner.reset();  // below `top`
    auto b = checkpoint(fn, {x});
    EXPECT_EQ(top.handles().size(), 1u);
  }
  auto c = checkpoint(fn, {x});  // no collector left: nothing to crash into
}

TEST(ScheduleDeathTest, CollectorDestroyedOnAnotherThreadIsAFatalMisuse) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(delete_on_another_thread(new HandleCollector()),
               "fatal misuse: a HandleCollector was destroyed on another thread");
}

TEST(ScheduleDeathTest, SessionScopeDestroyedOnAnotherThreadIsAFatalMisuse) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(delete_on_another_thread(new SessionScope(65)),
               "fatal misuse: the SessionScope of session 65 was destroyed on another thread");
}

// ---- budget --------------------------------------------------------------------------

TEST(Schedule, BudgetRefusesPrefireAndFrameStaysLazyWithCorrectGradients) {
  Stage stage(3, 0.1);
  auto ref = reference(stage, 50);
  std::vector<CheckpointHandle> handles;
  auto mb = forward_collect(stage, 50, &handles);
  // Measure one checkpoint's bytes, then allow two of three.
  prefire(handles[0], 51);
  int64_t one = session_stats(51).current_bytes;
  clear_session(51);
  ASSERT_GT(one, 0);
  set_session_budget(50, 2 * one);
  EXPECT_EQ(prefire(handles[0], 50), PrefireStatus::kRecomputed);
  EXPECT_EQ(prefire(handles[1], 50), PrefireStatus::kRecomputed);
  EXPECT_EQ(prefire(handles[2], 50), PrefireStatus::kRefusedOverBudget);
  int64_t before = recomputations();
  TensorList dx, dw;
  { SessionScope s(50, {true}); dx = b_pass(mb); }
  auto stats = session_stats(50);  // read while the graph lives
  { SessionScope s(50, {true}); dw = w_pass(mb, stage); }
  EXPECT_EQ(recomputations() - before, 2) << "the refused checkpoint recomputes once per pass";
  expect_all_equal(dx, ref.first);
  expect_all_equal(dw, ref.second);
  EXPECT_EQ(stats.current_bytes, 2 * one);
  EXPECT_EQ(stats.peak_bytes, 2 * one);
  EXPECT_EQ(stats.prefires, 2);
  EXPECT_EQ(stats.refused_prefires, 1);
  EXPECT_EQ(stats.lazy_recomputes, 0);
  EXPECT_GT(stats.hits, 0);
  EXPECT_EQ(stats.checkpoints, 2);
  EXPECT_EQ(stats.budget_bytes, 2 * one);
  clear_session(50);
  set_session_budget(50, std::nullopt);
}

TEST(Schedule, UnpackOutsideBackwardInsideSessionUsesTheSession) {
  struct Cube : torch::autograd::Function<Cube> {
    static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x) {
      ctx->save_for_backward({x});
      return x * x * x;
    }
    static TensorList backward(torch::autograd::AutogradContext* ctx, TensorList g) {
      auto x = ctx->get_saved_variables()[0];
      return {3 * x * x * g[0]};
    }
  };
  auto x = at::randn({5}).requires_grad_(true);
  std::vector<CheckpointHandle> handles;
  at::Tensor y;
  {
    HandleCollector collect;
    y = checkpoint([](const TensorList& in) { return TensorList{Cube::apply(in[0].sin())}; }, {x})[0];
    handles = collect.handles();
  }
  prefire(handles[0], 52);
  int64_t before = recomputations();
  auto* node = dynamic_cast<torch::autograd::CppNode<Cube>*>(y.grad_fn().get());
  ASSERT_NE(node, nullptr);
  {
    SessionScope s(52, {true});
    auto saved = node->ctx_.get_saved_variables();
    EXPECT_TRUE(at::equal(saved[0], x.sin()));
  }
  EXPECT_EQ(recomputations() - before, 0);
  EXPECT_EQ(session_stats(52).hits, 1);
  clear_session(52);
}

// ---- misuse --------------------------------------------------------------------------

TEST(Schedule, CheckpointInsideSessionScopeRaises) {
  auto x = at::randn({3}).requires_grad_(true);
  SessionScope s(60);
  const std::string message =
      message_of([&] { checkpoint([](const TensorList& in) { return TensorList{in[0].sin()}; }, {x}); });
  EXPECT_THAT(message, HasSubstr("created while a SessionScope is open on this thread"));
}

TEST(Schedule, NestedSessionScopesRaise) {
  SessionScope a(62);
  EXPECT_THROW(SessionScope b(63), CheckpointError);
  EXPECT_THROW(SessionScope c(62), CheckpointError);
}

TEST(Schedule, SecondScopeOfTheSameSessionOnAnotherThreadRaises) {
  SessionScope a(64);
  bool raised = false;
  std::thread other = pinned_thread([&] {
    try {
      SessionScope b(64);
    } catch (const CheckpointError&) {
      raised = true;
    }
  });
  other.join();
  EXPECT_TRUE(raised);
  EXPECT_THROW(clear_session(64), CheckpointError);  // while its scope is open
}

TEST(Schedule, InvalidArgumentsRaise) {
  CheckpointHandle nowhere;
  EXPECT_FALSE(nowhere.valid());
  EXPECT_THROW(prefire(nowhere, 1), std::invalid_argument);
  EXPECT_THROW(attach(nowhere, 1), std::invalid_argument);
  std::vector<CheckpointHandle> handles;
  Stage stage(1);
  auto mb = forward_collect(stage, 70, &handles);
  EXPECT_THROW(prefire(handles[0], -1), std::invalid_argument);
  EXPECT_THROW(attach(handles[0], -5), std::invalid_argument);
  EXPECT_THROW(SessionScope s(-1), std::invalid_argument);
  EXPECT_THROW(clear_session(-1), std::invalid_argument);
  EXPECT_THROW(session_stats(-1), std::invalid_argument);
  EXPECT_THROW(set_session_budget(-1, 10), std::invalid_argument);
  EXPECT_THROW(set_session_budget(70, -10), std::invalid_argument);
  EXPECT_STREQ(to_string(PrefireStatus::kRefusedOverBudget), "refused over budget");
}

}  // namespace
}  // namespace prefire::testing

namespace prefire::testing {
namespace {

TEST(Schedule, ObserverSeesLazyAndPrefireRecomputations) {
  std::mutex mu;
  std::vector<RecomputeEvent> events;
  set_recompute_observer([&](const RecomputeEvent& e) {
    std::lock_guard<std::mutex> lock(mu);
    events.push_back(e);
  });
  Stage stage(2, 0.0);
  std::vector<CheckpointHandle> handles;
  auto mb = forward_collect(stage, 80, &handles);
  prefire(handles[0], 80);  // the other stays lazy in the session
  attach(handles[1], 80);
  { SessionScope s(80, {false}); torch::autograd::grad({mb.y}, {mb.x}, {mb.gy}); }
  set_recompute_observer(nullptr);
  clear_session(80);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, RecomputeEvent::Kind::kPrefire);
  EXPECT_EQ(events[1].kind, RecomputeEvent::Kind::kLazy);
  for (const auto& e : events) {
    EXPECT_EQ(e.session, 80);
    EXPECT_LE(e.begin, e.end);
  }
}

}  // namespace
}  // namespace prefire::testing
