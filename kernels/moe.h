// CUDA kernels of the stable latent MoE layer (../../shared/design/MODEL.md, "Stable latent MoE"
// and "Quantile balancing"). Framework-free launchers: raw device pointers, sizes and a stream;
// each returns the launch's cudaError_t (cudaErrorInvalidValue for sizes outside the supported
// set, checked before anything is launched). The plain LibTorch references they are tested
// against: model::select_experts and QuantileBalancer::local_histogram (model/balancing.h),
// model::permute_tokens / permute / unpermute (model/moe.h), model::situ_glu (model/ffn.h).
// kernels/torch_bindings.h adapts at::Tensor to these calls. The routed experts run fused
// (moe_experts_forward, below) where that applies, else as at::_grouped_mm or a per-expert loop
// (kernels/moe_autograd.cpp).
//
// Layouts: every tensor is dense row-major (contiguous) in the shape given. "T" is an element
// type chosen by a MoeDtype (bf16 or fp32); arithmetic is fp32 whatever T is. Expert ids are
// int64, as LibTorch's topk / sort return them.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace odyssey::kernels {

enum class MoeDtype : int32_t { kBFloat16 = 0, kFloat32 = 1 };

// ---- Router: top-k with the balancing bias ----------------------------------------------------
// For every token row i of the router's (already sigmoid'ed, unbiased) scores:
//   T_i = the top_k experts of (scores[i] + bias)           (fp32 add, as select_experts does)
//   ids[i, :]     = T_i, best first (descending scores + bias)
//   weights[i, :] = scores[i, T_i] / sum over T_i of scores  (from the UNBIASED scores)
//   scores f32 [m, n]   bias f32 [n]   ids int64 [m, top_k]   weights f32 [m, top_k] (or nullptr)
// Ties: among equal values of scores + bias the lower expert id ranks first, so a tie across the
// k-th place keeps the lower ids. This is a valid top-k (the selected values are the k largest,
// as a multiset); LibTorch's topk leaves its tie order unspecified, so ids equal
// select_experts' as a set whenever the k-th and (k+1)-th values of a row differ.
// NaN scores are not supported. One warp per row, values held in registers.
// Supported: 1 <= top_k <= 32, top_k <= n <= 1024, m >= 0.
constexpr int64_t kMoeTopkMaxExperts = 1024;
constexpr int64_t kMoeTopkMaxK = 32;
cudaError_t moe_router_topk(const float* scores, const float* bias, int64_t* ids, float* weights,
                            int64_t m, int64_t n, int64_t top_k, cudaStream_t stream);

// ---- Router forward: W_r's bf16 parts -------------------------------------------------------------
// x (fp32, count elements) as `parts` bf16 arrays (1 to 3): out[0] = bf16(x), out[i] = bf16(the
// rest the ones before left), each rest exact in fp32; 3 parts carry all 24 bits of the mantissa.
// The operands of the router's split bf16 GEMMs, in one pass (in place of 2 parts - 1 casts and
// subtractions over the weight). out[i] for i >= parts may be nullptr.
cudaError_t moe_split_bf16(const float* x, int64_t count, int parts, void* out0, void* out1, void* out2,
                           cudaStream_t stream);

// ---- Router backward, sparse: the logits' gradient at the selection, then d x and d W_r -------
// Only the top_k selected logits of a token have a gradient (the others reach neither p nor the
// loss), so the router's backward is three sparse passes instead of dense GEMMs over [m, n]:
//
// moe_router_logit_gradient: for every token row i with its selected experts T_i = ids[i, :]
// (distinct, as moe_router_topk and select_experts give them), s = scores[i] (the router's sigmoid
// outputs) and the mixing weights p_j = s[T_ij] / S_i (S_i: the sum of s over T_i), from
// d_p = dL/dp:
//   d_logits[i, j] = (d_p[i, j] - sum_l d_p[i, l] p_l) / S_i * s[T_ij] (1 - s[T_ij])   (fp32)
// aligned with ids (the gradient of logit T_ij; every other logit's is zero). One warp per row.
//   scores f32 [m, n]   ids int64 [m, top_k]   d_p f32 [m, top_k]   d_logits f32 [m, top_k]
// Supported: 1 <= top_k <= 32, top_k <= n, m >= 0.
cudaError_t moe_router_logit_gradient(const float* scores, const int64_t* ids, const float* d_p,
                                      float* d_logits, int64_t m, int64_t n, int64_t top_k,
                                      cudaStream_t stream);

// moe_router_dx: dx[i, :] = sum over j = 0 .. top_k - 1, in that order, of d_logits[i, j] W_r[ids[i, j], :]
// (fp32 fmaf on the fp32 weight: what an fp32 GEMM computes, without its n - top_k zero terms),
// rounded once to bf16. Each CTA keeps 32 columns of W_r for all n experts in shared memory
// (n * 128 bytes) and walks a block of tokens: W_r is read from L2 once per CTA, not once per token.
//   d_logits f32 [m, top_k]   ids int64 [m, top_k]   weight T [n, d]   dx bf16 [m, d]
// weight_dtype: W_r's (fp32 or bf16). Supported: 1 <= top_k <= 32, 1 <= n <= 1024, d a positive
// multiple of 32, m >= 0.
constexpr int64_t kMoeRouterMaxExperts = 1024;
cudaError_t moe_router_dx(const float* d_logits, const int64_t* ids, MoeDtype weight_dtype,
                          const void* weight, void* dx, int64_t m, int64_t n, int64_t d, int64_t top_k,
                          cudaStream_t stream);

// moe_router_dw: dW_r[e, :] = sum over the copies c of expert e (token c / top_k, slot c % top_k;
// the token permutation's rows of e, in their order) of d_logits[c] x[c / top_k, :], fp32, in
// kMoeRouterDwSplits fixed parts of each expert's rows (each summed in row order into the
// workspace), then the parts added in order: the same bits every run, no atomics. Written as the
// weight's dtype. source and offsets are moe_permutation's (below); copies = m top_k.
//   d_logits f32 [m, top_k]   x bf16 [m, d]   source int64 [copies]   offsets int64 [n + 1]
//   dw T [n, d]   workspace: moe_router_dw_workspace_bytes(n, d)
// Supported: 1 <= top_k <= 32, 1 <= n <= 1024, d a positive multiple of 8, m >= 0.
constexpr int kMoeRouterDwSplits = 4;
size_t moe_router_dw_workspace_bytes(int64_t n, int64_t d);
cudaError_t moe_router_dw(const float* d_logits, const void* x, const int64_t* source,
                          const int64_t* offsets, MoeDtype weight_dtype, void* dw, void* workspace,
                          int64_t m, int64_t n, int64_t d, int64_t top_k, cudaStream_t stream);

// ---- Quantile balancing: the per-expert histogram of r_ij -------------------------------------
// Adds this batch's counts to counts (int64 [n, bins], NOT cleared here: zero it first, or let
// it accumulate several batches), exactly as QuantileBalancer::local_histogram (model/
// balancing.cpp) computes them:
//   v = scores[i] + bias (fp32); alpha_i = the (top_k + 1)-th largest of v, kth_i the top_k-th;
//   r_ij = (j among the top_k ? alpha_i : kth_i) - scores[i, j]     (fp32; literal_alpha: alpha_i
//          for every j, MODEL.md's literal form)
//   bin  = clamp(floor(((double) r_ij - lo) * scale), 0, bins - 1)  (fp64; scale = bins / (hi - lo)
//          computed by the caller in fp64, as the reference does)
// Each r_ij is independent of how ties are broken (a tie across the k-th place makes alpha_i and
// kth_i equal), so the counts equal the reference's bit for bit. One warp per token row; counts
// by 64-bit global atomics (integers: the result is deterministic).
// Supported: 1 <= top_k, top_k + 1 <= n <= 1024, top_k + 1 <= 32, bins >= 1, hi > lo.
cudaError_t moe_quantile_histogram(const float* scores, const float* bias, int64_t* counts,
                                   int64_t m, int64_t n, int64_t top_k, int64_t bins, double lo,
                                   double scale, bool literal_alpha, cudaStream_t stream);

// ---- Token permutation --------------------------------------------------------------------------
// The token copies c = token * top_k + slot (copies = m * top_k of them) sorted by expert, stably
// (each expert's copies keep their order), as model::permute_tokens:
//   ids         int64 [copies]   expert of each copy (selected [m, top_k] flattened), in [0, n)
//   counts      int64 [n]        written: copies of each expert (tokens_per_expert)
//   offsets     int64 [n + 1]    written: exclusive prefix sums of counts (offsets[n] = copies)
//   group_ends  int32 [n]        written, or nullptr: inclusive prefix sums (at::_grouped_mm's offs)
//   source      int64 [copies]   written: the copy at each permuted row
//   token       int64 [copies]   written: source / top_k
//   inverse     int64 [copies]   written: the permuted row of each copy (source's inverse)
// Ids outside [0, n) are a precondition violation: such copies get no row (inverse = -1) and the
// counts no longer sum to copies; nothing is written out of bounds.
// Three kernels: per-block expert counts, one CTA's scan (per expert over blocks, then over
// experts), per-block stable placement (warp match on equal ids, ranks by popcount).
// Workspace: moe_permutation_workspace_bytes(copies, n) bytes, 16-byte aligned, used only in the
// call's stream order. Supported: 1 <= n <= 8192, 0 <= copies < 2^31, top_k >= 1.
constexpr int64_t kMoePermutationMaxExperts = 8192;
size_t moe_permutation_workspace_bytes(int64_t copies, int64_t n);
cudaError_t moe_permutation(const int64_t* ids, int64_t copies, int64_t n, int64_t top_k,
                            int64_t* counts, int64_t* offsets, int32_t* group_ends,
                            int64_t* source, int64_t* token, int64_t* inverse, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream);

// Gather rows: out[r, :] = in[index[r], :] for r < rows; in [*, width] and out [rows, width] of
// one element size (2 or 4 bytes; the copy is bytewise, in 16-byte vectors where the row allows).
// index int64 in range (precondition). Used for permute (index = token) and for its backward's
// weighted gather (see moe_unpermute_backward).
cudaError_t moe_gather_rows(const void* in, const int64_t* index, void* out, int64_t rows,
                            int64_t width, int64_t element_size, cudaStream_t stream);

// Un-permute: out[t, :] = sum over slots s of weights[t, s] * copies[inverse[t * top_k + s], :],
// summed in fp32 (fmaf) in slot order, no atomics (each token reads its own top_k copies). bf16
// copies of a width divisible by 8 (16-byte aligned) go 8 columns a thread, the token's rows
// loaded 8 slots at a time; otherwise one CTA per token, one thread per column up to 1024
// columns. The two give the same bits; vectors = false forces the second (the parity test's).
//   copies  T [m * top_k, width]   weights f32 [m, top_k] or nullptr (all 1: the backward of
//   permute)   inverse int64 [m * top_k]   out: out_dtype [m, width]
// Copies without a row (inverse < 0) contribute nothing.
cudaError_t moe_unpermute(MoeDtype dtype, const void* copies, const float* weights,
                          const int64_t* inverse, MoeDtype out_dtype, void* out, int64_t m,
                          int64_t top_k, int64_t width, cudaStream_t stream, bool vectors = true);

// The backward of moe_unpermute with respect to copies and weights, from d_out f32 [m, width]:
//   d_copies[r, :]  = weights[source[r]] * d_out[source[r] / top_k, :]  (T [m * top_k, width],
//                     rounded once from fp32; or nullptr when not wanted)
//   d_weights[c]    = <d_out[c / top_k, :], copies[inverse[c], :]>     (f32 [m * top_k], or
//                     nullptr when not wanted; fp32 dot product)
// One pass, one warp per copy c, both outputs from one read of its token's d_out row; the copies
// are reached through inverse (row r = inverse[c] is the copy source[r] = c), so source is not
// read (the parameter stays for callers). Rows that no copy maps to (ids outside [0, n)) are not
// written.
cudaError_t moe_unpermute_backward(MoeDtype dtype, const void* copies, const float* weights,
                                   const int64_t* source, const int64_t* inverse,
                                   const float* d_out, void* d_copies, float* d_weights,
                                   int64_t m, int64_t top_k, int64_t width, cudaStream_t stream);

// ---- SiTU-GLU (model/ffn.h), elementwise, fp32 math ---------------------------------------------
//   h = [beta1 tanh(g / beta1) sigma(g)] * [beta2 tanh(u / beta2)]
// Forward: gate, up, h: T [count]. Backward: from dh T [count], writes
//   dg = dh * c2 * ((1 - tanh^2(g / beta1)) sigma(g) + c1 sigma(g) (1 - sigma(g)))
//   du = dh * c1 sigma(g) (1 - tanh^2(u / beta2))       (c1, c2 the capped gate and up)
// each rounded once to T. Any count >= 0; no alignment needed (bf16 counts of whole 8-element
// pieces with 16-byte aligned pointers go 16 bytes at a time, to the same values). The gradients,
// and h in fp32, from the accurate tanhf / expf; h in bf16 on the special-function unit as the fused
// experts compute it (situ.cuh, situ_h_fast: relative error below 2^-11), so every bf16 h of the
// MoE kernels, fused, standalone or recomputed in the backward, is the same for the same g and u.
cudaError_t situ_glu_forward(MoeDtype dtype, const void* gate, const void* up, void* h,
                             int64_t count, float beta1, float beta2, cudaStream_t stream);
cudaError_t situ_glu_backward(MoeDtype dtype, const void* gate, const void* up, const void* dh,
                              void* d_gate, void* d_up, int64_t count, float beta1, float beta2,
                              cudaStream_t stream);
// The same backward that also writes h (T [count], or nullptr), the forward's output recomputed
// from gate and up in the same pass, equal to situ_glu_forward's bit for bit: for a caller that
// did not keep h (the routed experts' backward needs it for dW_down), one read of gate and up
// and one launch instead of two.
cudaError_t situ_glu_backward_with_h(MoeDtype dtype, const void* gate, const void* up,
                                     const void* dh, void* d_gate, void* d_up, void* h,
                                     int64_t count, float beta1, float beta2,
                                     cudaStream_t stream);

// ---- Routed experts, fused (moe_experts.cu) ----------------------------------------------------
// The routed experts' whole MLP in one kernel, on tensor cores (mma.sync, fp32 accumulation), for
// rows grouped by expert (expert e owns rows [group_ends[e - 1], group_ends[e]), as
// moe_permutation writes them):
//   G = X W_gate[e]^T, U = X W_up[e]^T      fp32 sums, each rounded once to bf16; stored into
//                                           gate, up when they are not nullptr (the backward's)
//   H = situ_glu(G, U)                      from the rounded G and U on the special-function
//                                           unit (situ.cuh, situ_h_fast: tanh.approx, relative
//                                           error below 2^-11), rounded to bf16, never stored:
//                                           situ_glu_forward's bf16 H, bit for bit
//   Y = H W_down[e]^T                       fp32 sums, rounded once to bf16
// So G and U equal the grouped GEMMs' bit for bit, and Y the unfused chain (grouped GEMMs with bf16
// results, situ_glu_forward, grouped GEMM) up to the order of the fp32 sums. All bf16:
//   rows [R, L]   gate_proj, up_proj [E, F, L]   down_proj [E, L, F]   group_ends int32 [E]
//   y [R, L]      gate, up [R, F] (both or neither)
// Nothing is read back to the host (the tile schedule is built on the device from group_ends), so
// group_ends are not checked: they must be non-decreasing with group_ends[E - 1] <= R, as
// moe_permutation writes them (the same precondition as the grouped GEMMs' offsets).
// Supported (moe_experts_fused_supported): sm_80 or newer, L in {128, 256, 384, 512} and F a
// multiple of 64 with L + F <= 640 (the pairs compiled: 128 rows of L and of F plus three 16 KB
// weight chunks fit an sm_90 CTA's 227 KB; L = 384, F = 192: 207 KB), and the device's opt-in
// shared memory; 1 <= E <= 1024, R < 2^31, 16-byte aligned rows, weights and y.
// Two kernels do it (MoeExpertsKernel): kMmaSync, the one above (sm_80 and newer); kWgmma, the
// same tiles on Hopper's warpgroup instructions (kernels/moe_experts_sm90.h: sm_90 devices, L + F
// <= 576), whose sums run in another order (G and U equal kMmaSync's up to fp32 rounding before
// their bf16 rounding). kAuto takes kWgmma where it is supported, else kMmaSync; asking for a
// kernel that is not supported here returns cudaErrorInvalidValue.
enum class MoeExpertsKernel : int32_t { kAuto = 0, kMmaSync = 1, kWgmma = 2 };
bool moe_experts_fused_supported(int64_t latent, int64_t ffn, int64_t experts);
cudaError_t moe_experts_forward(const void* rows, const void* gate_proj, const void* up_proj,
                                const void* down_proj, const int32_t* group_ends, void* y,
                                void* gate, void* up, int64_t total_rows, int64_t experts,
                                int64_t latent, int64_t ffn, float beta1, float beta2,
                                cudaStream_t stream,
                                MoeExpertsKernel kernel = MoeExpertsKernel::kAuto);

// ---- Routed experts' weight gradients (moe_experts_backward.cu) ----------------------------------
// The three weight gradients of the routed experts in one kernel, on tensor cores (mma.sync, fp32
// accumulation over each expert's rows, each element rounded once to bf16), for rows grouped by
// expert as above (expert e owns rows [group_ends[e - 1], group_ends[e])):
//   d_gate_proj[e] = dG_e^T X_e    d_up_proj[e] = dU_e^T X_e    [F, L] each
//   d_down_proj[e] = dY_e^T H_e                                  [L, F]
// and exact zeros for experts without rows (so no separate zeroing pass). All bf16 (the outputs fp32 with fp32_outputs, below):
//   rows (X) [R, L]   d_gate, d_up (dG, dU) [R, F]   dy [R, L]   h [R, F]   group_ends int32 [E]
//   d_gate_proj, d_up_proj [E, F, L] (both or neither: then rows, d_gate, d_up are not read)
//   d_down_proj [E, L, F] (or nullptr: then dy, h are not read)
// The same precondition on group_ends as moe_experts_forward (not checked: no host sync). One
// launch replaces three 2d x 2d grouped GEMMs and the zeroing of empty experts; the sums run over
// each expert's rows in order in 32-row chunks, so results equal at::_grouped_mm's up to the order
// of the fp32 sums. Supported (moe_experts_weight_grads_supported): sm_80 or newer, L a multiple
// of 128, F a multiple of 64, 1 <= E <= 1024 (every CTA sorts the experts by rows in shared
// memory and deals the jobs out largest first), E L F < 2^31, R < 2^31, 16-byte aligned pointers.
// Two kernels (MoeExpertsKernel, as the forward's): kMmaSync, sm_80 and newer; kWgmma, sm_90
// devices (kernels/moe_experts_sm90.h), the same jobs with the rows summed in chunks of 64 (equal
// up to the order of the fp32 sums). kAuto takes kWgmma where it is supported.
// fp32_outputs: d_gate_proj, d_up_proj, d_down_proj are fp32, the sums themselves, unrounded (for
// fp32 weights trained through bf16 copies: no bf16 gradient to cast back); the bf16 outputs are
// exactly these rounded once. The wgmma kernel's alone: elsewhere (or with kMmaSync) it is
// cudaErrorInvalidValue.
bool moe_experts_weight_grads_supported(int64_t latent, int64_t ffn, int64_t experts);
cudaError_t moe_experts_weight_grads(const void* rows, const void* d_gate, const void* d_up,
                                     const void* dy, const void* h, const int32_t* group_ends,
                                     void* d_gate_proj, void* d_up_proj, void* d_down_proj,
                                     int64_t total_rows, int64_t experts, int64_t latent,
                                     int64_t ffn, cudaStream_t stream,
                                     MoeExpertsKernel kernel = MoeExpertsKernel::kAuto,
                                     bool fp32_outputs = false);

// ---- Routed experts' dX (moe_experts_backward.cu) -------------------------------------------------
// The rows' gradient of the routed experts' first two GEMMs as one kernel, on tensor cores:
//   dx[r] = d_gate[r] W_gate[e] + d_up[r] W_up[e]   for the rows r of expert e
// one fp32 sum over the 2F products, rounded once to bf16 (no bf16 intermediate, where two
// GEMMs added in place round twice). All bf16:
//   d_gate, d_up [R, F]   gate_proj, up_proj [E, F, L]   group_ends int32 [E]   dx [R, L]
// The same precondition on group_ends as moe_experts_forward (not checked). Supported
// (moe_experts_dx_supported): sm_80 or newer, L a multiple of 128, F a multiple of 64,
// 1 <= E <= 1024, E L F < 2^31, R < 2^31, 16-byte aligned pointers.
// Two kernels (MoeExpertsKernel, as the forward's): kMmaSync, sm_80 and newer; kWgmma, sm_90
// devices (kernels/moe_experts_sm90.h), the same sums in the same order. kAuto takes kWgmma where
// it is supported.
bool moe_experts_dx_supported(int64_t latent, int64_t ffn, int64_t experts);
cudaError_t moe_experts_dx(const void* d_gate, const void* d_up, const void* gate_proj,
                           const void* up_proj, const int32_t* group_ends, void* dx,
                           int64_t total_rows, int64_t experts, int64_t latent, int64_t ffn,
                           cudaStream_t stream,
                           MoeExpertsKernel kernel = MoeExpertsKernel::kAuto);

// Zeroes the rows of experts with no tokens in a stacked [groups, row_elements] tensor (weight
// gradients of grouped GEMMs over an empty token range); counts int64 [groups].
cudaError_t moe_zero_empty_groups(MoeDtype dtype, void* data, const int64_t* counts,
                                  int64_t groups, int64_t row_elements, cudaStream_t stream);

}  // namespace odyssey::kernels
