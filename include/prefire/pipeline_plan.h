#pragma once

// A pipeline rank's plan, from its actions: the lifetimes of its
// micro-batches, its blocks as one plan item per micro-batch (Note [A
// pipeline rank's memory plan] in python/prefire/_pipeline_plan.py), and what
// its sessions may hold action by action beside the plan's blocks (Note [A
// rank's byte budget] in python/prefire/_budget.py: whether a B keeps its
// recomputation for W, how far a bubble prefire may fill). The Python
// pipeline and prefire-bench both ask these. Pure arithmetic, no torch.

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

/// `blocks` (per block, its group the stage it belongs to) as one plan item
/// per (stage, micro-batch, block), stages in the order their blocks come:
/// each alive from its micro-batch's F to its W, recomputed by that
/// micro-batch's B and W, a group per (stage, micro-batch), in flight 1.
std::vector<BlockCost> per_micro_batch(const std::vector<BlockCost>& blocks, const std::vector<RankAction>& actions,
                                       int64_t micro_batches);

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

}  // namespace prefire
