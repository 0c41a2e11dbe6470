// The split backward: backward_input (B) and WeightPass::run (W) give a plain
// backward's gradients bit for bit on plain graphs, graph-task-keyed
// checkpoints, sessions and nested checkpoints, with W on another thread;
// W runs only the weight part (one graph task); after B only what W needs is
// held; misuse raises clear errors.
//
// Not covered here: prefire-bench's schedules (check_bench_outputs.py), CUDA.

#include "test_support.h"

#include <prefire/split_backward.h>

#include <torch/csrc/autograd/function_hook.h>

#include <atomic>
#include <thread>

namespace prefire::testing {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kDim = 16;

struct Batch {
  at::Tensor x, gy;
};

Batch batch(uint64_t seed) {
  at::manual_seed(seed);
  return {at::randn({2, 5, kDim}).requires_grad_(true), at::randn({2, 5, kDim})};
}

/// dx and dw of one plain backward of the unchecked stage.
std::pair<TensorList, TensorList> plain(const Stage& stage, uint64_t seed) {
  auto b = batch(seed);
  at::manual_seed(seed + 100);
  auto y = stage.forward(b.x, false);
  auto params = stage.params();
  auto all = torch::autograd::grad({y}, concat({b.x}, params), {b.gy});
  return {TensorList(all.begin(), all.begin() + 1), TensorList(all.begin() + 1, all.end())};
}

int64_t recomputations() { return runtime_stats().recomputations; }

TEST(SplitBackward, PlainGraphGivesOneBackwardsGradientsBitForBit) {
  Stage stage(3);
  auto [dx_ref, dw_ref] = plain(stage, 1);
  auto b = batch(1);
  at::manual_seed(101);
  auto y = stage.forward(b.x, false);
  auto [dx, w] = backward_input({y}, {b.gy}, {b.x}, stage.params());
  EXPECT_TRUE(w.pending());
  expect_all_equal(dx, dx_ref);
  expect_all_equal(w.run(), dw_ref);
  EXPECT_FALSE(w.pending());
  EXPECT_FALSE(y.requires_grad()) << "the outputs' graph belongs to the weight pass";
}

TEST(SplitBackward, WeightPassOnAnotherThreadAndAccumulatedIntoGrad) {
  Stage stage(2);
  auto [dx_ref, dw_ref] = plain(stage, 2);
  auto b = batch(2);
  at::manual_seed(102);
  auto y = stage.forward(b.x, false);
  auto split = backward_input({y}, {b.gy}, {b.x}, stage.params());
  TensorList dw;
  pinned_thread([&] { dw = split.weight_pass.run(/*accumulate_into_grad=*/true); }).join();
  expect_all_equal(dw, dw_ref);
  auto params = stage.params();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(at::equal(params[i].grad(), dw_ref[i])) << "param " << i;
    params[i].mutable_grad().reset();
  }
}

// Accumulating is what a plain backward's AccumulateGrad does: under its
// lock (two W passes on two threads into one shared weight), running the
// parameter's hooks once per pass.
TEST(SplitBackward, WeightPassesAccumulateLikeAutogradFromTwoThreads) {
  auto w = param({kDim, kDim});
  std::atomic<int> before_accumulate{0}, after_accumulate{0};
  w.register_hook([counter = &before_accumulate](const at::Tensor& g) {
    ++*counter;
    return g;
  });
  struct Count final : torch::autograd::PostAccumulateGradHook {
    explicit Count(std::atomic<int>& n) : n_(n) {}
    void operator()(const torch::autograd::Variable&) override { ++n_; }
    std::atomic<int>& n_;
  };
  torch::autograd::impl::set_post_acc_grad_hooks(w, std::make_unique<Count>(after_accumulate));
  for (int iteration = 0; iteration < 200; ++iteration) {
    w.mutable_grad().reset();
    std::vector<SplitBackward> splits;
    for (int k = 0; k < 2; ++k) {
      auto x = at::randn({64, kDim}).requires_grad_(true);
      auto y = at::linear(x, w).sin();
      splits.push_back(backward_input({y}, {at::ones_like(y)}, {x}, {w}));
    }
    TensorList g0, g1;
    std::thread other = pinned_thread([&] { g1 = splits[1].weight_pass.run(/*accumulate_into_grad=*/true); });
    g0 = splits[0].weight_pass.run(/*accumulate_into_grad=*/true);
    other.join();
    // AccumulateGrad adds in either order; both orders of a sum of two are the same bits
    ASSERT_TRUE(at::equal(w.grad(), g0[0] + g1[0])) << "iteration " << iteration;
  }
  EXPECT_EQ(before_accumulate.load(), 400) << "the parameter's tensor hooks run once per pass";
  EXPECT_EQ(after_accumulate.load(), 400) << "post-accumulate-grad hooks run once per pass";
}

TEST(SplitBackward, WeightPassRunsOnlyTheWeightPart) {
  // y = sin(x W1^T) W2^T: B runs SinBackward and both matmuls' input parts;
  // W runs only the matmuls' weight parts. A hook on SinBackward's output
  // counts how often it runs.
  auto x = at::randn({4, 8}).requires_grad_(true);
  auto w1 = param({8, 8}), w2 = param({8, 8});
  auto h = at::linear(x, w1);
  auto s = h.sin();
  struct CountRuns final : torch::autograd::FunctionPreHook {
    explicit CountRuns(int* runs) : runs_(runs) {}
    TensorList operator()(const TensorList& grads) override {
      ++*runs_;
      return grads;
    }
    int* runs_;
  };
  int sin_runs = 0;
  s.grad_fn()->add_pre_hook(std::make_unique<CountRuns>(&sin_runs));
  auto y = at::linear(s, w2);
  auto gy = at::randn({4, 8});
  auto ref = torch::autograd::grad({at::linear(at::linear(x, w1).sin(), w2)}, {x, w1, w2}, {gy});
  auto [dx, w] = backward_input({y}, {gy}, {x}, {w1, w2});
  EXPECT_EQ(sin_runs, 1);
  auto dw = w.run();
  EXPECT_EQ(sin_runs, 1) << "the weight pass ran a node of the input part again";
  expect_all_equal(dx, {ref[0]});
  expect_all_equal(dw, {ref[1], ref[2]});
}

TEST(SplitBackward, SharedWeightAndOutputsOfTheWeightPartAlone) {
  // w is used twice (the gradient sums two contributions), and a second
  // output depends on the parameters only.
  auto x = at::randn({4, 8}).requires_grad_(true);
  auto w = param({8, 8}), v = param({8});
  auto forward = [&] {
    auto h = at::linear(at::linear(x, w).tanh(), w, v);
    return TensorList{h, (w * w).sum() + v.sum()};
  };
  auto gy = TensorList{at::randn({4, 8}), at::Tensor()};
  auto ref_out = forward();
  auto ref = torch::autograd::grad(ref_out, {x, w, v}, {gy[0], at::ones({})});
  auto out = forward();
  auto [dx, pass] = backward_input(out, gy, {x}, {w, v});
  expect_all_equal(dx, {ref[0]});
  expect_all_equal(pass.run(), {ref[1], ref[2]});
}

TEST(SplitBackward, GraphTaskCheckpointsRecomputeOnceInEachPass) {
  Stage stage(3);
  auto [dx_ref, dw_ref] = plain(stage, 3);
  auto b = batch(3);
  at::manual_seed(103);
  auto y = stage.forward(b.x, true);
  const int64_t before = recomputations();
  auto [dx, w] = backward_input({y}, {b.gy}, {b.x}, stage.params());
  EXPECT_EQ(recomputations() - before, 3);
  auto dw = w.run();
  EXPECT_EQ(recomputations() - before, 6) << "W is one graph task: one recomputation per checkpoint";
  expect_all_equal(dx, dx_ref);
  expect_all_equal(dw, dw_ref);
}

/// Forward with a collector, prefire into `session`, B under a retaining
/// scope; returns the weight pass and the session's bytes before and after B.
struct SessionSplit {
  TensorList dx;
  WeightPass w;
  int64_t bytes_before_b = 0, bytes_after_b = 0;
};

SessionSplit split_in_session(const Stage& stage, const Batch& b, SessionId session, bool prefired) {
  std::vector<CheckpointHandle> handles;
  at::Tensor y;
  {
    HandleCollector collect;
    y = stage.forward(b.x, true);
    handles = collect.handles();
  }
  for (const auto& h : handles) prefired ? (void)prefire(h, session) : (void)attach(h, session);
  SessionSplit s;
  s.bytes_before_b = session_stats(session).current_bytes;
  {
    SessionScope scope(session, {/*retain_on_unpack=*/true});
    auto result = backward_input({y}, {b.gy}, {b.x}, stage.params());
    s.dx = std::move(result.input_grads);
    s.w = std::move(result.weight_pass);
  }
  s.bytes_after_b = session_stats(session).current_bytes;
  return s;
}

TEST(SplitBackward, SessionRecomputesOnceAndHoldsOnlyTheWeightPassShareBetweenBAndW) {
  Stage stage(3);
  auto [dx_ref, dw_ref] = plain(stage, 4);
  auto b = batch(4);
  at::manual_seed(104);
  const int64_t before = recomputations();
  auto s = split_in_session(stage, b, 500, /*prefired=*/true);
  EXPECT_EQ(recomputations() - before, 3);
  EXPECT_GT(s.bytes_before_b, 0);
  EXPECT_LT(s.bytes_after_b, s.bytes_before_b) << "B's share of the recomputation outlived B";
  EXPECT_GT(s.bytes_after_b, 0) << "W's share is needed until W";
  TensorList dw;
  {
    SessionScope scope(500, {/*retain_on_unpack=*/false});
    dw = s.w.run();
  }
  EXPECT_EQ(recomputations() - before, 3) << "B and W share one recomputation per checkpoint";
  EXPECT_EQ(session_stats(500).current_bytes, 0);
  expect_all_equal(s.dx, dx_ref);
  expect_all_equal(dw, dw_ref);
  clear_session(500);
  EXPECT_EQ(runtime_stats().recomputed_bytes, 0);
}

TEST(SplitBackward, LazySessionWithTheWeightPassOnAnotherThread) {
  Stage stage(2);
  auto [dx_ref, dw_ref] = plain(stage, 5);
  auto b = batch(5);
  at::manual_seed(105);
  const int64_t before = recomputations();
  auto s = split_in_session(stage, b, 501, /*prefired=*/false);
  TensorList dw;
  {
    SessionScope scope(501, {false});
    pinned_thread([&] { dw = s.w.run(); }).join();
  }
  EXPECT_EQ(recomputations() - before, 2);
  expect_all_equal(s.dx, dx_ref);
  expect_all_equal(dw, dw_ref);
  clear_session(501);
}

TEST(SplitBackward, NestedCheckpointsInASession) {
  Block a(kDim, 0.1), c(kDim, 0.1);
  const TensorList params = concat(a.params(), c.params());
  auto b = batch(6);
  at::manual_seed(106);
  auto y_ref = c.forward(a.forward(b.x));
  auto ref = torch::autograd::grad({y_ref}, concat({b.x}, params), {b.gy});
  CheckpointFn both = [&](const TensorList& in) {
    return TensorList{checkpoint(c.fn(), {checkpoint(a.fn(), in)[0]})[0]};
  };
  at::manual_seed(106);
  std::vector<CheckpointHandle> handles;
  at::Tensor y;
  {
    HandleCollector collect;
    y = checkpoint(both, {b.x})[0];
    handles = collect.handles();
  }
  ASSERT_EQ(handles.size(), 1u);
  const int64_t before = recomputations();
  prefire(handles[0], 502);
  SplitBackward split;
  { SessionScope s(502, {true}); split = backward_input({y}, {b.gy}, {b.x}, params); }
  TensorList dw;
  { SessionScope s(502, {false}); dw = split.weight_pass.run(); }
  EXPECT_EQ(recomputations() - before, 3) << "outer and both nested checkpoints once each";
  expect_all_equal(split.input_grads, {ref[0]});
  expect_all_equal(dw, TensorList(ref.begin() + 1, ref.end()));
  clear_session(502);
}

TEST(SplitBackward, AfterBOnlyTheSavedTensorsTheWeightPassNeedsAreHeld) {
  // Unchecked: SavedTensorMeter counts what autograd saves; after B it drops
  // B's share, after W nothing.
  Stage stage(2, 0.0);
  auto b = batch(7);
  at::Tensor y;
  SavedTensorMeter meter;
  y = stage.forward(b.x, false);
  meter.stop();
  const int64_t all = meter.current_bytes();
  auto [dx, w] = backward_input({y}, {b.gy}, {b.x}, stage.params());
  const int64_t between = meter.current_bytes();
  EXPECT_LT(between, all) << "B's saved tensors outlived B";
  EXPECT_GT(between, 0);
  w.run();
  y.reset();
  EXPECT_EQ(meter.current_bytes(), 0) << "the weight pass left saved tensors behind";
}

// ---- misuse ------------------------------------------------------------------------------

TEST(SplitBackward, RunningTheWeightPassTwiceRaises) {
  Stage stage(1);
  auto b = batch(8);
  auto y = stage.forward(b.x, false);
  auto [dx, w] = backward_input({y}, {b.gy}, {b.x}, stage.params());
  w.run();
  EXPECT_THAT(message_of<std::logic_error>([&] { w.run(); }), HasSubstr("already ran"));
  WeightPass nowhere;
  EXPECT_FALSE(nowhere.pending());
  EXPECT_THAT(message_of<std::logic_error>([&] { nowhere.run(); }), HasSubstr("default-made"));
}

TEST(SplitBackward, WeightPassAfterItsGraphWasFreedRaisesSayingSo) {
  auto x = at::randn({4, 8}).requires_grad_(true);
  auto w1 = param({8, 8});
  auto h = at::linear(x, w1);  // its node computes both dx and dW: an intermediate
  auto y = h.sin();
  auto [dx, w] = backward_input({y}, {at::randn({4, 8})}, {x}, {w1});
  torch::autograd::grad({h}, {w1}, {at::ones({4, 8})});  // no retain_graph: frees h's node
  EXPECT_THAT(message_of<std::runtime_error>([&] { w.run(); }), HasSubstr("weight part of this graph was freed"));

  // the same backward keeping the graph frees nothing: W runs
  auto h2 = at::linear(x, w1);
  auto y2 = h2.sin();
  auto split = backward_input({y2}, {at::randn({4, 8})}, {x}, {w1});
  torch::autograd::grad({h2}, {w1}, {at::ones({4, 8})}, /*retain_graph=*/true);
  EXPECT_TRUE(split.weight_pass.run()[0].defined());
}

TEST(SplitBackward, AnotherHeadThroughTheInputPartAfterBRaisesInsteadOfLosingItsInputGradient) {
  auto x = at::randn({4, 8}).requires_grad_(true);
  auto w1 = param({8, 8});
  auto w2 = param({8, 8});
  auto h = at::linear(x, w1);  // an intermediate: leads to x and to w1
  auto y = at::linear(h.sin(), w2);
  auto aux = h.square().sum();  // a second head on h, not passed to backward_input
  auto gy = at::randn({4, 8});
  auto expected = torch::autograd::grad({y}, {w1, w2}, {gy}, /*retain_graph=*/true);
  auto [dx, w] = backward_input({y}, {gy}, {x}, {w1, w2});
  // before: x.grad silently undefined, where a plain backward defines it
  EXPECT_THAT(message_of<std::exception>([&] { aux.backward(); }),
              HasSubstr("a backward reached the input part of a graph that backward_input() already ran"));
  EXPECT_FALSE(x.grad().defined());
  EXPECT_FALSE(w1.grad().defined()) << "it stopped before running any node of the graph";
  expect_all_equal(w.run(), expected);  // W is intact
}

TEST(SplitBackward, AnotherHeadsGradWithInputsThroughTheInputPartRaisesInsteadOfAWrongGradient) {
  auto x = at::randn({4, 8}).requires_grad_(true);
  auto w1 = param({8, 8});
  auto w2 = param({8, 8});
  auto h = at::linear(x, w1);
  auto y = at::linear(h.sin(), w2);
  auto aux = (h.sin() * 3 + x).sum();  // reaches x directly too: along that edge it still has a gradient
  auto gy = at::randn({4, 8});
  auto expected = torch::autograd::grad({y}, {w1, w2}, {gy}, /*retain_graph=*/true);
  auto aux_dw1 = torch::autograd::grad({aux}, {w1}, {}, /*retain_graph=*/true);
  auto [dx, w] = backward_input({y}, {gy}, {x}, {w1, w2});
  // before: the engine saw the cut edge lead nowhere and returned dx along x's own edge alone, without a word
  EXPECT_THAT(message_of<std::exception>([&] { torch::autograd::grad({aux}, {x}, {}, /*retain_graph=*/true); }),
              HasSubstr("a backward reached the input part of a graph that backward_input() already ran"));
  // h's own weight is reached without a cut edge: exact
  expect_all_equal(torch::autograd::grad({aux}, {w1}, {}, /*retain_graph=*/true), aux_dw1);
  expect_all_equal(w.run(), expected);
}

TEST(SplitBackward, TensorHooksAndRetainGradRunOnceAsInOnePlainBackward) {
  const TensorList w = {param({8, 8}), param({8, 8}), param({8, 8})};
  at::manual_seed(12);
  const auto x0 = at::randn({4, 8});
  const auto gy = at::randn({4, 8});
  struct Got {
    TensorList grads;  // dx, dw...
    at::Tensor a_grad;
    int hook_calls = 0;
  };
  auto step = [&](bool split) {
    Got got;
    for (const auto& p : w) p.mutable_grad() = at::Tensor();
    auto x = x0.clone().requires_grad_(true);
    auto a = at::linear(x, w[0]);  // intermediates: each leads to x and to a weight
    auto b = at::linear(a.tanh(), w[1]);
    a.retain_grad();
    b.register_hook([&](const at::Tensor& g) {
      ++got.hook_calls;
      return g * 2;  // changes what reaches w[1] and everything below b
    });
    auto y = at::linear(b.sin(), w[2]);
    if (split) {
      auto [dx, pass] = backward_input({y}, {gy}, {x}, w);
      pass.run(/*accumulate_into_grad=*/true);
      got.grads = dx;
    } else {
      y.backward(gy);
      got.grads = {x.grad()};
    }
    for (const auto& p : w) got.grads.push_back(p.grad());
    got.a_grad = a.grad();
    return got;
  };
  const Got plain = step(false);
  const Got split = step(true);
  ASSERT_EQ(plain.hook_calls, 1);
  EXPECT_EQ(split.hook_calls, 1) << "B and W each ran b's hook";
  expect_all_equal(split.grads, plain.grads);  // the hook's doubling reaches W's weight gradients once
  ASSERT_TRUE(split.a_grad.defined());
  EXPECT_TRUE(at::equal(split.a_grad, plain.a_grad)) << "retain_grad accumulated in B and in W";
}

TEST(SplitBackward, ParametersOutsideTheGraphAndBadArgumentsRaise) {
  Stage stage(1);
  auto b = batch(9);
  auto y = stage.forward(b.x, false);
  auto unused = param({3});
  auto params = concat(stage.params(), {unused});
  EXPECT_THAT(message_of<std::invalid_argument>([&] { backward_input({y}, {b.gy}, {b.x}, params); }),
              HasSubstr("parameter 10 is not part of the graph"));
  EXPECT_THAT(message_of<std::invalid_argument>([&] { backward_input({y}, {}, {b.x}, stage.params()); }),
              HasSubstr("0 grad_outputs for 1 outputs"));
  EXPECT_THAT(message_of<std::invalid_argument>([&] { backward_input({y}, {at::Tensor()}, {b.x}, stage.params()); }),
              HasSubstr("ones are implied for one-element outputs only"));
  EXPECT_THAT(
      message_of<std::invalid_argument>([&] { backward_input({y}, {b.gy}, {b.x}, {at::randn({3})}); }),
      HasSubstr("parameter 0 does not require grad"));
  EXPECT_THAT(message_of<std::invalid_argument>([&] { backward_input({y}, {b.gy}, {b.x}, {b.x}); }),
              HasSubstr("also one of the inputs"));
}

}  // namespace
}  // namespace prefire::testing
