// CUDA kernels of incremental attention (KDA, the gated delta rule with per-channel decay;
// ../../shared/design/MODEL.md, "Incremental attention"). Framework-free launchers: raw device
// pointers, sizes and a stream; each returns the launch's cudaError_t (cudaErrorInvalidValue for
// sizes outside the supported set, checked before anything is launched). The plain LibTorch
// reference they are tested against is model/kda.h (kda::recurrent, kda::chunked_reference,
// kda::step_reference); kernels/torch_bindings.h adapts at::Tensor to these calls.
//
// Semantics, per (sequence, head), token by token:
//   S~ = Diag(exp(g_t)) S;  r = S~^T k_t;  S = S~ + beta_t k_t (v_t - r)^T;  o_t = S^T (scale q_t)
//
// Layouts: every tensor is dense row-major (contiguous) in the shape given; "T" below is an
// element type chosen by `dtype` (bf16 or fp32). g and states are always fp32. Pointers must be
// 16-byte aligned (what the caching allocators return for whole tensors).
//
// Numerics: the state is kept and accumulated in fp32. The chunked forward feeds tensor cores
// with bf16 operands (fp32 accumulate), also for fp32 inputs: the state and the intra-chunk
// products are rounded to bf16 as matmul operands (relative error ~ 2^-9 per product, as in
// published KDA/GDN kernels). The inverse (I + L)^-1 is exact forward substitution in fp32.
// The decode step is fp32 throughout. g must lie in [-5, 0] (the layer's gate guarantees it):
// the chunk of 16 tokens is sized for that exponent budget.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace odyssey::kernels {

enum class KdaDtype : int32_t { kBFloat16 = 0, kFloat32 = 1 };

// Chunked forward (prefill / forward-only), chunks of 16 tokens.
//   q, k       T   [B, L, H, K]
//   v          T   [B, L, H, V]
//   g          f32 [B, L, H, K]    log-decay, in [-5, 0]
//   beta       T   [B, L, H]
//   initial_state f32 [N, H, K, V] or nullptr (zeros)
//   o          T   [B, L, H, V]    written (every position)
//   final_state f32 [N, H, K, V]   written; may alias initial_state (each element is read once
//                                  before it is written, by the same thread)
// Without cu_seqlens: N = batch sequences of `length` tokens each (L = length).
// With cu_seqlens (int32 device array of N + 1 ascending offsets, cu_seqlens[0] = 0): B = 1, the
// N sequences are packed along L = cu_seqlens[N] (= total_tokens), sequence n occupying tokens
// [cu_seqlens[n], cu_seqlens[n + 1]); `batch` is then N and `length` is total_tokens.
// Supported: K in {64, 128}, V in {64, 128}; any length >= 0 (a partly filled last chunk is
// handled exactly); heads >= 1.
cudaError_t kda_chunked_forward(KdaDtype dtype, const void* q, const void* k, const void* v,
                                const float* g, const void* beta, const float* initial_state,
                                void* o, float* final_state, const int32_t* cu_seqlens,
                                int64_t batch, int64_t length, int64_t heads, int64_t key_dim,
                                int64_t value_dim, float scale, cudaStream_t stream);

// One decode token for a batch of sequences; the state is updated in place.
//   q, k  T [B, H, K]    v T [B, H, V]    g f32 [B, H, K]    beta T [B, H]
//   state f32 [B, H, K, V] (read and written)     o T [B, H, V] (written)
// Supported: K in {64, 128}, V a multiple of 32 up to 256.
cudaError_t kda_decode_step(KdaDtype dtype, const void* q, const void* k, const void* v,
                            const float* g, const void* beta, float* state, void* o,
                            int64_t batch, int64_t heads, int64_t key_dim, int64_t value_dim,
                            float scale, cudaStream_t stream);

}  // namespace odyssey::kernels
