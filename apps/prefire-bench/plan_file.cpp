#include "plan_file.h"

#include <prefire/pipeline_plan.h>
#include <prefire/plan.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <set>
#include <stdexcept>

// Costs and plans as JSON, by field name (Note [Costs and plans by name] in
// python/src/plan_bindings.cpp): each field named once, here.
namespace prefire {
NLOHMANN_JSON_SERIALIZE_ENUM(Choice, {{Choice::kKeep, "KEEP"},
                                      {Choice::kCheckpoint, "CHECKPOINT"},
                                      {Choice::kSelective, "SELECTIVE"},
                                      {Choice::kOffload, "OFFLOAD"}})
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(BlockCost, saved_bytes, input_bytes, recompute_seconds, in_flight, group, alive,
                                   done, saved_after_bytes, input_after_bytes, selective_bytes, selective_seconds,
                                   selective_after_bytes, offload_bytes, offload_moved_bytes, offload_seconds,
                                   offload_hidden, offload_after_bytes, passes)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(Plan, choices, checkpointed, selective, offloaded, prefire_ahead, peak_bytes,
                                   recompute_seconds, block_seconds, memory_budget, blocks_bytes, pass_bytes,
                                   moment_bytes, room_bytes)
}  // namespace prefire

namespace prefire_bench {
namespace {

using nlohmann::json;

// The object's fields are exactly `names`, or an error naming the difference.
void expect_fields(const json& j, const std::set<std::string>& names, const char* what) {
  if (!j.is_object()) throw std::invalid_argument(std::string(what) + ": expected an object");
  for (const auto& name : names) {
    if (!j.contains(name)) throw std::invalid_argument(std::string(what) + ": missing field " + name);
  }
  for (const auto& [key, value] : j.items()) {
    if (names.count(key) == 0) throw std::invalid_argument(std::string(what) + ": unknown field " + key);
  }
}

// The fields T is written with.
template <typename T>
std::set<std::string> fields_of() {
  const json written = T{};
  std::set<std::string> names;
  for (const auto& [key, value] : written.items()) names.insert(key);
  return names;
}

prefire::BlockCost block_cost(const json& j) {
  expect_fields(j, fields_of<prefire::BlockCost>(), "BlockCost");
  return j.get<prefire::BlockCost>();
}

prefire::RankAction action(const json& j) {
  const std::string kind = j.at(0);
  const prefire::ActionKind k = kind == "F"   ? prefire::ActionKind::kForward
                                : kind == "B" ? prefire::ActionKind::kB
                                : kind == "W" ? prefire::ActionKind::kW
                                : kind == "BW"
                                    ? prefire::ActionKind::kFullBackward
                                    : throw std::invalid_argument("actions: kind " + kind + " is not F, B, W or BW");
  return {.kind = k, .stage = j.at(1), .micro_batch = j.at(2)};
}

}  // namespace

void plan_from_file(const std::string& path, std::FILE* out) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument("--plan: cannot read " + path);
  const json j = json::parse(in);
  const bool with_actions = j.contains("actions");
  expect_fields(j,
                with_actions ? std::set<std::string>{"memory_budget", "blocks", "actions", "micro_batches"}
                             : std::set<std::string>{"memory_budget", "blocks"},
                "--plan file");
  std::vector<prefire::BlockCost> blocks;
  for (const json& b : j["blocks"]) blocks.push_back(block_cost(b));
  if (with_actions) {
    std::vector<prefire::RankAction> actions;
    for (const json& a : j["actions"]) actions.push_back(action(a));
    blocks = prefire::rank_items(blocks, actions, j["micro_batches"]);
  }
  const prefire::Plan plan = prefire::plan_for_budget(blocks, j["memory_budget"]);
  std::fprintf(out, "%s\n", json(plan).dump().c_str());
}

}  // namespace prefire_bench
