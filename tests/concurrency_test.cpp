// Concurrency: user callbacks that call back into the public API, prefires
// and lazy recomputations of one checkpoint racing, budgets under concurrent
// prefires, clear_session during a backward, generator restores that never
// interleave, a registry that stays bounded, and a stress of the public API
// (run under ThreadSanitizer by scripts/test.sh --tsan).
//
// A hang is a failure here: every scenario runs under a deadline that aborts
// the process with the scenario's name.
//
// Not covered here: CUDA streams (cuda tests), random schedules
// (random_schedules.cpp).

#include "test_support.h"

#include "checkpoint/frame.h"
#include "session/session.h"
#include "checkpoint/state_capture.h"

#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <latch>
#include <mutex>

namespace prefire::testing {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

constexpr int64_t kDim = 16;

/// Runs `f` on a pinned thread; aborts the process, naming `what`, if it has
/// not finished after `deadline` (a deadlock would otherwise hang the suite).
void within_deadline(const char* what, std::chrono::seconds deadline, const std::function<void()>& f) {
  std::promise<void> done;
  auto finished = done.get_future();
  std::thread runner = pinned_thread([&] {
    try {
      f();
      done.set_value();
    } catch (...) {
      done.set_exception(std::current_exception());
    }
  });
  if (finished.wait_for(deadline) != std::future_status::ready) {
    std::fprintf(stderr, "deadlock: %s did not finish within %lld s\n", what, static_cast<long long>(deadline.count()));
    std::fflush(stderr);
    std::abort();
  }
  runner.join();
  finished.get();
}

struct Observed {
  std::mutex mu;
  std::vector<RecomputeEvent> events;
};

/// Removes the observer when the test ends, also on failure.
struct ObserverScope {
  explicit ObserverScope(RecomputeObserver observer) { set_recompute_observer(std::move(observer)); }
  ~ObserverScope() { set_recompute_observer(nullptr); }
};

/// One checkpointed block and its graph.
struct Checkpointed {
  std::vector<CheckpointHandle> handles;
  at::Tensor x, y;
};

Checkpointed checkpointed(const std::vector<CheckpointFn>& fns, uint64_t seed) {
  at::manual_seed(seed);
  Checkpointed c;
  c.x = at::randn({2, 4, kDim}).requires_grad_(true);
  HandleCollector collect;
  c.y = c.x;
  for (const auto& fn : fns) c.y = checkpoint(fn, {c.y})[0];
  c.handles = collect.handles();
  return c;
}

// ---- user callbacks and the public API -------------------------------------------------

TEST(Concurrency, ObserverReadsStatsWhileAnotherThreadPrefiresTheCheckpointBeingRecomputed) {
  // Thread A lazily recomputes a checkpoint of session 300 in backward; its
  // observer reads session_stats(300). Thread B prefires the same checkpoint
  // meanwhile: it waits for A's recomputation and finds it resident.
  Block block(kDim, 0.1);
  std::atomic<int> runs{0};
  std::latch recomputing(1);
  CheckpointFn fn = [&](const TensorList& in) {
    if (runs++ > 0) {
      recomputing.count_down();
      std::this_thread::sleep_for(100ms);  // B enters prefire() and waits
    }
    return block.fn()(in);
  };
  auto c = checkpointed({fn}, 1);
  ASSERT_TRUE(attach(c.handles[0], 300));
  std::atomic<int64_t> lazy_seen{-1};
  ObserverScope observer([&](const RecomputeEvent& e) {
    if (e.kind == RecomputeEvent::Kind::kLazy) lazy_seen = session_stats(e.session).lazy_recomputes;
    runtime_stats();
  });
  PrefireStatus status = PrefireStatus::kExpired;
  within_deadline("lazy recompute + observer vs prefire of the same checkpoint", 30s, [&] {
    SessionScope scope(300, {true});
    std::thread b = pinned_thread([&] {
      recomputing.wait();
      status = prefire(c.handles[0], 300);
    });
    grads(c.y, {c.x});
    b.join();
  });
  EXPECT_EQ(status, PrefireStatus::kAlreadyResident);
  EXPECT_EQ(lazy_seen, 1) << "the observer ran before the session counted the recomputation";
  EXPECT_EQ(runs, 2);
  clear_session(300);
}

TEST(Concurrency, PrefireOfTheSameCheckpointFromItsObserverIsANoOp) {
  Block block(kDim, 0.1);
  auto c = checkpointed({block.fn()}, 2);
  std::vector<PrefireStatus> inner;
  ObserverScope observer([&](const RecomputeEvent& e) {
    if (e.kind == RecomputeEvent::Kind::kPrefire) inner.push_back(prefire(c.handles[0], 301));
  });
  within_deadline("prefire from the observer of the same prefire", 30s, [&] {
    EXPECT_EQ(prefire(c.handles[0], 301), PrefireStatus::kRecomputed);
  });
  ASSERT_EQ(inner.size(), 1u);
  EXPECT_EQ(inner[0], PrefireStatus::kAlreadyResident);
  clear_session(301);
}

TEST(Concurrency, FunctionThatPrefiresItsOwnCheckpointRaisesInsteadOfWaitingForItself) {
  std::vector<CheckpointHandle> self;
  std::atomic<int> runs{0};
  CheckpointFn fn = [&](const TensorList& in) {
    if (runs++ > 0) prefire(self.at(0), 302);
    return TensorList{in[0].sin().cos()};
  };
  auto c = checkpointed({fn}, 3);
  self = c.handles;
  std::string message;
  within_deadline("a function prefiring its own checkpoint", 30s,
                  [&] { message = message_of([&] { prefire(c.handles[0], 302); }); });
  EXPECT_THAT(message, HasSubstr("needs its own result"));
  EXPECT_EQ(session_stats(302).checkpoints, 0) << "the failed prefire left its checkpoint registered";
  clear_session(302);
}

TEST(Concurrency, FunctionAndContextHooksMayCallThePublicApi) {
  Block a(kDim, 0.1), b(kDim, 0.1);
  std::vector<CheckpointHandle> handles;
  std::atomic<int> b_runs{0};
  std::vector<PrefireStatus> from_hook;
  CheckpointOptions options;
  options.context_fn.recompute = [&]() -> ContextGuard {
    session_stats(303);
    runtime_stats();
    if (b_runs > 0 && from_hook.empty()) from_hook.push_back(prefire(handles.at(0), 304));  // another checkpoint
    return nullptr;
  };
  CheckpointFn fa = [&](const TensorList& in) { return a.fn()(in); };
  CheckpointFn fb = [&](const TensorList& in) {
    if (b_runs++ > 0) session_stats(303);
    return b.fn()(in);
  };
  at::manual_seed(4);
  auto x = at::randn({2, 4, kDim}).requires_grad_(true);
  at::Tensor y;
  {
    HandleCollector collect;
    auto h = checkpoint(fa, {x})[0];
    y = checkpoint(fb, {h}, options)[0];
    handles = collect.handles();
  }
  within_deadline("callbacks calling the public API", 30s,
                  [&] { EXPECT_EQ(prefire(handles[1], 303), PrefireStatus::kRecomputed); });
  ASSERT_EQ(from_hook.size(), 1u);
  EXPECT_EQ(from_hook[0], PrefireStatus::kRecomputed);
  clear_session(303);
  clear_session(304);
}

// ---- budgets -----------------------------------------------------------------------------

TEST(Concurrency, ConcurrentPrefiresIntoOneSessionNeverExceedItsBudget) {
  constexpr int kThreads = 8, kAdmitted = 3;
  Block block(kDim, 0.0);
  CheckpointFn slow = [&](const TensorList& in) {
    if (detail::recomputing_on_this_thread()) std::this_thread::sleep_for(20ms);  // prefires overlap
    return block.fn()(in);
  };
  std::vector<Checkpointed> graphs;
  for (int t = 0; t < kThreads; ++t) graphs.push_back(checkpointed({slow}, 10 + t));
  prefire(graphs[0].handles[0], 305);
  const int64_t one = session_stats(305).current_bytes;
  clear_session(305);
  ASSERT_GT(one, 0);

  set_session_budget(306, kAdmitted * one);
  std::barrier start(kThreads);
  std::vector<PrefireStatus> status(kThreads);
  std::atomic<int64_t> max_seen{0};
  within_deadline("concurrent prefires into one budgeted session", 60s, [&] {
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.push_back(pinned_thread([&, t] {
        start.arrive_and_wait();
        status[t] = prefire(graphs[t].handles[0], 306);
        int64_t now = session_stats(306).current_bytes, seen = max_seen;
        while (now > seen && !max_seen.compare_exchange_weak(seen, now)) {
        }
      }));
    }
    for (auto& t : threads) t.join();
  });
  int admitted = 0, refused = 0;
  for (auto s : status) {
    admitted += s == PrefireStatus::kRecomputed;
    refused += s == PrefireStatus::kRefusedOverBudget;
  }
  auto stats = session_stats(306);
  EXPECT_EQ(admitted, kAdmitted);
  EXPECT_EQ(refused, kThreads - kAdmitted);
  EXPECT_LE(stats.peak_bytes, kAdmitted * one) << "the session went over its budget";
  EXPECT_LE(max_seen, kAdmitted * one);
  EXPECT_EQ(stats.refused_prefires, kThreads - kAdmitted);
  clear_session(306);
  set_session_budget(306, std::nullopt);
}

// ---- clear_session during a backward -------------------------------------------------------

TEST(Concurrency, ClearSessionDuringABackwardOfItOnAnotherThreadDefersTheRelease) {
  // The W pass runs on another thread; the scope's thread closes the scope and
  // clears the session while W is inside a recomputation of the session.
  Block first(kDim, 0.1), second(kDim, 0.1);
  at::manual_seed(20);
  auto x = at::randn({2, 4, kDim}).requires_grad_(true);
  at::manual_seed(21);
  auto expected = grads(second.forward(first.forward(x)), concat({x}, concat(first.params(), second.params())));

  std::latch inside(1), cleared(1);
  std::atomic<int> second_runs{0};
  CheckpointFn f1 = first.fn();
  CheckpointFn f2 = [&](const TensorList& in) {
    if (second_runs++ == 1) {  // the first recomputation: the W pass's, on the worker
      inside.count_down();
      cleared.wait();
    }
    return second.fn()(in);
  };
  at::manual_seed(21);
  std::vector<CheckpointHandle> handles;
  at::Tensor y;
  {
    HandleCollector collect;
    y = checkpoint(f2, {checkpoint(f1, {x})[0]})[0];
    handles = collect.handles();
  }
  for (const auto& h : handles) attach(h, 307);
  TensorList actual;
  within_deadline("clear_session during a backward of the session", 30s, [&] {
    std::optional<SessionScope> scope;
    scope.emplace(307, SessionOptions{true});
    std::thread w = pinned_thread([&] { actual = grads(y, concat({x}, concat(first.params(), second.params()))); });
    inside.wait();
    scope.reset();
    clear_session(307);
    EXPECT_EQ(session_stats(307).checkpoints, 0);
    cleared.count_down();
    w.join();
  });
  expect_all_equal(actual, expected);
  EXPECT_EQ(runtime_stats().recomputed_bytes, 0) << "memory of the cleared session outlived the backward";
}

TEST(Concurrency, ClearSessionRacingBackwardsOnOtherThreadsStaysCorrect) {
  Block a(kDim, 0.1), b(kDim, 0.1), d(kDim, 0.1);
  const TensorList params = concat(concat(a.params(), b.params()), d.params());
  within_deadline("clear_session racing backwards", 120s, [&] {
    for (int iteration = 0; iteration < 60; ++iteration) {
      at::manual_seed(30 + iteration);
      auto x = at::randn({2, 4, kDim}).requires_grad_(true);
      at::manual_seed(1000 + iteration);
      auto expected = grads(d.forward(b.forward(a.forward(x))), concat({x}, params));
      at::manual_seed(1000 + iteration);
      std::vector<CheckpointHandle> handles;
      at::Tensor y;
      {
        HandleCollector collect;
        y = checkpoint(d.fn(), {checkpoint(b.fn(), {checkpoint(a.fn(), {x})[0]})[0]})[0];
        handles = collect.handles();
      }
      for (size_t i = 0; i < handles.size(); ++i) {
        if (iteration % 2 == 0 || i == 0) prefire(handles[i], 308);
        else attach(handles[i], 308);
      }
      TensorList actual;
      std::latch started(1);
      std::optional<SessionScope> scope;
      scope.emplace(308, SessionOptions{iteration % 3 != 0});
      std::thread w = pinned_thread([&] {
        started.count_down();
        actual = grads(y, concat({x}, params));
      });
      started.wait();
      if (iteration % 4 == 1) std::this_thread::sleep_for(std::chrono::microseconds(200 * (iteration % 7)));
      scope.reset();
      clear_session(308);
      w.join();
      expect_all_equal(actual, expected);
      EXPECT_EQ(runtime_stats().recomputed_bytes, 0);
    }
  });
}

// ---- generators -------------------------------------------------------------------------------

TEST(Concurrency, RecomputationsThatRestoreGeneratorsNeverInterleaveTheirDraws) {
  // A prefire of one micro-batch and the lazy (graph-task) recomputation of
  // another run at once, both drawing dropout masks from the CPU generator.
  constexpr int64_t kWide = 64;
  Block p1(kWide, 0.5), p2(kWide, 0.5);
  const TensorList params = concat(p1.params(), p2.params());
  auto forward = [&](const at::Tensor& x, bool ckpt) {
    return ckpt ? checkpoint(p2.fn(), {checkpoint(p1.fn(), {x})[0]})[0] : p2.forward(p1.forward(x));
  };
  within_deadline("generator-restoring recomputations on two threads", 120s, [&] {
    for (int round = 0; round < 20; ++round) {
      at::manual_seed(50 + round);
      auto xa = at::randn({2, 32, kWide}).requires_grad_(true), xb = at::randn({2, 32, kWide}).requires_grad_(true);
      at::manual_seed(500 + round);
      auto ref_a = grads(forward(xa, false), concat({xa}, params));
      auto ref_b = grads(forward(xb, false), concat({xb}, params));
      at::manual_seed(500 + round);
      std::vector<CheckpointHandle> handles;
      at::Tensor ya, yb;
      {
        HandleCollector collect;
        ya = forward(xa, true);
        handles = collect.handles();
      }
      yb = forward(xb, true);
      TensorList got_a, got_b;
      std::barrier start(2);
      std::thread prefirer = pinned_thread([&] {
        start.arrive_and_wait();
        for (const auto& h : handles) prefire(h, 309);
        SessionScope s(309, {false});
        got_a = grads(ya, concat({xa}, params));
      });
      std::thread lazy = pinned_thread([&] {
        start.arrive_and_wait();
        got_b = grads(yb, concat({xb}, params));
      });
      prefirer.join();
      lazy.join();
      clear_session(309);
      expect_all_equal(got_a, ref_a);
      expect_all_equal(got_b, ref_b);
      if (::testing::Test::HasFailure()) {
        ADD_FAILURE() << "round " << round << ": masks differ";
        return;
      }
    }
  });
}

TEST(Concurrency, RecomputationsOfDrawFreeFunctionsNeitherRestoreNorWaitForGenerators) {
  // Note [Generator snapshots]: a checkpoint whose forward drew no random
  // numbers restores no generator when recomputed, so it does not wait for
  // the generator lock that a recomputation drawing dropout masks holds.
  auto xa = at::randn({8, 16}).requires_grad_(true), xb = at::randn({8, 16}).requires_grad_(true);
  std::atomic<int> runs_a{0};
  std::latch a_recomputing(1), release_a(1);
  CheckpointFn draws = [&](const TensorList& in) {
    auto out = at::dropout(in[0].sin(), 0.5, /*train=*/true);
    if (runs_a.fetch_add(1) == 1) {  // the recomputation: hold the generator lock until told
      a_recomputing.count_down();
      release_a.wait();
    }
    return TensorList{out};
  };
  CheckpointFn draw_free = [](const TensorList& in) { return TensorList{in[0].sin().exp()}; };
  at::manual_seed(31);
  auto ya = checkpoint(draws, {xa})[0];
  auto yb = checkpoint(draw_free, {xb})[0];
  const auto expected_b = grads(draw_free({xb})[0], {xb});
  TensorList got_b;
  within_deadline("a draw-free recomputation while a dropout recomputation holds the generators", 60s, [&] {
    std::thread a = pinned_thread([&] { grads(ya, {xa}); });
    a_recomputing.wait();
    const auto state_before_b = cpu_rng_state();
    got_b = grads(yb, {xb});  // waits forever if it takes the generator lock
    EXPECT_TRUE(at::equal(cpu_rng_state(), state_before_b));
    release_a.count_down();
    a.join();
  });
  expect_all_equal(got_b, expected_b);
  EXPECT_EQ(runs_a.load(), 2);
}

// ---- the session registry ------------------------------------------------------------------

TEST(Concurrency, SessionRegistryStaysBoundedOverManyDistinctIds) {
  auto x = at::randn({4}).requires_grad_(true);
  CheckpointFn fn = [](const TensorList& in) { return TensorList{in[0].sin()}; };
  const size_t before = detail::session_registry_size();
  size_t largest = 0;
  for (SessionId id = 1'000'000; id < 1'100'000; ++id) {
    at::Tensor y;
    std::vector<CheckpointHandle> handles;
    {
      HandleCollector collect;
      y = checkpoint(fn, {x})[0];
      handles = collect.handles();
    }
    attach(handles[0], id);
    if (id % 10 == 0) {  // a few go through a whole pass and a clear
      { SessionScope s(id, {false}); grads(y, {x}); }
      clear_session(id);
    }
    if (id % 1000 == 0) largest = std::max(largest, detail::session_registry_size());
  }  // the others' graphs are freed without a clear
  EXPECT_LE(largest, before + 2 * 64 + 1) << "sessions that hold nothing stay in the registry";
}

/// One collected checkpoint of `fn` on `x`: its output and its handle.
std::pair<at::Tensor, CheckpointHandle> collected(const CheckpointFn& fn, const at::Tensor& x) {
  HandleCollector collect;
  at::Tensor y = checkpoint(fn, {x})[0];
  return {y, collect.handles().at(0)};
}

TEST(Concurrency, ASessionClearedWhileItsPrefireRunsLeavesTheRegistryWhenThePrefireEnds) {
  const SessionId id = 2'000'000;
  bool clear_inside = false;
  CheckpointFn fn = [&](const TensorList& in) {
    if (clear_inside) clear_session(id);  // what another thread may do while the prefire runs
    return TensorList{in[0].sin().cos()};  // cos saves what sin computed: the prefire has a charge
  };
  auto x = at::randn({4}).requires_grad_(true);
  auto [y, handle] = collected(fn, x);
  const std::vector<CheckpointHandle> handles{handle};
  const size_t before = detail::session_registry_size();
  clear_inside = true;
  EXPECT_EQ(prefire(handles[0], id), PrefireStatus::kRecomputed);
  clear_inside = false;
  EXPECT_EQ(detail::session_registry_size(), before) << "the cleared session stayed registered";
  expect_all_equal(grads(y, {x}), grads(x.sin().cos(), {x}));  // lazily, as after any clear
}

TEST(Concurrency, ABudgetedSessionEndsWhenClearedAndItsBudgetStaysWithTheId) {
  CheckpointFn fn = [](const TensorList& in) { return TensorList{in[0].sin().cos()}; };  // a charge: cos saves sin's
  auto x = at::randn({4}).requires_grad_(true);
  auto [y, handle] = collected(fn, x);
  const std::vector<CheckpointHandle> handles{handle};
  const size_t before = detail::session_registry_size();
  for (SessionId id = 2'100'000; id < 2'101'000; ++id) {  // what a pipeline does per micro-batch and step
    set_session_budget(id, 0);
    EXPECT_EQ(prefire(handles[0], id), PrefireStatus::kRefusedOverBudget);
    clear_session(id);
  }
  EXPECT_EQ(detail::session_registry_size(), before) << "cleared budgeted sessions stayed registered";
  const SessionId id = 2'100'000;
  EXPECT_EQ(session_stats(id).budget_bytes, 0) << "the budget belongs to the id";
  EXPECT_EQ(session_stats(id).refused_prefires, 0) << "the session's counters ended with it";
  EXPECT_EQ(prefire(handles[0], id), PrefireStatus::kRefusedOverBudget) << "the id's next session has the budget";
  clear_session(id);
  for (SessionId other = 2'100'000; other < 2'101'000; ++other) set_session_budget(other, std::nullopt);
  EXPECT_FALSE(session_stats(id).budget_bytes.has_value());
  EXPECT_EQ(prefire(handles[0], id), PrefireStatus::kRecomputed);
  clear_session(id);
  EXPECT_EQ(detail::session_registry_size(), before);
  expect_all_equal(grads(y, {x}), grads(x.sin().cos(), {x}));
}

// ---- a stress of the public API ---------------------------------------------------------------

int stress_iterations() {
  const char* env = std::getenv("PREFIRE_STRESS_ITERATIONS");
  return env != nullptr ? std::max(1, std::atoi(env)) : 12;
}

TEST(Concurrency, PublicApiStress) {
  // Threads run micro-batches through forward, prefire or attach, B and W
  // (sometimes on another thread), stats polling and clear, with an observer
  // that calls back into the API, while a poller reads every session.
  constexpr int kThreads = 4;
  const int iterations = stress_iterations();
  std::vector<Block> blocks;
  for (int i = 0; i < 3; ++i) blocks.emplace_back(kDim, 0.1);
  TensorList params;
  for (const auto& blk : blocks) params = concat(params, blk.params());
  std::atomic<int64_t> observed{0};
  ObserverScope observer([&](const RecomputeEvent& e) {
    if (e.session >= 0) session_stats(e.session);
    runtime_stats();
    ++observed;
  });
  std::atomic<bool> stop{false};
  within_deadline("public API stress", 600s, [&] {
    std::thread poller = pinned_thread([&] {
      while (!stop) {
        for (SessionId id = 400; id < 400 + kThreads; ++id) session_stats(id);
        runtime_stats();
        std::this_thread::yield();
      }
    });
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.push_back(pinned_thread([&, t] {
        const SessionId id = 400 + t;
        for (int it = 0; it < iterations; ++it) {
          const uint64_t seed = 7000 + 100 * t + it;
          at::Tensor x, gy, y;
          TensorList ref_dx, ref_dw;
          std::vector<CheckpointHandle> handles;
          {
            // Forward and reference hold the lock recomputations restoring
            // generators hold: forward draws racing them are the user's
            // business (checkpoint.h), and this test makes them not race.
            auto generators = detail::lock_generators();
            at::manual_seed(seed);
            x = at::randn({2, 4, kDim}).requires_grad_(true);
            gy = at::randn({2, 4, kDim});
            at::manual_seed(seed + 1);
            at::Tensor h = x;
            for (const auto& blk : blocks) h = blk.forward(h);
            ref_dx = torch::autograd::grad({h}, {x}, {gy}, true);
            ref_dw = torch::autograd::grad({h}, params, {gy});
            at::manual_seed(seed + 1);
            HandleCollector collect;
            y = x;
            for (const auto& blk : blocks) y = checkpoint(blk.fn(), {y})[0];
            handles = collect.handles();
          }
          for (size_t i = 0; i < handles.size(); ++i) {
            if ((it + i) % 3 == 0) attach(handles[i], id);
            else prefire(handles[i], id);
          }
          TensorList dx, dw;
          {
            SessionScope s(id, {true});
            dx = torch::autograd::grad({y}, {x}, {gy}, true);
          }
          session_stats(id);
          {
            SessionScope s(id, {false});
            if (it % 2 == 0) {
              pinned_thread([&] { dw = torch::autograd::grad({y}, params, {gy}); }).join();
            } else {
              dw = torch::autograd::grad({y}, params, {gy});
            }
          }
          clear_session(id);
          clear_session(id);
          expect_all_equal(dx, ref_dx);
          expect_all_equal(dw, ref_dw);
        }
      }));
    }
    for (auto& t : threads) t.join();
    stop = true;
    poller.join();
  });
  EXPECT_GT(observed, 0);
  EXPECT_EQ(runtime_stats().recomputed_bytes, 0);
}

}  // namespace
}  // namespace prefire::testing
