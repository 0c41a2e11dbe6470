#pragma once

// The part of a stage's autograd graph that backward_input() partitions into
// B and W (Note [Splitting backward into B and W] in split_backward.cpp).

#include <torch/csrc/autograd/function.h>

#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace prefire::detail {

/// The part of the outputs' graph above the inputs: every node reachable
/// from the roots without passing through a node of `stop_at` (the inputs'
/// nodes), and the nodes feeding each one.
struct StageGraph {
  using Node = torch::autograd::Node;
  using NodeRef = decltype(torch::autograd::Edge::function);  // the engine's owning pointer to a node

  std::vector<Node*> nodes;  // breadth first from the roots
  std::unordered_map<Node*, NodeRef> refs;
  std::unordered_map<Node*, std::vector<Node*>> feeders;  // node -> nodes with an edge to it

  StageGraph(const torch::autograd::edge_list& roots, const std::unordered_set<Node*>& stop_at);

  /// The nodes that lead to `from` (those included), walking against the
  /// edges; nodes of `stop` are reported in `hit` and not walked through.
  std::unordered_set<Node*> leading_to(const std::vector<Node*>& from, const std::unordered_set<Node*>* stop,
                                       std::unordered_set<Node*>* hit) const;
};

}  // namespace prefire::detail
