// least_plan_bytes is the least any plan holds (Note [The least plan]):
// compared, on random small instances in both release modes, with every
// assignment of the four choices (keep, checkpoint, selective, offload)
// counted by describe_plan; a plan fits a budget of it,
// and one byte less raises.

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

// The choices a block offers: keep, checkpoint, and selective and offload where it has them.
std::vector<Choice> options_of(const BlockCost& b) {
  std::vector<Choice> options{Choice::kKeep, Choice::kCheckpoint};
  if (b.selective_bytes >= 0) options.push_back(Choice::kSelective);
  if (b.offload_bytes >= 0) options.push_back(Choice::kOffload);
  return options;
}

// The least describe_plan peak over every choice per block.
int64_t exhaustive_least(const std::vector<BlockCost>& blocks, Release release) {
  int64_t least = std::numeric_limits<int64_t>::max();
  std::vector<size_t> digit(blocks.size(), 0);
  std::vector<Choice> choices(blocks.size(), Choice::kKeep);
  while (true) {
    least = std::min(least, prefire::describe_plan(blocks, choices, 0, 0, release).peak_bytes);
    size_t i = 0;
    for (; i < blocks.size(); ++i) {
      const std::vector<Choice> options = options_of(blocks[i]);
      if (++digit[i] < options.size()) {
        choices[i] = options[digit[i]];
        break;
      }
      digit[i] = 0;
      choices[i] = Choice::kKeep;
    }
    if (i == blocks.size()) return least;
  }
}

// 1-6 blocks; with kAtStepEnd also micro-batches in flight, groups, and moments with passes where they run;
// `selective`: some blocks offer a selective checkpoint and some offloading.
std::vector<BlockCost> random_blocks(std::mt19937_64& rng, Release release, bool selective) {
  std::uniform_int_distribution<int> count(1, 6), small(0, 3), coin(0, 1);
  std::uniform_int_distribution<int64_t> bytes(1, 1 << 20);
  std::uniform_real_distribution<double> share(0.02, 1.2), ms(0.1, 10.0);
  std::vector<BlockCost> blocks(static_cast<size_t>(count(rng)));
  const bool timed = release == Release::kAtStepEnd && coin(rng);
  const size_t moments = 6;
  for (auto& b : blocks) {
    b.saved_bytes = bytes(rng);
    b.input_bytes = static_cast<int64_t>(static_cast<double>(b.saved_bytes) * share(rng));
    b.recompute_seconds = ms(rng) * 1e-3;
    if (selective && coin(rng)) {
      const auto selective = static_cast<int64_t>(static_cast<double>(b.saved_bytes) * share(rng));
      b.selective_bytes = std::max(b.input_bytes, selective);
      b.selective_seconds = b.recompute_seconds * share(rng) / 1.2;
    }
    if (selective && coin(rng)) {  // offloaded: holds little or nothing, its copies partly hidden
      b.offload_bytes = coin(rng) ? 0 : static_cast<int64_t>(static_cast<double>(b.input_bytes) * share(rng) / 1.2);
      b.offload_moved_bytes = b.saved_bytes + b.input_bytes;
      b.offload_seconds = ms(rng) * 1e-3;
      b.offload_hidden = share(rng) / 1.2;
    }
    if (release == Release::kInBackward) continue;
    b.in_flight = 1 + small(rng);
    b.group = small(rng) - 1;
    if (timed) {
      std::uniform_int_distribution<int64_t> alive(0, b.in_flight);
      for (size_t t = 0; t < moments; ++t) {
        b.alive.push_back(alive(rng));
        b.passes.push_back(coin(rng));
      }
    }
  }
  return blocks;
}

void expect_least_is_the_least(Release release, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 1000; ++trial) {
    const std::vector<BlockCost> blocks = random_blocks(rng, release, trial % 2 == 1);
    const int64_t least = prefire::least_plan_bytes(blocks, release);
    ASSERT_EQ(least, exhaustive_least(blocks, release)) << "trial " << trial;
    const prefire::Plan plan = prefire::plan_for_budget(blocks, least, release);
    ASSERT_LE(plan.peak_bytes, least) << "trial " << trial;
    ASSERT_EQ(plan.peak_bytes, prefire::describe_plan(blocks, plan.choices, least, plan.prefire_ahead, release)
                                   .peak_bytes);
    if (least > 0) {
      ASSERT_THROW(prefire::plan_for_budget(blocks, least - 1, release), std::invalid_argument) << "trial " << trial;
    }
  }
}

TEST(PlanLeast, InOneBackwardPassTheLeastIsTheLeastOfEveryPlan) {
  expect_least_is_the_least(Release::kInBackward, 38);
}

TEST(PlanLeast, AtTheStepEndTheLeastIsTheLeastOfEveryPlan) { expect_least_is_the_least(Release::kAtStepEnd, 39); }

TEST(PlanLeast, EqualBlocksInOneBackwardPassFitWhereTheyDidNotBefore) {
  // four equal blocks: checkpointing the first two and keeping none holds 384341, not the 421205 of
  // every block checkpointed
  const std::vector<BlockCost> blocks(
      4, BlockCost{.saved_bytes = 273749, .input_bytes = 36864, .recompute_seconds = 1e-3});
  EXPECT_EQ(prefire::least_plan_bytes(blocks, Release::kInBackward), exhaustive_least(blocks, Release::kInBackward));
  EXPECT_LT(prefire::least_plan_bytes(blocks, Release::kInBackward), 421205);
  EXPECT_NO_THROW(prefire::plan_for_budget(blocks, 384341, Release::kInBackward));
}

}  // namespace
