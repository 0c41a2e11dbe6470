#include <prefire/plan.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

// Note [What a plan holds]
// Forward leaves, for every block and every micro-batch in flight there: the
// block's saved tensors if it is kept, its inputs if it is checkpointed.
// Backward recomputes one checkpointed block at a time, and prefiring
// `ahead` blocks holds that many recomputations more. When a block lets go
// decides the rest (Release):
//  * kAtStepEnd (a pipeline: B keeps what W needs, W runs later): all of it
//    may still be held when the largest recomputation runs, so a plan holds
//      the most over the step's moments t of
//        sum over blocks of alive[t] * (checkpointed ? input : saved)
//                         + done[t] * (checkpointed ? input_after : saved_after)
//      (done: its micro-batches that let go, the `after` bytes what they
//      still hold until the step ends: a pipeline's last stage, whose
//      outputs keep their graphs)
//      (a block without moments: in_flight at every one, so without any
//      the sum of every block's in_flight; with them, the blocks of stages
//      whose micro-batches leave at different moments are not all counted
//      at their most at once)
//    + (1 + ahead) * the largest pass: the saved bytes of a group's
//      checkpointed blocks together (a pipeline stage's B recomputes all of
//      them into one session and keeps them for W), a block without a
//      group alone;
//  * kInBackward (one backward pass of one micro-batch, last block first):
//    block j's backward finds only blocks 0..j holding (the blocks above it
//    let go after their backward), so a plan holds the most of
//      what blocks 0..n-1 hold (the end of forward), and for every
//      checkpointed j: what blocks 0..j hold + its recomputation + the
//      `ahead` nearest checkpointed blocks' below it.
// A recomputation is charged the block's saved bytes, its inputs included
// (they are the checkpoint's own), and a storage two blocks share (a kept
// block's input is its predecessor's output) is counted for both: a plan
// never holds more than it says.
//
// Note [Choosing a plan]
// Recomputation is what a plan costs, so the best plan within a budget keeps
// the blocks whose recomputation takes longest per byte kept.
//  * kAtStepEnd, up to kExhaustiveBlocks blocks (a pipeline rank's stages
//    hold a few each): every keep/checkpoint choice is tried, 2^16 sums of
//    at most 16 terms, a few milliseconds; the plan and least_plan_bytes()
//    are exact.
//  * kAtStepEnd, more blocks: with the largest checkpointed block fixed at M, that is a
//    0/1 knapsack: blocks larger than M are kept, the others each cost
//    in_flight * (saved - input) bytes to keep and save their
//    recompute_seconds. Every M among the blocks' sizes is tried. Groups
//    make a pass larger than M, and moments (BlockCost::alive) make a
//    block cost less than in_flight times its bytes at some moments; both
//    are left to plan_bytes(), which refuses the candidates that do not
//    fit, so with either this finds a plan that fits, not always the best.
//  * kInBackward: the constraints are per position, so a dynamic program
//    over the blocks in forward order, its state what blocks 0..j hold;
//    checkpointing j needs its recomputation to fit on top of that state.
// Both count bytes in kCapacityUnits units of what is left, a block's bytes
// rounded up (the plan found always fits; it may miss one that fits to the
// last byte). The plans a user would write by hand -- none, all, every n-th
// block -- and the plans least_plan_bytes() takes its minimum over (every
// block above a size kept, the others checkpointed) are tried too, so the
// plan is never worse than one of those that fits, and a budget of
// least_plan_bytes() has one. Then what the budget leaves goes to prefiring
// ahead. Cost: (distinct sizes) x blocks x kCapacityUnits, or blocks x
// kCapacityUnits.

namespace prefire {
namespace {

constexpr int64_t kCapacityUnits = 4096;

// The moments of a step the blocks have (BlockCost::alive); 0: none.
size_t moments(const std::vector<BlockCost>& blocks) {
  for (const BlockCost& b : blocks) {
    if (!b.alive.empty()) return b.alive.size();
  }
  return 0;
}

void check(const std::vector<BlockCost>& blocks, Release release) {
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockCost& b = blocks[i];
    for (int64_t a : b.alive) {
      if (a < 0 || a > b.in_flight) {
        throw std::invalid_argument("prefire::plan: block " + std::to_string(i) + " holds " + std::to_string(a) +
                                    " micro-batches at a moment, outside 0..in_flight=" +
                                    std::to_string(b.in_flight));
      }
    }
    if (!b.alive.empty() && (release == Release::kInBackward || b.alive.size() != moments(blocks))) {
      throw std::invalid_argument("prefire::plan: block " + std::to_string(i) + "'s moments (alive) must be as "
                                  "many as every other block's, and only with Release::kAtStepEnd");
    }
    if ((!b.done.empty() && b.done.size() != b.alive.size()) ||
        std::any_of(b.done.begin(), b.done.end(), [](int64_t d) { return d < 0; }) || b.saved_after_bytes < 0 ||
        b.saved_after_bytes > b.saved_bytes || b.input_after_bytes < 0 || b.input_after_bytes > b.input_bytes) {
      throw std::invalid_argument("prefire::plan: block " + std::to_string(i) + ": done needs as many moments as "
                                  "alive, none negative, and the after bytes must lie within 0..saved or input bytes");
    }
    if (b.saved_bytes < 0 || b.input_bytes < 0 || !(b.recompute_seconds >= 0) || b.in_flight < 1 || b.group < -1) {
      throw std::invalid_argument("prefire::plan: block " + std::to_string(i) +
                                  " has a negative size or time, in_flight below 1 or a group below -1");
    }
    if (release == Release::kInBackward && (b.in_flight != 1 || b.group != -1)) {
      throw std::invalid_argument("prefire::plan: block " + std::to_string(i) + " has in_flight=" +
                                  std::to_string(b.in_flight) + " and group=" + std::to_string(b.group) +
                                  "; Release::kInBackward is one backward pass of one micro-batch recomputing "
                                  "one block at a time (in_flight 1, group -1), a pipeline's blocks need "
                                  "Release::kAtStepEnd");
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

// What a plan holds with Release::kAtStepEnd (Note [What a plan holds]);
// checkpointed(i): whether block i is.
template <typename Checkpointed>
int64_t held_at_step_end(const std::vector<BlockCost>& blocks, const Checkpointed& checkpointed, int64_t ahead) {
  const size_t n_moments = std::max<size_t>(1, moments(blocks));
  std::vector<int64_t> at(n_moments, 0);           // what the blocks hold at each moment
  int64_t pass = -1;                               // the largest pass; -1: nothing checkpointed
  std::vector<std::pair<int64_t, int64_t>> groups;  // (group, its checkpointed blocks' saved bytes)
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockCost& b = blocks[i];
    const int64_t bytes = checkpointed(i) ? b.input_bytes : b.saved_bytes;
    const int64_t after = checkpointed(i) ? b.input_after_bytes : b.saved_after_bytes;
    for (size_t t = 0; t < n_moments; ++t) {
      at[t] = add_product(at[t], b.alive.empty() ? b.in_flight : b.alive[t], bytes);
      if (!b.done.empty()) at[t] = add_product(at[t], b.done[t], after);
    }
    if (!checkpointed(i)) continue;
    int64_t together = b.saved_bytes;
    if (b.group >= 0) {
      auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == b.group; });
      if (it == groups.end()) it = groups.insert(groups.end(), {b.group, 0});
      together = it->second = add_product(it->second, 1, b.saved_bytes);
    }
    pass = std::max(pass, together);
  }
  const int64_t held = *std::max_element(at.begin(), at.end());
  return pass < 0 ? held : add_product(held, 1 + ahead, pass);
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

// Every block larger than `largest` kept, the others checkpointed unless
// they save no more than their inputs.
std::vector<bool> below(const std::vector<BlockCost>& blocks, int64_t largest) {
  std::vector<bool> checkpointed(blocks.size(), false);
  for (size_t i = 0; i < blocks.size(); ++i) {
    checkpointed[i] = blocks[i].saved_bytes <= largest && blocks[i].input_bytes < blocks[i].saved_bytes;
  }
  return checkpointed;
}

// The plan that recomputes least with Release::kInBackward: dynamic
// programming over the blocks in forward order, the state what blocks 0..j
// hold, in kCapacityUnits units of the budget, bytes rounded up (Note
// [Choosing a plan]).
std::vector<bool> by_position(const std::vector<BlockCost>& blocks, int64_t budget) {
  const int64_t unit = std::max<int64_t>(1, (budget + kCapacityUnits - 1) / kCapacityUnits);
  const auto units = static_cast<size_t>(budget / unit);
  auto rounded = [&](int64_t bytes) { return static_cast<size_t>(bytes / unit + (bytes % unit != 0)); };
  constexpr double kNone = std::numeric_limits<double>::infinity();
  std::vector<double> best(units + 1, kNone);  // best[p]: the least seconds with blocks 0..j holding p units
  best[0] = 0;
  // from[j][q]: the state before block j on the way to q, with the choice in its sign (checkpointed: negative)
  std::vector<std::vector<int64_t>> from(blocks.size(), std::vector<int64_t>(units + 1, 0));
  for (size_t j = 0; j < blocks.size(); ++j) {
    const size_t saved = rounded(blocks[j].saved_bytes);
    const size_t input = rounded(blocks[j].input_bytes);
    std::vector<double> next(units + 1, kNone);
    for (size_t p = 0; p <= units; ++p) {
      if (best[p] == kNone) continue;
      if (saved <= units - p && best[p] < next[p + saved]) {  // kept
        next[p + saved] = best[p];
        from[j][p + saved] = static_cast<int64_t>(p) + 1;
      }
      const double seconds = best[p] + blocks[j].recompute_seconds;  // checkpointed: its recomputation fits
      if (input <= units - p && saved <= units - p - input && seconds < next[p + input]) {
        next[p + input] = seconds;
        from[j][p + input] = -(static_cast<int64_t>(p) + 1);
      }
    }
    best = std::move(next);
  }
  std::vector<bool> checkpointed(blocks.size(), true);  // nothing fits: a plan the caller finds over budget
  size_t q = 0;
  for (size_t p = 1; p <= units; ++p) {
    if (best[p] < best[q]) q = p;
  }
  if (best[q] == kNone) return checkpointed;
  for (size_t j = blocks.size(); j-- > 0;) {
    const int64_t f = from[j][q];
    checkpointed[j] = f < 0;
    q = static_cast<size_t>((f < 0 ? -f : f) - 1);
  }
  return checkpointed;
}

bool exhaustive(const std::vector<BlockCost>& blocks, Release release) {
  return release == Release::kAtStepEnd && blocks.size() <= kExhaustiveBlocks;
}

// Every keep/checkpoint choice, each as a mask (bit i: block i checkpointed).
template <typename Consider>
void every_plan(const std::vector<BlockCost>& blocks, const Consider& consider) {
  std::vector<bool> checkpointed(blocks.size());
  for (uint32_t mask = 0; mask < (1u << blocks.size()); ++mask) {
    for (size_t i = 0; i < blocks.size(); ++i) checkpointed[i] = (mask >> i) & 1u;
    consider(checkpointed);
  }
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
                   int64_t prefire_ahead, Release release) {
  check(blocks, release);
  if (checkpointed.size() != blocks.size()) {
    throw std::invalid_argument("prefire::plan_bytes: " + std::to_string(checkpointed.size()) +
                                " choices for " + std::to_string(blocks.size()) + " blocks");
  }
  if (prefire_ahead < 0) throw std::invalid_argument("prefire::plan_bytes: prefire_ahead must be >= 0");
  if (release == Release::kInBackward) {
    // held when block j's backward runs: what blocks 0..j hold, j's recomputation and the next
    // prefire_ahead checkpointed blocks' below it
    int64_t prefix = 0;
    int64_t peak = 0;
    std::vector<int64_t> recomputations_below;  // saved bytes of the checkpointed blocks before j, nearest last
    for (size_t j = 0; j < blocks.size(); ++j) {
      const BlockCost& b = blocks[j];
      prefix = add_product(prefix, 1, checkpointed[j] ? b.input_bytes : b.saved_bytes);
      peak = std::max(peak, prefix);
      if (!checkpointed[j]) continue;
      int64_t held = add_product(prefix, 1, b.saved_bytes);
      for (int64_t k = 0; k < prefire_ahead && k < static_cast<int64_t>(recomputations_below.size()); ++k) {
        held = add_product(held, 1, recomputations_below[recomputations_below.size() - 1 - static_cast<size_t>(k)]);
      }
      peak = std::max(peak, held);
      recomputations_below.push_back(b.saved_bytes);
    }
    return peak;
  }
  return held_at_step_end(blocks, [&](size_t i) { return checkpointed[i]; }, prefire_ahead);
}

int64_t least_plan_bytes(const std::vector<BlockCost>& blocks, Release release) {
  check(blocks, release);
  if (exhaustive(blocks, release)) {
    int64_t least = std::numeric_limits<int64_t>::max();
    for (uint32_t mask = 0; mask < (1u << blocks.size()); ++mask) {
      least = std::min(least, held_at_step_end(blocks, [&](size_t i) { return (mask >> i) & 1u; }, 0));
    }
    return least;
  }
  int64_t least = plan_bytes(blocks, std::vector<bool>(blocks.size(), false), 0, release);
  for (int64_t largest : distinct_sizes(blocks)) {
    least = std::min(least, plan_bytes(blocks, below(blocks, largest), 0, release));
  }
  return least;
}

Plan plan_for_budget(const std::vector<BlockCost>& blocks, int64_t budget_bytes, Release release) {
  const int64_t least = least_plan_bytes(blocks, release);
  if (budget_bytes < least) {
    throw std::invalid_argument("prefire::plan_for_budget: budget_bytes=" + std::to_string(budget_bytes) +
                                " is below the least any plan holds: " + std::to_string(least) +
                                " bytes (Note [What a plan holds] in src/memory/plan.cpp)");
  }
  Plan best;
  bool found = false;
  auto consider = [&](const std::vector<bool>& checkpointed) {
    const int64_t bytes = plan_bytes(blocks, checkpointed, 0, release);
    if (bytes > budget_bytes) return;
    const double seconds = recompute_seconds(blocks, checkpointed);
    if (found && (seconds > best.recompute_seconds || (seconds == best.recompute_seconds && bytes >= best.peak_bytes))) {
      return;
    }
    best = Plan{checkpointed, 0, bytes, seconds};
    found = true;
  };
  const size_t n = blocks.size();
  if (exhaustive(blocks, release)) every_plan(blocks, consider);
  consider(std::vector<bool>(n, false));
  for (size_t every = 1; every <= n; ++every) {  // what torch users write: every n-th block (1: all)
    std::vector<bool> checkpointed(n, false);
    for (size_t i = 0; i < n; i += every) checkpointed[i] = true;
    consider(checkpointed);
  }
  for (int64_t largest : distinct_sizes(blocks)) {
    consider(below(blocks, largest));  // least_plan_bytes()'s plans: one of them fits
    if (release == Release::kAtStepEnd && !exhaustive(blocks, release)) {
      const int64_t base = bytes_below(blocks, largest);
      if (base <= budget_bytes) consider(knapsack(blocks, largest, budget_bytes - base));
    }
  }
  if (release == Release::kInBackward) consider(by_position(blocks, budget_bytes));
  // what is left goes to prefiring ahead
  const int64_t checkpoints = std::count(best.checkpointed.begin(), best.checkpointed.end(), true);
  while (best.prefire_ahead + 1 < checkpoints) {
    const int64_t bytes = plan_bytes(blocks, best.checkpointed, best.prefire_ahead + 1, release);
    if (bytes > budget_bytes) break;
    ++best.prefire_ahead;
    best.peak_bytes = bytes;
  }
  return best;
}

}  // namespace prefire
