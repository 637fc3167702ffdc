// The learner's policy-gradient loss: GRPO advantages, the PPO clipped objective with an
// asymmetric clip, token-level truncated importance weights against the actors' sampling
// log-probs, masking of tokens with extreme actor/learner ratios, an optional KL penalty to a
// reference policy and an entropy bonus, aggregated as a mean over the model-written tokens.
//
// Notation, per token t whose loss_mask is 1 (a model-written token; every other token takes
// no part in anything below):
//   logp      log π_θ(y_t | y_<t), from the logits being trained (carries the gradient)
//   logp_old  the learner's log-prob before this update (π_old: the same weights, recomputed
//             at the start of the step; detached). One update per sampled batch makes the PPO
//             ratio 1 in value with the gradient of logp; several updates per batch move it.
//   logp_act  the actor's sampling log-prob (stored in the trajectory): stale by the policy
//             lag and computed by another numerics path (decode vs training form, dtype)
//   A         the trajectory's group-relative advantage (group_advantages)
//
//   ρ_t   = exp(logp_old − logp_act)              actor → learner mismatch ratio ("the ratio"
//                                                 of the metrics ratio_mean / ratio_max)
//   w_t   = min(ρ_t, tis_cap)                     truncated importance weight, no gradient
//   keep_t = 1/mask_ratio_above ≤ ρ_t ≤ mask_ratio_above   else the token is masked: it
//                                                 contributes nothing (loss, KL, entropy)
//   r_t   = exp(logp − logp_old)                  PPO ratio
//   pg_t  = −w_t · min(r_t·A, clip(r_t, 1 − clip_low, 1 + clip_high)·A)
//   kl_t  = exp(logp_ref − logp) − (logp_ref − logp) − 1      (k3 estimator of KL(π_θ‖π_ref),
//                                                 ≥ 0, unbiased under samples from π_θ)
//   H_t   = −Σ_v π_θ(v) log π_θ(v)                entropy of the whole next-token distribution
//   ℓ_t   = keep_t · (pg_t + kl_coef·kl_t − entropy_coef·H_t)
//   loss  = Σ_t ℓ_t / N,   N = number of tokens with loss_mask 1 (masked tokens included in N,
//           so the normalisation does not depend on which tokens the ratio test dropped)
//
// The sums are additive over pieces of a sequence, over sequences and over data-parallel
// ranks: token_loss_sums() returns Σ_t ℓ_t (with its gradient) and the metric sums for any set
// of tokens; the learner adds them up over chunks and ranks and divides by the global N.
//
// Metrics (fractions and means over loss_mask tokens): clip_fraction = kept tokens where the
// clip binds, i.e. the clipped branch is the smaller one and cuts the gradient
// ((A > 0 and r > 1 + clip_high) or (A < 0 and r < 1 − clip_low)); masked_fraction = keep 0;
// ratio_mean / ratio_max of ρ; entropy = mean H; kl = mean kl_t (0 without a reference).
//
// Errors: shape mismatches throw c10::Error (programming errors). Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace odyssey::learner {

struct LossOptions {
  double clip_low = 0.2;          // ratio floor 1 − clip_low
  double clip_high = 0.28;        // ratio ceiling 1 + clip_high
  double tis_cap = 2.0;           // cap of w
  double mask_ratio_above = 10.0; // keep only tokens with ρ in [1/this, this]
  double kl_coef = 0.0;           // 0: no KL term (logp_ref may be undefined)
  double entropy_coef = 0.0;      // entropy bonus
};

// Group-relative advantages: (r_i − mean) / (std + eps), std the population standard deviation
// of the group's rewards (divided by n). A group whose rewards are all equal (zero variance,
// including a group of one) gets advantage 0 for every member: it says nothing about which
// behaviour is better, so its tokens carry no policy gradient (they still count in N and still
// feel the KL and entropy terms).
std::vector<double> group_advantages(const std::vector<double>& rewards, double eps = 1e-6);

// One piece of tokens (any number n >= 0 of positions, flattened), everything on the logits'
// device. Per-position tensors are [n]; their dtype is converted as needed.
struct TokenLossInputs {
  at::Tensor logits;      // [n, V] from the policy being trained (carries the gradient)
  at::Tensor targets;     // [n] int64: the token each position predicts (the next token)
  at::Tensor logp_old;    // [n] learner log-probs before the update; undefined = logp detached
  at::Tensor logp_actor;  // [n] the actors' sampling log-probs
  at::Tensor advantages;  // [n] the trajectory's advantage at each of its positions
  at::Tensor loss_mask;   // [n] 1 = model-written token, 0 = not trained on
  at::Tensor logp_ref;    // [n] reference log-probs; needed when kl_coef > 0
};

// Additive sums over a set of tokens (see the header comment). loss_sum is a 0-dim tensor with
// the gradient of Σ ℓ_t; the rest are plain numbers.
struct LossSums {
  at::Tensor loss_sum;
  double tokens = 0;       // N: loss_mask tokens
  double kept = 0;         // of which kept by the ratio test
  double clipped = 0;      // kept tokens where the clip binds
  double ratio_sum = 0;    // Σ ρ over loss_mask tokens
  double ratio_max = 0;    // max ρ (0 when no tokens)
  double entropy_sum = 0;  // Σ H over loss_mask tokens
  double kl_sum = 0;       // Σ kl over loss_mask tokens (0 without a reference)
  double loss_value = 0;   // Σ ℓ_t as a number

  // Adds another piece's numbers (loss_sum tensors are added when both are defined).
  void add(const LossSums& other);
};

// Σ ℓ_t and the metric sums of one piece. Also returns, in *logp_out when given, the detached
// log-probs logp [n] of the targets (what the learner records as logp_old).
LossSums token_loss_sums(const TokenLossInputs& in, const LossOptions& options, at::Tensor* logp_out = nullptr);

struct LossMetrics {
  double loss = 0;
  double tokens = 0;
  double clip_fraction = 0;
  double masked_fraction = 0;
  double ratio_mean = 0;
  double ratio_max = 0;
  double entropy = 0;
  double kl = 0;
};

// The means of summed numbers (all 0 when sums.tokens is 0).
LossMetrics loss_metrics(const LossSums& sums);

// Everything at once for one piece: loss = Σ ℓ_t / N (0 with no tokens) and its metrics.
struct LossResult {
  at::Tensor loss;
  LossMetrics metrics;
};
LossResult policy_loss(const TokenLossInputs& in, const LossOptions& options);

}  // namespace odyssey::learner
