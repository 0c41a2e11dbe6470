// Note [Splitting backward into B and W]
// The graph of a stage's outputs splits into three parts (nodes named by
// where their gradients go):
//   * I, the nodes that lead to an input: B must run them;
//   * the weight part: nodes that lead to a parameter but to no input;
//   * the intermediates: nodes of I with an edge into the weight part (a
//     linear's MmBackward, LayerNorm's backward). They compute the input
//     gradient and the weight gradient from the same incoming gradient.
// (PyTorch's torch/distributed/pipelining/_backward.py finds the same
// intermediates.) B runs the engine from the outputs with the inputs and the
// intermediates' inputs as captured outputs, so it executes I and stops at
// the weight part, capturing the gradient that arrives at every
// intermediate. W runs the engine once, from the intermediates seeded with
// those gradients, towards the parameters. Before W, every edge from an
// intermediate back into I is cut: an intermediate then computes only its
// weight outputs in W, no intermediate feeds another (nothing is counted
// twice, nothing of B runs again), and W is one graph task, so a checkpoint
// keyed by graph task recomputes once in W. Outputs whose own node leads to
// no input (a loss of the parameters alone) seed W with their gradient.
//
// Note [Backward through what B consumed raises]
// A cut edge would make any other backward through an intermediate (an
// auxiliary head on an activation of this graph, not passed to
// backward_input) lose its gradients into I without a word: x.grad stays
// undefined where a plain backward defines it. So an intermediate's cut
// edges lead to a node of its own, ConsumedByBackwardInput, that raises
// when run, and the intermediate gets a pre-hook that raises, naming
// backward_input, when the running backward needs a gradient along one of
// its cut edges (Node::task_should_compute_output): the backward stops
// before the intermediate runs, so it accumulates nothing there and W is
// intact. Until W begins, the consumed node leads where the cut edges led:
// a backward with `inputs` (autograd.grad) computes what it needs from the
// graph's edges, and with dead ends there an intermediate that leads to an
// input only through a cut edge looked unneeded, was skipped, and the
// backward returned a wrong gradient without a word (the first version; the
// random schedules found it: dx of an auxiliary head through the input
// part). W begins by making the consumed nodes dead ends: W needs none of
// the cut edges (its gradients along them went to I in B), nor does a
// backward towards parameters reached without a cut edge (autograd.grad(h,
// w) of the intermediate's own weight), which gets its exact gradients.
// (Other nodes of I run as in any second
// backward: those whose saved tensors B released raise torch's own error.)
// Exact gradients along the cut edges would need I kept alive until W, which
// is the memory the split frees (Note [Memory that follows the passes]).
//
// Note [Hooks run once across B and W]
// An intermediate runs in both passes (its input gradient in B, its weight
// gradient in W), and the engine runs a node's tensor pre-hooks (a
// register_hook on the activation it produced, retain_grad) each time it
// runs it: twice, where one plain backward runs them once. And B's capture
// of the gradient arriving at an intermediate it runs is taken before those
// hooks, so a hook that changes the gradient would not reach W. So B
// appends to every intermediate a pre-hook of its own that records the
// gradients after the others ran (removed when B ends), W is seeded with
// those, and W takes the intermediates' tensor pre-hooks and retain_grad
// hooks off before it runs (they ran in B; the graph is freed by W).
//
// Note [A freed weight part is seen, not guessed]
// A backward without retain_graph through an activation of the graph between
// B and W (autograd.grad(h, w) on a graph B already ran) frees the saved
// tensors of the nodes it runs, W's among them; W would then fail inside the
// engine with autograd's message about a second backward. Rather than
// recognising that message, every node W runs carries a pre-hook that, in a
// backward other than W (W has not begun) that does not keep the graph
// (get_current_graph_task_keep_graph), notes that W's part was freed; W
// checks the note before it runs and raises saying what happened.
//
// Note [Memory that follows the passes]
// After B, the nodes of I that W does not run (everything but the
// intermediates and the input nodes, which may belong to a previous stage)
// release their saved tensors, and the outputs are detached, so B's part of
// the graph holds nothing from B to W. A checkpoint learns of it through its
// saved tensors' destruction (Frame::release) and drops the recomputed
// tensors that no live saved tensor refers to: a session holds only W's share
// between the passes. W runs with keep_graph=false and frees its part.

#include <prefire/split_backward.h>

#include "profiling/nvtx.h"
#include "split_backward/stage_graph.h"

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace prefire {

using torch::autograd::Edge;
using torch::autograd::Node;
using NodeRef = decltype(Edge::function);  // the engine's owning pointer to a node

namespace detail {

/// Whether a backward other than W freed part of what W runs (Note [A freed
/// weight part is seen, not guessed]).
struct WeightPartWatch {
  std::atomic<bool> w_began{false};
  std::atomic<bool> freed{false};
};

struct WeightPassState {
  std::mutex mu;
  bool ran = false;
  std::shared_ptr<WeightPartWatch> watch = std::make_shared<WeightPartWatch>();
  TensorList params;
  torch::autograd::edge_list param_edges;
  torch::autograd::edge_list roots;  // W starts here: (intermediate, input) edges and outputs of the weight part
  TensorList root_grads;
  std::vector<NodeRef> intermediates;  // whose tensor hooks ran in B (Note [Hooks run once across B and W])
  std::vector<NodeRef> consumed;       // lead into I until W (Note [Backward through what B consumed raises])
};

namespace {

Edge gradient_edge_of(const at::Tensor& t) { return torch::autograd::impl::gradient_edge(t); }

[[noreturn]] void consumed_by_backward_input() {
  throw std::runtime_error(
      "prefire::backward_input: a backward reached the input part of a graph that backward_input() already ran "
      "(through an activation of that graph, e.g. an auxiliary head whose output was not passed to "
      "backward_input); its gradients there would be lost. Pass every output to differentiate to one "
      "backward_input() call, with its grad_output, or run that backward before backward_input()");
}

/// Where an intermediate's edges into I lead after B; see Note [Backward
/// through what B consumed raises].
struct ConsumedByBackwardInput final : Node {
  torch::autograd::variable_list apply(torch::autograd::variable_list&& /*grads*/) override {
    consumed_by_backward_input();
  }
  std::string name() const override { return "prefire::ConsumedByBackwardInput"; }
  /// An input like the one `edge` led to (its metadata, which the engine
  /// checks the gradient against), and an edge on to it. The node's parents
  /// link to it by assignment, so it never counts as having one
  /// (Node::add_next_edge refuses nodes that do: topological numbering).
  uint32_t add_input_like(const Edge& edge) {
    input_metadata_.push_back(edge.function->input_metadata(edge.input_nr));
    add_next_edge(edge);
    return static_cast<uint32_t>(input_metadata_.size() - 1);
  }
};

/// A new node, owned as the engine owns nodes (torch 2.14: intrusive_ptr; 2.11: shared_ptr).
template <typename T>
NodeRef make_node() {
  if constexpr (std::is_same_v<NodeRef, std::shared_ptr<Node>>) {
    return std::make_shared<T>();
  } else {
    return c10::make_intrusive<T>();
  }
}

/// Records the gradients a node's other tensor pre-hooks left (Note [Hooks
/// run once across B and W]).
struct ArrivingGradients final : torch::autograd::FunctionPreHook {
  explicit ArrivingGradients(std::shared_ptr<torch::autograd::variable_list> into) : into(std::move(into)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    *into = grads;
    return grads;
  }
  std::shared_ptr<torch::autograd::variable_list> into;
};

/// On every node W runs: notes a backward other than W that frees it.
struct FreedWatch final : torch::autograd::FunctionPreHook {
  explicit FreedWatch(std::shared_ptr<WeightPartWatch> watch) : watch(std::move(watch)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (!watch->w_began.load(std::memory_order_acquire) && !torch::autograd::get_current_graph_task_keep_graph()) {
      watch->freed.store(true, std::memory_order_release);
    }
    return grads;
  }
  std::shared_ptr<WeightPartWatch> watch;
};

/// On an intermediate: raises when the running backward needs a gradient
/// along one of its cut edges (Note [Backward through what B consumed raises]).
struct CutEdgesGuard final : torch::autograd::FunctionPreHook {
  CutEdgesGuard(const Node* node, std::vector<size_t> cut) : node(node), cut(std::move(cut)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    for (size_t edge : cut) {
      if (node->task_should_compute_output(edge)) consumed_by_backward_input();
    }
    return grads;
  }
  const Node* node;  // the node that owns this hook
  std::vector<size_t> cut;
};

}  // namespace
}  // namespace detail

WeightPass::WeightPass() = default;
WeightPass::~WeightPass() = default;
WeightPass::WeightPass(WeightPass&&) noexcept = default;
WeightPass& WeightPass::operator=(WeightPass&&) noexcept = default;

bool WeightPass::pending() const {
  if (!state_) return false;
  std::lock_guard<std::mutex> lock(state_->mu);
  return !state_->ran;
}

TensorList WeightPass::run(bool accumulate_into_grad) {
  if (!state_) {
    throw std::logic_error("prefire::WeightPass::run: this weight pass was default-made; take it from backward_input()");
  }
  PREFIRE_NVTX_RANGE("prefire::WeightPass::run", -1);
  std::lock_guard<std::mutex> lock(state_->mu);
  if (state_->ran) {
    throw std::logic_error(
        "prefire::WeightPass::run: the weight pass already ran; each backward_input() gives one weight pass, "
        "which frees its part of the graph when it runs");
  }
  state_->ran = true;
  detail::WeightPassState& s = *state_;
  TensorList grads(s.params.size());
  // See Note [Hooks run once across B and W]; destroyed with this pass's graph.
  std::vector<std::unique_ptr<torch::autograd::FunctionPreHook>> ran_in_b;
  for (const NodeRef& node : s.intermediates) {
    for (auto& hook : node->tensor_pre_hooks()) ran_in_b.push_back(std::move(hook));
    for (auto& [index, hook] : node->retains_grad_hooks()) ran_in_b.push_back(std::move(hook));
    node->tensor_pre_hooks().clear();
    node->retains_grad_hooks().clear();
  }
  s.intermediates.clear();
  // See Note [Backward through what B consumed raises]: dead ends for W.
  for (const NodeRef& node : s.consumed) node->next_edges().clear();
  s.consumed.clear();
  // Nothing of the graph is needed after this pass, whether it succeeds or throws.
  const torch::autograd::edge_list roots = std::move(s.roots);
  const TensorList root_grads = std::move(s.root_grads);
  s.roots.clear();
  s.root_grads.clear();
  s.watch->w_began.store(true, std::memory_order_release);
  if (s.watch->freed.load(std::memory_order_acquire)) {  // See Note [A freed weight part is seen, not guessed].
    throw std::runtime_error(
        "prefire::WeightPass::run: the weight part of this graph was freed after backward_input() (a backward "
        "without retain_graph ran through activations of this graph); run such backwards with retain_graph=true, "
        "or after the weight pass");
  }
  if (!roots.empty()) {
    grads = torch::autograd::Engine::get_default_engine().execute(roots, root_grads, /*keep_graph=*/false,
                                                                   /*create_graph=*/false,
                                                                   /*accumulate_grad=*/false, s.param_edges);
  }
  if (accumulate_into_grad) {
    // Into each parameter's own AccumulateGrad node, as a plain backward does:
    // under its lock (W passes on two threads may share a weight), with the
    // gradient layout contract and the post-accumulate-grad hooks. The
    // parameter's tensor hooks already ran on the captured gradient (the
    // engine runs them on captures), so the node is applied directly, not
    // through the engine, which would run them a second time.
    at::NoGradGuard no_grad;  // as the engine runs it without create_graph
    for (size_t i = 0; i < s.params.size(); ++i) {
      if (!grads[i].defined()) continue;
      auto accumulator = torch::autograd::impl::grad_accumulator(s.params[i]);  // shared_ptr or intrusive_ptr by torch version
      (*accumulator)({grads[i]});
    }
  }
  return grads;
}

struct SplitBackwardAccess {
  static std::unique_ptr<detail::WeightPassState>& state(WeightPass& w) { return w.state_; }
};

namespace {

using torch::autograd::edge_list;

// The outputs' gradient edges and the gradients B starts from, checked.
void check_roots(const TensorList& outputs, const TensorList& grad_outputs, edge_list& roots,
                 TensorList& root_grads) {
  if (grad_outputs.size() != outputs.size()) {
    throw std::invalid_argument("prefire::backward_input: " + std::to_string(grad_outputs.size()) +
                                " grad_outputs for " + std::to_string(outputs.size()) +
                                " outputs; pass one per output (undefined for ones, one-element outputs only)");
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    const at::Tensor& out = outputs[i];
    if (!out.defined() || !out.requires_grad()) {
      throw std::invalid_argument("prefire::backward_input: output " + std::to_string(i) +
                                  " does not require grad; pass only outputs of the graph to differentiate");
    }
    at::Tensor grad = grad_outputs[i];
    if (!grad.defined()) {
      if (out.numel() != 1) {
        throw std::invalid_argument("prefire::backward_input: grad_outputs[" + std::to_string(i) +
                                    "] is undefined for an output of " + std::to_string(out.numel()) +
                                    " elements; ones are implied for one-element outputs only");
      }
      grad = at::ones_like(out);
    } else if (!grad.sizes().equals(out.sizes())) {
      throw std::invalid_argument("prefire::backward_input: grad_outputs[" + std::to_string(i) + "] has shape " +
                                  c10::str(grad.sizes()) + ", output " + std::to_string(i) + " has shape " +
                                  c10::str(out.sizes()));
    }
    roots.push_back(detail::gradient_edge_of(out));
    root_grads.push_back(std::move(grad));
  }
}

// The stage's graph cut into B and W (Note [Splitting backward into B and W]): the edges of the inputs that need a
// gradient and of the parameters, the nodes that lead to the inputs (b_part) and to the parameters (w_part), and
// the intermediates where the two meet, in the graph's breadth-first order.
struct Partition {
  edge_list input_edges;
  std::vector<size_t> input_slots;  // input index of each input edge
  std::unordered_set<Node*> input_nodes;
  edge_list param_edges;
  std::unordered_set<Node*> b_part, w_part, intermediates;
  std::vector<Node*> ordered_intermediates;  // deterministic
};

Partition partition(const detail::StageGraph& graph, const edge_list& input_edges,
                    const std::vector<size_t>& input_slots, const TensorList& params) {
  Partition p;
  p.input_edges = input_edges;
  p.input_slots = input_slots;
  for (const Edge& e : input_edges) p.input_nodes.insert(e.function.get());
  std::vector<Node*> param_nodes;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].defined() || !params[i].requires_grad()) {
      throw std::invalid_argument("prefire::backward_input: parameter " + std::to_string(i) +
                                  " does not require grad; pass only the parameters to differentiate");
    }
    p.param_edges.push_back(detail::gradient_edge_of(params[i]));
    param_nodes.push_back(p.param_edges.back().function.get());
    if (p.input_nodes.count(param_nodes.back()) != 0) {
      throw std::invalid_argument("prefire::backward_input: parameter " + std::to_string(i) +
                                  " is also one of the inputs; pass each tensor in one list");
    }
  }
  for (size_t i = 0; i < param_nodes.size(); ++i) {
    if (graph.refs.count(param_nodes[i]) == 0) {
      throw std::invalid_argument("prefire::backward_input: parameter " + std::to_string(i) +
                                  " is not part of the graph of the outputs (above the inputs); pass only the "
                                  "parameters the outputs were computed from");
    }
  }
  std::vector<Node*> reached_inputs;
  for (Node* node : p.input_nodes) {
    if (graph.refs.count(node) != 0) reached_inputs.push_back(node);
  }
  p.b_part = graph.leading_to(reached_inputs, nullptr, nullptr);
  p.w_part = graph.leading_to(param_nodes, &p.b_part, &p.intermediates);
  for (Node* node : graph.nodes) {
    if (p.intermediates.count(node) != 0) p.ordered_intermediates.push_back(node);
  }
  return p;
}

// B: runs the engine from the roots to the input edges and every intermediate's inputs, recording what arrives at
// each intermediate (Note [Hooks run once across B and W]); returns the input edges' gradients and, per
// intermediate, what arrived there.
std::pair<TensorList, std::vector<torch::autograd::variable_list>> run_b(const detail::StageGraph& graph,
                                                                          const Partition& p, const edge_list& roots,
                                                                          const TensorList& root_grads) {
  edge_list captures = p.input_edges;
  for (Node* node : p.ordered_intermediates) {
    for (uint32_t k = 0; k < node->num_inputs(); ++k) captures.emplace_back(graph.refs.at(node), k);
  }
  std::vector<std::shared_ptr<torch::autograd::variable_list>> arrived;
  for (Node* node : p.ordered_intermediates) {
    arrived.push_back(std::make_shared<torch::autograd::variable_list>());
    node->add_tensor_pre_hook(std::make_unique<detail::ArrivingGradients>(arrived.back()));
  }
  auto remove_recorders = [&] {
    for (Node* node : p.ordered_intermediates) node->tensor_pre_hooks().pop_back();
  };
  TensorList captured(captures.size());
  try {
    if (!captures.empty()) {
      captured = torch::autograd::Engine::get_default_engine().execute(roots, root_grads, /*keep_graph=*/true,
                                                                        /*create_graph=*/false,
                                                                        /*accumulate_grad=*/false, captures);
    }
  } catch (...) {
    remove_recorders();
    throw;
  }
  remove_recorders();
  captured.resize(p.input_edges.size());
  std::vector<torch::autograd::variable_list> at_intermediates;
  for (const auto& grads : arrived) at_intermediates.push_back(*grads);
  return {std::move(captured), std::move(at_intermediates)};
}

// W's roots: what arrived at each intermediate, and the outputs in the weight part (they seed W themselves).
void seed_w(const detail::StageGraph& graph, const Partition& p,
            const std::vector<torch::autograd::variable_list>& arrived, const edge_list& roots,
            const TensorList& root_grads, detail::WeightPassState& state) {
  for (size_t i = 0; i < p.ordered_intermediates.size(); ++i) {
    const torch::autograd::variable_list& grads = arrived[i];
    for (uint32_t k = 0; k < grads.size(); ++k) {
      if (!grads[k].defined()) continue;
      state.roots.emplace_back(graph.refs.at(p.ordered_intermediates[i]), k);
      state.root_grads.push_back(grads[k]);
    }
    if (!grads.empty()) state.intermediates.push_back(graph.refs.at(p.ordered_intermediates[i]));
  }
  for (size_t o = 0; o < roots.size(); ++o) {
    if (p.w_part.count(roots[o].function.get()) != 0) {
      state.roots.push_back(roots[o]);
      state.root_grads.push_back(root_grads[o]);
    }
  }
}

// After B: the graph below the intermediates belongs to no pass any more (Note [Memory that follows the passes]).
// Cut through the edge list: set_next_edge() refuses nodes that have parents because adding an edge could break
// the topological numbering; removing one cannot. See Note [Backward through what B consumed raises].
void let_go_of_b(const detail::StageGraph& graph, const Partition& p, detail::WeightPassState& state) {
  for (Node* node : p.ordered_intermediates) {
    const NodeRef consumed = detail::make_node<detail::ConsumedByBackwardInput>();
    std::vector<size_t> cut;
    for (size_t e = 0; e < node->num_outputs(); ++e) {
      Edge& next = node->next_edges()[e];
      if (next.is_valid() && p.w_part.count(next.function.get()) == 0) {
        next = Edge(consumed, static_cast<detail::ConsumedByBackwardInput&>(*consumed).add_input_like(next));
        cut.push_back(e);
      }
    }
    if (cut.empty()) continue;
    state.consumed.push_back(consumed);
    node->add_pre_hook(std::make_unique<detail::CutEdgesGuard>(node, std::move(cut)));
  }
  for (Node* node : graph.nodes) {  // See Note [A freed weight part is seen, not guessed].
    if (p.w_part.count(node) != 0 || p.intermediates.count(node) != 0) {
      node->add_pre_hook(std::make_unique<detail::FreedWatch>(state.watch));
    }
  }
  for (Node* node : graph.nodes) {
    if (p.b_part.count(node) != 0 && p.intermediates.count(node) == 0 && p.input_nodes.count(node) == 0) {
      node->release_variables();
    }
  }
}

}  // namespace

SplitBackward backward_input(const TensorList& outputs, const TensorList& grad_outputs, const TensorList& inputs,
                             const TensorList& params) {
  PREFIRE_NVTX_RANGE("prefire::backward_input", -1);
  edge_list roots;
  TensorList root_grads;
  check_roots(outputs, grad_outputs, roots, root_grads);
  edge_list input_edges;  // the inputs that need a gradient
  std::vector<size_t> input_slots;
  std::unordered_set<Node*> input_nodes;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined() || !inputs[i].requires_grad()) continue;
    input_edges.push_back(detail::gradient_edge_of(inputs[i]));
    input_slots.push_back(i);
    input_nodes.insert(input_edges.back().function.get());
  }
  // See Note [Splitting backward into B and W].
  const detail::StageGraph graph(roots, input_nodes);
  const Partition p = partition(graph, input_edges, input_slots, params);
  auto [input_grads, arrived] = run_b(graph, p, roots, root_grads);

  SplitBackward result;
  result.input_grads.resize(inputs.size());
  for (size_t e = 0; e < p.input_edges.size(); ++e) result.input_grads[p.input_slots[e]] = input_grads[e];
  auto state = std::make_unique<detail::WeightPassState>();
  state->params = params;
  state->param_edges = p.param_edges;
  seed_w(graph, p, arrived, roots, root_grads, *state);
  let_go_of_b(graph, p, *state);
  for (const at::Tensor& out : outputs) {
    if (!out.is_leaf() && !out.is_view()) out.detach_();
  }
  SplitBackwardAccess::state(result.weight_pass) = std::move(state);
  return result;
}

}  // namespace prefire
