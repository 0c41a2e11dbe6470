// SavedTensorMeter: counts the bytes autograd's saved tensors hold, per
// storage, and keeps autograd's in-place check.
//
// Not covered here: CUDA tensors (the meter is device-agnostic: it reads
// storage sizes only).

#include "test_support.h"

namespace prefire::testing {
namespace {

// A non-leaf: what a stage computes. (Leaves that require grad are not counted.)
at::Tensor activation(at::IntArrayRef sizes) { return at::randn(sizes).requires_grad_(true) * 1.0; }

TEST(SavedTensorMeter, CountsEachSavedStorageOnceUntilReleased) {
  auto x = activation({4, 64});  // 1 KiB
  SavedTensorMeter meter;
  auto a = x.sin();  // saves x
  auto b = x.cos();  // saves x again: same storage
  auto c = a * b;    // saves a and b
  meter.stop();
  EXPECT_EQ(meter.saved_tensors(), 4);
  EXPECT_EQ(meter.current_bytes(), 3 * 1024);
  EXPECT_EQ(meter.peak_bytes(), 3 * 1024);
  a.reset();
  b.reset();
  c.reset();  // the graph goes, and its saved tensors with it
  EXPECT_EQ(meter.current_bytes(), 0);
  EXPECT_EQ(meter.peak_bytes(), 3 * 1024);
}

TEST(SavedTensorMeter, ParametersAreNotActivationMemory) {
  auto w = at::randn({64, 64}).requires_grad_(true);
  auto x = activation({4, 64});
  SavedTensorMeter meter;
  int64_t held_before = runtime_stats().held_bytes;
  auto y = at::linear(x, w);  // saves x and w
  meter.stop();
  EXPECT_EQ(meter.saved_tensors(), 2);
  EXPECT_EQ(meter.current_bytes(), 1024);
  EXPECT_EQ(runtime_stats().held_bytes - held_before, 1024);
}

TEST(SavedTensorMeter, CheckpointedBlockSavesOnlyItsInput) {
  at::manual_seed(21);
  Block block(16, 0.0);
  auto x = activation({2, 8, 16});
  int64_t plain, checkpointed;
  {
    SavedTensorMeter meter;
    auto y = block.forward(x);
    meter.stop();
    plain = meter.current_bytes();
  }
  {
    SavedTensorMeter meter;
    auto y = checkpoint(block.fn(), {x})[0];
    meter.stop();
    checkpointed = meter.current_bytes();
    grads(y, block.params());
  }
  EXPECT_EQ(checkpointed, static_cast<int64_t>(x.nbytes()));
  EXPECT_GT(plain, 10 * checkpointed);
}

TEST(SavedTensorMeter, KeepsAutogradsInPlaceCheck) {
  auto x = at::randn({8}).requires_grad_(true);
  SavedTensorMeter meter;
  auto h = x.sin();
  auto y = h.cos();  // saves h
  meter.stop();
  h.add_(1.0);
  EXPECT_THAT(message_of<c10::Error>([&] { grads(y, {x}); }), ::testing::HasSubstr("modified by an inplace operation"));
}

TEST(SavedTensorMeter, StoppedOutOfOrderTheOtherMeterKeepsCounting) {
  auto x = activation({4, 64});  // 1 KiB
  SavedTensorMeter outer;
  SavedTensorMeter inner;
  outer.stop();      // below `inner` on the stack: unlinked where it is
  auto a = x.sin();  // saves x: inner's
  inner.stop();
  auto b = x.cos();  // no meter active: not counted by either
  EXPECT_EQ(outer.saved_tensors(), 0);
  EXPECT_EQ(inner.saved_tensors(), 1);
  EXPECT_EQ(inner.current_bytes(), 1024);
}

TEST(SavedTensorMeter, StopOnAnotherThreadRaisesAndLeavesTheMeterActive) {
  auto x = activation({4, 64});
  SavedTensorMeter meter;
  std::string message;
  pinned_thread([&] { message = message_of<std::logic_error>([&] { meter.stop(); }); }).join();
  EXPECT_THAT(message, ::testing::HasSubstr("another thread"));
  auto a = x.sin();
  EXPECT_EQ(meter.saved_tensors(), 1);
  meter.stop();
}

TEST(SavedTensorMeterDeathTest, DestroyedOnAnotherThreadIsAFatalMisuse) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(delete_on_another_thread(new SavedTensorMeter()), "fatal misuse: a saved-tensor hook context");
}

}  // namespace
}  // namespace prefire::testing
