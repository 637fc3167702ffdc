#include "learner/optimizer.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <torch/types.h>

namespace odyssey::learner {

double learning_rate(double peak, const ScheduleOptions& s, int64_t step) {
  if (step < s.warmup_steps) return peak * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  if (s.schedule == LrSchedule::kConstant) return peak;
  const double span = static_cast<double>(std::max<int64_t>(1, s.total_steps - s.warmup_steps));
  const double progress = std::min(1.0, static_cast<double>(step - s.warmup_steps) / span);
  return peak * 0.5 * (1.0 + std::cos(M_PI * progress));
}

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm) {
  const at::NoGradGuard no_grad;
  double total = 0;
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    const double n = p.grad().to(at::kDouble).norm().item<double>();
    total += n * n;
  }
  const double norm = std::sqrt(total);
  if (max_norm > 0 && norm > max_norm && std::isfinite(norm)) {
    const double scale = max_norm / (norm + 1e-6);
    for (const auto& p : params)
      if (p.grad().defined()) p.grad().mul_(scale);
  }
  return norm;
}

AdamW::AdamW(std::vector<std::pair<std::string, at::Tensor>> params, const AdamWOptions& options)
    : params_(std::move(params)), moments_(params_.size()), options_(options) {
  for (size_t i = 0; i < params_.size(); ++i) {
    moments_[i].exp_avg = at::zeros_like(params_[i].second, at::MemoryFormat::Preserve);
    moments_[i].exp_avg_sq = at::zeros_like(params_[i].second, at::MemoryFormat::Preserve);
  }
}

void AdamW::step(double lr) {
  const at::NoGradGuard no_grad;
  const double b1 = options_.beta1, b2 = options_.beta2;
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = params_[i].second;
    if (!p.grad().defined()) continue;
    const at::Tensor grad = p.grad();
    Moments& m = moments_[i];
    if (options_.weight_decay != 0) p.mul_(1 - lr * options_.weight_decay);
    m.step += 1;
    const double bc1 = 1 - std::pow(b1, static_cast<double>(m.step));
    const double bc2 = 1 - std::pow(b2, static_cast<double>(m.step));
    m.exp_avg.mul_(b1).add_(grad, 1 - b1);
    m.exp_avg_sq.mul_(b2).addcmul_(grad, grad, 1 - b2);
    const at::Tensor denom = (m.exp_avg_sq.sqrt() / std::sqrt(bc2)).add_(options_.eps);
    p.addcdiv_(m.exp_avg, denom, -lr / bc1);
  }
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
  }
  steps_ = steps;
  return Status::Ok();
}

}  // namespace odyssey::learner
