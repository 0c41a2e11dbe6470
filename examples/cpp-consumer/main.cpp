// A LibTorch program that uses an installed prefire: a checkpointed block
// whose gradients equal the unchecked block's, and a split backward (B then
// W) that shares one recomputation through a session. Exits non-zero when
// either does not hold.
#include <prefire/prefire.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdio>

namespace {

at::Tensor block(const at::Tensor& x, const at::Tensor& w) { return at::tanh(at::matmul(x, w)).sin(); }

}  // namespace

int main() {
  prefire::install();  // once, before the first backward
  at::manual_seed(0);
  const auto x = at::randn({4, 8}).requires_grad_(true);
  const auto w = at::randn({8, 8}).requires_grad_(true);

  // Unchecked, for reference.
  auto [dx_ref, dw_ref] = [&] {
    auto g = torch::autograd::grad({block(x, w).sum()}, {x, w});
    return std::pair{g[0], g[1]};
  }();

  // Checkpointed, with the handle collected, recomputed ahead of backward
  // into session 0, and shared by the input-gradient pass and the weight pass.
  prefire::HandleCollector collect;
  auto y = prefire::checkpoint([&](const prefire::TensorList& in) { return prefire::TensorList{block(in[0], w)}; },
                               {x})[0];
  auto handles = collect.handles();
  const auto before = prefire::runtime_stats().recomputations;
  for (const auto& h : handles) prefire::prefire(h, /*session=*/0);
  at::Tensor dx, dw;
  {
    prefire::SessionScope b(0, {/*retain_on_unpack=*/true});
    dx = torch::autograd::grad({y.sum()}, {x}, {}, /*retain_graph=*/true)[0];
  }
  {
    prefire::SessionScope w_pass(0, {/*retain_on_unpack=*/false});
    dw = torch::autograd::grad({y.sum()}, {w})[0];
  }
  prefire::clear_session(0);
  const auto recomputations = prefire::runtime_stats().recomputations - before;

  const bool equal = at::equal(dx, dx_ref) && at::equal(dw, dw_ref);
  std::printf("gradients equal to unchecked: %s; recomputations for two passes: %lld\n", equal ? "yes" : "no",
              static_cast<long long>(recomputations));
  return equal && recomputations == 1 ? 0 : 1;
}
