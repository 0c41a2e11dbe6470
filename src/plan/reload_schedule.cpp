// Note [A reload schedule for a plain backward]
// A plain model's backward (one pass, last block first: Release::kInBackward)
// reaches an offloaded block and waits for its fetch, on the critical path,
// unless the fetch began earlier. The schedule says, per block j, which
// offloaded blocks below j begin their fetch when j's backward begins (a hook
// on j's output gradient calls fetch_ahead), so that block i's reads run on
// the tier's worker (the prefire stream) while the blocks above i run their
// backward, as TransformerEngine's reload schedule overlaps layer k's reload
// with the backward of the layers above. The rules:
//  1. While block m's backward runs the plan holds base[m]: what blocks 0..m
//     hold after forward and, unless m is kept, m's recomputation or fetch
//     (its saved bytes): held_in_backward's count with no prefire ahead.
//  2. A block i fetched when j's backward begins (i < j) holds its saved bytes
//     beside base[m] for every m in i+1..j (at i they are i's own pass).
//  3. Going down from the top block, each block j starts the nearest offloaded
//     blocks below it not started yet, nearest first, while every moment they
//     span stays within the budget; the first that does not fit waits for a
//     later j (nearer to it, where less is held above). The top offloaded
//     block has nothing above it to hide its fetch and fetches lazily.
//  4. A block that is not offloaded has nothing to fetch: it starts nothing
//     of its own, but the offloaded blocks below it may start at its backward.
// So a budget the plan fills to the byte fetches lazily, and every byte of
// headroom is spent on fetching earlier, never on exceeding the budget.

#include <prefire/plan.h>

#include "plan/plan_bytes.h"

#include <stdexcept>
#include <string>

namespace prefire {

std::vector<std::vector<int64_t>> reload_schedule(const std::vector<BlockCost>& blocks,
                                                  const std::vector<Choice>& choices, int64_t memory_budget) {
  if (choices.size() != blocks.size()) {
    throw std::invalid_argument("prefire::reload_schedule: " + std::to_string(choices.size()) + " choices for " +
                                std::to_string(blocks.size()) + " blocks");
  }
  plan_detail::check(blocks, Release::kInBackward);
  const size_t n = blocks.size();
  std::vector<int64_t> base(n);  // rule 1
  int64_t prefix = 0;
  for (size_t m = 0; m < n; ++m) {
    prefix = plan_detail::add_product(prefix, 1, plan_detail::held_bytes(blocks[m], choices[m]));
    base[m] = choices[m] == Choice::kKeep ? prefix : plan_detail::add_product(prefix, 1, blocks[m].saved_bytes);
  }
  std::vector<std::vector<int64_t>> schedule(n);
  std::vector<int64_t> extra(n, 0);  // rule 2: what started fetches hold beside base
  int64_t next = static_cast<int64_t>(n) - 1;  // the nearest offloaded block not started yet
  auto offloaded_below = [&](int64_t from) {
    while (from >= 0 && choices[static_cast<size_t>(from)] != Choice::kOffload) --from;
    return from;
  };
  for (int64_t j = static_cast<int64_t>(n) - 1; j > 0; --j) {
    next = offloaded_below(std::min(next, j - 1));
    while (next >= 0) {  // rule 3
      const int64_t bytes = blocks[static_cast<size_t>(next)].saved_bytes;
      bool fits = true;
      for (int64_t m = next + 1; m <= j && fits; ++m) {
        fits = plan_detail::add_product(base[static_cast<size_t>(m)], 1, extra[static_cast<size_t>(m)] + bytes) <=
               memory_budget;
      }
      if (!fits) break;
      for (int64_t m = next + 1; m <= j; ++m) extra[static_cast<size_t>(m)] += bytes;
      schedule[static_cast<size_t>(j)].push_back(next);
      next = offloaded_below(next - 1);
    }
  }
  return schedule;
}

}  // namespace prefire
