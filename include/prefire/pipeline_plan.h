#pragma once

// A pipeline rank's plan, from its actions: the lifetimes of its
// micro-batches, its blocks as the planner's items (one per micro-batch where
// the actions are known), the plan seen per stage, and what its sessions may
// hold action by action beside the plan's blocks: whether a B keeps its
// recomputation for W, how far a bubble prefire may fill (Note [A pipeline
// rank's memory plan] in python/prefire/pipelining/_plan.py, Note [A rank's
// byte budget] in python/prefire/pipelining/_budget.py). The Python pipeline,
// the pipeline simulator and prefire-bench all ask these. Pure arithmetic, no
// torch.

#include <prefire/plan.h>

#include <cstdint>
#include <vector>

namespace prefire {

/// The compute actions of a pipeline rank.
enum class ActionKind : uint8_t { kForward, kB, kW, kFullBackward };

/// One of a rank's compute actions, in its schedule's order.
struct RankAction {
  ActionKind kind = ActionKind::kForward;
  int64_t stage = 0;
  int64_t micro_batch = 0;
};

/// Per action of a rank, what it means for the micro-batches of one stage.
struct Lifetime {
  std::vector<int64_t> alive;   // after the action: micro-batches between their F and their W (or full backward)
  std::vector<int64_t> done;    // ... past it
  std::vector<int64_t> passes;  // the action is a pass (B, W, full backward) of this many of them (0 or 1)
};

/// The lifetime of `stage`'s micro-batches over `actions`; with
/// `micro_batch` >= 0, of that micro-batch alone.
Lifetime lifetime(const std::vector<RankAction>& actions, int64_t stage, int64_t micro_batch = -1);

/// `blocks` (per block, its group the stage it belongs to) with their stage's
/// lifetime over the rank's `actions`: alive, done and passes per action, in
/// flight the most alive at once; without actions, in flight `micro_batches`
/// at every moment. One choice per block for every micro-batch is counted so.
std::vector<BlockCost> rank_blocks(const std::vector<BlockCost>& blocks, const std::vector<RankAction>& actions,
                                   int64_t micro_batches);

/// The planner's items for a rank's `blocks` (per block, its group the stage
/// it belongs to): with `actions`, one per (stage, micro-batch, block), stages
/// in the order their blocks come, then micro-batches, then blocks, each alive
/// from its micro-batch's F to its W, recomputed by that micro-batch's B and
/// W, a group per (stage, micro-batch), in flight 1 (so a plan chooses per
/// micro-batch); without actions, rank_blocks().
std::vector<BlockCost> rank_items(const std::vector<BlockCost>& blocks, const std::vector<RankAction>& actions,
                                  int64_t micro_batches);

/// What a rank's plan says of one of its stages.
struct StagePlan {
  int64_t stage = 0;
  std::vector<std::vector<Choice>> choices;  // per micro-batch, per block of the stage
  int64_t pass_bytes = 0;                    // bytes: the most one pass of the stage holds (Plan::pass_bytes)
};

/// `plan` of rank_items(blocks, ...) (a choice per item) or of the blocks (a
/// choice per block, the same for every micro-batch), per stage, in the order
/// the stages' blocks come. Throws std::invalid_argument for a plan of
/// another size.
std::vector<StagePlan> stage_plans(const Plan& plan, const std::vector<BlockCost>& blocks, int64_t micro_batches);

/// One of a rank's actions as its sessions' budget sees it.
struct SessionAction {
  ActionKind kind = ActionKind::kForward;
  int64_t key = 0;             // its stage and micro-batch, numbered by the caller (0..keys-1)
  int64_t need = 0;            // bytes its pass holds while it recomputes (0: it recomputes nothing)
  int64_t kept = -1;           // B: bytes its session keeps for W after it (trimmed); -1: all it held
  bool w_recomputes = false;   // W, when later Bs keep (keep_for_w): its B already let go, so it recomputes
  bool kept_for_w = false;     // W, when later Bs let go: its B kept its recomputation, so it does not
};

/// The least room the sessions leave from the action at `now` through the
/// actions [begin, end): `room[t]` is what the budget leaves them while
/// action t runs (Plan::room_bytes, or the session budget at every t),
/// `held[key]` what each session holds now. Each B or full backward holds
/// its need less what its session holds; `keep_for_w`: a later B keeps what
/// it recomputed (`kept` of it) until its W, else it lets go and its W
/// recomputes. Negative: the actions go over the budget. Throws
/// std::invalid_argument on indices outside the actions or keys.
int64_t least_session_room(const std::vector<int64_t>& room, const std::vector<SessionAction>& actions,
                           std::vector<int64_t> held, int64_t now, int64_t begin, int64_t end, bool keep_for_w);

/// Whether a B's session keeps what B recomputed until its W.
struct KeepForW {
  bool keep = false;            // it keeps it
  std::vector<int64_t> let_go;  // keys of the sessions to let go of first, in order (none when it does not keep)
};

/// After the B of session `key` at action `b_at`: whether the actions from
/// there to its W (the first W of `key` after `b_at`) stay within `room` with
/// it kept, every other session at its floor meanwhile (a later B lets go, its
/// W recomputes: what any later decision can fall back to, so no later moment
/// finds the kept session over the budget). If not, the sessions of
/// `may_let_go` (bubble-prefired ones, in the order to let go of them) are let
/// go of one at a time until they do, or it does not keep. Without a place in
/// the actions (`b_at` -1, or no W of `key` after it): whether what is held
/// and `need` fit the least room. Throws as least_session_room() does.
KeepForW keep_for_w(const std::vector<int64_t>& room, const std::vector<SessionAction>& actions,
                    std::vector<int64_t> held, int64_t key, int64_t b_at, int64_t need,
                    const std::vector<int64_t>& may_let_go);

}  // namespace prefire
