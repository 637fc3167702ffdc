#include "model/moe.h"

#include <cmath>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "model/balancing.h"
#include "model/precision.h"

#ifdef ODYSSEY_WITH_CUDA_KERNELS
#include "kernels/moe.h"
#include "kernels/moe_autograd.h"
#include "kernels/torch_bindings.h"
#endif

namespace odyssey::model {
namespace {

// Uniform(±1/√fan_in), LibTorch's Linear default, for a stacked [count, out, in] weight.
torch::Tensor stacked_weight(int64_t count, int64_t out, int64_t in) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  return at::empty({count, out, in}, at::kFloat).uniform_(-bound, bound);
}

at::ScalarType accumulate_dtype(const torch::Tensor& a, const torch::Tensor& b) {
  return a.scalar_type() == at::kDouble || b.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// p = s_sel / Σ s_sel, differentiable in the scores (the selection is not).
torch::Tensor mixing_weights(const torch::Tensor& scores, const torch::Tensor& selected) {
  const torch::Tensor chosen = scores.gather(/*dim=*/1, selected);
  return chosen / chosen.sum(/*dim=*/{-1}, /*keepdim=*/true);
}

void check_input(const torch::Tensor& x, int64_t hidden) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == hidden, "Moe: x must be [..., ", hidden, "], got ", x.sizes());
}

}  // namespace

TokenPermutation permute_tokens(const torch::Tensor& selected, int64_t num_experts) {
  TORCH_CHECK(selected.dim() == 2 && selected.scalar_type() == at::kLong,
              "permute_tokens: selected must be int64 [tokens, k], got ", selected.scalar_type(), selected.sizes());
  const int64_t k = selected.size(1);
  const torch::Tensor flat = selected.reshape({-1});
  TokenPermutation permutation;
  permutation.source = std::get<1>(at::sort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  permutation.token = at::div(permutation.source, k, /*rounding_mode=*/"floor");
  permutation.tokens_per_expert = at::bincount(flat, /*weights=*/{}, /*minlength=*/num_experts);
  TORCH_CHECK(permutation.tokens_per_expert.size(0) == num_experts, "permute_tokens: an expert id is >= ",
              num_experts);
  return permutation;
}

torch::Tensor permute(const torch::Tensor& tokens, const TokenPermutation& permutation) {
  return tokens.index_select(0, permutation.token);
}

torch::Tensor unpermute(const torch::Tensor& copies, const TokenPermutation& permutation,
                        const torch::Tensor& weights) {
  TORCH_CHECK(weights.dim() == 2 && copies.size(0) == weights.numel(), "unpermute: ", copies.size(0),
              " copies for weights ", weights.sizes());
  const at::ScalarType dtype = accumulate_dtype(copies, weights);
  std::vector<int64_t> weight_shape(static_cast<size_t>(copies.dim()), 1);
  weight_shape[0] = copies.size(0);
  const torch::Tensor copy_weight =
      weights.reshape({-1}).index_select(0, permutation.source).to(dtype).reshape(weight_shape);
  std::vector<int64_t> out_shape = copies.sizes().vec();
  out_shape[0] = weights.size(0);
  return at::zeros(out_shape, copies.options().dtype(dtype))
      .index_add(0, permutation.token, copies.to(dtype) * copy_weight);
}

StackedExpertsImpl::StackedExpertsImpl(int64_t count, int64_t width, int64_t ffn, double beta1, double beta2)
    : count_(count), beta1_(beta1), beta2_(beta2) {
  TORCH_CHECK(count > 0 && width > 0 && ffn > 0, "StackedExperts: count (", count, "), width (", width,
              ") and ffn (", ffn, ") must be positive");
  gate_proj = register_parameter("gate_proj", stacked_weight(count, ffn, width));
  up_proj = register_parameter("up_proj", stacked_weight(count, ffn, width));
  down_proj = register_parameter("down_proj", stacked_weight(count, width, ffn));
}

torch::Tensor StackedExpertsImpl::forward(const torch::Tensor& rows, const torch::Tensor& tokens_per_expert) {
  TORCH_CHECK(tokens_per_expert.dim() == 1 && tokens_per_expert.size(0) == count_,
              "StackedExperts: tokens_per_expert must be [", count_, "], got ", tokens_per_expert.sizes());
  const torch::Tensor counts = tokens_per_expert.to(at::kCPU, at::kLong).contiguous();
  const std::vector<int64_t> count_of(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + count_);
  int64_t total = 0;
  for (int64_t c : count_of) total += c;
  TORCH_CHECK(total == rows.size(0), "StackedExperts: tokens_per_expert sums to ", total, ", rows are ",
              rows.size(0));
  // The rows and the weights are split once (split / unbind), not sliced per expert: under
  // autograd each split has one backward that puts every expert's gradient in place, where a
  // narrow() or select() per expert would make each expert's gradient a zero-filled tensor of the
  // whole size and sum them (quadratic in the number of experts).
  const std::vector<torch::Tensor> slices = rows.split_with_sizes(count_of, 0);
  const std::vector<torch::Tensor> gates = gate_proj.unbind(0), ups = up_proj.unbind(0), downs = down_proj.unbind(0);
  std::vector<torch::Tensor> outputs;
  for (size_t e = 0; e < static_cast<size_t>(count_); ++e) {
    if (count_of[e] == 0) continue;
    const torch::Tensor h =
        situ_glu(at::matmul(slices[e], gates[e].t()), at::matmul(slices[e], ups[e].t()), beta1_, beta2_);
    outputs.push_back(at::matmul(h, downs[e].t()));
  }
  if (outputs.empty()) return at::zeros_like(rows);
  return at::cat(outputs, /*dim=*/0);
}

torch::Tensor StackedExpertsImpl::sum_all(const torch::Tensor& x) {
  // Σ_e down_e · h_e(x) is one MLP whose inner width is the experts' widths side by side.
  const int64_t width = gate_proj.size(2);
  const int64_t inner = count_ * gate_proj.size(1);
  const torch::Tensor h = situ_glu(at::matmul(x, gate_proj.reshape({inner, width}).t()),
                                   at::matmul(x, up_proj.reshape({inner, width}).t()), beta1_, beta2_);
  return at::matmul(h, down_proj.permute({1, 0, 2}).reshape({width, inner}).t());
}

RouterImpl::RouterImpl(int64_t hidden, int64_t num_experts) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(hidden));
  weight = register_parameter("weight", at::empty({num_experts, hidden}, at::kFloat).uniform_(-bound, bound));
  bias = register_buffer("bias", at::zeros({num_experts}, at::kFloat));
}

torch::Tensor RouterImpl::forward(const torch::Tensor& tokens) {
#ifdef ODYSSEY_WITH_CUDA_KERNELS
  // bf16 tokens on the GPU: the same fp32 logits from bf16 tensor-core GEMMs (kernels/moe_autograd.h).
  if (kernels::router_logits_applies(tokens, weight)) {
    return at::sigmoid(kernels::router_logits_autograd(tokens, weight));
  }
#endif
  const at::ScalarType compute = tokens.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return at::sigmoid(at::matmul(tokens.to(compute), weight.to(compute).t()));
}

MoeImpl::MoeImpl(const MoeOptions& options) : options_(options) {
  TORCH_CHECK(options.hidden > 0 && options.latent > 0 && options.expert_ffn > 0, "Moe: hidden (", options.hidden,
              "), latent (", options.latent, ") and expert_ffn (", options.expert_ffn, ") must be positive");
  TORCH_CHECK(options.top_k >= 1 && options.top_k <= options.num_experts, "Moe: top_k ", options.top_k,
              " must be in [1, num_experts = ", options.num_experts, "]");
  TORCH_CHECK(options.num_shared >= 0 && (options.num_shared == 0 || options.shared_ffn > 0), "Moe: ",
              options.num_shared, " shared experts need a positive shared_ffn, got ", options.shared_ffn);
  using torch::nn::Linear;
  using torch::nn::LinearOptions;
  // Registration order is the order of model_tensors() (model/config.h).
  router = register_module("router", Router(options.hidden, options.num_experts));
  latent_down = register_module("latent_down", Linear(LinearOptions(options.hidden, options.latent).bias(false)));
  latent_up = register_module("latent_up", Linear(LinearOptions(options.latent, options.hidden).bias(false)));
  latent_norm = register_module("latent_norm", RmsNorm(options.latent, options.eps));
  experts = register_module("experts", StackedExperts(options.num_experts, options.latent, options.expert_ffn,
                                                      options.situ_beta1, options.situ_beta2));
  if (options.num_shared > 0) {
    shared_experts = register_module("shared_experts",
                                     StackedExperts(options.num_shared, options.hidden, options.shared_ffn,
                                                    options.situ_beta1, options.situ_beta2));
  }
}

MoeRouting MoeImpl::route_reference(const torch::Tensor& x) {
  check_input(x, options_.hidden);
  MoeRouting routing;
  routing.scores = router(x.reshape({-1, options_.hidden}));
  routing.selected = select_experts(routing.scores, router->bias, options_.top_k);
  routing.weights = mixing_weights(routing.scores, routing.selected);
  return routing;
}

MoeRouting MoeImpl::route(const torch::Tensor& x) { return route(x, nullptr); }

MoeRouting MoeImpl::route(const torch::Tensor& x, kernels::MoePermutation* permutation) {
#ifdef ODYSSEY_WITH_CUDA_KERNELS
  if (x.defined() && x.is_cuda() && x.scalar_type() != at::kDouble) {
    check_input(x, options_.hidden);
    MoeRouting routing;
    const torch::Tensor tokens = x.reshape({-1, options_.hidden});
    // With a gradient wanted and the router on tensor cores (bf16 tokens), the router learns
    // through p recorded as one Function of tokens and W_r (kernels::router_weights_autograd: p's
    // reference formula forward; backward, the k selected logits' gradients and from them alone,
    // sparse, d x and d W_r), and the scores are computed without a tape (nothing else
    // differentiates them).
    const bool fused = at::GradMode::is_enabled() && (tokens.requires_grad() || router->weight.requires_grad()) &&
                       kernels::router_weights_applies(tokens, router->weight, options_.top_k);
    if (fused) {
      const c10::NoGradGuard no_grad;
      routing.scores = router(tokens);
    } else {
      routing.scores = router(tokens);
    }
    torch::Tensor kernel_weights;  // p from the top-k kernel, where it ran
    if (kernels::moe_router_topk_supported(routing.scores, options_.top_k)) {
      kernels::MoeRouterTopk topk = kernels::moe_router_topk(routing.scores, router->bias, options_.top_k);
      routing.selected = topk.ids;
      kernel_weights = topk.weights;
    } else {
      routing.selected = select_experts(routing.scores, router->bias, options_.top_k);
    }
    // The caller's token permutation, made here so that p's recorded backward (d W_r) shares it.
    if (permutation != nullptr) *permutation = kernels::moe_permutation(routing.selected, options_.num_experts);
    // With a gradient wanted, p is recomputed from the selection with the reference's formula,
    // recorded for autograd (the router learns through p); otherwise the kernel's p.
    if (fused) {
      routing.weights =
          kernels::router_weights_autograd(tokens, router->weight, routing.scores, routing.selected, permutation);
    } else if (kernel_weights.defined() && !(at::GradMode::is_enabled() && routing.scores.requires_grad())) {
      routing.weights = kernel_weights;
    } else {
      routing.weights = mixing_weights(routing.scores, routing.selected);
    }
    return routing;
  }
#endif
  (void)permutation;
  return route_reference(x);
}

bool MoeImpl::uses_kernels(const torch::Tensor& x) const {
#ifdef ODYSSEY_WITH_CUDA_KERNELS
  if (!x.defined() || !x.is_cuda() || x.numel() == 0) return false;
  if (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kFloat) return false;
  for (const torch::Tensor* w : {&experts->gate_proj, &experts->up_proj, &experts->down_proj}) {
    if (w->scalar_type() != x.scalar_type() || w->device() != x.device()) return false;
  }
  return options_.num_experts <= kernels::kMoeTopkMaxExperts && options_.top_k <= kernels::kMoeTopkMaxK;
#else
  (void)x;
  return false;
#endif
}

MoeOutput MoeImpl::forward(const torch::Tensor& x) {
#ifdef ODYSSEY_WITH_CUDA_KERNELS
  if (uses_kernels(x)) {
    check_input(x, options_.hidden);
    MoeOutput out;
    kernels::MoePermutation permutation;
    out.routing = route(x, &permutation);
    const torch::Tensor tokens = x.reshape({-1, options_.hidden});
    const torch::Tensor z = latent_down(tokens).contiguous();
    const torch::Tensor rows = kernels::moe_permute_autograd(z, permutation);
    // fp32 at the medium float32 matmul precision (model/precision.h): the routed experts on bf16
    // copies of the rows and weights (the fused kernels), the rows' cast recorded for autograd and
    // the weights' gradients sent to the fp32 weights in fp32 (kernels::MoeExpertWeightCopies).
    // The weights' copies are kept until the weights change (the optimizer's step): one cast a
    // learner step.
    const bool rounded = x.scalar_type() == at::kFloat && float32_matmul_precision() == Float32MatmulPrecision::kMedium;
    const torch::Tensor* weights[3] = {&experts->gate_proj, &experts->up_proj, &experts->down_proj};
    kernels::MoeExpertWeightCopies copies;
    torch::Tensor* copy[3] = {&copies.gate_proj, &copies.up_proj, &copies.down_proj};
    for (int i = 0; i < 3; ++i) {
      if (rounded) {
        *copy[i] = expert_weights_bf16_[i].value(*weights[i]);
      } else {
        expert_weights_bf16_[i].clear();
      }
    }
    torch::Tensor expert_out = kernels::moe_experts_autograd(
        rounded ? rows.to(at::kBFloat16) : rows, *weights[0], *weights[1], *weights[2], permutation,
        options_.situ_beta1, options_.situ_beta2, kernels::MoeGemm::kAuto, copies);
    if (rounded) expert_out = expert_out.to(at::kFloat);
    const torch::Tensor u = kernels::moe_unpermute_autograd(expert_out, permutation, out.routing.weights);
    torch::Tensor y = latent_up(latent_norm(u).to(x.scalar_type()));
    if (!shared_experts.is_empty()) {
      // StackedExperts::sum_all with the fused SiTU-GLU between its two matmuls.
      const StackedExpertsImpl& shared = *shared_experts;
      const int64_t inner = shared.count() * shared.gate_proj.size(1);
      const torch::Tensor gate =
          at::matmul(tokens, shared.gate_proj.reshape({inner, options_.hidden}).t()).contiguous();
      const torch::Tensor up = at::matmul(tokens, shared.up_proj.reshape({inner, options_.hidden}).t()).contiguous();
      const torch::Tensor h =
          kernels::situ_glu_supported(gate, up)
              ? kernels::situ_glu_autograd(gate, up, options_.situ_beta1, options_.situ_beta2)
              : situ_glu(gate, up, options_.situ_beta1, options_.situ_beta2);
      // y + h W_down^T as one GEMM with the add in its epilogue (one rounding to bf16, no separate pass).
      y = at::addmm(y, h, shared.down_proj.permute({1, 0, 2}).reshape({options_.hidden, inner}).t());
    }
    out.y = y.reshape(x.sizes());
    return out;
  }
#endif
  return forward_reference(x);
}

MoeOutput MoeImpl::forward_reference(const torch::Tensor& x) {
  MoeOutput out;
  out.routing = route_reference(x);
  const torch::Tensor tokens = x.reshape({-1, options_.hidden});
  const torch::Tensor z = latent_down(tokens);
  const TokenPermutation permutation = permute_tokens(out.routing.selected, options_.num_experts);
  const torch::Tensor expert_out = experts(permute(z, permutation), permutation.tokens_per_expert);
  const torch::Tensor u = unpermute(expert_out, permutation, out.routing.weights);
  torch::Tensor y = latent_up(latent_norm(u).to(x.scalar_type()));
  if (!shared_experts.is_empty()) y = y + shared_experts->sum_all(tokens);
  out.y = y.reshape(x.sizes());
  return out;
}

void MoeImpl::set_expert_bias(const torch::Tensor& bias) {
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == options_.num_experts, "Moe: expert bias must be [",
              options_.num_experts, "], got ", bias.sizes());
  c10::NoGradGuard no_grad;
  router->bias.copy_(bias);
}

}  // namespace odyssey::model
