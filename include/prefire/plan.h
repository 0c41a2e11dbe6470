#pragma once

// A memory budget in, a plan out: which blocks keep their activations, which
// are checkpointed (whole or selectively) and which are offloaded, and how many checkpointed blocks to prefire ahead of
// the backward that needs them, so that a step's activation bytes stay within
// the budget and it recomputes as little as the budget allows. Pure
// arithmetic on measured costs (no torch): the same plans for LibTorch
// programs, the Python package and the pipeline simulator, which all ask
// this planner rather than count a plan themselves. See Note [What a plan
// holds] in src/plan/plan_bytes.cpp.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace prefire {

/// Up to this many blocks, Release::kAtStepEnd plans are chosen by trying
/// every keep/checkpoint choice (Note [Choosing a plan] in src/plan/plan_search.cpp).
inline constexpr size_t kExhaustiveBlocks = 16;
/// ... and every keep/selective/full choice while there are at most this
/// many of them in all (3 per block that has a selective checkpoint).
inline constexpr size_t kExhaustivePlans = size_t{1} << kExhaustiveBlocks;

/// A block's choice in a plan.
enum class Choice : uint8_t {
  kKeep,        ///< its forward's saved tensors stay for backward
  kCheckpoint,  ///< only its inputs stay; backward recomputes it
  kSelective,   ///< its inputs and the outputs a policy keeps stay; backward recomputes the rest
  kOffload,     ///< its saved tensors go to a host tier in forward and come back for backward
};

/// What one block costs, as a step that checkpointed it measured. Build it
/// by field name (designated initializers in C++, keywords in Python): the
/// fields may grow.
struct BlockCost {
  int64_t saved_bytes = 0;        // bytes: what its forward saves for backward when kept (storages counted once)
  int64_t input_bytes = 0;        // bytes: what a checkpoint of it holds instead (its inputs)
  double recompute_seconds = 0;   // seconds: one recomputation of it (its forward)
  int64_t in_flight = 1;          // micro-batches whose forward it holds at once (1 without a pipeline)
  int64_t group = -1;             // blocks of one group are recomputed by one pass together (a pipeline
                                  // stage's blocks: its B holds them all for W); -1: a group of its own
  std::vector<int64_t> alive;     // optional, Release::kAtStepEnd: the micro-batches it holds at each moment
                                  // of a step (a pipeline rank's actions in order), each <= in_flight; every
                                  // block that has them the same moments; empty: in_flight at every moment
  std::vector<int64_t> done;      // optional, with alive: the micro-batches that let go by each moment
  int64_t saved_after_bytes = 0;  // bytes: of saved_bytes, what a kept block still holds after its micro-batch
                                  // let go, until the step ends (counted `done` times)
  int64_t input_after_bytes = 0;  // bytes: of input_bytes, the same for a checkpointed block
  // A selective checkpoint (torch's SAC policy: the outputs of some ops kept, the rest recomputed), a third
  // choice between keeping the block and checkpointing it whole (Note [Selective checkpoints in a plan]):
  int64_t selective_bytes = -1;       // bytes: what it holds instead (its inputs and the outputs it keeps); -1: none
  double selective_seconds = 0;       // seconds: what it adds to a step over keeping the block (its recomputation)
  int64_t selective_after_bytes = 0;  // bytes: of selective_bytes, the same as input_after_bytes
  // Offloading (Note [Offloaded blocks in a plan]), a fourth choice: its saved tensors (inputs too) are copied to a
  // host tier in forward and fetched back for its backward, recomputing nothing:
  int64_t offload_bytes = -1;       // bytes: what it still holds on the device meanwhile (what no tier takes: 0 for a
                                    // block of plain tensors); -1: offloading is not offered for it
  int64_t offload_moved_bytes = 0;  // bytes: what the copies move each way (its saved storages)
  double offload_seconds = 0;       // seconds: both copies at the tier's measured bandwidth (moved bytes each way)
  double offload_hidden = 0;        // 0..1: the part of offload_seconds the neighbouring compute hides
  int64_t offload_after_bytes = 0;  // bytes: of offload_bytes, the same as input_after_bytes
  std::vector<int64_t> passes;  // optional, with alive: the passes that recompute the block (once checkpointed)
                                // during the action that ends each moment (a pipeline stage's B, W or full
                                // backward: 1); with them a plan holds a pass only where one runs (Note [What a
                                // plan holds]); every block has them or none does; empty: the largest pass at
                                // every moment
};

/// When a step lets go of what a block holds (Note [What a plan holds]).
enum class Release {
  kAtStepEnd,   ///< all of it stays until the step's last backward pass (a pipeline, whose W follows B)
  kInBackward,  ///< one backward pass, last block first: a block lets go after its backward (a plain model)
};

struct Plan {
  std::vector<Choice> choices;     // per block, in the order given
  std::vector<bool> checkpointed;  // per block: choices[i] != kKeep
  std::vector<bool> selective;     // per block: choices[i] == kSelective
  std::vector<bool> offloaded;     // per block: choices[i] == kOffload
  int64_t prefire_ahead = 0;       // checkpointed blocks recomputed (offloaded ones fetched) ahead of their backward
  int64_t peak_bytes = 0;          // bytes: the most the plan holds, by Note [What a plan holds]
  double recompute_seconds = 0;    // seconds: what it adds per micro-batch (recomputation, copies left exposed)
  std::vector<double> block_seconds;  // per block: its share of recompute_seconds (choice_seconds(), or an
                                      // offloaded block's copies whole where the plan leaves no room for them)
  int64_t memory_budget = 0;       // bytes: the budget it was chosen for
  int64_t blocks_bytes = 0;        // bytes: the most the blocks hold at a moment, the passes left out
  std::vector<int64_t> pass_bytes;    // per block: what the pass that recomputes it holds (its group's checkpointed
                                      // blocks' saved bytes together); 0 for a kept block
  std::vector<int64_t> moment_bytes;  // Release::kAtStepEnd with moments: what the blocks hold at each one, the
                                      // passes left out
  std::vector<int64_t> room_bytes;    // Release::kAtStepEnd: what the budget leaves a runtime's sessions (a B's
                                      // recomputation kept for W, prefires) beside the blocks while the action
                                      // ending at each moment runs (one entry without moments: anywhere in the
                                      // step); see Note [What a plan holds]
};

/// For a plan of one backward pass (Release::kInBackward: a plain model),
/// per block j the offloaded blocks whose fetch begins when j's backward
/// begins (fetch_ahead in prefire/offload.h), nearest first, as far ahead as
/// `memory_budget` allows (Note [A reload schedule for a plain backward] in
/// src/plan/reload_schedule.cpp). Throws std::invalid_argument for sizes that
/// differ and costs plan_bytes() refuses.
std::vector<std::vector<int64_t>> reload_schedule(const std::vector<BlockCost>& blocks,
                                                  const std::vector<Choice>& choices, int64_t memory_budget);

/// The most bytes the plan `choices` keeps in an offload tier at once: its
/// offloaded blocks' moved bytes, for every micro-batch each holds at a
/// moment (Note [Offloaded blocks in a plan], rule 7). Throws as describe_plan() does.
int64_t tier_bytes(const std::vector<BlockCost>& blocks, const std::vector<Choice>& choices,
                   Release release = Release::kAtStepEnd);

/// The plan `choices` describes, counted as plan_for_budget() counts its own
/// (peak, moments, passes and room within `memory_budget`, which it may
/// exceed: then some room is negative). Throws as plan_bytes() does.
Plan describe_plan(const std::vector<BlockCost>& blocks, const std::vector<Choice>& choices, int64_t memory_budget,
                   int64_t prefire_ahead = 0, Release release = Release::kAtStepEnd);

/// Bytes the plan `checkpointed` holds at most with `prefire_ahead` blocks
/// prefired (Note [What a plan holds]); `selective`: per block, whether its
/// checkpoint is the selective one (empty: none is). Throws
/// std::invalid_argument on sizes that differ, a negative cost, a selective
/// choice for a block that is kept or has none, or in_flight above 1 or a group with
/// Release::kInBackward (one backward pass of one micro-batch, one block at a time).
int64_t plan_bytes(const std::vector<BlockCost>& blocks, const std::vector<bool>& checkpointed,
                   int64_t prefire_ahead = 0, Release release = Release::kAtStepEnd,
                   const std::vector<bool>& selective = {});

/// The part of an offloaded block's copies the compute beside them hides: the
/// copy into the tier, which runs behind the work after the block's forward
/// (up to about one forward: the block's recompute_seconds); not the fetch,
/// which its backward waits for unless it was prefetched (Note [Offloaded
/// blocks in a plan]).
inline constexpr double kOffloadHidden = 0.5;

/// `block` with offloading offered: its copies move `moved_bytes` each way in
/// `copy_seconds` (both copies, measured on the tier or from copy_seconds()),
/// kOffloadHidden of that hidden, and it holds nothing on the device from its
/// forward until its fetch (every storage it saves goes to the tier), nor
/// after its micro-batch let go. Throws std::invalid_argument on a negative
/// size or time.
BlockCost with_offload(BlockCost block, int64_t moved_bytes, double copy_seconds);

/// Seconds to copy `moved_bytes` to a tier at `to_tier` bytes per second and
/// back at `back` (both > 0).
double copy_seconds(int64_t moved_bytes, double to_tier, double back);

/// The choices `block` offers: keep and checkpoint, and selective and offload
/// where its costs have them.
std::vector<Choice> offered_choices(const BlockCost& block);

/// Seconds choice `choice` adds to a step over keeping `block` (0 kept; its
/// recomputation; its selective checkpoint's, Note [Selective checkpoints in a
/// plan]; offloaded, its copies' time the compute does not hide,
/// offload_seconds * (1 - offload_hidden) and what of the hidden share is
/// longer than recompute_seconds, Note [Offloaded blocks in a plan]).
double choice_seconds(const BlockCost& block, Choice choice);

/// The least any plan holds (nothing prefired): the bound plan_for_budget()
/// refuses below, where it finds a plan. Exact with Release::kInBackward, and
/// with Release::kAtStepEnd up to kExhaustivePlans choices; beyond, the least
/// among the plans that keep every block above a size and checkpoint the
/// others (Note [The least plan]).
int64_t least_plan_bytes(const std::vector<BlockCost>& blocks, Release release = Release::kAtStepEnd);

/// The plan that recomputes least within `memory_budget` bytes, then prefires as far
/// ahead as the bytes left allow. Throws std::invalid_argument for a budget
/// below least_plan_bytes() (the message names that minimum), a negative cost
/// or in_flight below 1. Any thread; deterministic.
Plan plan_for_budget(const std::vector<BlockCost>& blocks, int64_t memory_budget,
                     Release release = Release::kAtStepEnd);

}  // namespace prefire
