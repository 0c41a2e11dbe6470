#pragma once

// A split backward for LibTorch, as zero-bubble pipeline schedules run it:
// an input-gradient pass (B) now, and a weight-gradient pass (W) later that
// runs only the weight part of the graph (the weight GEMMs, the weight part of
// LayerNorm, and what leads from them to the parameters), on any thread.
//
//   auto [dx, w] = prefire::backward_input({y}, {gy}, {x}, params);  // B
//   ...                                                           // other micro-batches
//   prefire::TensorList dw = w.run();                                // W
//
// Checkpoints work in both passes: keyed by graph task they recompute in each
// pass; registered to a session and run under its SessionScope (retain the
// recomputation in B, release it in W) they recompute once. Between B and W
// only what W needs stays alive: see Note [Memory that follows the passes]
// in src/split_backward/split_backward.cpp.

#include <prefire/checkpoint.h>

#include <memory>

namespace prefire {

namespace detail {
struct WeightPassState;
}

/// The W pass of one backward_input(): made by it, run once.
class WeightPass {
 public:
  /// A pass from nowhere: run() raises.
  WeightPass();
  ~WeightPass();
  WeightPass(WeightPass&&) noexcept;
  WeightPass& operator=(WeightPass&&) noexcept;

  /// Computes the gradients of the parameters given to backward_input(), in
  /// their order, executing only the nodes between the gradients B captured
  /// and the parameters; with `accumulate_into_grad`, also adds each into its
  /// parameter's grad() as a plain backward does (through the parameter's
  /// AccumulateGrad: its lock, so passes on several threads may share a
  /// weight, its post-accumulate-grad hooks, the gradient layout contract; the
  /// parameter's tensor hooks run once, on the gradient returned too).
  /// Bit-equal to what one plain backward would give.
  ///
  /// Once: a second run raises std::logic_error, as does a default-made pass.
  /// When the graph's weight part was freed meanwhile (a backward without
  /// retain_graph through activations of this graph), raises
  /// std::runtime_error saying so. Any thread; frees the weight part of the
  /// graph as it runs, like a backward without retain_graph.
  TensorList run(bool accumulate_into_grad = false);

  /// Whether run() can still be called.
  bool pending() const;

 private:
  friend struct SplitBackwardAccess;
  std::unique_ptr<detail::WeightPassState> state_;
};

struct SplitBackward {
  TensorList input_grads;  ///< by input; undefined for an input that needs no gradient
  WeightPass weight_pass;
};

/// The B pass: the gradients of `outputs`, seeded with `grad_outputs`, with
/// respect to `inputs`, and a WeightPass for `params`. B computes the input
/// gradients and captures the gradients arriving at the nodes where the
/// graph turns towards the parameters; nothing runs on the weight-only part.
///
/// * `grad_outputs` has one entry per output, of its shape; an undefined one
///   stands for ones, for a one-element output only.
/// * Every parameter must require grad and take part in the graph of
///   `outputs`; std::invalid_argument names the one that does not.
/// * Afterwards the graph belongs to the W pass: the outputs are detached
///   (views excepted: do not backward through them again), and every saved
///   tensor W will not unpack is released, recomputed tensors of checkpoints
///   included. Another backward that reaches the input part through an
///   activation of the graph (an auxiliary head not passed here) raises
///   std::runtime_error naming backward_input, where its input gradients
///   would otherwise be lost: differentiate all outputs in one call.
/// * Checkpoints: run it under a SessionScope with retain_on_unpack=true and
///   the W pass under one with retain_on_unpack=false to recompute each
///   checkpoint once for both passes.
SplitBackward backward_input(const TensorList& outputs, const TensorList& grad_outputs, const TensorList& inputs,
                             const TensorList& params);

}  // namespace prefire
