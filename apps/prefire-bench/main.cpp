// prefire-bench: trains a small stack of transformer-style blocks a few steps
// with and without checkpointing, on identical weights and data, and prints
// what checkpointing costs and saves: bytes held by saved tensors after
// forward (measured by prefire::SavedTensorMeter), step time, recomputations
// per step, and the largest gradient difference against the unchecked run.

#include <prefire/prefire.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using prefire::TensorList;

struct Config {
  int layers = 8;
  int64_t dim = 128;
  int64_t seq = 64;
  int64_t batch = 4;
  int steps = 5;
  double dropout = 0.1;
  int threads = 1;
  uint64_t seed = 0;
};

void usage(const char* argv0) {
  std::printf(
      "usage: %s [--layers N] [--dim D] [--seq T] [--batch B] [--steps S] [--dropout P]\n"
      "          [--threads N] [--seed S]\n"
      "Trains a stack of transformer-style blocks S steps with and without prefire::checkpoint\n"
      "and prints saved-tensor bytes, step time, recomputations and gradient difference.\n",
      argv0);
}

Config parse(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      usage(argv[0]);
      std::exit(0);
    }
    if (i + 1 >= argc) throw std::invalid_argument("flag " + flag + " needs a value");
    std::string value = argv[++i];
    auto as_int = [&](long lo) {
      long v = std::stol(value);
      if (v < lo) throw std::invalid_argument(flag + " must be >= " + std::to_string(lo) + ", got " + value);
      return v;
    };
    if (flag == "--layers") c.layers = as_int(1);
    else if (flag == "--dim") c.dim = as_int(1);
    else if (flag == "--seq") c.seq = as_int(1);
    else if (flag == "--batch") c.batch = as_int(1);
    else if (flag == "--steps") c.steps = as_int(1);
    else if (flag == "--threads") c.threads = as_int(1);
    else if (flag == "--seed") c.seed = as_int(0);
    else if (flag == "--dropout") {
      c.dropout = std::stod(value);
      if (c.dropout < 0 || c.dropout >= 1) throw std::invalid_argument("--dropout must be in [0, 1), got " + value);
    } else {
      throw std::invalid_argument("unknown flag " + flag + " (see --help)");
    }
  }
  return c;
}

struct Block {
  at::Tensor ln_w, ln_b, wq, wk, wv, wo, w1, b1, w2, b2;
  int64_t dim;
  double dropout;

  Block(int64_t d, double p) : dim(d), dropout(p) {
    auto init = [](at::IntArrayRef s, double scale) { return (at::randn(s) * scale).requires_grad_(true); };
    double s = 1.0 / std::sqrt(double(d));
    ln_w = at::ones({d}).requires_grad_(true);
    ln_b = at::zeros({d}).requires_grad_(true);
    wq = init({d, d}, s), wk = init({d, d}, s), wv = init({d, d}, s), wo = init({d, d}, s);
    w1 = init({4 * d, d}, s), b1 = at::zeros({4 * d}).requires_grad_(true);
    w2 = init({d, 4 * d}, s / 2), b2 = at::zeros({d}).requires_grad_(true);
  }
  TensorList params() const { return {ln_w, ln_b, wq, wk, wv, wo, w1, b1, w2, b2}; }

  at::Tensor forward(const at::Tensor& x) const {
    auto h = at::layer_norm(x, {dim}, ln_w, ln_b);
    auto q = at::linear(h, wq), k = at::linear(h, wk), v = at::linear(h, wv);
    auto att = at::softmax(at::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(dim)), -1);
    auto x2 = x + at::linear(at::matmul(at::dropout(att, dropout, true), v), wo);
    auto m = at::dropout(at::gelu(at::linear(x2, w1, b1)), dropout, true);
    return x2 + at::linear(m, w2, b2);
  }
};

struct Result {
  int64_t saved_bytes = 0;
  std::vector<double> step_ms;
  double recomputes_per_step = 0;
  std::vector<TensorList> grads;  // per step
};

Result train(const Config& c, bool use_checkpoint) {
  at::manual_seed(c.seed);
  std::vector<Block> blocks;
  for (int i = 0; i < c.layers; ++i) blocks.emplace_back(c.dim, c.dropout);
  TensorList params;
  for (auto& b : blocks) for (auto& p : b.params()) params.push_back(p);
  auto data = at::randn({c.batch, c.seq, c.dim});
  auto target = at::randn({c.batch, c.seq, c.dim});

  Result r;
  std::atomic<int64_t> runs{0};
  at::manual_seed(c.seed + 1);
  for (int step = 0; step < c.steps; ++step) {
    auto start = std::chrono::steady_clock::now();
    runs = 0;
    prefire::SavedTensorMeter meter;
    at::Tensor h = data;
    for (auto& b : blocks) {
      if (use_checkpoint) {
        h = prefire::checkpoint([&b, &runs](const TensorList& in) {
              ++runs;
              return TensorList{b.forward(in[0])};
            }, {h})[0];
      } else {
        h = b.forward(h);
      }
    }
    auto loss = (h - target).pow(2).mean();
    meter.stop();
    r.saved_bytes = std::max(r.saved_bytes, meter.peak_bytes());
    auto g = torch::autograd::grad({loss}, params);
    {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) params[i].sub_(g[i], 1e-2);
    }
    auto end = std::chrono::steady_clock::now();
    r.step_ms.push_back(std::chrono::duration<double, std::milli>(end - start).count());
    r.recomputes_per_step += double(use_checkpoint ? runs - c.layers : 0) / c.steps;
    r.grads.push_back(std::move(g));
  }
  return r;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Config c = parse(argc, argv);
    prefire::install();
    at::set_num_threads(c.threads);
    std::printf("prefire-bench: %d blocks, dim %lld, seq %lld, batch %lld, dropout %.2f, %d steps, %d thread(s)\n",
                c.layers, (long long)c.dim, (long long)c.seq, (long long)c.batch, c.dropout, c.steps, c.threads);
    Result plain = train(c, false);
    Result ckpt = train(c, true);
    double max_diff = 0;
    for (size_t s = 0; s < plain.grads.size(); ++s)
      for (size_t i = 0; i < plain.grads[s].size(); ++i)
        max_diff = std::max(max_diff, (plain.grads[s][i] - ckpt.grads[s][i]).abs().max().item<double>());

    std::printf("\n%-12s %16s %14s %18s %16s\n", "mode", "saved bytes", "step ms (med)", "recomputes/step",
                "max |grad diff|");
    auto row = [&](const char* name, const Result& r, double diff) {
      std::printf("%-12s %16lld %14.2f %18.1f %16.3g\n", name, (long long)r.saved_bytes, median(r.step_ms),
                  r.recomputes_per_step, diff);
    };
    row("none", plain, 0.0);
    row("checkpoint", ckpt, max_diff);
    std::printf("\nsaved bytes ratio checkpoint/none: %.3f   step time ratio: %.3f\n",
                double(ckpt.saved_bytes) / double(plain.saved_bytes), median(ckpt.step_ms) / median(plain.step_ms));
    return max_diff == 0.0 || c.threads > 1 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "prefire-bench: %s\n", e.what());
    return 2;
  }
}
