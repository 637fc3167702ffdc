// Learner checkpoints on disk: everything round-trips, a folder without COMPLETE is never
// loaded, the newest N complete ones are kept, and crashed saves' leftovers are cleaned up.
#include <filesystem>
#include <fstream>
#include <string>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/types.h>

#include "learner/checkpoint.h"
#include "learner_test_helpers.h"
#include "model/config.h"
#include "test_helpers.h"

namespace odyssey::learner {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

model::Policy tiny(uint64_t seed) {
  auto config = model::load_model_config({testing::tiny_model_config()});
  EXPECT_TRUE(config.ok());
  at::manual_seed(seed);
  return model::Policy(*config);
}

LearnerState state_at(int64_t step) {
  LearnerState s;
  s.step = step;
  s.version = static_cast<uint32_t>(step + 1);
  s.replay_cursor = static_cast<uint64_t>(step * 10);
  s.optimizer_steps = step;
  s.optimizer = {{"exp_avg.w", at::full({3}, 0.5f)}, {"step.w", at::full({1}, step, at::kLong)}};
  s.balancer_biases = {at::arange(4, at::kFloat)};
  s.balancer_steps = {step};
  s.rng_state = at::detail::getDefaultCPUGenerator().get_state();
  s.trajectories_trained = 7;
  s.trajectory_id_sum = 0xffffffffffffff00ull;
  s.tokens_trained = 123;
  return s;
}

TEST(LearnerCheckpoint, RoundTripsWeightsOptimizerBalancersRngCursorAndAccounting) {
  TempDir tmp;
  model::Policy saved = tiny(1);
  const LearnerState original = state_at(5);
  const Status st = save_learner_checkpoint(tmp.str("ckpt"), saved, original, {{"name", "tiny"}}, {"1K", nullptr}, 3);
  ASSERT_TRUE(st.ok()) << st.to_string();
  const auto latest = latest_checkpoint(tmp.str("ckpt"));
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(*latest, checkpoint_dir(tmp.str("ckpt"), 5));
  model::Policy loaded = tiny(2);
  auto s = load_learner_checkpoint(*latest, loaded);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(s->step, 5);
  EXPECT_EQ(s->version, 6u);
  EXPECT_EQ(s->replay_cursor, 50u);
  EXPECT_EQ(s->trajectory_id_sum, 0xffffffffffffff00ull);
  EXPECT_EQ(s->tokens_trained, 123u);
  EXPECT_TRUE(at::equal(s->optimizer.at("exp_avg.w"), at::full({3}, 0.5f)));
  EXPECT_TRUE(at::equal(s->balancer_biases.at(0), at::arange(4, at::kFloat)));
  EXPECT_TRUE(at::equal(s->rng_state, original.rng_state));
  auto a = saved->named_parameters(), b = loaded->named_parameters();
  for (const auto& item : a) EXPECT_TRUE(at::equal(item.value(), b[item.key()])) << item.key();
}

TEST(LearnerCheckpoint, KeepsTheNewestCompleteOnesAndNeverLoadsAnIncompleteOne) {
  TempDir tmp;
  const std::string root = tmp.str("ckpt");
  model::Policy policy = tiny(3);
  const nlohmann::json config = {{"name", "tiny"}};
  for (int64_t step : {1, 2, 3}) {
    const Status st = save_learner_checkpoint(root, policy, state_at(step), config, {"1K", nullptr}, 2);
    ASSERT_TRUE(st.ok()) << st.to_string();
  }
  // A crash in the middle of saving step 4: the renamed folder exists but COMPLETE does not;
  // and a temporary folder of an even earlier crash.
  fs::create_directories(checkpoint_dir(root, 4) + "/policy");
  fs::create_directories(root + "/.step-00000004.tmp-12345");
  EXPECT_EQ(*latest_checkpoint(root), checkpoint_dir(root, 3));
  const auto all = list_checkpoints(root);
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0], checkpoint_dir(root, 2));
  model::Policy target = tiny(4);
  EXPECT_EQ(load_learner_checkpoint(checkpoint_dir(root, 4), target).status().code(), StatusCode::kNotFound);
  // Saving step 4 again replaces the broken folder; step 5 prunes to the newest two and removes
  // the leftovers.
  ASSERT_TRUE(save_learner_checkpoint(root, policy, state_at(4), config, {"1K", nullptr}, 2).ok());
  ASSERT_TRUE(save_learner_checkpoint(root, policy, state_at(5), config, {"1K", nullptr}, 2).ok());
  const auto kept = list_checkpoints(root);
  ASSERT_EQ(kept.size(), 2u);
  EXPECT_EQ(kept[0], checkpoint_dir(root, 4));
  EXPECT_EQ(kept[1], checkpoint_dir(root, 5));
  EXPECT_FALSE(fs::exists(root + "/.step-00000004.tmp-12345"));
  EXPECT_FALSE(fs::exists(checkpoint_dir(root, 2)));
}

}  // namespace
}  // namespace odyssey::learner
