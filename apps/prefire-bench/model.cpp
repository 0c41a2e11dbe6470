#include "model.h"

#include <ATen/ATen.h>

#include <cmath>

namespace prefire_bench {

std::vector<at::Tensor> GptBlock::params() const {
  return {ln1_w, ln1_b, w_qkv, b_qkv, w_o, b_o, ln2_w, ln2_b, w_fc, b_fc, w_proj, b_proj};
}

at::Tensor GptBlock::forward(const at::Tensor& x) const {
  const int64_t b = x.size(0), t = x.size(1), c = config->hidden, h = config->heads;
  auto qkv = at::linear(at::layer_norm(x, {c}, ln1_w, ln1_b), w_qkv, b_qkv)
                 .view({b, t, 3, h, c / h})
                 .permute({2, 0, 3, 1, 4});  // [3, b, h, t, c/h]
  auto attended = at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], /*attn_mask=*/{}, config->dropout,
                                                   /*is_causal=*/true);
  auto merged = attended.transpose(1, 2).reshape({b, t, c});
  auto x2 = x + at::dropout(at::linear(merged, w_o, b_o), config->dropout, /*train=*/true);
  auto mlp = at::linear(at::gelu(at::linear(at::layer_norm(x2, {c}, ln2_w, ln2_b), w_fc, b_fc)), w_proj, b_proj);
  return x2 + at::dropout(mlp, config->dropout, /*train=*/true);
}

Stage::Stage(const ModelConfig& cfg, const at::Device& device, uint64_t seed) : config(cfg) {
  at::manual_seed(seed);
  const int64_t c = config.hidden;
  const double scale = 1.0 / std::sqrt(double(c));
  auto make = [&](at::Tensor t) { return t.to(device, config.dtype).requires_grad_(true); };
  for (int i = 0; i < config.layers; ++i) {
    GptBlock blk;
    blk.ln1_w = make(at::ones({c}));
    blk.ln1_b = make(at::zeros({c}));
    blk.w_qkv = make(at::randn({3 * c, c}) * scale);
    blk.b_qkv = make(at::zeros({3 * c}));
    blk.w_o = make(at::randn({c, c}) * scale);
    blk.b_o = make(at::zeros({c}));
    blk.ln2_w = make(at::ones({c}));
    blk.ln2_b = make(at::zeros({c}));
    blk.w_fc = make(at::randn({4 * c, c}) * scale);
    blk.b_fc = make(at::zeros({4 * c}));
    blk.w_proj = make(at::randn({c, 4 * c}) * (scale / 2));
    blk.b_proj = make(at::zeros({c}));
    blocks.push_back(blk);
  }
  for (auto& blk : blocks) blk.config = &config;
}

std::vector<at::Tensor> Stage::params() const {
  std::vector<at::Tensor> all;
  for (const auto& blk : blocks) {
    auto p = blk.params();
    all.insert(all.end(), p.begin(), p.end());
  }
  return all;
}

}  // namespace prefire_bench
