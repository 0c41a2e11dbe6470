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

std::vector<BlockCost> per_micro_batch(const std::vector<BlockCost>& blocks, const std::vector<RankAction>& actions,
                                       int64_t micro_batches) {
  std::vector<int64_t> stages;  // in the order their blocks come
  for (const BlockCost& b : blocks) {
    if (std::find(stages.begin(), stages.end(), b.group) == stages.end()) stages.push_back(b.group);
  }
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

}  // namespace prefire
