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
//    or, where the blocks say when their passes run (BlockCost::passes: a
//    pipeline rank knows which action recomputes which stage), a pass only
//    at its own moments: the most over t of
//        what the blocks hold at t, and where passes run during the action
//        that ends at t, the more of what they held before and after it
//        (a W's micro-batch lets go when it ends) + the saved bytes of the
//        checkpointed blocks those passes recompute
//      + ahead * the largest pass (prefires, at any moment).
//    Counting the largest pass at every moment charged a rank its
//    largest stage's recomputation where another stage's pass, a smaller
//    one, or none runs, and kept ZBV's ranks from keeping blocks that fit
//    (docs/benchmarks.md, "Passes where they run"). What a runtime holds
//    beyond the passes (a B's recomputation kept for W, a prefire) must
//    then fit what the blocks leave at each moment it is held
//    (Plan::moment_bytes; Note [A rank's byte budget] in
//    python/prefire/_budget.py);
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
// Note [Selective checkpoints in a plan]
// A block may have a third choice (BlockCost::selective_bytes >= 0): a
// selective checkpoint, whose forward keeps the outputs of the ops a policy
// names (torch's SAC) and whose recomputation runs the rest. It holds
// selective_bytes where a checkpoint holds input_bytes, recomputes in
// selective_seconds, and its recomputation is charged the block's whole
// saved bytes like a full one's: the kept outputs it hands back are counted
// again there, as the runtime's census counts them (in the checkpoint's
// meter and as recomputed bytes), so the plan says what the census sees.
// selective_seconds is what the choice adds to a step over keeping the
// block (its recomputation, and whatever its forward costs more), so the
// planner weighs the three by one measure. On a GPT block the outputs of
// its matmuls and attention are two thirds of what it saves and most of its
// ops' time, so a selective checkpoint frees a third of a kept block for
// the small ops' recomputation, where SAC's dispatch in Python does not
// cost as much again (on this CPU it does: Note [Measuring a selective
// checkpoint] in python/prefire/_selective.py).
//
// Note [Choosing a plan]
// Recomputation is what a plan costs, so the best plan within a budget keeps
// the blocks whose recomputation takes longest per byte kept.
//  * kAtStepEnd, up to kExhaustivePlans choices in all (2 per block, 3 with
//    a selective checkpoint; a pipeline rank's stages hold a few blocks
//    each): every one is tried, 2^16 sums of at most 16 terms, a few
//    milliseconds; the plan and least_plan_bytes() are exact.
//  * kAtStepEnd, more: with the largest checkpointed block fixed at M, that is a
//    knapsack with a choice per item: blocks larger than M are kept, the
//    others each cost in_flight * (saved - input) bytes to keep and save
//    their recompute_seconds, or in_flight * (selective - input) to check-
//    point selectively and save recompute_seconds - selective_seconds.
//    Every M among the blocks' sizes is tried. Groups
//    make a pass larger than M, and moments (BlockCost::alive) make a
//    block cost less than in_flight times its bytes at some moments; both
//    are left to plan_bytes(), which refuses the candidates that do not
//    fit, so with either this finds a plan that fits, not always the best.
//    Where many blocks have moments (a pipeline rank planned per
//    micro-batch: one block per stage, micro-batch and layer, each alive
//    for one micro-batch's lifetime) the knapsack counts every one as held
//    at once and keeps few; so a greedy pass is tried too: from every
//    block checkpointed, keep one at a time, the most recompute seconds per
//    byte it keeps first, where plan_bytes() says the plan still fits, then
//    the same with selective checkpoints for those left.
//  * kInBackward: the constraints are per position, so a dynamic program
//    over the blocks in forward order, its state what blocks 0..j hold;
//    checkpointing j (either way) needs its recomputation to fit on top of
//    that state.
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

// A block's choice in a plan.
enum Option : uint8_t { kKeep, kFull, kSelective };
using Options = std::vector<uint8_t>;  // one Option per block

bool has_selective(const BlockCost& b) { return b.selective_bytes >= 0; }

// What a block holds after its forward, and after its micro-batch let go, with option `o`.
int64_t held_bytes(const BlockCost& b, uint8_t o) {
  return o == kKeep ? b.saved_bytes : o == kFull ? b.input_bytes : b.selective_bytes;
}
int64_t after_bytes(const BlockCost& b, uint8_t o) {
  return o == kKeep ? b.saved_after_bytes : o == kFull ? b.input_after_bytes : b.selective_after_bytes;
}
double option_seconds(const BlockCost& b, uint8_t o) {
  return o == kKeep ? 0.0 : o == kFull ? b.recompute_seconds : b.selective_seconds;
}

// The moments of a step the blocks have (BlockCost::alive); 0: none.
size_t moments(const std::vector<BlockCost>& blocks) {
  for (const BlockCost& b : blocks) {
    if (!b.alive.empty()) return b.alive.size();
  }
  return 0;
}

// Whether the blocks say when their passes run (BlockCost::passes).
bool timed_passes(const std::vector<BlockCost>& blocks) {
  return std::any_of(blocks.begin(), blocks.end(), [](const BlockCost& b) { return !b.passes.empty(); });
}

void check(const std::vector<BlockCost>& blocks, Release release) {
  const bool timed = timed_passes(blocks);
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
    if ((timed && (b.alive.empty() || b.passes.size() != b.alive.size())) ||
        std::any_of(b.passes.begin(), b.passes.end(), [](int64_t p) { return p < 0; })) {
      throw std::invalid_argument("prefire::plan: block " + std::to_string(i) + ": passes must be given for every "
                                  "block or none, one per moment of alive, none negative");
    }
    if ((!b.done.empty() && b.done.size() != b.alive.size()) ||
        std::any_of(b.done.begin(), b.done.end(), [](int64_t d) { return d < 0; }) || b.saved_after_bytes < 0 ||
        b.saved_after_bytes > b.saved_bytes || b.input_after_bytes < 0 || b.input_after_bytes > b.input_bytes ||
        b.selective_after_bytes < 0 || b.selective_after_bytes > std::max<int64_t>(0, b.selective_bytes)) {
      throw std::invalid_argument("prefire::plan: block " + std::to_string(i) + ": done needs as many moments as "
                                  "alive, none negative, and the after bytes must lie within 0..saved, input or "
                                  "selective bytes");
    }
    if (b.saved_bytes < 0 || b.input_bytes < 0 || !(b.recompute_seconds >= 0) || b.in_flight < 1 || b.group < -1 ||
        b.selective_bytes < -1 || !(b.selective_seconds >= 0)) {
      throw std::invalid_argument("prefire::plan: block " + std::to_string(i) +
                                  " has a negative size or time (selective_bytes -1: none), in_flight below 1 or a "
                                  "group below -1");
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

// What the blocks hold at each moment of a step with Release::kAtStepEnd,
// passes left out (one moment without BlockCost::alive).
std::vector<int64_t> moment_bytes(const std::vector<BlockCost>& blocks, const Options& options) {
  std::vector<int64_t> at(std::max<size_t>(1, moments(blocks)), 0);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockCost& b = blocks[i];
    const int64_t bytes = held_bytes(b, options[i]);
    const int64_t after = after_bytes(b, options[i]);
    for (size_t t = 0; t < at.size(); ++t) {
      at[t] = add_product(at[t], b.alive.empty() ? b.in_flight : b.alive[t], bytes);
      if (!b.done.empty()) at[t] = add_product(at[t], b.done[t], after);
    }
  }
  return at;
}

// What a plan holds with Release::kAtStepEnd (Note [What a plan holds]).
int64_t held_at_step_end(const std::vector<BlockCost>& blocks, const Options& options, int64_t ahead) {
  const std::vector<int64_t> at = moment_bytes(blocks, options);
  std::vector<int64_t> passing(at.size(), 0);      // with BlockCost::passes: what the passes ending there recompute
  int64_t pass = -1;                               // the largest pass; -1: nothing checkpointed
  std::vector<std::pair<int64_t, int64_t>> groups;  // (group, its checkpointed blocks' saved bytes)
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockCost& b = blocks[i];
    if (options[i] == kKeep) continue;
    // a selective recomputation too is charged all it saves (Note [Selective checkpoints in a plan])
    for (size_t t = 0; t < b.passes.size(); ++t) passing[t] = add_product(passing[t], b.passes[t], b.saved_bytes);
    int64_t together = b.saved_bytes;
    if (b.group >= 0) {
      auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == b.group; });
      if (it == groups.end()) it = groups.insert(groups.end(), {b.group, 0});
      together = it->second = add_product(it->second, 1, b.saved_bytes);
    }
    pass = std::max(pass, together);
  }
  if (pass < 0) return *std::max_element(at.begin(), at.end());
  if (!timed_passes(blocks)) return add_product(*std::max_element(at.begin(), at.end()), 1 + ahead, pass);
  int64_t held = 0;
  for (size_t t = 0; t < at.size(); ++t) {
    held = std::max(held, at[t]);
    if (passing[t] > 0) held = std::max(held, add_product(std::max(at[t], t > 0 ? at[t - 1] : 0), 1, passing[t]));
  }
  return add_product(held, ahead, pass);
}

// What a plan holds with Release::kInBackward: when block j's backward runs, what blocks 0..j hold,
// j's recomputation and the `ahead` nearest checkpointed blocks' below it.
int64_t held_in_backward(const std::vector<BlockCost>& blocks, const Options& options, int64_t ahead) {
  int64_t prefix = 0;
  int64_t peak = 0;
  std::vector<int64_t> recomputations_below;  // saved bytes of the checkpointed blocks before j, nearest last
  for (size_t j = 0; j < blocks.size(); ++j) {
    const BlockCost& b = blocks[j];
    prefix = add_product(prefix, 1, held_bytes(b, options[j]));
    peak = std::max(peak, prefix);
    if (options[j] == kKeep) continue;
    int64_t held = add_product(prefix, 1, b.saved_bytes);
    for (int64_t k = 0; k < ahead && k < static_cast<int64_t>(recomputations_below.size()); ++k) {
      held = add_product(held, 1, recomputations_below[recomputations_below.size() - 1 - static_cast<size_t>(k)]);
    }
    peak = std::max(peak, held);
    recomputations_below.push_back(b.saved_bytes);
  }
  return peak;
}

int64_t held(const std::vector<BlockCost>& blocks, const Options& options, int64_t ahead, Release release) {
  return release == Release::kInBackward ? held_in_backward(blocks, options, ahead)
                                         : held_at_step_end(blocks, options, ahead);
}

double recompute_seconds(const std::vector<BlockCost>& blocks, const Options& options) {
  double total = 0;
  for (size_t i = 0; i < blocks.size(); ++i) total += option_seconds(blocks[i], options[i]);
  return total;
}

// The blocks of size at most `largest` that stay checkpointed (fully or
// selectively) when the others are kept and `capacity` bytes are left to
// keep more of them, or to checkpoint them selectively, with (Note
// [Choosing a plan]): a knapsack with a choice per item.
Options knapsack(const std::vector<BlockCost>& blocks, int64_t largest, int64_t capacity) {
  const int64_t unit = std::max<int64_t>(1, (capacity + kCapacityUnits - 1) / kCapacityUnits);
  const auto units = static_cast<size_t>(capacity / unit);
  struct Item {
    size_t block;
    uint8_t option;  // kKeep or kSelective, in place of kFull
    size_t weight;   // units
    double value;    // recompute seconds it saves over kFull
  };
  std::vector<std::vector<Item>> items;  // per block that has a choice, its options beyond kFull
  Options options(blocks.size(), kKeep);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockCost& b = blocks[i];
    if (b.saved_bytes > largest) continue;  // kept
    const int64_t keep = add_product(0, b.in_flight, b.saved_bytes - b.input_bytes);
    if (keep <= 0) continue;  // keeping it costs nothing
    options[i] = kFull;
    std::vector<Item> choice;
    auto add = [&](uint8_t option, int64_t extra, double value) {
      if (value <= 0) return;
      const int64_t w = (std::max<int64_t>(0, extra) + unit - 1) / unit;
      if (w <= static_cast<int64_t>(units)) choice.push_back({i, option, static_cast<size_t>(w), value});
    };
    add(kKeep, keep, b.recompute_seconds);
    if (has_selective(b)) {
      add(kSelective, add_product(0, b.in_flight, b.selective_bytes - b.input_bytes),
          b.recompute_seconds - b.selective_seconds);
    }
    if (!choice.empty()) items.push_back(std::move(choice));
  }
  // best[c]: the most recompute seconds saved within c units; took[k][c]: item k's option there (0: kFull)
  std::vector<double> best(units + 1, 0.0);
  std::vector<std::vector<uint8_t>> took(items.size(), std::vector<uint8_t>(units + 1, 0));
  for (size_t k = 0; k < items.size(); ++k) {
    for (size_t c = units + 1; c-- > 0;) {  // downwards: best[c - w] is still the value before item k
      const double before = best[c];
      for (size_t o = 0; o < items[k].size(); ++o) {
        const Item& item = items[k][o];
        if (item.weight > c) continue;
        const double with = (item.weight == 0 ? before : best[c - item.weight]) + item.value;
        if (with > best[c]) {
          best[c] = with;
          took[k][c] = static_cast<uint8_t>(o + 1);
        }
      }
    }
  }
  size_t c = units;
  for (size_t k = items.size(); k-- > 0;) {
    if (took[k][c] == 0) continue;
    const Item& item = items[k][took[k][c] - 1];
    options[item.block] = item.option;
    c -= item.weight;
  }
  return options;
}

// From every block checkpointed, each kept in turn where the plan still fits
// `budget`, the most recompute seconds per byte kept first; then those left
// checkpointed selectively where that fits and recomputes less (Note
// [Choosing a plan]).
Options greedy(const std::vector<BlockCost>& blocks, int64_t budget, Release release) {
  Options options(blocks.size(), kFull);
  std::vector<size_t> order(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) order[i] = i;
  auto per_byte = [&](size_t i) {
    return blocks[i].recompute_seconds / static_cast<double>(std::max<int64_t>(1, blocks[i].saved_bytes -
                                                                                       blocks[i].input_bytes));
  };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return per_byte(a) > per_byte(b); });
  auto try_option = [&](size_t i, uint8_t o) {
    const uint8_t before = options[i];
    options[i] = o;
    if (held(blocks, options, 0, release) > budget) options[i] = before;
  };
  for (size_t i : order) try_option(i, kKeep);
  for (size_t i : order) {
    if (options[i] == kFull && has_selective(blocks[i]) && blocks[i].selective_seconds < blocks[i].recompute_seconds) {
      try_option(i, kSelective);
    }
  }
  return options;
}

// Every block larger than `largest` kept, the others checkpointed unless
// they save no more than their inputs.
Options below(const std::vector<BlockCost>& blocks, int64_t largest) {
  Options options(blocks.size(), kKeep);
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i].saved_bytes <= largest && blocks[i].input_bytes < blocks[i].saved_bytes) options[i] = kFull;
  }
  return options;
}

// The plan that recomputes least with Release::kInBackward: dynamic
// programming over the blocks in forward order, the state what blocks 0..j
// hold, in kCapacityUnits units of the budget, bytes rounded up (Note
// [Choosing a plan]).
Options by_position(const std::vector<BlockCost>& blocks, int64_t budget) {
  const int64_t unit = std::max<int64_t>(1, (budget + kCapacityUnits - 1) / kCapacityUnits);
  const auto units = static_cast<size_t>(budget / unit);
  auto rounded = [&](int64_t bytes) { return static_cast<size_t>(bytes / unit + (bytes % unit != 0)); };
  constexpr double kNone = std::numeric_limits<double>::infinity();
  std::vector<double> best(units + 1, kNone);  // best[p]: the least seconds with blocks 0..j holding p units
  best[0] = 0;
  // from[j][q]: the state before block j on the way to q; chose[j][q]: block j's option there
  std::vector<std::vector<size_t>> from(blocks.size(), std::vector<size_t>(units + 1, 0));
  std::vector<Options> chose(blocks.size(), Options(units + 1, kKeep));
  for (size_t j = 0; j < blocks.size(); ++j) {
    const BlockCost& b = blocks[j];
    const size_t saved = rounded(b.saved_bytes);
    std::vector<double> next(units + 1, kNone);
    for (size_t p = 0; p <= units; ++p) {
      if (best[p] == kNone) continue;
      for (uint8_t o : {kKeep, kFull, kSelective}) {
        if (o == kSelective && !has_selective(b)) continue;
        const size_t bytes = rounded(held_bytes(b, o));
        // kept: it fits; checkpointed: its recomputation fits on top too
        if (bytes > units - p || (o != kKeep && saved > units - p - bytes)) continue;
        const double seconds = best[p] + option_seconds(b, o);
        if (seconds < next[p + bytes]) {
          next[p + bytes] = seconds;
          from[j][p + bytes] = p;
          chose[j][p + bytes] = o;
        }
      }
    }
    best = std::move(next);
  }
  Options options(blocks.size(), kFull);  // nothing fits: a plan the caller finds over budget
  size_t q = 0;
  for (size_t p = 1; p <= units; ++p) {
    if (best[p] < best[q]) q = p;
  }
  if (best[q] == kNone) return options;
  for (size_t j = blocks.size(); j-- > 0;) {
    options[j] = chose[j][q];
    q = from[j][q];
  }
  return options;
}

// Whether every choice is tried (Note [Choosing a plan]): Release::kAtStepEnd and at most kExhaustivePlans of them.
bool exhaustive(const std::vector<BlockCost>& blocks, Release release) {
  if (release != Release::kAtStepEnd || blocks.size() > kExhaustiveBlocks) return false;
  size_t plans = 1;
  for (const BlockCost& b : blocks) {
    plans *= has_selective(b) ? 3 : 2;
    if (plans > kExhaustivePlans) return false;
  }
  return true;
}

// Every choice per block (kKeep, kFull, and kSelective where a block has it), in turn.
template <typename Consider>
void every_plan(const std::vector<BlockCost>& blocks, const Consider& consider) {
  Options options(blocks.size(), kKeep);
  while (true) {
    consider(options);
    size_t i = 0;  // the next choice: count up, each block a digit of 2 or 3
    for (; i < blocks.size(); ++i) {
      const uint8_t last = has_selective(blocks[i]) ? kSelective : kFull;
      if (options[i] < last) {
        ++options[i];
        break;
      }
      options[i] = kKeep;
    }
    if (i == blocks.size()) return;
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
                   int64_t prefire_ahead, Release release, const std::vector<bool>& selective) {
  check(blocks, release);
  if (checkpointed.size() != blocks.size() || (!selective.empty() && selective.size() != blocks.size())) {
    throw std::invalid_argument("prefire::plan_bytes: " + std::to_string(checkpointed.size()) + " choices and " +
                                std::to_string(selective.size()) + " selective ones for " +
                                std::to_string(blocks.size()) + " blocks (selective: none or one per block)");
  }
  if (prefire_ahead < 0) throw std::invalid_argument("prefire::plan_bytes: prefire_ahead must be >= 0");
  Options options(blocks.size(), kKeep);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const bool sel = !selective.empty() && selective[i];
    if (sel && (!checkpointed[i] || !has_selective(blocks[i]))) {
      throw std::invalid_argument("prefire::plan_bytes: block " + std::to_string(i) + " is chosen selective but " +
                                  (checkpointed[i] ? "has no selective checkpoint (selective_bytes -1)"
                                                   : "is not checkpointed"));
    }
    options[i] = sel ? kSelective : checkpointed[i] ? kFull : kKeep;
  }
  return held(blocks, options, prefire_ahead, release);
}

int64_t least_plan_bytes(const std::vector<BlockCost>& blocks, Release release) {
  check(blocks, release);
  int64_t least = std::numeric_limits<int64_t>::max();
  if (exhaustive(blocks, release)) {
    every_plan(blocks, [&](const Options& options) { least = std::min(least, held_at_step_end(blocks, options, 0)); });
    return least;
  }
  least = held(blocks, Options(blocks.size(), kKeep), 0, release);
  for (int64_t largest : distinct_sizes(blocks)) least = std::min(least, held(blocks, below(blocks, largest), 0, release));
  return least;
}

Plan plan_for_budget(const std::vector<BlockCost>& blocks, int64_t budget_bytes, Release release) {
  const int64_t least = least_plan_bytes(blocks, release);
  if (budget_bytes < least) {
    throw std::invalid_argument("prefire::plan_for_budget: budget_bytes=" + std::to_string(budget_bytes) +
                                " is below the least any plan holds: " + std::to_string(least) +
                                " bytes (Note [What a plan holds] in src/memory/plan.cpp)");
  }
  Options chosen;
  bool found = false;
  int64_t chosen_bytes = 0;
  double chosen_seconds = 0;
  auto consider = [&](const Options& options) {
    const int64_t bytes = held(blocks, options, 0, release);
    if (bytes > budget_bytes) return;
    const double seconds = recompute_seconds(blocks, options);
    if (found && (seconds > chosen_seconds || (seconds == chosen_seconds && bytes >= chosen_bytes))) return;
    found = true;
    chosen = options;
    chosen_bytes = bytes;
    chosen_seconds = seconds;
  };
  const size_t n = blocks.size();
  if (exhaustive(blocks, release)) every_plan(blocks, consider);
  consider(Options(n, kKeep));
  for (size_t every = 1; every <= n; ++every) {  // what torch users write: every n-th block (1: all)
    Options options(n, kKeep);
    for (size_t i = 0; i < n; i += every) options[i] = kFull;
    consider(options);
  }
  for (int64_t largest : distinct_sizes(blocks)) {
    consider(below(blocks, largest));  // least_plan_bytes()'s plans: one of them fits
    if (release == Release::kAtStepEnd && !exhaustive(blocks, release)) {
      const int64_t base = bytes_below(blocks, largest);
      if (base <= budget_bytes) consider(knapsack(blocks, largest, budget_bytes - base));
    }
  }
  if (release == Release::kInBackward) consider(by_position(blocks, budget_bytes));
  if (release == Release::kAtStepEnd && !exhaustive(blocks, release)) consider(greedy(blocks, budget_bytes, release));
  Plan best;
  for (uint8_t o : chosen) {
    best.checkpointed.push_back(o != kKeep);
    best.selective.push_back(o == kSelective);
  }
  best.peak_bytes = held(blocks, chosen, 0, release);
  if (release == Release::kAtStepEnd && moments(blocks) > 0) best.moment_bytes = moment_bytes(blocks, chosen);
  best.recompute_seconds = recompute_seconds(blocks, chosen);
  // what is left goes to prefiring ahead
  const int64_t checkpoints = std::count(best.checkpointed.begin(), best.checkpointed.end(), true);
  while (best.prefire_ahead + 1 < checkpoints) {
    const int64_t bytes = held(blocks, chosen, best.prefire_ahead + 1, release);
    if (bytes > budget_bytes) break;
    ++best.prefire_ahead;
    best.peak_bytes = bytes;
  }
  return best;
}

}  // namespace prefire
