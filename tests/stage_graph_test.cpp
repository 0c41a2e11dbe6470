// StageGraph, the graph backward_input() partitions: what lies above the
// inputs, and which nodes lead to the inputs (B) or to the weights alone (W).

#include "split_backward/stage_graph.h"
#include "test_support.h"

#include <torch/csrc/autograd/variable.h>

#include <unordered_set>

namespace {

using prefire::detail::StageGraph;
using torch::autograd::Node;

Node* node_of(const at::Tensor& t) { return torch::autograd::impl::gradient_edge(t).function.get(); }

TEST(StageGraph, PartitionsIntoWhatLeadsToTheInputAndWhatOnlyToTheWeight) {
  const at::Tensor x = at::randn({3}).requires_grad_(true);  // the stage's input
  const at::Tensor w = at::randn({3}).requires_grad_(true);  // a weight
  const at::Tensor a = x * w;
  const at::Tensor b = a.sin();
  const at::Tensor c = w.cos();
  const at::Tensor y = b + c;
  Node* input = node_of(x);
  Node* weight = node_of(w);
  const StageGraph graph({torch::autograd::impl::gradient_edge(y)}, {input});
  EXPECT_EQ(graph.nodes.size(), 6u);  // add, sin, cos, mul, and the two leaves' accumulators
  EXPECT_EQ(graph.nodes.front(), node_of(y));
  // B: every node on a path from the outputs to the input
  const std::unordered_set<Node*> b_part = graph.leading_to({input}, nullptr, nullptr);
  EXPECT_EQ(b_part, (std::unordered_set<Node*>{input, node_of(a), node_of(b), node_of(y)}));
  // W: what leads to the weight without passing through B, and the B nodes it meets (the intermediates)
  std::unordered_set<Node*> hit;
  const std::unordered_set<Node*> w_part = graph.leading_to({weight}, &b_part, &hit);
  EXPECT_EQ(w_part, (std::unordered_set<Node*>{weight, node_of(c)}));
  EXPECT_EQ(hit, (std::unordered_set<Node*>{node_of(a), node_of(y)}));
}

TEST(StageGraph, StopsAtTheInputs) {
  const at::Tensor x0 = at::randn({3}).requires_grad_(true);
  const at::Tensor x = x0 * 2;  // a received activation: its own graph below it is not the stage's
  const at::Tensor y = (x * x).sum();
  const StageGraph graph({torch::autograd::impl::gradient_edge(y)}, {node_of(x)});
  for (Node* node : graph.nodes) EXPECT_NE(node, node_of(x0));
  EXPECT_EQ(graph.feeders.at(node_of(x)).size(), 2u);  // mul feeds it twice (both operands)
}

}  // namespace
