#include <prefire/plan.h>

#include "plan/plan_bytes.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

// Note [Choosing a plan]
// Recomputation is what a plan costs, so the best plan within a budget keeps
// the blocks whose recomputation takes longest per byte kept.
//  * kAtStepEnd, up to kExhaustivePlans choices in all (2 per block, 3 or 4
//    with a selective checkpoint or offloading; a pipeline rank's stages hold
//    a few blocks each): every one is tried, 2^16 sums of at most 16 terms, a few
//    milliseconds; the plan and least_plan_bytes() are exact.
//  * kAtStepEnd, more: with the largest checkpointed block fixed at M, that is a
//    knapsack with a choice per item: blocks larger than M are kept, the
//    others each cost in_flight * (saved - input) bytes to keep and save
//    their recompute_seconds, or in_flight * (selective - input) to check-
//    point selectively and save recompute_seconds - selective_seconds, or
//    in_flight * (offload - input) to offload and save recompute_seconds
//    less the copies' exposed time.
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
//    the same with selective checkpoints for those left; before the keeping,
//    every block whose offload costs less than its recomputation is
//    offloaded where that fits with room for a copy in flight (it frees
//    what the checkpoint held too; Note [Offloaded blocks in a plan], rule 6).
//  * kInBackward: the constraints are per position, so a dynamic program
//    over the blocks in forward order, its state what blocks 0..j hold;
//    checkpointing j (either way) needs its recomputation to fit on top of
//    that state.
// Both count bytes in kCapacityUnits units of what is left, a block's bytes
// rounded up (the plan found always fits; it may miss one that fits to the
// last byte). The plans a user would write by hand -- none, all, every n-th
// block -- and the plan least_plan_bytes() found (Note [The least plan])
// are tried too, so the plan is never worse than one of those that fits,
// and a budget of least_plan_bytes() has one. Offering a choice more never
// makes the plan worse: where the search is not exhaustive, its heuristics
// with four choices per block may miss a plan that the search over fewer
// finds (exhaustively, there), so the plan for the same blocks without
// offloading (and, in turn, without selective checkpoints) is a candidate too,
// where it fits. A plan that offloads is weighed by plan_seconds(): as
// rule 3 of Note [Offloaded blocks in a plan] counts it where it leaves room
// for a copy in flight, with its copies whole where it does not (rule 6);
// the knapsack and the dynamic program count per block, so each runs again
// for every room R a block's moved bytes make (offloading only blocks that
// move at most R, within the budget less R) and once with every copy
// exposed, and the candidates are compared by plan_seconds(). Then what the
// budget leaves (beside that room) goes to prefiring ahead. Cost: (distinct
// sizes) x (distinct moved bytes + 2) x blocks x kCapacityUnits, or
// (distinct moved bytes + 2) x blocks x kCapacityUnits.

// Note [The least plan]
// least_plan_bytes() is the bound plan_for_budget() refuses below, so it
// must be the least any plan holds: a budget it calls too small must have
// no plan, and one at it must have one.
//  * kInBackward: whether some plan holds at most B is decided in one pass
//    in forward order: block j's constraints (blocks 0..j within B, and
//    with a recomputation of j on top if checkpointed) read only what
//    blocks 0..j-1 hold, and every later constraint only gets easier when
//    they hold less; so taking, at each block, the choice that fits and
//    holds least is a plan within B whenever any is. The least B is then a
//    binary search over [0, what keeping every block holds]: exact, and its
//    plan is one plan_for_budget() tries.
//  * kAtStepEnd: exact by trying every choice up to kExhaustivePlans of
//    them; beyond, the passes of groups and the moments make the bytes no
//    sum of per-block terms, and the bound is the least among the plans
//    that keep every block above a size and checkpoint or offload the
//    others, whichever holds less (a plan at it exists, the least may be
//    lower).
// The property test (tests/plan_least_test.cpp) compares both with every
// assignment counted by plan_bytes() on random small instances.

namespace prefire {
namespace {

using plan_detail::add_product;
using plan_detail::copy_room;
using plan_detail::Choices;
using plan_detail::has_offload;
using plan_detail::has_selective;
using plan_detail::held;
using plan_detail::held_bytes;
using plan_detail::options_of;

constexpr int64_t kCapacityUnits = 4096;
constexpr Choice kKeep = Choice::kKeep;
constexpr Choice kCheckpoint = Choice::kCheckpoint;
constexpr Choice kSelective = Choice::kSelective;
constexpr Choice kOffload = Choice::kOffload;

// The blocks of size at most `largest` that stay checkpointed (fully or
// selectively) when the others are kept and `capacity` bytes are left to
// keep more of them, or to checkpoint them selectively, with (Note
// [Choosing a plan]): a knapsack with a choice per item.
Choices knapsack(const std::vector<BlockCost>& blocks, int64_t largest, int64_t capacity) {
  const int64_t unit = std::max<int64_t>(1, (capacity + kCapacityUnits - 1) / kCapacityUnits);
  const auto units = static_cast<size_t>(capacity / unit);
  struct Item {
    size_t block;
    Choice choice;  // kKeep, kSelective or kOffload, in place of kCheckpoint
    size_t weight;  // units
    double value;   // recompute seconds it saves over kCheckpoint
  };
  std::vector<std::vector<Item>> items;  // per block that has a choice, its choices beyond kCheckpoint
  Choices choices(blocks.size(), kKeep);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockCost& b = blocks[i];
    if (b.saved_bytes > largest) continue;  // kept
    const int64_t keep = add_product(0, b.in_flight, b.saved_bytes - b.input_bytes);
    if (keep <= 0) continue;  // keeping it costs nothing
    choices[i] = kCheckpoint;
    std::vector<Item> choice;
    auto add = [&](Choice c, int64_t extra, double value) {
      if (value <= 0) return;
      const int64_t w = (std::max<int64_t>(0, extra) + unit - 1) / unit;
      if (w <= static_cast<int64_t>(units)) choice.push_back({i, c, static_cast<size_t>(w), value});
    };
    add(kKeep, keep, b.recompute_seconds);
    if (has_selective(b)) {
      add(kSelective, add_product(0, b.in_flight, b.selective_bytes - b.input_bytes),
          b.recompute_seconds - b.selective_seconds);
    }
    if (has_offload(b)) {
      add(kOffload, add_product(0, b.in_flight, b.offload_bytes - b.input_bytes),
          b.recompute_seconds - choice_seconds(b, kOffload));
    }
    if (!choice.empty()) items.push_back(std::move(choice));
  }
  // best[c]: the most recompute seconds saved within c units; took[k][c]: item k's choice there (0: kCheckpoint)
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
    choices[item.block] = item.choice;
    c -= item.weight;
  }
  return choices;
}

// From every block checkpointed, each offloaded where that costs less than
// its recomputation and the plan still fits `budget`; then each kept in turn
// where the plan still fits, the most recompute seconds per byte kept first;
// then those left checkpointed selectively where that fits and costs less
// (Note [Choosing a plan]).
Choices greedy(const std::vector<BlockCost>& blocks, int64_t budget, Release release) {
  Choices choices(blocks.size(), kCheckpoint);
  std::vector<size_t> order(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) order[i] = i;
  auto per_byte = [&](size_t i) {
    return blocks[i].recompute_seconds / static_cast<double>(std::max<int64_t>(1, blocks[i].saved_bytes -
                                                                                       blocks[i].input_bytes));
  };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return per_byte(a) > per_byte(b); });
  auto try_choice = [&](size_t i, Choice c) {  // an offload with room for its copy (Note [Offloaded blocks in a plan])
    const Choice before = choices[i];
    choices[i] = c;
    if (add_product(held(blocks, choices, 0, release), 1, copy_room(blocks, choices)) > budget) choices[i] = before;
  };
  for (size_t i : order) {
    if (has_offload(blocks[i]) && choice_seconds(blocks[i], kOffload) < blocks[i].recompute_seconds) {
      try_choice(i, kOffload);
    }
  }
  for (size_t i : order) try_choice(i, kKeep);
  for (size_t i : order) {
    if (choices[i] != kKeep && has_selective(blocks[i]) &&
        blocks[i].selective_seconds < choice_seconds(blocks[i], choices[i])) {
      try_choice(i, kSelective);
    }
  }
  return choices;
}

// The choice of `b` other than keeping it that holds least (a checkpoint, or offloaded where that holds less).
Choice least_holding(const BlockCost& b) {
  Choice least = kCheckpoint;
  for (Choice o : options_of(b)) {
    if (o != kKeep && held_bytes(b, o) < held_bytes(b, least)) least = o;
  }
  return least;
}

// Every block larger than `largest` kept, the others checkpointed (or
// offloaded, whichever holds less) unless that holds no less than keeping them.
Choices below(const std::vector<BlockCost>& blocks, int64_t largest) {
  Choices choices(blocks.size(), kKeep);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Choice least = least_holding(blocks[i]);
    if (blocks[i].saved_bytes <= largest && held_bytes(blocks[i], least) < blocks[i].saved_bytes) choices[i] = least;
  }
  return choices;
}

// The plan that recomputes least with Release::kInBackward: dynamic
// programming over the blocks in forward order, the state what blocks 0..j
// hold, in kCapacityUnits units of the budget, bytes rounded up (Note
// [Choosing a plan]).
Choices by_position(const std::vector<BlockCost>& blocks, int64_t budget) {
  const int64_t unit = std::max<int64_t>(1, (budget + kCapacityUnits - 1) / kCapacityUnits);
  const auto units = static_cast<size_t>(budget / unit);
  auto rounded = [&](int64_t bytes) { return static_cast<size_t>(bytes / unit + (bytes % unit != 0)); };
  constexpr double kNone = std::numeric_limits<double>::infinity();
  std::vector<double> best(units + 1, kNone);  // best[p]: the least seconds with blocks 0..j holding p units
  best[0] = 0;
  // from[j][q]: the state before block j on the way to q; chose[j][q]: block j's choice there
  std::vector<std::vector<size_t>> from(blocks.size(), std::vector<size_t>(units + 1, 0));
  std::vector<Choices> chose(blocks.size(), Choices(units + 1, kKeep));
  for (size_t j = 0; j < blocks.size(); ++j) {
    const BlockCost& b = blocks[j];
    const size_t saved = rounded(b.saved_bytes);
    std::vector<double> next(units + 1, kNone);
    for (size_t p = 0; p <= units; ++p) {
      if (best[p] == kNone) continue;
      for (Choice o : options_of(b)) {
        const size_t bytes = rounded(held_bytes(b, o));
        // kept: it fits; checkpointed: its recomputation fits on top too
        if (bytes > units - p || (o != kKeep && saved > units - p - bytes)) continue;
        const double seconds = best[p] + choice_seconds(b, o);
        if (seconds < next[p + bytes]) {
          next[p + bytes] = seconds;
          from[j][p + bytes] = p;
          chose[j][p + bytes] = o;
        }
      }
    }
    best = std::move(next);
  }
  Choices choices(blocks.size(), kCheckpoint);  // nothing fits: a plan the caller finds over budget
  size_t q = 0;
  for (size_t p = 1; p <= units; ++p) {
    if (best[p] < best[q]) q = p;
  }
  if (best[q] == kNone) return choices;
  for (size_t j = blocks.size(); j-- > 0;) {
    choices[j] = chose[j][q];
    q = from[j][q];
  }
  return choices;
}

// Release::kInBackward: a plan within `budget` if there is one, each block the choice that fits and leaves
// blocks 0..j holding least (Note [The least plan]); false if none fits.
bool least_in_backward(const std::vector<BlockCost>& blocks, int64_t budget, Choices* choices) {
  choices->assign(blocks.size(), kKeep);
  int64_t prefix = 0;
  for (size_t j = 0; j < blocks.size(); ++j) {
    const BlockCost& b = blocks[j];
    int64_t least = -1;
    for (Choice o : options_of(b)) {
      const int64_t after = add_product(prefix, 1, held_bytes(b, o));
      if (after > budget || (o != kKeep && add_product(after, 1, b.saved_bytes) > budget)) continue;
      if (least < 0 || after < least) {
        least = after;
        (*choices)[j] = o;
      }
    }
    if (least < 0) return false;
    prefix = least;
  }
  return true;
}

// The least budget some Release::kInBackward plan fits, and that plan (Note [The least plan]).
int64_t least_bytes_in_backward(const std::vector<BlockCost>& blocks, Choices* plan) {
  *plan = Choices(blocks.size(), kKeep);
  int64_t low = 0;                                            // no plan fits below it
  int64_t high = held(blocks, *plan, 0, Release::kInBackward);  // *plan fits it
  while (low < high) {
    const int64_t mid = low + (high - low) / 2;
    Choices choices;
    if (least_in_backward(blocks, mid, &choices)) {
      high = mid;
      *plan = std::move(choices);
    } else {
      low = mid + 1;
    }
  }
  return high;
}

// Whether every choice is tried (Note [Choosing a plan]): Release::kAtStepEnd and at most kExhaustivePlans of them.
bool exhaustive(const std::vector<BlockCost>& blocks, Release release) {
  if (release != Release::kAtStepEnd || blocks.size() > kExhaustiveBlocks) return false;
  size_t plans = 1;
  for (const BlockCost& b : blocks) {
    plans *= options_of(b).size();
    if (plans > kExhaustivePlans) return false;
  }
  return true;
}

// Every choice per block (kKeep, kCheckpoint, and kSelective and kOffload where a block offers them), in turn.
template <typename Consider>
void every_plan(const std::vector<BlockCost>& blocks, const Consider& consider) {
  std::vector<Choices> options;
  for (const BlockCost& b : blocks) options.push_back(options_of(b));
  std::vector<size_t> digit(blocks.size(), 0);  // each block's index into its options
  Choices choices(blocks.size(), kKeep);
  while (true) {
    consider(choices);
    size_t i = 0;  // the next choice: count up, each block a digit of base 2 to 4
    for (; i < blocks.size(); ++i) {
      if (++digit[i] < options[i].size()) {
        choices[i] = options[i][digit[i]];
        break;
      }
      digit[i] = 0;
      choices[i] = kKeep;
    }
    if (i == blocks.size()) return;
  }
}

// `blocks` without choice `c` (kOffload or kSelective) offered; nullopt when none offers it.
std::optional<std::vector<BlockCost>> without(std::vector<BlockCost> blocks, Choice c) {
  bool offered = false;
  for (BlockCost& b : blocks) {
    int64_t& bytes = c == kOffload ? b.offload_bytes : b.selective_bytes;
    offered = offered || bytes >= 0;
    bytes = -1;
  }
  if (!offered) return std::nullopt;
  return blocks;
}

// The distinct moved bytes of the blocks that offer offloading: the rooms a plan that offloads may leave.
std::vector<int64_t> copy_rooms(const std::vector<BlockCost>& blocks) {
  std::vector<int64_t> rooms;
  for (const BlockCost& b : blocks) {
    if (has_offload(b)) rooms.push_back(b.offload_moved_bytes);
  }
  std::sort(rooms.begin(), rooms.end());
  rooms.erase(std::unique(rooms.begin(), rooms.end()), rooms.end());
  return rooms;
}

// `blocks` offering offload only where a block moves at most `room` bytes: a plan of them chosen within the
// budget less `room` leaves room for its copy in flight (Note [Offloaded blocks in a plan], rule 6).
std::vector<BlockCost> offloading_within(std::vector<BlockCost> blocks, int64_t room) {
  for (BlockCost& b : blocks) {
    if (b.offload_moved_bytes > room) b.offload_bytes = -1;
  }
  return blocks;
}

// `blocks` with nothing of their copies hidden: what a plan without room for a copy in flight adds (rule 6).
std::vector<BlockCost> copies_exposed(std::vector<BlockCost> blocks) {
  for (BlockCost& b : blocks) b.offload_hidden = 0;
  return blocks;
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
                       b.saved_bytes > largest ? b.saved_bytes
                                               : std::min(held_bytes(b, least_holding(b)), b.saved_bytes));
  }
  return held;
}

// The least any plan holds, and a plan that holds it (Note [The least plan]); the blocks checked.
int64_t least(const std::vector<BlockCost>& blocks, Release release, Choices* plan) {
  if (release == Release::kInBackward) return least_bytes_in_backward(blocks, plan);
  int64_t least = std::numeric_limits<int64_t>::max();
  auto consider = [&](const Choices& choices) {
    const int64_t bytes = held(blocks, choices, 0, release);
    if (bytes < least) {
      least = bytes;
      *plan = choices;
    }
  };
  if (exhaustive(blocks, release)) {
    every_plan(blocks, consider);
    return least;
  }
  consider(Choices(blocks.size(), kKeep));
  for (int64_t largest : distinct_sizes(blocks)) consider(below(blocks, largest));
  return least;
}

}  // namespace

int64_t least_plan_bytes(const std::vector<BlockCost>& blocks, Release release) {
  plan_detail::check(blocks, release);
  Choices plan;
  return least(blocks, release, &plan);
}

Plan plan_for_budget(const std::vector<BlockCost>& blocks, int64_t memory_budget, Release release) {
  plan_detail::check(blocks, release);
  Choices least_plan;
  const int64_t least_bytes = least(blocks, release, &least_plan);
  if (memory_budget < least_bytes) {
    throw std::invalid_argument("prefire::plan_for_budget: memory_budget=" + std::to_string(memory_budget) +
                                " bytes is below the least any plan holds: " + std::to_string(least_bytes) +
                                " bytes (Note [What a plan holds] in src/plan/plan_bytes.cpp)");
  }
  Choices chosen;
  bool found = false;
  int64_t chosen_bytes = 0;
  double chosen_seconds = 0;
  auto consider = [&](const Choices& choices) {
    const int64_t bytes = held(blocks, choices, 0, release);
    if (bytes > memory_budget) return;
    const double seconds = plan_detail::plan_seconds(blocks, choices, bytes, memory_budget);
    if (found && (seconds > chosen_seconds || (seconds == chosen_seconds && bytes >= chosen_bytes))) return;
    found = true;
    chosen = choices;
    chosen_bytes = bytes;
    chosen_seconds = seconds;
  };
  const size_t n = blocks.size();
  if (exhaustive(blocks, release)) every_plan(blocks, consider);
  consider(Choices(n, kKeep));
  for (size_t every = 1; every <= n; ++every) {  // what torch users write: every n-th block (1: all)
    Choices choices(n, kKeep);
    for (size_t i = 0; i < n; i += every) choices[i] = kCheckpoint;
    consider(choices);
  }
  consider(least_plan);  // one fits: the budget is at least what it holds
  const std::vector<int64_t> rooms = copy_rooms(blocks);
  for (int64_t largest : distinct_sizes(blocks)) {
    consider(below(blocks, largest));
    if (release == Release::kAtStepEnd && !exhaustive(blocks, release)) {
      const int64_t base = bytes_below(blocks, largest);
      if (base <= memory_budget) {
        consider(knapsack(blocks, largest, memory_budget - base));
        if (!rooms.empty()) consider(knapsack(copies_exposed(blocks), largest, memory_budget - base));
      }
      for (int64_t room : rooms) {  // the same, leaving room for a copy in flight
        if (add_product(base, 1, room) <= memory_budget) {
          consider(knapsack(offloading_within(blocks, room), largest, memory_budget - base - room));
        }
      }
    }
  }
  if (release == Release::kInBackward) {
    consider(by_position(blocks, memory_budget));
    if (!rooms.empty()) consider(by_position(copies_exposed(blocks), memory_budget));
    for (int64_t room : rooms) {
      if (room <= memory_budget) consider(by_position(offloading_within(blocks, room), memory_budget - room));
    }
    Choices fits;
    if (least_in_backward(blocks, memory_budget, &fits)) consider(fits);
  }
  if (release == Release::kAtStepEnd && !exhaustive(blocks, release)) consider(greedy(blocks, memory_budget, release));
  if (!exhaustive(blocks, release)) {  // a choice more never makes the plan worse (Note [Choosing a plan])
    for (Choice c : {kOffload, kSelective}) {
      std::optional<std::vector<BlockCost>> fewer = without(blocks, c);
      if (!fewer) continue;
      Choices fewer_least;
      if (least(*fewer, release, &fewer_least) <= memory_budget) {
        consider(plan_for_budget(*fewer, memory_budget, release).choices);  // it tries the next one itself
      }
      break;
    }
  }
  // what is left (beside the copy's room, where it had it) goes to prefiring ahead
  const int64_t checkpoints = std::count_if(chosen.begin(), chosen.end(), [](Choice c) { return c != kKeep; });
  const int64_t copy = copy_room(blocks, chosen);
  const int64_t room = add_product(chosen_bytes, 1, copy) <= memory_budget ? copy : 0;
  int64_t ahead = 0;
  while (ahead + 1 < checkpoints && add_product(held(blocks, chosen, ahead + 1, release), 1, room) <= memory_budget) {
    ++ahead;
  }
  return plan_detail::describe(blocks, chosen, memory_budget, ahead, release);
}

}  // namespace prefire
