#pragma once

// One pipeline stage trained through a split-backward schedule: per
// micro-batch a forward, a B pass (prefire::backward_input: dx) and a W pass
// (prefire::WeightPass: dw, the weight part of the graph only), in one of
// three orders, then an SGD step, in one of several modes.

#include "model.h"
#include "trace.h"

#include <prefire/session.h>

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace prefire_bench {

enum class Mode {
  kNone,       // no checkpoint
  kTorch,      // checkpoint per block keyed by graph task, as torch.utils.checkpoint: recomputes in B and again in W
  kSession,    // a session per micro-batch, lazy: recomputed in B, reused in W
  kPrefire,    // sessions + prefire of a micro-batch's checkpoints just before its B
  kBudget,     // prefire under a byte budget per session
  kTorchEvery,  // kTorch on every n-th block only (what torch users write: every n-th layer)
  kPlan,       // prefire's plan from a memory budget: the first step measures, then each block kept or
               // checkpointed as prefire::plan_for_budget chose (Note [prefire-bench's memory plan])
};
const char* to_string(Mode mode);
/// Whether `mode` gives each micro-batch a session (session, prefire, budget, plan).
bool uses_sessions(Mode mode);

/// One mode to run.
struct ModeSpec {
  Mode mode = Mode::kNone;
  std::optional<double> fraction;  // budget: of the prefire mode's session peak; plan: of none's peak held bytes
  int64_t budget_bytes = 0;        // bytes: budget: per session; plan: the memory budget (the least plan if more)
  int every = 0;                   // kTorchEvery: checkpoint the blocks whose index is a multiple of it
};
std::string label(const ModeSpec& spec);

/// The order of the passes.
enum class Order {
  kAllBThenW,    // "zb": every forward, every B, then every W (W fills bubbles late)
  kInterleaved,  // "bw": every forward, then B and W of each micro-batch in turn
  kZbH1,         // "zbh1": one stage of ZB-H1: 1F1B with `in_flight` warm-up forwards, each W deferred
                 // until `in_flight` more B passes ran
};
const char* to_string(Order order);

enum class Pass { kForward, kB, kW };
/// The passes of one step in `order`: (pass, micro-batch) pairs.
std::vector<std::pair<Pass, int>> schedule(Order order, int micro_batches, int in_flight);

struct RunConfig {
  ModelConfig model;
  int micro_batches = 4;
  int steps = 5;   // measured steps
  int warmup = 1;  // steps before measuring
  uint64_t seed = 0;
  double lr = 1e-3;
  Order order = Order::kAllBThenW;
  int in_flight = 2;  // zbh1: warm-up forwards, and how many B passes a W waits for
  at::Device device = at::Device(at::kCPU);
};

struct ModeResult {
  std::string label;             // "prefire", "budget 25%", ...
  Mode mode = Mode::kNone;
  std::optional<double> budget_fraction;
  int64_t budget_bytes = 0;      // bytes per session (budget modes)
  std::vector<double> step_ms;   // measured steps
  double recomputes_per_step = 0;
  double refused_per_step = 0;
  int64_t step_peak_bytes = 0;   // bytes: the allocator's most during a measured step above what it held at its start
  int64_t peak_held_bytes = 0;   // bytes: saved tensors + recomputed tensors, prefire's census
  int64_t peak_session_bytes = 0;  // bytes: largest peak of one micro-batch's session
  int64_t held_b_to_w_bytes = 0;   // bytes: largest a session held from the end of its B to its W
  double held_b_to_w_fraction = 0; // largest (held from B to W) / (the session's peak) of one micro-batch
  double forward_ms = 0, b_ms = 0, w_ms = 0;  // per micro-batch: medians over the measured steps
  int64_t peak_reserved_bytes = -1;  // bytes: CUDA allocator peak reserved (CUDA runs only)
  std::vector<std::vector<bool>> checkpointed;  // per micro-batch, per block, in the measured steps
  int64_t least_plan_bytes = -1;   // bytes: plan: the least any plan holds (the budget's floor)
  int64_t plan_bytes = -1;         // bytes: plan: what the chosen plan holds by its count
  int64_t measuring_held_bytes = -1;  // bytes: plan: what the measuring step held
  double released_after_b_per_step = 0;  // plan: sessions let go after B for the budget (W recomputed them)
  std::vector<double> released_per_micro_batch;  // plan: the same, per micro-batch (per measured step)
  double max_grad_diff = 0;      // max |grad - grad(none)| over steps, dx and dw
  std::vector<std::vector<at::Tensor>> grads;  // per measured step: dx of each micro-batch, then dw
};

/// Runs `mode` from fresh weights (same seed for every mode). `session_base`
/// keeps the modes' session ids apart; `reference` (the `none` run) gives the
/// gradient difference. `progress(step)` is called after each step.
ModeResult run_mode(const RunConfig& config, const ModeSpec& spec, prefire::SessionId session_base,
                    const ModeResult* reference, Trace* trace, const std::function<void(int)>& progress);

}  // namespace prefire_bench
