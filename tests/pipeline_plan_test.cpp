// least_session_room: Note [A rank's byte budget]'s count of what a rank's
// sessions hold action by action, beside a plan's room.

#include <prefire/pipeline_plan.h>

#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

namespace {

using prefire::ActionKind;
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

}  // namespace
