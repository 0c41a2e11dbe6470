// reload_schedule (Note [A reload schedule for a plain backward]): on random
// plans of one backward pass, what the schedule holds at every block's
// backward (the plan's own count plus the fetches it started) stays within the
// budget, each offloaded block but the top one starts at most once and only
// from a block above it, a budget with no headroom starts nothing, and an
// unbounded one starts every offloaded block below the top block at its
// backward, nearest first. tier_bytes: what a plan keeps in the tier at once.

#include <prefire/plan.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

namespace {

using prefire::BlockCost;
using prefire::Choice;
using prefire::Release;

struct Instance {
  std::vector<BlockCost> blocks;
  std::vector<Choice> choices;
};

Instance random_instance(std::mt19937_64& rng) {
  std::uniform_int_distribution<int> count(1, 8), choice(0, 2);
  std::uniform_int_distribution<int64_t> bytes(1, 1 << 20);
  Instance in;
  in.blocks.resize(static_cast<size_t>(count(rng)));
  for (BlockCost& b : in.blocks) {
    b.saved_bytes = bytes(rng);
    b.input_bytes = std::min(b.saved_bytes, bytes(rng));
    b.recompute_seconds = 1e-3;
    b = prefire::with_offload(b, b.saved_bytes, 1e-3);
    in.choices.push_back(std::vector<Choice>{Choice::kKeep, Choice::kCheckpoint, Choice::kOffload}[choice(rng)]);
  }
  return in;
}

// What the plan holds while block m's backward runs, with the started fetches (the Note's rules 1 and 2).
std::vector<int64_t> held_with(const Instance& in, const std::vector<std::vector<int64_t>>& schedule) {
  const size_t n = in.blocks.size();
  std::vector<int64_t> held(n);
  int64_t prefix = 0;
  for (size_t m = 0; m < n; ++m) {
    const BlockCost& b = in.blocks[m];
    prefix += in.choices[m] == Choice::kKeep ? b.saved_bytes
              : in.choices[m] == Choice::kCheckpoint ? b.input_bytes
                                                     : b.offload_bytes;
    held[m] = prefix + (in.choices[m] == Choice::kKeep ? 0 : b.saved_bytes);
  }
  for (size_t j = 0; j < n; ++j) {
    for (int64_t i : schedule[j]) {
      for (size_t m = static_cast<size_t>(i) + 1; m <= j; ++m) held[m] += in.blocks[static_cast<size_t>(i)].saved_bytes;
    }
  }
  return held;
}

TEST(ReloadSchedule, HoldsTheBudgetStartsEachOffloadedBlockOnceFromAboveAndSpendsAnUnboundedOne) {
  std::mt19937_64 rng(17);
  for (int round = 0; round < 2000; ++round) {
    const Instance in = random_instance(rng);
    const int64_t plan = prefire::describe_plan(in.blocks, in.choices, 0, 0, Release::kInBackward).peak_bytes;
    const std::vector<int64_t> without = held_with(in, std::vector<std::vector<int64_t>>(in.blocks.size()));
    ASSERT_EQ(plan, std::max(*std::max_element(without.begin(), without.end()),
                             plan))  // the plan's count is at least what the Note's rule 1 says
        << "round " << round;
    const int64_t headroom = std::uniform_int_distribution<int64_t>(0, 3 << 20)(rng);
    const auto schedule = prefire::reload_schedule(in.blocks, in.choices, plan + headroom);
    const std::vector<int64_t> held = held_with(in, schedule);
    EXPECT_LE(*std::max_element(held.begin(), held.end()), plan + headroom) << "round " << round;
    std::vector<int> started(in.blocks.size(), 0);
    for (size_t j = 0; j < schedule.size(); ++j) {
      for (size_t k = 0; k < schedule[j].size(); ++k) {
        const int64_t i = schedule[j][k];
        ASSERT_LT(i, static_cast<int64_t>(j));
        EXPECT_EQ(in.choices[static_cast<size_t>(i)], Choice::kOffload);
        if (k > 0) EXPECT_LT(i, schedule[j][k - 1]) << "nearest first";
        ++started[static_cast<size_t>(i)];
      }
    }
    EXPECT_TRUE(std::all_of(started.begin(), started.end(), [](int s) { return s <= 1; }));

    const auto unbounded = prefire::reload_schedule(in.blocks, in.choices, std::numeric_limits<int64_t>::max() / 4);
    std::vector<int64_t> below_top;
    for (int64_t i = static_cast<int64_t>(in.blocks.size()) - 2; i >= 0; --i) {
      if (in.choices[static_cast<size_t>(i)] == Choice::kOffload) below_top.push_back(i);
    }
    EXPECT_EQ(unbounded.back(), below_top) << "round " << round;
  }
}

TEST(ReloadSchedule, ABudgetTheBackwardFillsStartsNothing) {
  std::vector<BlockCost> blocks(3);
  for (BlockCost& b : blocks) {
    b.saved_bytes = 100;
    b.input_bytes = 10;
    b = prefire::with_offload(b, 100, 1e-3);
  }
  const std::vector<Choice> offloaded(3, Choice::kOffload);
  const int64_t plan = prefire::describe_plan(blocks, offloaded, 0, 0, Release::kInBackward).peak_bytes;
  EXPECT_EQ(plan, 100);
  for (const auto& starts : prefire::reload_schedule(blocks, offloaded, plan)) EXPECT_TRUE(starts.empty());
  const auto one_ahead = prefire::reload_schedule(blocks, offloaded, 2 * plan);
  EXPECT_EQ(one_ahead, (std::vector<std::vector<int64_t>>{{}, {0}, {1}})) << "one block ahead at a time";
  EXPECT_THROW(prefire::reload_schedule(blocks, {Choice::kKeep}, plan), std::invalid_argument);
}

}  // namespace

namespace {

TEST(TierBytes, OneBackwardPassHoldsEveryOffloadedBlockAndAPipelineTheMostAtAMoment) {
  std::vector<BlockCost> blocks(3);
  for (size_t i = 0; i < blocks.size(); ++i) {
    blocks[i].saved_bytes = 100 * static_cast<int64_t>(i + 1);
    blocks[i].input_bytes = 10;
    blocks[i] = prefire::with_offload(blocks[i], blocks[i].saved_bytes, 1e-3);
  }
  const std::vector<Choice> choices{Choice::kOffload, Choice::kKeep, Choice::kOffload};
  EXPECT_EQ(prefire::tier_bytes(blocks, choices, Release::kInBackward), 100 + 300);
  // a pipeline: micro-batches held at each of three moments
  for (BlockCost& b : blocks) b.in_flight = 2;
  blocks[0].alive = {1, 2, 0};
  blocks[1].alive = {1, 1, 1};
  blocks[2].alive = {0, 1, 2};
  EXPECT_EQ(prefire::tier_bytes(blocks, choices, Release::kAtStepEnd), std::max({100 * 1, 100 * 2 + 300, 300 * 2}));
  EXPECT_EQ(prefire::tier_bytes(blocks, std::vector<Choice>(3, Choice::kKeep), Release::kAtStepEnd), 0);
}

}  // namespace
