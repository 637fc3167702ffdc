// Model configs: the shipped configs load, full-2p8t counts land on MODEL.md's figures, the
// tensor list and the counts agree, and bad configs are named by file, line and key.
#include "model/config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>

#include "core/tokenizer.h"

namespace odyssey::model {
namespace {

std::string shipped(const std::string& name) {
  return std::string(ODYSSEY_SOURCE_DIR) + "/configs/model/" + name + ".toml";
}

ModelConfig load_shipped(const std::string& name, const std::vector<std::string>& overrides = {}) {
  auto config = load_model_config({shipped(name)}, overrides);
  EXPECT_TRUE(config.ok()) << config.status().message();
  return config.ok() ? *config : ModelConfig{};
}

// Writes `text` to a fresh file and returns its path.
std::string write_config(const std::string& name, const std::string& text) {
  // A folder per process (ctest runs cases in parallel); the file name stays what tests expect.
  const auto dir = std::filesystem::path(::testing::TempDir()) / ("odyssey_model_config_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / ("model_config_" + name + ".toml")).string();
  std::ofstream(path) << text;
  return path;
}

// The error of loading tiny.toml with `text` layered on top.
std::string error_of(const std::string& name, const std::string& text) {
  const std::string path = write_config(name, text);
  auto config = load_model_config({shipped("tiny"), path});
  EXPECT_FALSE(config.ok()) << "expected " << name << " to be rejected";
  return config.ok() ? "" : config.status().message();
}

double relative_error(double value, double target) { return std::abs(value - target) / target; }

TEST(ModelConfig, ShippedConfigsLoad) {
  for (const char* name : {"tiny", "small", "full-2p8t"}) {
    auto config = load_model_config({shipped(name)});
    ASSERT_TRUE(config.ok()) << name << ": " << config.status().message();
    EXPECT_EQ(config->name, name);
    EXPECT_TRUE(validate(*config).ok());
  }
}

TEST(ModelConfig, FullSizeLandsWithinOnePercentOfModelMd) {
  const ModelConfig c = load_shipped("full-2p8t");
  const ParameterCounts counts = count_parameters(c);
  std::printf("full-2p8t: total_params %lld (%.4fT, %+.3f%% from 2.78T), active_params %lld (%.3fB, %+.3f%% from "
              "104.2B)\n",
              static_cast<long long>(counts.total_params), counts.total_params / 1e12,
              100 * (counts.total_params / 2.78e12 - 1), static_cast<long long>(counts.active_params),
              counts.active_params / 1e9, 100 * (counts.active_params / 104.2e9 - 1));
  EXPECT_LT(relative_error(counts.total_params, 2.78e12), 0.01);
  EXPECT_LT(relative_error(counts.active_params, 104.2e9), 0.01);
}

TEST(ModelConfig, FullSizeSplitIsModelMds) {
  const ModelConfig c = load_shipped("full-2p8t");
  const ParameterCounts counts = count_parameters(c);
  EXPECT_EQ(c.num_kda_layers(), 69);
  EXPECT_EQ(c.num_mla_layers(), 24);
  EXPECT_EQ(c.mla_layers.front(), 4);
  EXPECT_EQ(c.mla_layers[c.mla_layers.size() - 2], 92);
  EXPECT_EQ(c.mla_layers.back(), 93);
  EXPECT_EQ(c.attention_kind(3), AttentionKind::kMla);   // one-based layer 4
  EXPECT_EQ(c.attention_kind(4), AttentionKind::kKda);
  EXPECT_EQ(c.attention_kind(92), AttentionKind::kMla);  // the last layer
  EXPECT_EQ(c.ffn_kind(0), FfnKind::kDense);
  EXPECT_EQ(c.num_moe_layers(), 92);
  EXPECT_EQ(c.attn_res_max_sources(), 9);
  EXPECT_EQ(c.mla.qk_head_dim(), 192);
  EXPECT_EQ(c.mla.cache_width(), 576);

  // Routed experts 92 × 896 × 33.0M; embedding and head 1.17B each; trunk ≈ 54.4B.
  EXPECT_EQ(counts.total(Component::kRoutedExperts), int64_t{92} * 896 * 3 * 3584 * 3072);
  EXPECT_EQ(counts.total(Component::kEmbedding), int64_t{163840} * 7168);
  EXPECT_EQ(counts.total(Component::kLmHead), int64_t{163840} * 7168);
  const int64_t trunk = counts.active_params - counts.active(Component::kRoutedExperts) - counts.active(Component::kLmHead);
  std::printf("full-2p8t: trunk %.3fB, routed experts %.4fT, vision %.3fB\n", trunk / 1e9,
              counts.total(Component::kRoutedExperts) / 1e12, counts.total(Component::kVision) / 1e9);
  EXPECT_LT(relative_error(trunk, 54.4e9), 0.01);
  EXPECT_EQ(counts.active(Component::kRoutedExperts), int64_t{92} * 16 * 3 * 3584 * 3072);
}

TEST(ModelConfig, TinyHasManyExpertsAnMlaLayerAndTheByteVocabulary) {
  const ModelConfig c = load_shipped("tiny");
  EXPECT_GE(c.moe.routed_experts, 64);
  EXPECT_GE(c.num_mla_layers(), 1);
  EXPECT_EQ(c.vocab_size, ByteTokenizer().vocab_size());
  const ParameterCounts counts = count_parameters(c);
  std::printf("tiny: total_params %lld, active_params %lld\n", static_cast<long long>(counts.total_params),
              static_cast<long long>(counts.active_params));
  ASSERT_EQ(counts.layer_kinds.size(), 3u);
  EXPECT_EQ(counts.layer_kinds[0].attention, AttentionKind::kKda);
  EXPECT_EQ(counts.layer_kinds[0].ffn, FfnKind::kDense);
  EXPECT_EQ(counts.layer_kinds[0].layers, 1);
  EXPECT_EQ(counts.layer_kinds[1].layers, 5);
  EXPECT_EQ(counts.layer_kinds[2].attention, AttentionKind::kMla);
  EXPECT_EQ(counts.layer_kinds[2].layers, 2);
}

TEST(ModelConfig, SmallUsesEveryExpertOfTheFullModel) {
  const ModelConfig c = load_shipped("small");
  const ParameterCounts counts = count_parameters(c);
  std::printf("small: total_params %lld, active_params %lld\n", static_cast<long long>(counts.total_params),
              static_cast<long long>(counts.active_params));
  EXPECT_EQ(c.moe.routed_experts, 896);
  EXPECT_EQ(c.moe.top_k, 16);
  // bf16 weights + fp32 AdamW state leave most of one H200 for activations.
  const MemoryPlan memory = plan_memory(c, counts);
  EXPECT_LT(memory.weights_bf16_bytes + memory.adamw_state_bytes, int64_t{60} << 30);
}

TEST(ModelConfig, TensorListSumsToTotalParams) {
  for (const char* name : {"tiny", "small", "full-2p8t"}) {
    const ModelConfig c = load_shipped(name);
    int64_t sum = 0;
    std::set<std::string> names;
    for (const ModelTensor& tensor : model_tensors(c)) {
      EXPECT_TRUE(names.insert(tensor.name).second) << "duplicate tensor " << tensor.name;
      if (!tensor.buffer) sum += tensor.numel();
    }
    EXPECT_EQ(sum, count_parameters(c).total_params) << name;
  }
}

TEST(ModelConfig, TensorNamesAndShapesFollowTheDocumentedScheme) {
  const ModelConfig c = load_shipped("tiny");
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const ModelTensor& tensor : model_tensors(c)) shapes[tensor.name] = tensor.shape;
  auto shape = [&](const std::string& name) {
    EXPECT_EQ(shapes.count(name), 1u) << "missing " << name;
    return shapes[name];
  };
  EXPECT_EQ(shape("embed.weight"), (std::vector<int64_t>{271, 128}));
  EXPECT_EQ(shape("layers.0.ffn.gate_proj.weight"), (std::vector<int64_t>{256, 128}));
  EXPECT_EQ(shape("layers.0.attn.q_conv1d.weight"), (std::vector<int64_t>{64, 1, 4}));
  EXPECT_EQ(shape("layers.1.attn.A_log"), (std::vector<int64_t>{2}));
  EXPECT_EQ(shape("layers.1.moe.experts.gate_proj"), (std::vector<int64_t>{64, 32, 64}));
  EXPECT_EQ(shape("layers.1.moe.experts.down_proj"), (std::vector<int64_t>{64, 64, 32}));
  EXPECT_EQ(shape("layers.1.moe.shared_experts.up_proj"), (std::vector<int64_t>{2, 64, 128}));
  EXPECT_EQ(shape("layers.1.moe.router.bias"), (std::vector<int64_t>{64}));
  EXPECT_EQ(shape("layers.3.attn.kv_down_proj.weight"), (std::vector<int64_t>{48, 128}));     // one-based layer 4
  EXPECT_EQ(shape("layers.7.attn.q_up_proj.weight"), (std::vector<int64_t>{2 * 48, 64}));
  EXPECT_EQ(shape("layers.7.attn_mix"), (std::vector<int64_t>{128}));
  EXPECT_EQ(shape("out_mix"), (std::vector<int64_t>{128}));
  EXPECT_EQ(shape("lm_head.weight"), (std::vector<int64_t>{271, 128}));
  EXPECT_EQ(shape("vision.patch_embed.weight"), (std::vector<int64_t>{64, 3 * 8 * 8}));
  EXPECT_EQ(shape("vision.proj.weight"), (std::vector<int64_t>{128, 64}));
  EXPECT_EQ(shapes.count("layers.3.attn.q_proj.weight"), 0u);  // an MLA layer has no KDA tensors
  // The balancing bias is a buffer: saved, not counted.
  const auto layer = layer_tensors(c, 1, "layers.1.");
  const auto bias = std::find_if(layer.begin(), layer.end(), [](const ModelTensor& t) { return t.name == "layers.1.moe.router.bias"; });
  ASSERT_NE(bias, layer.end());
  EXPECT_TRUE(bias->buffer);
}

TEST(ModelConfig, ActiveCountsTopKRoutedExpertsAndTheHeadButNotTheEmbedding) {
  const ModelConfig c = load_shipped("tiny");
  const ParameterCounts counts = count_parameters(c);
  const int64_t routed = counts.total(Component::kRoutedExperts);
  const int64_t expected = counts.total_params - counts.total(Component::kEmbedding) - counts.total(Component::kVision) -
                           routed + routed / c.moe.routed_experts * c.moe.top_k;
  EXPECT_EQ(counts.active_params, expected);
  EXPECT_EQ(counts.active(Component::kLmHead), counts.total(Component::kLmHead));
  EXPECT_EQ(counts.active(Component::kEmbedding), 0);
}

TEST(ModelConfig, TiedEmbeddingsCountOnceAndStayActive) {
  const ParameterCounts untied = count_parameters(load_shipped("tiny"));
  const ParameterCounts tied = count_parameters(load_shipped("tiny", {"model.tie_embeddings=true"}));
  EXPECT_EQ(tied.total_params, untied.total_params - 271 * 128);
  EXPECT_EQ(tied.active_params, untied.active_params);
}

TEST(ModelConfig, MtpLayersCountInTotalButNotActive) {
  const ModelConfig c = load_shipped("tiny", {"model.mtp_layers=1"});
  const ParameterCounts with = count_parameters(c);
  const ParameterCounts without = count_parameters(load_shipped("tiny"));
  EXPECT_GT(with.total(Component::kMtp), 0);
  EXPECT_EQ(with.total_params, without.total_params + with.total(Component::kMtp));
  EXPECT_EQ(with.active_params, without.active_params);
  int64_t mtp_layer = 0;
  for (const ModelTensor& t : layer_tensors(c, c.num_layers - 1, "")) mtp_layer += t.buffer ? 0 : t.numel();
  EXPECT_EQ(with.total(Component::kMtp), mtp_layer + 3 * 128 + 2 * 128 * 128);  // + 3 norms and eh_proj
}

TEST(ModelConfig, DecodeCacheIsTheMlaLatentPerTokenAndAConstantKdaState) {
  const ModelConfig c = load_shipped("full-2p8t");
  const MemoryPlan memory = plan_memory(c, count_parameters(c));
  EXPECT_EQ(memory.mla_cache_bytes_per_token, 24 * 576 * 2);
  EXPECT_EQ(memory.kda_state_bytes, int64_t{69} * (96 * 128 * 128 + 3 * 96 * (128 + 128 + 128)) * 4);
  EXPECT_EQ(memory.decode_cache_bytes(1 << 20), memory.kda_state_bytes + (int64_t{1} << 20) * 24 * 576 * 2);
  EXPECT_EQ(memory.adamw_state_bytes, 12 * count_parameters(c).total_params);
  std::printf("full-2p8t: decode cache for 2^20 tokens %.2f GiB, AdamW state %.2f TiB\n",
              memory.decode_cache_bytes(1 << 20) / double(1 << 30), memory.adamw_state_bytes / std::pow(2.0, 40));
}

TEST(ModelConfig, MlaLayerOutOfRangeNamesFileLineAndKey) {
  const std::string message = error_of("mla_range", "[model]\nnum_layers = 6\nmla_layers = \"5, 7\"\n");
  EXPECT_NE(message.find("model_config_mla_range.toml:3"), std::string::npos) << message;
  EXPECT_NE(message.find("'model.mla_layers'"), std::string::npos) << message;
  EXPECT_NE(message.find("layer 7"), std::string::npos) << message;
}

TEST(ModelConfig, MlaLayersMustBeIncreasingIntegers) {
  EXPECT_NE(error_of("mla_order", "[model]\nmla_layers = \"6, 5\"\n").find("strictly increasing"), std::string::npos);
  const std::string message = error_of("mla_text", "[model]\nmla_layers = \"5, six\"\n");
  EXPECT_NE(message.find("model_config_mla_text.toml:2"), std::string::npos) << message;
  EXPECT_NE(message.find("'six'"), std::string::npos) << message;
  EXPECT_NE(error_of("mla_array", "[model]\nmla_layers = [5, 6]\n").find("must be a string"), std::string::npos);
}

TEST(ModelConfig, TopKAboveExpertsNamesFileLineAndKey) {
  const std::string message = error_of("top_k", "[model.moe]\nrouted_experts = 16\n\ntop_k = 20\n");
  EXPECT_NE(message.find("model_config_top_k.toml:4: key 'model.moe.top_k' is 20, more than "
                         "model.moe.routed_experts (16)"),
            std::string::npos)
      << message;
}

TEST(ModelConfig, QuantileBalancingNeedsTopKBelowExperts) {
  EXPECT_NE(error_of("top_k_all", "[model.moe]\nrouted_experts = 4\ntop_k = 4\n").find("(k+1)-th"), std::string::npos);
  const std::string sign = write_config("top_k_all_sign", "[model.moe]\nrouted_experts = 4\ntop_k = 4\n"
                                                          "[model.moe.balancing]\nmethod = \"sign\"\n");
  EXPECT_TRUE(load_model_config({shipped("tiny"), sign}).ok());
}

TEST(ModelConfig, VisionHeadsMustDivideItsWidth) {
  const std::string message = error_of("vision", "[model.vision]\nwidth = 66\nheads = 4\n");
  EXPECT_NE(message.find("model_config_vision.toml:2: key 'model.vision.width'"), std::string::npos) << message;
}

TEST(ModelConfig, ChunkOutsideTheExponentRangeIsRejected) {
  const std::string message = error_of("chunk", "[model.kda]\nchunk_size = 64\n");
  EXPECT_NE(message.find("'model.kda.chunk_size'"), std::string::npos) << message;
  EXPECT_NE(message.find("126"), std::string::npos) << message;
}

TEST(ModelConfig, UnknownKeysGetASuggestion) {
  const std::string message = error_of("typo", "[model.moe]\ntop_kk = 4\n");
  EXPECT_NE(message.find("model_config_typo.toml:2: unknown key 'model.moe.top_kk' (did you mean 'model.moe.top_k'?)"),
            std::string::npos)
      << message;
}

TEST(ModelConfig, EveryProblemIsReportedAtOnce) {
  const std::string message = error_of("many", "[model]\nmla_layers = \"9\"\n[model.moe]\ntop_k = 65\n");
  EXPECT_NE(message.find("mla_layers"), std::string::npos) << message;
  EXPECT_NE(message.find("top_k"), std::string::npos) << message;
}

TEST(ModelConfig, OverridesAreNamedAsSuch) {
  auto config = load_model_config({shipped("tiny")}, {"model.moe.top_k=100"});
  ASSERT_FALSE(config.ok());
  EXPECT_NE(config.status().message().find("config --set: key 'model.moe.top_k'"), std::string::npos)
      << config.status().message();
}

TEST(ModelConfig, ValidateChecksConfigsBuiltInCode) {
  ModelConfig c = load_shipped("tiny");
  EXPECT_TRUE(validate(c).ok());
  c.mla_layers = {0};
  const Status status = validate(c);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("model config: key 'model.mla_layers' names layer 0"), std::string::npos)
      << status.message();
}

}  // namespace
}  // namespace odyssey::model
