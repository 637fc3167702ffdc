// Gated multi-head latent attention with NoPE and a key slot shared by all heads
// (../../shared/design/MODEL.md, "Gated multi-head latent attention"). Plain LibTorch; this is
// the reference the CUDA kernels are checked against.
//
// Per token x [hidden], H heads, q/k width per head K + S (K = head_dim from the latent,
// S = shared_dim shared by all heads), value width V, latents Lq and Lkv:
//     c_q = RMSNorm(W_dq x);  q_h = (W_uq c_q)_h = [q_nope_h (K) ; q_shared_h (S)]
//     [c_kv ; k_shared] = W_dkv x;  c_kv = RMSNorm(c_kv)           (norm on the Lkv part only)
//     k_h = [(W_uk c_kv)_h ; k_shared];  v_h = (W_uv c_kv)_h
//     o_h = causal softmax attention with scale 1/sqrt(K + S)      (nothing rotated: NoPE)
//     y = W_o(sigmoid(W_g x) ⊙ concat_h o_h)                       (no norm before the gate)
// RMSNorm is model/rms_norm.h (statistics in fp32, fp64 for fp64 inputs; result in z's dtype). Full size: H = 96, K = 128, S = 64, V = 128, Lq = 1536, Lkv = 512.
//
// Three forms that agree (up to rounding; the tests check it in fp64):
//   forward(x)              the whole sequence, with blockwise attention (model/attention.h).
//   forward_chunk(x, cache) a chunk continuing `cache`: its queries attend to every cached token
//                           and causally within the chunk. With autograd on, keys and values are
//                           rebuilt from the cached latents by W_uk / W_uv; without (prefill), the
//                           absorbed form below where it costs no more (tiny: equal multiply-adds).
//   step(x_t, cache)        one token, in the ABSORBED form: q_abs_h = W_uk_hᵀ q_nope_h (Lkv),
//                           scored as [q_abs_h ; q_shared_h] · [c_kv ; k_shared] against the
//                           cache directly (one 576-wide key shared by every head), values are
//                           c_kv, and W_uv_h is applied to the attended latent afterwards.
// Attention output: kept in fp32 (fp64 for an fp64 layer) through the gate; it is cast to the
// parameters' dtype only as W_o's input. In step, W_uk folding and W_uv run in the parameters'
// dtype (no per-token weight casts), so a bf16 layer rounds q_abs and the attended latent to bf16.
//
// Differentiability: forward is fully differentiable (attention has a recomputing backward, so
// activation memory is O(T), not O(T²)). forward_chunk is differentiable with respect to the
// parameters and the chunk's own tokens; the cached tokens' latents are constants (the cache
// stores detached values). step records no autograd graph (decode only).
//
// Parameter names (stable: they are the checkpoint's tensor names under the layer's prefix).
// D = hidden; per-head layouts are head-major (row h*W + i); no projection has a bias:
//   q_down_proj.weight  [Lq, D]          W_dq
//   q_norm.weight       [Lq]             RMSNorm weight of c_q
//   q_up_proj.weight    [H*(K+S), Lq]    W_uq, per head [q_nope_h (K) ; q_shared_h (S)]
//   kv_down_proj.weight [Lkv+S, D]       W_dkv, rows [c_kv (Lkv) ; k_shared (S)]
//   kv_norm.weight      [Lkv]            RMSNorm weight of c_kv
//   k_up_proj.weight    [H*K, Lkv]       W_uk
//   v_up_proj.weight    [H*V, Lkv]       W_uv
//   g_proj.weight       [H*V, D]         W_g (output gate, full rank)
//   o_proj.weight       [D, H*V]         W_o
// (DeepSeek-V3's names map as q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa,
// kv_a_layernorm, o_proj; its kv_b_proj [H*(K+V), Lkv] interleaves per head the rows of our
// k_up_proj (K) and v_up_proj (V).)
//
// Thread-safety: forward only reads the weights; forward_chunk and step mutate their cache,
// which one caller owns.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "core/status.h"
#include "model/attention.h"
#include "model/rms_norm.h"

namespace odyssey::model {

// Sizes of one MLA layer. hidden, heads and the two latents come from the model config; the
// per-head widths default to the full-size values.
struct GatedMlaOptions {
  int64_t hidden = 0;
  int64_t heads = 0;
  int64_t q_latent = 0;    // Lq
  int64_t kv_latent = 0;   // Lkv
  int64_t head_dim = 128;  // K: per-head q/k width from the latent
  int64_t shared_dim = 64; // S: the key slot shared by all heads (and each head's query slot)
  int64_t v_dim = 128;     // V
  double rms_eps = 1e-5;
  int64_t attention_block = kAttentionBlock;  // tile of the blockwise attention
};

// The decode cache of one MLA layer for a batch of sequences that advance in lockstep: per
// token the Lkv + S numbers [c_kv (after its RMSNorm) ; k_shared], in the layer's parameter
// dtype. This is the only state that grows with the trajectory (576 numbers per token per layer
// at full size).
//
//   latent [B, capacity, Lkv + S]   rows [0, length) are the tokens so far; the rest is reserve
//
// Capacity grows in whole blocks of `capacity_block` tokens, and by at least half the current
// capacity, so appending token by token costs amortised O(1) copies; reserve() pre-allocates
// a known budget once.
struct MlaCache {
  at::Tensor latent;
  int64_t length = 0;
  int64_t capacity_block = 1024;

  int64_t batch() const { return latent.defined() ? latent.size(0) : 0; }
  int64_t width() const { return latent.defined() ? latent.size(2) : 0; }
  int64_t capacity() const { return latent.defined() ? latent.size(1) : 0; }
  // The filled rows [B, length, Lkv + S] (a view: valid until the next append).
  at::Tensor tokens() const;
  // Makes room for at least `tokens` rows in total (never shrinks; keeps the content).
  void reserve(int64_t tokens);
  // Appends rows [B, n, Lkv + S] (detached, cast to the cache's dtype).
  void append(const at::Tensor& rows);

  // A snapshot: {"latent": [B, length, Lkv + S]} as a detached, contiguous CPU copy, exact in
  // the cache's dtype; later appends do not change it.
  std::map<std::string, at::Tensor> to_tensors() const;
  // Rebuilds from to_tensors()'s map, on `device`. kInvalidArgument names a missing or extra
  // tensor, or a latent that is not a rank-3 floating tensor. Whether the width and dtype fit a
  // layer is checked when the layer uses it.
  static Result<MlaCache> from_tensors(const std::map<std::string, at::Tensor>& tensors,
                                       const at::Device& device = at::kCPU);
};

class GatedMlaImpl : public torch::nn::Module {
 public:
  explicit GatedMlaImpl(const GatedMlaOptions& options);

  // x [B, T, hidden] -> [B, T, hidden], same dtype (the parameters' dtype).
  at::Tensor forward(const at::Tensor& x);
  // x [B, T, hidden] (T >= 1) continuing `cache`, which gains the chunk's T tokens.
  at::Tensor forward_chunk(const at::Tensor& x, MlaCache& cache);
  // x_t [B, hidden] -> [B, hidden]; `cache` gains the token. No autograd.
  at::Tensor step(const at::Tensor& x_t, MlaCache& cache);

  // An empty cache for `batch` sequences on the parameters' device and dtype, with room for
  // `reserve_tokens` tokens.
  MlaCache initial_cache(int64_t batch, int64_t reserve_tokens = 0) const;

  const GatedMlaOptions& options() const { return options_; }
  double attention_scale() const;

  torch::nn::Linear q_down_proj{nullptr};
  torch::nn::Linear q_up_proj{nullptr};
  torch::nn::Linear kv_down_proj{nullptr};
  torch::nn::Linear k_up_proj{nullptr};
  torch::nn::Linear v_up_proj{nullptr};
  torch::nn::Linear g_proj{nullptr};
  torch::nn::Linear o_proj{nullptr};
  RmsNorm q_norm{nullptr};
  RmsNorm kv_norm{nullptr};

 private:
  struct Latents {
    at::Tensor q;           // [B, T, H, K + S]
    at::Tensor kv_latent;   // [B, T, Lkv + S]: [c_kv (normed) ; k_shared]
  };
  Latents latents(const at::Tensor& x);
  // Keys [B, H, T, K + S] and values [B, H, T, V] from latents [B, T, Lkv + S].
  std::pair<at::Tensor, at::Tensor> keys_values(const at::Tensor& kv_latent);
  // x [B, T, hidden] and attention output o [B, T, H*V] (compute dtype) -> y [B, T, hidden].
  at::Tensor gated_output(const at::Tensor& x, const at::Tensor& o);
  void check_cache(const MlaCache& cache, const at::Tensor& x, const char* where) const;

  GatedMlaOptions options_;
};
TORCH_MODULE(GatedMla);

}  // namespace odyssey::model
