#include "split_backward/stage_graph.h"

#include <deque>

namespace prefire::detail {

StageGraph::StageGraph(const torch::autograd::edge_list& roots, const std::unordered_set<Node*>& stop_at) {
  std::deque<Node*> queue;
  auto visit = [&](const NodeRef& ref) {
    Node* node = ref.get();
    if (refs.emplace(node, ref).second) {
      nodes.push_back(node);
      feeders[node];
      if (stop_at.count(node) == 0) queue.push_back(node);
    }
  };
  for (const auto& root : roots) {
    if (root.is_valid()) visit(root.function);
  }
  while (!queue.empty()) {
    Node* node = queue.front();
    queue.pop_front();
    for (const auto& edge : node->next_edges()) {
      if (!edge.is_valid()) continue;
      visit(edge.function);
      feeders[edge.function.get()].push_back(node);
    }
  }
}

std::unordered_set<torch::autograd::Node*> StageGraph::leading_to(const std::vector<Node*>& from,
                                                                  const std::unordered_set<Node*>* stop,
                                                                  std::unordered_set<Node*>* hit) const {
  std::unordered_set<Node*> closure;
  std::deque<Node*> queue;
  for (Node* node : from) {
    if (closure.insert(node).second) queue.push_back(node);
  }
  while (!queue.empty()) {
    Node* node = queue.front();
    queue.pop_front();
    for (Node* feeder : feeders.at(node)) {
      if (closure.count(feeder) != 0) continue;
      if (stop != nullptr && stop->count(feeder) != 0) {
        hit->insert(feeder);
        continue;
      }
      closure.insert(feeder);
      queue.push_back(feeder);
    }
  }
  return closure;
}

}  // namespace prefire::detail
