// checkpoint() without prefire::install(): a clear CheckpointError, never a
// silent save-everything. Each test runs in a process of its own (ctest), so
// each starts with the base engine.

#include <prefire/prefire.h>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace {

prefire::TensorList sin_fn(const prefire::TensorList& in) { return {in[0].sin()}; }

TEST(NotInstalled, CheckpointRaisesCheckpointErrorNamingInstall) {
  EXPECT_FALSE(prefire::is_installed());
  auto x = at::randn({3}).requires_grad_(true);
  try {
    prefire::checkpoint(sin_fn, {x});
    FAIL() << "expected CheckpointError";
  } catch (const prefire::CheckpointError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("prefire::install()"));
  }
}

TEST(NotInstalled, InstallIsIdempotentAndEnablesCheckpoint) {
  prefire::install();
  prefire::install();
  EXPECT_TRUE(prefire::is_installed());
  auto x = at::randn({3}).requires_grad_(true);
  auto y = prefire::checkpoint(sin_fn, {x})[0];
  y.sum().backward();
  EXPECT_TRUE(at::allclose(x.grad(), x.cos()));
}

}  // namespace
