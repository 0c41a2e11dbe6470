#include "prefire/plan.h"

#include <algorithm>
#include <stdexcept>
#include <string>

// Note [What a plan holds]
// A step holds, at its most (when backward begins), for every block and every
// micro-batch in flight there: the block's saved tensors if it is kept, its
// inputs if it is checkpointed. Backward then recomputes one checkpointed
// block at a time and lets go of it after its backward; prefiring `ahead`
// blocks holds that many recomputations more. So a plan holds at most
//     sum over blocks of in_flight * (checkpointed ? input : saved)
//   + (1 + ahead) * the largest saved bytes among checkpointed blocks.
// It over-counts a storage that two blocks share (a kept block's input is
// its predecessor's output): a plan never holds more than it says.
//
// Note [Choosing a plan]
// Recomputation is what a plan costs, so the best plan within a budget keeps
// the blocks whose recomputation takes longest per byte kept. With the
// largest checkpointed block fixed at M, that is a 0/1 knapsack: blocks larger
// than M are kept, the others each cost in_flight * (saved - input) bytes to
// keep and save their recompute_seconds. Every M among the blocks' sizes is
// tried, each knapsack solved by dynamic programming over the bytes left in
// kCapacityUnits units, a block's bytes rounded up (the plan found always
// fits; it may miss one that fits to the last byte). The plans a user would
// write by hand -- none, all, every n-th block -- are tried too, so the plan
// is never worse than one of those that fits. Then what the budget leaves
// goes to prefiring ahead. Cost: (distinct sizes) x blocks x kCapacityUnits.

namespace prefire {
namespace {

constexpr int64_t kCapacityUnits = 4096;

void check(const std::vector<BlockCost>& blocks) {
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockCost& b = blocks[i];
    if (b.saved_bytes < 0 || b.input_bytes < 0 || !(b.recompute_seconds >= 0) || b.in_flight < 1) {
      throw std::invalid_argument("prefire::plan: block " + std::to_string(i) +
                                  " has a negative size or time, or in_flight below 1");
    }
  }
}

// a + b * c, or std::overflow_error
int64_t add_product(int64_t a, int64_t b, int64_t c) {
  int64_t product = 0;
  int64_t sum = 0;
  if (__builtin_mul_overflow(b, c, &product) || __builtin_add_overflow(a, product, &sum)) {
    throw std::overflow_error("prefire::plan: the blocks' bytes overflow 64 bits");
  }
  return sum;
}

double recompute_seconds(const std::vector<BlockCost>& blocks, const std::vector<bool>& checkpointed) {
  double total = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (checkpointed[i]) total += blocks[i].recompute_seconds;
  }
  return total;
}

// The blocks of size at most `largest` that stay checkpointed when the
// others are kept and `capacity` bytes are left to keep more of them with
// (Note [Choosing a plan]).
std::vector<bool> knapsack(const std::vector<BlockCost>& blocks, int64_t largest, int64_t capacity) {
  const int64_t unit = std::max<int64_t>(1, (capacity + kCapacityUnits - 1) / kCapacityUnits);
  const int64_t units = capacity / unit;
  std::vector<size_t> items;
  std::vector<int64_t> weight;
  std::vector<bool> checkpointed(blocks.size(), false);
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i].saved_bytes > largest) continue;  // kept
    const int64_t extra = add_product(0, blocks[i].in_flight, blocks[i].saved_bytes - blocks[i].input_bytes);
    if (extra <= 0) continue;  // keeping it costs nothing
    items.push_back(i);
    weight.push_back((extra + unit - 1) / unit);
    checkpointed[i] = true;
  }
  // best[c]: the most recompute seconds kept within c units; took[k][c]: item k kept there
  std::vector<double> best(static_cast<size_t>(units) + 1, 0.0);
  std::vector<std::vector<bool>> took(items.size(), std::vector<bool>(static_cast<size_t>(units) + 1, false));
  for (size_t k = 0; k < items.size(); ++k) {
    const double value = blocks[items[k]].recompute_seconds;
    for (int64_t c = units; c >= weight[k]; --c) {
      const double with = best[static_cast<size_t>(c - weight[k])] + value;
      if (with > best[static_cast<size_t>(c)]) {
        best[static_cast<size_t>(c)] = with;
        took[k][static_cast<size_t>(c)] = true;
      }
    }
  }
  int64_t c = units;
  for (size_t k = items.size(); k-- > 0;) {
    if (took[k][static_cast<size_t>(c)]) {
      checkpointed[items[k]] = false;
      c -= weight[k];
    }
  }
  return checkpointed;
}

std::vector<int64_t> distinct_sizes(const std::vector<BlockCost>& blocks) {
  std::vector<int64_t> sizes;
  for (const BlockCost& b : blocks) sizes.push_back(b.saved_bytes);
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  return sizes;
}

// The least a plan whose largest checkpointed block saves at most `largest`
// bytes holds: blocks above it kept, the others as a checkpoint or kept,
// whichever holds less (keeping one that saves less than its inputs).
int64_t bytes_below(const std::vector<BlockCost>& blocks, int64_t largest) {
  int64_t held = largest;
  for (const BlockCost& b : blocks) {
    held = add_product(held, b.in_flight,
                       b.saved_bytes > largest ? b.saved_bytes : std::min(b.input_bytes, b.saved_bytes));
  }
  return held;
}

}  // namespace

int64_t plan_bytes(const std::vector<BlockCost>& blocks, const std::vector<bool>& checkpointed,
                   int64_t prefire_ahead) {
  check(blocks);
  if (checkpointed.size() != blocks.size()) {
    throw std::invalid_argument("prefire::plan_bytes: " + std::to_string(checkpointed.size()) +
                                " choices for " + std::to_string(blocks.size()) + " blocks");
  }
  if (prefire_ahead < 0) throw std::invalid_argument("prefire::plan_bytes: prefire_ahead must be >= 0");
  int64_t held = 0;
  int64_t largest = -1;  // none checkpointed
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockCost& b = blocks[i];
    held = add_product(held, b.in_flight, checkpointed[i] ? b.input_bytes : b.saved_bytes);
    if (checkpointed[i]) largest = std::max(largest, b.saved_bytes);
  }
  return largest < 0 ? held : add_product(held, 1 + prefire_ahead, largest);
}

int64_t least_plan_bytes(const std::vector<BlockCost>& blocks) {
  check(blocks);
  int64_t least = 0;  // nothing checkpointed
  for (const BlockCost& b : blocks) least = add_product(least, b.in_flight, b.saved_bytes);
  for (int64_t largest : distinct_sizes(blocks)) {
    least = std::min(least, bytes_below(blocks, largest));
  }
  return least;
}

Plan plan_for_budget(const std::vector<BlockCost>& blocks, int64_t budget_bytes) {
  const int64_t least = least_plan_bytes(blocks);
  if (budget_bytes < least) {
    throw std::invalid_argument("prefire::plan_for_budget: budget_bytes=" + std::to_string(budget_bytes) +
                                " is below the least any plan holds: " + std::to_string(least) +
                                " bytes (checkpointing every block that saves more than its inputs: their "
                                "inputs, and one recomputation at a time)");
  }
  Plan best;
  bool found = false;
  auto consider = [&](const std::vector<bool>& checkpointed) {
    const int64_t bytes = plan_bytes(blocks, checkpointed, 0);
    if (bytes > budget_bytes) return;
    const double seconds = recompute_seconds(blocks, checkpointed);
    if (found && (seconds > best.recompute_seconds || (seconds == best.recompute_seconds && bytes >= best.peak_bytes))) {
      return;
    }
    best = Plan{checkpointed, 0, bytes, seconds};
    found = true;
  };
  const size_t n = blocks.size();
  consider(std::vector<bool>(n, false));
  for (size_t every = 1; every <= n; ++every) {  // what torch users write: every n-th block (1: all)
    std::vector<bool> checkpointed(n, false);
    for (size_t i = 0; i < n; i += every) checkpointed[i] = true;
    consider(checkpointed);
  }
  for (int64_t largest : distinct_sizes(blocks)) {
    const int64_t base = bytes_below(blocks, largest);
    if (base <= budget_bytes) consider(knapsack(blocks, largest, budget_bytes - base));
  }
  // what is left goes to prefiring ahead, one recomputation of the largest at a time
  int64_t checkpoints = 0;
  int64_t largest = 0;
  for (size_t i = 0; i < n; ++i) {
    if (best.checkpointed[i]) {
      ++checkpoints;
      largest = std::max(largest, blocks[i].saved_bytes);
    }
  }
  if (checkpoints > 1 && largest > 0) {
    best.prefire_ahead = std::min(checkpoints - 1, (budget_bytes - best.peak_bytes) / largest);
    best.peak_bytes = plan_bytes(blocks, best.checkpointed, best.prefire_ahead);
  } else if (checkpoints > 1) {
    best.prefire_ahead = checkpoints - 1;  // recomputations that hold nothing
  }
  return best;
}

}  // namespace prefire
