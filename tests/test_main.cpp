// The test binary's main: installs prefire's engine before any backward runs
// and fixes the intra-op thread count so CPU gradients are bit-reproducible
// (threads the tests start pin it too: pinned_thread in test_support.h).

#include "test_support.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  prefire::install();
  at::set_num_threads(prefire::testing::kTestThreads);
  return RUN_ALL_TESTS();
}
