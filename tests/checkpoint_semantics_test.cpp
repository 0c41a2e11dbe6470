// Checkpoint semantics beyond gradients: early stop, RNG and autocast
// restore, user context hooks, determinism checks, in-place detection, double
// unpack, exceptions, option validation.
//
// Not covered here: CUDA generators and devices (cuda tests), the checksum
// determinism mode, sessions.

#include "test_support.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>

#include <chrono>
#include <string>
#include <thread>

namespace prefire::testing {
namespace {

using ::testing::HasSubstr;

at::Tensor input(int64_t n = 64) { return at::randn({4, n}).requires_grad_(true); }

struct UserError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---- early stop -----------------------------------------------------------------

int run_with_early_stop(bool early_stop, int* caught = nullptr) {
  int after_last_save = 0;
  CheckpointFn fn = [&](const TensorList& in) {
    try {
      auto a = in[0].sin();  // saves in[0]
      auto b = a.cos();      // saves a: the last save
      ++after_last_save;     // side effect after the last save
      return TensorList{b * 2.0};
    } catch (const std::exception&) {
      if (caught) ++*caught;
      throw;
    }
  };
  CheckpointOptions options;
  options.early_stop = early_stop;
  auto x = input();
  auto y = checkpoint(fn, {x}, options)[0];
  auto g = grads(y, {x});
  EXPECT_TRUE(at::allclose(g[0], grads((x.sin().cos() * 2.0), {x})[0]));
  return after_last_save;
}

TEST(CheckpointSemantics, EarlyStopSkipsWorkAfterLastSave) { EXPECT_EQ(run_with_early_stop(true), 1); }

TEST(CheckpointSemantics, NoEarlyStopRunsFunctionToTheEnd) { EXPECT_EQ(run_with_early_stop(false), 2); }

TEST(CheckpointSemantics, EarlyStopSignalIsNotAStdException) {
  int caught = 0;
  EXPECT_EQ(run_with_early_stop(true, &caught), 1);
  EXPECT_EQ(caught, 0) << "user code caught the early-stop signal as std::exception";
}

// See Note [Early stop]: where the code after the last save creates no
// autograd node and the last save is an output (its kernel ran), no stop is
// signalled and it runs again, however long it takes (the rule does not
// depend on timing). Counts its runs.
int runs_of_tail_without_autograd_work(std::chrono::microseconds tail) {
  int after_last_save = 0;
  CheckpointFn fn = [&](const TensorList& in) {
    auto b = in[0].sin().exp();  // saves in[0], then exp's result: the last save, after its kernel
    ++after_last_save;
    if (tail.count() > 0) std::this_thread::sleep_for(tail);
    return TensorList{b};
  };
  auto x = input();
  auto y = checkpoint(fn, {x})[0];
  expect_all_equal(grads(y, {x}), grads(x.sin().exp(), {x}));
  return after_last_save;
}

// Where the last save is an input of an op whose kernel has not run yet (a
// linear layer saves its input and weight before the GEMM) and that input is
// large, the recomputation stops there, and the kernel does not run again.
TEST(CheckpointSemantics, EarlyStopSkipsTheKernelOfALastOpThatSavedLargeInputs) {
  int after_last_op = 0;
  auto w = at::randn({128, 128}).requires_grad_(true);  // 16384 elements: Note [Early stop]
  CheckpointFn fn = [&](const TensorList& in) {
    auto out = at::mm(in[0].sin(), w);  // mm saves both inputs before its kernel: the last saves
    ++after_last_op;
    return TensorList{out};
  };
  auto x = at::randn({4, 128}).requires_grad_(true);
  auto y = checkpoint(fn, {x})[0];
  expect_all_equal(grads(y, {x, w}), grads(at::mm(x.sin(), w), {x, w}));
  EXPECT_EQ(after_last_op, 1) << "the recomputation ran the last op's kernel again";

  // on small inputs the kernel is cheaper than the stop: it runs again
  after_last_op = 0;
  auto small_w = at::randn({4, 4}).requires_grad_(true);
  CheckpointFn small = [&](const TensorList& in) {
    auto out = at::mm(in[0].sin(), small_w);
    ++after_last_op;
    return TensorList{out};
  };
  auto small_x = at::randn({4, 4}).requires_grad_(true);
  auto small_y = checkpoint(small, {small_x})[0];
  expect_all_equal(grads(small_y, {small_x, small_w}), grads(at::mm(small_x.sin(), small_w), {small_x, small_w}));
  EXPECT_EQ(after_last_op, 2);
}

TEST(CheckpointSemantics, TailWithoutAutogradWorkRunsAgainInsteadOfBeingStopped) {
  EXPECT_EQ(runs_of_tail_without_autograd_work(std::chrono::microseconds(0)), 2);
  EXPECT_EQ(runs_of_tail_without_autograd_work(std::chrono::milliseconds(2)), 2);
}

// See Note [Backward inside the checkpointed function]: a backward run inside
// `fn` unpacks what the frame saved so far; it gets a recomputation of that
// part, and backward of the whole checkpoint recomputes as usual.
TEST(CheckpointSemantics, BackwardInsideTheCheckpointedFunction) {
  int runs = 0;
  CheckpointFn fn = [&](const TensorList& in) {
    ++runs;
    auto a = in[0].sin().exp();
    auto inner = torch::autograd::grad({a.sum()}, {in[0]}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    return TensorList{(a * inner).cos()};
  };
  auto unchecked = [](const at::Tensor& x) {
    auto a = x.sin().exp();
    auto inner = torch::autograd::grad({a.sum()}, {x}, {}, true, true)[0];
    return (a * inner).cos();
  };
  auto x = input();
  auto expected = grads(unchecked(x), {x});
  auto y = checkpoint(fn, {x})[0];
  EXPECT_EQ(runs, 2) << "forward and the inner backward's recomputation of the part saved so far";
  expect_all_equal(grads(y, {x}), expected);
  EXPECT_EQ(runs, 3);
}

// ---- RNG --------------------------------------------------------------------------

TensorList dropout_grads(bool preserve_rng_state, bool checkpointed) {
  at::manual_seed(11);
  auto x = input(256);
  CheckpointFn fn = [](const TensorList& in) { return TensorList{at::dropout(in[0].sin(), 0.5, true)}; };
  CheckpointOptions options;
  options.preserve_rng_state = preserve_rng_state;
  auto y = checkpointed ? checkpoint(fn, {x}, options)[0] : fn({x})[0];
  at::rand({1000});  // other random work between forward and backward
  return grads(y, {x});
}

TEST(CheckpointSemantics, DropoutMasksIdenticalWithPreservedRngState) {
  expect_all_equal(dropout_grads(true, true), dropout_grads(true, false));
}

TEST(CheckpointSemantics, DropoutMasksDifferWithoutPreservedRngState) {
  // Documented: the metadata check cannot see a different mask (same shapes);
  // the gradients differ.
  auto unchecked = dropout_grads(false, false)[0];
  auto checked = dropout_grads(false, true)[0];
  EXPECT_FALSE(at::equal(checked, unchecked));
}

TEST(CheckpointSemantics, CallerRngStateUnchangedByRecompute) {
  at::manual_seed(12);
  auto x = input();
  auto y = checkpoint([](const TensorList& in) { return TensorList{at::dropout(in[0], 0.3, true).sin()}; }, {x})[0];
  at::rand({17});
  auto before = cpu_rng_state();
  grads(y, {x});
  EXPECT_TRUE(at::equal(cpu_rng_state(), before));
}

// ---- autocast ---------------------------------------------------------------------

struct CpuAutocast {
  bool was_enabled = at::autocast::is_autocast_enabled(at::kCPU);
  at::ScalarType was_dtype = at::autocast::get_autocast_dtype(at::kCPU);
  explicit CpuAutocast(at::ScalarType dtype) {
    at::autocast::set_autocast_dtype(at::kCPU, dtype);
    at::autocast::set_autocast_enabled(at::kCPU, true);
  }
  ~CpuAutocast() {
    at::autocast::set_autocast_enabled(at::kCPU, was_enabled);
    at::autocast::set_autocast_dtype(at::kCPU, was_dtype);
    at::autocast::clear_cache();
  }
};

TEST(CheckpointSemantics, CpuAutocastReappliedInRecomputeOutsideAutocast) {
  at::manual_seed(13);
  auto x = input(32);
  auto w = param({32, 32});
  CheckpointFn fn = [&](const TensorList& in) { return TensorList{at::linear(in[0], w).sin()}; };
  TensorList expected;
  {
    CpuAutocast autocast(at::kBFloat16);
    auto y = fn({x})[0];
    ASSERT_EQ(y.scalar_type(), at::kBFloat16);
    expected = grads(y, {x, w}, /*retain_graph=*/true);
  }
  at::Tensor y;
  {
    CpuAutocast autocast(at::kBFloat16);
    y = checkpoint(fn, {x})[0];
  }
  ASSERT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  // Recomputed without autocast, the saved tensors would be float32 and the
  // metadata check would raise; with it, gradients match bit for bit.
  expect_all_equal(grads(y, {x, w}), expected);
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU)) << "recompute leaked its autocast state";
  EXPECT_EQ(at::autocast::increment_nesting(), 1) << "recompute left an autocast region open";
  at::autocast::decrement_nesting();
}

// See Note [Autocast's cast cache in recomputation]. The main thread holds an
// autocast region (its cast of w cached) while a prefire on another thread
// recomputes under autocast: the recomputation must not read that cast, and
// must not clear it when it ends.
TEST(CheckpointSemantics, AutocastRecomputationNeitherReadsNorClearsAnotherRegionsCastCache) {
  at::manual_seed(14);
  auto x = input(32);
  auto w = param({32, 32});
  std::atomic<int> calls{0};
  at::Tensor cast_in_recompute;
  CheckpointFn fn = [&](const TensorList& in) {
    if (++calls == 2) cast_in_recompute = at::autocast::cached_cast(at::kBFloat16, w, at::kCPU);
    return TensorList{at::linear(in[0], w).sin()};
  };
  CpuAutocast autocast(at::kBFloat16);
  at::autocast::increment_nesting();  // the main thread's region
  auto cached = at::autocast::cached_cast(at::kBFloat16, w, at::kCPU);
  ASSERT_EQ(at::autocast::cached_cast(at::kBFloat16, w, at::kCPU).data_ptr(), cached.data_ptr());
  HandleCollector collect;
  auto y = checkpoint(fn, {x})[0];
  std::thread([&] { prefire(collect.handles().at(0), 40); }).join();
  ASSERT_EQ(calls.load(), 2);
  EXPECT_NE(cast_in_recompute.data_ptr(), cached.data_ptr()) << "the recomputation read another region's cast";
  EXPECT_EQ(at::autocast::cached_cast(at::kBFloat16, w, at::kCPU).data_ptr(), cached.data_ptr())
      << "the recomputation cleared another region's cast cache";
  at::autocast::decrement_nesting();
  TensorList g;
  {
    SessionScope scope(40, {false});
    g = grads(y.to(at::kFloat), {x, w});
  }
  clear_session(40);
  EXPECT_TRUE(g[0].defined() && g[1].defined());
}

// ---- intra-op threads -------------------------------------------------------------

// A function whose saved tensor is a sum: CPU reductions split by the
// intra-op thread count, so its last bits can depend on that count.
CheckpointFn thread_sensitive(std::atomic<int>* recompute_threads) {
  return [recompute_threads](const TensorList& in) {
    if (recompute_threads != nullptr) *recompute_threads = at::get_num_threads();
    return TensorList{in[0] * in[0].sum()};
  };
}

// A vector whose sum gives other bits under 4 intra-op threads than under
// kTestThreads, or std::nullopt where no length tried does. Whether a length
// does depends on the CPU's kernels: ATen's per-thread chunks can line up
// with its cascade summation (2^22 floats sum alike under 1 and 4 threads with
// ATEN_CPU_CAPABILITY=default, and apart with AVX2), so lengths that split
// unevenly come first.
std::optional<at::Tensor> sum_depends_on_thread_count() {
  for (int64_t n : {4206649, 3000017, 5111111, 1 << 22}) {
    at::manual_seed(14);
    auto x = at::randn({n});
    at::Tensor here = x.sum(), other;
    pinned_thread([&] {
      at::set_num_threads(4);
      other = x.sum();
    }).join();
    if (!at::equal(here, other)) return x;
  }
  return std::nullopt;
}

TEST(CheckpointSemantics, RecomputationRunsUnderForwardsThreadCountOnAThreadWithAnother) {
  // With such an input a recomputation under the wrong count is caught by its
  // bits too (the checksum check, the gradient), not only by the count it saw.
  const std::optional<at::Tensor> sensitive = sum_depends_on_thread_count();
  auto x = (sensitive ? *sensitive : at::randn({1 << 12})).requires_grad_(true);
  auto gy = at::randn(x.sizes());

  // The reference: forward here, backward on a thread with 4 intra-op threads.
  // The backward of x * s is elementwise, so only s's bits can differ.
  TensorList expected, actual;
  std::atomic<int> seen{0};
  auto backward_with_4_threads = [&](const at::Tensor& y, TensorList& out) {
    pinned_thread([&] {
      at::set_num_threads(4);
      EXPECT_NO_THROW(out = torch::autograd::grad({y}, {x}, {gy}));
      EXPECT_EQ(at::get_num_threads(), 4) << "the recomputation did not put the thread's count back";
    }).join();
  };
  backward_with_4_threads(thread_sensitive(nullptr)({x})[0], expected);
  CheckpointOptions options;
  options.determinism_check = DeterminismCheck::kChecksum;  // forward's bits, checked at recompute
  backward_with_4_threads(checkpoint(thread_sensitive(&seen), {x}, options)[0], actual);
  EXPECT_EQ(seen, kTestThreads) << "the recomputation ran under the backward thread's count";
  expect_all_equal(actual, expected);
  if (!sensitive) {
    GTEST_SKIP() << "the count was checked, the bits were not: no length tried sums to other bits under 4 "
                    "intra-op threads than under "
                 << kTestThreads << " on this CPU";
  }
}

// ---- context hooks --------------------------------------------------------------

TEST(CheckpointSemantics, ContextFnHooksWrapForwardAndRecomputeInOrder) {
  std::vector<std::string> events;
  auto guard = [&](std::string name) {
    events.push_back(name + " enter");
    return ContextGuard(nullptr, [&events, name](void*) { events.push_back(name + " exit"); });
  };
  CheckpointOptions options;
  options.context_fn.forward = [&] { return guard("forward"); };
  options.context_fn.recompute = [&] { return guard("recompute"); };
  auto x = input();
  auto y = checkpoint([&](const TensorList& in) {
        events.push_back("fn");
        return TensorList{in[0].sin()};
      }, {x}, options)[0];
  grads(y, {x});
  EXPECT_EQ(events, (std::vector<std::string>{"forward enter", "fn", "forward exit", "recompute enter", "fn",
                                                "recompute exit"}));
}

// ---- determinism check ------------------------------------------------------------

// A function whose second run narrows its input differently.
CheckpointFn shape_changing(int& runs) {
  return [&runs](const TensorList& in) {
    int64_t n = runs++ == 0 ? 8 : 6;
    return TensorList{in[0].narrow(1, 0, n).sin().sum(1)};
  };
}

TEST(CheckpointSemantics, MetadataMismatchRaisesCheckpointErrorNamingSlot) {
  int runs = 0;
  auto x = input();
  auto y = checkpoint(shape_changing(runs), {x})[0];
  const std::string message = message_of([&] { grads(y, {x}); });
  EXPECT_THAT(message, HasSubstr("saved tensor 0"));
  EXPECT_THAT(message, HasSubstr("[4, 8]"));
  EXPECT_THAT(message, HasSubstr("[4, 6]"));
}

TEST(CheckpointSemantics, FewerSavesInRecomputeRaisesCheckpointError) {
  int runs = 0;
  CheckpointFn fn = [&](const TensorList& in) {
    auto a = in[0].sin();
    if (runs++ == 0) a = a.cos();  // forward saves twice, recompute once
    return TensorList{a * 3.0};
  };
  auto x = input();
  auto y = checkpoint(fn, {x})[0];
  const std::string message = message_of([&] { grads(y, {x}); });
  EXPECT_THAT(message, HasSubstr("fewer tensors than forward did (forward saved 2, recompute 1)"));
}

TEST(CheckpointSemantics, MoreSavesInRecomputeRaisesCheckpointError) {
  int runs = 0;
  CheckpointFn fn = [&](const TensorList& in) {
    auto a = in[0].sin();
    if (runs++ > 0) a = a.cos();  // recompute saves one more
    return TensorList{a * 3.0};
  };
  CheckpointOptions options;
  options.early_stop = false;  // with early stop the extra save is never reached
  auto x = input();
  auto y = checkpoint(fn, {x}, options)[0];
  const std::string message = message_of([&] { grads(y, {x}); });
  EXPECT_THAT(message, HasSubstr("more tensors than forward did (forward saved 1"));
}

TEST(CheckpointSemantics, DeterminismNoneLetsAMetadataChangePass) {
  // The recomputation saves a float64 tensor where forward saved float32; the
  // backward copes (autograd casts the gradient back), and `none` trusts it.
  int runs = 0;
  CheckpointFn fn = [&](const TensorList& in) {
    auto t = runs++ == 0 ? in[0] : in[0].to(at::kDouble);
    return TensorList{t.sin().to(at::kFloat)};
  };
  auto x = input();
  CheckpointOptions options;
  options.determinism_check = DeterminismCheck::kNone;
  auto y = checkpoint(fn, {x}, options)[0];
  TensorList g;
  ASSERT_NO_THROW(g = grads(y, {x}));
  EXPECT_TRUE(at::allclose(g[0], grads(x.sin(), {x})[0]));

  runs = 0;
  auto y2 = checkpoint(fn, {x})[0];  // default: metadata
  EXPECT_THROW(grads(y2, {x}), CheckpointError);
}

// ---- misuse ---------------------------------------------------------------------

TEST(CheckpointSemantics, InputModifiedInPlaceAfterForwardRaises) {
  auto x = input();
  auto h = x * 2.0;  // a non-leaf the user may modify
  auto y = checkpoint([](const TensorList& in) { return TensorList{in[0].sin()}; }, {h})[0];
  h.add_(1.0);
  const std::string message = message_of([&] { grads(y, {x}); });
  EXPECT_THAT(message, HasSubstr("input 0 of a checkpoint was modified in place"));
}

TEST(CheckpointSemantics, SlotUnpackedTwiceInOneBackwardRaises) {
  auto x = input();
  auto y = checkpoint([](const TensorList& in) { return TensorList{ReadsSavedTwice::apply(in[0].sin())}; }, {x})[0];
  const std::string message = message_of([&] { grads(y, {x}); });
  EXPECT_THAT(message, HasSubstr("unpacked a second time in this backward"));
}

// After a failure, nothing of prefire may stay on this thread: a plain graph
// keeps its saved tensors, and a new checkpoint works.
void expect_clean_thread_state() {
  StorageWatch watch;
  auto x = input();
  auto h = x.sin();
  watch.watch(h);
  auto y = h.cos();  // saves h
  h.reset();
  EXPECT_EQ(watch.alive(), 1u) << "a plain saved tensor was packed by a leftover checkpoint context";
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  auto z = checkpoint([](const TensorList& in) { return TensorList{in[0].sin().cos()}; }, {x})[0];
  expect_all_equal(grads(z, {x}), grads(x.sin().cos(), {x}));
}

TEST(CheckpointSemantics, ExceptionInForwardLeavesNoState) {
  auto x = input();
  CheckpointFn fn = [](const TensorList& in) -> TensorList {
    auto a = in[0].sin();
    throw UserError("boom in forward");
  };
  EXPECT_THROW(checkpoint(fn, {x}), UserError);
  expect_clean_thread_state();
}

TEST(CheckpointSemantics, ExceptionInRecomputeLeavesNoStateAndRestoresRng) {
  int runs = 0;
  CheckpointFn fn = [&](const TensorList& in) {
    auto a = at::dropout(in[0], 0.5, true);  // draws random numbers, then saves
    if (runs++ > 0) throw UserError("boom in recompute");  // before the last save: early stop cannot skip it
    return TensorList{a.sin()};
  };
  auto x = input();
  auto y = checkpoint(fn, {x})[0];
  auto before = cpu_rng_state();
  EXPECT_THROW(grads(y, {x}), UserError);
  EXPECT_TRUE(at::equal(cpu_rng_state(), before)) << "the failed recompute left the forward's RNG state";
  expect_clean_thread_state();
}

// ---- options --------------------------------------------------------------------

TEST(CheckpointOptionsTest, ParseDeterminismCheck) {
  EXPECT_EQ(parse_determinism_check("none"), DeterminismCheck::kNone);
  EXPECT_EQ(parse_determinism_check("metadata"), DeterminismCheck::kMetadata);
  EXPECT_STREQ(to_string(DeterminismCheck::kMetadata), "metadata");
  const std::string message = message_of<std::invalid_argument>([&] { parse_determinism_check("sometimes"); });
  EXPECT_THAT(message, HasSubstr("determinism_check"));
  EXPECT_THAT(message, HasSubstr("sometimes"));
}

TEST(CheckpointOptionsTest, EmptyFunctionRaises) {
  EXPECT_THROW(checkpoint(CheckpointFn(), {input()}), std::invalid_argument);
}

TEST(CheckpointOptionsTest, OutOfRangeDeterminismCheckRaisesNamingTheOption) {
  CheckpointOptions options;
  options.determinism_check = static_cast<DeterminismCheck>(42);
  const std::string message = message_of<std::invalid_argument>(
      [&] { checkpoint([](const TensorList& in) { return in; }, {input()}, options); });
  EXPECT_THAT(message, HasSubstr("determinism_check"));
}

}  // namespace
}  // namespace prefire::testing
