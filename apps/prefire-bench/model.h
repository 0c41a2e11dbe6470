#pragma once

// The model prefire-bench trains: one pipeline stage of GPT-style blocks.

#include <prefire/checkpoint.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace prefire_bench {

struct ModelConfig {
  int layers = 4;
  int64_t hidden = 192;
  int64_t heads = 6;
  int64_t seq = 128;
  int64_t micro_batch = 2;
  double dropout = 0.1;
  at::ScalarType dtype = at::kFloat;  // of parameters (and of the activations fed in)
};

/// Pre-LN GPT block: LayerNorm, causal self-attention (scaled_dot_product_attention),
/// dropout, residual; LayerNorm, GELU MLP, dropout, residual.
struct GptBlock {
  at::Tensor ln1_w, ln1_b, w_qkv, b_qkv, w_o, b_o, ln2_w, ln2_b, w_fc, b_fc, w_proj, b_proj;
  const ModelConfig* config = nullptr;

  std::vector<at::Tensor> params() const;
  at::Tensor forward(const at::Tensor& x) const;  // x: [micro_batch, seq, hidden]
};

/// A stage: `layers` blocks on `device`, initialised from `seed`.
struct Stage {
  ModelConfig config;
  std::vector<GptBlock> blocks;

  Stage(const ModelConfig& config, const at::Device& device, uint64_t seed);
  Stage(const Stage&) = delete;  // blocks point at `config`
  Stage& operator=(const Stage&) = delete;
  std::vector<at::Tensor> params() const;
};

}  // namespace prefire_bench
