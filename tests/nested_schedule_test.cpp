// Scheduling a stage whose checkpoints nest (2 and 3 levels): collectors see
// only the outermost checkpoints, prefire and attach take the nested ones
// along, each checkpoint recomputes once per micro-batch, shared by B and W,
// with gradients equal to the unchecked stage bit for bit; a failing prefire
// leaves nothing registered.
//
// Not covered here: flat stages (schedule_test.cpp), concurrency
// (concurrency_test.cpp), random schedules (random_schedules.cpp).

#include "test_support.h"

#include <map>

namespace prefire::testing {
namespace {

constexpr int64_t kDim = 8;

/// Blocks grouped into checkpoints `levels` deep: the outermost checkpoint
/// covers every block, each level splits its range in two, and the innermost
/// level checkpoints single blocks (4 blocks, 3 levels: 1 + 2 + 4 = 7).
struct NestedStage {
  std::vector<Block> blocks;
  int levels;
  std::map<std::pair<size_t, size_t>, std::atomic<int>> runs;  // by block range: runs of that checkpoint's function
  std::function<void(size_t, size_t)> on_run;                  // called at every run, before the work

  NestedStage(int num_blocks, int nesting_levels) : levels(nesting_levels) {
    for (int i = 0; i < num_blocks; ++i) blocks.emplace_back(kDim, 0.1);
  }

  TensorList params() const {
    TensorList all;
    for (const auto& b : blocks) all = concat(all, b.params());
    return all;
  }

  at::Tensor plain(at::Tensor x) const {
    for (const auto& b : blocks) x = b.forward(x);
    return x;
  }

  at::Tensor checkpointed(const at::Tensor& x) { return range(0, blocks.size(), levels, x); }

  int checkpoints() const {
    int n = 0;
    for (int level = 0, width = 1; level < levels; ++level, width *= 2) n += std::min<int>(width, blocks.size());
    return n;
  }

 private:
  at::Tensor range(size_t begin, size_t end, int depth, at::Tensor x) {
    if (depth == 0) {
      for (size_t i = begin; i < end; ++i) x = blocks[i].forward(x);
      return x;
    }
    CheckpointFn fn = [this, begin, end, depth](const TensorList& in) {
      ++runs[{begin, end}];
      if (on_run) on_run(begin, end);
      const size_t mid = begin + (end - begin + 1) / 2;
      if (end - begin == 1) return TensorList{range(begin, end, 0, in[0])};
      at::Tensor h = range(begin, mid, depth - 1, in[0]);
      return TensorList{range(mid, end, depth - 1, h)};
    };
    return checkpoint(fn, {x})[0];
  }
};

struct Pass {
  at::Tensor x, gy;
};

Pass make_input(uint64_t seed) {
  at::manual_seed(seed);
  return {at::randn({2, 3, kDim}).requires_grad_(true), at::randn({2, 3, kDim})};
}

TensorList b_pass(const Pass& p, const at::Tensor& y) { return torch::autograd::grad({y}, {p.x}, {p.gy}, true); }
TensorList w_pass(const Pass& p, const at::Tensor& y, const TensorList& params) {
  return torch::autograd::grad({y}, params, {p.gy}, false, false, true);
}

/// A checkpointed forward of `seed`'s input and the handles it collected.
struct Collected {
  Pass p;
  at::Tensor y;
  std::vector<CheckpointHandle> handles;
};

Collected forward_collected(NestedStage& stage, uint64_t seed) {
  Collected c{make_input(seed), {}, {}};
  at::manual_seed(seed + 100);
  HandleCollector collect;
  c.y = stage.checkpointed(c.p.x);
  c.handles = collect.handles();
  return c;
}

std::pair<TensorList, TensorList> reference(const NestedStage& stage, uint64_t seed) {
  auto p = make_input(seed);
  at::manual_seed(seed + 100);
  auto y = stage.plain(p.x);
  auto dx = b_pass(p, y);
  return {dx, w_pass(p, y, stage.params())};
}

int total_runs(NestedStage& stage) {
  int n = 0;
  for (auto& [range, count] : stage.runs) n += count;
  return n;
}

class NestedSchedule : public ::testing::TestWithParam<int> {};  // nesting levels

TEST_P(NestedSchedule, CollectorSeesOnlyTheOutermostCheckpoint) {
  NestedStage stage(4, GetParam());
  auto [p, y, handles] = forward_collected(stage, 1);
  ASSERT_EQ(handles.size(), 1u);
  EXPECT_FALSE(handles[0].expired());
}

TEST_P(NestedSchedule, PrefireRecomputesEveryCheckpointOnceForBothPassesBitForBit) {
  NestedStage stage(4, GetParam());
  auto [dx_ref, dw_ref] = reference(stage, 2);
  auto [p, y, handles] = forward_collected(stage, 2);
  ASSERT_EQ(handles.size(), 1u);
  at::rand({50});  // other random work between forward and prefire
  const int64_t before = runtime_stats().recomputations;
  EXPECT_EQ(prefire(handles[0], 200), PrefireStatus::kRecomputed);
  EXPECT_EQ(runtime_stats().recomputations - before, stage.checkpoints());
  EXPECT_EQ(session_stats(200).checkpoints, stage.checkpoints());
  EXPECT_EQ(session_stats(200).hits, 0) << "a nested prefire's inputs taken from its parent's are not hits";
  EXPECT_EQ(prefire(handles[0], 200), PrefireStatus::kAlreadyResident);
  TensorList dx, dw;
  { SessionScope s(200, {true}); dx = b_pass(p, y); }
  { SessionScope s(200, {false}); dw = w_pass(p, y, stage.params()); }
  EXPECT_EQ(runtime_stats().recomputations - before, stage.checkpoints())
      << "B and W share the one recomputation of every checkpoint, nested ones included";
  EXPECT_EQ((stage.runs[{0, 4}]), 2) << "the outer checkpoint ran at forward and once more, for the prefire";
  expect_all_equal(dx, dx_ref);
  expect_all_equal(dw, dw_ref);
  EXPECT_EQ(session_stats(200).prefires, stage.checkpoints());
  EXPECT_EQ(session_stats(200).lazy_recomputes, 0);
  clear_session(200);
  EXPECT_EQ(runtime_stats().recomputed_bytes, 0);
}

TEST_P(NestedSchedule, AttachRecomputesEachCheckpointOnceInBAndReusesInW) {
  NestedStage stage(4, GetParam());
  auto [dx_ref, dw_ref] = reference(stage, 3);
  auto [p, y, handles] = forward_collected(stage, 3);
  ASSERT_TRUE(attach(handles[0], 201));
  const int64_t before = runtime_stats().recomputations;
  TensorList dx, dw;
  { SessionScope s(201, {true}); dx = b_pass(p, y); }
  EXPECT_EQ(runtime_stats().recomputations - before, stage.checkpoints());
  { SessionScope s(201, {false}); dw = w_pass(p, y, stage.params()); }
  EXPECT_EQ(runtime_stats().recomputations - before, stage.checkpoints());
  EXPECT_EQ(session_stats(201).lazy_recomputes, stage.checkpoints());
  expect_all_equal(dx, dx_ref);
  expect_all_equal(dw, dw_ref);
  clear_session(201);
}

TEST_P(NestedSchedule, WithoutSessionEveryPassRecomputesEveryCheckpoint) {
  NestedStage stage(4, GetParam());
  auto [dx_ref, dw_ref] = reference(stage, 4);
  auto p = make_input(4);
  at::manual_seed(4 + 100);
  auto y = stage.checkpointed(p.x);
  const int64_t before = runtime_stats().recomputations;
  expect_all_equal(b_pass(p, y), dx_ref);
  expect_all_equal(w_pass(p, y, stage.params()), dw_ref);
  EXPECT_EQ(runtime_stats().recomputations - before, 2 * stage.checkpoints());
}

TEST_P(NestedSchedule, FailingPrefireLeavesNothingRegistered) {
  NestedStage stage(4, GetParam());
  auto [dx_ref, dw_ref] = reference(stage, 5);
  auto [p, y, handles] = forward_collected(stage, 5);
  // The innermost checkpoint of the last block fails once when recomputed.
  const int forward_runs = total_runs(stage);
  bool failed = false;
  stage.on_run = [&](size_t begin, size_t end) {
    if (!failed && total_runs(stage) > forward_runs && end == 4 && begin == 4u - (4u >> (GetParam() - 1))) {
      failed = true;
      throw std::runtime_error("injected failure in recompute");
    }
  };
  EXPECT_THROW(prefire(handles[0], 202), std::runtime_error);
  EXPECT_TRUE(failed);
  auto stats = session_stats(202);
  EXPECT_EQ(stats.checkpoints, 0) << "a failing prefire left checkpoints registered";
  EXPECT_EQ(stats.current_bytes, 0);
  EXPECT_EQ(runtime_stats().recomputed_bytes, 0);
  // Nothing is bound to the session: the passes recompute per graph task and are right.
  { SessionScope s(202, {true}); expect_all_equal(b_pass(p, y), dx_ref); }
  expect_all_equal(w_pass(p, y, stage.params()), dw_ref);
  clear_session(202);
}

INSTANTIATE_TEST_SUITE_P(Levels, NestedSchedule, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return std::to_string(info.param) + "Levels"; });

}  // namespace
}  // namespace prefire::testing
