#include "model/policy.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include "model/config.h"

namespace odyssey::model {
namespace {

using torch::indexing::Slice;

ModelConfig load_tiny() {
  auto config = load_model_config({std::string(ODYSSEY_SOURCE_DIR) + "/configs/model/tiny.toml"});
  EXPECT_TRUE(config.ok()) << config.status().message();
  return config.ok() ? *config : ModelConfig{};
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// The tiny policy in fp64, with the mix vectors, norm gains and balancing biases moved away
// from their initial values (zeros, ones, zeros) so that every part of the math is exercised.
Policy tiny_policy_fp64(const ModelConfig& config, uint64_t seed) {
  at::manual_seed(static_cast<int64_t>(seed));
  Policy policy(config);
  policy->to(at::kDouble);
  c10::NoGradGuard no_grad;
  for (auto& item : policy->named_parameters()) {
    const std::string& name = item.key();
    at::Tensor p = item.value();
    const bool is_mix = name.size() >= 3 && name.compare(name.size() - 3, 3, "mix") == 0;
    const bool is_norm = name.find("norm.weight") != std::string::npos;
    if (is_mix) p.copy_(at::randn(p.sizes(), p.options()) * 0.5);
    if (is_norm) p.add_(at::randn(p.sizes(), p.options()) * 0.1);
  }
  for (int64_t layer : policy->moe_layers()) {
    policy->set_expert_bias(layer, at::randn({config.moe.routed_experts}, at::kDouble) * 0.02);
  }
  return policy;
}

// Sorted expert ids per row, so that selections compare regardless of order within a row.
at::Tensor sorted_rows(const at::Tensor& selected) { return std::get<0>(selected.sort(-1)); }

TEST(Policy, NamedParametersMatchModelTensors) {
  const ModelConfig config = load_tiny();
  Policy policy(config);
  std::map<std::string, std::vector<int64_t>> expected_params, expected_buffers, got_params, got_buffers;
  for (const ModelTensor& t : model_tensors(config)) {
    (t.buffer ? expected_buffers : expected_params)[t.name] = t.shape;
  }
  for (const auto& item : policy->named_parameters()) got_params[item.key()] = item.value().sizes().vec();
  for (const auto& item : policy->named_buffers()) got_buffers[item.key()] = item.value().sizes().vec();
  EXPECT_EQ(policy->named_parameters().size(), expected_params.size());
  for (const auto& [name, shape] : expected_params) {
    auto it = got_params.find(name);
    if (it == got_params.end()) {
      ADD_FAILURE() << "missing parameter " << name;
    } else {
      EXPECT_EQ(it->second, shape) << name;
    }
  }
  for (const auto& [name, shape] : got_params) {
    EXPECT_TRUE(expected_params.count(name)) << "extra parameter " << name;
  }
  EXPECT_EQ(got_buffers, expected_buffers);
}

TEST(Policy, ParameterCountMatchesConfigCount) {
  const ModelConfig config = load_tiny();
  Policy policy(config);
  int64_t total = 0;
  for (const auto& p : policy->parameters()) total += p.numel();
  const ParameterCounts counts = count_parameters(config);
  std::printf("tiny policy: %lld parameters (count_parameters: %lld)\n", static_cast<long long>(total),
              static_cast<long long>(counts.total_params));
  EXPECT_EQ(total, counts.total_params);
  int64_t buffers = 0;
  for (const auto& b : policy->buffers()) buffers += b.numel();
  EXPECT_EQ(buffers, counts.buffer_numel);
}

TEST(Policy, ForwardChunkAndStepAgreeWithForwardFp64) {
  const ModelConfig config = load_tiny();
  Policy policy = tiny_policy_fp64(config, 7);
  const int64_t B = 2, T = 37, d = config.hidden_size, V = config.vocab_size;
  const at::Tensor tokens = at::randint(V, {B, T}, at::kLong);

  // Four image patches in sequence 0 at positions 5..8, from the vision encoder.
  at::Tensor image_mask = at::zeros({B, T}, at::kBool);
  image_mask.index_put_({0, Slice(5, 9)}, true);
  at::Tensor image_full = at::zeros({B, T, d}, at::kDouble);
  {
    c10::NoGradGuard no_grad;
    const at::Tensor images = at::rand({1, config.vision.channels, 16, 16}, at::kDouble);
    const at::Tensor patches = policy->vision->encode(images);  // [1, 4, d]
    ASSERT_EQ(patches.size(1), 4);
    image_full.index_put_({0, Slice(5, 9)}, patches[0]);
  }
  auto rows = [&](const at::Tensor& mask, const at::Tensor& full) { return full.index({mask}); };

  at::Tensor full;
  std::vector<at::Tensor> full_selected;
  {
    c10::NoGradGuard no_grad;
    full = policy->forward(tokens, rows(image_mask, image_full), image_mask);
    full_selected = policy->last_selected_experts();
  }
  ASSERT_EQ(full.sizes(), (std::vector<int64_t>{B, T, V}));
  ASSERT_EQ(full_selected.size(), policy->moe_layers().size());

  // Chunks of 8 (8, 8, 8, 8, 5): not a divisor of T, nor of the KDA chunk of 16.
  std::vector<at::Tensor> chunk_logits;
  {
    c10::NoGradGuard no_grad;
    PolicyState state = policy->initial_state(B);
    for (int64_t start = 0; start < T; start += 8) {
      const int64_t end = std::min(T, start + 8);
      const at::Tensor m = image_mask.index({Slice(), Slice(start, end)}).contiguous();
      const at::Tensor f = image_full.index({Slice(), Slice(start, end)});
      chunk_logits.push_back(policy->forward_chunk(tokens.index({Slice(), Slice(start, end)}), state, rows(m, f), m));
    }
    EXPECT_EQ(state.tokens, T);
  }
  const at::Tensor chunked = at::cat(chunk_logits, 1);

  std::vector<at::Tensor> step_logits;
  std::vector<std::vector<at::Tensor>> step_selected(policy->moe_layers().size());
  PolicyState state = policy->initial_state(B);
  for (int64_t t = 0; t < T; ++t) {
    const at::Tensor m = image_mask.index({Slice(), t}).contiguous();
    const at::Tensor f = image_full.index({Slice(), t});
    step_logits.push_back(policy->step(tokens.index({Slice(), t}), state, rows(m, f), m));
    const auto selected = policy->last_selected_experts();
    for (size_t j = 0; j < selected.size(); ++j) step_selected[j].push_back(selected[j]);  // [B, k]
  }
  const at::Tensor stepped = at::stack(step_logits, 1);

  const double chunk_diff = max_abs_diff(full, chunked);
  const double step_diff = max_abs_diff(full, stepped);
  std::printf("policy fp64 B=%lld T=%lld: max |forward - forward_chunk(8)| = %.3g, max |forward - step| = %.3g "
              "(logit scale %.3g)\n",
              static_cast<long long>(B), static_cast<long long>(T), chunk_diff, step_diff,
              full.abs().max().item<double>());
  EXPECT_LT(chunk_diff, 1e-9);
  EXPECT_LT(step_diff, 1e-9);

  // The recorded routing: the experts every token selected agree between forward and step.
  const int64_t k = config.moe.top_k;
  for (size_t j = 0; j < full_selected.size(); ++j) {
    ASSERT_EQ(full_selected[j].sizes(), (std::vector<int64_t>{B * T, k}));
    const at::Tensor from_steps = at::stack(step_selected[j], 1).reshape({B * T, k});
    EXPECT_TRUE(at::equal(sorted_rows(full_selected[j]), sorted_rows(from_steps)))
        << "layer " << policy->moe_layers()[j];
  }
}

TEST(Policy, ImageEmbeddingsReplaceTokenEmbeddings) {
  const ModelConfig config = load_tiny();
  Policy policy = tiny_policy_fp64(config, 3);
  const at::Tensor tokens = at::randint(config.vocab_size, {1, 6}, at::kLong);
  at::Tensor mask = at::zeros({1, 6}, at::kBool);
  mask.index_put_({0, Slice(2, 4)}, true);
  const at::Tensor images = at::randn({2, config.hidden_size}, at::kDouble);
  const at::Tensor x = policy->embed_tokens(tokens, images, mask);
  const at::Tensor plain = policy->embed_tokens(tokens);
  EXPECT_TRUE(at::equal(x.index({0, Slice(2, 4)}), images));
  EXPECT_TRUE(at::equal(x.index({0, Slice(0, 2)}), plain.index({0, Slice(0, 2)})));
  EXPECT_TRUE(at::equal(x.index({0, Slice(4, 6)}), plain.index({0, Slice(4, 6)})));
  EXPECT_ANY_THROW(policy->embed_tokens(tokens, images.index({Slice(0, 1)}), mask));
}

TEST(Policy, GradientsReachEveryParameter) {
  const ModelConfig config = load_tiny();
  Policy policy = tiny_policy_fp64(config, 11);
  const int64_t B = 2, T = 20;
  const at::Tensor tokens = at::randint(config.vocab_size, {B, T + 1}, at::kLong);
  const at::Tensor inputs = tokens.index({Slice(), Slice(0, T)});
  const at::Tensor targets = tokens.index({Slice(), Slice(1, T + 1)});
  // An image so the vision encoder is on the path too.
  const at::Tensor images = at::rand({1, config.vision.channels, 16, 16}, at::kDouble);
  const at::Tensor patches = policy->vision->encode(images).reshape({-1, config.hidden_size});
  at::Tensor mask = at::zeros({B, T}, at::kBool);
  mask.index_put_({1, Slice(3, 3 + patches.size(0))}, true);
  const at::Tensor logits = policy->forward(inputs, patches, mask);
  const at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, config.vocab_size}), targets.reshape({-1}));
  loss.backward();
  int64_t checked = 0;
  for (const auto& item : policy->named_parameters()) {
    // Layer 0's attention sees a single source (the embedding): its mix is the identity.
    if (item.key() == "layers.0.attn_mix") continue;
    const at::Tensor& grad = item.value().grad();
    ASSERT_TRUE(grad.defined()) << "no gradient reaches " << item.key();
    EXPECT_TRUE(at::isfinite(grad).all().item<bool>()) << item.key();
    EXPECT_GT(grad.abs().sum().item<double>(), 0.0) << "zero gradient at " << item.key();
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int64_t>(policy->named_parameters().size()) - 1);
}

TEST(Policy, SetExpertBiasChecksLayers) {
  const ModelConfig config = load_tiny();
  Policy policy(config);
  ASSERT_EQ(policy->moe_layers(), (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7}));
  const at::Tensor bias = at::arange(config.moe.routed_experts, at::kFloat) * 0.01;
  policy->set_expert_bias(2, bias);
  EXPECT_TRUE(at::allclose(policy->layer(2)->moe->router->bias.to(at::kFloat), bias));
  EXPECT_ANY_THROW(policy->set_expert_bias(0, bias));  // dense layer
  EXPECT_ANY_THROW(policy->set_expert_bias(8, bias));  // out of range
  EXPECT_ANY_THROW(policy->set_expert_biases({bias}));
}

}  // namespace
}  // namespace odyssey::model
