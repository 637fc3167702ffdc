#include "kernels/moe_autograd.h"
#include "kernels/grouped_gemm.h"
#include "kernels/moe_experts_sm90.h"

#include <cstdint>
#include <vector>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/autograd.h>
#include <torch/version.h>

#include "kernels/moe.h"

// at::_grouped_mm (2d x 3d and 2d x 2d with offsets) exists from LibTorch 2.8 on; the local
// compile check builds against 1.13 headers, which have neither the op nor its header.
#if defined(TORCH_VERSION_MAJOR) && \
    (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8))
#define ODYSSEY_HAVE_GROUPED_MM 1
#else
#define ODYSSEY_HAVE_GROUPED_MM 0
#endif

namespace odyssey::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The permutation's index tensors ride in saved_data (they carry no gradient).
void save_permutation(AutogradContext* ctx, const MoePermutation& p) {
  ctx->saved_data["source"] = p.source;
  ctx->saved_data["token"] = p.token;
  ctx->saved_data["tokens_per_expert"] = p.tokens_per_expert;
  ctx->saved_data["offsets"] = p.offsets;
  ctx->saved_data["group_ends"] = p.group_ends;
  ctx->saved_data["inverse"] = p.inverse;
  ctx->saved_data["tokens"] = p.tokens;
  ctx->saved_data["top_k"] = p.top_k;
}

MoePermutation load_permutation(AutogradContext* ctx) {
  MoePermutation p;
  p.source = ctx->saved_data["source"].toTensor();
  p.token = ctx->saved_data["token"].toTensor();
  p.tokens_per_expert = ctx->saved_data["tokens_per_expert"].toTensor();
  p.offsets = ctx->saved_data["offsets"].toTensor();
  p.group_ends = ctx->saved_data["group_ends"].toTensor();
  p.inverse = ctx->saved_data["inverse"].toTensor();
  p.tokens = ctx->saved_data["tokens"].toInt();
  p.top_k = ctx->saved_data["top_k"].toInt();
  return p;
}

class MoePermuteFunction : public torch::autograd::Function<MoePermuteFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& tokens,
                               const MoePermutation& permutation) {
    save_permutation(ctx, permutation);
    ctx->saved_data["dtype"] = static_cast<int64_t>(tokens.scalar_type());
    return {moe_gather_rows(tokens, permutation.token)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    const MoePermutation p = load_permutation(ctx);
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    // Each token's gradient: the sum of its k copies' (the unpermute kernel with unit weights).
    const at::Tensor d_rows = grads[0].to(dtype).contiguous();
    const at::Tensor flat = d_rows.reshape({d_rows.size(0), -1});
    at::Tensor d_tokens = moe_unpermute(flat, p, at::Tensor(), dtype);
    std::vector<int64_t> shape = d_rows.sizes().vec();
    shape[0] = p.tokens;
    return {d_tokens.reshape(shape), at::Tensor()};
  }
};

class MoeUnpermuteFunction : public torch::autograd::Function<MoeUnpermuteFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& copies,
                               const at::Tensor& weights, const MoePermutation& permutation) {
    save_permutation(ctx, permutation);
    ctx->save_for_backward({copies, weights});
    return {moe_unpermute(copies, permutation, weights, at::kFloat)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const variable_list saved = ctx->get_saved_variables();
    const MoePermutation p = load_permutation(ctx);
    const bool want_weights = ctx->needs_input_grad(1);
    MoeUnpermuteGradients g = moe_unpermute_backward(saved[0], p, saved[1], grads[0], want_weights);
    return {g.d_copies,
            want_weights ? g.d_weights.to(saved[1].scalar_type()) : at::Tensor(), at::Tensor()};
  }
};

class SituGluFunction : public torch::autograd::Function<SituGluFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up,
                               double beta1, double beta2) {
    ctx->save_for_backward({gate, up});
    ctx->saved_data["beta1"] = beta1;
    ctx->saved_data["beta2"] = beta2;
    return {situ_glu(gate, up, beta1, beta2)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const variable_list saved = ctx->get_saved_variables();
    SituGluGradients g = situ_glu_backward(saved[0], saved[1], grads[0],
                                           ctx->saved_data["beta1"].toDouble(),
                                           ctx->saved_data["beta2"].toDouble());
    return {g.d_gate, g.d_up, at::Tensor(), at::Tensor()};
  }
};

// ---- grouped GEMMs ----------------------------------------------------------------------------------

class MoeExpertsFunction : public torch::autograd::Function<MoeExpertsFunction> {
 public:
  // weight_gate, weight_up, weight_down: the weights the gradients are for. gate_copy, up_copy,
  // down_copy: their bf16 copies, or nullopt. Given, the products run on them and the weights'
  // gradients come back in the weights' dtype (fp32).
  static variable_list forward(AutogradContext* ctx, const at::Tensor& rows,
                               const at::Tensor& weight_gate, const at::Tensor& weight_up,
                               const at::Tensor& weight_down, const c10::optional<at::Tensor>& gate_copy,
                               const c10::optional<at::Tensor>& up_copy,
                               const c10::optional<at::Tensor>& down_copy, const MoePermutation& permutation,
                               double beta1, double beta2, bool grouped, bool fused, bool cublas) {
    // (Optional, not undefined tensors: autograd takes every at::Tensor argument for an input.)
    const bool copies = gate_copy.has_value() && gate_copy->defined();
    const at::Tensor& gate_proj = copies ? *gate_copy : weight_gate;
    const at::Tensor& up_proj = copies ? *up_copy : weight_up;
    const at::Tensor& down_proj = copies ? *down_copy : weight_down;
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight_gate.scalar_type());
    // With `fused` the forward is one kernel, and so are the backward's dX (moe_experts_dx) and
    // its weight gradients (moe_experts_weight_grads); dH is a grouped GEMM or a loop.
    const MoeExpertGroups g =
        moe_expert_groups(permutation.tokens_per_expert, permutation.group_ends, grouped, cublas);
    const at::Tensor x = rows.contiguous();
    at::Tensor gate, up, y;
    if (fused) {
      const MoeExpertsFused out = moe_experts_fused_forward(x, gate_proj, up_proj, down_proj,
                                                            permutation, beta1, beta2, true);
      gate = out.gate, up = out.up, y = out.y;
    } else {
      gate = moe_expert_rows_times(x, gate_proj.transpose(1, 2), g);
      up = moe_expert_rows_times(x, up_proj.transpose(1, 2), g);
      const at::Tensor h = situ_glu(gate, up, beta1, beta2);
      y = moe_expert_rows_times(h, down_proj.transpose(1, 2), g);
    }
    save_permutation(ctx, permutation);
    ctx->save_for_backward({x, gate_proj, up_proj, down_proj, gate, up});
    ctx->saved_data["beta1"] = beta1;
    ctx->saved_data["beta2"] = beta2;
    ctx->saved_data["grouped"] = grouped;
    ctx->saved_data["fused"] = fused;
    ctx->saved_data["cublas"] = g.cublas;
    if (!grouped) ctx->saved_data["host_counts"] = g.host;
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list none(13);
    if (!grads[0].defined()) return none;
    const auto weight_dtype = static_cast<at::ScalarType>(ctx->saved_data["weight_dtype"].toInt());
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &gate_proj = saved[1], &up_proj = saved[2],
                     &down_proj = saved[3], &gate = saved[4], &up = saved[5];
    const double beta1 = ctx->saved_data["beta1"].toDouble();
    const double beta2 = ctx->saved_data["beta2"].toDouble();
    MoeExpertGroups g;
    g.grouped = ctx->saved_data["grouped"].toBool();
    g.cublas = ctx->saved_data["cublas"].toBool();
    g.counts = ctx->saved_data["tokens_per_expert"].toTensor();
    g.ends = ctx->saved_data["group_ends"].toTensor();
    if (!g.grouped) g.host = ctx->saved_data["host_counts"].toIntVector();

    const at::Tensor dy = grads[0].to(x.scalar_type()).contiguous();
    const at::Tensor dh = moe_expert_rows_times(dy, down_proj, g);  // dY W_down: [R, F]
    // H (for dW_down) is not saved: the SiTU-GLU backward recomputes it in its own pass.
    const bool want_down = ctx->needs_input_grad(3);
    const SituGluBackwardWithH d = situ_glu_backward_with_h(gate, up, dh, beta1, beta2, want_down);
    variable_list out(13);
    const bool fused = ctx->saved_data["fused"].toBool();
    if (ctx->needs_input_grad(0) && fused) {
      // dX = dG W_gate + dU W_up in one kernel: one fp32 sum over 2F, rounded once.
      out[0] = moe_experts_dx(d.d_gate, d.d_up, gate_proj, up_proj, g.ends.to(at::kInt));
    } else if (ctx->needs_input_grad(0)) {
      // dX = dG W_gate + dU W_up, the second product added into the first (no third [R, L]).
      out[0] = moe_expert_rows_times(d.d_gate, gate_proj, g);
      out[0].add_(moe_expert_rows_times(d.d_up, up_proj, g));
    }
    const bool want_gate_up = ctx->needs_input_grad(1) || ctx->needs_input_grad(2);
    // Weights of another dtype than the products' (fp32 weights run on bf16 copies) get their
    // gradients in their own: from the kernel's fp32 sums where its wgmma form writes them, else
    // the bf16 gradients cast.
    auto in_weight_dtype = [&](at::Tensor& t) {
      if (t.defined() && t.scalar_type() != weight_dtype) t = t.to(weight_dtype);
    };
    if (fused && (want_gate_up || want_down)) {
      // One kernel for all three, empty experts zeroed in the same pass.
      const bool fp32_sums = weight_dtype == at::kFloat &&
                             moe_experts_weight_grads_wgmma_supported(x.size(1), gate.size(1), gate_proj.size(0));
      MoeExpertWeightGrads w =
          moe_experts_weight_grads(x, d.d_gate, d.d_up, dy, d.h, g.ends.to(at::kInt), want_gate_up, want_down,
                                   MoeExpertsKernel::kAuto, fp32_sums ? at::kFloat : x.scalar_type());
      out[1] = std::move(w.d_gate_proj), out[2] = std::move(w.d_up_proj), out[3] = std::move(w.d_down_proj);
    } else {
      if (ctx->needs_input_grad(1)) out[1] = moe_expert_weight_grad(d.d_gate, x, g);
      if (ctx->needs_input_grad(2)) out[2] = moe_expert_weight_grad(d.d_up, x, g);
      if (want_down) out[3] = moe_expert_weight_grad(dy, d.h, g);
    }
    for (int i = 1; i <= 3; ++i) in_weight_dtype(out[i]);
    return out;
  }
};

}  // namespace

bool moe_grouped_mm_compiled() { return ODYSSEY_HAVE_GROUPED_MM != 0; }

namespace {

#if ODYSSEY_HAVE_GROUPED_MM
// a b as fp32 from bf16 operands (fp32 accumulation, no rounding of the result to bf16).
at::Tensor mm_fp32(const at::Tensor& a, const at::Tensor& b) { return at::mm(a, b, at::kFloat); }

// t (CUDA fp32) as a sum of `parts` bf16 tensors, each carrying the next 8 significant bits of what
// the ones before left (3 parts: all 24 bits of an fp32 mantissa), in one pass (moe_split_bf16). A
// bf16 t is one part, itself.
std::vector<at::Tensor> split_bf16(const at::Tensor& t, int parts) {
  if (t.scalar_type() == at::kBFloat16) return {t};
  return moe_split_bf16(t.to(at::kFloat), parts);
}

// Σ a_i b_j over the pairs with i + j < terms: the products of the leading parts, fp32 results.
// Each product after the first accumulates in the GEMM's epilogue (addmm with an fp32 out dtype:
// C = A B + C), not in a separate add over [m, n] fp32.
at::Tensor split_mm(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, size_t terms) {
  at::Tensor sum;
  for (size_t i = 0; i < a.size(); ++i) {
    for (size_t j = 0; j < b.size() && i + j < terms; ++j) {
      sum = sum.defined() ? at::addmm(sum, a[i], b[j], at::kFloat) : mm_fp32(a[i], b[j]);
    }
  }
  return sum;
}

class RouterLogitsFunction : public torch::autograd::Function<RouterLogitsFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& tokens,
                            const at::Tensor& weight) {
    ctx->save_for_backward({tokens, weight});
    std::vector<at::Tensor> w = split_bf16(weight, 3);
    if (w.size() == 3) {
      // x W_0^T + x W_1^T + x W_2^T as one GEMM along K = 3 d: [x | x | x] times the parts side
      // by side, one fp32 result written once (three GEMMs wrote it three times and read it twice).
      return mm_fp32(at::cat({tokens, tokens, tokens}, /*dim=*/1), at::cat(w, /*dim=*/1).t());
    }
    for (at::Tensor& part : w) part = part.t();
    return split_mm({tokens}, w, 3);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& tokens = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor g = grads[0].to(at::kFloat).contiguous();
    at::Tensor d_tokens, d_weight;
    if (ctx->needs_input_grad(0)) {  // bf16 result: the leading 16 bits of g and W are plenty
      d_tokens = split_mm(split_bf16(g, 2), split_bf16(weight, 2), 2).to(tokens.scalar_type());
    }
    if (ctx->needs_input_grad(1)) {  // the weight's own precision: 3 parts of g for an fp32 W
      std::vector<at::Tensor> gt = split_bf16(g, weight.scalar_type() == at::kBFloat16 ? 2 : 3);
      for (at::Tensor& part : gt) part = part.t();
      d_weight = split_mm(gt, {tokens}, 3).to(weight.scalar_type());
    }
    return {d_tokens, d_weight};
  }
};

// p = s[ids] / sum(s[ids]) as the router's differentiable output: the forward is the reference's
// formula (model::mixing_weights) on the scores computed without a tape; the backward is sparse
// (kernels/moe.h): the gradient of each selected logit through p and the sigmoid in one kernel,
// then d x and d W_r from those top_k values a token alone (moe_router_dx, moe_router_dw: fp32
// sums over the selection, not dense GEMMs over [m, n] whose other n - top_k columns are zeros).
// source and offsets: the token permutation of ids (moe_permutation), or empty tensors to make it
// here (a custom Function's inputs must be defined tensors).
class RouterWeightsFunction : public torch::autograd::Function<RouterWeightsFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& tokens,
                            const at::Tensor& weight, const at::Tensor& scores, const at::Tensor& ids,
                            const at::Tensor& source, const at::Tensor& offsets) {
    ctx->save_for_backward({tokens, weight, scores, ids, source, offsets});
    const at::Tensor chosen = scores.gather(/*dim=*/1, ids);
    return chosen / chosen.sum(/*dim=*/{-1}, /*keepdim=*/true);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& tokens = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& ids = saved[3];
    const at::Tensor d_logits = moe_router_logit_gradient(saved[2], ids, grads[0]);
    at::Tensor d_tokens, d_weight;
    if (ctx->needs_input_grad(0)) d_tokens = moe_router_dx(d_logits, ids, weight);
    if (ctx->needs_input_grad(1)) {
      MoePermutation permutation;
      if (saved[5].numel() == weight.size(0) + 1) {
        permutation.source = saved[4];
        permutation.offsets = saved[5];
        permutation.tokens = ids.size(0);
        permutation.top_k = ids.size(1);
      } else {
        permutation = moe_permutation(ids, weight.size(0));
      }
      d_weight = moe_router_dw(d_logits, tokens, permutation, weight.scalar_type());
    }
    return {d_tokens, d_weight, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
#endif

}  // namespace

bool router_logits_applies(const at::Tensor& tokens, const at::Tensor& weight) {
#if ODYSSEY_HAVE_GROUPED_MM
  return tokens.is_cuda() && weight.is_cuda() && tokens.dim() == 2 && weight.dim() == 2 &&
         tokens.scalar_type() == at::kBFloat16 &&
         (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat) &&
         tokens.size(1) == weight.size(1);
#else
  (void)tokens;
  (void)weight;
  return false;
#endif
}

bool router_weights_applies(const at::Tensor& tokens, const at::Tensor& weight, int64_t top_k) {
  return router_logits_applies(tokens, weight) && moe_router_backward_applies(tokens, weight, top_k);
}

at::Tensor router_weights_autograd(const at::Tensor& tokens, const at::Tensor& weight, const at::Tensor& scores,
                                  const at::Tensor& ids, const MoePermutation* permutation) {
  const int64_t top_k = ids.dim() == 2 ? ids.size(1) : 0;
  TORCH_CHECK(router_weights_applies(tokens, weight, top_k), "router_weights_autograd: needs CUDA bf16 tokens ",
              "[m, d] with d a multiple of 32, an fp32 or bf16 weight [E <= ", kMoeRouterMaxExperts, ", d], top_k <= ",
              kMoeTopkMaxK, " and LibTorch >= 2.8; got ", tokens.sizes(), " ", tokens.scalar_type(), ", ",
              weight.sizes(), " ", weight.scalar_type(), " and ids ", ids.sizes());
#if ODYSSEY_HAVE_GROUPED_MM
  at::Tensor source = at::empty({0}, ids.options()), offsets = source;
  if (permutation != nullptr) {
    TORCH_CHECK(permutation->tokens == ids.size(0) && permutation->top_k == top_k,
                "router_weights_autograd: the permutation is of ", permutation->tokens, " tokens x ",
                permutation->top_k, " slots, ids are ", ids.sizes());
    source = permutation->source;
    offsets = permutation->offsets;
  }
  return RouterWeightsFunction::apply(tokens, weight, scores.detach(), ids, source, offsets);
#else
  (void)scores;
  (void)permutation;
  return {};
#endif
}

at::Tensor router_logits_autograd(const at::Tensor& tokens, const at::Tensor& weight) {
  TORCH_CHECK(router_logits_applies(tokens, weight), "router_logits_autograd: needs CUDA bf16 tokens [m, d] and ",
              "an fp32 or bf16 weight [E, d] and LibTorch >= 2.8; got ", tokens.sizes(), " ", tokens.scalar_type(), " and ",
              weight.sizes(), " ", weight.scalar_type());
#if ODYSSEY_HAVE_GROUPED_MM
  return RouterLogitsFunction::apply(tokens, weight);
#else
  return {};
#endif
}

bool moe_experts_fused_applies(const at::Tensor& rows, const at::Tensor& gate_proj,
                               const at::Tensor& up_proj, const at::Tensor& down_proj) {
  for (const at::Tensor* t : {&rows, &gate_proj, &up_proj, &down_proj}) {
    if (!t->defined() || !t->is_cuda() || t->device() != rows.device() ||
        t->scalar_type() != at::kBFloat16) {
      return false;
    }
  }
  if (rows.dim() != 2 || gate_proj.dim() != 3 || up_proj.sizes() != gate_proj.sizes() ||
      down_proj.dim() != 3 || rows.size(1) != gate_proj.size(2) ||
      rows.size(0) >= (int64_t{1} << 31)) {
    return false;
  }
  const c10::cuda::CUDAGuard guard(rows.device());
  return moe_experts_fused_supported(gate_proj.size(2), gate_proj.size(1), gate_proj.size(0));
}

MoeExpertsFused moe_experts_fused_forward(const at::Tensor& rows, const at::Tensor& gate_proj,
                                          const at::Tensor& up_proj, const at::Tensor& down_proj,
                                          const MoePermutation& permutation, double beta1,
                                          double beta2, bool want_gate_up, MoeExpertsKernel kernel) {
  constexpr const char* where = "kernels::moe_experts_fused_forward";
  TORCH_CHECK(moe_experts_fused_applies(rows, gate_proj, up_proj, down_proj), where,
              ": needs CUDA bf16 rows [R, L] and weights [E, F, L], [E, F, L], [E, L, F] on sm_80 or "
              "newer with L in {128, 256, 384, 512}, F a multiple of 64, L + F <= 640 and at most "
              "1024 experts; got rows ",
              rows.sizes(), " ", rows.scalar_type(), ", gate_proj ", gate_proj.sizes(), " ",
              gate_proj.scalar_type());
  const int64_t experts = gate_proj.size(0), ffn = gate_proj.size(1), latent = gate_proj.size(2);
  TORCH_CHECK(down_proj.size(0) == experts && down_proj.size(1) == latent && down_proj.size(2) == ffn,
              where, ": down_proj must be [", experts, ", ", latent, ", ", ffn, "], got ",
              down_proj.sizes());
  TORCH_CHECK(permutation.group_ends.defined() && permutation.group_ends.numel() == experts &&
                  permutation.tokens * permutation.top_k == rows.size(0),
              where, ": the permutation (", permutation.tokens, " tokens x ", permutation.top_k,
              ") does not describe ", rows.size(0), " rows of ", experts, " experts");
  TORCH_CHECK(beta1 > 0 && beta2 > 0, where, ": caps must be positive, got ", beta1, " and ", beta2);
  const c10::cuda::CUDAGuard guard(rows.device());
  TORCH_CHECK(kernel != MoeExpertsKernel::kWgmma || moe_experts_forward_wgmma_supported(latent, ffn, experts),
              where, ": the wgmma kernel does not apply to L = ", latent, ", F = ", ffn, ", ", experts,
              " experts on this device (it needs an sm_90 GPU and L + F <= 576; MoeExpertsKernel::kMmaSync "
              "runs elsewhere)");
  const at::Tensor x = rows.contiguous(), wg = gate_proj.contiguous(), wu = up_proj.contiguous(),
                   wd = down_proj.contiguous();
  const at::Tensor ends = permutation.group_ends.to(at::kInt).contiguous();
  MoeExpertsFused out;
  out.y = at::empty({x.size(0), latent}, x.options());
  if (want_gate_up) {
    out.gate = at::empty({x.size(0), ffn}, x.options());
    out.up = at::empty({x.size(0), ffn}, x.options());
  }
  const cudaError_t error = moe_experts_forward(
      x.data_ptr(), wg.data_ptr(), wu.data_ptr(), wd.data_ptr(), ends.data_ptr<int32_t>(),
      out.y.data_ptr(), want_gate_up ? out.gate.data_ptr() : nullptr,
      want_gate_up ? out.up.data_ptr() : nullptr, x.size(0), experts, latent, ffn,
      static_cast<float>(beta1), static_cast<float>(beta2),
      at::cuda::getCurrentCUDAStream(x.device().index()).stream(), kernel);
  check_launch(error, where);
  return out;
}

bool moe_experts_dx_applies(const at::Tensor& d_gate, const at::Tensor& gate_proj) {
  if (!d_gate.defined() || !gate_proj.defined() || !d_gate.is_cuda() ||
      gate_proj.device() != d_gate.device() || d_gate.scalar_type() != at::kBFloat16 ||
      gate_proj.scalar_type() != at::kBFloat16 || d_gate.dim() != 2 || gate_proj.dim() != 3 ||
      d_gate.size(1) != gate_proj.size(1) || d_gate.size(0) >= (int64_t{1} << 31)) {
    return false;
  }
  const c10::cuda::CUDAGuard guard(d_gate.device());
  return moe_experts_dx_supported(gate_proj.size(2), gate_proj.size(1), gate_proj.size(0));
}

at::Tensor moe_experts_dx(const at::Tensor& d_gate, const at::Tensor& d_up,
                          const at::Tensor& gate_proj, const at::Tensor& up_proj,
                          const at::Tensor& group_ends, MoeExpertsKernel kernel) {
  constexpr const char* where = "kernels::moe_experts_dx";
  TORCH_CHECK(gate_proj.defined() && gate_proj.dim() == 3 && up_proj.defined() &&
                  up_proj.sizes() == gate_proj.sizes() && d_gate.defined() && d_gate.dim() == 2 &&
                  d_up.defined() && d_up.sizes() == d_gate.sizes() && group_ends.defined() &&
                  group_ends.dim() == 1 && group_ends.size(0) == gate_proj.size(0),
              where, ": needs d_gate, d_up [R, F], gate_proj, up_proj [E, F, L] and group_ends [E]; got ",
              d_gate.defined() ? c10::str(d_gate.sizes()) : "none", ", ",
              d_up.defined() ? c10::str(d_up.sizes()) : "none", ", ",
              gate_proj.defined() ? c10::str(gate_proj.sizes()) : "none", ", ",
              up_proj.defined() ? c10::str(up_proj.sizes()) : "none", ", ",
              group_ends.defined() ? c10::str(group_ends.sizes()) : "none");
  const int64_t experts = gate_proj.size(0), ffn = gate_proj.size(1), latent = gate_proj.size(2);
  const int64_t total = d_gate.size(0);
  TORCH_CHECK(d_gate.size(1) == ffn, where, ": d_gate is [", total, ", ", d_gate.size(1),
              "] but gate_proj's F is ", ffn);
  const at::Device device = d_gate.device();
  for (const auto& [name, t] : {std::make_pair("d_gate", &d_gate), std::make_pair("d_up", &d_up),
                                std::make_pair("gate_proj", &gate_proj), std::make_pair("up_proj", &up_proj)}) {
    TORCH_CHECK(t->is_cuda() && t->device() == device && t->scalar_type() == at::kBFloat16, where, ": ",
                name, " must be bf16 on ", device, ", got ", t->scalar_type(), " on ", t->device());
  }
  TORCH_CHECK(group_ends.device() == device && group_ends.scalar_type() == at::kInt, where,
              ": group_ends must be int32 on ", device, ", got ", group_ends.scalar_type(), " on ",
              group_ends.device());
  const c10::cuda::CUDAGuard guard(device);
  TORCH_CHECK(moe_experts_dx_supported(latent, ffn, experts), where,
              ": needs sm_80 or newer, L a multiple of 128, F a multiple of 64 and 1 to 1024 experts; "
              "got L = ", latent, ", F = ", ffn, ", ", experts, " experts");
  TORCH_CHECK(kernel != MoeExpertsKernel::kWgmma || moe_experts_dx_wgmma_supported(latent, ffn, experts), where,
              ": the wgmma kernel does not apply to L = ", latent, ", F = ", ffn, ", ", experts,
              " experts on this device (it needs an sm_90 GPU; MoeExpertsKernel::kMmaSync runs elsewhere)");
  const at::Tensor dg = d_gate.contiguous(), du = d_up.contiguous(), wg = gate_proj.contiguous(),
                   wu = up_proj.contiguous(), ends = group_ends.contiguous();
  at::Tensor dx = at::empty({total, latent}, dg.options());
  const cudaError_t error = moe_experts_dx(dg.data_ptr(), du.data_ptr(), wg.data_ptr(), wu.data_ptr(),
                                           ends.data_ptr<int32_t>(), dx.data_ptr(), total, experts, latent,
                                           ffn, at::cuda::getCurrentCUDAStream(device.index()).stream(), kernel);
  check_launch(error, where);
  return dx;
}

bool moe_experts_weight_grads_applies(const at::Tensor& rows, const at::Tensor& gate_proj) {
  if (!rows.defined() || !gate_proj.defined() || !rows.is_cuda() ||
      gate_proj.device() != rows.device() || rows.scalar_type() != at::kBFloat16 ||
      gate_proj.scalar_type() != at::kBFloat16 || rows.dim() != 2 || gate_proj.dim() != 3 ||
      rows.size(1) != gate_proj.size(2) || rows.size(0) >= (int64_t{1} << 31)) {
    return false;
  }
  const c10::cuda::CUDAGuard guard(rows.device());
  return moe_experts_weight_grads_supported(gate_proj.size(2), gate_proj.size(1), gate_proj.size(0));
}

MoeExpertWeightGrads moe_experts_weight_grads(const at::Tensor& rows, const at::Tensor& d_gate,
                                              const at::Tensor& d_up, const at::Tensor& dy,
                                              const at::Tensor& h, const at::Tensor& group_ends,
                                              bool want_gate_up, bool want_down, MoeExpertsKernel kernel,
                                              at::ScalarType out_dtype) {
  constexpr const char* where = "kernels::moe_experts_weight_grads";
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kFloat, where,
              ": out_dtype must be bf16 or fp32, got ", out_dtype);
  if (!want_gate_up && !want_down) return {};
  // The widths come from the operands of the parts wanted: rows and d_gate, else dy and h.
  const at::Tensor& wide = want_gate_up ? rows : dy;
  const at::Tensor& narrow = want_gate_up ? d_gate : h;
  TORCH_CHECK(wide.defined() && wide.dim() == 2 && narrow.defined() && narrow.dim() == 2 &&
                  group_ends.defined() && group_ends.dim() == 1,
              where, ": ", want_gate_up ? "rows" : "dy", " must be [R, L], ",
              want_gate_up ? "d_gate" : "h", " [R, F], group_ends [E]");
  const int64_t total = wide.size(0), latent = wide.size(1), ffn = narrow.size(1);
  const int64_t experts = group_ends.size(0);
  const at::Device device = wide.device();
  struct Input {
    const char* name;
    const at::Tensor* tensor;
    int64_t width;
    bool needed;
  };
  for (const Input& in : {Input{"rows", &rows, latent, want_gate_up}, Input{"d_gate", &d_gate, ffn, want_gate_up},
                          Input{"d_up", &d_up, ffn, want_gate_up}, Input{"dy", &dy, latent, want_down},
                          Input{"h", &h, ffn, want_down}}) {
    const at::Tensor& t = *in.tensor;
    if (!in.needed) continue;
    TORCH_CHECK(t.defined() && t.is_cuda() && t.device() == device &&
                    t.scalar_type() == at::kBFloat16 && t.dim() == 2 && t.size(0) == total &&
                    t.size(1) == in.width,
                where, ": ", in.name, " must be a bf16 [", total, ", ", in.width, "] tensor on ",
                device, "; got ",
                t.defined() ? c10::str(t.sizes(), " ", t.scalar_type(), " on ", t.device())
                            : std::string("none"));
  }
  TORCH_CHECK(group_ends.device() == device && group_ends.scalar_type() == at::kInt, where,
              ": group_ends must be int32 on ", device, ", got ", group_ends.scalar_type(),
              " on ", group_ends.device());
  const c10::cuda::CUDAGuard guard(device);
  TORCH_CHECK(moe_experts_weight_grads_supported(latent, ffn, experts), where,
              ": needs sm_80 or newer, L a multiple of 128, F a multiple of 64 and 1 to 1024 experts; "
              "got L = ", latent, ", F = ", ffn, ", ", experts, " experts");
  TORCH_CHECK(kernel != MoeExpertsKernel::kWgmma || moe_experts_weight_grads_wgmma_supported(latent, ffn, experts),
              where, ": the wgmma kernel does not apply to L = ", latent, ", F = ", ffn, ", ", experts,
              " experts on this device (it needs an sm_90 GPU; MoeExpertsKernel::kMmaSync runs elsewhere)");
  const bool fp32_outputs = out_dtype == at::kFloat;
  TORCH_CHECK(!fp32_outputs || (kernel != MoeExpertsKernel::kMmaSync &&
                                moe_experts_weight_grads_wgmma_supported(latent, ffn, experts)),
              where, ": fp32 outputs are the wgmma kernel's alone (an sm_90 GPU); ask for bf16 elsewhere");
  auto dense = [](const at::Tensor& t) { return t.defined() ? t.contiguous() : t; };
  const at::Tensor x = dense(rows), dg = dense(d_gate), du = dense(d_up), dyc = dense(dy),
                   hc = dense(h), ends = group_ends.contiguous();
  const at::TensorOptions options = wide.options().dtype(out_dtype);
  MoeExpertWeightGrads out;
  if (want_gate_up) {
    out.d_gate_proj = at::empty({experts, ffn, latent}, options);
    out.d_up_proj = at::empty({experts, ffn, latent}, options);
  }
  if (want_down) out.d_down_proj = at::empty({experts, latent, ffn}, options);
  auto pointer = [](const at::Tensor& t, bool wanted) { return wanted ? t.data_ptr() : nullptr; };
  const cudaError_t error = moe_experts_weight_grads(
      pointer(x, want_gate_up), pointer(dg, want_gate_up), pointer(du, want_gate_up),
      pointer(dyc, want_down), pointer(hc, want_down), ends.data_ptr<int32_t>(),
      pointer(out.d_gate_proj, want_gate_up), pointer(out.d_up_proj, want_gate_up),
      pointer(out.d_down_proj, want_down), total, experts, latent, ffn,
      at::cuda::getCurrentCUDAStream(device.index()).stream(), kernel, fp32_outputs);
  check_launch(error, where);
  return out;
}

bool moe_grouped_mm_applies(const at::Tensor& rows, const at::Tensor& gate_proj,
                            const at::Tensor& up_proj, const at::Tensor& down_proj) {
#if ODYSSEY_HAVE_GROUPED_MM
  for (const at::Tensor* t : {&rows, &gate_proj, &up_proj, &down_proj}) {
    if (!t->defined() || !t->is_cuda() || t->device() != rows.device() ||
        t->scalar_type() != at::kBFloat16) {
      return false;
    }
  }
  if (rows.dim() != 2 || gate_proj.dim() != 3 || rows.size(0) == 0 ||
      rows.size(0) >= (int64_t{1} << 31)) {
    return false;
  }
  const int64_t latent = rows.size(1), ffn = gate_proj.size(1);
  if (latent % 16 != 0 || ffn % 16 != 0) return false;
  // LibTorch's CUTLASS grouped GEMM prepares its per-group arguments with one thread per group
  // and refuses 1024 groups or more.
  if (gate_proj.size(0) >= 1024) return false;
  const int major = at::cuda::getDeviceProperties(rows.device().index())->major;
  return major == 9 || major == 10;
#else
  (void)rows;
  (void)gate_proj;
  (void)up_proj;
  (void)down_proj;
  return false;
#endif
}

MoeExpertGroups moe_expert_groups(const at::Tensor& counts, const at::Tensor& ends, bool grouped, bool cublas) {
  TORCH_CHECK(counts.defined() && counts.dim() == 1 && counts.scalar_type() == at::kLong,
              "kernels::moe_expert_groups: counts must be int64 [experts]");
  TORCH_CHECK(!grouped || (ends.defined() && ends.dim() == 1 && ends.size(0) == counts.size(0) &&
                           ends.scalar_type() == at::kInt && ends.device() == counts.device()),
              "kernels::moe_expert_groups: the grouped GEMMs need int32 group ends [", counts.size(0),
              "] on the counts' device");
  MoeExpertGroups g;
  g.grouped = grouped;
  g.cublas = !grouped && cublas;
  g.counts = counts;
  g.ends = ends;
  if (!grouped) {
    const at::Tensor host = counts.to(at::kCPU, at::kLong).contiguous();
    g.host.assign(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
  }
  return g;
}

at::Tensor moe_expert_rows_times(const at::Tensor& x, const at::Tensor& w,
                                 const MoeExpertGroups& g) {
#if ODYSSEY_HAVE_GROUPED_MM
  if (g.grouped) return at::_grouped_mm(x, w, g.ends);
#endif
  TORCH_CHECK(!g.grouped, "kernels::moe_expert_rows_times: at::_grouped_mm is not compiled in");
  if (g.cublas) return grouped_rows_times(x, w, g.host);
  at::Tensor out = at::empty({x.size(0), w.size(2)}, x.options());
  int64_t start = 0;
  for (size_t e = 0; e < g.host.size(); ++e) {
    const int64_t count = g.host[e];
    if (count == 0) continue;
    at::Tensor slice = out.narrow(0, start, count);
    at::mm_out(slice, x.narrow(0, start, count), w.select(0, static_cast<int64_t>(e)));
    start += count;
  }
  return out;
}

at::Tensor moe_expert_weight_grad(const at::Tensor& a, const at::Tensor& b,
                                  const MoeExpertGroups& g) {
  const int64_t experts = g.counts.size(0);
#if ODYSSEY_HAVE_GROUPED_MM
  if (g.grouped) {
    at::Tensor out = at::_grouped_mm(a.t(), b, g.ends).contiguous();
    moe_zero_empty_groups(out, g.counts);
    return out;
  }
#endif
  TORCH_CHECK(!g.grouped, "kernels::moe_expert_weight_grad: at::_grouped_mm is not compiled in");
  if (g.cublas) return grouped_weight_grad(a, b, g.host);
  at::Tensor out = at::zeros({experts, a.size(1), b.size(1)}, a.options());
  int64_t start = 0;
  for (size_t e = 0; e < g.host.size(); ++e) {
    const int64_t count = g.host[e];
    if (count == 0) continue;
    at::Tensor slice = out.select(0, static_cast<int64_t>(e));
    at::mm_out(slice, a.narrow(0, start, count).t(), b.narrow(0, start, count));
    start += count;
  }
  return out;
}

SituGluBackwardWithH situ_glu_backward_with_h(const at::Tensor& gate, const at::Tensor& up,
                                              const at::Tensor& dh, double beta1, double beta2,
                                              bool want_h) {
  constexpr const char* where = "kernels::situ_glu_backward_with_h";
  TORCH_CHECK(situ_glu_supported(gate, up), where,
              ": gate and up must be CUDA tensors of one shape and one dtype of bf16 / fp32");
  TORCH_CHECK(dh.defined() && dh.sizes() == gate.sizes() && dh.device() == gate.device(), where,
              ": dh must match gate ", gate.sizes(), " on ", gate.device());
  TORCH_CHECK(beta1 > 0 && beta2 > 0, where, ": caps must be positive, got ", beta1, " and ", beta2);
  const c10::cuda::CUDAGuard guard(gate.device());
  const at::Tensor g = gate.contiguous(), u = up.contiguous();
  const at::Tensor d = dh.to(g.scalar_type()).contiguous();
  SituGluBackwardWithH out;
  out.d_gate = at::empty(g.sizes(), g.options());
  out.d_up = at::empty(g.sizes(), g.options());
  if (want_h) out.h = at::empty(g.sizes(), g.options());
  const MoeDtype dtype = g.scalar_type() == at::kBFloat16 ? MoeDtype::kBFloat16 : MoeDtype::kFloat32;
  const cudaError_t error = situ_glu_backward_with_h(
      dtype, g.data_ptr(), u.data_ptr(), d.data_ptr(), out.d_gate.data_ptr(), out.d_up.data_ptr(),
      want_h ? out.h.data_ptr() : nullptr, g.numel(), static_cast<float>(beta1),
      static_cast<float>(beta2), at::cuda::getCurrentCUDAStream(g.device().index()).stream());
  check_launch(error, where);
  return out;
}

at::Tensor moe_permute_autograd(const at::Tensor& tokens, const MoePermutation& permutation) {
  return MoePermuteFunction::apply(tokens, permutation)[0];
}

at::Tensor moe_unpermute_autograd(const at::Tensor& copies, const MoePermutation& permutation,
                                  const at::Tensor& weights) {
  TORCH_CHECK(weights.defined() && weights.scalar_type() == at::kFloat,
              "kernels::moe_unpermute_autograd: weights must be fp32 [m, k], got ",
              weights.defined() ? c10::str(weights.scalar_type()) : std::string("undefined"));
  return MoeUnpermuteFunction::apply(copies, weights, permutation)[0];
}

at::Tensor situ_glu_autograd(const at::Tensor& gate, const at::Tensor& up, double beta1,
                             double beta2) {
  return SituGluFunction::apply(gate, up, beta1, beta2)[0];
}

namespace {

// Which products MoeExpertsFunction runs (its last three arguments), the arguments checked: rows
// and the weights the products read.
struct ExpertProducts {
  bool grouped, fused, cublas;
};
ExpertProducts expert_products(const at::Tensor& rows, const at::Tensor& gate_proj, const at::Tensor& up_proj,
                               const at::Tensor& down_proj, const MoePermutation& permutation, MoeGemm gemm) {
  constexpr const char* where = "kernels::moe_experts_autograd";
  TORCH_CHECK(rows.dim() == 2 && gate_proj.dim() == 3 && up_proj.sizes() == gate_proj.sizes() &&
                  down_proj.dim() == 3,
              where, ": rows must be [R, L], gate_proj / up_proj [E, F, L], down_proj [E, L, F]; got ",
              rows.sizes(), ", ", gate_proj.sizes(), ", ", up_proj.sizes(), ", ", down_proj.sizes());
  const int64_t experts = gate_proj.size(0), ffn = gate_proj.size(1), latent = gate_proj.size(2);
  TORCH_CHECK(rows.size(1) == latent && down_proj.size(0) == experts && down_proj.size(1) == latent &&
                  down_proj.size(2) == ffn,
              where, ": shapes disagree: rows ", rows.sizes(), ", gate_proj ", gate_proj.sizes(),
              ", down_proj ", down_proj.sizes());
  TORCH_CHECK(permutation.tokens_per_expert.defined() &&
                  permutation.tokens_per_expert.size(0) == experts &&
                  permutation.tokens * permutation.top_k == rows.size(0),
              where, ": the permutation (", permutation.tokens, " tokens x ", permutation.top_k,
              ") does not describe ", rows.size(0), " rows of ", experts, " experts");
  TORCH_CHECK(rows.scalar_type() == gate_proj.scalar_type() &&
                  up_proj.scalar_type() == gate_proj.scalar_type() &&
                  down_proj.scalar_type() == gate_proj.scalar_type() &&
                  (rows.scalar_type() == at::kBFloat16 || rows.scalar_type() == at::kFloat),
              where, ": rows and weights must be one dtype of bf16 / fp32, got ", rows.scalar_type(),
              ", ", gate_proj.scalar_type(), ", ", up_proj.scalar_type(), ", ", down_proj.scalar_type());
  const bool applies = moe_grouped_mm_applies(rows, gate_proj, up_proj, down_proj);
  TORCH_CHECK(gemm != MoeGemm::kGrouped || applies, where,
              ": at::_grouped_mm does not apply here (needs LibTorch >= 2.8, bf16, sm90 / sm100, "
              "widths that are multiples of 16, fewer than 1024 experts; compiled in: ", moe_grouped_mm_compiled(), ")");
  const bool fused_applies = moe_experts_fused_applies(rows, gate_proj, up_proj, down_proj);
  TORCH_CHECK(gemm != MoeGemm::kFused || fused_applies, where,
              ": the fused experts do not apply here (need CUDA bf16 rows and weights on sm_80 or "
              "newer, L in {128, 256, 384, 512}, F a multiple of 64, L + F <= 640, at most 1024 "
              "experts; got L = ", latent, ", F = ",
              ffn, ", ", experts, " experts, ", rows.scalar_type(), ")");
  const bool cublas_applies = cublas_grouped_gemm_applies(rows, gate_proj) &&
                              cublas_grouped_gemm_applies(rows, up_proj) &&
                              cublas_grouped_gemm_applies(rows, down_proj);
  TORCH_CHECK(gemm != MoeGemm::kCublas || cublas_applies, where,
              ": cuBLAS's grouped GEMM does not apply here (needs CUDA bf16 / fp32 rows and weights and "
              "cuBLAS >= 12.5; compiled in: ", cublas_grouped_gemm_compiled(), ")");
  const bool fused = gemm == MoeGemm::kFused || (gemm == MoeGemm::kAuto && fused_applies);
  const bool grouped = gemm == MoeGemm::kGrouped || ((gemm == MoeGemm::kAuto || fused) && applies);
  const bool cublas = !grouped && (gemm == MoeGemm::kCublas || ((gemm == MoeGemm::kAuto || fused) && cublas_applies));
  return {grouped, fused, cublas};
}

}  // namespace

at::Tensor moe_experts_autograd(const at::Tensor& rows, const at::Tensor& gate_proj,
                                const at::Tensor& up_proj, const at::Tensor& down_proj,
                                const MoePermutation& permutation, double beta1, double beta2,
                                MoeGemm gemm, const MoeExpertWeightCopies& copies) {
  constexpr const char* where = "kernels::moe_experts_autograd";
  const bool with_copies = copies.gate_proj.defined() || copies.up_proj.defined() || copies.down_proj.defined();
  if (with_copies) {
    struct Pair {
      const char* name;
      const at::Tensor* weight;
      const at::Tensor* copy;
    };
    for (const Pair& p : {Pair{"gate_proj", &gate_proj, &copies.gate_proj}, Pair{"up_proj", &up_proj, &copies.up_proj},
                          Pair{"down_proj", &down_proj, &copies.down_proj}}) {
      const at::Tensor &weight = *p.weight, &copy = *p.copy;
      TORCH_CHECK(weight.defined() && weight.scalar_type() == at::kFloat && copy.defined() &&
                      copy.scalar_type() == at::kBFloat16 && copy.sizes() == weight.sizes() &&
                      copy.device() == weight.device() && !copy.requires_grad(),
                  where, ": copies.", p.name, " must be a bf16 copy of the fp32 ", p.name,
                  " on its device, not recorded for autograd; got the weight ",
                  weight.defined() ? c10::str(weight.sizes(), " ", weight.scalar_type()) : std::string("none"),
                  " and the copy ",
                  copy.defined() ? c10::str(copy.sizes(), " ", copy.scalar_type(), " on ", copy.device(),
                                            copy.requires_grad() ? ", requiring grad" : "")
                                 : std::string("none"));
    }
    TORCH_CHECK(rows.scalar_type() == at::kBFloat16, where,
                ": with bf16 copies of the weights the rows must be bf16 too, got ", rows.scalar_type());
  }
  const ExpertProducts products =
      with_copies ? expert_products(rows, copies.gate_proj, copies.up_proj, copies.down_proj, permutation, gemm)
                  : expert_products(rows, gate_proj, up_proj, down_proj, permutation, gemm);
  auto optional = [](const at::Tensor& t) { return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt; };
  return MoeExpertsFunction::apply(rows, gate_proj, up_proj, down_proj, optional(copies.gate_proj),
                                   optional(copies.up_proj), optional(copies.down_proj), permutation, beta1, beta2,
                                   products.grouped, products.fused, products.cublas)[0];
}

}  // namespace odyssey::kernels
