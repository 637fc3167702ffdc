#include "model/checkpoint.h"

#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

namespace odyssey::model {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::path(::testing::TempDir()) / "checkpoint_test_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    root_ = pattern;
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string path(const std::string& name) const { return (root_ / name).string(); }

  fs::path root_;
};

// A small model: 4 KiB per fp32 weight, a bf16 norm, an integer buffer and a bool mask.
std::map<std::string, at::Tensor> small_model() {
  at::manual_seed(11);
  return {
      {"embed.weight", at::randn({32, 32}, at::kFloat)},
      {"layers.0.attn.q_proj.weight", at::randn({32, 32}, at::kFloat)},
      {"layers.0.attn.k_proj.weight", at::randn({32, 32}, at::kFloat).t()},  // non-contiguous
      {"layers.0.moe.router.weight", at::randn({8, 32}, at::kFloat)},
      {"layers.0.norm.weight", at::randn({32}, at::kBFloat16)},
      {"layers.0.moe.expert_counts", at::randint(0, 1000, {8}, at::kLong)},
      {"layers.0.moe.active", at::randint(0, 2, {8}, at::kLong).to(at::kBool)},
  };
}

std::map<std::string, TensorSpec> specs_of(const std::map<std::string, at::Tensor>& tensors,
                                           std::optional<at::ScalarType> floating = std::nullopt) {
  std::map<std::string, TensorSpec> specs;
  for (const auto& [name, tensor] : tensors) {
    at::ScalarType dtype = tensor.scalar_type();
    if (floating && at::isFloatingType(dtype)) dtype = *floating;
    specs[name] = {tensor.sizes().vec(), dtype};
  }
  return specs;
}

json model_config() { return {{"d_model", 32}, {"n_layers", 1}, {"moe", {{"experts", 8}, {"top_k", 2}}}}; }

CheckpointMeta stage_meta() {
  return {"64K", {{"steps", 1200}, {"data", "mix-v3"}, {"parent", "ckpt/8K-final"}, {"git", "0eef362"}}};
}

bool bytes_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  at::Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.numel() * x.element_size()) == 0;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST_F(CheckpointTest, ShardedRoundTripInFp32IsBitExact) {
  auto tensors = small_model();
  // 4096-byte weights and a 4500-byte limit: every fp32 weight gets a shard of its own.
  SaveOptions options{/*dtype=*/at::kFloat, /*max_shard_bytes=*/4500};
  ASSERT_TRUE(save_checkpoint(path("ckpt"), tensors, model_config(), stage_meta(), options).ok());

  auto info = inspect_checkpoint(path("ckpt"));
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_GE(info->shards.size(), 4u);
  EXPECT_EQ(info->shards.front(), fmt::format("model-00001-of-{:05d}.safetensors", info->shards.size()));
  EXPECT_EQ(info->tensors.at("layers.0.norm.weight").info.dtype, at::kFloat) << "floating tensors stored as fp32";
  EXPECT_EQ(info->tensors.at("layers.0.moe.expert_counts").info.dtype, at::kLong) << "integers kept";

  auto loaded = load_checkpoint(path("ckpt"), specs_of(tensors));
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  ASSERT_EQ(loaded->tensors.size(), tensors.size());
  for (const auto& [name, tensor] : tensors) {
    EXPECT_TRUE(bytes_equal(tensor, loaded->tensors.at(name))) << name;
  }
  EXPECT_EQ(loaded->config, model_config());
  EXPECT_EQ(loaded->meta.stage, "64K");
  EXPECT_EQ(loaded->meta.provenance, stage_meta().provenance);
}

TEST_F(CheckpointTest, Bf16AndFp16SavesAreBitExactForTensorsAlreadyInThatDtype) {
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    std::map<std::string, at::Tensor> tensors = {{"a", at::randn({17, 3}).to(dtype)},
                                                 {"b", at::randn({5}).to(dtype)}};
    const std::string dir = path(fmt::format("ckpt_{}", c10::toString(dtype)));
    ASSERT_TRUE(save_checkpoint(dir, tensors, model_config(), stage_meta(), {dtype, /*max_shard_bytes=*/64}).ok());
    auto loaded = load_checkpoint(dir, specs_of(tensors));
    ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
    for (const auto& [name, tensor] : tensors) EXPECT_TRUE(bytes_equal(tensor, loaded->tensors.at(name))) << name;
  }
}

TEST_F(CheckpointTest, SavingConvertsToTheStorageDtypeAndLoadingToTheRequestedOne) {
  auto tensors = small_model();
  ASSERT_TRUE(save_checkpoint(path("ckpt"), tensors, model_config(), stage_meta(), {at::kBFloat16, 1 << 20}).ok());
  auto info = inspect_checkpoint(path("ckpt"));
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->shards.size(), 1u);
  EXPECT_EQ(info->tensors.at("embed.weight").info.dtype, at::kBFloat16);
  EXPECT_EQ(info->tensors.at("layers.0.moe.active").info.dtype, at::kBool);

  // The model holds fp32: bf16 values come back widened, exactly.
  auto loaded = load_checkpoint(path("ckpt"), specs_of(tensors, at::kFloat));
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  const at::Tensor& embed = loaded->tensors.at("embed.weight");
  EXPECT_EQ(embed.scalar_type(), at::kFloat);
  EXPECT_TRUE(bytes_equal(tensors.at("embed.weight").to(at::kBFloat16).to(at::kFloat), embed));
  EXPECT_TRUE(bytes_equal(tensors.at("layers.0.moe.expert_counts"), loaded->tensors.at("layers.0.moe.expert_counts")));

  // LoadOptions::dtype overrides the spec for floating tensors only.
  auto as_half = load_checkpoint(path("ckpt"), specs_of(tensors, at::kFloat), LoadOptions{at::kHalf});
  ASSERT_TRUE(as_half.ok()) << as_half.status().to_string();
  EXPECT_EQ(as_half->tensors.at("embed.weight").scalar_type(), at::kHalf);
  EXPECT_EQ(as_half->tensors.at("layers.0.moe.expert_counts").scalar_type(), at::kLong);
}

TEST_F(CheckpointTest, LayoutFollowsTheHuggingFaceIndexFormat) {
  auto tensors = small_model();
  ASSERT_TRUE(save_checkpoint(path("ckpt"), tensors, model_config(), stage_meta(), {at::kFloat, 4500}).ok());
  json index = json::parse(read_text(path("ckpt/model.safetensors.index.json")));
  EXPECT_EQ(index["weight_map"].size(), tensors.size());
  EXPECT_EQ(index["metadata"]["stage"], "64K");
  EXPECT_EQ(index["metadata"]["provenance"]["steps"], 1200);
  uint64_t total = 0;
  for (const auto& [name, tensor] : tensors) total += tensor.numel() * (at::isFloatingType(tensor.scalar_type()) ? 4 : tensor.element_size());
  EXPECT_EQ(index["metadata"]["total_size"], total);
  EXPECT_EQ(json::parse(read_text(path("ckpt/config.json"))), model_config());
  json stage = json::parse(read_text(path("ckpt/stage.json")));
  EXPECT_EQ(stage["stage"], "64K");
  EXPECT_EQ(stage["provenance"]["git"], "0eef362");
  EXPECT_TRUE(fs::exists(path("ckpt/COMPLETE")));
  for (const auto& entry : fs::directory_iterator(root_)) {
    EXPECT_EQ(entry.path().filename(), "ckpt") << "no staging folder left behind";
  }
  for (const auto& [name, shard] : index["weight_map"].items()) {
    auto file = read_safetensors(path("ckpt/" + shard.get<std::string>()));
    ASSERT_TRUE(file.ok()) << file.status().to_string();
    EXPECT_EQ(file->metadata.at("format"), "pt");
    EXPECT_EQ(file->metadata.at("stage"), "64K");
    EXPECT_TRUE(file->tensors.count(name));
  }
}

TEST_F(CheckpointTest, EveryMissingUnexpectedAndMismatchedTensorIsNamedInOneError) {
  auto tensors = small_model();
  ASSERT_TRUE(save_checkpoint(path("ckpt"), tensors, model_config(), stage_meta(), {at::kFloat, 1 << 20}).ok());
  auto expected = specs_of(tensors);
  expected.erase("embed.weight");                                   // unexpected in the checkpoint
  expected.erase("layers.0.moe.router.weight");                     // unexpected too
  expected["lm_head.weight"] = {{32, 32}, at::kFloat};              // missing
  expected["layers.1.norm.weight"] = {{32}, at::kFloat};            // missing
  expected["layers.0.attn.q_proj.weight"].shape = {32, 64};         // shape mismatch
  expected["layers.0.moe.expert_counts"].dtype = at::kInt;          // integer dtype mismatch
  expected["layers.0.moe.active"].dtype = at::kFloat;               // bool -> float is not a conversion

  auto loaded = load_checkpoint(path("ckpt"), expected);
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), StatusCode::kInvalidArgument);
  const std::string& message = loaded.status().message();
  for (const char* line : {
           "(7 problems):",
           "\n  missing tensor 'lm_head.weight' (the model expects [32, 32] F32)",
           "\n  missing tensor 'layers.1.norm.weight' (the model expects [32] F32)",
           "\n  unexpected tensor 'embed.weight' ([32, 32] F32, in model-00001-of-00001.safetensors)",
           "\n  unexpected tensor 'layers.0.moe.router.weight' ([8, 32] F32",
           "\n  tensor 'layers.0.attn.q_proj.weight': shape [32, 32] in the checkpoint, the model expects [32, 64]",
           "\n  tensor 'layers.0.moe.expert_counts': stored as I64, the model expects I32",
           "\n  tensor 'layers.0.moe.active': stored as BOOL, the model expects F32",
       }) {
    EXPECT_NE(message.find(line), std::string::npos) << "lacks: " << line << "\nmessage:\n" << message;
  }
}

TEST_F(CheckpointTest, AFolderWithoutTheCompleteMarkerIsRefused) {
  auto tensors = small_model();
  ASSERT_TRUE(save_checkpoint(path("ckpt"), tensors, model_config(), stage_meta()).ok());
  fs::remove(path("ckpt/COMPLETE"));
  auto loaded = load_checkpoint(path("ckpt"), specs_of(tensors));
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(loaded.status().message().find("has no COMPLETE marker"), std::string::npos) << loaded.status().message();
  EXPECT_NE(loaded.status().message().find("did not finish"), std::string::npos);

  EXPECT_EQ(load_checkpoint(path("nowhere"), {}).status().code(), StatusCode::kNotFound);
}

TEST_F(CheckpointTest, ATruncatedShardNamesTheShardAndTheTensor) {
  auto tensors = small_model();
  ASSERT_TRUE(save_checkpoint(path("ckpt"), tensors, model_config(), stage_meta(), {at::kFloat, 4500}).ok());
  auto info = inspect_checkpoint(path("ckpt"));
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  const std::string victim = info->tensors.at("layers.0.attn.q_proj.weight").shard;
  const std::string shard_path = path("ckpt/" + victim);
  fs::resize_file(shard_path, fs::file_size(shard_path) - 100);

  auto loaded = load_checkpoint(path("ckpt"), specs_of(tensors));
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(loaded.status().message().find(victim), std::string::npos) << loaded.status().message();
  EXPECT_NE(loaded.status().message().find("truncated: tensor 'layers.0.attn.q_proj.weight'"), std::string::npos)
      << loaded.status().message();
}

TEST_F(CheckpointTest, AnIndexThatDisagreesWithItsShardsIsCorrupt) {
  auto tensors = small_model();
  ASSERT_TRUE(save_checkpoint(path("ckpt"), tensors, model_config(), stage_meta(), {at::kFloat, 4500}).ok());
  const std::string index_path = path("ckpt/model.safetensors.index.json");
  const json index = json::parse(read_text(index_path));
  auto expect_corrupt = [&](const json& edited, const std::string& says) {
    std::ofstream(index_path, std::ios::trunc) << edited.dump();
    auto loaded = load_checkpoint(path("ckpt"), specs_of(tensors));
    ASSERT_FALSE(loaded.ok()) << says;
    EXPECT_EQ(loaded.status().code(), StatusCode::kCorrupt) << loaded.status().to_string();
    EXPECT_NE(loaded.status().message().find(says), std::string::npos) << loaded.status().message();
  };
  json moved = index;
  std::string other = index["weight_map"]["layers.0.norm.weight"] == index["weight_map"]["embed.weight"]
                          ? index["weight_map"]["layers.0.attn.q_proj.weight"].get<std::string>()
                          : index["weight_map"]["layers.0.norm.weight"].get<std::string>();
  moved["weight_map"]["embed.weight"] = other;
  expect_corrupt(moved, "maps tensor 'embed.weight' to shard " + other + ", which does not hold it");

  json escaping = index;
  escaping["weight_map"]["embed.weight"] = "../elsewhere.safetensors";
  expect_corrupt(escaping, "not a file name in the folder");

  json wrong_total = index;
  wrong_total["metadata"]["total_size"] = 5;
  expect_corrupt(wrong_total, "says total_size 5");

  json wrong_stage = index;
  wrong_stage["metadata"]["stage"] = "8K";
  expect_corrupt(wrong_stage, "says stage \"8K\" but stage.json says \"64K\"");

  std::ofstream(index_path, std::ios::trunc) << "{ not json";
  auto loaded = load_checkpoint(path("ckpt"), specs_of(tensors));
  EXPECT_EQ(loaded.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(loaded.status().message().find("model.safetensors.index.json is not valid JSON"), std::string::npos);
}

TEST_F(CheckpointTest, SavingRefusesBadOptionsAndExistingFolders) {
  auto tensors = small_model();
  EXPECT_EQ(save_checkpoint(path("a"), tensors, model_config(), stage_meta(), {at::kDouble, 1 << 20}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(save_checkpoint(path("a"), tensors, model_config(), {"64k", {}}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(save_checkpoint(path("a"), tensors, json::array(), stage_meta()).code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(fs::exists(path("a")));
  for (const char* stage : {"8K", "64K", "256K", "1M"}) EXPECT_TRUE(validate_stage(stage).ok()) << stage;
  for (const char* stage : {"", "K", "0K", "64", "64k", "6 4K", "1G"}) EXPECT_FALSE(validate_stage(stage).ok()) << stage;

  ASSERT_TRUE(save_checkpoint(path("a"), tensors, model_config(), stage_meta()).ok());
  EXPECT_EQ(save_checkpoint(path("a"), tensors, model_config(), stage_meta()).code(), StatusCode::kAlreadyExists);
  SaveOptions overwrite;
  overwrite.overwrite = true;
  std::map<std::string, at::Tensor> replacement = {{"only", at::ones({2})}};
  ASSERT_TRUE(save_checkpoint(path("a/"), replacement, model_config(), {"1M", nullptr}, overwrite).ok());
  auto loaded = load_checkpoint(path("a"), specs_of(replacement));
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded->meta.stage, "1M");
  EXPECT_TRUE(loaded->meta.provenance.is_null());
  for (const auto& entry : fs::directory_iterator(root_)) EXPECT_EQ(entry.path().filename(), "a");
}

}  // namespace
}  // namespace odyssey::model
