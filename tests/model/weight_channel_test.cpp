#include "model/weight_channel.h"

#include <stdlib.h>

#include <filesystem>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "model/config.h"

namespace odyssey::model {
namespace {

namespace fs = std::filesystem;

class WeightChannel : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::path(::testing::TempDir()) / "weight_channel_test_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    root_ = pattern;
    auto config = load_model_config({std::string(ODYSSEY_SOURCE_DIR) + "/configs/model/tiny.toml"});
    ASSERT_TRUE(config.ok());
    config_ = *config;
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string dir() const { return (root_ / "weights").string(); }

  fs::path root_;
  ModelConfig config_;
};

TEST_F(WeightChannel, ActorPicksUpTheNewestVersionAndGetsIdenticalLogits) {
  at::manual_seed(1);
  Policy learner(config_);
  at::manual_seed(2);
  Policy actor(config_);
  WeightPublisher publisher(dir(), {{"model", "tiny"}});
  WeightSubscriber subscriber(dir(), std::chrono::milliseconds(0));
  EXPECT_FALSE(subscriber.latest(true).has_value()) << "nothing published yet";
  auto unchanged = subscriber.refresh(actor, 0);
  ASSERT_TRUE(unchanged.ok());
  EXPECT_EQ(*unchanged, 0u);

  ASSERT_TRUE(publisher.publish(learner, 1).ok());
  {
    c10::NoGradGuard no_grad;
    for (auto& p : learner->parameters()) p.add_(0.01);  // a learner step
  }
  ASSERT_TRUE(publisher.publish(learner, 2, {{"step", 2}}).ok());
  auto got = subscriber.refresh(actor, 0);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(*got, 2u);
  const at::Tensor tokens = at::randint(0, config_.vocab_size, {1, 9}, at::kLong);
  c10::NoGradGuard no_grad;
  EXPECT_TRUE(at::equal(learner->forward(tokens), actor->forward(tokens)));
  auto again = subscriber.refresh(actor, 2);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, 2u) << "no newer version: nothing loaded";
}

TEST_F(WeightChannel, VersionsOnlyGrowAndOldOnesAreRemoved) {
  Policy learner(config_);
  WeightPublisher publisher(dir(), nlohmann::json::object(), at::kBFloat16, /*keep=*/2);
  for (uint32_t v = 1; v <= 4; ++v) ASSERT_TRUE(publisher.publish(learner, v).ok());
  const Status stale = publisher.publish(learner, 3);
  EXPECT_EQ(stale.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(stale.message().find("not newer"), std::string::npos) << stale.message();
  EXPECT_FALSE(fs::exists(weight_version_dir(dir(), 1)));
  EXPECT_FALSE(fs::exists(weight_version_dir(dir(), 2)));
  EXPECT_TRUE(fs::exists(weight_version_dir(dir(), 3)));
  EXPECT_TRUE(fs::exists(weight_version_dir(dir(), 4)));
  WeightSubscriber subscriber(dir());
  Policy actor(config_);
  const Status gone = subscriber.load(actor, 1);
  EXPECT_EQ(gone.code(), StatusCode::kNotFound);
  EXPECT_NE(gone.message().find("poll again"), std::string::npos);
}

TEST_F(WeightChannel, SubscriberReadsLatestAtMostOncePerPollInterval) {
  Policy learner(config_);
  WeightPublisher publisher(dir(), nlohmann::json::object());
  ASSERT_TRUE(publisher.publish(learner, 1).ok());
  WeightSubscriber subscriber(dir(), std::chrono::hours(1));
  EXPECT_EQ(subscriber.latest(), std::optional<uint32_t>(1));
  ASSERT_TRUE(publisher.publish(learner, 2).ok());
  EXPECT_EQ(subscriber.latest(), std::optional<uint32_t>(1)) << "cached until the interval passes";
  EXPECT_EQ(subscriber.latest(/*force=*/true), std::optional<uint32_t>(2));
}

}  // namespace
}  // namespace odyssey::model
