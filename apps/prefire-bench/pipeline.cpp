#include "pipeline.h"

#include "device.h"

#include <prefire/prefire.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>

namespace prefire_bench {

const char* to_string(Order order) {
  switch (order) {
    case Order::kAllBThenW:
      return "zb";
    case Order::kInterleaved:
      return "bw";
    case Order::kZbH1:
      return "zbh1";
  }
  return "?";
}

std::vector<std::pair<Pass, int>> schedule(Order order, int mbs, int in_flight) {
  std::vector<std::pair<Pass, int>> passes;
  auto all = [&](Pass p) {
    for (int mb = 0; mb < mbs; ++mb) passes.emplace_back(p, mb);
  };
  switch (order) {
    case Order::kAllBThenW:
      all(Pass::kForward);
      all(Pass::kB);
      all(Pass::kW);
      break;
    case Order::kInterleaved:
      all(Pass::kForward);
      for (int mb = 0; mb < mbs; ++mb) {
        passes.emplace_back(Pass::kB, mb);
        passes.emplace_back(Pass::kW, mb);
      }
      break;
    case Order::kZbH1: {
      // 1F1B: `warm` forwards, then one forward and one B each, then the
      // remaining B passes; W of micro-batch j right after B of j + warm.
      const int warm = std::min(std::max(in_flight, 1), mbs);
      int next_w = 0;
      auto b_pass = [&](int mb) {
        passes.emplace_back(Pass::kB, mb);
        if (mb - warm >= next_w) passes.emplace_back(Pass::kW, next_w++);
      };
      for (int mb = 0; mb < warm; ++mb) passes.emplace_back(Pass::kForward, mb);
      for (int mb = warm; mb < mbs; ++mb) {
        passes.emplace_back(Pass::kForward, mb);
        b_pass(mb - warm);
      }
      for (int mb = mbs - warm; mb < mbs; ++mb) b_pass(mb);
      while (next_w < mbs) passes.emplace_back(Pass::kW, next_w++);
      break;
    }
  }
  return passes;
}

const char* to_string(Mode mode) {
  switch (mode) {
    case Mode::kNone:
      return "none";
    case Mode::kTorch:
      return "torch";
    case Mode::kSession:
      return "session";
    case Mode::kPrefire:
      return "prefire";
    case Mode::kBudget:
      return "budget";
    case Mode::kTorchEvery:
      return "torch-every";
    case Mode::kPlan:
      return "plan";
  }
  return "?";
}

bool uses_sessions(Mode m) {
  return m == Mode::kSession || m == Mode::kPrefire || m == Mode::kBudget || m == Mode::kPlan;
}

std::string label(const ModeSpec& spec) {
  if (spec.mode == Mode::kTorchEvery) return "torch-every" + std::to_string(spec.every);
  std::string out = to_string(spec.mode);
  if (spec.fraction) out += " " + std::to_string(static_cast<int>(*spec.fraction * 100 + 0.5)) + "%";
  return out;
}

// Note [prefire-bench's memory plan]
// The plan mode is what enable(schedule, memory_budget=...) does for a
// Python pipeline (Note [A pipeline rank's memory plan] in
// python/prefire/pipelining/_plan.py), on one stage, by the same C++ rules:
// the first step (a warm-up step) checkpoints every block, measures per
// block its kept bytes (prefire::kept_bytes of its checkpoint), its input's
// bytes and its forward's time, and lets go of every session after its B
// (W recomputes), holding the least. Then the planner chooses per block and
// micro-batch (prefire::per_micro_batch over the stage's order of actions:
// each micro-batch held from its forward to its W, its passes counted where
// they run; prefire::plan_for_budget, Release::kAtStepEnd), and every later
// step runs that plan: kept blocks unchecked, the others prefired before
// their B as in prefire mode. After each B the session keeps its
// recomputation for W only if the actions up to that W stay within the
// room the plan leaves the sessions (Plan::room_bytes), every later
// micro-batch at its floor (prefire::least_session_room, the count of Note
// [A rank's byte budget] in python/prefire/pipelining/_budget.py); otherwise it lets
// go (a fresh session, which W recomputes into). The budget covers the
// census (runtime_stats()'s held bytes: the stage's saved tensors,
// checkpoint inputs and recomputations).

// Note [prefire-bench's memory figures]
// A mode's memory is what the device's allocator holds (prefire::
// allocator_bytes: every storage, whoever made it), not prefire's census,
// which sees only what prefire handles and is 0 for a mode without its
// checkpoints. Per measured step: the most the allocator held during the
// step above what it held when the step began (the stage's weights, and on
// CPU the reference mode's stored gradients, are there before and after);
// the mode reports the largest over its steps. So it counts the step's
// activations, recomputations, gradients (dx and dw, made in the step) and
// ops' working memory: what the step needs beyond the model. The census
// (peak held) stays beside it: it is what a plan's budget covers.

namespace {

using Clock = std::chrono::steady_clock;
using prefire::TensorList;

bool prefires(Mode m) { return m == Mode::kPrefire || m == Mode::kBudget || m == Mode::kPlan; }

// The stage's forward, block i checkpointed where checkpointed[i]; with
// `seconds`, each block's forward time is added to it, with `input_bytes`
// its input's bytes raised to (the plan's measuring).
at::Tensor stage_forward(const Stage& stage, at::Tensor h, const std::vector<bool>& checkpointed,
                         std::vector<double>* seconds = nullptr, std::vector<int64_t>* input_bytes = nullptr) {
  for (size_t i = 0; i < stage.blocks.size(); ++i) {
    const auto& blk = stage.blocks[i];
    const auto begin = Clock::now();
    // what its checkpoint holds: its input, unless a leaf that requires grad (never counted)
    if (input_bytes && !(h.is_leaf() && h.requires_grad())) {
      (*input_bytes)[i] = std::max((*input_bytes)[i], static_cast<int64_t>(h.storage().nbytes()));
    }
    h = checkpointed[i]
            ? prefire::checkpoint([&blk](const TensorList& in) { return TensorList{blk.forward(in[0])}; }, {h})[0]
            : blk.forward(h);
    if (seconds) (*seconds)[i] += std::chrono::duration<double>(Clock::now() - begin).count();
  }
  return h;
}

// Per block: checkpointed in `mode` (the plan's choice is made after its measuring step).
std::vector<bool> blocks_checkpointed(const ModeSpec& spec, int layers) {
  std::vector<bool> out(static_cast<size_t>(layers), spec.mode != Mode::kNone);
  if (spec.mode == Mode::kTorchEvery) {
    for (int i = 0; i < layers; ++i) out[static_cast<size_t>(i)] = i % spec.every == 0;
  }
  return out;
}

// The stage's passes as the planner's actions (its only stage: 0).
std::vector<prefire::RankAction> rank_actions(const std::vector<std::pair<Pass, int>>& passes) {
  std::vector<prefire::RankAction> actions;
  for (const auto& [pass, mb] : passes) {
    actions.push_back({.kind = pass == Pass::kForward ? prefire::ActionKind::kForward
                               : pass == Pass::kB     ? prefire::ActionKind::kB
                                                      : prefire::ActionKind::kW,
                       .stage = 0,
                       .micro_batch = mb});
  }
  return actions;
}

// Runs `work` and, with a trace, records it as one event; returns its host time in ms.
template <typename F>
double phase(Trace* trace, const char* name, int64_t micro_batch, F&& work) {
  const auto begin = Clock::now();
  work();
  const auto end = Clock::now();
  if (trace) trace->add(name, "schedule", begin, end, "micro_batch", micro_batch);
  return std::chrono::duration<double, std::milli>(end - begin).count();
}

double max_abs_diff(const TensorList& a, const TensorList& b) {
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (!a[i].defined() || !b[i].defined()) continue;
    m = std::max(m, (a[i].to(at::kCPU) - b[i]).abs().max().item<double>());
  }
  return m;
}

}  // namespace

ModeResult run_mode(const RunConfig& config, const ModeSpec& spec, prefire::SessionId session_base,
                    const ModeResult* reference, Trace* trace, const std::function<void(int)>& progress) {
  const Mode mode = spec.mode;
  ModeResult result;
  result.mode = mode;
  result.budget_fraction = spec.fraction;
  result.budget_bytes = spec.budget_bytes;
  result.label = label(spec);
  if (mode == Mode::kTorchEvery && spec.every < 1) throw std::invalid_argument("torch-every: n must be at least 1");
  if (mode == Mode::kPlan && config.warmup < 1) {
    throw std::invalid_argument("plan mode measures in its first step: --warmup must be at least 1");
  }

  Stage stage(config.model, config.device, config.seed);
  const TensorList params = stage.params();
  const int mbs = config.micro_batches;
  const size_t layers = stage.blocks.size();
  const auto passes = schedule(config.order, mbs, config.in_flight);
  const std::vector<prefire::RankAction> actions = rank_actions(passes);
  // per micro-batch, per block (a plan chooses per micro-batch once measured)
  std::vector<std::vector<bool>> checkpointed(mbs, blocks_checkpointed(spec, static_cast<int>(layers)));
  // a micro-batch's session, and the one W recomputes into when B let go of it (plan mode)
  auto session = [&](int mb) { return session_base + mb; };
  auto w_session = [&](int mb) { return session_base + 500 + mb; };
  if (mode == Mode::kBudget) {
    for (int mb = 0; mb < mbs; ++mb) prefire::set_session_budget(session(mb), spec.budget_bytes);
  }
  std::vector<int64_t> pass_bytes(mbs, 0);  // plan: what a pass of each micro-batch holds (Plan::pass_bytes)
  std::vector<int64_t> room;                // plan: what it leaves the sessions at each action (Plan::room_bytes)
  std::vector<int64_t> released(mbs, 0);    // plan: sessions let go after B in the measured steps
  int64_t recomputations_measured = 0, refused_measured = 0;
  std::vector<double> forward_per_mb, b_per_mb, w_per_mb;  // ms, per measured step
  const auto opts = at::TensorOptions().device(config.device).dtype(config.model.dtype);
  const auto& m = config.model;

  // plan: whether micro-batch mb's session, after its B at action `at`, keeps its recomputation until its W
  // (Note [prefire-bench's memory plan])
  auto keeps_for_w = [&](int mb, size_t at, const std::vector<bool>& w_recomputes,
                         const std::vector<bool>& kept_for_w) {
    std::vector<prefire::SessionAction> session_actions;
    for (const prefire::RankAction& a : actions) {
      const auto m = static_cast<size_t>(a.micro_batch);
      session_actions.push_back({.kind = a.kind,
                                 .key = a.micro_batch,
                                 .need = pass_bytes[m],
                                 .w_recomputes = w_recomputes[m],
                                 .kept_for_w = kept_for_w[m]});
    }
    std::vector<int64_t> held(static_cast<size_t>(mbs));
    for (int m = 0; m < mbs; ++m) {
      held[static_cast<size_t>(m)] = prefire::session_stats(w_recomputes[m] ? w_session(m) : session(m)).current_bytes;
    }
    return prefire::keep_for_w(room, session_actions, held, mb, static_cast<int64_t>(at), pass_bytes[mb], {}).keep;
  };

  reset_peaks(config.device);
  for (int step = 0; step < config.warmup + config.steps; ++step) {
    const bool measured = step >= config.warmup;
    at::manual_seed(config.seed + 1000 + step);  // data of this step, the same in every mode
    TensorList x(mbs), gy(mbs), y(mbs);
    for (int mb = 0; mb < mbs; ++mb) {
      x[mb] = at::randn({m.micro_batch, m.seq, m.hidden}, opts).requires_grad_(true);  // received activations
      gy[mb] = at::randn({m.micro_batch, m.seq, m.hidden}, opts);                      // received gradients
    }
    at::manual_seed(config.seed + 2000 + step);  // dropout of this step
    synchronize(config.device);
    prefire::reset_runtime_peak();
    prefire::reset_allocator_peak(config.device);  // See Note [prefire-bench's memory figures]
    const int64_t allocated_before = prefire::allocator_bytes(config.device).current;
    const int64_t recomputations_before = prefire::runtime_stats().recomputations;
    int64_t refused = 0;  // prefires the budget refused this step, read before each session's clear ends it
    const auto start = Clock::now();

    std::vector<std::vector<prefire::CheckpointHandle>> handles(mbs);
    std::vector<prefire::WeightPass> weight_passes(mbs);
    std::vector<bool> w_recomputes(mbs, false);  // plan: B let go of the micro-batch's recomputation
    std::vector<bool> kept_for_w(mbs, false);    // plan: B kept it
    const bool measuring = mode == Mode::kPlan && step == 0;  // Note [prefire-bench's memory plan]
    std::vector<double> block_seconds(layers, 0.0);
    std::vector<int64_t> block_inputs(layers, 0), block_kept(layers, 0);
    TensorList dx(mbs), dw;
    double forward_ms = 0, b_ms = 0, w_ms = 0;
    {
      prefire::SavedTensorMeter meter;  // counts what forward saves outside checkpoints
      for (size_t action_index = 0; action_index < passes.size(); ++action_index) {
        const auto& [pass, mb] = passes[action_index];
        switch (pass) {
          case Pass::kForward:
            forward_ms += phase(trace, "forward", mb, [&, mb = mb] {
              prefire::HandleCollector collect;
              y[mb] = stage_forward(stage, x[mb], checkpointed[mb], measuring ? &block_seconds : nullptr,
                                    measuring ? &block_inputs : nullptr);
              handles[mb] = collect.handles();
              if (measuring) {
                for (size_t i = 0; i < layers; ++i) {
                  block_kept[i] = std::max(block_kept[i], prefire::kept_bytes(handles[mb].at(i)));
                }
              }
              if (mode == Mode::kSession) {
                for (const auto& h : handles[mb]) prefire::attach(h, session(mb));
              }
            });
            break;
          case Pass::kB:
            if (prefires(mode)) {
              phase(trace, "prefire", mb, [&, mb = mb] {
                for (const auto& h : handles[mb]) prefire::prefire(h, session(mb));
              });
            }
            b_ms += phase(trace, "B", mb, [&, mb = mb] {
              std::optional<prefire::SessionScope> scope;
              if (uses_sessions(mode)) scope.emplace(session(mb), prefire::SessionOptions{/*retain_on_unpack=*/true});
              auto split = prefire::backward_input({y[mb]}, {gy[mb]}, {x[mb]}, params);
              dx[mb] = split.input_grads[0];
              weight_passes[mb] = std::move(split.weight_pass);
            });
            y[mb].reset();  // the graph belongs to the weight pass now
            if (mode == Mode::kPlan && !handles[mb].empty() &&
                (measuring || !keeps_for_w(mb, action_index, w_recomputes, kept_for_w))) {
              prefire::clear_session(session(mb));  // W recomputes into a session of its own
              for (const auto& h : handles[mb]) prefire::attach(h, w_session(mb));
              w_recomputes[mb] = true;
              if (step >= config.warmup) ++released[mb];
            } else if (mode == Mode::kPlan) {
              kept_for_w[mb] = true;
            }
            if (uses_sessions(mode)) {
              const auto stats = prefire::session_stats(session(mb));
              result.held_b_to_w_bytes = std::max(result.held_b_to_w_bytes, stats.current_bytes);
              if (stats.peak_bytes > 0) {
                result.held_b_to_w_fraction =
                    std::max(result.held_b_to_w_fraction, double(stats.current_bytes) / double(stats.peak_bytes));
              }
            }
            break;
          case Pass::kW:
            w_ms += phase(trace, "W", mb, [&, mb = mb] {
              std::optional<prefire::SessionScope> scope;
              if (uses_sessions(mode)) {
                scope.emplace(w_recomputes[mb] ? w_session(mb) : session(mb),
                              prefire::SessionOptions{/*retain_on_unpack=*/false});
              }
              auto g = weight_passes[mb].run();
              if (dw.empty()) {
                dw = g;
              } else {
                for (size_t i = 0; i < g.size(); ++i) dw[i].add_(g[i]);
              }
            });
            if (uses_sessions(mode)) {
              const prefire::SessionId id = w_recomputes[mb] ? w_session(mb) : session(mb);
              const auto stats = prefire::session_stats(id);
              result.peak_session_bytes = std::max(result.peak_session_bytes, stats.peak_bytes);
              refused += stats.refused_prefires;
              phase(trace, "clear", mb, [&, id] { prefire::clear_session(id); });
            }
            break;
        }
      }
      meter.stop();
      {
        c10::NoGradGuard no_grad;
        for (size_t i = 0; i < params.size(); ++i) params[i].sub_(dw[i], config.lr);
      }
      synchronize(config.device);
      const auto end = Clock::now();
      if (measured) {
        result.step_ms.push_back(std::chrono::duration<double, std::milli>(end - start).count());
        forward_per_mb.push_back(forward_ms / mbs);
        b_per_mb.push_back(b_ms / mbs);
        w_per_mb.push_back(w_ms / mbs);
        result.step_peak_bytes =
            std::max(result.step_peak_bytes, prefire::allocator_bytes(config.device).peak - allocated_before);
        result.peak_held_bytes = std::max(result.peak_held_bytes, prefire::runtime_stats().peak_held_bytes);
        recomputations_measured += prefire::runtime_stats().recomputations - recomputations_before;
        refused_measured += refused;
        TensorList grads = dx;
        grads.insert(grads.end(), dw.begin(), dw.end());
        if (reference == nullptr) {
          for (auto& g : grads) g = g.to(at::kCPU);  // kept off the device: not part of its peak
          result.grads.push_back(std::move(grads));
        } else {
          const size_t s = result.step_ms.size() - 1;
          result.max_grad_diff = std::max(result.max_grad_diff, max_abs_diff(grads, reference->grads.at(s)));
        }
      }
    }
    if (measuring) {
      result.measuring_held_bytes = prefire::runtime_stats().peak_held_bytes;
      std::vector<prefire::BlockCost> costs(layers);
      for (size_t i = 0; i < layers; ++i) {
        costs[i] = prefire::BlockCost{.saved_bytes = block_kept[i],
                                      .input_bytes = block_inputs[i],
                                      .recompute_seconds = block_seconds[i] / mbs,
                                      .group = 0};
      }
      // one item per (micro-batch, block), as the Python pipeline plans (Note [prefire-bench's memory plan])
      const std::vector<prefire::BlockCost> items = prefire::rank_items(costs, actions, mbs);
      result.least_plan_bytes = prefire::least_plan_bytes(items);
      result.budget_bytes = std::max(spec.budget_bytes, result.least_plan_bytes);  // a sweep's lowest point
      const prefire::Plan plan = prefire::plan_for_budget(items, result.budget_bytes);
      result.plan_bytes = plan.peak_bytes;
      room = plan.room_bytes;
      const prefire::StagePlan stage_plan = prefire::stage_plans(plan, costs, mbs).at(0);  // the one stage
      for (int m = 0; m < mbs; ++m) {
        const auto& choices = stage_plan.choices[static_cast<size_t>(m)];
        for (size_t i = 0; i < layers; ++i) checkpointed[m][i] = choices[i] != prefire::Choice::kKeep;
        // a micro-batch whose blocks are all kept recomputes nothing, as in the Python pipeline (RankBudget.expect)
        const bool any = std::find(checkpointed[m].begin(), checkpointed[m].end(), true) != checkpointed[m].end();
        pass_bytes[m] = any ? stage_plan.pass_bytes : 0;
      }
    }
    // Every step resets the allocator's peaks (CUDA: reserved too): the mode's is the most of its steps'.
    result.peak_reserved_bytes = std::max(result.peak_reserved_bytes, device_peak_reserved_bytes(config.device));
    if (progress) progress(step + 1);
  }
  result.checkpointed = checkpointed;
  int64_t released_all = 0;
  for (int64_t r : released) {
    released_all += r;
    result.released_per_micro_batch.push_back(double(r) / config.steps);
  }
  result.released_after_b_per_step = double(released_all) / config.steps;
  result.recomputes_per_step = double(recomputations_measured) / config.steps;
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  result.forward_ms = median(forward_per_mb);
  result.b_ms = median(b_per_mb);
  result.w_ms = median(w_per_mb);
  result.refused_per_step = double(refused_measured) / config.steps;
  return result;
}

}  // namespace prefire_bench
