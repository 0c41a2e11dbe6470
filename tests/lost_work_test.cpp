// Work a user's schedule throws away is loud (Note [A session shares what is
// registered to it], session/session.h): session scopes with nothing
// registered around passes that recompute warn, and so does a prefire that no
// pass of its session used; the counters say how often. And the quiet cases
// stay quiet: registered checkpoints, used prefires.
//
// Not covered here: the same warnings as Python warnings (tests/python/test_schedule.py).

#include "test_support.h"

#include <c10/util/Exception.h>

namespace prefire::testing {
namespace {

using ::testing::HasSubstr;

/// Collects the warnings c10 reports on this thread while it lives, with
/// TORCH_WARN_ONCE warning every time (as torch.set_warn_always(True)).
class Warnings : public c10::WarningHandler {
 public:
  Warnings() : guard_(this), always_(c10::WarningUtils::get_warnAlways()) { c10::WarningUtils::set_warnAlways(true); }
  ~Warnings() override { c10::WarningUtils::set_warnAlways(always_); }
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  /// How many messages contain `part`.
  size_t count(const std::string& part) const {
    return std::count_if(messages.begin(), messages.end(), [&](const auto& m) { return m.find(part) != std::string::npos; });
  }
  std::vector<std::string> messages;

 private:
  c10::WarningUtils::WarningHandlerGuard guard_;
  bool always_;
};

int64_t recomputations_now() { return runtime_stats().recomputations; }

constexpr const char* kSharedNothing = "ended with no checkpoint registered to it";
constexpr const char* kWasted = "was released before any backward pass used its recomputation";

struct Forward {
  at::Tensor x, y;
  std::vector<CheckpointHandle> handles;
};

Forward forward(const Stage& stage, uint64_t seed) {
  at::manual_seed(seed);
  Forward f;
  f.x = at::randn({2, 5, 16}).requires_grad_(true);
  HandleCollector collect;
  f.y = stage.forward(f.x, /*checkpointed=*/true);
  f.handles = collect.handles();
  return f;
}

// The split of a zero-bubble schedule: B (input gradients), then W (weights).
void b_then_w(const Forward& f, const Stage& stage, SessionId id) {
  { SessionScope b(id, {/*retain_on_unpack=*/true}); torch::autograd::grad({f.y.sum()}, {f.x}, {}, true); }
  { SessionScope w(id, {/*retain_on_unpack=*/false}); torch::autograd::grad({f.y.sum()}, stage.params()); }
}

// Two backward calls of one graph (two losses, or gradient accumulation).
void two_backwards(const Forward& f, SessionId id) {
  { SessionScope first(id, {true}); f.y.sum().backward({}, /*retain_graph=*/true); }
  { SessionScope second(id, {false}); f.y.mean().backward(); }
}

TEST(LostWork, ScopesAloneAroundBAndWShareNothingAndWarn) {
  Stage stage(2);
  auto f = forward(stage, 1);
  Warnings warnings;
  const auto before = runtime_stats();
  b_then_w(f, stage, 200);
  const auto after = runtime_stats();
  EXPECT_EQ(after.recomputations - before.recomputations, 4);  // two blocks, twice: nothing shared
  EXPECT_EQ(after.unshared_recomputations - before.unshared_recomputations, 4);
  EXPECT_EQ(warnings.count(kSharedNothing), 2u) << ::testing::PrintToString(warnings.messages);
  EXPECT_THAT(warnings.messages.front(), HasSubstr("prefire::attach"));
  clear_session(200);
}

TEST(LostWork, ScopesAloneAroundTwoBackwardCallsWarn) {
  Stage stage(2);
  auto f = forward(stage, 2);
  Warnings warnings;
  two_backwards(f, 201);
  EXPECT_EQ(warnings.count(kSharedNothing), 2u) << ::testing::PrintToString(warnings.messages);
  clear_session(201);
}

TEST(LostWork, AttachedCheckpointsShareOneRecomputationWithoutAWarning) {
  Stage stage(2);
  for (bool split : {true, false}) {
    auto f = forward(stage, 3);
    for (const auto& h : f.handles) attach(h, 202);
    Warnings warnings;
    const auto before = runtime_stats();
    if (split) {
      b_then_w(f, stage, 202);
    } else {
      two_backwards(f, 202);
    }
    EXPECT_EQ(runtime_stats().recomputations - before.recomputations, 2) << "split " << split;
    EXPECT_EQ(runtime_stats().unshared_recomputations, before.unshared_recomputations) << "split " << split;
    EXPECT_TRUE(warnings.messages.empty()) << ::testing::PrintToString(warnings.messages);
    clear_session(202);
  }
}

TEST(LostWork, APrefireClearedUnusedIsCountedAndWarns) {
  Stage stage(2);
  auto f = forward(stage, 4);
  for (const auto& h : f.handles) EXPECT_EQ(prefire::prefire(h, 203), PrefireStatus::kRecomputed);
  EXPECT_EQ(session_stats(203).unused_prefires, 2);
  Warnings warnings;
  const int64_t wasted = runtime_stats().wasted_prefires;
  clear_session(203);
  EXPECT_EQ(runtime_stats().wasted_prefires - wasted, 2);
  EXPECT_EQ(warnings.count(kWasted), 2u) << ::testing::PrintToString(warnings.messages);
}

TEST(LostWork, APrefireDiscardedOnPurposeIsNeitherCountedNorWarned) {
  Stage stage(2);
  auto f = forward(stage, 7);
  for (const auto& h : f.handles) prefire::prefire(h, 207);
  Warnings warnings;
  const int64_t wasted = runtime_stats().wasted_prefires;
  discard_session(207);  // a budget making room: the caller knows
  EXPECT_EQ(runtime_stats().wasted_prefires, wasted);
  EXPECT_TRUE(warnings.messages.empty()) << ::testing::PrintToString(warnings.messages);
  EXPECT_EQ(session_stats(207).checkpoints, 0);  // ended like a clear
  const auto before = recomputations_now();
  { SessionScope b(207, {false}); torch::autograd::grad({f.y.sum()}, {f.x}); }  // nothing registered: recomputes
  EXPECT_EQ(recomputations_now() - before, 2);
}

TEST(LostWork, APrefireFollowedByABackwardOutsideItsSessionWarnsWhenTheGraphGoes) {
  Stage stage(1);
  auto f = forward(stage, 5);
  prefire::prefire(f.handles.at(0), 204);
  Warnings warnings;
  const auto before = runtime_stats();
  f.y.sum().backward();  // no scope: recomputes by graph task, then frees the graph and the prefire with it
  EXPECT_EQ(runtime_stats().unshared_recomputations - before.unshared_recomputations, 1);
  EXPECT_EQ(runtime_stats().wasted_prefires - before.wasted_prefires, 1);
  EXPECT_EQ(warnings.count(kWasted), 1u) << ::testing::PrintToString(warnings.messages);
  clear_session(204);
}

TEST(LostWork, APrefireAPassUsedIsNotWasted) {
  Stage stage(2);
  auto f = forward(stage, 6);
  for (const auto& h : f.handles) prefire::prefire(h, 205);
  Warnings warnings;
  const int64_t wasted = runtime_stats().wasted_prefires;
  { SessionScope b(205, {true}); torch::autograd::grad({f.y.sum()}, {f.x}, {}, true); }
  EXPECT_EQ(session_stats(205).unused_prefires, 0);
  { SessionScope w(205, {false}); torch::autograd::grad({f.y.sum()}, stage.params()); }
  clear_session(205);
  EXPECT_EQ(runtime_stats().wasted_prefires, wasted);
  EXPECT_TRUE(warnings.messages.empty()) << ::testing::PrintToString(warnings.messages);
}

}  // namespace
}  // namespace prefire::testing
