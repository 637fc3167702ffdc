// The one place where at::Tensor meets the framework-free launchers of kernels/*.h: checks of
// device, dtype, shape and contiguity (each failure is a c10::Error naming the argument and what
// was expected), the current CUDA stream of the tensors' device, and launch errors converted to
// c10::Error. Built only with -DODYSSEY_CUDA=ON (it defines ODYSSEY_WITH_CUDA_KERNELS for its
// users).
#pragma once

#include <cstdint>

#include <ATen/ATen.h>

namespace odyssey::kernels {

struct KdaChunkedOutput {
  at::Tensor o;            // [B, T, H, V], q's dtype
  at::Tensor final_state;  // [N, H, K, V], fp32
};

// Whether kda_chunked can run these inputs (shapes as in model/kda.h): CUDA tensors on one
// device, q, k, v in one dtype of bf16 / fp32, K and V in {64, 128}, chunk 16, an undefined or
// floating-point initial state. Any dtype of g and beta is accepted (converted).
bool kda_chunked_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& g, const at::Tensor& beta,
                           const at::Tensor& initial_state, int64_t chunk);

// kda::chunked on the GPU (forward only; nothing is recorded for autograd). g must lie in
// [-5, 0]. Non-contiguous inputs are copied. With cu_seqlens (int32 or int64 [N + 1], on any
// device), q etc. are [1, total, H, *] holding N packed sequences, and the states are [N, ...].
// segment_length: context parallelism inside the GPU (KdaChunkedOptions in kernels/kda.h):
// 0 automatic, < 0 never, > 0 segments of this many tokens (a multiple of 16). Its workspace
// comes from the caching allocator. prefetch: KdaChunkedOptions::prefetch (same results).
KdaChunkedOutput kda_chunked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& g, const at::Tensor& beta,
                             const at::Tensor& initial_state, double scale,
                             const at::Tensor& cu_seqlens = at::Tensor(),
                             int64_t segment_length = 0, bool prefetch = true);

// The gradients of kda_chunked (no cu_seqlens, no context-parallel options) with respect to its
// inputs, from the gradients of its outputs: d_o [B, T, H, V] (any float dtype; converted to q's),
// d_final_state [B, H, K, V] or undefined (zeros). Computed by kernels/kda.h's
// kda_chunked_backward (state recompute, reverse state walk, per-chunk gradients) in fp32; each
// gradient is returned in its input's dtype (d_initial_state: initial_state's, fp32 when that is
// undefined). g must lie in [-5, 0]. The workspace comes from the caching allocator.
struct KdaChunkedGradients {
  at::Tensor dq, dk, dv, dg, dbeta, d_initial_state;
};
KdaChunkedGradients kda_chunked_backward(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& g,
                                         const at::Tensor& beta, const at::Tensor& initial_state,
                                         const at::Tensor& d_o, const at::Tensor& d_final_state,
                                         double scale);

// Whether kda_step can run these: CUDA, q k v of one dtype bf16 / fp32, K in {64, 128}, V a
// multiple of 32 up to 256, state fp32 and contiguous (it is updated in place).
bool kda_step_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state);

// kda::step on the GPU: q, k, g [B, H, K], v [B, H, V], beta [B, H]; state [B, H, K, V] fp32
// contiguous, updated in place. Returns o [B, H, V] in q's dtype.
at::Tensor kda_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& g, const at::Tensor& beta, at::Tensor& state, double scale);

}  // namespace odyssey::kernels
