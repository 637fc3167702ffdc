// The MoE kernels recorded for autograd (GPU build only): the token permutation, the weighted
// un-permute, fused SiTU-GLU, and the routed experts as grouped GEMMs. model/moe.cpp's MoeImpl
// uses them for CUDA bf16 / fp32 inputs; MoeImpl::forward_reference stays the plain LibTorch path
// these are tested against (tests/kernels/moe_kernel_test.cpp).
//
// Every backward here is first order only (its own ops are not recorded: no double backward).
// Gradients are the reference's: permute's backward sums each token's copies, unpermute's gives
// the copies weight * d_out and the weights <d_out, copy> (so the router learns through p), the
// expert GEMMs' backward is dX = dY W and dW = dY^T X per expert.
//
// Grouped GEMMs. With LibTorch >= 2.8 (TORCH_VERSION_MAJOR / MINOR of <torch/version.h>), bf16
// rows and weights, an sm90 / sm100 device, widths that are multiples of 16 and fewer than 1024
// experts (LibTorch's CUTLASS path refuses more groups), the experts run
// as at::_grouped_mm (CUTLASS grouped GEMM, offsets on the device: no host synchronisation):
//   forward    G = X W_gate^T, U = X W_up^T, Y = H W_down^T     2d x 3d, rows grouped by offs
//   backward   dH = dY W_down, dX = dG W_gate + dU W_up          2d x 3d
//              dW_down = dY^T H, dW_gate = dG^T X, dW_up = dU^T X 2d x 2d, offs over the tokens
// Nothing relies on an autograd formula of at::_grouped_mm: MoeExpertsFunction is a custom
// Function whose backward calls at::_grouped_mm itself. Weight gradients of experts with no
// tokens are zeroed explicitly (moe_zero_empty_groups) rather than trusting what a 2d x 2d GEMM
// over an empty range leaves. Otherwise (fp32, LibTorch 1.13, other devices or widths) the same
// Function loops over experts with at::mm on host-side counts (one device-to-host copy).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

#include "kernels/moe.h"
#include "kernels/torch_bindings.h"

namespace odyssey::kernels {

// Which GEMMs MoeExpertsFunction uses. kFused: the forward as one kernel (moe_experts_forward,
// kernels/moe.h: both GEMMs and SiTU-GLU per tile of rows), the backward's dX and its weight
// gradients as one kernel each (moe_experts_dx, moe_experts_weight_grads); the backward's dH
// grouped where that applies, else the loop. kCublas: every product one grouped GEMM over the
// counts on the host (kernels/grouped_gemm.h: one launch a product; fp32 on our CUDA-core kernels,
// bf16 on cuBLAS's grouped GEMM; built against cuBLAS >= 12.5). kLoop: one at::mm
// an expert. kAuto takes kFused where it applies, else at::_grouped_mm where that applies (see
// above), else kCublas where that applies (the fp32 path), else the loop; the fused path's dH
// takes the same order.
enum class MoeGemm { kAuto, kGrouped, kLoop, kFused, kCublas };

// Whether at::_grouped_mm was compiled in (LibTorch >= 2.8).
bool moe_grouped_mm_compiled();
// Whether kAuto picks at::_grouped_mm for these rows [R, L] and stacked weights
// gate / up [E, F, L], down [E, L, F].
bool moe_grouped_mm_applies(const at::Tensor& rows, const at::Tensor& gate_proj,
                            const at::Tensor& up_proj, const at::Tensor& down_proj);

// Whether the fused experts' forward applies: CUDA bf16 rows [R, L] and weights (gate / up
// [E, F, L], down [E, L, F]) on one device, and moe_experts_fused_supported(L, F, E) there.
bool moe_experts_fused_applies(const at::Tensor& rows, const at::Tensor& gate_proj,
                               const at::Tensor& up_proj, const at::Tensor& down_proj);

// moe_experts_forward on tensors, without autograd: y [R, L] and, when want_gate_up, the gate
// and up activations [R, F] (what MoeExpertsFunction saves for its backward); `kernel` picks the
// mma.sync or the wgmma kernel (kernels/moe.h, MoeExpertsKernel; kAuto as the layer runs). Errors
// name what does not apply.
struct MoeExpertsFused {
  at::Tensor y, gate, up;
};
MoeExpertsFused moe_experts_fused_forward(const at::Tensor& rows, const at::Tensor& gate_proj,
                                          const at::Tensor& up_proj, const at::Tensor& down_proj,
                                          const MoePermutation& permutation, double beta1,
                                          double beta2, bool want_gate_up,
                                          MoeExpertsKernel kernel = MoeExpertsKernel::kAuto);

// dX = dG W_gate + dU W_up of the routed experts as one kernel (moe_experts_dx, kernels/moe.h):
// one fp32 sum over the 2F products per element, rounded once. d_gate, d_up [R, F] grouped by
// expert as group_ends (int32 [E]) says, gate_proj, up_proj [E, F, L], all CUDA bf16 on one
// device; returns [R, L]. MoeExpertsFunction's backward takes it whenever its forward ran fused.
// Whether it applies: bf16 CUDA, sm_80 or newer, L a multiple of 128, F a multiple of 64, at most
// 1024 experts. Errors name the tensor or the width that does not fit.
bool moe_experts_dx_applies(const at::Tensor& d_gate, const at::Tensor& gate_proj);
at::Tensor moe_experts_dx(const at::Tensor& d_gate, const at::Tensor& d_up,
                          const at::Tensor& gate_proj, const at::Tensor& up_proj,
                          const at::Tensor& group_ends,
                          MoeExpertsKernel kernel = MoeExpertsKernel::kAuto);

// The routed experts' three weight gradients as one kernel (moe_experts_weight_grads, kernels/
// moe.h): dW_gate = dG^T X, dW_up = dU^T X per expert ([E, F, L]) when want_gate_up, dW_down =
// dY^T H ([E, L, F]) when want_down (the others undefined and their inputs not read), exact
// zeros for experts without rows. rows [R, L], d_gate / d_up / h [R, F], dy [R, L], all CUDA
// bf16 on one device; group_ends int32 [E] as the permutation's. MoeExpertsFunction's backward
// takes it whenever its forward ran fused (MoeGemm::kFused, or kAuto where that applies).
// out_dtype kFloat: the gradients are the kernel's fp32 sums themselves (the bf16 ones are these
// rounded once, bit for bit), for fp32 weights trained through bf16 copies; the wgmma kernel's
// alone (moe_experts_weight_grads_wgmma_supported: an sm_90 GPU). Errors name the tensor or the
// width that does not fit.
struct MoeExpertWeightGrads {
  at::Tensor d_gate_proj, d_up_proj, d_down_proj;
};
// Whether it supports these rows [R, L] and gate_proj [E, F, L]: CUDA bf16, sm_80 or newer, L a
// multiple of 128, F a multiple of 64, at most 1024 experts.
bool moe_experts_weight_grads_applies(const at::Tensor& rows, const at::Tensor& gate_proj);
MoeExpertWeightGrads moe_experts_weight_grads(const at::Tensor& rows, const at::Tensor& d_gate,
                                              const at::Tensor& d_up, const at::Tensor& dy,
                                              const at::Tensor& h, const at::Tensor& group_ends,
                                              bool want_gate_up, bool want_down,
                                              MoeExpertsKernel kernel = MoeExpertsKernel::kAuto,
                                              at::ScalarType out_dtype = at::kBFloat16);

// model::permute with autograd: rows[r] = tokens[permutation.token[r]]; tokens [m, width] CUDA
// (2- or 4-byte elements). Backward: each token's gradient is the sum of its k copies' (fp32, no
// atomics).
at::Tensor moe_permute_autograd(const at::Tensor& tokens, const MoePermutation& permutation);

// model::unpermute with autograd: fp32 [m, width] = sum over slots of weights * copies. copies
// bf16 / fp32 [m k, width]; weights fp32 [m, k] (differentiable: the mixing weights p).
at::Tensor moe_unpermute_autograd(const at::Tensor& copies, const MoePermutation& permutation,
                                  const at::Tensor& weights);

// model::situ_glu with autograd, both directions fused (kernels/moe.h).
at::Tensor situ_glu_autograd(const at::Tensor& gate, const at::Tensor& up, double beta1,
                             double beta2);

// bf16 copies of fp32 expert weights (model::Bf16Shadow's), not recorded for autograd: for
// training fp32 weights on the bf16 kernels (the medium float32 matmul precision).
struct MoeExpertWeightCopies {
  at::Tensor gate_proj, up_proj, down_proj;
};

// StackedExperts::forward with autograd: rows [R, L] grouped by expert as permutation says
// (R = m k), gate_proj / up_proj [E, F, L], down_proj [E, L, F], all one dtype (bf16 or fp32);
// SiTU-GLU between the GEMMs fused. Returns [R, L] in rows' dtype. Saves rows and the gate and up
// activations ([R, F] each); H is recomputed in the backward, inside the SiTU-GLU backward's pass.
// With `copies` (all three, bf16, the weights' shapes; the weights fp32 and rows bf16) the products
// run on the copies and rows, and the gradients go to the fp32 weights themselves, in fp32: on an
// sm_90 GPU the weight-gradient kernel's fp32 sums, unrounded (no bf16 gradient, no cast pass),
// elsewhere the bf16 gradients cast. gemm picks the products as for bf16 weights.
at::Tensor moe_experts_autograd(const at::Tensor& rows, const at::Tensor& gate_proj,
                                const at::Tensor& up_proj, const at::Tensor& down_proj,
                                const MoePermutation& permutation, double beta1, double beta2,
                                MoeGemm gemm = MoeGemm::kAuto,
                                const MoeExpertWeightCopies& copies = {});

// ---- the steps of moe_experts_autograd one at a time --------------------------------------------
// Exactly what MoeExpertsFunction runs (no autograd), for the bench's per-stage breakdown
// (bench/kernels_bench.cpp) and the tests.

// The groups of rows the expert GEMMs multiply: expert e owns rows [ends[e] - counts[e], ends[e]).
struct MoeExpertGroups {
  bool grouped = false;       // at::_grouped_mm; else kernels/grouped_gemm.h or a loop of at::mm_out over host-side counts
  bool cublas = false;        // (not grouped) one kernels/grouped_gemm.h launch a product (fp32: CUDA cores; bf16: cuBLAS)
  at::Tensor counts;          // int64 [E], device
  at::Tensor ends;            // int32 [E], device: inclusive prefix sums of counts (grouped only)
  std::vector<int64_t> host;  // counts on the host (not grouped)
};
// grouped: at::_grouped_mm (the caller checked moe_grouped_mm_applies), no host synchronisation;
// otherwise copies counts to the host (one synchronisation), for kernels/grouped_gemm.h where
// `cublas` (the caller checked cublas_grouped_gemm_applies), else for a loop of at::mm.
MoeExpertGroups moe_expert_groups(const at::Tensor& counts, const at::Tensor& ends, bool grouped,
                                  bool cublas = false);
// x [R, K] grouped by rows, w [E, K, N] (any strides) -> [R, N]: row block e times w[e].
at::Tensor moe_expert_rows_times(const at::Tensor& x, const at::Tensor& w,
                                 const MoeExpertGroups& groups);
// a [R, M], b [R, N] grouped by rows -> [E, M, N]: a_e^T b_e, exactly zero for experts without
// rows.
at::Tensor moe_expert_weight_grad(const at::Tensor& a, const at::Tensor& b,
                                  const MoeExpertGroups& groups);

struct SituGluBackwardWithH {
  at::Tensor h;  // situ_glu(gate, up) bit for bit; undefined unless want_h
  at::Tensor d_gate, d_up;
};
// kernels::situ_glu_backward (same checks, same gradients bit for bit) that also returns h from
// the same pass (moe.h, situ_glu_backward_with_h): the experts' backward needs h for dW_down and
// does not save it. (A tensor binding; it belongs in torch_bindings.{h,cpp} with the others.)
SituGluBackwardWithH situ_glu_backward_with_h(const at::Tensor& gate, const at::Tensor& up,
                                              const at::Tensor& dh, double beta1, double beta2,
                                              bool want_h = true);

// ---- the router's logits -------------------------------------------------------------------------
// W_r x for bf16 tokens [m, d] and the router weight [E, d] (fp32, as a bf16 model keeps it, or
// bf16), as fp32 [m, E], on tensor cores: W_r is split into three bf16 parts (W = W_hi + W_mid +
// W_lo, each the next 8 significant bits: all 24 of fp32; a bf16 W is one part) and x W_part^T
// are bf16 GEMMs with fp32 accumulation and fp32 results. A product of two bf16 numbers is exact
// in fp32, so this is the reference's fp32 GEMM up to the order of the sums, at about a quarter
// of its time (three 0.028 ms GEMMs for one 0.353 ms fp32 GEMM at m = 8192, d = 1024, E = 896 on
// the H200). Backward, for the fp32 gradient g of the logits, also as split bf16 GEMMs: dx from
// the leading 16 bits of g and W (the result is bf16), dW from all 24 bits of g for an fp32 W.
// Whether it applies: CUDA, bf16 tokens, an fp32 or bf16 weight, LibTorch >= 2.8 (at::mm with an
// output dtype).
bool router_logits_applies(const at::Tensor& tokens, const at::Tensor& weight);
at::Tensor router_logits_autograd(const at::Tensor& tokens, const at::Tensor& weight);

// The mixing weights p = s[ids] / sum(s[ids]) recorded for autograd as a function of tokens and
// W_r, with s = sigmoid(x W_r^T) computed by the caller without a tape (scores, fp32 [m, E]) and
// ids the selection (int64 [m, k], distinct per row). The forward is model::mixing_weights'
// formula on scores; the backward is sparse: the k selected logits' gradients through p and the
// sigmoid in one kernel (moe_router_logit_gradient), then d x and d W_r from them alone
// (moe_router_dx, moe_router_dw; fp32 sums, the same bits every run). permutation: ids' token
// permutation over E experts if the caller has it (MoeImpl does), else the backward makes one.
// Whether it applies: router_logits_applies, E <= 1024, d a multiple of 32, k <= 32.
bool router_weights_applies(const at::Tensor& tokens, const at::Tensor& weight, int64_t top_k);
at::Tensor router_weights_autograd(const at::Tensor& tokens, const at::Tensor& weight,
                                   const at::Tensor& scores, const at::Tensor& ids,
                                   const MoePermutation* permutation = nullptr);

}  // namespace odyssey::kernels
