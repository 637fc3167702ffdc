// The learner's loss against values computed by hand: GRPO advantages, the PPO clip on both
// sides (binding and not), the truncated importance weight, ratio masking, KL (k3), entropy,
// token-mean aggregation, and the sign of the gradient.
#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/types.h>

#include "learner/loss.h"

namespace odyssey::learner {
namespace {

const auto kF64 = at::TensorOptions().dtype(at::kDouble);

// Logits over 2 tokens whose log_softmax at token 0 is exactly log(p) (up to rounding).
at::Tensor logits_with_probability(const std::vector<double>& p) {
  std::vector<double> flat;
  for (double v : p) {
    flat.push_back(std::log(v));
    flat.push_back(std::log(1 - v));
  }
  return at::tensor(flat, kF64).view({static_cast<int64_t>(p.size()), 2}).clone().requires_grad_(true);
}

at::Tensor vec(const std::vector<double>& v) { return at::tensor(v, kF64); }

TokenLossInputs inputs(const at::Tensor& logits, const std::vector<double>& logp_old, const std::vector<double>& logp_actor,
                       const std::vector<double>& adv, const std::vector<double>& mask) {
  TokenLossInputs in;
  in.logits = logits;
  in.targets = at::zeros({logits.size(0)}, at::kLong);
  in.logp_old = vec(logp_old);
  in.logp_actor = vec(logp_actor);
  in.advantages = vec(adv);
  in.loss_mask = vec(mask);
  return in;
}

LossOptions options() {
  LossOptions o;
  o.clip_low = 0.2;
  o.clip_high = 0.28;
  o.tis_cap = 2.0;
  o.mask_ratio_above = 10.0;
  return o;
}

TEST(GroupAdvantages, AreRewardMinusMeanOverPopulationStd) {
  const auto a = group_advantages({1, 0, 0, 1}, /*eps=*/0.0);
  ASSERT_EQ(a.size(), 4u);
  // mean 0.5, population std 0.5.
  EXPECT_DOUBLE_EQ(a[0], 1.0);
  EXPECT_DOUBLE_EQ(a[1], -1.0);
  EXPECT_DOUBLE_EQ(a[3], 1.0);
  const auto b = group_advantages({3, 1, 2}, 1e-6);
  // mean 2, std sqrt(2/3).
  EXPECT_NEAR(b[0], 1.0 / (std::sqrt(2.0 / 3.0) + 1e-6), 1e-12);
  EXPECT_NEAR(b[1], -1.0 / (std::sqrt(2.0 / 3.0) + 1e-6), 1e-12);
  EXPECT_DOUBLE_EQ(b[2], 0.0);
}

TEST(GroupAdvantages, ZeroVarianceGroupsAndSingletonsGetZero) {
  for (double x : group_advantages({0.7, 0.7, 0.7, 0.7})) EXPECT_EQ(x, 0.0);
  for (double x : group_advantages({1.0})) EXPECT_EQ(x, 0.0);
  EXPECT_TRUE(group_advantages({}).empty());
}

TEST(PolicyLoss, UnclippedTokensGiveMinusRatioTimesAdvantageTimesWeight) {
  // logp = log 0.5, logp_old = log 0.45: r = 0.5/0.45 = 1.111 (inside [0.8, 1.28]);
  // logp_actor = log 0.3: rho = 0.45/0.3 = 1.5 (w = 1.5, kept).
  const at::Tensor logits = logits_with_probability({0.5});
  const auto res = policy_loss(inputs(logits, {std::log(0.45)}, {std::log(0.3)}, {2.0}, {1}), options());
  const double r = 0.5 / 0.45, w = 1.5;
  EXPECT_NEAR(res.loss.item<double>(), -r * 2.0 * w, 1e-12);
  EXPECT_EQ(res.metrics.clip_fraction, 0.0);
  EXPECT_NEAR(res.metrics.ratio_mean, 1.5, 1e-12);
  res.loss.backward();
  // d loss / d logp = -w A r.
  const at::Tensor g = logits.grad();
  // d logp/d logits for a 2-way softmax at token 0 is (1 - p, -(1 - p)).
  EXPECT_NEAR(g[0][0].item<double>(), -w * 2.0 * r * 0.5, 1e-12);
  EXPECT_NEAR(g[0][1].item<double>(), w * 2.0 * r * 0.5, 1e-12);
}

TEST(PolicyLoss, ClipBindsAboveForPositiveAdvantageAndStopsTheGradient) {
  // r = 0.6 / 0.4 = 1.5 > 1.28, A > 0: the clipped value (1.28 A) is smaller and binds.
  const at::Tensor logits = logits_with_probability({0.6});
  const auto res = policy_loss(inputs(logits, {std::log(0.4)}, {std::log(0.4)}, {1.0}, {1}), options());
  EXPECT_NEAR(res.loss.item<double>(), -1.28, 1e-12);
  EXPECT_EQ(res.metrics.clip_fraction, 1.0);
  res.loss.backward();
  EXPECT_EQ(logits.grad().abs().max().item<double>(), 0.0);
}

TEST(PolicyLoss, ClipBindsBelowForNegativeAdvantageAndStopsTheGradient) {
  // r = 0.3 / 0.5 = 0.6 < 0.8, A = -1: min(-0.6, -0.8) = -0.8 (clipped) binds; loss = 0.8.
  const at::Tensor logits = logits_with_probability({0.3});
  const auto res = policy_loss(inputs(logits, {std::log(0.5)}, {std::log(0.5)}, {-1.0}, {1}), options());
  EXPECT_NEAR(res.loss.item<double>(), 0.8, 1e-12);
  EXPECT_EQ(res.metrics.clip_fraction, 1.0);
  res.loss.backward();
  EXPECT_EQ(logits.grad().abs().max().item<double>(), 0.0);
}

TEST(PolicyLoss, ClipDoesNotBindOnTheOtherSide) {
  // A > 0 with r = 0.6 < 0.8: min(0.6 A, 0.8 A) = 0.6 A, unclipped, gradient flows.
  // A < 0 with r = 1.5 > 1.28: min(-1.5, -1.28) = -1.5, unclipped, gradient flows.
  const at::Tensor logits = logits_with_probability({0.3, 0.6});
  const auto res = policy_loss(
      inputs(logits, {std::log(0.5), std::log(0.4)}, {std::log(0.5), std::log(0.4)}, {1.0, -1.0}, {1, 1}), options());
  EXPECT_NEAR(res.loss.item<double>(), (-0.6 * 1.0 + 1.5 * 1.0) / 2.0, 1e-12);
  EXPECT_EQ(res.metrics.clip_fraction, 0.0);
  res.loss.backward();
  EXPECT_GT(logits.grad()[0].abs().max().item<double>(), 0.0);
  EXPECT_GT(logits.grad()[1].abs().max().item<double>(), 0.0);
}

TEST(PolicyLoss, ImportanceWeightIsTruncatedAtTheCap) {
  // rho = 0.6/0.2 = 3 -> w = min(3, 2) = 2; on-policy r = 1 (logp_old = logp).
  const at::Tensor logits = logits_with_probability({0.6});
  const auto res = policy_loss(inputs(logits, {std::log(0.6)}, {std::log(0.2)}, {1.5}, {1}), options());
  EXPECT_NEAR(res.loss.item<double>(), -2.0 * 1.5, 1e-12);
  EXPECT_NEAR(res.metrics.ratio_max, 3.0, 1e-12);
  EXPECT_EQ(res.metrics.masked_fraction, 0.0);
}

TEST(PolicyLoss, TokensWithExtremeRatiosAreMaskedOnBothSides) {
  // Token 0: rho = 0.6/0.05 = 12 > 10 -> masked. Token 1: rho = 0.05/0.6 < 1/10 -> masked.
  // Token 2: rho = 1 -> kept, r = 1, w = 1: loss -A. Token 3: loss_mask 0 -> ignored entirely.
  const at::Tensor logits = logits_with_probability({0.6, 0.05, 0.5, 0.5});
  const auto res = policy_loss(inputs(logits, {std::log(0.6), std::log(0.05), std::log(0.5), std::log(0.5)},
                                      {std::log(0.05), std::log(0.6), std::log(0.5), std::log(0.001)},
                                      {1.0, 1.0, 0.5, 7.0}, {1, 1, 1, 0}),
                               options());
  EXPECT_NEAR(res.loss.item<double>(), -0.5 / 3.0, 1e-12);  // N = 3 loss_mask tokens
  EXPECT_NEAR(res.metrics.masked_fraction, 2.0 / 3.0, 1e-12);
  EXPECT_EQ(res.metrics.tokens, 3.0);
  EXPECT_NEAR(res.metrics.ratio_max, 12.0, 1e-9);
  res.loss.backward();
  EXPECT_EQ(logits.grad()[0].abs().max().item<double>(), 0.0);
  EXPECT_EQ(logits.grad()[1].abs().max().item<double>(), 0.0);
  EXPECT_GT(logits.grad()[2].abs().max().item<double>(), 0.0);
  EXPECT_EQ(logits.grad()[3].abs().max().item<double>(), 0.0);
}

TEST(PolicyLoss, KlIsTheK3EstimatorAndEntropyIsOfTheWholeDistribution) {
  // Uniform over 4 tokens: logp = log 1/4, entropy log 4. Reference logp = log 0.5:
  // d = log 2, k3 = 2 - log 2 - 1.
  TokenLossInputs in;
  in.logits = at::zeros({1, 4}, kF64).requires_grad_(true);
  in.targets = at::zeros({1}, at::kLong);
  in.logp_actor = vec({std::log(0.25)});
  in.advantages = vec({0.0});
  in.loss_mask = vec({1});
  in.logp_ref = vec({std::log(0.5)});
  LossOptions o = options();
  o.kl_coef = 0.1;
  o.entropy_coef = 0.01;
  const auto res = policy_loss(in, o);
  const double k3 = 2.0 - std::log(2.0) - 1.0;
  EXPECT_NEAR(res.metrics.kl, k3, 1e-12);
  EXPECT_NEAR(res.metrics.entropy, std::log(4.0), 1e-12);
  EXPECT_NEAR(res.loss.item<double>(), 0.1 * k3 - 0.01 * std::log(4.0), 1e-12);
}

TEST(PolicyLoss, GradientStepRaisesPositiveAndLowersNegativeAdvantageTokens) {
  at::manual_seed(3);
  const at::Tensor logits = at::randn({4, 8}, kF64).requires_grad_(true);
  TokenLossInputs in;
  in.logits = logits;
  in.targets = at::tensor(std::vector<int64_t>{1, 2, 3, 4});
  in.logp_actor = at::log_softmax(logits.detach(), -1).gather(1, in.targets.unsqueeze(1)).squeeze(1);
  in.advantages = vec({1.0, 1.0, -1.0, -1.0});
  in.loss_mask = vec({1, 1, 1, 1});
  const auto res = policy_loss(in, options());
  res.loss.backward();
  const at::Tensor before = at::log_softmax(logits.detach(), -1).gather(1, in.targets.unsqueeze(1)).squeeze(1);
  const at::Tensor after_logits = logits.detach() - 0.1 * logits.grad();
  const at::Tensor after = at::log_softmax(after_logits, -1).gather(1, in.targets.unsqueeze(1)).squeeze(1);
  EXPECT_GT(after[0].item<double>(), before[0].item<double>());
  EXPECT_GT(after[1].item<double>(), before[1].item<double>());
  EXPECT_LT(after[2].item<double>(), before[2].item<double>());
  EXPECT_LT(after[3].item<double>(), before[3].item<double>());
}

TEST(PolicyLoss, SumsOverPiecesEqualTheLossOfTheWhole) {
  at::manual_seed(5);
  const at::Tensor logits = at::randn({6, 5}, kF64);
  TokenLossInputs whole;
  whole.logits = logits;
  whole.targets = at::randint(0, 5, {6}, at::kLong);
  whole.logp_old = at::log_softmax(logits, -1).gather(1, whole.targets.unsqueeze(1)).squeeze(1) + 0.1 * at::randn({6}, kF64);
  whole.logp_actor = whole.logp_old + 0.3 * at::randn({6}, kF64);
  whole.advantages = at::randn({6}, kF64);
  whole.loss_mask = vec({1, 0, 1, 1, 1, 0});
  const auto all = policy_loss(whole, options());
  LossSums sums;
  for (int64_t start : {0, 2, 5}) {
    const int64_t len = start == 0 ? 2 : start == 2 ? 3 : 1;
    TokenLossInputs piece;
    piece.logits = whole.logits.narrow(0, start, len);
    piece.targets = whole.targets.narrow(0, start, len);
    piece.logp_old = whole.logp_old.narrow(0, start, len);
    piece.logp_actor = whole.logp_actor.narrow(0, start, len);
    piece.advantages = whole.advantages.narrow(0, start, len);
    piece.loss_mask = whole.loss_mask.narrow(0, start, len);
    sums.add(token_loss_sums(piece, options()));
  }
  const auto m = loss_metrics(sums);
  EXPECT_NEAR(m.loss, all.metrics.loss, 1e-12);
  EXPECT_NEAR(m.ratio_mean, all.metrics.ratio_mean, 1e-12);
  EXPECT_NEAR(m.entropy, all.metrics.entropy, 1e-12);
  EXPECT_EQ(m.tokens, 4.0);
}

}  // namespace
}  // namespace odyssey::learner
