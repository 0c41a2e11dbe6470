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
// 1. The first step (a warm-up step) checkpoints every block, measures per
//    block its kept bytes (prefire::kept_bytes of its checkpoint), its
//    input's bytes and its forward's time, and lets go of every session
//    after its B (W recomputes), holding the least.
// 2. The planner then chooses per block and micro-batch over the stage's
//    order of actions (prefire::rank_items, prefire::plan_for_budget with
//    Release::kAtStepEnd, prefire::stage_plans), and every later step runs
//    that plan: kept blocks unchecked, the others prefired before their B
//    as in prefire mode.
// 3. After each B the session keeps its recomputation for W only where
//    prefire::keep_for_w says so, within the room the plan leaves the
//    sessions (Plan::room_bytes; Note [A rank's byte budget] in
//    python/prefire/pipelining/_budget.py); otherwise it lets go (a fresh
//    session, which W recomputes into).
// 4. The budget covers the census (runtime_stats()'s held bytes: the
//    stage's saved tensors, checkpoint inputs and recomputations).

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

// One mode's run: its stage, its sessions, and what its steps measured (run_mode).
class ModeRun {
 public:
  ModeRun(const RunConfig& config, const ModeSpec& spec, prefire::SessionId session_base, const ModeResult* reference,
          Trace* trace)
      : config_(config),
        spec_(spec),
        mode_(spec.mode),
        session_base_(session_base),
        reference_(reference),
        trace_(trace),
        stage_(config.model, config.device, config.seed),
        params_(stage_.params()),
        mbs_(config.micro_batches),
        layers_(stage_.blocks.size()),
        passes_(schedule(config.order, config.micro_batches, config.in_flight)),
        actions_(rank_actions(passes_)),
        checkpointed_(config.micro_batches, blocks_checkpointed(spec, static_cast<int>(stage_.blocks.size()))),
        pass_bytes_(config.micro_batches, 0),
        released_(config.micro_batches, 0) {
    result_.mode = mode_;
    result_.budget_fraction = spec.fraction;
    result_.budget_bytes = spec.budget_bytes;
    result_.label = label(spec);
    if (mode_ == Mode::kTorchEvery && spec.every < 1) {
      throw std::invalid_argument("torch-every: n must be at least 1");
    }
    if (mode_ == Mode::kPlan && config.warmup < 1) {
      throw std::invalid_argument("plan mode measures in its first step: --warmup must be at least 1");
    }
    if (mode_ == Mode::kBudget) {
      for (int mb = 0; mb < mbs_; ++mb) prefire::set_session_budget(session(mb), spec.budget_bytes);
    }
  }

  void step(int index);
  ModeResult finish();

 private:
  // What one step holds while it runs.
  struct Step {
    TensorList x, gy, y, dx, dw;
    std::vector<std::vector<prefire::CheckpointHandle>> handles;
    std::vector<prefire::WeightPass> weight_passes;
    std::vector<bool> w_recomputes;  // plan: B let go of the micro-batch's recomputation
    std::vector<bool> kept_for_w;    // plan: B kept it
    bool measuring = false;          // Note [prefire-bench's memory plan]
    std::vector<double> block_seconds;
    std::vector<int64_t> block_inputs, block_kept;
    double forward_ms = 0, b_ms = 0, w_ms = 0;
    int64_t refused = 0;  // prefires the budget refused, read before each session's clear ends it
  };

  // A micro-batch's session, and the one W recomputes into when B let go of it (plan mode).
  prefire::SessionId session(int mb) const { return session_base_ + mb; }
  prefire::SessionId w_session(int mb) const { return session_base_ + 500 + mb; }
  void forward(Step& s, int mb);
  void b_pass(Step& s, int mb, size_t at, bool measured);
  void w_pass(Step& s, int mb);
  bool keeps_for_w(const Step& s, int mb, size_t at) const;
  void record(const Step& s, double step_ms, int64_t allocated_before, int64_t recomputations_before);
  void choose_plan(const Step& s);

  const RunConfig& config_;
  const ModeSpec spec_;
  const Mode mode_;
  const prefire::SessionId session_base_;
  const ModeResult* reference_;
  Trace* trace_;
  Stage stage_;
  const TensorList params_;
  const int mbs_;
  const size_t layers_;
  const std::vector<std::pair<Pass, int>> passes_;
  const std::vector<prefire::RankAction> actions_;
  std::vector<std::vector<bool>> checkpointed_;  // per micro-batch, per block (a plan chooses per micro-batch)
  std::vector<int64_t> pass_bytes_;  // plan: what a pass of each micro-batch holds (StagePlan::pass_bytes)
  std::vector<int64_t> room_;        // plan: what it leaves the sessions at each action (Plan::room_bytes)
  std::vector<int64_t> released_;    // plan: sessions let go after B in the measured steps
  int64_t recomputations_measured_ = 0, refused_measured_ = 0;
  std::vector<double> forward_per_mb_, b_per_mb_, w_per_mb_;  // ms, per measured step
  ModeResult result_;
};

void ModeRun::step(int index) {
  const bool measured = index >= config_.warmup;
  const auto& m = config_.model;
  const auto opts = at::TensorOptions().device(config_.device).dtype(m.dtype);
  Step s{.x = TensorList(mbs_), .gy = TensorList(mbs_), .y = TensorList(mbs_), .dx = TensorList(mbs_)};
  at::manual_seed(config_.seed + 1000 + index);  // data of this step, the same in every mode
  for (int mb = 0; mb < mbs_; ++mb) {
    s.x[mb] = at::randn({m.micro_batch, m.seq, m.hidden}, opts).requires_grad_(true);  // received activations
    s.gy[mb] = at::randn({m.micro_batch, m.seq, m.hidden}, opts);                      // received gradients
  }
  at::manual_seed(config_.seed + 2000 + index);  // dropout of this step
  s.handles.resize(mbs_);
  s.weight_passes.resize(mbs_);
  s.w_recomputes.assign(mbs_, false);
  s.kept_for_w.assign(mbs_, false);
  s.measuring = mode_ == Mode::kPlan && index == 0;
  s.block_seconds.assign(layers_, 0.0);
  s.block_inputs.assign(layers_, 0);
  s.block_kept.assign(layers_, 0);
  synchronize(config_.device);
  prefire::reset_runtime_peak();
  prefire::reset_allocator_peak(config_.device);  // See Note [prefire-bench's memory figures]
  const int64_t allocated_before = prefire::allocator_bytes(config_.device).current;
  const int64_t recomputations_before = prefire::runtime_stats().recomputations;
  const auto start = Clock::now();
  {
    prefire::SavedTensorMeter meter;  // counts what forward saves outside checkpoints
    for (size_t at = 0; at < passes_.size(); ++at) {
      const auto& [pass, mb] = passes_[at];
      if (pass == Pass::kForward) forward(s, mb);
      if (pass == Pass::kB) b_pass(s, mb, at, measured);
      if (pass == Pass::kW) w_pass(s, mb);
    }
    meter.stop();
    {
      c10::NoGradGuard no_grad;
      for (size_t i = 0; i < params_.size(); ++i) params_[i].sub_(s.dw[i], config_.lr);
    }
    synchronize(config_.device);
    const double step_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    if (measured) record(s, step_ms, allocated_before, recomputations_before);
  }
  if (s.measuring) choose_plan(s);
  // Every step resets the allocator's peaks (CUDA: reserved too): the mode's is the most of its steps'.
  result_.peak_reserved_bytes = std::max(result_.peak_reserved_bytes, device_peak_reserved_bytes(config_.device));
}

void ModeRun::forward(Step& s, int mb) {
  s.forward_ms += phase(trace_, "forward", mb, [&] {
    prefire::HandleCollector collect;
    s.y[mb] = stage_forward(stage_, s.x[mb], checkpointed_[mb], s.measuring ? &s.block_seconds : nullptr,
                            s.measuring ? &s.block_inputs : nullptr);
    s.handles[mb] = collect.handles();
    if (s.measuring) {
      for (size_t i = 0; i < layers_; ++i) {
        s.block_kept[i] = std::max(s.block_kept[i], prefire::kept_bytes(s.handles[mb].at(i)));
      }
    }
    if (mode_ == Mode::kSession) {
      for (const auto& h : s.handles[mb]) prefire::attach(h, session(mb));
    }
  });
}

void ModeRun::b_pass(Step& s, int mb, size_t at, bool measured) {
  if (prefires(mode_)) {
    phase(trace_, "prefire", mb, [&] {
      for (const auto& h : s.handles[mb]) prefire::prefire(h, session(mb));
    });
  }
  s.b_ms += phase(trace_, "B", mb, [&] {
    std::optional<prefire::SessionScope> scope;
    if (uses_sessions(mode_)) scope.emplace(session(mb), prefire::SessionOptions{/*retain_on_unpack=*/true});
    auto split = prefire::backward_input({s.y[mb]}, {s.gy[mb]}, {s.x[mb]}, params_);
    s.dx[mb] = split.input_grads[0];
    s.weight_passes[mb] = std::move(split.weight_pass);
  });
  s.y[mb].reset();  // the graph belongs to the weight pass now
  if (mode_ == Mode::kPlan && !s.handles[mb].empty() && (s.measuring || !keeps_for_w(s, mb, at))) {
    prefire::clear_session(session(mb));  // W recomputes into a session of its own
    for (const auto& h : s.handles[mb]) prefire::attach(h, w_session(mb));
    s.w_recomputes[mb] = true;
    if (measured) ++released_[mb];
  } else if (mode_ == Mode::kPlan) {
    s.kept_for_w[mb] = true;
  }
  if (uses_sessions(mode_)) {
    const auto stats = prefire::session_stats(session(mb));
    result_.held_b_to_w_bytes = std::max(result_.held_b_to_w_bytes, stats.current_bytes);
    if (stats.peak_bytes > 0) {
      result_.held_b_to_w_fraction =
          std::max(result_.held_b_to_w_fraction, double(stats.current_bytes) / double(stats.peak_bytes));
    }
  }
}

void ModeRun::w_pass(Step& s, int mb) {
  const prefire::SessionId id = s.w_recomputes[mb] ? w_session(mb) : session(mb);
  s.w_ms += phase(trace_, "W", mb, [&] {
    std::optional<prefire::SessionScope> scope;
    if (uses_sessions(mode_)) scope.emplace(id, prefire::SessionOptions{/*retain_on_unpack=*/false});
    auto g = s.weight_passes[mb].run();
    if (s.dw.empty()) {
      s.dw = g;
    } else {
      for (size_t i = 0; i < g.size(); ++i) s.dw[i].add_(g[i]);
    }
  });
  if (uses_sessions(mode_)) {
    const auto stats = prefire::session_stats(id);
    result_.peak_session_bytes = std::max(result_.peak_session_bytes, stats.peak_bytes);
    s.refused += stats.refused_prefires;
    phase(trace_, "clear", mb, [&] { prefire::clear_session(id); });
  }
}

// plan: whether micro-batch mb's session, after its B at action `at`, keeps its recomputation until its W
// (Note [prefire-bench's memory plan])
bool ModeRun::keeps_for_w(const Step& s, int mb, size_t at) const {
  std::vector<prefire::SessionAction> session_actions;
  for (const prefire::RankAction& a : actions_) {
    const auto m = static_cast<size_t>(a.micro_batch);
    session_actions.push_back({.kind = a.kind,
                               .key = a.micro_batch,
                               .need = pass_bytes_[m],
                               .w_recomputes = s.w_recomputes[m],
                               .kept_for_w = s.kept_for_w[m]});
  }
  std::vector<int64_t> held(static_cast<size_t>(mbs_));
  for (int m = 0; m < mbs_; ++m) {
    held[static_cast<size_t>(m)] = prefire::session_stats(s.w_recomputes[m] ? w_session(m) : session(m)).current_bytes;
  }
  return prefire::keep_for_w(room_, session_actions, held, mb, static_cast<int64_t>(at), pass_bytes_[mb], {}).keep;
}

void ModeRun::record(const Step& s, double step_ms, int64_t allocated_before, int64_t recomputations_before) {
  result_.step_ms.push_back(step_ms);
  forward_per_mb_.push_back(s.forward_ms / mbs_);
  b_per_mb_.push_back(s.b_ms / mbs_);
  w_per_mb_.push_back(s.w_ms / mbs_);
  result_.step_peak_bytes =
      std::max(result_.step_peak_bytes, prefire::allocator_bytes(config_.device).peak - allocated_before);
  result_.peak_held_bytes = std::max(result_.peak_held_bytes, prefire::runtime_stats().peak_held_bytes);
  recomputations_measured_ += prefire::runtime_stats().recomputations - recomputations_before;
  refused_measured_ += s.refused;
  TensorList grads = s.dx;
  grads.insert(grads.end(), s.dw.begin(), s.dw.end());
  if (reference_ == nullptr) {
    for (auto& g : grads) g = g.to(at::kCPU);  // kept off the device: not part of its peak
    result_.grads.push_back(std::move(grads));
  } else {
    const size_t step = result_.step_ms.size() - 1;
    result_.max_grad_diff = std::max(result_.max_grad_diff, max_abs_diff(grads, reference_->grads.at(step)));
  }
}

// After the measuring step: one item per (micro-batch, block), as the Python pipeline plans (Note [prefire-bench's
// memory plan]).
void ModeRun::choose_plan(const Step& s) {
  result_.measuring_held_bytes = prefire::runtime_stats().peak_held_bytes;
  std::vector<prefire::BlockCost> costs(layers_);
  for (size_t i = 0; i < layers_; ++i) {
    costs[i] = prefire::BlockCost{.saved_bytes = s.block_kept[i],
                                  .input_bytes = s.block_inputs[i],
                                  .recompute_seconds = s.block_seconds[i] / mbs_,
                                  .group = 0};
  }
  const std::vector<prefire::BlockCost> items = prefire::rank_items(costs, actions_, mbs_);
  result_.least_plan_bytes = prefire::least_plan_bytes(items);
  result_.budget_bytes = std::max(spec_.budget_bytes, result_.least_plan_bytes);  // a sweep's lowest point
  const prefire::Plan plan = prefire::plan_for_budget(items, result_.budget_bytes);
  result_.plan_bytes = plan.peak_bytes;
  room_ = plan.room_bytes;
  const prefire::StagePlan stage_plan = prefire::stage_plans(plan, costs, mbs_).at(0);  // the one stage
  for (int m = 0; m < mbs_; ++m) {
    const auto& choices = stage_plan.choices[static_cast<size_t>(m)];
    for (size_t i = 0; i < layers_; ++i) checkpointed_[m][i] = choices[i] != prefire::Choice::kKeep;
    // a micro-batch whose blocks are all kept recomputes nothing, as in the Python pipeline (RankBudget.expect)
    const bool any = std::find(checkpointed_[m].begin(), checkpointed_[m].end(), true) != checkpointed_[m].end();
    pass_bytes_[m] = any ? stage_plan.pass_bytes : 0;
  }
}

ModeResult ModeRun::finish() {
  const int steps = config_.steps;
  result_.checkpointed = checkpointed_;
  int64_t released_all = 0;
  for (int64_t r : released_) {
    released_all += r;
    result_.released_per_micro_batch.push_back(double(r) / steps);
  }
  result_.released_after_b_per_step = double(released_all) / steps;
  result_.recomputes_per_step = double(recomputations_measured_) / steps;
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  result_.forward_ms = median(forward_per_mb_);
  result_.b_ms = median(b_per_mb_);
  result_.w_ms = median(w_per_mb_);
  result_.refused_per_step = double(refused_measured_) / steps;
  return std::move(result_);
}

}  // namespace

ModeResult run_mode(const RunConfig& config, const ModeSpec& spec, prefire::SessionId session_base,
                    const ModeResult* reference, Trace* trace, const std::function<void(int)>& progress) {
  ModeRun run(config, spec, session_base, reference, trace);
  reset_peaks(config.device);
  for (int step = 0; step < config.warmup + config.steps; ++step) {
    run.step(step);
    if (progress) progress(step + 1);
  }
  return run.finish();
}

}  // namespace prefire_bench
