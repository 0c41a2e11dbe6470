// Cost per saved tensor. Pack: a checkpoint's forward of a function that
// saves kSaved tensors, against the same function unchecked. Unpack: served
// from a session with 1 and with 1000 live sessions (the hot path reads
// checkpoint fields only, so the count of sessions must not matter), and
// autograd's own unpack without hooks for scale (it returns the saved tensor
// itself; a hooked unpack makes a new tensor object, as with any saved-tensor
// hook).
//
//   build/benchmarks/prefire_saved_tensor_benchmark

#include <prefire/prefire.h>

#include "ratio_reporter.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <memory>
#include <vector>

namespace {

using prefire::TensorList;
constexpr int kSaved = 64;  // saved tensors per checkpoint

// Saves its input kSaved times: one slot each.
struct SaveMany : torch::autograd::Function<SaveMany> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x) {
    ctx->save_for_backward(TensorList(kSaved, x));
    return x.clone();
  }
  static TensorList backward(torch::autograd::AutogradContext*, TensorList g) { return g; }
};

using SaveManyNode = torch::autograd::CppNode<SaveMany>;

struct Checkpointed {
  at::Tensor y;
  prefire::CheckpointHandle handle;
  SaveManyNode* node() const { return dynamic_cast<SaveManyNode*>(y.grad_fn().get()); }
};

Checkpointed make_checkpoint() {
  auto x = at::randn({16}).requires_grad_(true);
  prefire::HandleCollector collect;
  auto y = prefire::checkpoint([](const TensorList& in) { return TensorList{SaveMany::apply(in[0].sin())}; }, {x})[0];
  return {y, collect.handles().at(0)};
}

// Sessions 1..n-1 each hold a prefired checkpoint; session 0 is measured.
void BM_Unpack_SessionHit(benchmark::State& state) {
  const int live = static_cast<int>(state.range(0));
  std::vector<Checkpointed> others;
  for (int id = 1; id < live; ++id) {
    others.push_back(make_checkpoint());
    prefire::prefire(others.back().handle, id);
  }
  auto measured = make_checkpoint();
  prefire::prefire(measured.handle, 0);
  {
    prefire::SessionScope scope(0, {/*retain_on_unpack=*/true});
    for (auto _ : state) {
      auto saved = measured.node()->ctx_.get_saved_variables();
      benchmark::DoNotOptimize(saved.data());
    }
  }
  state.SetItemsProcessed(state.iterations() * kSaved);
  for (int id = 0; id < live; ++id) prefire::clear_session(id);
}
BENCHMARK(BM_Unpack_SessionHit)->Arg(1)->Arg(1000);

// Pack: the forward of a checkpoint whose function saves kSaved tensors.
void BM_Pack_Checkpoint(benchmark::State& state) {
  auto x = at::randn({16}).requires_grad_(true);
  for (auto _ : state) {
    auto y = prefire::checkpoint([](const TensorList& in) { return TensorList{SaveMany::apply(in[0])}; }, {x});
    benchmark::DoNotOptimize(y.data());
  }
  state.SetItemsProcessed(state.iterations() * kSaved);
}
BENCHMARK(BM_Pack_Checkpoint);

void BM_Pack_NoCheckpoint(benchmark::State& state) {
  auto x = at::randn({16}).requires_grad_(true);
  for (auto _ : state) {
    auto y = SaveMany::apply(x);
    benchmark::DoNotOptimize(y);
  }
  state.SetItemsProcessed(state.iterations() * kSaved);
}
BENCHMARK(BM_Pack_NoCheckpoint);

// Autograd's own unpack of the same node, no checkpoint: the floor.
void BM_Unpack_NoCheckpoint(benchmark::State& state) {
  auto x = at::randn({16}).requires_grad_(true);
  auto y = SaveMany::apply(x.sin());
  auto* node = dynamic_cast<SaveManyNode*>(y.grad_fn().get());
  for (auto _ : state) {
    auto saved = node->ctx_.get_saved_variables();
    benchmark::DoNotOptimize(saved.data());
  }
  state.SetItemsProcessed(state.iterations() * kSaved);
}
BENCHMARK(BM_Unpack_NoCheckpoint);

}  // namespace

int main(int argc, char** argv) {
  prefire::install();
  at::set_num_threads(1);
  return prefire::bench::run_with_ratios(
      argc, argv,
      {{"pack: checkpoint / no checkpoint, per saved tensor", {"BM_Pack_Checkpoint", "BM_Pack_NoCheckpoint"}},
       {"session hit, 1000 live sessions / 1 live session",
        {"BM_Unpack_SessionHit/1000", "BM_Unpack_SessionHit/1"}},
       {"session hit / autograd's unhooked unpack", {"BM_Unpack_SessionHit/1", "BM_Unpack_NoCheckpoint"}}});
}
