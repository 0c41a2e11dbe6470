// The test binary's main: installs prefire's engine before any backward runs
// and fixes the intra-op thread count so CPU gradients are bit-reproducible.

#include <prefire/install.h>

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  prefire::install();
  at::set_num_threads(1);
  return RUN_ALL_TESTS();
}
