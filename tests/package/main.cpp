// Uses an installed prefire through find_package(prefire): one checkpoint,
// one backward, the gradient of sin.
#include <prefire/prefire.h>
#include <ATen/ATen.h>
int main() {
  prefire::install();
  auto x = at::randn({3}).requires_grad_(true);
  auto y = prefire::checkpoint([](const prefire::TensorList& in) { return prefire::TensorList{in[0].sin()}; }, {x})[0];
  y.sum().backward();
  return at::allclose(x.grad(), x.cos()) ? 0 : 1;
}
