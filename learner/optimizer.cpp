#include "learner/optimizer.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include <ATen/ATen.h>
#include <torch/types.h>
#include <torch/version.h>

namespace odyssey::learner {

double learning_rate(double peak, const ScheduleOptions& s, int64_t step) {
  if (step < s.warmup_steps) return peak * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  if (s.schedule == LrSchedule::kConstant) return peak;
  const double span = static_cast<double>(std::max<int64_t>(1, s.total_steps - s.warmup_steps));
  const double progress = std::min(1.0, static_cast<double>(step - s.warmup_steps) / span);
  return peak * 0.5 * (1.0 + std::cos(M_PI * progress));
}

namespace {

// The global norm in fp64 a parameter at a time: the fallback when the fp32 norms overflow.
double grad_norm_fp64(const std::vector<at::Tensor>& grads) {
  double total = 0;
  for (const auto& g : grads) {
    const double n = g.to(at::kDouble).norm().item<double>();
    total += n * n;
  }
  return std::sqrt(total);
}

}  // namespace

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm) {
  const at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return 0;
  // Every gradient's norm in one multi-tensor pass (fp32 sums), summed in fp64 with one sync.
  const std::vector<at::Tensor> norms = at::_foreach_norm(grads, 2);
  double norm = at::stack(norms).to(at::kDouble).square().sum().sqrt().item<double>();
  // fp32 squares overflow above ~1.8e19; such gradients are rare but not wrong, so their norm is
  // taken again in fp64 rather than reported as inf (which would skip the update).
  if (!std::isfinite(norm)) norm = grad_norm_fp64(grads);
  if (max_norm > 0 && norm > max_norm && std::isfinite(norm)) at::_foreach_mul_(grads, max_norm / (norm + 1e-6));
  return norm;
}

AdamW::AdamW(std::vector<std::pair<std::string, at::Tensor>> params, const AdamWOptions& options)
    : params_(std::move(params)), moments_(params_.size()), options_(options) {
  for (size_t i = 0; i < params_.size(); ++i) {
    moments_[i].exp_avg = at::zeros_like(params_[i].second, at::MemoryFormat::Preserve);
    moments_[i].exp_avg_sq = at::zeros_like(params_[i].second, at::MemoryFormat::Preserve);
  }
}

bool AdamW::fused_step_applies(size_t i) const {
#if TORCH_VERSION_MAJOR >= 2
  const at::Tensor& p = params_[i].second;
  const at::Tensor& g = p.grad();
  // at::_fused_adamw_'s conditions: floating point, one device and dtype for a parameter, its
  // gradient and moments, the same dense layout (the moments are made with the parameter's).
  return options_.fused && p.is_cuda() && at::isFloatingType(p.scalar_type()) && g.scalar_type() == p.scalar_type() &&
         g.device() == p.device() && p.is_non_overlapping_and_dense() && g.strides() == p.strides() &&
         moments_[i].exp_avg.strides() == p.strides();
#else
  (void)i;
  return false;
#endif
}

void AdamW::step(double lr) {
  const at::NoGradGuard no_grad;
  const double b1 = options_.beta1, b2 = options_.beta2;
  // Groups of parameters the fused multi-tensor step takes, by (device, dtype).
  std::map<std::tuple<int, int, int>, std::vector<size_t>> fused_groups;  // (device type, index, dtype)
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = params_[i].second;
    if (!p.grad().defined()) continue;
    Moments& m = moments_[i];
    if (fused_step_applies(i)) {
      fused_groups[{static_cast<int>(p.device().type()), p.device().index(), static_cast<int>(p.scalar_type())}]
          .push_back(i);
      continue;
    }
    const at::Tensor grad = p.grad();
    if (options_.weight_decay != 0) p.mul_(1 - lr * options_.weight_decay);
    m.step += 1;
    m.device_step = at::Tensor();  // the fused step's copy, remade from `step` if it is taken again
    const double bc1 = 1 - std::pow(b1, static_cast<double>(m.step));
    const double bc2 = 1 - std::pow(b2, static_cast<double>(m.step));
    m.exp_avg.mul_(b1).add_(grad, 1 - b1);
    m.exp_avg_sq.mul_(b2).addcmul_(grad, grad, 1 - b2);
    const at::Tensor denom = (m.exp_avg_sq.sqrt() / std::sqrt(bc2)).add_(options_.eps);
    p.addcdiv_(m.exp_avg, denom, -lr / bc1);
  }
#if TORCH_VERSION_MAJOR >= 2
  for (const auto& group : fused_groups) {
    std::vector<at::Tensor> ps, gs, exp_avgs, exp_avg_sqs, steps;
    for (size_t i : group.second) {
      Moments& m = moments_[i];
      // The update count on the device, as the fused kernel reads it (fp32, exact to 2^24 steps);
      // made from the host's count when first needed and after restore().
      if (!m.device_step.defined())
        m.device_step = at::full({}, static_cast<double>(m.step), params_[i].second.options().dtype(at::kFloat));
      m.step += 1;
      ps.push_back(params_[i].second);
      gs.push_back(params_[i].second.grad());
      exp_avgs.push_back(m.exp_avg);
      exp_avg_sqs.push_back(m.exp_avg_sq);
      steps.push_back(m.device_step);
    }
    at::_foreach_add_(steps, 1);
    at::_fused_adamw_(ps, gs, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, lr, b1, b2, options_.weight_decay,
                      options_.eps, /*amsgrad=*/false, /*maximize=*/false);
  }
#endif
  ++steps_;
}

std::map<std::string, at::Tensor> AdamW::state() const {
  std::map<std::string, at::Tensor> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string& name = params_[i].first;
    out["exp_avg." + name] = moments_[i].exp_avg.detach().to(at::kCPU).clone();
    out["exp_avg_sq." + name] = moments_[i].exp_avg_sq.detach().to(at::kCPU).clone();
    out["step." + name] = at::full({1}, moments_[i].step, at::kLong);
  }
  return out;
}

Status AdamW::restore(const std::map<std::string, at::Tensor>& state, int64_t steps) {
  if (steps < 0) return invalid_argument("optimizer state: negative step count {}", steps);
  // Check everything before changing anything.
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string& name = params_[i].first;
    for (const char* kind : {"exp_avg.", "exp_avg_sq."}) {
      auto it = state.find(kind + name);
      if (it == state.end()) return invalid_argument("optimizer state: missing tensor '{}{}'", kind, name);
      if (it->second.sizes() != params_[i].second.sizes())
        return invalid_argument("optimizer state: '{}{}' has the wrong shape for its parameter", kind, name);
    }
    auto st = state.find("step." + name);
    if (st == state.end() || st->second.numel() != 1 || st->second.scalar_type() != at::kLong)
      return invalid_argument("optimizer state: missing or malformed 'step.{}' (int64 [1])", name);
  }
  if (state.size() != 3 * params_.size())
    return invalid_argument("optimizer state: {} tensors for {} parameters (3 each expected)", state.size(),
                            params_.size());
  const at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string& name = params_[i].first;
    moments_[i].exp_avg.copy_(state.at("exp_avg." + name));
    moments_[i].exp_avg_sq.copy_(state.at("exp_avg_sq." + name));
    moments_[i].step = state.at("step." + name).item<int64_t>();
    moments_[i].device_step = at::Tensor();
  }
  steps_ = steps;
  return Status::Ok();
}

}  // namespace odyssey::learner
