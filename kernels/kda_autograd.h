// KDA chunked attention as an autograd function on the GPU: the forward kernel
// (kernels/kda.h, kda_chunked_forward) in the forward, the backward kernel (kda_chunked_backward)
// in the backward. The inputs (and the initial state) are saved, and the backward recomputes
// everything else, unless the forward is asked to keep the chunk states (keep_chunk_states). Built only with -DODYSSEY_CUDA=ON; model/kda.cpp's kda::chunked uses it for
// CUDA inputs the kernels support when a gradient is needed. The layer's decay gate (kernels/kda_gate.h)
// is recorded here too (kda_gate_autograd, below; model::kda::gate takes it).
#pragma once

#include <ATen/ATen.h>

#include "kernels/torch_bindings.h"

namespace odyssey::kernels {

// kda_chunked (torch_bindings.h) recorded for autograd: o and final_state carry a grad_fn when
// any of q, k, v, g, beta, initial_state requires grad (initial_state may be undefined: zeros).
// Shapes and requirements as kda_chunked without cu_seqlens; g must lie in [-5, 0]. The backward
// is first order only (its own ops are not recorded: no double backward).
// keep_chunk_states: the forward also writes the state entering every chunk (every fourth chunk,
// with every token's V', where the backward's pass 3 goes by blocks: bf16, K = V = 128;
// kda.h, kda_backward_state_interval) and keeps it for the backward, which then skips their
// recompute (its first pass): the same gradients bit for bit, a shorter training step
// (kernels/JOURNAL.md, "Kept chunk states") for B T H K V / 8 bytes (/ 32 by blocks, plus V' at
// B T H V 2: 1.07 + 0.54 GB at B=2 T=16K H=64 K=V=128) held from the forward to the backward.
// Off: only the inputs are held.
KdaChunkedOutput kda_chunked_autograd(const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, const at::Tensor& g,
                                      const at::Tensor& beta, const at::Tensor& initial_state,
                                      double scale, bool keep_chunk_states = false);

// The decay gate (model::kda::gate; kernels/kda_gate.h) recorded for autograd:
// g = g_min sigmoid(exp(A_log[h]) (z + dt_bias[h, c])), fp32 [..., H, K] from z [..., H, K]
// (bf16 / fp32), A_log fp32 [H], dt_bias fp32 [H K] (or [H, K]). Holds z and the parameters for
// the backward, which gives dz (z's dtype), dA_log and d dt_bias (fp32, summed over the tokens in
// a fixed order: the same bits every run) as far as each is needed. Conditions:
// kda_gate_supported (kernels/torch_bindings.h). First order only.
at::Tensor kda_gate_autograd(const at::Tensor& z, const at::Tensor& a_log, const at::Tensor& dt_bias,
                             double g_min);

// The layer's short convolution on q, k or v (kernels/kda_conv.h) recorded for autograd: SiLU of
// the causal depthwise convolution of [conv_inputs | x] with weight, then (head > 0) each head's
// channels divided by sqrt(their sum of squares + eps); fp32 [B, T, D]. Holds x, conv_inputs and
// the weight; the backward gives dx, d conv_inputs and d weight (summed in a fixed order) as far
// as each is needed. Conditions: kda_short_conv_supported (kernels/torch_bindings.h). First order
// only.
at::Tensor kda_short_conv_autograd(const at::Tensor& x, const at::Tensor& conv_inputs, const at::Tensor& weight,
                                   int64_t head, double eps);

}  // namespace odyssey::kernels
