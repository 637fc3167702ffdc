#include "model/balancing.h"

#include <cmath>
#include <cstdio>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

namespace odyssey::model {
namespace {

// A fixed router strongly skewed toward its first experts: scores = σ(x·W + skew), with a
// fresh batch of tokens x at every draw.
class SkewedRouter {
 public:
  SkewedRouter(int64_t experts, int64_t width, uint64_t seed)
      : width_(width), generator_(at::make_generator<at::CPUGeneratorImpl>(seed)) {
    weight_ = at::randn({width, experts}, generator_, at::kFloat) * 0.5;
    // Logit +4 for expert 0, about +2 for expert 1, −1 for the tail.
    skew_ = at::exp(at::arange(experts, at::kFloat) * -0.5) * 5.0 - 1.0;
  }
  torch::Tensor draw(int64_t tokens) {
    const torch::Tensor x = at::randn({tokens, width_}, generator_, at::kFloat);
    return at::sigmoid(at::matmul(x, weight_) + skew_);
  }

 private:
  int64_t width_;
  at::Generator generator_;
  torch::Tensor weight_;
  torch::Tensor skew_;
};

double max_over_mean(const torch::Tensor& scores, const torch::Tensor& bias, int64_t top_k) {
  return balance_stats(select_experts(scores, bias, top_k), scores.size(1)).max_over_mean;
}

// Each step: route a fresh batch with the bias learned so far (the load printed and checked is
// this batch's, which the balancer has not seen), then let the balancer learn from it. Batch
// size sets a noise floor: a fresh batch's load is binomial, ±√q around q per expert, so a
// max/mean ≤ 1.05 is only measurable with q in the thousands (here q = 8192, noise floor ≈ 1.02).
TEST(QuantileBalancing, ReachesMaxOverMeanLoadWithinFivePercentInAFewStepsWhileTheSignRuleIsFarFromIt) {
  constexpr int64_t kExperts = 16, kTopK = 4, kTokens = 32768, kSteps = 10, kBalancedBy = 3;
  SkewedRouter router(kExperts, /*width=*/16, /*seed=*/1);
  QuantileBalancer quantile(QuantileBalancerOptions{kExperts, kTopK, /*ema_decay=*/0.0, /*histogram_bins=*/1000});
  SignRuleBalancer sign(SignRuleOptions{kExperts, kTopK, /*gamma=*/1e-3});
  std::vector<double> quantile_curve, sign_curve;
  std::printf("step  max/mean quantile  max/mean sign (γ = 1e-3)\n");
  for (int64_t step = 0; step < kSteps; ++step) {
    const torch::Tensor scores = router.draw(kTokens);
    quantile_curve.push_back(max_over_mean(scores, quantile.bias(), kTopK));
    sign_curve.push_back(max_over_mean(scores, sign.bias(), kTopK));
    std::printf("%4ld  %17.3f  %13.3f\n", static_cast<long>(step), quantile_curve.back(), sign_curve.back());
    (void)quantile.update(scores);
    (void)sign.update(scores);
  }
  EXPECT_GT(quantile_curve.front(), 3.0) << "the router is not skewed enough to test anything";
  for (int64_t step = kBalancedBy; step < kSteps; ++step) {
    EXPECT_LE(quantile_curve[step], 1.05) << "step " << step;
    EXPECT_GT(sign_curve[step], 2.0) << "step " << step;
  }
  EXPECT_EQ(balance_stats(select_experts(router.draw(kTokens), quantile.bias(), kTopK), kExperts).dead_experts, 0);
}

// The histogram resolves the crossing to a fraction of its bin by linear interpolation; the
// loads it gives differ from the exact form's by well under 2% of q.
TEST(QuantileBalancing, ExactAndHistogramFormsAgree) {
  constexpr int64_t kExperts = 64, kTopK = 4, kTokens = 16384, kShards = 4;
  SkewedRouter router(kExperts, /*width=*/16, /*seed=*/2);
  QuantileBalancer balancer(QuantileBalancerOptions{kExperts, kTopK, /*ema_decay=*/0.0, /*histogram_bins=*/1000});
  for (int step = 0; step < 4; ++step) {
    const torch::Tensor scores = router.draw(kTokens);
    // Four ranks' histograms summed (the all-reduce) are the histogram of the whole batch.
    torch::Tensor reduced = at::zeros({kExperts, 1000}, at::kLong);
    for (const torch::Tensor& shard : scores.chunk(kShards, 0)) reduced += balancer.local_histogram(shard);
    ASSERT_TRUE(at::equal(reduced, balancer.local_histogram(scores)));

    const torch::Tensor exact = balancer.exact_target(scores);
    const torch::Tensor from_histogram = balancer.histogram_target(reduced);
    const auto [lo, hi] = balancer.histogram_range();
    const double bin_width = (hi - lo) / 1000.0;
    const double bias_diff = (exact - from_histogram).abs().max().item<double>();
    const torch::Tensor load_exact = expert_load(select_experts(scores, exact, kTopK), kExperts).to(at::kDouble);
    const torch::Tensor load_hist =
        expert_load(select_experts(scores, from_histogram, kTopK), kExperts).to(at::kDouble);
    const double q = static_cast<double>(kTokens * kTopK / kExperts);
    const double load_diff = (load_exact - load_hist).abs().max().item<double>() / q;
    std::printf("step %d: bin width %.4f, max |b_exact − b_histogram| %.5f, max load difference %.2f%% of q\n", step,
                bin_width, bias_diff, 100 * load_diff);
    EXPECT_LT(bias_diff, bin_width);
    EXPECT_LT(load_diff, 0.02);
    (void)balancer.update(scores);
  }
}

TEST(QuantileBalancing, HistogramUpdateMovesTheStateLikeTheExactOne) {
  constexpr int64_t kExperts = 16, kTopK = 2;
  SkewedRouter router(kExperts, /*width=*/8, /*seed=*/3);
  QuantileBalancer exact(QuantileBalancerOptions{kExperts, kTopK, /*ema_decay=*/0.5, 1000});
  QuantileBalancer histogram(QuantileBalancerOptions{kExperts, kTopK, /*ema_decay=*/0.5, 1000});
  for (int step = 0; step < 3; ++step) {
    const torch::Tensor scores = router.draw(2048);
    (void)exact.update(scores);
    (void)histogram.update_from_histogram(histogram.local_histogram(scores));
  }
  EXPECT_EQ(histogram.step(), 3);
  EXPECT_LT((exact.bias() - histogram.bias()).abs().max().item<double>(), 0.01);
  EXPECT_LT(std::abs(histogram.bias().sum().item<double>()), 1e-4);  // centred
}

TEST(QuantileBalancing, StateRoundTripsExactly) {
  constexpr int64_t kExperts = 32, kTopK = 4;
  const QuantileBalancerOptions options{kExperts, kTopK, /*ema_decay=*/0.3, 1000};
  SkewedRouter router(kExperts, /*width=*/8, /*seed=*/4);
  std::vector<torch::Tensor> batches;
  for (int i = 0; i < 5; ++i) batches.push_back(router.draw(1024));

  QuantileBalancer original(options);
  for (int i = 0; i < 3; ++i) (void)original.update(batches[i]);
  const BalancerState saved = original.state();
  for (int i = 3; i < 5; ++i) (void)original.update(batches[i]);

  QuantileBalancer resumed(options);
  ASSERT_TRUE(resumed.restore(saved).ok());
  EXPECT_EQ(resumed.step(), 3);
  for (int i = 3; i < 5; ++i) (void)resumed.update(batches[i]);
  EXPECT_TRUE(at::equal(resumed.bias(), original.bias()));
  EXPECT_EQ(resumed.step(), original.step());

  // A state that does not fit is refused and changes nothing.
  const Status wrong = resumed.restore(BalancerState{at::zeros({kExperts + 1}), 7});
  EXPECT_EQ(wrong.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(resumed.restore(BalancerState{at::zeros({kExperts}), -1}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(resumed.restore(BalancerState{}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(resumed.step(), 5);
}

TEST(QuantileBalancing, FrozenBalancerIgnoresUpdates) {
  QuantileBalancer balancer(QuantileBalancerOptions{8, 2, 0.0, 1000});
  SkewedRouter router(8, /*width=*/4, /*seed=*/5);
  (void)balancer.update(router.draw(256));
  const torch::Tensor before = balancer.bias().clone();
  balancer.set_frozen(true);
  (void)balancer.update(router.draw(256));
  (void)balancer.update_from_histogram(balancer.local_histogram(router.draw(256)));
  EXPECT_TRUE(at::equal(balancer.bias(), before));
  EXPECT_EQ(balancer.step(), 1);
}

TEST(QuantileBalancing, BalanceStatsCountLoadsAndDeadExperts) {
  const torch::Tensor selected = at::tensor(std::vector<int64_t>{0, 1, 0, 2, 0, 1}, at::kLong).reshape({3, 2});
  const BalanceStats stats = balance_stats(selected, /*num_experts=*/4);
  EXPECT_DOUBLE_EQ(stats.mean_load, 1.5);
  EXPECT_EQ(stats.max_load, 3);
  EXPECT_EQ(stats.min_load, 0);
  EXPECT_DOUBLE_EQ(stats.max_over_mean, 2.0);
  EXPECT_EQ(stats.dead_experts, 1);
}

TEST(SignRule, MovesEachBiasByGammaTowardTheMeanLoad) {
  // Two tokens, top-1 of 4: both pick expert 0; experts 1–3 are idle.
  const torch::Tensor scores =
      at::tensor(std::vector<float>{0.9f, 0.1f, 0.2f, 0.3f, 0.8f, 0.3f, 0.2f, 0.1f}).reshape({2, 4});
  SignRuleBalancer balancer(SignRuleOptions{/*num_experts=*/4, /*top_k=*/1, /*gamma=*/0.01});
  const torch::Tensor bias = balancer.update(scores);
  const std::vector<float> expected{-0.01f, 0.01f, 0.01f, 0.01f};
  for (int64_t j = 0; j < 4; ++j) EXPECT_FLOAT_EQ(bias[j].item<float>(), expected[static_cast<size_t>(j)]);
  EXPECT_EQ(balancer.step(), 1);
}

}  // namespace
}  // namespace odyssey::model
