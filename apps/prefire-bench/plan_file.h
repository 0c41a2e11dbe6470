#pragma once

// prefire-bench --plan FILE: plans the costs a JSON file names, as the plan
// mode does, and prints the plan as JSON: the C++ side of the test that the
// C++ API, the Python API and prefire-bench give one plan for one set of
// costs (tests/python/test_plan.py). Costs and plans go by field name, as
// the Python package writes them (Note [Costs and plans by name]).

#include <cstdio>
#include <string>

namespace prefire_bench {

/// Reads `path`: {"memory_budget": bytes, "blocks": [BlockCost by field name],
/// "actions": [[kind, stage, micro-batch], ...] (optional; kind F, B, W or
/// BW), "micro_batches": n (with actions)}; writes the plan to `out`. With
/// actions the blocks are planned per micro-batch (prefire::rank_items),
/// as the plan mode and the Python pipeline plan them. Throws
/// std::invalid_argument naming a missing or unknown field.
void plan_from_file(const std::string& path, std::FILE* out);

}  // namespace prefire_bench
