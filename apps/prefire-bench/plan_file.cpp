#include "plan_file.h"

#include <prefire/pipeline_plan.h>
#include <prefire/plan.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <set>
#include <stdexcept>

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

prefire::BlockCost block_cost(const json& j) {
  expect_fields(j,
                {"saved_bytes", "input_bytes", "recompute_seconds", "in_flight", "group", "alive", "done",
                 "saved_after_bytes", "input_after_bytes", "selective_bytes", "selective_seconds",
                 "selective_after_bytes", "offload_bytes", "offload_moved_bytes", "offload_seconds", "offload_hidden",
                 "offload_after_bytes", "passes"},
                "BlockCost");
  return prefire::BlockCost{.saved_bytes = j["saved_bytes"],
                            .input_bytes = j["input_bytes"],
                            .recompute_seconds = j["recompute_seconds"],
                            .in_flight = j["in_flight"],
                            .group = j["group"],
                            .alive = j["alive"],
                            .done = j["done"],
                            .saved_after_bytes = j["saved_after_bytes"],
                            .input_after_bytes = j["input_after_bytes"],
                            .selective_bytes = j["selective_bytes"],
                            .selective_seconds = j["selective_seconds"],
                            .selective_after_bytes = j["selective_after_bytes"],
                            .offload_bytes = j["offload_bytes"],
                            .offload_moved_bytes = j["offload_moved_bytes"],
                            .offload_seconds = j["offload_seconds"],
                            .offload_hidden = j["offload_hidden"],
                            .offload_after_bytes = j["offload_after_bytes"],
                            .passes = j["passes"]};
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

json plan_json(const prefire::Plan& p) {
  json choices = json::array();
  for (prefire::Choice c : p.choices) {
    choices.push_back(c == prefire::Choice::kKeep         ? "KEEP"
                      : c == prefire::Choice::kCheckpoint ? "CHECKPOINT"
                      : c == prefire::Choice::kSelective  ? "SELECTIVE"
                                                          : "OFFLOAD");
  }
  return {{"choices", choices},
          {"checkpointed", p.checkpointed},
          {"selective", p.selective},
          {"offloaded", p.offloaded},
          {"prefire_ahead", p.prefire_ahead},
          {"peak_bytes", p.peak_bytes},
          {"recompute_seconds", p.recompute_seconds},
          {"memory_budget", p.memory_budget},
          {"blocks_bytes", p.blocks_bytes},
          {"pass_bytes", p.pass_bytes},
          {"moment_bytes", p.moment_bytes},
          {"room_bytes", p.room_bytes}};
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
    blocks = prefire::per_micro_batch(blocks, actions, j["micro_batches"]);
  }
  const prefire::Plan plan = prefire::plan_for_budget(blocks, j["memory_budget"]);
  std::fprintf(out, "%s\n", plan_json(plan).dump().c_str());
}

}  // namespace prefire_bench
