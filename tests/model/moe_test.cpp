#include "model/moe.h"

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include "model/balancing.h"
#include "model/ffn.h"

namespace odyssey::model {
namespace {

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

MoeOptions small_options() {
  MoeOptions options;
  options.hidden = 12;
  options.latent = 8;
  options.expert_ffn = 10;
  options.num_experts = 6;
  options.top_k = 2;
  options.num_shared = 2;
  options.shared_ffn = 7;
  return options;
}

// A small fp64 MoE with every weight random (norm gain and balancing bias too).
Moe random_moe(const MoeOptions& options, uint64_t seed) {
  Moe moe(options);
  moe->to(at::kDouble);
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  c10::NoGradGuard no_grad;
  for (auto& parameter : moe->parameters()) {
    parameter.copy_(at::randn(parameter.sizes(), generator, at::kDouble) * 0.5);
  }
  moe->set_expert_bias(at::randn({options.num_experts}, generator, at::kDouble) * 0.1);
  return moe;
}

torch::Tensor random_tokens(std::vector<int64_t> shape, uint64_t seed) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, generator, at::kDouble);
}

// The layer computed one token at a time, straight from MODEL.md, with the selection found by
// sorting s + b and p taken from the unbiased s.
torch::Tensor naive_moe(MoeImpl& moe, const torch::Tensor& x) {
  const MoeOptions& o = moe.options();
  const torch::Tensor tokens = x.reshape({-1, o.hidden});
  const torch::Tensor bias = moe.router->bias.to(at::kDouble);
  std::vector<torch::Tensor> rows;
  for (int64_t t = 0; t < tokens.size(0); ++t) {
    const torch::Tensor xt = tokens[t];
    const torch::Tensor s = at::sigmoid(at::mv(moe.router->weight, xt));
    const torch::Tensor biased = s + bias;
    std::vector<int64_t> order(static_cast<size_t>(o.num_experts));
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(),
              [&](int64_t a, int64_t b) { return biased[a].item<double>() > biased[b].item<double>(); });
    double chosen_sum = 0;
    for (int64_t i = 0; i < o.top_k; ++i) chosen_sum += s[order[i]].item<double>();
    const torch::Tensor z = at::mv(moe.latent_down->weight, xt);
    torch::Tensor u = at::zeros({o.latent}, at::kDouble);
    for (int64_t i = 0; i < o.top_k; ++i) {
      const int64_t e = order[i];
      const torch::Tensor h = situ_glu(at::mv(moe.experts->gate_proj[e], z), at::mv(moe.experts->up_proj[e], z));
      u = u + at::mv(moe.experts->down_proj[e], h) * (s[e].item<double>() / chosen_sum);
    }
    const torch::Tensor normed = u / at::sqrt(u.pow(2).mean() + o.eps) * moe.latent_norm->weight;
    torch::Tensor y = at::mv(moe.latent_up->weight, normed);
    for (int64_t j = 0; j < o.num_shared; ++j) {
      const torch::Tensor h = situ_glu(at::mv(moe.shared_experts->gate_proj[j], xt),
                                       at::mv(moe.shared_experts->up_proj[j], xt));
      y = y + at::mv(moe.shared_experts->down_proj[j], h);
    }
    rows.push_back(y);
  }
  return at::stack(rows).reshape(x.sizes());
}

std::vector<std::set<int64_t>> selected_sets(const torch::Tensor& selected) {
  std::vector<std::set<int64_t>> sets;
  const auto rows = selected.accessor<int64_t, 2>();
  for (int64_t t = 0; t < selected.size(0); ++t) {
    std::set<int64_t> set;
    for (int64_t i = 0; i < selected.size(1); ++i) set.insert(rows[t][i]);
    sets.push_back(set);
  }
  return sets;
}

TEST(SituGlu, EqualsSwigluToFirstOrderNearZero) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(3);
  const torch::Tensor g = at::randn({1000}, generator, at::kDouble) * 1e-3;
  const torch::Tensor u = at::randn({1000}, generator, at::kDouble) * 1e-3;
  const torch::Tensor swiglu = g * at::sigmoid(g) * u;
  const torch::Tensor situ = situ_glu(g, u);
  // tanh(x/β)·β = x − x³/(3β²) + …: relative difference of order (1e-3)² / (3·16).
  const double relative = ((situ - swiglu).abs() / swiglu.abs()).max().item<double>();
  std::printf("max relative difference to SwiGLU at |x| ~ 1e-3: %.3g\n", relative);
  EXPECT_LT(relative, 1e-6);
}

TEST(SituGlu, StaysWithinOneHundredForAnyInput) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(4);
  const torch::Tensor g = at::randn({10000}, generator, at::kDouble) * 1e4;
  const torch::Tensor u = at::randn({10000}, generator, at::kDouble) * 1e4;
  EXPECT_LE(situ_glu(g, u).abs().max().item<double>(), 100.0);
  // The bound is reached: large positive gate (σ → 1, cap 4) and large up (cap 25).
  const torch::Tensor big = at::full({1}, 1e6, at::kDouble);
  EXPECT_NEAR(situ_glu(big, big).item<double>(), 100.0, 1e-9);
  EXPECT_NEAR(situ_glu(big, -big).item<double>(), -100.0, 1e-9);
  // The sigmoid takes the uncapped gate: a very negative gate shuts the unit off.
  EXPECT_NEAR(situ_glu(-big, big).item<double>(), 0.0, 1e-9);
}

TEST(SituGlu, DenseFfnIsDownOfSituGluOfGateAndUp) {
  DenseFfn ffn(DenseFfnOptions{/*hidden=*/6, /*ffn=*/9});
  ffn->to(at::kDouble);
  const torch::Tensor x = random_tokens({3, 6}, 5);
  const torch::Tensor expected = at::matmul(
      situ_glu(at::matmul(x, ffn->gate_proj->weight.t()), at::matmul(x, ffn->up_proj->weight.t())),
      ffn->down_proj->weight.t());
  EXPECT_LT(max_abs_diff(ffn(x), expected), 1e-14);
  std::vector<std::string> names;
  for (const auto& item : ffn->named_parameters()) names.push_back(item.key());
  EXPECT_EQ(names, (std::vector<std::string>{"gate_proj.weight", "up_proj.weight", "down_proj.weight"}));
}

TEST(MoeLayer, ForwardEqualsANaivePerTokenReferenceInFp64) {
  const MoeOptions options = small_options();
  Moe moe = random_moe(options, 11);
  const torch::Tensor x = random_tokens({3, 5, options.hidden}, 12);
  const MoeOutput out = moe(x);
  ASSERT_EQ(out.y.sizes(), x.sizes());
  ASSERT_EQ(out.routing.selected.sizes(), (std::vector<int64_t>{15, options.top_k}));
  const double diff = max_abs_diff(out.y, naive_moe(*moe, x));
  std::printf("max |MoE − per-token reference| (fp64): %.3g\n", diff);
  EXPECT_LT(diff, 1e-12);
}

TEST(MoeLayer, ForwardOnTheCpuIsTheReferencePath) {
  // The kernels (GPU build, CUDA tensors) never take CPU inputs: forward and route are exactly
  // forward_reference and route_reference there.
  const MoeOptions options = small_options();
  Moe moe = random_moe(options, 15);
  const torch::Tensor x = random_tokens({4, options.hidden}, 16);
  EXPECT_FALSE(moe->uses_kernels(x));
  EXPECT_FALSE(moe->uses_kernels(x.to(at::kFloat)));
  EXPECT_TRUE(at::equal(moe(x).y, moe->forward_reference(x).y));
  EXPECT_TRUE(at::equal(moe->route(x).weights, moe->route_reference(x).weights));
}

TEST(MoeLayer, HandlesExpertsWithoutTokensAndNoSharedExperts) {
  MoeOptions options = small_options();
  options.num_experts = 16;
  options.top_k = 3;
  options.num_shared = 0;
  Moe moe = random_moe(options, 13);
  const torch::Tensor x = random_tokens({2, options.hidden}, 14);  // 6 copies for 16 experts
  const MoeOutput out = moe(x);
  EXPECT_GT(balance_stats(out.routing.selected, options.num_experts).dead_experts, 0);
  EXPECT_LT(max_abs_diff(out.y, naive_moe(*moe, x)), 1e-12);
}

TEST(MoeLayer, BiasChangesSelectionButNeverMixingWeights) {
  const MoeOptions options = small_options();
  Moe moe = random_moe(options, 21);
  const torch::Tensor x = random_tokens({64, options.hidden}, 22);
  moe->set_expert_bias(at::zeros({options.num_experts}));
  const MoeRouting unbiased = moe->route(x);
  moe->set_expert_bias(at::linspace(-0.3, 0.3, options.num_experts));
  const MoeOutput biased = moe(x);

  // p always comes from the unbiased scores of the selected experts.
  const torch::Tensor chosen = unbiased.scores.gather(1, biased.routing.selected);
  EXPECT_LT(max_abs_diff(biased.routing.weights, chosen / chosen.sum(-1, true)), 1e-15);
  EXPECT_LT(max_abs_diff(biased.routing.scores, unbiased.scores), 1e-15);

  // Same selected set ⇒ identical p (compared expert by expert).
  const auto sets_before = selected_sets(unbiased.selected);
  const auto sets_after = selected_sets(biased.routing.selected);
  int64_t same = 0;
  int64_t changed = 0;
  for (size_t t = 0; t < sets_before.size(); ++t) {
    if (sets_before[t] != sets_after[t]) {
      ++changed;
      continue;
    }
    ++same;
    const torch::Tensor before = at::zeros({options.num_experts}, at::kDouble)
                                     .scatter(0, unbiased.selected[t], unbiased.weights[t]);
    const torch::Tensor after = at::zeros({options.num_experts}, at::kDouble)
                                    .scatter(0, biased.routing.selected[t], biased.routing.weights[t]);
    EXPECT_LT(max_abs_diff(before, after), 1e-15) << "token " << t;
  }
  std::printf("tokens whose selection the bias changed: %ld of %ld\n", static_cast<long>(changed),
              static_cast<long>(changed + same));
  EXPECT_GT(changed, 0);
  EXPECT_GT(same, 0);

  // The output with the bias is the reference computed with p from the unbiased scores.
  EXPECT_LT(max_abs_diff(biased.y, naive_moe(*moe, x)), 1e-12);
}

TEST(MoeLayer, GradientsReachRouterExpertsAndLatentProjections) {
  const MoeOptions options = small_options();
  Moe moe = random_moe(options, 31);
  const torch::Tensor x = random_tokens({16, options.hidden}, 32).requires_grad_(true);
  const MoeOutput out = moe(x);
  out.y.pow(2).sum().backward();

  for (const auto& item : moe->named_parameters()) {
    ASSERT_TRUE(item.value().grad().defined()) << item.key();
    EXPECT_GT(item.value().grad().abs().sum().item<double>(), 0.0) << item.key();
    EXPECT_TRUE(item.value().grad().isfinite().all().item<bool>()) << item.key();
  }
  EXPECT_FALSE(moe->router->bias.requires_grad());
  EXPECT_GT(x.grad().abs().sum().item<double>(), 0.0);

  // The router's gradient (it learns only through p) matches central differences; a small step
  // keeps the selection fixed.
  const torch::Tensor analytic = moe->router->weight.grad().clone();
  c10::NoGradGuard no_grad;
  const double h = 1e-6;
  double worst = 0;
  for (int64_t e = 0; e < options.num_experts; ++e) {
    for (int64_t c : {0, 5, 11}) {
      torch::Tensor w = moe->router->weight;
      const double original = w[e][c].item<double>();
      w[e][c].fill_(original + h);
      const double plus = moe(x).y.pow(2).sum().item<double>();
      w[e][c].fill_(original - h);
      const double minus = moe(x).y.pow(2).sum().item<double>();
      w[e][c].fill_(original);
      worst = std::max(worst, std::abs((plus - minus) / (2 * h) - analytic[e][c].item<double>()));
    }
  }
  std::printf("router gradient vs central differences: max difference %.3g\n", worst);
  EXPECT_LT(worst, 1e-5);
}

TEST(MoeLayer, PermutationRoundTripRestoresEveryTokenCopy) {
  constexpr int64_t kTokens = 50, kTopK = 3, kExperts = 7;
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(41);
  const torch::Tensor scores = at::rand({kTokens, kExperts}, generator, at::kDouble);
  const torch::Tensor selected = select_experts(scores, at::zeros({kExperts}, at::kDouble), kTopK);
  const TokenPermutation permutation = permute_tokens(selected, kExperts);

  EXPECT_TRUE(at::equal(permutation.tokens_per_expert, expert_load(selected, kExperts)));
  // Rows are grouped by expert, and each expert's tokens keep their order.
  const torch::Tensor expert_of_row = selected.reshape({-1}).index_select(0, permutation.source);
  const torch::Tensor key = expert_of_row * kTokens + permutation.token;
  EXPECT_TRUE(at::equal(key, std::get<0>(at::sort(key))));
  EXPECT_TRUE(at::equal(std::get<0>(at::sort(permutation.source)), at::arange(kTokens * kTopK)));

  const torch::Tensor tokens = at::randn({kTokens, 4, 2}, generator, at::kDouble);
  const torch::Tensor copies = permute(tokens, permutation);
  for (int64_t r = 0; r < copies.size(0); ++r) {
    ASSERT_TRUE(at::equal(copies[r], tokens[permutation.token[r].item<int64_t>()]));
  }
  const torch::Tensor weights = at::rand({kTokens, kTopK}, generator, at::kDouble);
  const torch::Tensor back = unpermute(copies, permutation, weights);
  EXPECT_LT(max_abs_diff(back, tokens * weights.sum(1).reshape({kTokens, 1, 1})), 1e-14);
}

TEST(MoeLayer, ParameterAndBufferNamesMatchTheCheckpointLayout) {
  const MoeOptions options = small_options();
  Moe moe(options);
  std::vector<std::pair<std::string, std::vector<int64_t>>> names;
  for (const auto& item : moe->named_parameters()) names.emplace_back(item.key(), item.value().sizes().vec());
  const int64_t E = options.num_experts, d = options.hidden, L = options.latent, F = options.expert_ffn,
                S = options.num_shared, Fs = options.shared_ffn;
  const std::vector<std::pair<std::string, std::vector<int64_t>>> expected = {
      {"router.weight", {E, d}},
      {"latent_down.weight", {L, d}},
      {"latent_up.weight", {d, L}},
      {"latent_norm.weight", {L}},
      {"experts.gate_proj", {E, F, L}},
      {"experts.up_proj", {E, F, L}},
      {"experts.down_proj", {E, L, F}},
      {"shared_experts.gate_proj", {S, Fs, d}},
      {"shared_experts.up_proj", {S, Fs, d}},
      {"shared_experts.down_proj", {S, d, Fs}},
  };
  EXPECT_EQ(names, expected);
  std::vector<std::string> buffers;
  for (const auto& item : moe->named_buffers()) buffers.push_back(item.key());
  EXPECT_EQ(buffers, std::vector<std::string>{"router.bias"});
  EXPECT_EQ(moe->router->bias.scalar_type(), at::kFloat);
}

}  // namespace
}  // namespace odyssey::model
