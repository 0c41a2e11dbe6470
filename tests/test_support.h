#pragma once

// Helpers shared by the tests: a transformer-style block whose parameters are
// captured by the checkpointed function, gradient helpers, and weak references
// to storages to observe what stays alive.

#include <prefire/prefire.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <c10/core/Storage.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace prefire::testing {

using TensorList = std::vector<at::Tensor>;

/// The intra-op thread count of every thread the tests run on (main pins it
/// too). CPU bits depend on it: reductions and GEMMs split their work by it.
constexpr int kTestThreads = 1;

/// A std::thread running `f` with the intra-op thread count pinned to
/// kTestThreads. A new thread otherwise runs with the machine's defaults (MKL
/// uses all cores until ATen's lazy initialization runs on that thread), and a
/// bit-equality test would pass or fail by machine.
template <typename F, typename... Args>
std::thread pinned_thread(F&& f, Args&&... args) {
  return std::thread(
      [](auto f, auto... args) {
        at::set_num_threads(kTestThreads);
        f(std::move(args)...);
      },
      std::forward<F>(f), std::forward<Args>(args)...);
}

inline at::Tensor param(at::IntArrayRef sizes, double scale = 0.2) {
  return (at::randn(sizes) * scale).requires_grad_(true);
}

/// Pre-LN block: LayerNorm, single-head softmax attention, dropout, residual,
/// Linear-GELU-Linear MLP, dropout, residual. x: [batch, seq, dim].
struct Block {
  int64_t dim;
  double dropout;
  at::Tensor ln_w, ln_b, wq, wk, wv, wo, w1, b1, w2, b2;

  explicit Block(int64_t d, double p = 0.1) : dim(d), dropout(p) {
    ln_w = (at::ones({d}) + at::randn({d}) * 0.1).requires_grad_(true);
    ln_b = param({d});
    wq = param({d, d});
    wk = param({d, d});
    wv = param({d, d});
    wo = param({d, d});
    w1 = param({4 * d, d});
    b1 = param({4 * d});
    w2 = param({d, 4 * d});
    b2 = param({d});
  }

  TensorList params() const { return {ln_w, ln_b, wq, wk, wv, wo, w1, b1, w2, b2}; }

  /// Moves the parameters to `device`; they stay leaves.
  Block& to(c10::Device device) {
    for (at::Tensor* p : {&ln_w, &ln_b, &wq, &wk, &wv, &wo, &w1, &b1, &w2, &b2}) {
      *p = p->detach().to(device).requires_grad_(true);
    }
    return *this;
  }

  at::Tensor forward(const at::Tensor& x) const {
    auto h = at::layer_norm(x, {dim}, ln_w, ln_b);
    auto q = at::linear(h, wq), k = at::linear(h, wk), v = at::linear(h, wv);
    auto att = at::softmax(at::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(dim)), -1);
    att = at::dropout(att, dropout, /*train=*/true);
    auto x2 = x + at::linear(at::matmul(att, v), wo);
    auto m = at::gelu(at::linear(x2, w1, b1));
    m = at::dropout(m, dropout, /*train=*/true);
    return x2 + at::linear(m, w2, b2);
  }

  /// The block as a checkpointable function.
  CheckpointFn fn() const {
    return [this](const TensorList& in) { return TensorList{forward(in[0])}; };
  }
};

/// d(sum(y * weights)) / d(wrt); weights fixed so every gradient element counts.
inline TensorList grads(const at::Tensor& y, const TensorList& wrt, bool retain_graph = false) {
  auto gy = at::linspace(-1.0, 1.0, y.numel()).reshape(y.sizes());
  return torch::autograd::grad({y}, wrt, {gy}, retain_graph, /*create_graph=*/false, /*allow_unused=*/true);
}

inline void expect_all_equal(const TensorList& a, const TensorList& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << "gradient " << i;
    if (!a[i].defined()) continue;
    EXPECT_TRUE(at::equal(a[i], b[i])) << "gradient " << i << " differs, max |diff| = "
                                       << (a[i] - b[i]).abs().max().item<double>();
  }
}

/// For GPU results, where kernels may be chosen per stream: close, not
/// identical. A wrong dropout mask or a wrong dtype is far outside these.
inline void expect_all_close(const TensorList& a, const TensorList& b, double rtol = 1e-5, double atol = 1e-6) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << "gradient " << i;
    if (!a[i].defined()) continue;
    EXPECT_TRUE(at::allclose(a[i], b[i], rtol, atol)) << "gradient " << i << " differs, max |diff| = "
                                                      << (a[i] - b[i]).abs().max().item<double>();
  }
}

/// The default CPU generator's state, read under its lock.
inline at::Tensor cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

inline TensorList concat(TensorList a, const TensorList& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

/// A pipeline stage: `layers` blocks of width `dim`, each checkpointed (or not).
struct Stage {
  std::vector<Block> blocks;
  explicit Stage(int layers, double dropout = 0.1, int64_t dim = 16) {
    for (int i = 0; i < layers; ++i) blocks.emplace_back(dim, dropout);
  }
  Stage& to(c10::Device device) {
    for (auto& b : blocks) b.to(device);
    return *this;
  }
  TensorList params() const {
    TensorList all;
    for (const auto& b : blocks) all = concat(all, b.params());
    return all;
  }
  at::Tensor forward(at::Tensor x, bool checkpointed, CheckpointOptions options = {}) const {
    for (const auto& b : blocks) x = checkpointed ? checkpoint(b.fn(), {x}, options)[0] : b.forward(x);
    return x;
  }
};

/// Skips the test where no CUDA device is visible.
#define PREFIRE_REQUIRE_GPU()                                     \
  do {                                                            \
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device here"; \
  } while (0)

/// Turns the session buffer pool on or off for a scope.
class PoolSetting {
 public:
  explicit PoolSetting(bool on) : before_(session_pool_enabled()) { set_session_pool_enabled(on); }
  ~PoolSetting() { set_session_pool_enabled(before_); }
  PoolSetting(const PoolSetting&) = delete;
  PoolSetting& operator=(const PoolSetting&) = delete;

 private:
  bool before_;
};

/// The message of the `E` that `f` throws; a test failure (and "") when `f`
/// throws nothing.
template <typename E = CheckpointError, typename F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

/// Deletes `object` on a new thread: the misuse the death tests check.
template <typename T>
void delete_on_another_thread(T* object) {
  std::thread([object] { delete object; }).join();
}

/// Weak references to storages, to see whether anything still holds them.
class StorageWatch {
 public:
  void watch(const at::Tensor& t) { refs_.push_back(t.storage().getWeakStorageImpl()); }
  size_t alive() const {
    size_t n = 0;
    for (const auto& r : refs_) n += r.expired() ? 0 : 1;
    return n;
  }
  size_t size() const { return refs_.size(); }
  void clear() { refs_.clear(); }

 private:
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> refs_;
};

/// Wraps `fn` so that every run (forward or recompute) is counted.
/// exp(x), whose backward unpacks its saved input twice.
struct ReadsSavedTwice : torch::autograd::Function<ReadsSavedTwice> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x) {
    ctx->save_for_backward({x});
    return x.exp();
  }
  static TensorList backward(torch::autograd::AutogradContext* ctx, TensorList g) {
    auto first = ctx->get_saved_variables()[0];
    auto second = ctx->get_saved_variables()[0];
    return {g[0] * first.exp() + 0 * second};
  }
};

inline CheckpointFn counted(CheckpointFn fn, std::atomic<int>& runs) {
  return [fn = std::move(fn), &runs](const TensorList& in) {
    ++runs;
    return fn(in);
  };
}

}  // namespace prefire::testing
