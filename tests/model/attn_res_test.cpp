#include "model/attn_res.h"

#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "model/config.h"
#include "model/rms_norm.h"

namespace odyssey::model {
namespace {

ModelConfig load_shipped(const std::string& name) {
  auto config = load_model_config({std::string(ODYSSEY_SOURCE_DIR) + "/configs/model/" + name + ".toml"});
  EXPECT_TRUE(config.ok()) << config.status().message();
  return config.ok() ? *config : ModelConfig{};
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

at::TensorOptions f64() { return at::TensorOptions().dtype(at::kDouble); }

// The mixture token by token with scalar loops: the definition, written out.
TEST(AttnResMix, EqualsHandComputedSoftmaxMixtureFp64) {
  at::manual_seed(1);
  const int64_t d = 5;
  const double eps = 1e-5;
  std::vector<at::Tensor> sources;
  for (int s = 0; s < 3; ++s) sources.push_back(at::randn({2, 4, d}, f64()) * (s + 1));
  const at::Tensor w = at::randn({d}, f64());
  const at::Tensor h = attn_res_mix(sources, w, eps);
  ASSERT_EQ(h.sizes(), sources[0].sizes());
  ASSERT_EQ(h.scalar_type(), at::kDouble);
  const at::Tensor weights = attn_res_weights(sources, w, eps);
  ASSERT_EQ(weights.sizes(), (std::vector<int64_t>{3, 2, 4}));

  const auto wa = w.accessor<double, 1>();
  const auto ha = h.accessor<double, 3>();
  double worst = 0;
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t t = 0; t < 4; ++t) {
      std::vector<double> logits;
      for (const at::Tensor& source : sources) {
        const auto sa = source.accessor<double, 3>();
        double squares = 0;
        for (int64_t i = 0; i < d; ++i) squares += sa[b][t][i] * sa[b][t][i];
        const double inv_rms = 1.0 / std::sqrt(squares / d + eps);
        double dot = 0;
        for (int64_t i = 0; i < d; ++i) dot += sa[b][t][i] * inv_rms * wa[i];
        logits.push_back(dot);
      }
      double max_logit = logits[0];
      for (double l : logits) max_logit = std::max(max_logit, l);
      double total = 0;
      for (double& l : logits) total += (l = std::exp(l - max_logit));
      for (int64_t i = 0; i < d; ++i) {
        double expected = 0;
        for (size_t s = 0; s < sources.size(); ++s) expected += logits[s] / total * sources[s].accessor<double, 3>()[b][t][i];
        worst = std::max(worst, std::abs(expected - ha[b][t][i]));
      }
      for (size_t s = 0; s < sources.size(); ++s) {
        worst = std::max(worst, std::abs(logits[s] / total - weights[static_cast<int64_t>(s)][b][t].item<double>()));
      }
    }
  }
  std::printf("  max |diff| against the scalar mixture %.3e\n", worst);
  EXPECT_LT(worst, 1e-13);
}

TEST(AttnResMix, OneSourceIsTheIdentity) {
  const at::Tensor x = at::randn({3, 7});
  const at::Tensor w = at::randn({7});
  const at::Tensor h = attn_res_mix({x}, w, 1e-5);
  EXPECT_TRUE(at::equal(h, x));
  EXPECT_TRUE(at::allclose(attn_res_weights({x}, w, 1e-5), at::ones({1, 3})));
}

TEST(AttnResMix, ZeroVectorIsTheUniformAverageAndDtypeIsKept) {
  const std::vector<at::Tensor> sources = {at::randn({4, 6}).to(at::kBFloat16), at::randn({4, 6}).to(at::kBFloat16)};
  const at::Tensor h = attn_res_mix(sources, at::zeros({6}), 1e-5);
  EXPECT_EQ(h.scalar_type(), at::kBFloat16);
  const at::Tensor mean = (sources[0].to(at::kFloat) + sources[1].to(at::kFloat)) / 2;
  EXPECT_LT(max_abs_diff(h, mean), 2e-2);
}

TEST(AttnResMix, RejectsMismatchedSources) {
  EXPECT_THROW(attn_res_mix({at::randn({2, 4}), at::randn({2, 5})}, at::zeros({4}), 1e-5), c10::Error);
  EXPECT_THROW(attn_res_mix({at::randn({2, 4}), at::randn({2, 4})}, at::zeros({5}), 1e-5), c10::Error);
  EXPECT_THROW(attn_res_mix({}, at::zeros({4}), 1e-5), c10::Error);
}

// d loss / d w by autograd equals central finite differences (fp64).
TEST(AttnResMix, GradientsReachW) {
  at::manual_seed(2);
  const int64_t d = 6;
  std::vector<at::Tensor> sources;
  for (int s = 0; s < 4; ++s) sources.push_back(at::randn({3, d}, f64()));
  const at::Tensor target = at::randn({3, d}, f64());
  const at::Tensor w0 = at::randn({d}, f64()) * 0.5;
  auto loss = [&](const at::Tensor& w) { return (attn_res_mix(sources, w, 1e-5) * target).sum(); };
  const at::Tensor w = w0.clone().requires_grad_(true);
  loss(w).backward();
  ASSERT_TRUE(w.grad().defined());
  EXPECT_GT(w.grad().abs().max().item<double>(), 1e-3);
  const double step = 1e-6;
  for (int64_t i = 0; i < d; ++i) {
    const at::Tensor e = at::zeros({d}, f64());
    e[i] = step;
    const double numeric = (loss(w0 + e).item<double>() - loss(w0 - e).item<double>()) / (2 * step);
    EXPECT_NEAR(w.grad()[i].item<double>(), numeric, 1e-7) << "component " << i;
  }
}

// A stand-in trunk: attention is a causal prefix mean of tanh(x A_i) over tokens (with a running
// cache, so it can be evaluated in chunks and token by token), the FFN is tanh(x F_i).
struct FakeTrunk {
  int64_t layers = 7;
  int64_t block_size = 3;
  int64_t d = 8;
  std::vector<at::Tensor> attn_proj, ffn_proj;
  AttentionResiduals mixes{nullptr};
  at::Tensor norm_weight;

  FakeTrunk() {
    for (int64_t i = 0; i < layers; ++i) {
      attn_proj.push_back(at::randn({d, d}, f64()) / std::sqrt(static_cast<double>(d)));
      ffn_proj.push_back(at::randn({d, d}, f64()) / std::sqrt(static_cast<double>(d)));
    }
    AttentionResidualsOptions o;
    o.hidden = d;
    o.num_layers = layers;
    o.block_size = block_size;
    mixes = AttentionResiduals(o);
    mixes->to(at::kDouble);
    at::NoGradGuard no_grad;
    for (auto& p : mixes->parameters()) p.copy_(at::randn_like(p));
    norm_weight = at::ones({d}, f64());
  }

  // Per layer: sum of tanh(x A) over the tokens so far [B, d], and their count.
  struct Cache {
    std::vector<at::Tensor> prefix;
    int64_t tokens = 0;
  };

  // x [B, T, d], continuing `cache` -> the final mixed, normed hidden state [B, T, d].
  at::Tensor run(const at::Tensor& embedded, Cache& cache) {
    if (cache.prefix.empty()) cache.prefix.assign(static_cast<size_t>(layers), at::zeros({embedded.size(0), d}, f64()));
    const int64_t t = embedded.size(1);
    const at::Tensor positions =
        at::arange(cache.tokens + 1, cache.tokens + t + 1, f64()).view({1, t, 1});
    AttnResStream stream = mixes->stream(embedded);
    for (int64_t i = 0; i < layers; ++i) {
      stream.begin_layer(i);
      const at::Tensor values = at::tanh(at::matmul(rms_norm(stream.mix(mixes->attn_mix(i)), norm_weight, 1e-5),
                                                    attn_proj[static_cast<size_t>(i)]));
      const at::Tensor sums = values.cumsum(1) + cache.prefix[static_cast<size_t>(i)].unsqueeze(1);
      cache.prefix[static_cast<size_t>(i)] = sums.select(1, t - 1);
      stream.add(sums / positions);
      stream.add(at::tanh(at::matmul(rms_norm(stream.mix(mixes->ffn_mix(i)), norm_weight, 1e-5),
                                     ffn_proj[static_cast<size_t>(i)])));
    }
    cache.tokens += t;
    return rms_norm(stream.mix(mixes->out_mix()), norm_weight, 1e-5);
  }
};

TEST(AttnResStream, WholeSequenceEqualsChunksAndTokenByToken) {
  at::manual_seed(3);
  FakeTrunk trunk;
  const int64_t tokens = 9;
  const at::Tensor embedded = at::randn({2, tokens, trunk.d}, f64());
  at::NoGradGuard no_grad;
  FakeTrunk::Cache whole_cache;
  const at::Tensor whole = trunk.run(embedded, whole_cache);

  FakeTrunk::Cache token_cache;
  std::vector<at::Tensor> per_token;
  for (int64_t t = 0; t < tokens; ++t) per_token.push_back(trunk.run(embedded.narrow(1, t, 1), token_cache));
  const double token_diff = max_abs_diff(whole, at::cat(per_token, 1));

  FakeTrunk::Cache chunk_cache;
  std::vector<at::Tensor> chunks;
  for (int64_t start = 0, size = 4; start < tokens; start += size, size = size == 4 ? 2 : 4) {
    const int64_t n = std::min(size, tokens - start);
    chunks.push_back(trunk.run(embedded.narrow(1, start, n), chunk_cache));
  }
  const double chunk_diff = max_abs_diff(whole, at::cat(chunks, 1));
  std::printf("  max |diff| whole vs token by token %.3e, whole vs chunks 4,2,... %.3e\n", token_diff, chunk_diff);
  EXPECT_LT(token_diff, 1e-12);
  EXPECT_LT(chunk_diff, 1e-12);
}

// Source counts at every mix point for 7 layers in blocks of 3.
TEST(AttnResStream, SourcesFollowTheBlocks) {
  const int64_t d = 4;
  AttnResStream stream(at::randn({1, d}), /*block_size=*/3, 1e-5);
  EXPECT_EQ(stream.num_sources(), 1);
  std::vector<int64_t> attn_counts, ffn_counts;
  for (int64_t i = 0; i < 7; ++i) {
    stream.begin_layer(i);
    attn_counts.push_back(stream.num_sources());
    stream.add(at::randn({1, d}));
    ffn_counts.push_back(stream.num_sources());
    stream.add(at::randn({1, d}));
  }
  // Layer 0: the embedding alone; a block start: embedding + completed blocks.
  EXPECT_EQ(attn_counts, (std::vector<int64_t>{1, 2, 2, 2, 3, 3, 3}));
  EXPECT_EQ(ffn_counts, (std::vector<int64_t>{2, 2, 2, 3, 3, 3, 4}));
  EXPECT_EQ(stream.num_sources(), 4);  // final: embedding, blocks {0-2}, {3-5}, running {6}
  EXPECT_EQ(stream.completed_blocks().size(), 2u);
  EXPECT_THROW(stream.begin_layer(9), c10::Error);
}

// The running sum is the sum of the outputs added in its block, and a completed block keeps it.
TEST(AttnResStream, BlockSumsAreSumsOfTheirOutputs) {
  AttnResStream stream(at::zeros({2, 3}), /*block_size=*/2, 1e-5);
  at::Tensor expected_block = at::zeros({2, 3});
  for (int64_t i = 0; i < 2; ++i) {
    stream.begin_layer(i);
    for (int k = 0; k < 2; ++k) {
      const at::Tensor out = at::randn({2, 3});
      expected_block = expected_block + out;
      stream.add(out);
    }
  }
  stream.begin_layer(2);
  ASSERT_EQ(stream.completed_blocks().size(), 1u);
  EXPECT_TRUE(at::allclose(stream.completed_blocks()[0], expected_block));
  EXPECT_FALSE(stream.running().defined());
}

TEST(AttnResStream, FullSizeHasAtMostNineSources) {
  const ModelConfig config = load_shipped("full-2p8t");
  ASSERT_EQ(config.num_layers, 93);
  ASSERT_EQ(config.attn_res_block_size, 12);
  EXPECT_EQ(config.attn_res_max_sources(), 9);
  AttnResStream stream(at::zeros({1, 2}), config.attn_res_block_size, config.rms_norm_eps);
  int64_t most = 0;
  for (int64_t i = 0; i < config.num_layers; ++i) {
    stream.begin_layer(i);
    most = std::max(most, stream.num_sources());
    stream.add(at::ones({1, 2}));
    most = std::max(most, stream.num_sources());
    stream.add(at::ones({1, 2}));
  }
  most = std::max(most, stream.num_sources());  // the final mix
  EXPECT_EQ(most, config.attn_res_max_sources());
  EXPECT_LE(most, 9);
}

TEST(AttnResModule, NamesAndShapesMatchTheConfigTensorList) {
  const ModelConfig config = load_shipped("tiny");
  AttentionResidualsOptions o;
  o.hidden = config.hidden_size;
  o.num_layers = config.num_layers;
  o.block_size = config.attn_res_block_size;
  o.eps = config.rms_norm_eps;
  AttentionResiduals module(o);
  std::vector<std::string> expected, actual;
  for (const ModelTensor& t : model_tensors(config)) {
    if (t.component != Component::kAttnResMix) continue;
    std::string shape;
    for (int64_t s : t.shape) shape += " " + std::to_string(s);
    expected.push_back(t.name + shape);
  }
  for (const auto& item : module->named_parameters()) {
    std::string shape;
    for (int64_t s : item.value().sizes()) shape += " " + std::to_string(s);
    actual.push_back(item.key() + shape);
    EXPECT_TRUE(at::equal(item.value(), at::zeros_like(item.value()))) << item.key() << " starts at zero";
  }
  // LibTorch lists a module's own parameters (out_mix) before its children's: same set, and the
  // per-layer vectors in the list's order.
  ASSERT_FALSE(actual.empty());
  EXPECT_EQ(actual.front(), expected.back());
  EXPECT_EQ(std::vector<std::string>(actual.begin() + 1, actual.end()),
            std::vector<std::string>(expected.begin(), expected.end() - 1));
  EXPECT_EQ(module->buffers().size(), 0u);
}

// Every mix vector but layers.0.attn_mix (a single source) gets a gradient through the stream.
TEST(AttnResModule, GradientsReachEveryUsedMixVector) {
  at::manual_seed(4);
  const int64_t d = 8;
  AttentionResidualsOptions o;
  o.hidden = d;
  o.num_layers = 5;
  o.block_size = 2;
  AttentionResiduals module(o);
  std::vector<at::Tensor> proj;
  for (int64_t i = 0; i < 2 * o.num_layers; ++i) proj.push_back(at::randn({d, d}) / std::sqrt(8.0));
  AttnResStream stream = module->stream(at::randn({3, 4, d}));
  for (int64_t i = 0; i < o.num_layers; ++i) {
    stream.begin_layer(i);
    stream.add(at::tanh(at::matmul(stream.mix(module->attn_mix(i)), proj[static_cast<size_t>(2 * i)])));
    stream.add(at::tanh(at::matmul(stream.mix(module->ffn_mix(i)), proj[static_cast<size_t>(2 * i + 1)])));
  }
  (stream.mix(module->out_mix()) * at::randn({3, 4, d})).sum().backward();
  for (const auto& item : module->named_parameters()) {
    if (item.key() == "layers.0.attn_mix") {
      EXPECT_FALSE(item.value().grad().defined() && item.value().grad().abs().max().item<double>() > 0);
      continue;
    }
    ASSERT_TRUE(item.value().grad().defined()) << item.key();
    EXPECT_GT(item.value().grad().abs().max().item<double>(), 0) << item.key();
  }
}

}  // namespace
}  // namespace odyssey::model
