// plan_for_budget: within the budget always, never worse than the plans a
// user writes by hand, within a hair of the best plan an exhaustive search
// finds, and a clear error below the least any plan holds; for a pipeline
// (Release::kAtStepEnd) and for a plain model's one backward pass
// (Release::kInBackward).

#include <prefire/plan.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using prefire::BlockCost;

double seconds_of(const std::vector<BlockCost>& blocks, const std::vector<bool>& checkpointed) {
  double total = 0;
  for (size_t i = 0; i < blocks.size(); ++i) total += checkpointed[i] ? blocks[i].recompute_seconds : 0;
  return total;
}

// The least recomputation of any keep/checkpoint choice within the budget.
double exhaustive_best(const std::vector<BlockCost>& blocks, int64_t budget,
                       prefire::Release release = prefire::Release::kAtStepEnd) {
  double best = -1;
  for (uint32_t mask = 0; mask < (1u << blocks.size()); ++mask) {
    std::vector<bool> checkpointed(blocks.size());
    for (size_t i = 0; i < blocks.size(); ++i) checkpointed[i] = (mask >> i) & 1u;
    if (prefire::plan_bytes(blocks, checkpointed, 0, release) > budget) continue;
    const double seconds = seconds_of(blocks, checkpointed);
    if (best < 0 || seconds < best) best = seconds;
  }
  return best;
}

std::vector<BlockCost> transformer(int n, int64_t in_flight = 1) {
  // a block saves 12x its input (attention and MLP activations) and takes 1 ms
  return std::vector<BlockCost>(static_cast<size_t>(n), BlockCost{.saved_bytes = 12 << 20, .input_bytes = 1 << 20,
                                                                  .recompute_seconds = 1e-3, .in_flight = in_flight});
}

TEST(Plan, BytesFollowTheNote) {
  const std::vector<BlockCost> blocks{{.saved_bytes = 100, .input_bytes = 10, .recompute_seconds = 1.0, .in_flight = 1},
                                      {.saved_bytes = 200, .input_bytes = 20, .recompute_seconds = 2.0, .in_flight = 3},
                                      {.saved_bytes = 50, .input_bytes = 5, .recompute_seconds = 0.5, .in_flight = 1}};
  EXPECT_EQ(prefire::plan_bytes(blocks, {false, false, false}), 100 + 3 * 200 + 50);
  // checkpointed: inputs, plus one recomputation of the largest checkpointed (200), plus one more prefired
  EXPECT_EQ(prefire::plan_bytes(blocks, {false, true, true}), 100 + 3 * 20 + 5 + 200);
  EXPECT_EQ(prefire::plan_bytes(blocks, {false, true, true}, 1), 100 + 3 * 20 + 5 + 2 * 200);
  EXPECT_THROW(prefire::plan_bytes(blocks, {true}), std::invalid_argument);
  EXPECT_THROW(prefire::plan_bytes({{.saved_bytes = -1, .input_bytes = 0, .recompute_seconds = 0.0}}, {true}),
               std::invalid_argument);
  EXPECT_THROW(prefire::plan_bytes({{.saved_bytes = 1, .input_bytes = 0, .recompute_seconds = 0.0,
                                    .in_flight = 0}}, {true}), std::invalid_argument);
  EXPECT_THROW(prefire::plan_bytes({{.saved_bytes = INT64_MAX / 2, .input_bytes = 0, .recompute_seconds = 0.0,
                                     .in_flight = 3}},
                                   {false}),
               std::overflow_error);
}

TEST(Plan, AGroupIsRecomputedTogether) {
  // a pipeline stage's blocks (group 0: two blocks, group 1: one): its B holds their recomputation together
  const std::vector<BlockCost> blocks{{.saved_bytes = 100, .input_bytes = 10, .recompute_seconds = 2.0, .group = 0},
                                      {.saved_bytes = 100, .input_bytes = 10, .recompute_seconds = 1.0, .group = 0},
                                      {.saved_bytes = 50, .input_bytes = 5, .recompute_seconds = 0.5, .group = 1}};
  EXPECT_EQ(prefire::plan_bytes(blocks, {true, true, true}), 10 + 10 + 5 + (100 + 100));
  EXPECT_EQ(prefire::plan_bytes(blocks, {true, true, true}, 1), 10 + 10 + 5 + 2 * (100 + 100));
  EXPECT_EQ(prefire::plan_bytes(blocks, {false, true, true}), 100 + 10 + 5 + 100);
  // the least plan keeps one of group 0's blocks: 90 bytes more held, 100 less in its pass; the plan
  // keeps the one whose recomputation takes longer
  EXPECT_EQ(prefire::least_plan_bytes(blocks), 215);
  EXPECT_EQ(prefire::plan_for_budget(blocks, 215).checkpointed, (std::vector<bool>{false, true, true}));
  // one backward pass recomputes one block at a time: groups are a pipeline's
  EXPECT_THROW(prefire::plan_bytes(blocks, {true, true, true}, 0, prefire::Release::kInBackward),
               std::invalid_argument);
  EXPECT_THROW(prefire::plan_bytes({{.saved_bytes = 1, .input_bytes = 0, .recompute_seconds = 0.0, .in_flight = 1,
                                    .group = -2}}, {true}), std::invalid_argument);
}

TEST(Plan, MomentsCountWhatIsHeldAtOnce) {
  // two stages of one rank: stage 0's two micro-batches leave (their W) before stage 1's arrive
  BlockCost first{.saved_bytes = 100, .input_bytes = 10, .recompute_seconds = 1.0, .in_flight = 2, .group = 0,
                  .alive = {1, 2, 1, 0, 0, 0}};
  BlockCost second{.saved_bytes = 100, .input_bytes = 10, .recompute_seconds = 1.0, .in_flight = 2, .group = 1,
                   .alive = {0, 0, 1, 2, 1, 0}};
  EXPECT_EQ(prefire::plan_bytes({first, second}, {false, false}), 2 * 100);  // never more than two at once
  BlockCost always = first;
  always.alive.clear();  // in_flight at every moment: both stages at their most together
  EXPECT_EQ(prefire::plan_bytes({always, second}, {false, false}), 2 * 100 + 2 * 100);
  EXPECT_EQ(prefire::plan_bytes({first, second}, {true, false}), 2 * 100 + 100);  // moment 3, and its pass
  // what the step holds at its most keeps both
  EXPECT_EQ(prefire::plan_for_budget({first, second}, 200).checkpointed, (std::vector<bool>{false, false}));
  // what a micro-batch still holds after it let go counts until the step ends: one micro-batch, then another
  BlockCost keeps{.saved_bytes = 100, .input_bytes = 10, .recompute_seconds = 1.0, .in_flight = 1, .group = 0,
                  .alive = {1, 0, 1, 0}, .done = {0, 1, 1, 2}, .saved_after_bytes = 60, .input_after_bytes = 4};
  EXPECT_EQ(prefire::plan_bytes({keeps}, {false}), 100 + 60);   // the second alive, the first's 60 still held
  EXPECT_EQ(prefire::plan_bytes({keeps}, {true}), 10 + 4 + 100);  // inputs, and one pass
  keeps.done.clear();  // letting go is letting go of everything
  EXPECT_EQ(prefire::plan_bytes({keeps}, {false}), 100);
  keeps.done = {0, 1, 1, 2};
  keeps.input_after_bytes = 11;  // more than its inputs
  EXPECT_THROW(prefire::plan_bytes({keeps}, {true}), std::invalid_argument);
  BlockCost wrong = second;
  wrong.alive.pop_back();
  EXPECT_THROW(prefire::plan_bytes({first, wrong}, {false, false}), std::invalid_argument);
  wrong = second;
  wrong.alive[0] = 3;  // above in_flight
  EXPECT_THROW(prefire::plan_bytes({first, wrong}, {false, false}), std::invalid_argument);
}

TEST(Plan, PassesAreCountedWhereTheyRun) {
  // one stage, two micro-batches: F0 F1 B0 W0 B1 W1; the most is held after both forwards, where no pass runs
  const std::vector<int64_t> alive{1, 2, 2, 1, 1, 0};
  const std::vector<int64_t> passes{0, 0, 1, 1, 1, 1};
  BlockCost a{.saved_bytes = 100, .input_bytes = 10, .recompute_seconds = 2.0, .in_flight = 2, .group = 0,
              .alive = alive};
  BlockCost b{.saved_bytes = 100, .input_bytes = 10, .recompute_seconds = 1.0, .in_flight = 2, .group = 0,
              .alive = alive};
  EXPECT_EQ(prefire::plan_bytes({a, b}, {true, true}), 2 * 20 + 200);  // the largest pass at every moment
  a.passes = b.passes = passes;
  // B0: both micro-batches' inputs and the pass; W0: what was held before it (micro-batch 0 lets go as it ends)
  EXPECT_EQ(prefire::plan_bytes({a, b}, {true, true}), 2 * 20 + 200);
  EXPECT_EQ(prefire::plan_bytes({a, b}, {false, true}), 2 * 110 + 100);  // B0: a kept twice, b's pass
  EXPECT_EQ(prefire::plan_bytes({a, b}, {false, false}), 2 * 200);       // after F1
  // a pass that runs only once one micro-batch let go: B1 after W0 finds one in flight
  const std::vector<int64_t> late{1, 2, 1, 1, 0, 0};  // F0 F1 W-like release, then B1's pass, W1
  BlockCost c{.saved_bytes = 100,
              .input_bytes = 10,
              .recompute_seconds = 1.0,
              .in_flight = 2,
              .group = 0,
              .alive = late,
              .passes = {0, 0, 0, 1, 0, 0}};
  EXPECT_EQ(prefire::plan_bytes({c}, {true}), 10 + 100);  // where the pass runs one input is held, not two
  EXPECT_EQ(prefire::plan_bytes({c}, {true}, 1), 10 + 100 + 100);  // a prefire ahead at any moment
  EXPECT_EQ(prefire::least_plan_bytes({c}), 110);
  const prefire::Plan plan = prefire::plan_for_budget({c}, 110);
  EXPECT_EQ(plan.checkpointed, std::vector<bool>{true});
  EXPECT_EQ(plan.moment_bytes, (std::vector<int64_t>{10, 20, 10, 10, 0, 0}));  // the blocks alone
  // every block or none, one per moment, none negative
  BlockCost without = a;
  without.passes.clear();
  EXPECT_THROW(prefire::plan_bytes({a, without}, {true, true}), std::invalid_argument);
  without.passes = {0, 1};
  EXPECT_THROW(prefire::plan_bytes({a, without}, {true, true}), std::invalid_argument);
  without.passes = {0, 0, -1, 1, 1, 1};
  EXPECT_THROW(prefire::plan_bytes({a, without}, {true, true}), std::invalid_argument);
  BlockCost timeless{.saved_bytes = 100, .input_bytes = 10, .recompute_seconds = 1.0, .in_flight = 2, .group = 0};
  timeless.passes = passes;  // passes without moments
  EXPECT_THROW(prefire::plan_bytes({timeless}, {true}), std::invalid_argument);
}

// A pipeline rank planned per micro-batch (one item per micro-batch and block, each alive for its
// micro-batch's lifetime): 5 blocks x 4 micro-batches, more than kExhaustiveBlocks, in the order `order`
// (F, B or W of a micro-batch per moment).
std::vector<BlockCost> per_micro_batch(const std::vector<std::pair<char, int>>& order) {
  std::vector<BlockCost> items;
  for (int m = 0; m < 4; ++m) {
    for (int b = 0; b < 5; ++b) {
      BlockCost item{.saved_bytes = 100, .input_bytes = 10, .recompute_seconds = 1.0 + b, .in_flight = 1, .group = 0};
      int64_t alive = 0;
      int64_t done = 0;
      for (const auto& [kind, mb] : order) {
        if (mb == m && kind == 'F') alive = 1;
        if (mb == m && kind == 'W') alive = 0, done = 1;
        item.alive.push_back(alive);
        item.done.push_back(done);
        item.passes.push_back(mb == m && kind != 'F');
      }
      items.push_back(item);
    }
  }
  return items;
}

TEST(Plan, ManyBlocksPerMicroBatchKeepWhatNeverMeets) {
  // the micro-batches one after another: keeping everything holds one micro-batch's blocks at most
  const auto apart = per_micro_batch({{'F', 0}, {'B', 0}, {'W', 0}, {'F', 1}, {'B', 1}, {'W', 1},
                                      {'F', 2}, {'B', 2}, {'W', 2}, {'F', 3}, {'B', 3}, {'W', 3}});
  const prefire::Plan all = prefire::plan_for_budget(apart, 5 * 100);
  EXPECT_EQ(all.checkpointed, std::vector<bool>(apart.size(), false));
  EXPECT_EQ(all.peak_bytes, 5 * 100);
  // two in flight: micro-batch 0 meets only micro-batch 1 before its pass, so it keeps every block, and
  // the others keep the one that takes longest to recompute (a plan per block keeps one everywhere: 40 s);
  // the greedy pass finds it, where the knapsack counts all 20 held at once
  const auto overlapping = per_micro_batch({{'F', 0}, {'F', 1}, {'B', 0}, {'W', 0}, {'F', 2}, {'B', 1},
                                            {'W', 1}, {'F', 3}, {'B', 2}, {'W', 2}, {'B', 3}, {'W', 3}});
  const prefire::Plan some = prefire::plan_for_budget(overlapping, 700);
  EXPECT_LE(some.peak_bytes, 700);
  EXPECT_EQ(some.recompute_seconds, 30.0);
  for (int m = 0; m < 4; ++m) {
    for (int b = 0; b < 5; ++b) EXPECT_EQ(some.checkpointed[m * 5 + b], m > 0 && b < 4) << m << " " << b;
  }
}

TEST(Plan, AnOffloadedBlockHoldsNothingOnTheDeviceAndCostsTheCopiesLeftExposed) {
  const BlockCost block{.saved_bytes = 100, .input_bytes = 10, .recompute_seconds = 1.0};
  EXPECT_EQ(prefire::offered_choices(block), (std::vector<prefire::Choice>{prefire::Choice::kKeep,
                                                                           prefire::Choice::kCheckpoint}));
  const BlockCost offered = prefire::with_offload(block, 100, 0.5);
  EXPECT_EQ(offered.offload_bytes, 0);
  EXPECT_EQ(offered.offload_after_bytes, 0);
  EXPECT_EQ(offered.offload_moved_bytes, 100);
  EXPECT_EQ(offered.offload_hidden, prefire::kOffloadHidden);
  EXPECT_EQ(prefire::choice_seconds(offered, prefire::Choice::kOffload), 0.5 * (1 - prefire::kOffloadHidden));
  EXPECT_EQ(prefire::offered_choices(offered).back(), prefire::Choice::kOffload);
  EXPECT_EQ(prefire::copy_seconds(100, 50.0, 100.0), 3.0);
  EXPECT_THROW(prefire::with_offload(block, -1, 0.5), std::invalid_argument);
  EXPECT_THROW(prefire::copy_seconds(100, 0.0, 1.0), std::invalid_argument);
}

TEST(Plan, AllTheMemoryKeepsEverythingAndTheLeastCheckpointsEverything) {
  const auto blocks = transformer(8);
  const int64_t everything = 8 * (12 << 20);
  const prefire::Plan keep = prefire::plan_for_budget(blocks, everything);
  EXPECT_EQ(keep.checkpointed, std::vector<bool>(8, false));
  EXPECT_EQ(keep.recompute_seconds, 0);
  EXPECT_EQ(keep.peak_bytes, everything);

  const int64_t least = prefire::least_plan_bytes(blocks);
  EXPECT_EQ(least, 8 * (1 << 20) + (12 << 20));
  const prefire::Plan all = prefire::plan_for_budget(blocks, least);
  EXPECT_EQ(all.checkpointed, std::vector<bool>(8, true));
  EXPECT_EQ(all.prefire_ahead, 0);
  EXPECT_EQ(all.peak_bytes, least);
}

TEST(Plan, ABudgetBelowTheLeastNamesTheLeast) {
  const auto blocks = transformer(4);
  const int64_t least = prefire::least_plan_bytes(blocks);
  try {
    prefire::plan_for_budget(blocks, least - 1);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("memory_budget=" + std::to_string(least - 1)), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("least any plan holds: " + std::to_string(least) + " bytes"),
              std::string::npos);
  }
}

TEST(Plan, WhatTheBudgetLeavesGoesToPrefiringAhead) {
  const auto blocks = transformer(8, 4);
  // 4 micro-batches' inputs of 8 blocks, one recomputation and two more ahead: a kept block would cost
  // 4 x 11 MiB more, more than the 24.5 MiB left, which hold two recomputations ahead
  const int64_t budget = 4 * 8 * (1 << 20) + 3 * (12 << 20) + (1 << 19);
  const prefire::Plan plan = prefire::plan_for_budget(blocks, budget);
  EXPECT_EQ(plan.checkpointed, std::vector<bool>(8, true));
  EXPECT_EQ(plan.prefire_ahead, 2);
  EXPECT_EQ(plan.peak_bytes, budget - (1 << 19));
}

TEST(Plan, BytesAreWorthMoreWhereMoreMicroBatchesAreInFlight) {
  // two blocks alike but for in_flight (a first pipeline stage holds 4 micro-batches, a last one 1):
  // keeping the last stage's block costs a quarter of the first's
  const std::vector<BlockCost> blocks{{.saved_bytes = 12, .input_bytes = 1, .recompute_seconds = 1.0, .in_flight = 4},
                                      {.saved_bytes = 12, .input_bytes = 1, .recompute_seconds = 1.0, .in_flight = 1}};
  const int64_t budget = prefire::least_plan_bytes(blocks) + 11;
  const prefire::Plan plan = prefire::plan_for_budget(blocks, budget);
  EXPECT_EQ(plan.checkpointed, (std::vector<bool>{true, false}));
}

TEST(Plan, RandomBlocksStayWithinTheBudgetAndMatchTheExhaustiveBest) {
  std::mt19937_64 rng(2026);
  std::uniform_int_distribution<int64_t> saved(1, 64 << 20);
  std::uniform_real_distribution<double> fraction(0.02, 1.2);  // some blocks save less than their inputs
  std::uniform_real_distribution<double> ms(0.1, 10.0);
  std::uniform_int_distribution<int> in_flight(1, 4);
  std::uniform_int_distribution<int> count(1, 12);
  std::uniform_int_distribution<int> group(-1, 2);  // a rank's stages, or blocks alone
  std::bernoulli_distribution grouped(0.5);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<BlockCost> blocks(static_cast<size_t>(count(rng)));
    const bool stages = grouped(rng);
    for (auto& b : blocks) {
      b.saved_bytes = saved(rng);
      b.input_bytes = static_cast<int64_t>(static_cast<double>(b.saved_bytes) * fraction(rng));
      b.recompute_seconds = ms(rng) * 1e-3;
      b.in_flight = in_flight(rng);
      b.group = stages ? group(rng) : -1;
    }
    const int64_t least = prefire::least_plan_bytes(blocks);
    const int64_t most = prefire::plan_bytes(blocks, std::vector<bool>(blocks.size(), false));
    for (double at : {0.0, 0.1, 0.3, 0.5, 0.8, 1.0}) {
      const int64_t budget = least + static_cast<int64_t>(at * static_cast<double>(std::max<int64_t>(0, most - least)));
      const prefire::Plan plan = prefire::plan_for_budget(blocks, budget);
      ASSERT_LE(plan.peak_bytes, budget) << trial;
      ASSERT_EQ(plan.peak_bytes, prefire::plan_bytes(blocks, plan.checkpointed, plan.prefire_ahead));
      ASSERT_DOUBLE_EQ(plan.recompute_seconds, seconds_of(blocks, plan.checkpointed));
      // every n-th block, as torch users write it, where it fits: never faster than the plan
      for (size_t every = 1; every <= blocks.size(); ++every) {
        std::vector<bool> nth(blocks.size(), false);
        for (size_t i = 0; i < blocks.size(); i += every) nth[i] = true;
        if (prefire::plan_bytes(blocks, nth) <= budget) {
          ASSERT_LE(plan.recompute_seconds, seconds_of(blocks, nth) + 1e-12) << trial << " every " << every;
        }
      }
      const double best = exhaustive_best(blocks, budget);
      ASSERT_GE(best, 0);
      ASSERT_LE(plan.recompute_seconds, best + 1e-12) << trial << " at " << at;  // it tried them all too
    }
  }
}

TEST(Plan, ManyBlocksStayWithinTheBudgetAndBeatTheHandWrittenPlans) {
  // past kExhaustiveBlocks: the knapsack (with a choice per item where blocks have a selective checkpoint:
  // every fourth trial), and for groups the plans that fit among its candidates
  std::mt19937_64 rng(25);
  std::uniform_int_distribution<int64_t> saved(1, 64 << 20);
  std::uniform_real_distribution<double> ms(0.1, 10.0);
  std::uniform_real_distribution<double> share(0.1, 0.9);
  std::uniform_int_distribution<int> count(static_cast<int>(prefire::kExhaustiveBlocks) + 1, 40);
  std::uniform_int_distribution<int> group(-1, 3);
  for (int trial = 0; trial < 48; ++trial) {
    const bool selective = trial % 4 >= 2;
    std::vector<BlockCost> blocks(static_cast<size_t>(count(rng)));
    for (auto& b : blocks) {
      b.saved_bytes = saved(rng);
      b.input_bytes = b.saved_bytes / 8;
      b.recompute_seconds = ms(rng) * 1e-3;
      b.in_flight = 1 + trial % 4;
      b.group = trial % 2 ? group(rng) : -1;
      if (selective) {
        b.selective_bytes = b.input_bytes + static_cast<int64_t>(static_cast<double>(b.saved_bytes) * share(rng) / 2);
        b.selective_seconds = b.recompute_seconds * share(rng);
      }
    }
    std::vector<BlockCost> plain = blocks;  // the same without selective checkpoints
    for (auto& b : plain) b.selective_bytes = -1;
    const int64_t least = prefire::least_plan_bytes(blocks);
    const int64_t most = prefire::plan_bytes(blocks, std::vector<bool>(blocks.size(), false));
    for (double at : {0.0, 0.2, 0.5, 1.0}) {
      const int64_t budget = least + static_cast<int64_t>(at * static_cast<double>(most - least));
      const prefire::Plan plan = prefire::plan_for_budget(blocks, budget);
      ASSERT_LE(plan.peak_bytes, budget) << trial;
      ASSERT_EQ(plan.peak_bytes, prefire::plan_bytes(blocks, plan.checkpointed, plan.prefire_ahead,
                                                     prefire::Release::kAtStepEnd, plan.selective));
      if (selective) {  // a choice more never makes the plan slower (Note [Choosing a plan])
        ASSERT_LE(plan.recompute_seconds, prefire::plan_for_budget(plain, budget).recompute_seconds + 1e-12) << trial;
      }
      for (size_t every = 1; every <= blocks.size(); ++every) {
        std::vector<bool> nth(blocks.size(), false);
        for (size_t i = 0; i < blocks.size(); i += every) nth[i] = true;
        if (prefire::plan_bytes(blocks, nth) <= budget) {
          ASSERT_LE(plan.recompute_seconds, seconds_of(blocks, nth) + 1e-12) << trial << " every " << every;
        }
      }
    }
  }
}

constexpr auto kInBackward = prefire::Release::kInBackward;

TEST(Plan, OfferingOffloadNeverMakesAPlanRecomputeMoreThanWithoutIt) {
  // past what the exhaustive search takes, the heuristics with four choices could miss the plan that two find
  // (a pipeline rank planned per micro-batch: 16 items, found so on a measured sweep)
  std::mt19937_64 rng(41);
  std::uniform_int_distribution<int64_t> saved(1, 64 << 20);
  std::uniform_real_distribution<double> ms(0.1, 10.0);
  std::uniform_real_distribution<double> share(0.0, 1.0);
  std::uniform_int_distribution<int> count(9, 30);
  std::uniform_int_distribution<int> group(-1, 3);
  std::bernoulli_distribution coin(0.5);
  for (prefire::Release release : {prefire::Release::kAtStepEnd, kInBackward}) {
    for (int trial = 0; trial < 24; ++trial) {
      std::vector<BlockCost> blocks(static_cast<size_t>(count(rng)));
      for (auto& b : blocks) {
        b.saved_bytes = saved(rng);
        b.input_bytes = static_cast<int64_t>(static_cast<double>(b.saved_bytes) * share(rng) / 4);
        b.recompute_seconds = ms(rng) * 1e-3;
        if (coin(rng)) {  // offered, at copies that cost more or less than the recomputation
          b.offload_bytes = 0;
          b.offload_moved_bytes = b.saved_bytes;
          b.offload_seconds = ms(rng) * 2e-3;
          b.offload_hidden = share(rng);
        }
        if (release == prefire::Release::kAtStepEnd) {
          b.in_flight = 1 + trial % 4;
          b.group = trial % 2 ? group(rng) : -1;
        }
      }
      std::vector<BlockCost> recompute_only = blocks;
      for (auto& b : recompute_only) b.offload_bytes = -1;
      const int64_t least = prefire::least_plan_bytes(recompute_only, release);
      const int64_t most = prefire::plan_bytes(blocks, std::vector<bool>(blocks.size(), false), 0, release);
      for (double at : {0.0, 0.1, 0.3, 0.6, 1.0}) {
        const int64_t budget =
            least + static_cast<int64_t>(at * static_cast<double>(std::max<int64_t>(0, most - least)));
        const prefire::Plan with = prefire::plan_for_budget(blocks, budget, release);
        const prefire::Plan without = prefire::plan_for_budget(recompute_only, budget, release);
        ASSERT_LE(with.peak_bytes, budget) << trial;
        ASSERT_LE(with.recompute_seconds, without.recompute_seconds + 1e-12) << trial << " at " << at;
      }
    }
  }
}

TEST(Plan, InOneBackwardPassABlockFindsOnlyTheBlocksBelowItHeld) {
  const std::vector<BlockCost> blocks{{.saved_bytes = 100, .input_bytes = 10, .recompute_seconds = 1.0, .in_flight = 1},
                                      {.saved_bytes = 200, .input_bytes = 20, .recompute_seconds = 2.0, .in_flight = 1},
                                      {.saved_bytes = 50, .input_bytes = 5, .recompute_seconds = 0.5, .in_flight = 1}};
  // block 1's backward: block 0's 100, its input 20 and its recomputation 200; block 2's: 125 + 50
  EXPECT_EQ(prefire::plan_bytes(blocks, {false, true, true}, 0, kInBackward), 100 + 20 + 200);
  // prefiring one ahead: block 2's backward also holds block 1's recomputation
  EXPECT_EQ(prefire::plan_bytes(blocks, {false, true, true}, 1, kInBackward), 100 + 20 + 5 + 50 + 200);
  // the end of forward holds the most when the checkpointed block is the first
  EXPECT_EQ(prefire::plan_bytes(blocks, {true, false, false}, 0, kInBackward), 10 + 200 + 50);
  EXPECT_EQ(prefire::plan_bytes(blocks, {false, false, false}, 0, kInBackward), 350);
  EXPECT_THROW(prefire::plan_bytes({{.saved_bytes = 1, .input_bytes = 0, .recompute_seconds = 0.0,
                                    .in_flight = 2}}, {true}, 0, kInBackward), std::invalid_argument);
  EXPECT_THROW(prefire::plan_for_budget({{.saved_bytes = 1, .input_bytes = 0, .recompute_seconds = 0.0,
                                         .in_flight = 2}}, 10, kInBackward), std::invalid_argument);
}

TEST(Plan, InOneBackwardPassEveryOtherBlockFitsWhereThePipelineModelSaysItCannot) {
  const auto blocks = transformer(4);  // 12 MiB saved, 1 MiB input each
  const std::vector<bool> every_other{true, false, true, false};
  EXPECT_EQ(prefire::plan_bytes(blocks, every_other), (1 + 12 + 1 + 12 + 12) << 20);
  EXPECT_EQ(prefire::plan_bytes(blocks, every_other, 0, kInBackward), (1 + 12 + 1 + 12) << 20);
  const int64_t budget = 30 << 20;
  EXPECT_EQ(prefire::plan_for_budget(blocks, budget, kInBackward).recompute_seconds, 2e-3);
  EXPECT_GT(prefire::plan_for_budget(blocks, budget).recompute_seconds, 2e-3);
}

TEST(Plan, InOneBackwardPassRandomBlocksStayWithinTheBudgetAndMatchTheExhaustiveBest) {
  std::mt19937_64 rng(2027);
  std::uniform_int_distribution<int64_t> saved(1, 64 << 20);
  std::uniform_real_distribution<double> fraction(0.02, 1.2);
  std::uniform_real_distribution<double> ms(0.1, 10.0);
  std::uniform_int_distribution<int> count(1, 12);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<BlockCost> blocks(static_cast<size_t>(count(rng)));
    for (auto& b : blocks) {
      b.saved_bytes = saved(rng);
      b.input_bytes = static_cast<int64_t>(static_cast<double>(b.saved_bytes) * fraction(rng));
      b.recompute_seconds = ms(rng) * 1e-3;
    }
    const int64_t least = prefire::least_plan_bytes(blocks, kInBackward);
    const int64_t most = prefire::plan_bytes(blocks, std::vector<bool>(blocks.size(), false), 0, kInBackward);
    for (double at : {0.0, 0.1, 0.3, 0.5, 0.8, 1.0}) {
      const int64_t budget = least + static_cast<int64_t>(at * static_cast<double>(std::max<int64_t>(0, most - least)));
      const prefire::Plan plan = prefire::plan_for_budget(blocks, budget, kInBackward);
      ASSERT_LE(plan.peak_bytes, budget) << trial;
      ASSERT_EQ(plan.peak_bytes, prefire::plan_bytes(blocks, plan.checkpointed, plan.prefire_ahead, kInBackward));
      ASSERT_DOUBLE_EQ(plan.recompute_seconds, seconds_of(blocks, plan.checkpointed));
      for (size_t every = 1; every <= blocks.size(); ++every) {
        std::vector<bool> nth(blocks.size(), false);
        for (size_t i = 0; i < blocks.size(); i += every) nth[i] = true;
        if (prefire::plan_bytes(blocks, nth, 0, kInBackward) <= budget) {
          ASSERT_LE(plan.recompute_seconds, seconds_of(blocks, nth) + 1e-12) << trial << " every " << every;
        }
      }
      // the dynamic program is exact up to rounding each block's bytes up to a unit of budget/4096:
      // no plan that fits with that much to spare recomputes less
      const int64_t slack = 2 * static_cast<int64_t>(blocks.size()) * (budget / 4096 + 1);
      const double best_with_slack = exhaustive_best(blocks, budget - slack, kInBackward);
      if (best_with_slack >= 0) {
        ASSERT_LE(plan.recompute_seconds, best_with_slack + 1e-12) << trial << " at " << at;
      }
    }
  }
}


// ---- selective checkpoints: a third choice per block (Note [Selective checkpoints in a plan]) ----

// per block: 0 kept, 1 checkpointed, 2 checkpointed selectively
struct Choices {
  std::vector<bool> checkpointed, selective;
};

Choices choices_of(const std::vector<int>& options) {
  Choices c;
  for (int o : options) {
    c.checkpointed.push_back(o != 0);
    c.selective.push_back(o == 2);
  }
  return c;
}

double seconds_of(const std::vector<BlockCost>& blocks, const Choices& c) {
  double total = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (c.checkpointed[i]) total += c.selective[i] ? blocks[i].selective_seconds : blocks[i].recompute_seconds;
  }
  return total;
}

BlockCost selective_block(int64_t saved, int64_t input, double seconds, int64_t selective, double selective_seconds,
                          int64_t in_flight = 1, int64_t group = -1) {
  BlockCost b{.saved_bytes = saved, .input_bytes = input, .recompute_seconds = seconds, .in_flight = in_flight,
              .group = group};
  b.selective_bytes = selective;
  b.selective_seconds = selective_seconds;
  return b;
}

TEST(Plan, ASelectiveCheckpointHoldsWhatItKeepsAndIsRecomputedLikeTheWholeBlock) {
  const std::vector<BlockCost> blocks{selective_block(100, 10, 1.0, 60, 0.2, 2),
                                      {.saved_bytes = 200, .input_bytes = 20, .recompute_seconds = 2.0}};
  // selective: 2 micro-batches of its 60, and its recomputation is charged the block's saved 100
  EXPECT_EQ(prefire::plan_bytes(blocks, {true, false}, 0, prefire::Release::kAtStepEnd, {true, false}),
            2 * 60 + 200 + 100);
  EXPECT_EQ(prefire::plan_bytes(blocks, {true, false}), 2 * 10 + 200 + 100);  // whole: its inputs
  EXPECT_EQ(prefire::plan_bytes(blocks, {true, true}, 0, prefire::Release::kAtStepEnd, {true, false}),
            2 * 60 + 20 + 200);
  // in one backward pass: what blocks 0..j hold, and j's recomputation
  const std::vector<BlockCost> one{selective_block(100, 10, 1.0, 60, 0.2),
                                   {.saved_bytes = 200, .input_bytes = 20, .recompute_seconds = 2.0}};
  EXPECT_EQ(prefire::plan_bytes(one, {true, false}, 0, kInBackward, {true, false}), 60 + 200);
  EXPECT_EQ(prefire::plan_bytes(one, {true, true}, 0, kInBackward, {true, false}), 60 + 20 + 200);
  // selective where a block is kept, or has no selective checkpoint; or a size that differs
  EXPECT_THROW(prefire::plan_bytes(blocks, {false, false}, 0, prefire::Release::kAtStepEnd, {true, false}),
               std::invalid_argument);
  EXPECT_THROW(prefire::plan_bytes(blocks, {true, true}, 0, prefire::Release::kAtStepEnd, {false, true}),
               std::invalid_argument);
  EXPECT_THROW(prefire::plan_bytes(blocks, {true, true}, 0, prefire::Release::kAtStepEnd, {true}),
               std::invalid_argument);
  EXPECT_THROW(prefire::plan_bytes({selective_block(100, 10, 1.0, -2, 0.2)}, {false}), std::invalid_argument);
  EXPECT_THROW(prefire::plan_bytes({selective_block(100, 10, 1.0, 60, -1.0)}, {false}), std::invalid_argument);
}

TEST(Plan, SelectiveCheckpointsComeFirstWhereTheyFreeBytesCheapest) {
  // a transformer block: 12 MiB saved, 1 MiB input, 1 ms; kept matmul outputs 8 MiB, 0.15 ms recomputed
  std::vector<BlockCost> blocks(4, selective_block(12 << 20, 1 << 20, 1e-3, 8 << 20, 0.15e-3, 2));
  const Choices all_selective = choices_of({2, 2, 2, 2});
  const int64_t budget = prefire::plan_bytes(blocks, all_selective.checkpointed, 0, prefire::Release::kAtStepEnd,
                                             all_selective.selective);
  const prefire::Plan plan = prefire::plan_for_budget(blocks, budget);
  EXPECT_EQ(plan.selective, all_selective.selective);
  EXPECT_EQ(plan.checkpointed, all_selective.checkpointed);
  EXPECT_DOUBLE_EQ(plan.recompute_seconds, 4 * 0.15e-3);
  EXPECT_EQ(plan.peak_bytes, budget);
  // without the third choice the same budget checkpoints two blocks whole: 3.3x the recomputation
  for (auto& b : blocks) b.selective_bytes = -1;
  EXPECT_DOUBLE_EQ(prefire::plan_for_budget(blocks, budget).recompute_seconds, 2e-3);
}

// ---- offloading: a fourth choice per block (Note [Offloaded blocks in a plan]) ----

BlockCost offload_block(int64_t saved, int64_t input, double seconds, int64_t offload, double copy_seconds,
                        double hidden, int64_t in_flight = 1, int64_t group = -1) {
  BlockCost b{.saved_bytes = saved, .input_bytes = input, .recompute_seconds = seconds, .in_flight = in_flight,
              .group = group};
  b.offload_bytes = offload;
  b.offload_moved_bytes = saved + input;
  b.offload_seconds = copy_seconds;
  b.offload_hidden = hidden;
  return b;
}

std::vector<prefire::Choice> options_of(const BlockCost& b) {
  std::vector<prefire::Choice> options{prefire::Choice::kKeep, prefire::Choice::kCheckpoint};
  if (b.selective_bytes >= 0) options.push_back(prefire::Choice::kSelective);
  if (b.offload_bytes >= 0) options.push_back(prefire::Choice::kOffload);
  return options;
}

// The least seconds added of any choice per block within the budget, counted by describe_plan (-1: none fits).
double exhaustive_best_of_four(const std::vector<BlockCost>& blocks, int64_t budget, prefire::Release release) {
  double best = -1;
  std::vector<size_t> digit(blocks.size(), 0);
  std::vector<prefire::Choice> choices(blocks.size(), prefire::Choice::kKeep);
  while (true) {
    const prefire::Plan p = prefire::describe_plan(blocks, choices, budget, 0, release);
    if (p.peak_bytes <= budget && (best < 0 || p.recompute_seconds < best)) best = p.recompute_seconds;
    size_t i = 0;
    for (; i < blocks.size(); ++i) {
      const auto options = options_of(blocks[i]);
      if (++digit[i] < options.size()) {
        choices[i] = options[digit[i]];
        break;
      }
      digit[i] = 0;
      choices[i] = prefire::Choice::kKeep;
    }
    if (i == blocks.size()) return best;
  }
}

TEST(Plan, AnOffloadedBlockHoldsWhatStaysAndItsFetchIsChargedLikeARecomputation) {
  using prefire::Choice;
  const std::vector<BlockCost> blocks{offload_block(100, 10, 1.0, 0, 0.5, 0.8, 2),
                                      {.saved_bytes = 200, .input_bytes = 20, .recompute_seconds = 2.0}};
  const prefire::Plan offloaded = prefire::describe_plan(blocks, {Choice::kOffload, Choice::kKeep}, 1000);
  // 2 micro-batches holding nothing on the device, the kept block, and the fetch of its saved 100
  EXPECT_EQ(offloaded.peak_bytes, 2 * 0 + 200 + 100);
  EXPECT_EQ(offloaded.offloaded, (std::vector<bool>{true, false}));
  EXPECT_EQ(offloaded.checkpointed, (std::vector<bool>{true, false}));
  EXPECT_NEAR(offloaded.recompute_seconds, 0.5 * (1 - 0.8), 1e-12) << "the copies' time the compute leaves";
  EXPECT_NEAR(prefire::choice_seconds(blocks[0], Choice::kOffload), 0.1, 1e-12);
  // in one backward pass: what blocks 0..j hold, and j's fetch
  const std::vector<BlockCost> one{offload_block(100, 10, 1.0, 5, 0.5, 0.0),
                                   {.saved_bytes = 200, .input_bytes = 20, .recompute_seconds = 2.0}};
  EXPECT_EQ(prefire::describe_plan(one, {Choice::kOffload, Choice::kCheckpoint}, 0, 0, kInBackward).peak_bytes,
            std::max<int64_t>(5 + 100, 5 + 20 + 200));
  // offload where it is not offered, or costs out of range
  EXPECT_THROW(prefire::describe_plan({BlockCost{.saved_bytes = 1}}, {Choice::kOffload}, 0), std::invalid_argument);
  EXPECT_THROW(prefire::plan_for_budget({offload_block(100, 10, 1.0, 0, 0.5, 1.5)}, 1000), std::invalid_argument);
  EXPECT_THROW(prefire::plan_for_budget({offload_block(100, 10, 1.0, -2, 0.5, 0.5)}, 1000), std::invalid_argument);
  EXPECT_THROW(prefire::plan_for_budget({offload_block(100, 10, 1.0, 0, -0.5, 0.5)}, 1000), std::invalid_argument);
}

TEST(Plan, OffloadComesFirstWhereItsCopiesHideAndNeverWithoutItsCosts) {
  // a transformer block: 12 MiB saved, 1 MiB input, 1 ms recomputed; its copies take 1 ms, 95 % hidden (the copy
  // into the tier, within the next block's forward); the budget leaves room for the 13 MiB of one copy in flight
  std::vector<BlockCost> blocks(4, offload_block(12 << 20, 1 << 20, 1e-3, 0, 1e-3, 0.95, 2));
  const int64_t none = prefire::plan_bytes(blocks, std::vector<bool>(4, false));
  const prefire::Plan plan = prefire::plan_for_budget(blocks, none / 3);
  EXPECT_LE(plan.peak_bytes + (13 << 20), none / 3);
  EXPECT_EQ(std::count(plan.offloaded.begin(), plan.offloaded.end(), true), 4);
  EXPECT_NEAR(plan.recompute_seconds, 4 * 1e-3 * 0.05, 1e-12);
  // at a budget that fits it but no copy beside it, forward would wait for every copy: the copies count whole
  EXPECT_NEAR(prefire::describe_plan(blocks, std::vector<prefire::Choice>(4, prefire::Choice::kOffload), none / 4).recompute_seconds,
              4 * 1e-3, 1e-12);
  // per block: the roomy plan's offloaded blocks their exposed 5 %; a tight one's its offloaded blocks' copies whole
  // and its recomputed block its recomputation (the simulator replays a plan by these)
  for (const double s : plan.block_seconds) EXPECT_NEAR(s, 1e-3 * 0.05, 1e-12);
  const std::vector<prefire::Choice> mixed{prefire::Choice::kOffload, prefire::Choice::kOffload,
                                           prefire::Choice::kCheckpoint, prefire::Choice::kKeep};
  const prefire::Plan tight = prefire::describe_plan(blocks, mixed, prefire::describe_plan(blocks, mixed, 0).peak_bytes);
  ASSERT_EQ(tight.block_seconds.size(), 4U);
  EXPECT_NEAR(tight.block_seconds[0], 1e-3, 1e-12);
  EXPECT_NEAR(tight.block_seconds[1], 1e-3, 1e-12);
  EXPECT_NEAR(tight.block_seconds[2], 1e-3, 1e-12);
  EXPECT_EQ(tight.block_seconds[3], 0.0);
  const prefire::Plan roomy = prefire::describe_plan(blocks, mixed, tight.peak_bytes + (13 << 20));
  EXPECT_NEAR(roomy.block_seconds[0], 1e-3 * 0.05, 1e-12);
  EXPECT_NEAR(roomy.block_seconds[2], 1e-3, 1e-12);
  EXPECT_NEAR(roomy.recompute_seconds, 2 * 1e-3 * 0.05 + 1e-3, 1e-12);
  // without the fourth choice the same budget recomputes every block: 10x the seconds
  for (auto& b : blocks) b.offload_bytes = -1;
  const prefire::Plan recompute_only = prefire::plan_for_budget(blocks, none / 4);
  EXPECT_EQ(std::count(recompute_only.offloaded.begin(), recompute_only.offloaded.end(), true), 0);
  EXPECT_NEAR(recompute_only.recompute_seconds, 4e-3, 1e-12);
  // copies that hide nothing and take longer than the recomputation: recomputed, not offloaded
  for (auto& b : blocks) b = offload_block(12 << 20, 1 << 20, 1e-3, 0, 2e-3, 0.0, 2);
  EXPECT_EQ(prefire::plan_for_budget(blocks, none / 4).offloaded, std::vector<bool>(4, false));
}

// Selective checkpoints and offloading, each offered by some blocks: every choice tried at the step end.
TEST(Plan, RandomBlocksWithFourChoicesStayWithinTheBudgetAndMatchTheExhaustiveBest) {
  std::mt19937_64 rng(2029);
  std::uniform_int_distribution<int64_t> saved(1, 64 << 20);
  std::uniform_real_distribution<double> fraction(0.02, 1.2);
  std::uniform_real_distribution<double> share(0.0, 1.0);
  std::uniform_real_distribution<double> ms(0.1, 10.0);
  std::uniform_int_distribution<int> in_flight(1, 4);
  std::uniform_int_distribution<int> count(1, 7);
  std::uniform_int_distribution<int> group(-1, 2);
  std::bernoulli_distribution coin(0.5);
  for (prefire::Release release : {prefire::Release::kAtStepEnd, kInBackward}) {
    for (int trial = 0; trial < 200; ++trial) {
      std::vector<BlockCost> blocks(static_cast<size_t>(count(rng)));
      const bool stages = coin(rng);
      for (auto& b : blocks) {
        b.saved_bytes = saved(rng);
        b.input_bytes = static_cast<int64_t>(static_cast<double>(b.saved_bytes) * fraction(rng));
        b.recompute_seconds = ms(rng) * 1e-3;
        if (coin(rng)) {
          const int64_t low = std::min(b.input_bytes, b.saved_bytes);
          b.selective_bytes = low + static_cast<int64_t>(static_cast<double>(b.saved_bytes - low) * share(rng));
          b.selective_seconds = b.recompute_seconds * share(rng);
        }
        if (coin(rng)) {
          b.offload_bytes = static_cast<int64_t>(static_cast<double>(b.input_bytes) * share(rng) * share(rng));
          b.offload_moved_bytes = b.saved_bytes + b.input_bytes;
          b.offload_seconds = ms(rng) * 1e-3;
          b.offload_hidden = share(rng);
        }
        if (release == prefire::Release::kAtStepEnd) {
          b.in_flight = in_flight(rng);
          b.group = stages ? group(rng) : -1;
        }
      }
      const int64_t least = prefire::least_plan_bytes(blocks, release);
      const int64_t most = prefire::plan_bytes(blocks, std::vector<bool>(blocks.size(), false), 0, release);
      for (double at : {0.0, 0.1, 0.25, 0.5, 0.75, 1.0}) {
        const int64_t budget =
            least + static_cast<int64_t>(at * static_cast<double>(std::max<int64_t>(0, most - least)));
        const prefire::Plan plan = prefire::plan_for_budget(blocks, budget, release);
        ASSERT_LE(plan.peak_bytes, budget) << trial;
        const prefire::Plan described =
            prefire::describe_plan(blocks, plan.choices, budget, plan.prefire_ahead, release);
        ASSERT_EQ(plan.peak_bytes, described.peak_bytes);
        ASSERT_DOUBLE_EQ(plan.recompute_seconds, described.recompute_seconds);
        if (std::count(plan.offloaded.begin(), plan.offloaded.end(), true) == 0) {  // the bool-vector form too
          ASSERT_EQ(plan.peak_bytes,
                    prefire::plan_bytes(blocks, plan.checkpointed, plan.prefire_ahead, release, plan.selective));
          ASSERT_DOUBLE_EQ(plan.recompute_seconds, seconds_of(blocks, Choices{plan.checkpointed, plan.selective}));
        }
        const double best = exhaustive_best_of_four(blocks, budget, release);
        if (release == prefire::Release::kAtStepEnd) {  // every choice tried: exact
          ASSERT_LE(plan.recompute_seconds, best + 1e-12) << trial << " at " << at;
          continue;
        }
        const int64_t slack = 2 * static_cast<int64_t>(blocks.size()) * (budget / 4096 + 1);  // the DP's rounding
        const double best_with_slack = exhaustive_best_of_four(blocks, budget - slack, release);
        if (best_with_slack >= 0) ASSERT_LE(plan.recompute_seconds, best_with_slack + 1e-12) << trial << " at " << at;
      }
    }
  }
}

}  // namespace
