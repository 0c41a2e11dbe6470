#include <prefire/pipeline_plan.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace prefire {

Lifetime lifetime(const std::vector<RankAction>& actions, int64_t stage, int64_t micro_batch) {
  Lifetime out;
  int64_t held = 0, gone = 0;
  for (const RankAction& a : actions) {
    const bool mine = a.stage == stage && (micro_batch < 0 || a.micro_batch == micro_batch);
    if (mine && a.kind == ActionKind::kForward) {
      ++held;
    } else if (mine && (a.kind == ActionKind::kW || a.kind == ActionKind::kFullBackward)) {
      --held;
      ++gone;
    }
    out.alive.push_back(held);
    out.done.push_back(gone);
    out.passes.push_back(mine && a.kind != ActionKind::kForward ? 1 : 0);
  }
  return out;
}

namespace {

// The stages of `blocks` (their groups), in the order their blocks come.
std::vector<int64_t> stages_of(const std::vector<BlockCost>& blocks) {
  std::vector<int64_t> stages;
  for (const BlockCost& b : blocks) {
    if (std::find(stages.begin(), stages.end(), b.group) == stages.end()) stages.push_back(b.group);
  }
  return stages;
}

void check_micro_batches(int64_t micro_batches, const char* who) {
  if (micro_batches < 1) {
    throw std::invalid_argument(std::string("prefire::") + who + ": micro_batches must be >= 1, got " +
                                std::to_string(micro_batches));
  }
}

}  // namespace

std::vector<BlockCost> rank_blocks(const std::vector<BlockCost>& blocks, const std::vector<RankAction>& actions,
                                   int64_t micro_batches) {
  check_micro_batches(micro_batches, "rank_blocks");
  std::vector<BlockCost> out = blocks;
  for (const int64_t stage : stages_of(blocks)) {
    const Lifetime life = lifetime(actions, stage);
    const int64_t most = life.alive.empty() ? micro_batches : *std::max_element(life.alive.begin(), life.alive.end());
    for (BlockCost& b : out) {
      if (b.group != stage) continue;
      b.alive = life.alive;
      b.done = life.done;
      b.passes = life.passes;
      b.in_flight = std::max<int64_t>(1, most);
    }
  }
  return out;
}

std::vector<BlockCost> rank_items(const std::vector<BlockCost>& blocks, const std::vector<RankAction>& actions,
                                  int64_t micro_batches) {
  if (actions.empty()) return rank_blocks(blocks, actions, micro_batches);
  check_micro_batches(micro_batches, "rank_items");
  const std::vector<int64_t> stages = stages_of(blocks);
  std::vector<BlockCost> items;
  for (size_t i = 0; i < stages.size(); ++i) {
    for (int64_t m = 0; m < micro_batches; ++m) {
      const Lifetime life = lifetime(actions, stages[i], m);
      for (const BlockCost& b : blocks) {
        if (b.group != stages[i]) continue;
        BlockCost item = b;
        item.in_flight = 1;
        item.group = static_cast<int64_t>(i) * micro_batches + m;
        item.alive = life.alive;
        item.done = life.done;
        item.passes = life.passes;
        items.push_back(std::move(item));
      }
    }
  }
  return items;
}

std::vector<StagePlan> stage_plans(const Plan& plan, const std::vector<BlockCost>& blocks, int64_t micro_batches) {
  check_micro_batches(micro_batches, "stage_plans");
  const size_t n = blocks.size();
  const bool per_block = plan.choices.size() == n;
  if (!per_block && plan.choices.size() != n * static_cast<size_t>(micro_batches)) {
    throw std::invalid_argument("prefire::stage_plans: a plan of " + std::to_string(plan.choices.size()) +
                                " choices for " + std::to_string(n) + " blocks and " + std::to_string(micro_batches) +
                                " micro-batches (one per block, or one per block and micro-batch)");
  }
  std::vector<StagePlan> out;
  size_t at = 0;  // the stage's first item
  for (const int64_t stage : stages_of(blocks)) {
    const auto count = static_cast<size_t>(std::count_if(blocks.begin(), blocks.end(),
                                                         [&](const BlockCost& b) { return b.group == stage; }));
    const size_t span = per_block ? count : count * static_cast<size_t>(micro_batches);
    StagePlan sp;
    sp.stage = stage;
    for (int64_t m = 0; m < micro_batches; ++m) {
      const size_t first = at + (per_block ? 0 : static_cast<size_t>(m) * count);
      sp.choices.emplace_back(plan.choices.begin() + static_cast<std::ptrdiff_t>(first),
                              plan.choices.begin() + static_cast<std::ptrdiff_t>(first + count));
    }
    for (size_t i = at; i < at + span && i < plan.pass_bytes.size(); ++i) {
      sp.pass_bytes = std::max(sp.pass_bytes, plan.pass_bytes[i]);
    }
    out.push_back(std::move(sp));
    at += span;
  }
  return out;
}

int64_t least_session_room(const std::vector<int64_t>& room, const std::vector<SessionAction>& actions,
                           std::vector<int64_t> held, int64_t now, int64_t begin, int64_t end, bool keep_for_w) {
  const auto n = static_cast<int64_t>(actions.size());
  if (room.size() != actions.size() || now < 0 || now > n || begin < 0 || end > n || begin > end) {
    throw std::invalid_argument("prefire::least_session_room: " + std::to_string(room.size()) + " rooms for " +
                                std::to_string(n) + " actions, now=" + std::to_string(now) + ", actions " +
                                std::to_string(begin) + ".." + std::to_string(end));
  }
  for (const SessionAction& a : actions) {
    if (a.key < 0 || a.key >= static_cast<int64_t>(held.size())) {
      throw std::invalid_argument("prefire::least_session_room: action key " + std::to_string(a.key) +
                                  " outside the " + std::to_string(held.size()) + " sessions held");
    }
  }
  auto room_at = [&](int64_t t) {
    return t < n ? room[static_cast<size_t>(t)] : *std::min_element(room.begin(), room.end());
  };
  int64_t total = 0;
  for (int64_t h : held) total += h;
  int64_t least = (n == 0 ? 0 : room_at(now)) - total;
  for (int64_t at = begin; at < end; ++at) {
    const SessionAction& a = actions[static_cast<size_t>(at)];
    int64_t& mine = held[static_cast<size_t>(a.key)];
    const int64_t r = room[static_cast<size_t>(at)];
    switch (a.kind) {
      case ActionKind::kB:
      case ActionKind::kFullBackward: {
        const int64_t add = std::max<int64_t>(0, a.need - mine);
        least = std::min(least, r - total - add);
        if (a.kind == ActionKind::kB && keep_for_w) {  // kept for W: all it held, or what a trimmed session keeps
          const int64_t after = a.kept >= 0 ? std::min(mine + add, a.kept) : mine + add;
          total += after - mine;
          mine = after;
        } else {
          total -= mine;
          mine = 0;
        }
        break;
      }
      case ActionKind::kW: {
        const bool recomputes = keep_for_w ? a.w_recomputes : !a.kept_for_w;
        total -= mine;
        mine = 0;
        if (recomputes) least = std::min(least, r - total - a.need);
        break;
      }
      case ActionKind::kForward:
        least = std::min(least, r - total);
        break;
    }
  }
  return least;
}

KeepForW keep_for_w(const std::vector<int64_t>& room, const std::vector<SessionAction>& actions,
                    std::vector<int64_t> held, int64_t key, int64_t b_at, int64_t need,
                    const std::vector<int64_t>& may_let_go) {
  if (key < 0 || key >= static_cast<int64_t>(held.size())) {
    throw std::invalid_argument("prefire::keep_for_w: key " + std::to_string(key) + " outside the " +
                                std::to_string(held.size()) + " sessions held");
  }
  for (const int64_t other : may_let_go) {
    if (other < 0 || other >= static_cast<int64_t>(held.size()) || other == key) {
      throw std::invalid_argument("prefire::keep_for_w: a session to let go of, " + std::to_string(other) +
                                  ", is not another of the " + std::to_string(held.size()) + " sessions held");
    }
  }
  const auto n = static_cast<int64_t>(actions.size());
  int64_t w_at = -1;
  for (int64_t at = b_at + 1; b_at >= 0 && at < n && w_at < 0; ++at) {
    const SessionAction& a = actions[static_cast<size_t>(at)];
    if (a.kind == ActionKind::kW && a.key == key) w_at = at;
  }
  auto fits = [&] {
    if (w_at < 0) {  // no place in the actions: what is held, and a pass, within the least room
      int64_t total = need;
      for (int64_t h : held) total += h;
      return room.empty() || total <= *std::min_element(room.begin(), room.end());
    }
    return least_session_room(room, actions, held, b_at, b_at + 1, w_at, false) >= 0;
  };
  KeepForW out;
  for (size_t next = 0;; ++next) {
    if (fits()) {
      out.keep = true;
      return out;
    }
    if (next == may_let_go.size()) return {};
    const int64_t other = may_let_go[next];
    held[static_cast<size_t>(other)] = 0;
    out.let_go.push_back(other);
  }
}

}  // namespace prefire
