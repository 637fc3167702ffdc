// A Policy saved as a checkpoint and loaded into a fresh one computes the same logits; a model
// of another shape is refused with every mismatching tensor named, and left untouched.
#include "model/policy_checkpoint.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include <torch/types.h>

namespace odyssey::model {
namespace {

namespace fs = std::filesystem;

ModelConfig tiny(const std::vector<std::string>& overrides = {}) {
  auto cfg = load_model_config({std::string(ODYSSEY_SOURCE_DIR) + "/configs/model/tiny.toml"}, overrides);
  EXPECT_TRUE(cfg.ok()) << cfg.status().to_string();
  return *cfg;
}

struct TempCheckpointDir {
  fs::path path = fs::temp_directory_path() / ("odyssey-policy-ckpt-" + std::to_string(::getpid()));
  TempCheckpointDir() { fs::remove_all(path); }
  ~TempCheckpointDir() { fs::remove_all(path); }
};

TEST(PolicyCheckpoint, RoundTripGivesIdenticalLogits) {
  TempCheckpointDir tmp;
  torch::manual_seed(1);
  Policy saved(tiny());
  SaveOptions so;
  so.dtype = at::kFloat;
  CheckpointMeta meta{"8K", nlohmann::json{{"steps", 12}}};
  ASSERT_TRUE(save_policy(saved, tmp.path.string(), nlohmann::json{{"name", "tiny"}}, meta, so).ok());

  torch::manual_seed(2);
  Policy loaded(tiny());
  const at::Tensor tokens = at::randint(0, 256, {2, 19}, at::kLong);
  torch::NoGradGuard no_grad;
  ASSERT_FALSE(at::equal(saved->forward(tokens), loaded->forward(tokens))) << "different seeds, different weights";
  nlohmann::json config;
  auto got = load_policy(loaded, tmp.path.string(), &config);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(got->stage, "8K");
  EXPECT_EQ(config["name"], "tiny");
  EXPECT_TRUE(at::equal(saved->forward(tokens), loaded->forward(tokens)));
}

TEST(PolicyCheckpoint, AnotherShapeIsRefusedNamingTensorsAndLeavesTheModelUntouched) {
  TempCheckpointDir tmp;
  torch::manual_seed(3);
  Policy saved(tiny());
  SaveOptions so;
  so.dtype = at::kFloat;
  ASSERT_TRUE(save_policy(saved, tmp.path.string(), nlohmann::json::object(), CheckpointMeta{"8K", nullptr}, so).ok());
  Policy other(tiny({"model.moe.routed_experts=32"}));
  const at::Tensor tokens = at::randint(0, 256, {1, 7}, at::kLong);
  torch::NoGradGuard no_grad;
  const at::Tensor before = other->forward(tokens);
  auto got = load_policy(other, tmp.path.string());
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("experts.gate_proj"), std::string::npos) << got.status().message();
  EXPECT_TRUE(at::equal(before, other->forward(tokens)));
}

}  // namespace
}  // namespace odyssey::model
