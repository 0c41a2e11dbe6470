// How much recomputation prefire hides behind an idle window (GPU only).
//
// A stack of transformer blocks on the GPU; each step is forward, a pipeline
// receive (a sleep kernel on a receive stream, as long as the stack's
// forward, starting when forward is done; the main stream waits for it before
// backward), then backward:
//   (a) Lazy:     checkpointed, recomputation inside backward;
//   (b) Prefire:  checkpointed, prefire issued after the receive is posted and
//                 before the main stream waits for it, as a pipeline stage
//                 would: the prefire stream recomputes during the receive;
//   (c) NoCkpt:   no checkpoint.
// Printed: hidden fraction H = (a - b) / (a - c) (target >= 0.8) and, with
// no window, the compute-bound ratio b / a (target <= 1.02).
// Step times are CUDA-event times on the main stream (UseManualTime).
//
//   build/benchmarks/prefire_overlap_benchmark

#include <prefire/prefire.h>

#include "model.h"
#include "ratio_reporter.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/Event.h>
#include <torch/csrc/autograd/autograd.h>

#if PREFIRE_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace {

using prefire::TensorList;

constexpr int kLayers = 8;
constexpr int64_t kDim = 1024, kSeq = 1024, kBatch = 8, kHeads = 16;

enum class Mode { kLazy, kPrefire, kNoCheckpoint };

#if PREFIRE_WITH_CUDA

struct Model {
  std::unique_ptr<prefire_bench::Stage> stage;
  at::Tensor x, gy;
  int64_t window_cycles = 0;
};

Model& model() {
  static Model m = [] {
    prefire_bench::ModelConfig c;
    c.layers = kLayers, c.hidden = kDim, c.heads = kHeads, c.seq = kSeq, c.micro_batch = kBatch, c.dropout = 0.1;
    c.dtype = at::kBFloat16;
    Model m;
    m.stage = std::make_unique<prefire_bench::Stage>(c, at::Device(at::kCUDA, 0), /*seed=*/0);
    auto o = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
    m.x = at::randn({kBatch, kSeq, kDim}, o).requires_grad_(true);
    m.gy = at::randn({kBatch, kSeq, kDim}, o);
    return m;
  }();
  return m;
}

double elapsed_ms(const std::function<void()>& work) {
  auto stream = c10::cuda::getCurrentCUDAStream();
  c10::Event start(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
  c10::Event end(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
  start.record(stream.unwrap());
  work();
  end.record(stream.unwrap());
  end.synchronize();
  return start.elapsedTime(end);
}

/// A pipeline receive: `cycles` of a sleep kernel on a stream of its own,
/// starting when the main stream's forward is done (the stage sent its
/// activations; the gradient comes back after the next stage's work).
/// wait() makes the main stream wait for it, as a stage waits for the
/// activation gradient of the next stage.
class Receive {
 public:
  explicit Receive(int64_t cycles) {
    if (cycles <= 0) return;
    static const c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, 0);
    c10::Event forward_done(c10::DeviceType::CUDA);
    forward_done.record(c10::cuda::getCurrentCUDAStream().unwrap());
    forward_done.block(stream.unwrap());
    c10::cuda::CUDAStreamGuard on(stream);
    at::cuda::sleep(cycles);
    done_.record(stream.unwrap());
    posted_ = true;
  }
  void wait() {
    if (posted_) done_.block(c10::cuda::getCurrentCUDAStream().unwrap());
  }

 private:
  c10::Event done_{c10::DeviceType::CUDA};
  bool posted_ = false;
};

at::Tensor forward(Mode mode, std::vector<prefire::CheckpointHandle>* handles) {
  auto& m = model();
  prefire::HandleCollector collect;
  at::Tensor h = m.x;
  for (const auto& b : m.stage->blocks) {
    h = mode == Mode::kNoCheckpoint
            ? b.forward(h)
            : prefire::checkpoint([&b](const TensorList& in) { return TensorList{b.forward(in[0])}; }, {h})[0];
  }
  if (handles) *handles = collect.handles();
  return h;
}

void step(Mode mode, bool window) {
  auto& m = model();
  std::vector<prefire::CheckpointHandle> handles;
  auto y = forward(mode, &handles);
  Receive receive(window ? m.window_cycles : 0);
  if (mode == Mode::kPrefire) {
    for (const auto& h : handles) prefire::prefire(h, 0);  // recomputes while the receive is in flight
  }
  receive.wait();
  std::optional<prefire::SessionScope> scope;
  if (mode == Mode::kPrefire) scope.emplace(0, prefire::SessionOptions{false});
  torch::autograd::backward({y}, {m.gy});
  scope.reset();
  prefire::clear_session(0);
}

// Calibrates the window: as long as the stack's forward (what recomputation
// costs), measured after warm-up (the first no-grad forwards load kernels).
void calibrate() {
  auto& m = model();
  if (m.window_cycles > 0) return;
  for (int i = 0; i < 3; ++i) step(Mode::kNoCheckpoint, false);
  auto no_grad_forward = [] {
    c10::NoGradGuard no_grad;
    forward(Mode::kNoCheckpoint, nullptr);
  };
  for (int i = 0; i < 3; ++i) elapsed_ms(no_grad_forward);
  double forward_ms = 0;
  for (int i = 0; i < 5; ++i) forward_ms += elapsed_ms(no_grad_forward) / 5;
  const int64_t probe = 10'000'000;
  elapsed_ms([&] { at::cuda::sleep(probe); });
  double probe_ms = elapsed_ms([&] { at::cuda::sleep(probe); });
  m.window_cycles = static_cast<int64_t>(probe * (forward_ms / probe_ms));
  std::printf("window: %.3f ms (the stack's forward, no grad)\n", forward_ms);
}

void BM_Step(benchmark::State& state, Mode mode, bool window) {
  if (!prefire::cuda_available()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  calibrate();
  for (int i = 0; i < 2; ++i) step(mode, window);  // warm-up: allocator, pool, autotuning
  for (auto _ : state) state.SetIterationTime(elapsed_ms([&] { step(mode, window); }) / 1e3);
}

#else

void BM_Step(benchmark::State& state, Mode, bool) { state.SkipWithError("prefire was built without CUDA"); }

#endif

BENCHMARK_CAPTURE(BM_Step, Lazy_Window, Mode::kLazy, true)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Step, Prefire_Window, Mode::kPrefire, true)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Step, NoCkpt_Window, Mode::kNoCheckpoint, true)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Step, Lazy_NoWindow, Mode::kLazy, false)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Step, Prefire_NoWindow, Mode::kPrefire, false)->UseManualTime()->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  prefire::install();
  prefire::bench::RatioReporter reporter;
  int rc = prefire::bench::run_with_ratios(
      argc, argv, {{"compute-bound ratio b/a (no window; target <= 1.02)",
                    {"BM_Step/Prefire_NoWindow/manual_time", "BM_Step/Lazy_NoWindow/manual_time"}}},
      &reporter);
  double a = reporter.ns("BM_Step/Lazy_Window/manual_time");
  double b = reporter.ns("BM_Step/Prefire_Window/manual_time");
  double c = reporter.ns("BM_Step/NoCkpt_Window/manual_time");
  if (a > 0 && b > 0 && c > 0 && a > c) {
    std::printf("  %-48s (%.3f - %.3f) / (%.3f - %.3f) ms = %.3f\n", "hidden fraction H (target >= 0.8)", a / 1e6,
                b / 1e6, a / 1e6, c / 1e6, (a - b) / (a - c));
  } else {
    std::printf("  hidden fraction H: skipped (needs a GPU)\n");
  }
  return rc;
}
