#include "actors/sampling.h"

#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace odyssey::actors {
namespace {

const std::vector<double> kLogits = {2.0, 1.0, 0.5, 0.0, -1.0, -3.0};

std::vector<double> softmax(const std::vector<double>& z, double t) {
  std::vector<double> p(z.size());
  double m = -1e300, s = 0;
  for (double v : z) m = std::max(m, v / t);
  for (size_t i = 0; i < z.size(); ++i) s += p[i] = std::exp(z[i] / t - m);
  for (double& v : p) v /= s;
  return p;
}

// Pearson's statistic of `draws` samples against `expected` probabilities (cells with
// expected probability 0 must get no draws: they are checked separately).
double chi_square(const TokenSampler& sampler, const std::vector<double>& expected, int draws,
                  std::vector<int>* counts_out = nullptr) {
  std::vector<int> counts(expected.size(), 0);
  for (int i = 0; i < draws; ++i) {
    auto t = sampler.sample(kLogits.data(), kLogits.size(), {/*sequence=*/7, static_cast<uint64_t>(i)});
    EXPECT_TRUE(t.ok());
    ++counts[t->token];
  }
  double chi = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    if (expected[i] == 0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " is outside the kept set but was drawn";
      continue;
    }
    const double e = expected[i] * draws;
    chi += (counts[i] - e) * (counts[i] - e) / e;
  }
  if (counts_out) *counts_out = counts;
  return chi;
}

// Upper 0.1% points of the chi-square distribution by degrees of freedom.
double chi_square_999(int dof) {
  static const double table[] = {0, 10.83, 13.82, 16.27, 18.47, 20.52};
  return table[dof];
}

TEST(TokenSampler, DrawsMatchTheTemperedSoftmaxInAChiSquareTest) {
  for (double t : {1.0, 0.7, 2.0}) {
    TokenSampler sampler({t, 0, 1.0}, /*seed=*/11);
    const std::vector<double> p = softmax(kLogits, t);
    const double chi = chi_square(sampler, p, 20000);
    EXPECT_LT(chi, chi_square_999(5)) << "temperature " << t;
    auto q = sampler.distribution(kLogits.data(), kLogits.size());
    ASSERT_TRUE(q.ok());
    for (size_t i = 0; i < p.size(); ++i) EXPECT_NEAR((*q)[i], p[i], 1e-12);
  }
}

TEST(TokenSampler, TopKDrawsOnlyTheKLargestInTheirRenormalisedProportions) {
  TokenSampler sampler({1.0, /*top_k=*/3, 1.0}, 5);
  std::vector<double> p = softmax(kLogits, 1.0);
  const double kept = p[0] + p[1] + p[2];
  for (size_t i = 0; i < p.size(); ++i) p[i] = i < 3 ? p[i] / kept : 0.0;
  EXPECT_LT(chi_square(sampler, p, 20000), chi_square_999(2));
}

TEST(TokenSampler, TopPKeepsTheSmallestPrefixThatReachesP) {
  const std::vector<double> full = softmax(kLogits, 1.0);  // 0.561, 0.206, 0.125, 0.076, ...
  // p = 0.7: token 0 alone (0.561) is short of it, tokens 0 and 1 (0.767) reach it.
  TokenSampler sampler({1.0, 0, /*top_p=*/0.7}, 5);
  std::vector<double> p(full.size(), 0.0);
  p[0] = full[0] / (full[0] + full[1]);
  p[1] = full[1] / (full[0] + full[1]);
  EXPECT_LT(chi_square(sampler, p, 20000), chi_square_999(1));
  // A p below the top token's probability keeps only that token: logprob 0.
  TokenSampler narrow({1.0, 0, 0.3}, 5);
  for (uint64_t i = 0; i < 50; ++i) {
    auto t = narrow.sample(kLogits.data(), kLogits.size(), {1, i});
    ASSERT_TRUE(t.ok());
    EXPECT_EQ(t->token, 0u);
    EXPECT_EQ(t->logprob, 0.0f);
  }
  // top-k and top-p together: k first, then p over the renormalised k.
  TokenSampler both({1.0, 2, 0.75}, 5);
  auto q = both.distribution(kLogits.data(), kLogits.size());
  ASSERT_TRUE(q.ok());
  // Among tokens {0, 1}: 0.731, 0.269 -> p = 0.75 needs both.
  EXPECT_NEAR((*q)[0], full[0] / (full[0] + full[1]), 1e-12);
  EXPECT_NEAR((*q)[1], full[1] / (full[0] + full[1]), 1e-12);
  for (size_t i = 2; i < q->size(); ++i) EXPECT_EQ((*q)[i], 0.0);
}

TEST(TokenSampler, LogprobIsTheLogOfTheSampledDistribution) {
  TokenSampler sampler({0.8, 4, 0.95}, 3);
  auto q = sampler.distribution(kLogits.data(), kLogits.size());
  ASSERT_TRUE(q.ok());
  for (uint64_t i = 0; i < 200; ++i) {
    auto t = sampler.sample(kLogits.data(), kLogits.size(), {9, i});
    ASSERT_TRUE(t.ok());
    ASSERT_GT((*q)[t->token], 0.0);
    EXPECT_NEAR(t->logprob, std::log((*q)[t->token]), 1e-6);
  }
}

TEST(TokenSampler, SameSeedGivesTheSameTokensWhateverTheBatch) {
  at::manual_seed(0);
  const at::Tensor logits = at::randn({5, 271}, at::kFloat) * 3;
  TokenSampler sampler({1.0, 50, 0.9}, /*seed=*/42);
  std::vector<DrawKey> keys;
  for (uint64_t b = 0; b < 5; ++b) keys.push_back({100 + b, 30 + 7 * b});
  auto together = sampler.sample(logits, keys);
  ASSERT_TRUE(together.ok());
  // Each row alone, and the rows in reverse order in one batch.
  for (int64_t b = 0; b < 5; ++b) {
    auto alone = sampler.sample(logits.narrow(0, b, 1), {keys[static_cast<size_t>(b)]});
    ASSERT_TRUE(alone.ok());
    EXPECT_EQ((*alone)[0].token, (*together)[static_cast<size_t>(b)].token);
    EXPECT_EQ((*alone)[0].logprob, (*together)[static_cast<size_t>(b)].logprob);
  }
  const at::Tensor reversed = logits.flip(0);
  std::vector<DrawKey> reversed_keys(keys.rbegin(), keys.rend());
  auto backwards = sampler.sample(reversed, reversed_keys);
  ASSERT_TRUE(backwards.ok());
  for (size_t b = 0; b < 5; ++b) EXPECT_EQ((*backwards)[4 - b].token, (*together)[b].token);
  // Another seed, or another position, draws differently somewhere.
  TokenSampler other({1.0, 50, 0.9}, 43);
  int differ = 0;
  for (uint64_t i = 0; i < 64; ++i) {
    auto a = sampler.sample(kLogits.data(), kLogits.size(), {1, i});
    auto b = other.sample(kLogits.data(), kLogits.size(), {1, i});
    differ += a->token != b->token;
  }
  EXPECT_GT(differ, 5);
}

TEST(TokenSampler, TemperatureZeroIsTheArgmaxWithLogprobZero) {
  at::manual_seed(1);
  const at::Tensor logits = at::randn({8, 271}, at::kDouble);
  TokenSampler greedy({0.0, 0, 1.0}, 1);
  std::vector<DrawKey> keys(8);
  auto tokens = greedy.sample(logits, keys);
  ASSERT_TRUE(tokens.ok());
  const at::Tensor argmax = logits.argmax(1);
  for (int64_t b = 0; b < 8; ++b) {
    EXPECT_EQ((*tokens)[static_cast<size_t>(b)].token, argmax[b].item<int64_t>());
    EXPECT_EQ((*tokens)[static_cast<size_t>(b)].logprob, 0.0f);
  }
  // Ties go to the lowest id; NaN and -inf are never chosen.
  const std::vector<double> tied = {1.0, 3.0, 3.0, std::nan(""), -INFINITY};
  EXPECT_EQ(greedy.sample(tied.data(), tied.size(), {})->token, 1u);
  const std::vector<double> nan_first = {std::nan(""), -2.0, -1.0};
  EXPECT_EQ(greedy.sample(nan_first.data(), nan_first.size(), {})->token, 2u);
}

TEST(TokenSampler, NeverDrawsNanOrMinusInfinityAndRejectsRowsWithoutAFiniteLogit) {
  const std::vector<double> masked = {-INFINITY, 0.0, std::nan(""), 0.0};
  TokenSampler sampler({1.0, 0, 1.0}, 2);
  for (uint64_t i = 0; i < 200; ++i) {
    auto t = sampler.sample(masked.data(), masked.size(), {3, i});
    ASSERT_TRUE(t.ok());
    EXPECT_TRUE(t->token == 1 || t->token == 3);
    EXPECT_NEAR(t->logprob, std::log(0.5), 1e-6);
  }
  const std::vector<double> none = {-INFINITY, std::nan("")};
  auto bad = sampler.sample(none.data(), none.size(), {});
  EXPECT_FALSE(bad.ok());
  auto bad_row = sampler.sample(at::full({2, 3}, NAN, at::kFloat), {{}, {}});
  ASSERT_FALSE(bad_row.ok());
  EXPECT_NE(bad_row.status().message().find("row 0"), std::string::npos) << bad_row.status().message();
}

TEST(TokenSampler, ValidateNamesTheBadField) {
  EXPECT_TRUE(validate({1.0, 0, 1.0}).ok());
  EXPECT_NE(validate({-1.0, 0, 1.0}).message().find("temperature"), std::string::npos);
  EXPECT_NE(validate({1.0, -2, 1.0}).message().find("top_k"), std::string::npos);
  EXPECT_NE(validate({1.0, 0, 0.0}).message().find("top_p"), std::string::npos);
  EXPECT_NE(validate({1.0, 0, 1.5}).message().find("top_p"), std::string::npos);
}

TEST(TokenSampler, CounterUniformIsUniformAndAPureFunctionOfItsCounters) {
  EXPECT_EQ(counter_uniform(1, 2, 3), counter_uniform(1, 2, 3));
  EXPECT_NE(counter_uniform(1, 2, 3), counter_uniform(1, 2, 4));
  EXPECT_NE(counter_uniform(1, 2, 3), counter_uniform(1, 3, 3));
  EXPECT_NE(counter_uniform(1, 2, 3), counter_uniform(2, 2, 3));
  // Ten equal bins over consecutive positions of one sequence.
  std::vector<int> bins(10, 0);
  const int n = 50000;
  for (int i = 0; i < n; ++i) {
    const double u = counter_uniform(0, 0, static_cast<uint64_t>(i));
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    ++bins[static_cast<size_t>(u * 10)];
  }
  double chi = 0;
  for (int c : bins) chi += (c - n / 10.0) * (c - n / 10.0) / (n / 10.0);
  EXPECT_LT(chi, 27.88);  // chi-square, 9 degrees of freedom, p = 0.001
}

}  // namespace
}  // namespace odyssey::actors
