// The one place where at::Tensor meets the framework-free launchers of kernels/*.h: checks of
// device, dtype, shape and contiguity (each failure is a c10::Error naming the argument and what
// was expected), the current CUDA stream of the tensors' device, and launch errors converted to
// c10::Error. Built only with -DODYSSEY_CUDA=ON (it defines ODYSSEY_WITH_CUDA_KERNELS for its
// users).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <cuda_runtime.h>

namespace odyssey::kernels {

// A launcher's result as a c10::Error naming the call (`where`) and the CUDA error; nothing on
// cudaSuccess. What every tensor adapter of kernels/ (this file, moe_autograd.cpp,
// grouped_gemm.cpp) does after a launch.
void check_launch(cudaError_t error, const char* where);

struct KdaChunkedOutput {
  at::Tensor o;            // [B, T, H, V], q's dtype
  at::Tensor final_state;  // [N, H, K, V], fp32
  // bf16 [N, H, ceil(ceil(T / 16) / i), V, K]: the state entering chunks 0, i, 2i, ... (i =
  // chunk_state_interval, 1, 2 or 4), when kda_chunked was asked to keep them (for
  // kda_chunked_backward's chunk_states); else undefined.
  at::Tensor chunk_states;
  // bf16 [B, T, H, V]: every token's V' (the value the walk adds to the state), when kda_chunked
  // was asked to keep it with the states (for kda_chunked_backward's new_values); else undefined.
  at::Tensor new_values;
};

// Whether kda_chunked can run these inputs (shapes as in model/kda.h): CUDA tensors on one
// device, q, k, v in one dtype of bf16 / fp32, K and V in {32, 64, 128}, chunk 16, an undefined or
// floating-point initial state. Any dtype of g and beta is accepted (converted).
bool kda_chunked_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& g, const at::Tensor& beta,
                           const at::Tensor& initial_state, int64_t chunk);

// kda::chunked on the GPU (forward only; nothing is recorded for autograd). g must lie in
// [-5, 0]. Non-contiguous inputs are copied. With cu_seqlens (int32 or int64 [N + 1], on any
// device), q etc. are [1, total, H, *] holding N packed sequences, and the states are [N, ...].
// segment_length: context parallelism inside the GPU (KdaChunkedOptions in kernels/kda.h):
// 0 automatic, < 0 never, > 0 segments of this many tokens (a multiple of 16). Its workspace
// comes from the caching allocator. prefetch, head_walk: KdaChunkedOptions::prefetch and
// ::head_walk (same results, bit for bit, under the same segments). lead_length:
// KdaChunkedOptions::lead_length (0 automatic, < 0 none, > 0 tokens, a multiple of 16).
// keep_chunk_states: also return the state entering every chunk (KdaChunkedOptions::chunk_states,
// written in the same walk; not with cu_seqlens), so that a training step's backward need not
// recompute them: B T H K V 2 / 16 bytes (B=2 T=16K H=64 K=V=128: 4.3 GB) held until then; with
// chunk_state_interval = 2 every second chunk's, half that, and 4 every fourth one's (what the
// backward reads where pass 3 goes by blocks, 4 with V' kept: kernels/kda.h,
// kda_backward_state_interval). keep_new_values (with
// keep_chunk_states): also every token's V', B T H V 2 bytes, for the backward's pass 3 by blocks
// (kernels/kda.h, KdaBackwardOptions::new_values).
KdaChunkedOutput kda_chunked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& g, const at::Tensor& beta,
                             const at::Tensor& initial_state, double scale,
                             const at::Tensor& cu_seqlens = at::Tensor(),
                             int64_t segment_length = 0, bool prefetch = true,
                             bool head_walk = true, int64_t lead_length = 0,
                             bool keep_chunk_states = false, int64_t chunk_state_interval = 1,
                             bool keep_new_values = false);

// The gradients of kda_chunked (no cu_seqlens, no context-parallel options) with respect to its
// inputs, from the gradients of its outputs: d_o [B, T, H, V] (any float dtype; converted to q's),
// d_final_state [B, H, K, V] or undefined (zeros). Computed by kernels/kda.h's
// kda_chunked_backward (state recompute, reverse state walk, per-chunk gradients) in fp32; each
// gradient is returned in its input's dtype (d_initial_state: initial_state's, fp32 when that is
// undefined). g must lie in [-5, 0]. The workspace comes from the caching allocator.
// chunk_states: kda_chunked's, kept by the forward on these inputs (keep_chunk_states): the
// states are not recomputed (the same gradients bit for bit, one pass less, half the workspace);
// undefined: recomputed. pass3_blocks: kernels/kda.h's KdaBackwardOptions::pass3_blocks (on by
// default, where it applies: bf16, K = V = 128; it also takes states kept at chunk_state_interval
// 2, and at 4 with new_values, told apart by their shape; kda_backward_state_interval says which
// to keep). keep_values:
// KdaBackwardOptions::keep_values (passes 1 and 2 keep V' and dV' for pass 3 by blocks; on by
// default, as there). new_values: kda_chunked's, kept with chunk_states (keep_new_values), read by pass 3
// by blocks instead of recomputing V' (with chunk_states only). pass3_block_tokens:
// KdaBackwardOptions::pass3_block_tokens (0, the default: fused 64-token blocks where V' and dVb are
// at hand, i.e. keep_values, or new_values with chunk_states, else 32-token blocks; 32; or 64, which
// needs V' and dVb). pass3_block_producer: KdaBackwardOptions::pass3_block_producer (with 64-token
// blocks).
struct KdaChunkedGradients {
  at::Tensor dq, dk, dv, dg, dbeta, d_initial_state;
};
KdaChunkedGradients kda_chunked_backward(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& g,
                                         const at::Tensor& beta, const at::Tensor& initial_state,
                                         const at::Tensor& d_o, const at::Tensor& d_final_state,
                                         double scale, const at::Tensor& chunk_states = at::Tensor(),
                                         bool pass3_blocks = true, bool keep_values = true,
                                         const at::Tensor& new_values = at::Tensor(),
                                         int64_t pass3_block_tokens = 0, bool pass3_block_producer = false);

// Whether kda_step can run these: CUDA, q k v of one dtype bf16 / fp32, K in {32, 64, 128}, V a
// multiple of 32 up to 256, state fp32 and contiguous (it is updated in place).
bool kda_step_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state);

// kda::step on the GPU: q, k, g [B, H, K], v [B, H, V], beta [B, H]; state [B, H, K, V] fp32
// contiguous, updated in place. Returns o [B, H, V] in q's dtype.
at::Tensor kda_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& g, const at::Tensor& beta, at::Tensor& state, double scale);


// ---- The KDA decay gate (kernels/kda_gate.h) -----------------------------------------------------

// Whether the fused gate can run: z a CUDA bf16 / fp32 tensor [..., H, K] with K a positive
// multiple of 4, A_log fp32 [H] and dt_bias fp32 with H K elements ([H K] or [H, K]), on z's device.
// (Other dtypes, e.g. a model converted to bf16 throughout, take model::kda::gate_reference.)
bool kda_gate_supported(const at::Tensor& z, const at::Tensor& a_log, const at::Tensor& dt_bias);

// model::kda::gate on the GPU (nothing recorded for autograd; kernels/kda_autograd.h records it):
// g = g_min sigmoid(exp(A_log[h]) (z + dt_bias[h, c])), fp32, z's shape. Non-contiguous inputs
// are copied.
at::Tensor kda_gate(const at::Tensor& z, const at::Tensor& a_log, const at::Tensor& dt_bias, double g_min);

struct KdaGateGradients {
  at::Tensor dz;         // z's shape and dtype, or undefined when not wanted
  at::Tensor d_a_log;    // fp32 [H], or undefined when not wanted
  at::Tensor d_dt_bias;  // fp32, dt_bias's shape, or undefined when not wanted
};
// Its backward from dg (any float dtype, z's shape; converted to fp32). The parameters' gradients
// are sums over the tokens in a fixed order (kernels/kda_gate.h): the same bits every run.
KdaGateGradients kda_gate_backward(const at::Tensor& z, const at::Tensor& a_log, const at::Tensor& dt_bias,
                                   double g_min, const at::Tensor& dg, bool want_dz, bool want_a_log,
                                   bool want_dt_bias);

// ---- The KDA layer's short convolution (kernels/kda_conv.h) -------------------------------------

// Whether the fused short convolution can run: x fp32 CUDA [B, T, D] with D a multiple of 128,
// conv_inputs fp32 [B, W - 1, D], weight fp32 [D, 1, W] or [D, W] with 1 <= W <= 4, on x's device;
// head 0 (no norm) or a power-of-two multiple of 4 up to 128 dividing D.
bool kda_short_conv_supported(const at::Tensor& x, const at::Tensor& conv_inputs, const at::Tensor& weight,
                              int64_t head);

// SiLU(causal depthwise convolution of [conv_inputs | x] with weight), then with head > 0 each
// head's channels divided by sqrt(their sum of squares + eps): fp32 [B, T, D] (kernels/kda_conv.h;
// nothing recorded for autograd, kernels/kda_autograd.h records it). Non-contiguous inputs are
// copied.
at::Tensor kda_short_conv(const at::Tensor& x, const at::Tensor& conv_inputs, const at::Tensor& weight, int64_t head,
                          double eps);

struct KdaShortConvGradients {
  at::Tensor dx;             // x's shape, or undefined when not wanted
  at::Tensor d_conv_inputs;  // conv_inputs' shape, or undefined when not wanted
  at::Tensor d_weight;       // weight's shape, or undefined when not wanted
};
// Its backward from dy (any float dtype, x's shape). d_weight is summed in a fixed order.
KdaShortConvGradients kda_short_conv_backward(const at::Tensor& x, const at::Tensor& conv_inputs,
                                              const at::Tensor& weight, int64_t head, double eps,
                                              const at::Tensor& dy, bool want_dx, bool want_conv_inputs,
                                              bool want_weight);

// ---- RMSNorm (kernels/rms_norm.h) ---------------------------------------------------------------

// Whether the fused RMSNorm can run: x a CUDA bf16 / fp32 tensor [..., width] with
// 1 <= width <= 1024, weight [width] bf16 / fp32 on x's device.
bool rms_norm_supported(const at::Tensor& x, const at::Tensor& weight);

struct RmsNormForward {
  at::Tensor y;        // x's shape and dtype
  at::Tensor inv_rms;  // fp32 [rows]: 1 / sqrt(mean(x^2) + eps) of every row
};
// model::rms_norm on the GPU (nothing recorded for autograd; kernels/norm_autograd.h records it).
RmsNormForward rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps);

struct RmsNormBackward {
  at::Tensor dx;  // x's shape and dtype
  at::Tensor dw;  // weight's shape and dtype, or undefined when not wanted
};
// Its backward from dy (converted to x's dtype) and the forward's inv_rms.
RmsNormBackward rms_norm_backward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& inv_rms,
                                  const at::Tensor& dy, bool want_dw);

// ---- Attention-residual mix (kernels/attn_res.h) -------------------------------------------------

// Whether the fused mix can run: 2 to 32 sources, CUDA bf16 / fp32 tensors of one shape
// [..., width] and dtype with 1 <= width <= 1024, w [width] bf16 / fp32 on their device.
bool attn_res_mix_supported(const std::vector<at::Tensor>& sources, const at::Tensor& w);

struct AttnResMixForward {
  at::Tensor h;        // the sources' shape and dtype
  at::Tensor weights;  // fp32 [rows, S]: softmax_s of the logits
  at::Tensor inv_rms;  // fp32 [rows, S]: 1 / sqrt(mean(x_s^2) + eps)
};
// model::attn_res_mix on the GPU (nothing recorded for autograd; kernels/norm_autograd.h records it).
AttnResMixForward attn_res_mix_forward(const std::vector<at::Tensor>& sources, const at::Tensor& w, double eps);

struct AttnResMixBackward {
  std::vector<at::Tensor> d_sources;  // each the sources' shape and dtype
  at::Tensor dw;                      // w's shape and dtype, or undefined when not wanted
};
// Its backward from dh (converted to the sources' dtype) and the forward's weights and inv_rms.
AttnResMixBackward attn_res_mix_backward(const std::vector<at::Tensor>& sources, const at::Tensor& w,
                                         const at::Tensor& weights, const at::Tensor& inv_rms,
                                         const at::Tensor& dh, bool want_dw);

// ---- MoE (kernels/moe.h) -------------------------------------------------------------------------

// Whether moe_router_topk can run: scores a CUDA fp32 [m, n] tensor with n <= 1024 and
// 1 <= top_k <= min(32, n).
bool moe_router_topk_supported(const at::Tensor& scores, int64_t top_k);

struct MoeRouterTopk {
  at::Tensor ids;      // int64 [m, top_k], best first (descending scores + bias; ties: lower id)
  at::Tensor weights;  // fp32 [m, top_k]: the selected unbiased scores over their sum
};
// select_experts (model/balancing.h) fused with the mixing weights: the top_k of scores + bias
// per row and p = s_sel / sum(s_sel) from the unbiased scores. scores: CUDA fp32 [m, n], already
// sigmoid'ed (read detached: nothing is recorded for autograd); bias: [n], any floating dtype and
// device (converted to fp32 on scores' device, as select_experts does).
MoeRouterTopk moe_router_topk(const at::Tensor& scores, const at::Tensor& bias, int64_t top_k);

// An fp32 CUDA tensor as `parts` (1 to 3) bf16 tensors of its shape, each the next 8 significant
// bits of what the ones before left (moe_split_bf16): the router's split GEMM operands.
std::vector<at::Tensor> moe_split_bf16(const at::Tensor& x, int parts);

struct MoePermutation;  // below

// The router's sparse backward (kernels/moe.h). moe_router_logit_gradient: from scores (CUDA fp32
// [m, n]), the selection ids (int64 [m, k], distinct per row) and d_p ([m, k], converted to fp32),
// the gradient of each selected logit, fp32 [m, k] aligned with ids (every other logit's is zero).
at::Tensor moe_router_logit_gradient(const at::Tensor& scores, const at::Tensor& ids, const at::Tensor& d_p);
// Whether moe_router_dx and moe_router_dw run for bf16 tokens [m, d] and a weight [n, d] (fp32 or
// bf16) on CUDA: n <= 1024, d a multiple of 32, top_k <= 32.
bool moe_router_backward_applies(const at::Tensor& tokens, const at::Tensor& weight, int64_t top_k);
// d tokens = d_logits scattered to [m, n] times W_r, bf16 [m, d] (fp32 sums over the selection).
at::Tensor moe_router_dx(const at::Tensor& d_logits, const at::Tensor& ids, const at::Tensor& weight);
// d W_r = (d_logits scattered to [m, n])^T tokens, [n, d] in weight_dtype (fp32 sums in a fixed
// order: the same bits every run); permutation: moe_permutation of ids over n experts.
at::Tensor moe_router_dw(const at::Tensor& d_logits, const at::Tensor& tokens, const MoePermutation& permutation,
                         at::ScalarType weight_dtype);

// Whether moe_quantile_histogram can run: CUDA floating (not fp64) scores [m, n] with
// top_k + 1 <= min(32, n) and n <= 1024.
bool moe_quantile_histogram_supported(const at::Tensor& scores, int64_t top_k);

// QuantileBalancer::local_histogram on the GPU: int64 [n, bins] counts of r_ij over [lo, hi]
// (the balancer's histogram_range()), equal to the reference bit for bit. scores [m, n] (any
// non-fp64 floating dtype: converted to fp32 as the reference does), bias [n] (converted to
// fp32). literal_alpha: QuantileBalancerOptions::literal_alpha.
at::Tensor moe_quantile_histogram(const at::Tensor& scores, const at::Tensor& bias, int64_t top_k,
                                  int64_t bins, double lo, double hi, bool literal_alpha);

// model::permute_tokens on the GPU, plus what the kernels need to go back (all on selected's
// device).
struct MoePermutation {
  at::Tensor source;             // int64 [m k]: the copy (token k + slot) at each permuted row
  at::Tensor token;              // int64 [m k]: source / k
  at::Tensor tokens_per_expert;  // int64 [n]
  at::Tensor offsets;            // int64 [n + 1]: exclusive prefix sums of tokens_per_expert
  at::Tensor group_ends;         // int32 [n]: inclusive prefix sums (at::_grouped_mm's offs)
  at::Tensor inverse;            // int64 [m k]: the permuted row of each copy
  int64_t tokens = 0;            // m
  int64_t top_k = 0;             // k
};
// selected: CUDA int64 [m, k] with ids in [0, num_experts) (not checked on the host: that would
// synchronise; an id outside gets no row), num_experts <= 8192, m k < 2^31.
MoePermutation moe_permutation(const at::Tensor& selected, int64_t num_experts);

// rows[index[r]] for every r: [index.size(0), *rows.shape[1:]] in rows' dtype (bf16 or fp32, or
// any 2- or 4-byte type), rows CUDA; index CUDA int64 within range (not checked).
at::Tensor moe_gather_rows(const at::Tensor& rows, const at::Tensor& index);

// model::unpermute on the GPU without atomics: out[t] = sum over slots s of
// weights[t, s] copies[inverse[t k + s]] in fp32. copies [m k, width] bf16 / fp32; weights fp32
// [m, k] or undefined (all 1); out_dtype: the result's dtype (fp32 as model::unpermute returns,
// or copies' dtype for the backward of a permute). vectors = false: the one-column-a-thread
// kernel, for the test that the 16-byte path gives its bits.
at::Tensor moe_unpermute(const at::Tensor& copies, const MoePermutation& permutation,
                         const at::Tensor& weights, at::ScalarType out_dtype, bool vectors = true);

struct MoeUnpermuteGradients {
  at::Tensor d_copies;   // [m k, width], copies' dtype
  at::Tensor d_weights;  // fp32 [m, k]; undefined unless wanted
};
// The backward of moe_unpermute (weights defined) from d_out [m, width] (converted to fp32).
MoeUnpermuteGradients moe_unpermute_backward(const at::Tensor& copies,
                                             const MoePermutation& permutation,
                                             const at::Tensor& weights, const at::Tensor& d_out,
                                             bool want_weights);

// Whether the SiTU-GLU kernels can run: CUDA gate and up of one shape and one dtype bf16 / fp32.
bool situ_glu_supported(const at::Tensor& gate, const at::Tensor& up);
// model::situ_glu fused (fp32 math, one rounding to the inputs' dtype); no autograd.
at::Tensor situ_glu(const at::Tensor& gate, const at::Tensor& up, double beta1, double beta2);
struct SituGluGradients {
  at::Tensor d_gate, d_up;
};
// Its backward from dh (converted to gate's dtype).
SituGluGradients situ_glu_backward(const at::Tensor& gate, const at::Tensor& up,
                                   const at::Tensor& dh, double beta1, double beta2);

// Zeroes stacked[e] (a contiguous bf16 / fp32 [E, ...] CUDA tensor) for every expert e with
// counts[e] == 0 (counts: CUDA int64 [E]); no host synchronisation.
void moe_zero_empty_groups(at::Tensor& stacked, const at::Tensor& counts);

}  // namespace odyssey::kernels
