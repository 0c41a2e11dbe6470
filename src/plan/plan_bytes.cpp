#include "plan/plan_bytes.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

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
//    then fit what the blocks leave of the budget while each action runs:
//    Plan::room_bytes[t] = budget - the more of moment_bytes[t - 1] and
//    moment_bytes[t] (the action ending at t begins with the first and
//    ends with the second), which Note [A rank's byte budget] in
//    python/prefire/pipelining/_budget.py spends action by action;
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
// Note [Offloaded blocks in a plan]
// A block may have a fourth choice (BlockCost::offload_bytes >= 0): offloaded
// (Note [Offloading a checkpoint] in src/checkpoint/offloaded_slots.cpp), its
// saved tensors copied to a host tier in forward and fetched back for its
// backward; it recomputes nothing. The rules, each in with_offload() or here:
//  1. Between the two copies it holds nothing on the device: every storage it
//     saves, its inputs among them, goes to the tier (offload_bytes 0), and
//     nothing after its micro-batch let go.
//  2. Its fetch is charged the block's saved bytes where a recomputation would
//     be, in its pass and as a prefire when fetched ahead: the fetched copy is
//     what the recomputation would have made.
//  3. It costs a step the copies' time the compute beside them does not hide,
//     offload_seconds * (1 - offload_hidden) + the part of the hidden share
//     longer than the block's recompute_seconds, weighed against the other
//     choices by that one measure (Plan::recompute_seconds, "seconds added").
//  4. offload_hidden is kOffloadHidden, one half: the copy into the tier runs
//     on the tier's worker or copy stream behind the work after the block's
//     forward, and hides behind about one block's forward (the next block's,
//     which takes about what this one's recomputation does): a copy longer
//     than that keeps the next forward waiting for the rest (rule 6). The
//     fetch is counted on the critical path of the backward that
//     needs it (a pipeline's B fetches when it reaches the block unless a
//     bubble prefire fetched it ahead; a plain backward fetches ahead as far
//     as the plan leaves room, Note [A reload schedule for a plain backward]
//     in src/plan/reload_schedule.cpp: where either does, more is hidden
//     than the plan counts).
//  5. offload_seconds is both copies of the block's saved storages: measured
//     on the tier (OffloadTier::measure_copy_seconds) or, for an assumed tier,
//     copy_seconds() from a bandwidth each way.
//  6. Rule 1 holds from a plan's first step only where forward cannot run
//     ahead of the copies: the planners set the tier's max_pending_bytes to
//     the budget less the plan's peak (Note [Backpressure on copies into a
//     tier] in src/offload/tier_store.cpp), and both refuse a plan that keeps
//     more in the tier at once than it holds (rule 7). A plan that fills its
//     budget leaves no room for a copy in flight, and every copy into the
//     tier then keeps forward waiting (measured on 2 ranks at 1 GB/s: a
//     stage's forward of two offloaded blocks 12 ms longer, the copies 8 ms):
//     so a plan that offloads adds what rule 3 says only where it also
//     leaves copy_room() (its largest offloaded block's moved bytes) below
//     the budget, room for the one copy rule 4 hides; without it, every
//     offloaded block's copies whole (block_seconds(): Plan::block_seconds,
//     summed in Plan::recompute_seconds, what plan_for_budget() chooses by
//     and what the simulator's replays of a plan charge each block).
//  7. The tier holds an offloaded block's moved bytes for every micro-batch
//     it holds (BlockCost::alive at each moment, in_flight without moments;
//     in one backward pass every offloaded block at the end of forward):
//     tier_bytes(), the most over the moments, which a planner checks
//     against the tier's capacity before it runs the plan (regions are
//     whole pages per storage, so a tier needs a little more than this).
// offload_bytes -1 (the default) offers no offload, so no plan chooses it
// without its costs.
//

namespace prefire::plan_detail {

bool has_selective(const BlockCost& b) { return b.selective_bytes >= 0; }
bool has_offload(const BlockCost& b) { return b.offload_bytes >= 0; }

int64_t held_bytes(const BlockCost& b, Choice c) {
  switch (c) {
    case Choice::kKeep:
      return b.saved_bytes;
    case Choice::kCheckpoint:
      return b.input_bytes;
    case Choice::kSelective:
      return b.selective_bytes;
    case Choice::kOffload:
      return b.offload_bytes;
  }
  return b.saved_bytes;
}

Choices options_of(const BlockCost& b) {
  Choices options{Choice::kKeep, Choice::kCheckpoint};
  if (has_selective(b)) options.push_back(Choice::kSelective);
  if (has_offload(b)) options.push_back(Choice::kOffload);
  return options;
}

double recompute_seconds(const std::vector<BlockCost>& blocks, const Choices& choices) {
  double total = 0;
  for (size_t i = 0; i < blocks.size(); ++i) total += choice_seconds(blocks[i], choices[i]);
  return total;
}

size_t moments(const std::vector<BlockCost>& blocks) {
  for (const BlockCost& b : blocks) {
    if (!b.alive.empty()) return b.alive.size();
  }
  return 0;
}

namespace {

// Whether the blocks say when their passes run (BlockCost::passes).
bool timed_passes(const std::vector<BlockCost>& blocks) {
  return std::any_of(blocks.begin(), blocks.end(), [](const BlockCost& b) { return !b.passes.empty(); });
}

}  // namespace

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
        b.selective_after_bytes < 0 || b.selective_after_bytes > std::max<int64_t>(0, b.selective_bytes) ||
        b.offload_after_bytes < 0 || b.offload_after_bytes > std::max<int64_t>(0, b.offload_bytes)) {
      throw std::invalid_argument("prefire::plan: block " + std::to_string(i) + ": done needs as many moments as "
                                  "alive, none negative, and the after bytes must lie within 0..saved, input, "
                                  "selective or offload bytes");
    }
    if (b.saved_bytes < 0 || b.input_bytes < 0 || !(b.recompute_seconds >= 0) || b.in_flight < 1 || b.group < -1 ||
        b.selective_bytes < -1 || !(b.selective_seconds >= 0) || b.offload_bytes < -1 ||
        b.offload_moved_bytes < 0 || !(b.offload_seconds >= 0) || !(b.offload_hidden >= 0 && b.offload_hidden <= 1)) {
      throw std::invalid_argument("prefire::plan: block " + std::to_string(i) +
                                  " has a negative size or time (selective_bytes and offload_bytes -1: none), "
                                  "offload_hidden outside 0..1, in_flight below 1 or a group below -1");
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

namespace {

int64_t after_bytes(const BlockCost& b, Choice c) {
  switch (c) {
    case Choice::kKeep:
      return b.saved_after_bytes;
    case Choice::kCheckpoint:
      return b.input_after_bytes;
    case Choice::kSelective:
      return b.selective_after_bytes;
    case Choice::kOffload:
      return b.offload_after_bytes;
  }
  return b.saved_after_bytes;
}

// What the blocks hold at each moment of a step with Release::kAtStepEnd,
// passes left out (one moment without BlockCost::alive).
std::vector<int64_t> moment_bytes(const std::vector<BlockCost>& blocks, const Choices& choices) {
  std::vector<int64_t> at(std::max<size_t>(1, moments(blocks)), 0);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockCost& b = blocks[i];
    const int64_t bytes = held_bytes(b, choices[i]);
    const int64_t after = after_bytes(b, choices[i]);
    for (size_t t = 0; t < at.size(); ++t) {
      at[t] = add_product(at[t], b.alive.empty() ? b.in_flight : b.alive[t], bytes);
      if (!b.done.empty()) at[t] = add_product(at[t], b.done[t], after);
    }
  }
  return at;
}

// Per block, what the pass that recomputes it holds: its group's checkpointed
// blocks' saved bytes together (a selective one's too: Note [Selective
// checkpoints in a plan]; an offloaded one's fetch: Note [Offloaded blocks in
// a plan]); 0 for a kept block.
std::vector<int64_t> pass_bytes(const std::vector<BlockCost>& blocks, const Choices& choices) {
  std::vector<std::pair<int64_t, int64_t>> groups;  // (group, its checkpointed blocks' saved bytes)
  auto group_of = [&](int64_t group) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == group; });
    return it == groups.end() ? groups.insert(groups.end(), {group, 0}) : it;
  };
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (choices[i] != Choice::kKeep && blocks[i].group >= 0) {
      auto it = group_of(blocks[i].group);
      it->second = add_product(it->second, 1, blocks[i].saved_bytes);
    }
  }
  std::vector<int64_t> out(blocks.size(), 0);
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (choices[i] == Choice::kKeep) continue;
    out[i] = blocks[i].group < 0 ? blocks[i].saved_bytes : group_of(blocks[i].group)->second;
  }
  return out;
}

bool any_checkpointed(const Choices& choices) {
  return std::any_of(choices.begin(), choices.end(), [](Choice c) { return c != Choice::kKeep; });
}

// What a plan holds with Release::kAtStepEnd (Note [What a plan holds]).
int64_t held_at_step_end(const std::vector<BlockCost>& blocks, const Choices& choices, int64_t ahead) {
  const std::vector<int64_t> at = moment_bytes(blocks, choices);
  const int64_t most = *std::max_element(at.begin(), at.end());
  if (!any_checkpointed(choices)) return most;
  const std::vector<int64_t> per_block = pass_bytes(blocks, choices);
  const int64_t pass = *std::max_element(per_block.begin(), per_block.end());  // the largest pass
  if (!timed_passes(blocks)) return add_product(most, 1 + ahead, pass);
  std::vector<int64_t> passing(at.size(), 0);  // what the passes ending at each moment recompute
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (choices[i] == Choice::kKeep) continue;
    for (size_t t = 0; t < blocks[i].passes.size(); ++t) {
      passing[t] = add_product(passing[t], blocks[i].passes[t], blocks[i].saved_bytes);
    }
  }
  int64_t held = 0;
  for (size_t t = 0; t < at.size(); ++t) {
    held = std::max(held, at[t]);
    if (passing[t] > 0) held = std::max(held, add_product(std::max(at[t], t > 0 ? at[t - 1] : 0), 1, passing[t]));
  }
  return add_product(held, ahead, pass);
}

// What a plan holds with Release::kInBackward: when block j's backward runs, what blocks 0..j hold,
// j's recomputation and the `ahead` nearest checkpointed blocks' below it.
int64_t held_in_backward(const std::vector<BlockCost>& blocks, const Choices& choices, int64_t ahead) {
  int64_t prefix = 0;
  int64_t peak = 0;
  std::vector<int64_t> recomputations_below;  // saved bytes of the checkpointed blocks before j, nearest last
  for (size_t j = 0; j < blocks.size(); ++j) {
    const BlockCost& b = blocks[j];
    prefix = add_product(prefix, 1, held_bytes(b, choices[j]));
    peak = std::max(peak, prefix);
    if (choices[j] == Choice::kKeep) continue;
    int64_t held = add_product(prefix, 1, b.saved_bytes);
    for (int64_t k = 0; k < ahead && k < static_cast<int64_t>(recomputations_below.size()); ++k) {
      held = add_product(held, 1, recomputations_below[recomputations_below.size() - 1 - static_cast<size_t>(k)]);
    }
    peak = std::max(peak, held);
    recomputations_below.push_back(b.saved_bytes);
  }
  return peak;
}

// Per block: checkpointed selectively or not, checked against the costs.
Choices choices_of(const std::vector<BlockCost>& blocks, const std::vector<bool>& checkpointed,
                   const std::vector<bool>& selective) {
  if (checkpointed.size() != blocks.size() || (!selective.empty() && selective.size() != blocks.size())) {
    throw std::invalid_argument("prefire::plan_bytes: " + std::to_string(checkpointed.size()) + " choices and " +
                                std::to_string(selective.size()) + " selective ones for " +
                                std::to_string(blocks.size()) + " blocks (selective: none or one per block)");
  }
  Choices choices(blocks.size(), Choice::kKeep);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const bool sel = !selective.empty() && selective[i];
    if (sel && !checkpointed[i]) {
      throw std::invalid_argument("prefire::plan_bytes: block " + std::to_string(i) +
                                  " is chosen selective but is not checkpointed");
    }
    choices[i] = sel ? Choice::kSelective : checkpointed[i] ? Choice::kCheckpoint : Choice::kKeep;
  }
  return choices;
}

void check_choices(const std::vector<BlockCost>& blocks, const Choices& choices, int64_t ahead) {
  if (choices.size() != blocks.size()) {
    throw std::invalid_argument("prefire::plan_bytes: " + std::to_string(choices.size()) + " choices for " +
                                std::to_string(blocks.size()) + " blocks");
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (choices[i] == Choice::kSelective && !has_selective(blocks[i])) {
      throw std::invalid_argument("prefire::plan_bytes: block " + std::to_string(i) +
                                  " is chosen selective but has no selective checkpoint (selective_bytes -1)");
    }
    if (choices[i] == Choice::kOffload && !has_offload(blocks[i])) {
      throw std::invalid_argument("prefire::plan_bytes: block " + std::to_string(i) +
                                  " is chosen offloaded but offloading is not offered for it (offload_bytes -1)");
    }
    if (static_cast<uint8_t>(choices[i]) > static_cast<uint8_t>(Choice::kOffload)) {
      throw std::invalid_argument("prefire::plan_bytes: block " + std::to_string(i) + " has an invalid choice");
    }
  }
  if (ahead < 0) throw std::invalid_argument("prefire::plan_bytes: prefire_ahead must be >= 0");
}

}  // namespace

int64_t held(const std::vector<BlockCost>& blocks, const Choices& choices, int64_t ahead, Release release) {
  return release == Release::kInBackward ? held_in_backward(blocks, choices, ahead)
                                         : held_at_step_end(blocks, choices, ahead);
}

int64_t copy_room(const std::vector<BlockCost>& blocks, const Choices& choices) {
  int64_t room = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (choices[i] == Choice::kOffload) room = std::max(room, blocks[i].offload_moved_bytes);
  }
  return room;
}

std::vector<double> block_seconds(const std::vector<BlockCost>& blocks, const Choices& choices, int64_t bytes,
                                  int64_t memory_budget) {
  const bool room = add_product(bytes, 1, copy_room(blocks, choices)) <= memory_budget;
  std::vector<double> out(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {  // without room, forward waits for every copy into the tier
    out[i] = !room && choices[i] == Choice::kOffload ? blocks[i].offload_seconds : choice_seconds(blocks[i], choices[i]);
  }
  return out;
}

double plan_seconds(const std::vector<BlockCost>& blocks, const Choices& choices, int64_t bytes,
                    int64_t memory_budget) {
  double total = 0;
  for (const double s : block_seconds(blocks, choices, bytes, memory_budget)) total += s;
  return total;
}

Plan describe(const std::vector<BlockCost>& blocks, const Choices& choices, int64_t memory_budget, int64_t ahead,
              Release release) {
  Plan plan;
  plan.choices = choices;
  for (Choice c : choices) {
    plan.checkpointed.push_back(c != Choice::kKeep);
    plan.selective.push_back(c == Choice::kSelective);
    plan.offloaded.push_back(c == Choice::kOffload);
  }
  plan.prefire_ahead = ahead;
  plan.peak_bytes = held(blocks, choices, ahead, release);
  plan.block_seconds = block_seconds(blocks, choices, plan.peak_bytes, memory_budget);
  for (const double s : plan.block_seconds) plan.recompute_seconds += s;
  plan.memory_budget = memory_budget;
  plan.pass_bytes = pass_bytes(blocks, choices);
  if (release == Release::kInBackward) {
    for (size_t i = 0; i < blocks.size(); ++i) {  // the end of forward: every block holds
      plan.blocks_bytes = add_product(plan.blocks_bytes, 1, held_bytes(blocks[i], choices[i]));
    }
    return plan;
  }
  const std::vector<int64_t> at = moment_bytes(blocks, choices);
  plan.blocks_bytes = *std::max_element(at.begin(), at.end());
  if (moments(blocks) == 0) {
    plan.room_bytes = {memory_budget - plan.blocks_bytes};
    return plan;
  }
  plan.moment_bytes = at;
  for (size_t t = 0; t < at.size(); ++t) {
    plan.room_bytes.push_back(memory_budget - std::max(at[t], t > 0 ? at[t - 1] : 0));
  }
  return plan;
}

}  // namespace prefire::plan_detail

namespace prefire {

using plan_detail::Choices;

std::vector<Choice> offered_choices(const BlockCost& block) { return plan_detail::options_of(block); }

double choice_seconds(const BlockCost& b, Choice c) {
  switch (c) {
    case Choice::kKeep:
      return 0.0;
    case Choice::kCheckpoint:
      return b.recompute_seconds;
    case Choice::kSelective:
      return b.selective_seconds;
    case Choice::kOffload: {  // Note [Offloaded blocks in a plan], rules 3 and 4
      const double hidden = b.offload_seconds * b.offload_hidden;
      return b.offload_seconds - hidden + std::max(0.0, hidden - b.recompute_seconds);
    }
  }
  return 0.0;
}

BlockCost with_offload(BlockCost block, int64_t moved_bytes, double copy_seconds) {
  if (moved_bytes < 0 || !(copy_seconds >= 0)) {
    throw std::invalid_argument("prefire::with_offload: moved_bytes " + std::to_string(moved_bytes) +
                                " and copy_seconds " + std::to_string(copy_seconds) + " must be >= 0");
  }
  block.offload_bytes = 0;  // Note [Offloaded blocks in a plan], rule 1
  block.offload_after_bytes = 0;
  block.offload_moved_bytes = moved_bytes;
  block.offload_seconds = copy_seconds;
  block.offload_hidden = kOffloadHidden;
  return block;
}

double copy_seconds(int64_t moved_bytes, double to_tier, double back) {
  if (moved_bytes < 0 || !(to_tier > 0) || !(back > 0)) {
    throw std::invalid_argument("prefire::copy_seconds: moved_bytes must be >= 0 and both bandwidths > 0");
  }
  return static_cast<double>(moved_bytes) / to_tier + static_cast<double>(moved_bytes) / back;
}

int64_t tier_bytes(const std::vector<BlockCost>& blocks, const std::vector<Choice>& choices, Release release) {
  plan_detail::check(blocks, release);
  plan_detail::check_choices(blocks, choices, 0);
  // Note [Offloaded blocks in a plan], rule 7
  std::vector<int64_t> at(release == Release::kInBackward ? 1 : std::max<size_t>(1, plan_detail::moments(blocks)), 0);
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (choices[i] != Choice::kOffload) continue;
    const BlockCost& b = blocks[i];
    for (size_t t = 0; t < at.size(); ++t) {
      const int64_t held = release == Release::kInBackward ? 1 : b.alive.empty() ? b.in_flight : b.alive[t];
      at[t] = plan_detail::add_product(at[t], held, b.offload_moved_bytes);
    }
  }
  return *std::max_element(at.begin(), at.end());
}

int64_t plan_bytes(const std::vector<BlockCost>& blocks, const std::vector<bool>& checkpointed,
                   int64_t prefire_ahead, Release release, const std::vector<bool>& selective) {
  plan_detail::check(blocks, release);
  const Choices choices = plan_detail::choices_of(blocks, checkpointed, selective);
  plan_detail::check_choices(blocks, choices, prefire_ahead);
  return plan_detail::held(blocks, choices, prefire_ahead, release);
}

Plan describe_plan(const std::vector<BlockCost>& blocks, const std::vector<Choice>& choices, int64_t memory_budget,
                   int64_t prefire_ahead, Release release) {
  plan_detail::check(blocks, release);
  plan_detail::check_choices(blocks, choices, prefire_ahead);
  return plan_detail::describe(blocks, choices, memory_budget, prefire_ahead, release);
}

}  // namespace prefire
