#include "learner/loss.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace odyssey::learner {

std::vector<double> group_advantages(const std::vector<double>& rewards, double eps) {
  std::vector<double> out(rewards.size(), 0.0);
  if (rewards.empty()) return out;
  double mean = 0;
  for (double r : rewards) mean += r;
  mean /= static_cast<double>(rewards.size());
  double var = 0;
  for (double r : rewards) var += (r - mean) * (r - mean);
  var /= static_cast<double>(rewards.size());
  const double std = std::sqrt(var);
  if (std == 0) return out;  // zero variance: no signal, advantage 0 (not 0/eps noise)
  for (size_t i = 0; i < rewards.size(); ++i) out[i] = (rewards[i] - mean) / (std + eps);
  return out;
}

void LossSums::add(const LossSums& o) {
  if (o.loss_sum.defined()) loss_sum = loss_sum.defined() ? loss_sum + o.loss_sum : o.loss_sum;
  tokens += o.tokens;
  kept += o.kept;
  clipped += o.clipped;
  ratio_sum += o.ratio_sum;
  ratio_max = std::max(ratio_max, o.ratio_max);
  entropy_sum += o.entropy_sum;
  kl_sum += o.kl_sum;
  loss_value += o.loss_value;
}

LossSums token_loss_sums(const TokenLossInputs& in, const LossOptions& o, at::Tensor* logp_out) {
  TORCH_CHECK(in.logits.dim() == 2, "token_loss_sums: logits must be [n, V], got ", in.logits.sizes());
  const int64_t n = in.logits.size(0);
  auto check = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.defined() && t.dim() == 1 && t.size(0) == n, "token_loss_sums: ", name, " must be [", n,
                "], got ", t.defined() ? t.sizes() : at::IntArrayRef{});
  };
  check(in.targets, "targets");
  check(in.logp_actor, "logp_actor");
  check(in.advantages, "advantages");
  check(in.loss_mask, "loss_mask");
  if (in.logp_old.defined()) check(in.logp_old, "logp_old");
  const bool with_kl = o.kl_coef > 0;
  if (with_kl) check(in.logp_ref, "logp_ref (kl_coef > 0)");

  const at::Tensor log_probs = at::log_softmax(in.logits, -1);  // [n, V], the logits' dtype
  const auto dtype = log_probs.scalar_type();
  const at::Tensor logp = log_probs.gather(1, in.targets.to(at::kLong).unsqueeze(1)).squeeze(1);
  if (logp_out) *logp_out = logp.detach();
  const at::Tensor logp_old = in.logp_old.defined() ? in.logp_old.to(dtype) : logp.detach();
  const at::Tensor mask = in.loss_mask.to(dtype);
  const at::Tensor adv = in.advantages.to(dtype);

  // Actor -> learner mismatch: the truncated importance weight and the ratio mask (no gradient).
  const at::Tensor rho = at::exp(logp_old - in.logp_actor.to(dtype));
  const at::Tensor w = at::clamp_max(rho, o.tis_cap);
  const at::Tensor keep = ((rho >= 1.0 / o.mask_ratio_above) & (rho <= o.mask_ratio_above)).to(dtype) * mask;

  // PPO clipped objective against the learner's own pre-update log-probs.
  const at::Tensor r = at::exp(logp - logp_old);
  const at::Tensor unclipped = r * adv;
  const at::Tensor clipped = at::clamp(r, 1.0 - o.clip_low, 1.0 + o.clip_high) * adv;
  const at::Tensor pg = -w * at::min(unclipped, clipped);

  // Entropy of the whole next-token distribution.
  const at::Tensor entropy = -(at::exp(log_probs) * log_probs).sum(-1);

  at::Tensor per_token = pg;
  at::Tensor kl;
  if (with_kl) {
    const at::Tensor d = in.logp_ref.to(dtype) - logp;
    kl = at::exp(d) - d - 1.0;
    per_token = per_token + o.kl_coef * kl;
  }
  if (o.entropy_coef > 0) per_token = per_token - o.entropy_coef * entropy;

  LossSums s;
  s.loss_sum = (keep * per_token).sum();
  const at::NoGradGuard no_grad;
  const at::Tensor binds = ((adv > 0) & (r.detach() > 1.0 + o.clip_high)) | ((adv < 0) & (r.detach() < 1.0 - o.clip_low));
  // The metric sums come to the host together: one device sync a call, not one a figure.
  const at::Tensor zero = at::zeros({}, mask.options());
  const at::Tensor figures =
      at::stack({mask.sum(), keep.sum(), (binds.to(dtype) * keep).sum(), (rho * mask).sum(),
                 n > 0 ? (rho * mask).max() : zero, (entropy.detach() * mask).sum(),
                 with_kl ? (kl.detach() * mask).sum() : zero, s.loss_sum.detach()})
          .to(at::kDouble)
          .to(at::kCPU);
  const double* f = figures.data_ptr<double>();
  s.tokens = f[0];
  s.kept = f[1];
  s.clipped = f[2];
  s.ratio_sum = f[3];
  s.ratio_max = s.tokens > 0 ? f[4] : 0.0;
  s.entropy_sum = f[5];
  if (with_kl) s.kl_sum = f[6];
  s.loss_value = f[7];
  return s;
}

LossMetrics loss_metrics(const LossSums& s) {
  LossMetrics m;
  m.tokens = s.tokens;
  if (s.tokens <= 0) return m;
  m.loss = s.loss_value / s.tokens;
  m.clip_fraction = s.clipped / s.tokens;
  m.masked_fraction = (s.tokens - s.kept) / s.tokens;
  m.ratio_mean = s.ratio_sum / s.tokens;
  m.ratio_max = s.ratio_max;
  m.entropy = s.entropy_sum / s.tokens;
  m.kl = s.kl_sum / s.tokens;
  return m;
}

LossResult policy_loss(const TokenLossInputs& in, const LossOptions& options) {
  const LossSums s = token_loss_sums(in, options);
  LossResult out;
  out.loss = s.tokens > 0 ? s.loss_sum / s.tokens : s.loss_sum * 0.0;
  out.metrics = loss_metrics(s);
  return out;
}

}  // namespace odyssey::learner
