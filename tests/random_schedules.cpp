// A property test: schedules drawn from a seed run against the unchecked
// model. Each schedule has 1-6 micro-batches of a stage of 1-4 blocks whose
// checkpoints nest 0-2 levels deep; its operations (forward, prefire, attach,
// B, W, clear) interleave at random across micro-batches, with random retain
// flags, budgets, scopes or none, B and W as two autograd passes or as a
// split backward (backward_input, WeightPass), on random threads, and
// failures injected into recomputations of prefire and B. Some schedules add
// an auxiliary head on the activation after the first checkpoint, run
// between B and W; some hook that activation (a counting register_hook);
// some run split W passes accumulating into the parameters' grad(), two
// micro-batches' passes at once on two threads. For every schedule:
//   * dx and dw of every micro-batch equal the unchecked model's bit for bit,
//     and so do the auxiliary head's gradients (with two passes) or it raises
//     naming backward_input (after a split B: Note [Backward through what B
//     consumed raises]); grad() after accumulating W passes is the sum of
//     their unchecked gradients;
//   * the hook runs as often as the passes imply (once for B and W together
//     in a split backward, as in one plain backward);
//   * recomputations per micro-batch equal what the schedule implies (a model
//     of which checkpoints each pass finds resident in its session), or stay
//     within bounds where an injected failure makes the count depend on where
//     it struck;
//   * after the last clear and the graphs' release, prefire holds no bytes;
//   * nothing crashes, and a watchdog turns a hang into a failure.
// A failure prints the schedule's seed and its operations; --seed S
// --schedules 1 replays it.
//
//   prefire_random_schedules [--schedules N] [--seed S] [--soak SECONDS] [--verbose]

#include "test_support.h"

#include "checkpoint/frame.h"

#include <prefire/split_backward.h>

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

namespace prefire::testing {
namespace {

struct InjectedFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// A schedule's checkpoint structure: nodes over contiguous block ranges.
struct Node {
  size_t begin, end;              // blocks
  std::vector<size_t> children;   // nested checkpoints, in order; empty: the blocks run plainly
};

struct Model {
  int64_t dim = 8, batch = 2, seq = 3;
  std::vector<Block> blocks;
  std::vector<Node> nodes;
  std::vector<size_t> top;          // top-level checkpoints, in order
  std::vector<std::pair<size_t, size_t>> plain_ranges;  // block ranges run without a checkpoint, by position
  std::vector<int> order;           // >= 0: top-level checkpoint index; < 0: plain range -(i+1)
  CheckpointOptions options;
  std::atomic<int>* armed = nullptr;  // > 0: the next recomputation fails

  TensorList params() const {
    TensorList all;
    for (const auto& b : blocks) all = concat(all, b.params());
    return all;
  }

  int subtree_size(size_t node) const {
    int n = 1;
    for (size_t c : nodes[node].children) n += subtree_size(c);
    return n;
  }

  at::Tensor run_blocks(size_t begin, size_t end, at::Tensor x) const {
    for (size_t i = begin; i < end; ++i) x = blocks[i].forward(x);
    return x;
  }

  at::Tensor run_node(size_t n, at::Tensor x) const {
    CheckpointFn fn = [this, n](const TensorList& in) {
      if (detail::recomputing_on_this_thread() && armed != nullptr) {
        int expected = 1;
        if (armed->compare_exchange_strong(expected, 0)) throw InjectedFailure("injected failure in a recomputation");
      }
      const Node& node = nodes[n];
      if (node.children.empty()) return TensorList{run_blocks(node.begin, node.end, in[0])};
      at::Tensor h = in[0];
      for (size_t c : node.children) h = run_node(c, h);
      return TensorList{h};
    };
    return checkpoint(fn, {x}, options)[0];
  }

  /// Whether the model has an activation to tap: one after the first item, before the last.
  bool tappable() const { return order.size() >= 2; }

  /// `tap`, when given and tappable(), receives the activation after the first item.
  at::Tensor forward(at::Tensor x, bool checkpointed, at::Tensor* tap = nullptr) const {
    for (size_t i = 0; i < order.size(); ++i) {
      const int item = order[i];
      if (item < 0) {
        auto [b, e] = plain_ranges[-item - 1];
        x = run_blocks(b, e, x);
      } else {
        const Node& node = nodes[top[item]];
        x = checkpointed ? run_node(top[item], x) : run_blocks(node.begin, node.end, x);
      }
      if (i == 0 && tap != nullptr && tappable()) *tap = x;
    }
    return x;
  }

  /// Checkpoints recomputed by a backward through the tapped activation alone.
  int before_tap() const { return order[0] >= 0 ? subtree_size(top[order[0]]) : 0; }
};

size_t build_node(Model& m, std::mt19937_64& rng, size_t begin, size_t end, int depth) {
  const size_t index = m.nodes.size();
  m.nodes.push_back(Node{begin, end, {}});
  if (depth == 0) return index;
  // Split the range into 1 or 2 nested checkpoints.
  std::vector<std::pair<size_t, size_t>> parts;
  if (end - begin >= 2 && rng() % 2 == 0) {
    const size_t mid = begin + 1 + rng() % (end - begin - 1);
    parts = {{begin, mid}, {mid, end}};
  } else {
    parts = {{begin, end}};
  }
  for (auto [b, e] : parts) {
    const size_t child = build_node(m, rng, b, e, depth - 1);
    m.nodes[index].children.push_back(child);
  }
  return index;
}

enum class Op { kForward, kPrefire, kAttach, kB, kAux, kW, kClear };

struct Step {
  Op op;
  int mb;
};

struct Plan {
  int micro_batches;
  std::vector<Step> steps;
  std::vector<std::optional<int64_t>> budget;  // bytes, per micro-batch session
  std::vector<bool> b_scoped, w_scoped, w_retain, b_thread, w_thread, split;
  std::optional<std::pair<Op, int>> inject;  // the first recomputation of this op fails
  bool hooked = false;      // a counting hook on the tapped activation
  bool accumulate = false;  // split W passes accumulate into grad(), two at once where two are due
};

const char* name(Op op) {
  switch (op) {
    case Op::kForward: return "F";
    case Op::kPrefire: return "P";
    case Op::kAttach: return "A";
    case Op::kB: return "B";
    case Op::kAux: return "X";
    case Op::kW: return "W";
    case Op::kClear: return "C";
  }
  return "?";
}

std::string describe(const Model& m, const Plan& p) {
  std::ostringstream out;
  out << p.micro_batches << " micro-batches, " << m.blocks.size() << " blocks, " << m.nodes.size()
      << " checkpoints (early_stop " << m.options.early_stop << ", check " << to_string(m.options.determinism_check)
      << "), steps:";
  for (const auto& s : p.steps) out << ' ' << name(s.op) << s.mb;
  for (int mb = 0; mb < p.micro_batches; ++mb) {
    out << "\n  mb " << mb << ": budget " << (p.budget[mb] ? std::to_string(*p.budget[mb]) : "none") << ", B "
        << (p.b_scoped[mb] ? "scoped" : "unscoped") << (p.b_thread[mb] ? " on a thread" : "") << ", W "
        << (p.w_scoped[mb] ? (p.w_retain[mb] ? "scoped retain" : "scoped release") : "unscoped")
        << (p.w_thread[mb] ? " on a thread" : "") << (p.split[mb] ? ", split backward" : "");
  }
  if (p.inject) out << "\n  failure injected into " << name(p.inject->first) << p.inject->second;
  if (p.hooked) out << "\n  the tapped activation is hooked";
  if (p.accumulate) out << "\n  split W passes accumulate into grad()";
  return out.str();
}

Model make_model(std::mt19937_64& rng) {
  Model m;
  const int num_blocks = 1 + rng() % 4;
  const int depth = rng() % 3;
  const double dropout = rng() % 2 == 0 ? 0.0 : 0.2;
  for (int i = 0; i < num_blocks; ++i) m.blocks.emplace_back(m.dim, dropout);
  for (size_t begin = 0; begin < m.blocks.size();) {
    const size_t end = std::min(m.blocks.size(), begin + 1 + rng() % 2);
    if (rng() % 5 == 0) {
      m.plain_ranges.emplace_back(begin, end);
      m.order.push_back(-static_cast<int>(m.plain_ranges.size()));
    } else {
      m.top.push_back(build_node(m, rng, begin, end, depth));
      m.order.push_back(static_cast<int>(m.top.size()) - 1);
    }
    begin = end;
  }
  m.options.early_stop = rng() % 4 != 0;
  const DeterminismCheck checks[] = {DeterminismCheck::kMetadata, DeterminismCheck::kNone, DeterminismCheck::kChecksum};
  m.options.determinism_check = checks[rng() % 3];
  return m;
}

// `extra` draws what later versions added (auxiliary heads, hooks,
// accumulating W passes), so that `rng` draws the same schedules as before.
Plan make_plan(std::mt19937_64& rng, std::mt19937_64& extra, bool tappable) {
  Plan p;
  p.micro_batches = 1 + rng() % 6;
  const int mbs = p.micro_batches;
  auto coin = [&](int one_in) { return rng() % one_in == 0; };
  std::vector<std::vector<Op>> per_mb(mbs);
  for (int mb = 0; mb < mbs; ++mb) {
    std::vector<Op> ops{Op::kForward};
    const int schedule_kind = rng() % 3;  // prefire, attach, neither
    std::vector<Op> middle{Op::kB};
    if (schedule_kind < 2) {
      const Op reg = schedule_kind == 0 ? Op::kPrefire : Op::kAttach;
      middle.insert(coin(4) ? middle.end() : middle.begin(), reg);  // mostly before B
    }
    ops.insert(ops.end(), middle.begin(), middle.end());
    if (tappable && extra() % 3 == 0) ops.push_back(Op::kAux);
    ops.push_back(Op::kW);
    if (coin(4)) ops.insert(ops.begin() + 1 + rng() % (ops.size() - 1), Op::kClear);  // an early clear
    ops.push_back(Op::kClear);
    per_mb[mb] = ops;
    p.budget.push_back(coin(3) ? std::optional<int64_t>(int64_t(1) << (8 + rng() % 8)) : std::nullopt);
    p.b_scoped.push_back(!coin(5));
    p.w_scoped.push_back(!coin(5));
    p.w_retain.push_back(coin(2));
    p.b_thread.push_back(coin(3));
    p.w_thread.push_back(coin(3));
    p.split.push_back(coin(2));
  }
  // A random interleaving that keeps each micro-batch's order.
  std::vector<size_t> next(mbs, 0);
  for (;;) {
    std::vector<int> ready;
    for (int mb = 0; mb < mbs; ++mb) {
      if (next[mb] < per_mb[mb].size()) ready.push_back(mb);
    }
    if (ready.empty()) break;
    const int mb = ready[rng() % ready.size()];
    p.steps.push_back({per_mb[mb][next[mb]++], mb});
  }
  p.hooked = tappable && extra() % 2 == 0;
  p.accumulate = extra() % 3 == 0;
  if (coin(5)) {
    std::vector<Step> candidates;
    for (const auto& s : p.steps) {
      if (s.op == Op::kPrefire || s.op == Op::kB) candidates.push_back(s);
    }
    if (!candidates.empty()) {
      const auto& s = candidates[rng() % candidates.size()];
      p.inject = std::make_pair(s.op, s.mb);
    }
  }
  return p;
}

/// What the schedule implies for one micro-batch's checkpoints: registered to
/// its session, and resident there. Driven by the statuses prefire returns.
struct Residency {
  std::vector<bool> registered, resident;  // by top-level checkpoint
  bool exact = true;                       // false once a failure struck this micro-batch
};

struct MicroBatch {
  at::Tensor x, gy, y;
  at::Tensor gaux, aux;  // the auxiliary head's seed and loss (aux: undefined without one)
  TensorList daux_ref;   // its unchecked gradients: dx, then dw
  WeightPass weight_pass;  // split backward: made by B, run by W
  TensorList dx_ref, dw_ref, dx, dw;
  std::vector<CheckpointHandle> handles;  // one per top-level checkpoint, in order
  Residency state;
  int64_t recomputations = 0, expected = 0, bound = 0;  // bound: the most allowed when not exact
  int hook_calls = 0, expected_hook_calls = 0;
};

/// Runs `f` on a new pinned thread or here.
void on_thread(bool thread, const std::function<void()>& f) {
  if (!thread) return f();
  std::exception_ptr error;
  pinned_thread([&] {
    try {
      f();
    } catch (...) {
      error = std::current_exception();
    }
  }).join();
  if (error) std::rethrow_exception(error);
}

/// Runs one schedule; returns an empty string or what went wrong.
std::string run_schedule(uint64_t seed, bool verbose) {
  std::mt19937_64 rng(seed);
  std::mt19937_64 extra(seed ^ 0x9e3779b97f4a7c15ULL);
  Model model = make_model(rng);
  Plan plan = make_plan(rng, extra, model.tappable());
  if (verbose) std::printf("seed %llu: %s\n", static_cast<unsigned long long>(seed), describe(model, plan).c_str());
  std::atomic<int> armed{0};
  model.armed = &armed;
  const TensorList params = model.params();
  const SessionId session_base = 1'000'000'000 + static_cast<SessionId>(seed % 100'000'000) * 8;
  auto session = [&](int mb) { return session_base + mb; };
  std::ostringstream failures;
  auto fail = [&](const std::string& what) { failures << what << "\n"; };

  std::vector<MicroBatch> mbs(plan.micro_batches);
  for (int i = 0; i < plan.micro_batches; ++i) {
    MicroBatch& mb = mbs[i];
    at::manual_seed(seed * 31 + i);
    mb.x = at::randn({model.batch, model.seq, model.dim}).requires_grad_(true);
    mb.gy = at::randn({model.batch, model.seq, model.dim});
    mb.gaux = at::randn({model.batch, model.seq, model.dim});
    at::manual_seed(seed * 31 + 1000 + i);
    at::Tensor tap;
    at::Tensor y = model.forward(mb.x, /*checkpointed=*/false, &tap);
    if (tap.defined()) {
      mb.daux_ref = torch::autograd::grad({(tap * mb.gaux).sum()}, concat({mb.x}, params), {}, true, false, true);
    }
    mb.dx_ref = torch::autograd::grad({y}, {mb.x}, {mb.gy}, true);
    mb.dw_ref = torch::autograd::grad({y}, params, {mb.gy}, false, false, true);
    mb.state.registered.assign(model.top.size(), false);
    mb.state.resident.assign(model.top.size(), false);
    if (plan.budget[i]) set_session_budget(session(i), *plan.budget[i]);
  }

  int total_checkpoints = 0;
  for (size_t t : model.top) total_checkpoints += model.subtree_size(t);
  auto size_of = [&](size_t top_index) { return model.subtree_size(model.top[top_index]); };

  // A pass recomputes every checkpoint its scope does not find resident, once.
  auto implied_by_pass = [&](MicroBatch& mb, bool scoped) {
    int64_t implied = 0;
    for (size_t t = 0; t < model.top.size(); ++t) {
      const bool served = scoped && mb.state.registered[t];
      if (!(served && mb.state.resident[t])) implied += size_of(t);
      if (served) mb.state.resident[t] = true;
    }
    return implied;
  };
  auto pass = [&](MicroBatch& mb, bool scoped, int64_t count) {
    mb.expected += implied_by_pass(mb, scoped);
    mb.bound += total_checkpoints;
    mb.recomputations += count;
  };
  // One W pass of micro-batch `i`; `accumulate`: into grad() too.
  auto run_w = [&](int i, bool accumulate) {
    MicroBatch& mb = mbs[i];
    std::optional<SessionScope> scope;
    if (plan.w_scoped[i]) scope.emplace(session(i), SessionOptions{plan.w_retain[i]});
    mb.dw = plan.split[i] ? mb.weight_pass.run(accumulate)
                          : torch::autograd::grad({mb.y}, params, {mb.gy}, false, false, true);
  };
  // The tapped activation's hook runs in every pass through it but W after
  // a split B, which ran it (Note [Hooks run once across B and W]).
  auto hook_runs = [&](MicroBatch& mb) {
    if (plan.hooked) ++mb.expected_hook_calls;
  };

  std::vector<bool> done(plan.steps.size(), false);  // a W run early, beside another's
  for (size_t index = 0; index < plan.steps.size(); ++index) {
    if (done[index]) continue;
    const Step& step = plan.steps[index];
    MicroBatch& mb = mbs[step.mb];
    const bool inject = plan.inject && plan.inject->first == step.op && plan.inject->second == step.mb;
    armed = inject ? 1 : 0;
    const int64_t before = runtime_stats().recomputations;
    auto recomputed = [&] { return runtime_stats().recomputations - before; };
    switch (step.op) {
      case Op::kForward: {
        at::manual_seed(seed * 31 + 1000 + step.mb);
        HandleCollector collect;
        at::Tensor tap;
        mb.y = model.forward(mb.x, /*checkpointed=*/true, &tap);
        mb.handles = collect.handles();
        if (tap.defined()) {
          mb.aux = (tap * mb.gaux).sum();
          if (plan.hooked) tap.register_hook([&mb](const at::Tensor&) { ++mb.hook_calls; });
        }
        if (mb.handles.size() != model.top.size()) fail("the collector gathered other than the outermost checkpoints");
        break;
      }
      case Op::kPrefire:
      case Op::kAttach: {
        for (size_t t = 0; t < mb.handles.size(); ++t) {
          if (step.op == Op::kAttach) {
            attach(mb.handles[t], session(step.mb));
            mb.state.registered[t] = true;
            continue;
          }
          const int64_t registered_before = session_stats(session(step.mb)).checkpoints;
          try {
            const PrefireStatus status = prefire(mb.handles[t], session(step.mb));
            if (status == PrefireStatus::kRecomputed) {
              if (mb.state.resident[t]) fail("prefire recomputed a resident checkpoint");
              mb.state.registered[t] = mb.state.resident[t] = true;
              mb.expected += size_of(t);
            } else if (status == PrefireStatus::kAlreadyResident) {
              if (!mb.state.resident[t]) fail("prefire called a checkpoint resident that the schedule never made so");
            } else if (status != PrefireStatus::kRefusedOverBudget) {
              fail(std::string("prefire returned ") + to_string(status));
            }
          } catch (const InjectedFailure&) {
            mb.state.exact = false;
            if (session_stats(session(step.mb)).checkpoints != registered_before) {
              fail("a failing prefire left checkpoints registered");
            }
          }
          mb.bound += size_of(t);
        }
        mb.recomputations += recomputed();
        break;
      }
      case Op::kB: {
        const bool scoped = plan.b_scoped[step.mb];
        for (int attempt = 0; attempt < 2; ++attempt) {
          hook_runs(mb);
          try {
            std::optional<SessionScope> scope;
            if (scoped) scope.emplace(session(step.mb), SessionOptions{/*retain_on_unpack=*/true});
            on_thread(plan.b_thread[step.mb], [&] {
              if (plan.split[step.mb]) {
                SplitBackward split = backward_input({mb.y}, {mb.gy}, {mb.x}, params);
                mb.dx = std::move(split.input_grads);
                mb.weight_pass = std::move(split.weight_pass);
              } else {
                mb.dx = torch::autograd::grad({mb.y}, {mb.x}, {mb.gy}, /*retain_graph=*/true);
              }
            });
            break;
          } catch (const InjectedFailure&) {
            mb.state.exact = false;
            mb.bound += total_checkpoints;
          }
        }
        pass(mb, scoped, recomputed());
        break;
      }
      case Op::kAux: {
        // Unscoped: recomputes the checkpoints before the tap per graph task.
        // After a split B it must raise before it runs a node of the input part.
        hook_runs(mb);
        try {
          TensorList got = torch::autograd::grad({mb.aux}, concat({mb.x}, params), {}, /*retain_graph=*/true,
                                                 false, /*allow_unused=*/true);
          if (plan.split[step.mb]) {
            fail("micro-batch " + std::to_string(step.mb) + ": an auxiliary head through what a split B consumed ran");
          }
          for (size_t g = 0; g < got.size(); ++g) {
            const at::Tensor& want = mb.daux_ref[g];
            if (got[g].defined() != want.defined() || (want.defined() && !at::equal(got[g], want))) {
              fail("micro-batch " + std::to_string(step.mb) + ": auxiliary head gradient " + std::to_string(g) +
                   " differs from the unchecked model's");
              break;
            }
          }
          mb.expected += model.before_tap();
        } catch (const std::exception& e) {
          if (!plan.split[step.mb] || std::string(e.what()).find("backward_input") == std::string::npos) {
            fail("micro-batch " + std::to_string(step.mb) + ": the auxiliary head raised: " + e.what());
          }
        }
        mb.bound += total_checkpoints;
        mb.recomputations += recomputed();
        break;
      }
      case Op::kW: {
        const int i = step.mb;
        const bool accumulate = plan.accumulate && plan.split[i];
        // With accumulate, another split micro-batch whose next step is its W runs it now, beside this one.
        std::optional<int> partner;
        for (size_t later = index + 1; accumulate && later < plan.steps.size() && !partner; ++later) {
          const Step& s = plan.steps[later];
          if (done[later] || s.mb == i || !plan.split[s.mb]) continue;
          bool next_of_its_mb = true;
          for (size_t k = index + 1; k < later; ++k) next_of_its_mb = next_of_its_mb && plan.steps[k].mb != s.mb;
          if (next_of_its_mb && s.op == Op::kW) {
            partner = s.mb;
            done[later] = true;
          }
        }
        if (accumulate) {
          for (const auto& p : params) p.mutable_grad() = at::Tensor();
        }
        if (partner) {
          // Two W passes at once, each on a thread of its own (a thread opens one SessionScope at a time).
          std::exception_ptr errors[2];
          std::thread threads[2];
          const int both[2] = {i, *partner};
          for (int t = 0; t < 2; ++t) {
            threads[t] = pinned_thread([&, t] {
              try {
                run_w(both[t], /*accumulate=*/true);
              } catch (...) {
                errors[t] = std::current_exception();
              }
            });
          }
          for (auto& thread : threads) thread.join();
          for (const auto& error : errors) {
            if (error) std::rethrow_exception(error);
          }
        } else {
          on_thread(plan.w_thread[i], [&] { run_w(i, accumulate); });
        }
        // The recomputations of both passes count for this micro-batch.
        mb.expected += implied_by_pass(mb, plan.w_scoped[i]);
        mb.bound += total_checkpoints;
        if (partner) {
          MicroBatch& other = mbs[*partner];
          mb.expected += implied_by_pass(other, plan.w_scoped[*partner]);
          mb.bound += total_checkpoints;
          mb.state.exact = mb.state.exact && other.state.exact;
          other.y.reset();
          other.aux.reset();
        }
        mb.recomputations += recomputed();
        if (!plan.split[i]) hook_runs(mb);
        if (accumulate) {
          for (size_t g = 0; g < params.size(); ++g) {
            at::Tensor want = mb.dw_ref[g];
            if (partner) {
              const at::Tensor& more = mbs[*partner].dw_ref[g];
              want = !want.defined() ? more : more.defined() ? want + more : want;
            }
            const at::Tensor& got = params[g].grad();
            if (got.defined() != want.defined() || (want.defined() && !at::equal(got, want))) {
              fail("micro-batch " + std::to_string(i) + (partner ? " and " + std::to_string(*partner) : "") +
                   ": grad() of parameter " + std::to_string(g) + " after accumulating W passes is not the sum of "
                   "their unchecked gradients");
              break;
            }
          }
          for (const auto& p : params) p.mutable_grad() = at::Tensor();
        }
        mb.y.reset();  // the W pass freed the graph; nothing may still hold it
        mb.aux.reset();
        break;
      }
      case Op::kClear:
        clear_session(session(step.mb));
        mb.state.registered.assign(model.top.size(), false);
        mb.state.resident.assign(model.top.size(), false);
        break;
    }
  }

  for (int i = 0; i < plan.micro_batches; ++i) {
    MicroBatch& mb = mbs[i];
    if (plan.budget[i]) set_session_budget(session(i), std::nullopt);
    auto check = [&](const TensorList& got, const TensorList& want, const char* what) {
      if (got.size() != want.size()) return fail(std::string(what) + ": wrong number of gradients");
      for (size_t g = 0; g < got.size(); ++g) {
        if (got[g].defined() != want[g].defined() || (got[g].defined() && !at::equal(got[g], want[g]))) {
          return fail("micro-batch " + std::to_string(i) + ": " + what + " gradient " + std::to_string(g) +
                      " differs from the unchecked model's");
        }
      }
    };
    check(mb.dx, mb.dx_ref, "dx");
    check(mb.dw, mb.dw_ref, "dw");
    if (mb.state.exact && mb.recomputations != mb.expected) {
      fail("micro-batch " + std::to_string(i) + ": " + std::to_string(mb.recomputations) +
           " recomputations where the schedule implies " + std::to_string(mb.expected));
    }
    if (!mb.state.exact && mb.recomputations > mb.bound) {
      fail("micro-batch " + std::to_string(i) + ": " + std::to_string(mb.recomputations) +
           " recomputations, more than the bound " + std::to_string(mb.bound));
    }
    if (mb.state.exact && mb.hook_calls != mb.expected_hook_calls) {
      fail("micro-batch " + std::to_string(i) + ": the tapped activation's hook ran " + std::to_string(mb.hook_calls) +
           " times where the passes imply " + std::to_string(mb.expected_hook_calls));
    }
    if (session_stats(session(i)).current_bytes != 0) fail("a cleared session holds bytes");
  }
  mbs.clear();
  const RuntimeStats stats = runtime_stats();
  if (stats.recomputed_bytes != 0 || stats.held_bytes != 0) {
    fail("prefire holds " + std::to_string(stats.recomputed_bytes) + " recomputed bytes after every clear and release");
  }
  std::string result = failures.str();
  if (!result.empty()) result += describe(model, plan);
  return result;
}

/// Aborts with the seed when one schedule runs longer than `limit`.
class Watchdog {
 public:
  explicit Watchdog(std::chrono::seconds limit) : limit_(limit), thread_([this] { watch(); }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void start(uint64_t seed) {
    std::lock_guard<std::mutex> lock(mu_);
    seed_ = seed;
    ++generation_;
  }

 private:
  void watch() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!done_) {
      const uint64_t generation = generation_;
      if (cv_.wait_for(lock, limit_, [&] { return done_ || generation_ != generation; })) continue;
      std::fprintf(stderr, "random schedules: seed %llu ran longer than %lld s (a hang): replay with --seed %llu "
                   "--schedules 1 --verbose\n", static_cast<unsigned long long>(seed_),
                   static_cast<long long>(limit_.count()), static_cast<unsigned long long>(seed_));
      std::fflush(stderr);
      std::abort();
    }
  }

  const std::chrono::seconds limit_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  uint64_t seed_ = 0, generation_ = 0;
  std::thread thread_;
};

}  // namespace
}  // namespace prefire::testing

int main(int argc, char** argv) {
  using namespace prefire::testing;
  CLI::App app{"prefire's randomized schedule test: schedules drawn from seeds, checked against the unchecked model"};
  uint64_t schedules = 1000, seed = 1;
  double soak = 0;
  bool verbose = false;
  app.add_option("--schedules", schedules, "how many schedules to run (seeds seed, seed+1, ...)");
  app.add_option("--seed", seed, "the first schedule's seed");
  app.add_option("--soak", soak, "run schedules for this many seconds instead (at least --schedules of them)");
  app.add_flag("--verbose", verbose, "print every schedule before running it");
  CLI11_PARSE(app, argc, argv);

  prefire::install();
  at::set_num_threads(kTestThreads);
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  Watchdog watchdog(std::chrono::seconds(60));
  uint64_t ran = 0;
  for (uint64_t s = seed; ran < schedules || elapsed() < soak; ++s, ++ran) {
    watchdog.start(s);
    const std::string failure = run_schedule(s, verbose);
    if (!failure.empty()) {
      std::fprintf(stderr, "random schedules: seed %llu failed:\n%s\nreplay: --seed %llu --schedules 1 --verbose\n",
                   static_cast<unsigned long long>(s), failure.c_str(), static_cast<unsigned long long>(s));
      return 1;
    }
  }
  std::printf("random schedules: %llu schedules from seed %llu passed in %.1f s\n", static_cast<unsigned long long>(ran),
              static_cast<unsigned long long>(seed), elapsed());
  return 0;
}
