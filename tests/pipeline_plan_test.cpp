// A pipeline rank's plan from its actions: its blocks' lifetimes, the
// planner's items, the plan per stage (Note [A pipeline rank's memory plan]),
// and Note [A rank's byte budget]'s count of what its sessions hold action by
// action beside a plan's room: least_session_room, keep_for_w. Not here: what
// a plan holds (plan_test.cpp) and the least plan (plan_least_test.cpp).

#include <prefire/pipeline_plan.h>

#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

namespace {

using prefire::ActionKind;
using prefire::BlockCost;
using prefire::Choice;
using prefire::RankAction;
using prefire::SessionAction;

SessionAction act(ActionKind kind, int64_t key, int64_t need) { return {.kind = kind, .key = key, .need = need}; }

// F0 F1 B0 B1 W0 W1 of one stage: micro-batch 0 is key 0, 1 is key 1; a pass holds 10
const std::vector<SessionAction> kActions = {act(ActionKind::kForward, 0, 10), act(ActionKind::kForward, 1, 10),
                                             act(ActionKind::kB, 0, 10),       act(ActionKind::kB, 1, 10),
                                             act(ActionKind::kW, 0, 10),       act(ActionKind::kW, 1, 10)};

TEST(PipelinePlan, ABKeptForItsWMustFitBesideTheLaterPassesAtTheirFloor) {
  // B0 ran and holds 10 for W0; B1 then recomputes its 10 beside it and lets go (others at their floor)
  const std::vector<int64_t> room(6, 20);
  EXPECT_EQ(prefire::least_session_room(room, kActions, {10, 0}, 2, 3, 4, false), 0);
  const std::vector<int64_t> tight = {20, 20, 20, 19, 20, 20};  // less room where B1 runs
  EXPECT_EQ(prefire::least_session_room(tight, kActions, {10, 0}, 2, 3, 4, false), -1);
}

TEST(PipelinePlan, WhenLaterBsKeepTheirsTheyAddUpUntilTheirW) {
  const std::vector<int64_t> room(6, 25);
  // before B0: B0 and B1 each keep 10 until their W, so 20 is held after B1
  EXPECT_EQ(prefire::least_session_room(room, kActions, {0, 0}, 2, 2, 6, true), 5);
  // a trimmed session keeps 4 of its 10: 14 after B1
  std::vector<SessionAction> trimmed = kActions;
  for (auto& a : trimmed) a.kept = 4;
  EXPECT_EQ(prefire::least_session_room(room, trimmed, {0, 0}, 2, 2, 6, true), 25 - 14);
  // a W whose B let go recomputes its need there
  std::vector<SessionAction> w_recomputes = kActions;
  w_recomputes[5].w_recomputes = true;
  EXPECT_EQ(prefire::least_session_room(room, w_recomputes, {0, 0}, 2, 2, 6, true), 5);
}

TEST(PipelinePlan, BadIndicesAreRefused) {
  EXPECT_THROW(prefire::least_session_room(std::vector<int64_t>(5, 0), kActions, {0, 0}, 0, 0, 6, true),
               std::invalid_argument);
  EXPECT_THROW(prefire::least_session_room(std::vector<int64_t>(6, 0), kActions, {0}, 0, 0, 6, true),
               std::invalid_argument);
  EXPECT_THROW(prefire::least_session_room(std::vector<int64_t>(6, 0), kActions, {0, 0}, 0, 4, 3, true),
               std::invalid_argument);
}

TEST(PipelinePlan, AKeptBLetsGoOfBubblePrefiresInOrderUntilItsSessionFitsUntilItsW) {
  const std::vector<int64_t> room(6, 20);
  // right after B0 (action 2), with 10 held for W0: B1 recomputes its 10 beside it, within 20
  const auto fits = prefire::keep_for_w(room, kActions, {10, 0}, 0, 2, 10, {});
  EXPECT_TRUE(fits.keep);
  EXPECT_TRUE(fits.let_go.empty());
  // B then W of each micro-batch in turn, and a bubble prefire of micro-batch 1 holding 10 when B0 ends: with 15
  // room there, B0's 10 fits only once that prefire is let go of (B1 recomputes it later)
  const std::vector<SessionAction> in_turn = {act(ActionKind::kForward, 0, 10), act(ActionKind::kForward, 1, 10),
                                              act(ActionKind::kB, 0, 10),       act(ActionKind::kW, 0, 10),
                                              act(ActionKind::kB, 1, 10),       act(ActionKind::kW, 1, 10)};
  const auto let_go = prefire::keep_for_w({20, 20, 15, 20, 20, 20}, in_turn, {10, 10}, 0, 2, 10, {1});
  EXPECT_TRUE(let_go.keep);
  EXPECT_EQ(let_go.let_go, std::vector<int64_t>{1});
  const auto no = prefire::keep_for_w({20, 20, 9, 20, 20, 20}, in_turn, {10, 10}, 0, 2, 10, {1});
  EXPECT_FALSE(no.keep);
  EXPECT_TRUE(no.let_go.empty());  // nothing is let go of for a keep that does not happen
  // no place in the actions: what is held and one pass within the least room
  EXPECT_TRUE(prefire::keep_for_w({30}, {}, {10, 10}, 0, -1, 10, {}).keep);
  EXPECT_FALSE(prefire::keep_for_w({29}, {}, {10, 10}, 0, -1, 10, {}).keep);
  EXPECT_THROW(prefire::keep_for_w(room, kActions, {10, 0}, 2, 2, 10, {}), std::invalid_argument);
  EXPECT_THROW(prefire::keep_for_w(room, kActions, {10, 0}, 0, 2, 10, {0}), std::invalid_argument);
}

// Stage 0's micro-batches 0 and 1 (F0 F1 B0 B1 W0 W1), two blocks each; stage 1's one block runs no action
std::vector<RankAction> rank_actions() {
  std::vector<RankAction> out;
  for (const SessionAction& a : kActions) out.push_back({.kind = a.kind, .stage = 0, .micro_batch = a.key});
  return out;
}

std::vector<BlockCost> two_stages() {
  return {{.saved_bytes = 100, .input_bytes = 10, .recompute_seconds = 1.0, .group = 0},
          {.saved_bytes = 200, .input_bytes = 20, .recompute_seconds = 2.0, .group = 0},
          {.saved_bytes = 300, .input_bytes = 30, .recompute_seconds = 3.0, .group = 1}};
}

TEST(PipelinePlan, RankBlocksCarryTheirStagesLifetimeAndItemsOneMicroBatchEach) {
  const auto blocks = prefire::rank_blocks(two_stages(), rank_actions(), 2);
  EXPECT_EQ(blocks[0].alive, (std::vector<int64_t>{1, 2, 2, 2, 1, 0}));
  EXPECT_EQ(blocks[0].done, (std::vector<int64_t>{0, 0, 0, 0, 1, 2}));
  EXPECT_EQ(blocks[0].passes, (std::vector<int64_t>{0, 0, 1, 1, 1, 1}));
  EXPECT_EQ(blocks[0].in_flight, 2);
  EXPECT_EQ(blocks[2].alive, std::vector<int64_t>(6, 0));  // a stage without actions here: never alive
  EXPECT_EQ(blocks[2].in_flight, 1);
  const auto unordered = prefire::rank_blocks(two_stages(), {}, 3);  // no order: every micro-batch at every moment
  EXPECT_TRUE(unordered[0].alive.empty());
  EXPECT_EQ(unordered[0].in_flight, 3);
  const auto items = prefire::rank_items(two_stages(), rank_actions(), 2);
  ASSERT_EQ(items.size(), 6u);  // (stage 0: mb 0 block 0, 1; mb 1 block 0, 1), (stage 1: mb 0, mb 1)
  EXPECT_EQ(items[2].saved_bytes, 100);
  EXPECT_EQ(items[2].alive, (std::vector<int64_t>{0, 1, 1, 1, 1, 0}));
  EXPECT_EQ(items[2].group, 1);  // a group per (stage, micro-batch)
  EXPECT_EQ(items[4].saved_bytes, 300);
  EXPECT_EQ(prefire::rank_items(two_stages(), {}, 3).size(), 3u);  // no order: rank_blocks
  EXPECT_THROW(prefire::rank_blocks(two_stages(), {}, 0), std::invalid_argument);
}

TEST(PipelinePlan, APlanPerStageSaysEachMicroBatchsChoicesAndItsLargestPass) {
  const auto blocks = prefire::rank_blocks(two_stages(), rank_actions(), 2);
  const auto items = prefire::rank_items(blocks, rank_actions(), 2);
  std::vector<Choice> choices = {Choice::kCheckpoint, Choice::kKeep, Choice::kCheckpoint, Choice::kCheckpoint,
                                 Choice::kKeep,       Choice::kKeep};
  const prefire::Plan plan = prefire::describe_plan(items, choices, 1 << 20);
  const auto stages = prefire::stage_plans(plan, blocks, 2);
  ASSERT_EQ(stages.size(), 2u);
  EXPECT_EQ(stages[0].stage, 0);
  EXPECT_EQ(stages[0].choices, (std::vector<std::vector<Choice>>{{Choice::kCheckpoint, Choice::kKeep},
                                                                  {Choice::kCheckpoint, Choice::kCheckpoint}}));
  EXPECT_EQ(stages[0].pass_bytes, 300);  // micro-batch 1 recomputes both blocks in one pass
  EXPECT_EQ(stages[1].choices, (std::vector<std::vector<Choice>>{{Choice::kKeep}, {Choice::kKeep}}));
  EXPECT_EQ(stages[1].pass_bytes, 0);
  // a plan of one choice per block says the same for every micro-batch
  const prefire::Plan per_block = prefire::describe_plan(blocks, {Choice::kKeep, Choice::kCheckpoint, Choice::kKeep},
                                                         1 << 20);
  const auto same = prefire::stage_plans(per_block, blocks, 2);
  EXPECT_EQ(same[0].choices, (std::vector<std::vector<Choice>>{{Choice::kKeep, Choice::kCheckpoint},
                                                                {Choice::kKeep, Choice::kCheckpoint}}));
  EXPECT_THROW(prefire::stage_plans(plan, blocks, 3), std::invalid_argument);
}

}  // namespace
