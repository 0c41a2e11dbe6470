// Checkpoint gradients, recompute counts and memory: the checkpointed block
// gives the unchecked block's gradients bit for bit, recomputes once per
// backward, and keeps none of its intermediates.
//
// Not covered here: RNG/autocast/context hooks and error paths
// (checkpoint_semantics_test.cpp), sessions and prefire (scheduling tests),
// CUDA (cuda tests).

#include "test_support.h"

#include <thread>

namespace prefire::testing {
namespace {

constexpr int64_t kDim = 16;

at::Tensor input(int64_t batch = 2, int64_t seq = 5) { return at::randn({batch, seq, kDim}).requires_grad_(true); }

TEST(CheckpointGradients, EqualUncheckedBitForBitForInputsAndParameters) {
  at::manual_seed(1);
  Block block(kDim, /*dropout=*/0.2);
  auto x = input();
  auto wrt = concat({x}, block.params());

  at::manual_seed(7);
  auto expected = grads(block.forward(x), wrt);
  at::manual_seed(7);
  auto y = checkpoint(block.fn(), {x})[0];
  auto actual = grads(y, wrt);
  expect_all_equal(actual, expected);
}

TEST(CheckpointGradients, RecomputesOncePerBackward) {
  at::manual_seed(2);
  Block block(kDim);
  std::atomic<int> runs{0};
  auto y = checkpoint(counted(block.fn(), runs), {input()})[0];
  EXPECT_EQ(runs, 1);  // forward
  grads(y, block.params());
  EXPECT_EQ(runs, 2);  // one recomputation for all saved tensors of the block
}

TEST(CheckpointGradients, IntermediatesFreedAfterForward) {
  at::manual_seed(3);
  Block block(kDim, 0.0);
  StorageWatch watch;
  CheckpointFn fn = [&](const TensorList& in) {
    auto h = at::gelu(at::linear(in[0], block.w1, block.b1));
    auto z = at::linear(h.sin(), block.w2, block.b2);
    watch.watch(h);
    return TensorList{z.tanh()};
  };
  auto x = input();
  auto y = checkpoint(fn, {x})[0];
  EXPECT_EQ(watch.size(), 1u);
  EXPECT_EQ(watch.alive(), 0u) << "the block's intermediate is still held after a checkpointed forward";
  grads(y, {x});

  // The same function unchecked keeps it alive for backward: the watch works.
  watch.clear();
  auto y2 = fn({x})[0];
  EXPECT_EQ(watch.alive(), 1u);
}

TEST(CheckpointGradients, FrameInputsAreSavedThroughAutograd) {
  // The inner checkpoint's input is an intermediate of the outer function.
  // Held as a plain reference by the inner frame, it would outlive the outer
  // forward; saved through autograd, the outer frame drops it.
  at::manual_seed(4);
  Block block(kDim, 0.0);
  StorageWatch watch;
  CheckpointFn inner = [&](const TensorList& in) { return TensorList{at::linear(in[0], block.wq).sin()}; };
  CheckpointFn outer = [&](const TensorList& in) {
    auto h = at::linear(in[0], block.wk).cos();
    watch.watch(h);
    auto z = checkpoint(inner, {h})[0];
    return TensorList{at::linear(z, block.wv)};
  };
  auto x = input();
  auto wrt = concat({x}, {block.wq, block.wk, block.wv});
  auto expected_y = at::linear(at::linear(at::linear(x, block.wk).cos(), block.wq).sin(), block.wv);
  auto expected = grads(expected_y, wrt);

  auto y = checkpoint(outer, {x})[0];
  EXPECT_EQ(watch.alive(), 0u) << "the nested frame keeps the outer's intermediate alive";
  expect_all_equal(grads(y, wrt), expected);
}

TEST(CheckpointGradients, NestedCheckpointsEqualUnchecked) {
  at::manual_seed(5);
  Block a(kDim, 0.1), b(kDim, 0.1);
  auto x = input();
  auto wrt = concat(concat({x}, a.params()), b.params());
  auto both = [&](const TensorList& in) {
    auto h = checkpoint(a.fn(), in)[0];
    return TensorList{checkpoint(b.fn(), {h.sin()})[0]};
  };
  at::manual_seed(9);
  auto expected = grads(b.forward(a.forward(x).sin()), wrt);
  at::manual_seed(9);
  auto y = checkpoint(both, {x})[0];
  expect_all_equal(grads(y, wrt), expected);
}

TEST(CheckpointGradients, PartialBackwardForASubsetOfInputs) {
  at::manual_seed(6);
  Block block(kDim, 0.0);
  auto x = input();
  auto expected = grads(block.forward(x), {x});
  auto y = checkpoint(block.fn(), {x})[0];
  expect_all_equal(grads(y, {x}), expected);
}

TEST(CheckpointGradients, RecomputedTensorsReleasedWhenGraphTaskEnds) {
  // A backward that needs only part of the block still recomputes all of it;
  // what it never unpacks must not outlive the backward.
  at::manual_seed(7);
  Block block(kDim, 0.0);
  StorageWatch recomputed;
  std::atomic<int> runs{0};
  CheckpointFn fn = [&](const TensorList& in) {
    auto la = at::linear(in[0], block.wq);  // saved by sin: unpacked by a backward wrt in[0]
    auto lb = at::linear(in[1], block.wk);  // saved by cos: never unpacked by it
    if (runs++ > 0) {
      recomputed.watch(la);
      recomputed.watch(lb);
    }
    return TensorList{la.sin(), lb.cos()};
  };
  auto x0 = input(), x1 = input();
  auto outs = checkpoint(fn, {x0, x1});
  auto y = outs[0] + outs[1];
  grads(y, {x0}, /*retain_graph=*/true);
  EXPECT_EQ(runs, 2);
  EXPECT_EQ(recomputed.alive(), 0u) << "tensors recomputed for a finished backward are still held";
}

TEST(CheckpointGradients, RetainGraphSecondBackwardRecomputesAgain) {
  at::manual_seed(8);
  Block block(kDim, 0.2);
  auto x = input();
  auto wrt = concat({x}, block.params());
  at::manual_seed(3);
  auto expected = grads(block.forward(x), wrt);
  std::atomic<int> runs{0};
  at::manual_seed(3);
  auto y = checkpoint(counted(block.fn(), runs), {x})[0];
  expect_all_equal(grads(y, wrt, /*retain_graph=*/true), expected);
  expect_all_equal(grads(y, wrt), expected);
  EXPECT_EQ(runs, 3);
}

TEST(CheckpointGradients, TwoThreadsCheckpointAndBackpropagateConcurrently) {
  // No dropout: the CPU generator is process-wide (see checkpoint.h).
  at::manual_seed(9);
  Block blocks[2] = {Block(kDim, 0.0), Block(kDim, 0.0)};
  at::Tensor xs[2] = {input(), input()};
  TensorList expected[2], actual[2];
  for (int t = 0; t < 2; ++t) expected[t] = grads(blocks[t].forward(xs[t]), concat({xs[t]}, blocks[t].params()));

  auto work = [&](int t) {
    for (int iter = 0; iter < 20; ++iter) {
      auto h = checkpoint(blocks[t].fn(), {xs[t]})[0];
      auto y = checkpoint([](const TensorList& in) { return TensorList{in[0] * 1.0}; }, {h})[0];
      actual[t] = grads(y, concat({xs[t]}, blocks[t].params()));
    }
  };
  std::thread a = pinned_thread(work, 0), b = pinned_thread(work, 1);
  a.join();
  b.join();
  for (int t = 0; t < 2; ++t) expect_all_equal(actual[t], expected[t]);
}

TEST(CheckpointGradients, UnpackOutsideBackwardUsesAPrivateKey) {
  // A custom function whose saved tensor is read outside any backward: the
  // checkpoint recomputes for that read alone, every time.
  struct Square : torch::autograd::Function<Square> {
    static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x) {
      ctx->save_for_backward({x});
      return x * x;
    }
    static TensorList backward(torch::autograd::AutogradContext* ctx, TensorList g) {
      auto x = ctx->get_saved_variables()[0];
      return {2 * x * g[0]};
    }
  };
  at::manual_seed(10);
  auto x = input();
  std::atomic<int> runs{0};
  CheckpointFn fn = [&](const TensorList& in) {
    ++runs;
    return TensorList{Square::apply(in[0].sin())};
  };
  auto y = checkpoint(fn, {x})[0];
  auto* node = dynamic_cast<torch::autograd::CppNode<Square>*>(y.grad_fn().get());
  ASSERT_NE(node, nullptr);
  for (int i = 0; i < 2; ++i) {
    auto saved = node->ctx_.get_saved_variables();
    ASSERT_EQ(saved.size(), 1u);
    EXPECT_TRUE(at::equal(saved[0], x.sin()));
  }
  EXPECT_EQ(runs, 3);
  expect_all_equal(grads(y, {x}), grads(Square::apply(x.sin()), {x}));
}

TEST(CheckpointGradients, NoGradModeRunsFunctionPlainly) {
  Block block(kDim);
  std::atomic<int> runs{0};
  c10::NoGradGuard no_grad;
  auto y = checkpoint(counted(block.fn(), runs), {input()})[0];
  EXPECT_EQ(runs, 1);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_EQ(y.grad_fn(), nullptr);
}

TEST(CheckpointGradients, NothingRequiringGradKeepsNoFrame) {
  std::atomic<int> runs{0};
  StorageWatch watch;
  auto x = at::randn({3, 4});
  CheckpointFn fn = [&](const TensorList& in) {
    ++runs;
    auto h = in[0].sin();
    watch.watch(h);
    return TensorList{h.cos()};
  };
  auto y = checkpoint(fn, {x})[0];
  EXPECT_FALSE(y.requires_grad());
  EXPECT_EQ(runs, 1);
  EXPECT_EQ(watch.alive(), 0u);
}

}  // namespace
}  // namespace prefire::testing
