// What a checkpoint costs and saves.
//
// * Per-call overhead: forward + backward of a tiny block (CPU-bound: the
//   cost is bookkeeping, not arithmetic), checkpointed vs not, as a ratio and
//   in microseconds (the recomputation's own ops included); and the part of
//   it beyond two floors: the forward run again with autograd recording
//   (its graph thrown away, BM_Call_RecomputeFloor), the same with the
//   forward's saved tensors going through saved-tensor hooks
//   (BM_Call_HookedFloor), and with the second run's saves hooked too, as a
//   recomputation's are in any hook-based checkpoint
//   (BM_Call_RecomputeHookedFloor). Printed once more from an interleaved
//   run that a busy host disturbs less (Note [Per-call overhead on a shared
//   machine]), with ATen's defaults and with oneDNN off (Note [The tiny
//   block with and without oneDNN]).
// * B/W split: one micro-batch of a GPT-style stage, forward then B
//   (prefire::backward_input) then W (prefire::WeightPass), in four modes: no
//   checkpoint, checkpoint keyed by graph task (recomputes in both passes),
//   session (recomputes once, lazily), prefire (recomputes once, before B).
//   Target: session / graph-task <= 0.85.
// * Memory: peak bytes of saved and recomputed tensors (runtime accounting)
//   per mode, as counters; printed as ratios to the unchecked run (target for
//   checkpointing: about 1/layers of it, plus the checkpoint inputs).
//
//   build/benchmarks/prefire_checkpoint_benchmark

#include <prefire/prefire.h>

#include "model.h"
#include "ratio_reporter.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

namespace {

using prefire::TensorList;

// ---- per-call overhead ------------------------------------------------------------

struct Tiny {
  at::Tensor w = at::randn({16, 16}).requires_grad_(true);
  at::Tensor x = at::randn({4, 16}).requires_grad_(true);
  at::Tensor forward(const at::Tensor& in) const { return at::gelu(at::linear(in, w)).sin(); }
};

void call_unchecked(const Tiny& t) {
  auto g = torch::autograd::grad({t.forward(t.x).sum()}, {t.x, t.w});
  benchmark::DoNotOptimize(g.data());
}

// The floors: an unchecked call plus the forward run again, recording
// autograd (that is how a recomputation's saved tensors come back), its
// graph unused. `hook_forward`: the first run's saves go through a pack and
// an unpack hook (a SavedTensorMeter's, which only holds the tensor), as in
// any checkpoint built on saved-tensor hooks, prefire's and
// torch.utils.checkpoint's; `hook_again`: the second run's too, as a
// recomputation's must (that is how its tensors are caught).
void call_floor(const Tiny& t, bool hook_forward, bool hook_again) {
  at::Tensor y;
  {
    std::optional<prefire::SavedTensorMeter> hooked;
    if (hook_forward) hooked.emplace();
    y = t.forward(t.x);
  }
  {
    std::optional<prefire::SavedTensorMeter> hooked;
    if (hook_again) hooked.emplace();
    auto again = t.forward(t.x);
    benchmark::DoNotOptimize(again.data_ptr());
  }
  auto g = torch::autograd::grad({y.sum()}, {t.x, t.w});
  benchmark::DoNotOptimize(g.data());
}

void call_checkpoint(const Tiny& t, const prefire::CheckpointOptions& options) {
  auto y = prefire::checkpoint([&t](const TensorList& in) { return TensorList{t.forward(in[0])}; }, {t.x}, options)[0];
  auto g = torch::autograd::grad({y.sum()}, {t.x, t.w});
  benchmark::DoNotOptimize(g.data());
}

void BM_Call_NoCheckpoint(benchmark::State& state) {
  Tiny t;
  for (auto _ : state) call_unchecked(t);
}
BENCHMARK(BM_Call_NoCheckpoint)->Unit(benchmark::kMicrosecond);

void BM_Call_RecomputeFloor(benchmark::State& state) {
  Tiny t;
  for (auto _ : state) call_floor(t, false, false);
}
BENCHMARK(BM_Call_RecomputeFloor)->Unit(benchmark::kMicrosecond);

void BM_Call_HookedFloor(benchmark::State& state) {
  Tiny t;
  for (auto _ : state) call_floor(t, true, false);
}
BENCHMARK(BM_Call_HookedFloor)->Unit(benchmark::kMicrosecond);

void BM_Call_RecomputeHookedFloor(benchmark::State& state) {
  Tiny t;
  for (auto _ : state) call_floor(t, true, true);
}
BENCHMARK(BM_Call_RecomputeHookedFloor)->Unit(benchmark::kMicrosecond);

void BM_Call_Checkpoint(benchmark::State& state, prefire::CheckpointOptions options) {
  Tiny t;
  for (auto _ : state) call_checkpoint(t, options);
}
BENCHMARK_CAPTURE(BM_Call_Checkpoint, Default, prefire::CheckpointOptions{})->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_Call_Checkpoint, NoRngState, [] {
  prefire::CheckpointOptions o;
  o.preserve_rng_state = false;
  return o;
}())->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_Call_Checkpoint, NoDeterminismCheck, [] {
  prefire::CheckpointOptions o;
  o.determinism_check = prefire::DeterminismCheck::kNone;
  return o;
}())->Unit(benchmark::kMicrosecond);

// Note [Per-call overhead on a shared machine]
// The host these run on is shared: for seconds at a time every call slows by
// 10-50 %, and the medians above move with it. So the per-call overhead is
// also measured interleaved: unchecked, the recompute floor, the both-hooked
// floor and checkpoint run in alternating chunks of 50 calls, 200 chunks
// each, and each is represented by its fastest chunk (and its 10th
// percentile), the chunks least disturbed. Alternating keeps the four under
// the same conditions.
//
// Note [The tiny block with and without oneDNN]
// ATen runs a CPU GELU through oneDNN when it can, building a primitive
// descriptor on every call: about half of the tiny block's unchecked time,
// and paid again by the recomputation. It also slows the checkpoint's
// backward beyond the instructions it adds (docs/benchmarks.md). So the
// interleaved run is printed twice: with ATen's defaults and with oneDNN
// switched off (at::Context::setUserEnabledMkldnn(false), ATen's own GELU),
// which separates what prefire costs from what the recomputed op costs.
void print_interleaved_overhead(const char* setting) {
  Tiny t;
  const prefire::CheckpointOptions defaults;
  const std::function<void()> calls[] = {[&] { call_unchecked(t); }, [&] { call_floor(t, false, false); },
                                         [&] { call_floor(t, true, true); }, [&] { call_checkpoint(t, defaults); }};
  constexpr int kKinds = 4, kChunks = 200, kCalls = 50;
  std::vector<double> us[kKinds];
  for (const auto& call : calls) {
    for (int i = 0; i < kCalls; ++i) call();  // warm-up
  }
  for (int chunk = 0; chunk < kChunks; ++chunk) {
    for (int k = 0; k < kKinds; ++k) {
      const auto begin = std::chrono::steady_clock::now();
      for (int i = 0; i < kCalls; ++i) calls[k]();
      us[k].push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - begin).count() /
                      kCalls);
    }
  }
  double fastest[kKinds], p10[kKinds];
  for (int k = 0; k < kKinds; ++k) {
    std::sort(us[k].begin(), us[k].end());
    fastest[k] = us[k].front();
    p10[k] = us[k][us[k].size() / 10];
  }
  std::printf("  per call, interleaved, %s (fastest of %d chunks of %d; 10th percentile): unchecked %.1f (%.1f) us, "
              "recompute floor %.1f (%.1f), both runs hooked %.1f (%.1f), checkpoint %.1f (%.1f)\n",
              setting, kChunks, kCalls, fastest[0], p10[0], fastest[1], p10[1], fastest[2], p10[2], fastest[3],
              p10[3]);
  std::printf("  %-50s %.2f us (%.2f); beyond the recompute floor %.2f us (%.2f); beyond hooks on both runs "
              "%.2f us (%.2f)\n",
              "per-call overhead, interleaved", fastest[3] - fastest[0], p10[3] - p10[0], fastest[3] - fastest[1],
              p10[3] - p10[1], fastest[3] - fastest[2], p10[3] - p10[2]);
}

// ---- B/W split ---------------------------------------------------------------------

enum class Split { kNone, kGraphTask, kSession, kPrefire };

prefire_bench::Stage& stage() {
  static prefire_bench::ModelConfig config = [] {
    prefire_bench::ModelConfig c;
    c.layers = 4, c.hidden = 128, c.heads = 4, c.seq = 64, c.micro_batch = 4, c.dropout = 0.1;
    return c;
  }();
  static prefire_bench::Stage s(config, at::Device(at::kCPU), /*seed=*/0);
  return s;
}

struct SplitPeaks {
  int64_t census = 0;     // bytes: prefire's census (RuntimeStats::peak_held_bytes)
  int64_t allocator = 0;  // bytes: the CPU allocator's most during a step above its start
};
std::map<Split, SplitPeaks>& peak_bytes() {
  static std::map<Split, SplitPeaks> peaks;
  return peaks;
}

void BM_Split(benchmark::State& state, Split mode) {
  auto& s = stage();
  const auto params = s.params();
  const auto& c = s.config;
  auto x = at::randn({c.micro_batch, c.seq, c.hidden}).requires_grad_(true);
  auto gy = at::randn({c.micro_batch, c.seq, c.hidden});
  const bool sessions = mode == Split::kSession || mode == Split::kPrefire;
  SplitPeaks peak;
  const c10::Device cpu(c10::DeviceType::CPU);
  for (auto _ : state) {
    prefire::reset_runtime_peak();
    prefire::reset_allocator_peak(cpu);
    const int64_t allocated_before = prefire::allocator_bytes(cpu).current;
    prefire::HandleCollector collect;
    at::Tensor y;
    {
      prefire::SavedTensorMeter meter;
      y = x;
      for (const auto& blk : s.blocks) {
        y = mode == Split::kNone
                ? blk.forward(y)
                : prefire::checkpoint([&blk](const TensorList& in) { return TensorList{blk.forward(in[0])}; }, {y})[0];
      }
      meter.stop();
      for (const auto& h : collect.handles()) {
        if (mode == Split::kSession) prefire::attach(h, 0);
        if (mode == Split::kPrefire) prefire::prefire(h, 0);
      }
      std::optional<prefire::SessionScope> b_scope;
      if (sessions) b_scope.emplace(0, prefire::SessionOptions{true});
      auto split = prefire::backward_input({y}, {gy}, {x}, params);
      b_scope.reset();
      std::optional<prefire::SessionScope> w_scope;
      if (sessions) w_scope.emplace(0, prefire::SessionOptions{false});
      auto dw = split.weight_pass.run();
      w_scope.reset();
      if (sessions) prefire::clear_session(0);
      benchmark::DoNotOptimize(dw.data());
    }
    peak.census = std::max(peak.census, prefire::runtime_stats().peak_held_bytes);
    peak.allocator = std::max(peak.allocator, prefire::allocator_bytes(cpu).peak - allocated_before);
  }
  state.counters["peak_held_bytes"] = static_cast<double>(peak.census);
  state.counters["step_peak_bytes"] = static_cast<double>(peak.allocator);
  peak_bytes()[mode] = peak;
}
BENCHMARK_CAPTURE(BM_Split, None, Split::kNone)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Split, GraphTask, Split::kGraphTask)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Split, Session, Split::kSession)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Split, Prefire, Split::kPrefire)->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  prefire::install();
  prefire::count_cpu_allocations();  // before the stage is built: BM_Split's step peaks
  at::set_num_threads(1);
  prefire::bench::RatioReporter reporter;
  int rc = prefire::bench::run_with_ratios(
      argc, argv,
      {{"per call: checkpoint / no checkpoint (tiny block)", {"BM_Call_Checkpoint/Default", "BM_Call_NoCheckpoint"}},
       {"per call: without / with preserve_rng_state", {"BM_Call_Checkpoint/NoRngState", "BM_Call_Checkpoint/Default"}},
       {"per call: without / with the metadata check",
        {"BM_Call_Checkpoint/NoDeterminismCheck", "BM_Call_Checkpoint/Default"}},
       {"B/W split: session / graph-task (target <= 0.85)", {"BM_Split/Session", "BM_Split/GraphTask"}},
       {"B/W split: prefire / graph-task", {"BM_Split/Prefire", "BM_Split/GraphTask"}},
       {"B/W split: session / no checkpoint", {"BM_Split/Session", "BM_Split/None"}}},
      &reporter);
  const double checkpointed = reporter.ns("BM_Call_Checkpoint/Default");
  const struct {
    const char* label;
    const char* baseline;
    const char* what;
  } overheads[] = {
      {"per-call overhead (tiny block)", "BM_Call_NoCheckpoint", "checkpointed - unchecked, recomputation included"},
      {"per-call overhead beyond the recomputation", "BM_Call_RecomputeFloor",
       "checkpointed - recompute floor: hooks and prefire's work"},
      {"per-call overhead beyond hooks + recomputation", "BM_Call_HookedFloor",
       "checkpointed - hooked floor: prefire's work and the recomputation's hooks"},
      {"per-call overhead beyond hooks on both runs", "BM_Call_RecomputeHookedFloor",
       "checkpointed - both runs hooked: prefire's work"},
  };
  for (const auto& o : overheads) {
    const double baseline = reporter.ns(o.baseline);
    if (checkpointed > 0 && baseline > 0) {
      std::printf("  %-50s %.2f us (%s)\n", o.label, (checkpointed - baseline) / 1e3, o.what);
    }
  }
  if (checkpointed > 0) {  // Note [Per-call overhead on a shared machine]
    print_interleaved_overhead("ATen defaults");
    auto& context = at::globalContext();  // Note [The tiny block with and without oneDNN]
    const bool mkldnn = context.userEnabledMkldnn();
    context.setUserEnabledMkldnn(false);
    print_interleaved_overhead("oneDNN off");
    context.setUserEnabledMkldnn(mkldnn);
  }
  auto& peaks = peak_bytes();
  if (peaks.count(Split::kNone) && peaks[Split::kNone].allocator > 0 && peaks[Split::kNone].census > 0) {
    const SplitPeaks none = peaks[Split::kNone];
    for (const auto& [mode, name] : {std::pair{Split::kGraphTask, "graph-task"}, std::pair{Split::kSession, "session"},
                                     std::pair{Split::kPrefire, "prefire"}}) {
      if (!peaks.count(mode)) continue;
      std::printf("  memory: %-10s / no checkpoint: step peak (allocator) %.3f, census %.3f\n", name,
                  double(peaks[mode].allocator) / double(none.allocator), double(peaks[mode].census) / double(none.census));
    }
  }
  return rc;
}
