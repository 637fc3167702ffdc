#include "model/balancing.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#ifdef ODYSSEY_WITH_CUDA_KERNELS
#include "kernels/torch_bindings.h"
#endif

namespace odyssey::model {
namespace {

// Balancing arithmetic runs in fp32 (the router's precision), or fp64 for fp64 scores.
at::ScalarType work_dtype(const torch::Tensor& scores) {
  return scores.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

torch::Tensor centred(const torch::Tensor& bias) { return bias - bias.mean(); }

}  // namespace

torch::Tensor select_experts(const torch::Tensor& scores, const torch::Tensor& bias, int64_t top_k) {
  TORCH_CHECK(scores.dim() == 2, "select_experts: scores must be [tokens, experts], got ", scores.sizes());
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == scores.size(1), "select_experts: bias ", bias.sizes(),
              " does not match ", scores.size(1), " experts");
  TORCH_CHECK(top_k >= 1 && top_k <= scores.size(1), "select_experts: top_k ", top_k, " not in [1, ",
              scores.size(1), "]");
  const torch::Tensor biased = scores.detach() + bias.to(scores.device(), scores.scalar_type());
  return std::get<1>(at::topk(biased, top_k, /*dim=*/-1, /*largest=*/true, /*sorted=*/false));
}

torch::Tensor expert_load(const torch::Tensor& selected, int64_t num_experts) {
  TORCH_CHECK(selected.scalar_type() == at::kLong, "expert_load: selected must be int64");
  return at::bincount(selected.reshape({-1}), /*weights=*/{}, /*minlength=*/num_experts);
}

BalanceStats balance_stats(const torch::Tensor& selected, int64_t num_experts) {
  TORCH_CHECK(selected.dim() == 2, "balance_stats: selected must be [tokens, k], got ", selected.sizes());
  const torch::Tensor load = expert_load(selected, num_experts).to(at::kCPU);
  BalanceStats stats;
  stats.mean_load = static_cast<double>(selected.numel()) / static_cast<double>(num_experts);
  stats.max_load = load.max().item<int64_t>();
  stats.min_load = load.min().item<int64_t>();
  stats.dead_experts = load.eq(0).sum().item<int64_t>();
  stats.max_over_mean = stats.mean_load > 0 ? static_cast<double>(stats.max_load) / stats.mean_load : 0.0;
  return stats;
}

ExpertBalancer::ExpertBalancer(int64_t num_experts, int64_t top_k)
    : num_experts_(num_experts), top_k_(top_k), bias_(at::zeros({num_experts}, at::kFloat)) {
  TORCH_CHECK(num_experts >= 2, "balancer: num_experts must be at least 2, got ", num_experts);
  TORCH_CHECK(top_k >= 1 && top_k < num_experts, "balancer: top_k ", top_k, " must be in [1, num_experts = ",
              num_experts, ")");
}

BalancerState ExpertBalancer::state() const {
  return BalancerState{bias_.detach().to(at::kCPU).clone(), step_};
}

Status ExpertBalancer::restore(const BalancerState& state) {
  if (!state.bias.defined() || state.bias.dim() != 1 || state.bias.size(0) != num_experts_ ||
      !at::isFloatingType(state.bias.scalar_type())) {
    return invalid_argument("balancer state: bias must be a floating [{}] tensor, got {}", num_experts_,
                            state.bias.defined() ? c10::str(state.bias.scalar_type(), state.bias.sizes())
                                                 : std::string("none"));
  }
  if (state.step < 0) return invalid_argument("balancer state: step must be >= 0, got {}", state.step);
  bias_ = state.bias.detach().to(bias_.device(), at::kFloat).clone();
  step_ = state.step;
  return Status::Ok();
}

void ExpertBalancer::check_scores(const torch::Tensor& scores, const char* where) {
  TORCH_CHECK(scores.dim() == 2 && scores.size(1) == num_experts_ && scores.size(0) > 0, where,
              ": scores must be [tokens > 0, ", num_experts_, "], got ", scores.sizes());
  TORCH_CHECK(at::isFloatingType(scores.scalar_type()), where, ": scores must be floating");
  if (bias_.device() != scores.device()) bias_ = bias_.to(scores.device());
}

QuantileBalancer::QuantileBalancer(const QuantileBalancerOptions& options)
    : ExpertBalancer(options.num_experts, options.top_k), options_(options) {
  TORCH_CHECK(options.ema_decay >= 0.0 && options.ema_decay < 1.0, "QuantileBalancer: ema_decay ",
              options.ema_decay, " must be in [0, 1)");
  TORCH_CHECK(options.histogram_bins >= 2, "QuantileBalancer: histogram_bins must be at least 2");
}

torch::Tensor QuantileBalancer::residuals(const torch::Tensor& scores) const {
  // The bias at which token i's choice of j flips, the other experts' biases held: for a chosen
  // pair α_i − s_ij, for one not chosen (k-th largest of s_i + b) − s_ij.
  const torch::Tensor s = scores.detach().to(work_dtype(scores));
  const torch::Tensor biased = s + bias_.to(s.device(), s.scalar_type());
  // α_i: the (k+1)-th largest of s_i + b.
  const auto [values, indices] = at::topk(biased, top_k_ + 1, /*dim=*/-1, /*largest=*/true, /*sorted=*/true);
  const torch::Tensor alpha = values.select(-1, top_k_);
  if (options_.literal_alpha) return alpha.unsqueeze(1) - s;
  // For a pair not chosen, j would enter once s_ij + b_j passes the k-th largest instead.
  const torch::Tensor kth = values.select(-1, top_k_ - 1);
  const torch::Tensor chosen = at::zeros_like(s, at::kBool).scatter(1, indices.narrow(1, 0, top_k_), true);
  return at::where(chosen, alpha.unsqueeze(1), kth.unsqueeze(1)) - s;
}

torch::Tensor QuantileBalancer::exact_target(const torch::Tensor& scores) const {
  TORCH_CHECK(scores.dim() == 2 && scores.size(1) == num_experts_ && scores.size(0) > 0,
              "QuantileBalancer: scores must be [tokens > 0, ", num_experts_, "], got ", scores.sizes());
  // Expert-major, so each expert's order statistics come from a contiguous row.
  const torch::Tensor r = residuals(scores).t().contiguous();
  const int64_t m = r.size(1);
  const double q = static_cast<double>(m) * static_cast<double>(top_k_) / static_cast<double>(num_experts_);
  // The value with q of the r below it: position q − ½ (0-based) of the sorted r.
  const double position = std::clamp(q - 0.5, 0.0, static_cast<double>(m - 1));
  const int64_t below = static_cast<int64_t>(std::floor(position));
  const int64_t above = std::min(below + 1, m - 1);
  const double frac = position - static_cast<double>(below);
  // kthvalue's k is 1-based.
  const torch::Tensor r_below = std::get<0>(at::kthvalue(r, below + 1, /*dim=*/1));
  const torch::Tensor r_above = std::get<0>(at::kthvalue(r, above + 1, /*dim=*/1));
  return centred(r_below * (1.0 - frac) + r_above * frac).to(at::kFloat);
}

std::pair<double, double> QuantileBalancer::histogram_range() const {
  const torch::Tensor b = bias_.to(at::kCPU, at::kDouble);
  return {b.min().item<double>() - 1.0, b.max().item<double>() + 1.0};
}

torch::Tensor QuantileBalancer::local_histogram(const torch::Tensor& scores) const {
  TORCH_CHECK(scores.dim() == 2 && scores.size(1) == num_experts_ && scores.size(0) > 0,
              "QuantileBalancer: scores must be [tokens > 0, ", num_experts_, "], got ", scores.sizes());
  const auto [lo, hi] = histogram_range();
  const int64_t bins = options_.histogram_bins;
#ifdef ODYSSEY_WITH_CUDA_KERNELS
  // The same counts, bit for bit, from one warp per token (kernels/moe.h).
  if (kernels::moe_quantile_histogram_supported(scores, top_k_)) {
    return kernels::moe_quantile_histogram(scores, bias_, top_k_, bins, lo, hi, options_.literal_alpha);
  }
#endif
  const torch::Tensor r = residuals(scores).to(at::kDouble);
  const torch::Tensor bin =
      at::clamp(at::floor((r - lo) * (static_cast<double>(bins) / (hi - lo))), 0, bins - 1).to(at::kLong);
  const torch::Tensor expert = at::arange(num_experts_, bin.options()).unsqueeze(0);
  const torch::Tensor flat = (expert * bins + bin).reshape({-1});
  return at::bincount(flat, /*weights=*/{}, /*minlength=*/num_experts_ * bins).reshape({num_experts_, bins});
}

torch::Tensor QuantileBalancer::histogram_target(const torch::Tensor& histogram) const {
  const int64_t bins = options_.histogram_bins;
  TORCH_CHECK(histogram.dim() == 2 && histogram.size(0) == num_experts_ && histogram.size(1) == bins,
              "QuantileBalancer: histogram must be [", num_experts_, ", ", bins, "], got ", histogram.sizes());
  const torch::Tensor counts = histogram.to(at::kCPU, at::kLong).contiguous();
  const auto rows = counts.accessor<int64_t, 2>();
  const auto [lo, hi] = histogram_range();
  const double width = (hi - lo) / static_cast<double>(bins);
  torch::Tensor target = at::empty({num_experts_}, at::kDouble);
  auto target_of = target.accessor<double, 1>();
  int64_t tokens = -1;
  for (int64_t j = 0; j < num_experts_; ++j) {
    int64_t total = 0;
    for (int64_t c = 0; c < bins; ++c) total += rows[j][c];
    TORCH_CHECK(total > 0 && (tokens < 0 || total == tokens), "QuantileBalancer: histogram row ", j,
                " holds ", total, " tokens, expected the same positive count in every row");
    tokens = total;
    const double q = static_cast<double>(total) * static_cast<double>(top_k_) / static_cast<double>(num_experts_);
    // The bin where the cumulative count passes q, then the point inside it where it reaches q
    // (counts spread evenly across a bin).
    double value = hi;
    int64_t cumulative = 0;
    for (int64_t c = 0; c < bins; ++c) {
      const int64_t in_bin = rows[j][c];
      if (static_cast<double>(cumulative + in_bin) > q) {
        value = lo + width * (static_cast<double>(c) + (q - static_cast<double>(cumulative)) / static_cast<double>(in_bin));
        break;
      }
      cumulative += in_bin;
    }
    target_of[j] = value;
  }
  return centred(target).to(bias_.device(), at::kFloat);
}

torch::Tensor QuantileBalancer::apply_target(const torch::Tensor& target) {
  const torch::Tensor t = target.to(bias_.device(), at::kFloat);
  const torch::Tensor next =
      options_.ema_decay > 0.0 ? bias_ * options_.ema_decay + t * (1.0 - options_.ema_decay) : t;
  bias_ = centred(next);
  ++step_;
  return bias_;
}

torch::Tensor QuantileBalancer::update(const torch::Tensor& scores) {
  if (frozen_) return bias_;
  check_scores(scores, "QuantileBalancer::update");
  return apply_target(exact_target(scores));
}

torch::Tensor QuantileBalancer::update_from_histogram(const torch::Tensor& histogram) {
  if (frozen_) return bias_;
  return apply_target(histogram_target(histogram));
}

SignRuleBalancer::SignRuleBalancer(const SignRuleOptions& options)
    : ExpertBalancer(options.num_experts, options.top_k), options_(options) {
  TORCH_CHECK(options.gamma > 0.0, "SignRuleBalancer: gamma must be positive, got ", options.gamma);
}

torch::Tensor SignRuleBalancer::update(const torch::Tensor& scores) {
  if (frozen_) return bias_;
  check_scores(scores, "SignRuleBalancer::update");
  const torch::Tensor load = expert_load(select_experts(scores, bias_, top_k_), num_experts_).to(at::kFloat);
  const double mean_load =
      static_cast<double>(scores.size(0)) * static_cast<double>(top_k_) / static_cast<double>(num_experts_);
  bias_ = bias_ + at::sign(mean_load - load) * options_.gamma;
  ++step_;
  return bias_;
}

}  // namespace odyssey::model
