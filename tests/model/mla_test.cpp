#include "model/mla.h"

#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/utils.h>

namespace odyssey::model {
namespace {

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0) return 0.0;
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

void report(const std::string& what, double value) {
  std::printf("  max |diff| %-56s %.3e\n", what.c_str(), value);
}

// Small sizes with every width distinct, and an attention tile (5) that divides nothing.
GatedMlaOptions small_options() {
  GatedMlaOptions o;
  o.hidden = 32;
  o.heads = 4;
  o.q_latent = 24;
  o.kv_latent = 16;
  o.head_dim = 8;
  o.shared_dim = 4;
  o.v_dim = 6;
  o.attention_block = 5;
  return o;
}

// An fp64 layer with non-trivial norm weights.
GatedMla fp64_layer(uint64_t seed) {
  torch::manual_seed(seed);
  GatedMla layer(small_options());
  layer->to(at::kDouble);
  torch::NoGradGuard no_grad;
  layer->q_norm->weight.uniform_(0.5, 1.5);
  layer->kv_norm->weight.uniform_(0.5, 1.5);
  return layer;
}

at::Tensor random_x(int64_t batch, int64_t tokens, uint64_t seed) {
  torch::manual_seed(seed);
  return at::randn({batch, tokens, small_options().hidden}, at::kDouble);
}

TEST(Mla, ParameterNamesAndShapesAreTheDocumentedOnes) {
  GatedMla layer(small_options());
  const GatedMlaOptions o = small_options();
  const std::map<std::string, std::vector<int64_t>> expected = {
      {"q_down_proj.weight", {o.q_latent, o.hidden}},
      {"q_norm.weight", {o.q_latent}},
      {"q_up_proj.weight", {o.heads * (o.head_dim + o.shared_dim), o.q_latent}},
      {"kv_down_proj.weight", {o.kv_latent + o.shared_dim, o.hidden}},
      {"kv_norm.weight", {o.kv_latent}},
      {"k_up_proj.weight", {o.heads * o.head_dim, o.kv_latent}},
      {"v_up_proj.weight", {o.heads * o.v_dim, o.kv_latent}},
      {"g_proj.weight", {o.heads * o.v_dim, o.hidden}},
      {"o_proj.weight", {o.hidden, o.heads * o.v_dim}},
  };
  std::map<std::string, std::vector<int64_t>> actual;
  for (const auto& p : layer->named_parameters()) {
    actual[p.key()] = p.value().sizes().vec();
  }
  EXPECT_EQ(actual, expected);
}

TEST(Mla, AbsorbedDecodeStepsMatchTheParallelForward) {
  GatedMla layer = fp64_layer(1);
  const at::Tensor x = random_x(2, 13, 2);
  const at::Tensor full = layer->forward(x);
  MlaCache cache = layer->initial_cache(/*batch=*/2);
  std::vector<at::Tensor> steps;
  for (int64_t t = 0; t < x.size(1); ++t) steps.push_back(layer->step(x.select(1, t), cache));
  const at::Tensor stepped = at::stack(steps, 1);
  EXPECT_EQ(cache.length, 13);
  const double diff = max_abs_diff(stepped, full);
  report("absorbed step x13 vs forward (fp64)", diff);
  EXPECT_LT(diff, 1e-12);
  EXPECT_GT(full.abs().max().item<double>(), 1e-3);
}

TEST(Mla, ChunkByChunkMatchesTheParallelForwardAndContinuesIntoSteps) {
  GatedMla layer = fp64_layer(3);
  const at::Tensor x = random_x(2, 17, 4);
  const at::Tensor full = layer->forward(x);
  MlaCache cache = layer->initial_cache(/*batch=*/2);
  std::vector<at::Tensor> parts;
  int64_t start = 0;
  for (int64_t len : {3, 1, 6, 4}) {
    parts.push_back(layer->forward_chunk(x.narrow(1, start, len), cache));
    start += len;
  }
  for (; start < x.size(1); ++start) {
    parts.push_back(layer->step(x.select(1, start), cache).unsqueeze(1));
  }
  const double diff = max_abs_diff(at::cat(parts, 1), full);
  report("chunks 3,1,6,4 then 3 steps vs forward (fp64)", diff);
  EXPECT_LT(diff, 1e-12);
}

// Without autograd (an actor's prefill) forward_chunk scores short chunks in the absorbed form
// against the cached latents (here Lkv + S + Lkv = 36 multiply-adds per pair and head against
// K + S + V = 18 plus the rebuilt keys' 14·16/T: absorbed for T <= 12) and rebuilds keys for
// long ones; both continue the same cache and agree with the parallel forward.
TEST(Mla, ChunksWithoutAutogradAgreeInTheAbsorbedAndTheRebuiltForm) {
  GatedMla layer = fp64_layer(7);
  const at::Tensor x = random_x(2, 70, 8);
  const at::Tensor full = layer->forward(x).detach();
  torch::NoGradGuard no_grad;
  MlaCache cache = layer->initial_cache(/*batch=*/2);
  std::vector<at::Tensor> parts;
  int64_t start = 0;
  for (int64_t len : {3, 30, 1, 12, 24}) {  // absorbed, rebuilt, absorbed, absorbed, rebuilt
    parts.push_back(layer->forward_chunk(x.narrow(1, start, len), cache));
    start += len;
  }
  EXPECT_EQ(cache.length, 70);
  const double diff = max_abs_diff(at::cat(parts, 1), full);
  report("no-grad chunks 3,30,1,12,24 vs forward (fp64)", diff);
  EXPECT_LT(diff, 1e-12);

  // The tiny model's widths (Lkv + S = K + S, Lkv = V): absorbed for every chunk, fp32.
  GatedMlaOptions o = small_options();
  o.kv_latent = 8;
  o.v_dim = 8;
  torch::manual_seed(9);
  GatedMla tiny(o);
  const at::Tensor xf = at::randn({1, 40, o.hidden});
  const at::Tensor tiny_full = tiny->forward(xf);
  MlaCache tiny_cache = tiny->initial_cache(/*batch=*/1);
  const at::Tensor chunked = at::cat({tiny->forward_chunk(xf.narrow(1, 0, 33), tiny_cache),
                                      tiny->forward_chunk(xf.narrow(1, 33, 7), tiny_cache)}, 1);
  const double tiny_diff = max_abs_diff(chunked, tiny_full);
  report("absorbed no-grad chunks 33,7 vs forward (fp32)", tiny_diff);
  EXPECT_LT(tiny_diff, 1e-5);
}

TEST(Mla, SharedKeySlotContributesToTheScores) {
  GatedMla layer = fp64_layer(5);
  const at::Tensor x = random_x(1, 9, 6);
  const at::Tensor with_slot = layer->forward(x);
  {
    torch::NoGradGuard no_grad;
    const GatedMlaOptions o = small_options();
    layer->kv_down_proj->weight.narrow(0, o.kv_latent, o.shared_dim).zero_();
  }
  const at::Tensor without_slot = layer->forward(x);
  const double change = max_abs_diff(with_slot, without_slot);
  std::printf("  zeroing k_shared changes the output by up to %.3e\n", change);
  EXPECT_GT(change, 1e-3);
  // With the slot zeroed, the step form (which scores the slot separately) still agrees.
  MlaCache cache = layer->initial_cache(1);
  std::vector<at::Tensor> steps;
  for (int64_t t = 0; t < x.size(1); ++t) steps.push_back(layer->step(x.select(1, t), cache));
  EXPECT_LT(max_abs_diff(at::stack(steps, 1), without_slot), 1e-12);
}

TEST(Mla, OutputOfAPrefixDoesNotDependOnLaterTokens) {
  GatedMla layer = fp64_layer(7);
  const at::Tensor x = random_x(2, 15, 8);
  const at::Tensor full = layer->forward(x);
  for (int64_t t : {1, 6, 11}) {
    const double diff = max_abs_diff(layer->forward(x.narrow(1, 0, t)), full.narrow(1, 0, t));
    report("prefix of " + std::to_string(t) + " tokens vs full forward", diff);
    EXPECT_LT(diff, 1e-12);
  }
}

TEST(Mla, ForwardChunkGradientsForItsOwnTokensMatchTheParallelForward) {
  GatedMla layer = fp64_layer(9);
  const at::Tensor x = random_x(1, 12, 10);
  const int64_t past = 7;
  const at::Tensor weight = at::randn({1, 12 - past, small_options().hidden}, at::kDouble);

  const at::Tensor x_full = x.clone().requires_grad_(true);
  const at::Tensor loss_full = (layer->forward(x_full).narrow(1, past, 12 - past) * weight).sum();
  const at::Tensor grad_full = torch::autograd::grad({loss_full}, {x_full})[0];

  MlaCache cache = layer->initial_cache(1);
  {
    torch::NoGradGuard no_grad;
    layer->forward_chunk(x.narrow(1, 0, past), cache);
  }
  const at::Tensor x_chunk = x.narrow(1, past, 12 - past).clone().requires_grad_(true);
  const at::Tensor loss_chunk = (layer->forward_chunk(x_chunk, cache) * weight).sum();
  const at::Tensor grad_chunk = torch::autograd::grad({loss_chunk}, {x_chunk})[0];

  const double diff = max_abs_diff(grad_chunk, grad_full.narrow(1, past, 12 - past));
  report("d loss / d chunk tokens: forward_chunk vs forward", diff);
  EXPECT_LT(diff, 1e-12);
  // The cached tokens are constants for forward_chunk; the full forward sees through them.
  EXPECT_GT(grad_full.narrow(1, 0, past).abs().max().item<double>(), 0.0);
}

// On the GPU a bf16 layer's chunk that continues the cache (the learner's chunked recompute, an
// actor's long prefill) takes LibTorch's memory-efficient kernel with its causal mask aligned to the
// cache's end (model/attention.h). Chunk by chunk it must match the parallel forward, and the
// gradients for a chunk's own tokens those of the parallel forward, to bf16 accuracy; the small
// config's attention widths (96-wide keys, 64-wide values).
TEST(Mla, GpuChunksContinuingTheCacheTakeTheFusedKernelAndMatchTheParallelForward) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  GatedMlaOptions o;
  o.hidden = 256;
  o.heads = 4;
  o.q_latent = 96;
  o.kv_latent = 64;
  o.head_dim = 64;
  o.shared_dim = 32;
  o.v_dim = 64;
  torch::manual_seed(21);
  GatedMla layer(o);
  layer->to(at::kCUDA, at::kBFloat16);
  const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const int64_t T = 700, past = 300;
  const at::Tensor x = at::randn({2, T, o.hidden}, opts);
  {
    const at::Tensor q = at::randn({2, o.heads, T - past, o.head_dim + o.shared_dim}, opts);
    const at::Tensor k = at::randn({2, o.heads, T, o.head_dim + o.shared_dim}, opts);
    const at::Tensor v = at::randn({2, o.heads, T, o.v_dim}, opts);
    ASSERT_TRUE(fused_attention_applies(q, k, v, past)) << "the chunk continuing the cache is fused";
  }
  const at::Tensor weight = at::randn({2, T - past, o.hidden}, opts);
  const at::Tensor x_full = x.clone().requires_grad_(true);
  const at::Tensor full = layer->forward(x_full);
  const at::Tensor grad_full =
      torch::autograd::grad({(full.narrow(1, past, T - past) * weight).sum()}, {x_full})[0];

  MlaCache cache = layer->initial_cache(2);
  const at::Tensor first = layer->forward_chunk(x.narrow(1, 0, past), cache);  // autograd on: rebuilt keys
  const at::Tensor x_chunk = x.narrow(1, past, T - past).clone().requires_grad_(true);
  const at::Tensor second = layer->forward_chunk(x_chunk, cache);
  const at::Tensor grad_chunk = torch::autograd::grad({(second * weight).sum()}, {x_chunk})[0];

  const double scale = full.abs().max().item<double>();
  const double fwd = max_abs_diff(at::cat({first, second}, 1), full) / scale;
  const double bwd = max_abs_diff(grad_chunk, grad_full.narrow(1, past, T - past)) /
                     grad_full.abs().max().item<double>();
  report("GPU bf16 chunks 300 + 400 vs forward, relative", fwd);
  report("GPU bf16 d loss / d chunk tokens vs forward, relative", bwd);
  EXPECT_LT(fwd, 2e-2);
  EXPECT_LT(bwd, 3e-2);
}

TEST(Mla, ForwardIsDifferentiableInEveryParameter) {
  GatedMla layer = fp64_layer(11);
  layer->forward(random_x(2, 6, 12)).pow(2).sum().backward();
  for (const auto& p : layer->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_GT(p.value().grad().abs().max().item<double>(), 0.0) << p.key();
  }
}

TEST(Mla, Fp32LayerKeepsItsDtypeAndItsFormsAgree) {
  torch::manual_seed(13);
  GatedMla layer(small_options());
  const at::Tensor x = at::randn({1, 8, small_options().hidden});
  const at::Tensor full = layer->forward(x);
  EXPECT_EQ(full.scalar_type(), at::kFloat);
  MlaCache cache = layer->initial_cache(1);
  EXPECT_EQ(cache.latent.scalar_type(), at::kFloat);
  std::vector<at::Tensor> steps;
  for (int64_t t = 0; t < 8; ++t) steps.push_back(layer->step(x.select(1, t), cache));
  const double diff = max_abs_diff(at::stack(steps, 1), full);
  report("absorbed step vs forward (fp32)", diff);
  EXPECT_LT(diff, 1e-5);
}

TEST(Mla, CacheSaveAndRestoreContinuesBitExactly) {
  GatedMla layer = fp64_layer(15);
  const at::Tensor x = random_x(2, 10, 16);
  MlaCache cache = layer->initial_cache(2);
  layer->forward_chunk(x.narrow(1, 0, 6), cache);
  const std::map<std::string, at::Tensor> saved = cache.to_tensors();
  ASSERT_EQ(saved.size(), 1u);
  EXPECT_EQ(saved.at("latent").sizes(), (std::vector<int64_t>{2, 6, 20}));

  Result<MlaCache> restored = MlaCache::from_tensors(saved);
  ASSERT_TRUE(restored.ok()) << restored.status().to_string();
  EXPECT_EQ(restored->length, 6);
  EXPECT_TRUE(at::equal(restored->tokens(), cache.tokens()));
  for (int64_t t = 6; t < 10; ++t) {
    const at::Tensor a = layer->step(x.select(1, t), cache);
    const at::Tensor b = layer->step(x.select(1, t), *restored);
    EXPECT_TRUE(at::equal(a, b)) << "token " << t;
  }
  // The snapshot is a copy: the steps above did not change it.
  EXPECT_EQ(saved.at("latent").size(1), 6);
  EXPECT_TRUE(at::equal(saved.at("latent"), cache.tokens().narrow(1, 0, 6)));
}

TEST(Mla, CacheRestoreRejectsMalformedMaps) {
  const at::Tensor good = at::zeros({1, 3, 20}, at::kDouble);
  EXPECT_EQ(MlaCache::from_tensors({}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(MlaCache::from_tensors({{"latent", good}, {"extra", good}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(MlaCache::from_tensors({{"latent", at::zeros({3, 20})}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(MlaCache::from_tensors({{"latent", at::zeros({1, 3, 20}, at::kLong)}})
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  // A cache of the wrong width is refused by the layer that would use it.
  GatedMla layer = fp64_layer(17);
  Result<MlaCache> wrong = MlaCache::from_tensors({{"latent", at::zeros({1, 3, 19}, at::kDouble)}});
  ASSERT_TRUE(wrong.ok());
  EXPECT_THROW(layer->step(random_x(1, 1, 18).select(1, 0), *wrong), c10::Error);
}

TEST(Mla, CacheGrowsInBlocksWithoutLosingTokens) {
  GatedMla layer = fp64_layer(19);
  MlaCache cache = layer->initial_cache(/*batch=*/1);
  cache.capacity_block = 4;
  const at::Tensor x = random_x(1, 23, 20);
  std::vector<int64_t> capacities;
  for (int64_t t = 0; t < 23; ++t) {
    layer->step(x.select(1, t), cache);
    if (capacities.empty() || capacities.back() != cache.capacity()) {
      capacities.push_back(cache.capacity());
    }
    EXPECT_EQ(cache.capacity() % 4, 0);
    EXPECT_GE(cache.capacity(), cache.length);
  }
  // Geometric growth: a handful of re-allocations for 23 tokens, not one per block.
  EXPECT_LE(capacities.size(), 5u);
  MlaCache fresh = layer->initial_cache(1);
  layer->forward_chunk(x, fresh);
  // Same rows either way (to rounding: a batched GEMM and row-at-a-time products may differ
  // in the last bit, depending on the BLAS behind LibTorch).
  ASSERT_EQ(fresh.tokens().sizes(), cache.tokens().sizes());
  EXPECT_TRUE(at::allclose(fresh.tokens(), cache.tokens(), /*rtol=*/1e-12, /*atol=*/1e-12));

  MlaCache reserved = layer->initial_cache(1, /*reserve_tokens=*/3000);
  EXPECT_EQ(reserved.capacity(), 3072);  // whole blocks of the default 1024
  EXPECT_EQ(reserved.length, 0);
}

}  // namespace
}  // namespace odyssey::model
