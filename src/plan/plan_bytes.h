#pragma once

// What a plan holds (Note [What a plan holds] in plan_bytes.cpp): the cost
// side of the planner, which plan_search.cpp chooses with. No torch.

#include <prefire/plan.h>

#include <cstdint>
#include <vector>

namespace prefire::plan_detail {

using Choices = std::vector<Choice>;  // one per block

/// Throws std::invalid_argument on costs the planner cannot count (Note [What a plan holds]).
void check(const std::vector<BlockCost>& blocks, Release release);

/// a + b * c, or std::overflow_error.
int64_t add_product(int64_t a, int64_t b, int64_t c);

bool has_selective(const BlockCost& b);
bool has_offload(const BlockCost& b);
/// The choices a block offers: keep and checkpoint, selective and offload where it has them.
Choices options_of(const BlockCost& b);
/// What a block holds after its forward with choice `c`, and after its micro-batch let go.
int64_t held_bytes(const BlockCost& b, Choice c);
double recompute_seconds(const std::vector<BlockCost>& blocks, const Choices& choices);

/// The moments of a step the blocks have (BlockCost::alive); 0: none.
size_t moments(const std::vector<BlockCost>& blocks);

/// What the plan `choices` holds at most with `ahead` blocks prefired.
int64_t held(const std::vector<BlockCost>& blocks, const Choices& choices, int64_t ahead, Release release);

/// The room a plan that offloads leaves for one copy into the tier in flight
/// beside forward: its largest offloaded block's moved bytes; 0 without
/// offload (Note [Offloaded blocks in a plan], rule 6).
int64_t copy_room(const std::vector<BlockCost>& blocks, const Choices& choices);

/// What each block of the plan `choices`, holding `bytes`, adds to a step
/// within `memory_budget`: choice_seconds(), or where the plan leaves no
/// copy_room(), an offloaded block's copies whole (rule 6).
std::vector<double> block_seconds(const std::vector<BlockCost>& blocks, const Choices& choices, int64_t bytes,
                                  int64_t memory_budget);

/// block_seconds() summed: what the plan adds to a step.
double plan_seconds(const std::vector<BlockCost>& blocks, const Choices& choices, int64_t bytes,
                    int64_t memory_budget);

/// The plan `choices` with everything a runtime reads of it (Plan's fields).
Plan describe(const std::vector<BlockCost>& blocks, const Choices& choices, int64_t memory_budget, int64_t ahead,
              Release release);

}  // namespace prefire::plan_detail
