// The learner step against a real replay service on loopback (RocksDB store, ZeroMQ), fed with
// GRPO groups of tokens sampled from the tiny policy: a step trains on whole groups and changes
// the weights, publishes and reports; it raises the log-probs of positive-advantage tokens;
// chunked recompute, packing and padding do not change the gradient; and a checkpoint resumed
// gives bit-identical weights to an uninterrupted run.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/types.h>

#include "learner/checkpoint.h"
#include "learner/loss.h"
#include "learner/trainer.h"
#include "learner_test_helpers.h"
#include "model/config.h"
#include "model/policy_checkpoint.h"
#include "model/precision.h"
#include "replay/client.h"
#include "test_helpers.h"

namespace odyssey::learner {
namespace {

using testing::InProcessReplay;
using testing::TempDir;
namespace fs = std::filesystem;

model::Policy load_tiny(const std::string& checkpoint) {
  auto config = model::load_model_config({testing::tiny_model_config()});
  EXPECT_TRUE(config.ok());
  model::Policy policy(*config);
  auto meta = model::load_policy(policy, checkpoint);
  EXPECT_TRUE(meta.ok()) << meta.status().to_string();
  return policy;
}

std::map<std::string, at::Tensor> weights_of(const Trainer& t) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, p] : t.named_parameters()) out[name] = p.detach().clone();
  return out;
}

replay::ServiceStats stats_of(const std::string& endpoint) {
  replay::ClientOptions o;
  o.endpoint = endpoint;
  auto s = replay::ReplaySampler::connect(o);
  EXPECT_TRUE(s.ok());
  auto st = (*s)->stats();
  EXPECT_TRUE(st.ok()) << st.status().to_string();
  return st.ok() ? *st : replay::ServiceStats{};
}

// Σ log π(token_t | prefix) over a trajectory's loss-mask tokens.
double sequence_logp(model::Policy& policy, const testing::SyntheticTrajectory& t) {
  const at::NoGradGuard no_grad;
  std::vector<int64_t> ids(t.tokens.begin(), t.tokens.end());
  const at::Tensor tokens = at::tensor(ids, at::kLong).unsqueeze(0);
  const at::Tensor logp = at::log_softmax(policy->forward(tokens), -1)[0];
  double sum = 0;
  for (size_t p = 1; p < ids.size(); ++p)
    if (t.loss_mask[p]) sum += logp[static_cast<int64_t>(p - 1)][ids[p]].item<double>();
  return sum;
}

TEST(Trainer, AStepTrainsOnWholeGroupsChangesTheWeightsPublishesReportsAndCommits) {
  TempDir tmp;
  InProcessReplay replay(tmp.str("replay"));
  const std::string init = testing::save_init_checkpoint(tmp.str("init"), 1);
  model::Policy actor = load_tiny(init);
  const auto groups = testing::sample_groups_from(actor, /*groups=*/2, /*size=*/4, /*prompt=*/8, /*generated=*/24, 5);
  ASSERT_TRUE(testing::write_groups(replay.endpoint(), groups).ok());

  TrainerOptions o = testing::small_trainer_options(tmp.str("out"), replay.endpoint(), init);
  o.checkpoint_every = 1;
  auto trainer = Trainer::create(o);
  ASSERT_TRUE(trainer.ok()) << trainer.status().to_string();
  EXPECT_EQ((*trainer)->version(), 1u);  // the starting weights, published
  const auto before = weights_of(**trainer);
  auto m = (*trainer)->step();
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->step, 1);
  EXPECT_EQ(m->groups, 2);
  EXPECT_EQ(m->trajectories, 8);
  EXPECT_EQ(m->trained_tokens, 8 * 24);
  EXPECT_EQ(m->tokens, 8 * 32);
  EXPECT_EQ(m->version, 2u);
  EXPECT_TRUE(std::isfinite(m->loss));
  EXPECT_GT(m->grad_norm, 0);
  // The actor sampled with these very weights (decode form): the ratio is 1 up to rounding.
  EXPECT_NEAR(m->ratio_mean, 1.0, 1e-3);
  EXPECT_EQ(m->masked_fraction, 0.0);
  EXPECT_EQ(m->policy_lag_mean, 0.0);  // tokens of version 1, learner at version 1 when sampling
  EXPECT_GT(m->entropy, 0.0);
  double reward_sum = 0, success = 0;
  for (const auto& g : groups)
    for (const auto& t : g.members) {
      reward_sum += t.reward;
      success += t.reward > 0.5;
    }
  EXPECT_NEAR(m->reward_mean, reward_sum / 8, 1e-12);
  EXPECT_NEAR(m->success_rate, success / 8, 1e-12);

  const auto after = weights_of(**trainer);
  int changed = 0;
  for (const auto& [name, w] : before) changed += !at::equal(w, after.at(name));
  EXPECT_GT(changed, 10) << "the step changed " << changed << " parameters";

  // Published as version 2, reported to the replay service, metrics line, checkpoint, commit.
  std::ifstream latest(tmp.str("out/weights/LATEST"));
  uint32_t v = 0;
  latest >> v;
  EXPECT_EQ(v, 2u);
  std::ifstream metrics(tmp.str("out/metrics/learner.jsonl"));
  std::string line;
  ASSERT_TRUE(std::getline(metrics, line));
  const auto j = nlohmann::json::parse(line);
  for (const char* key : {"role", "time", "step", "version", "loss", "reward_mean", "success_rate", "tokens",
                          "tokens_per_s", "policy_lag_mean", "policy_lag_max", "clip_fraction", "entropy", "ratio_mean",
                          "ratio_max", "masked_fraction", "kl", "grad_norm", "lr", "groups"})
    EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_EQ(j["role"], "learner");
  EXPECT_EQ(j["step"], 1);
  EXPECT_TRUE(fs::exists(checkpoint_dir(tmp.str("out/checkpoints"), 1) + "/COMPLETE"));
  const auto stats = stats_of(replay.endpoint());
  EXPECT_EQ(stats.consumed, 8u);
  EXPECT_EQ(stats.policy_version, 2u);
}

TEST(Trainer, Float32MatmulPrecisionIsSetWhenItStartsAndABadOneNamesTheKey) {
  TempDir tmp;
  InProcessReplay replay(tmp.str("replay"));
  const std::string init = testing::save_init_checkpoint(tmp.str("init"), 1);
  const model::Float32MatmulPrecisionScope restore(model::Float32MatmulPrecision::kHighest);
  TrainerOptions o = testing::small_trainer_options(tmp.str("out"), replay.endpoint(), init);
  o.float32_matmul_precision = "fast";
  auto refused = Trainer::create(o);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("learner.float32_matmul_precision"), std::string::npos)
      << refused.status().to_string();
  EXPECT_EQ(model::float32_matmul_precision(), model::Float32MatmulPrecision::kHighest);
  o.out_dir = tmp.str("out2");
  o.float32_matmul_precision = "medium";
  auto trainer = Trainer::create(o);
  ASSERT_TRUE(trainer.ok()) << trainer.status().to_string();
  EXPECT_EQ(model::float32_matmul_precision(), model::Float32MatmulPrecision::kMedium);
}

TEST(Trainer, AStepRaisesTheLogProbsOfPositiveAdvantageTrajectories) {
  TempDir tmp;
  InProcessReplay replay(tmp.str("replay"));
  const std::string init = testing::save_init_checkpoint(tmp.str("init"), 2);
  model::Policy actor = load_tiny(init);
  const auto groups = testing::sample_groups_from(actor, 2, 6, 8, 24, 6);
  ASSERT_TRUE(testing::write_groups(replay.endpoint(), groups).ok());

  TrainerOptions o = testing::small_trainer_options(tmp.str("out"), replay.endpoint(), init);
  o.adamw.lr = 1e-4;
  auto trainer = Trainer::create(o);
  ASSERT_TRUE(trainer.ok()) << trainer.status().to_string();
  ASSERT_TRUE((*trainer)->step().ok());
  model::Policy trained = load_tiny(init);
  {
    const at::NoGradGuard no_grad;
    auto params = trained->named_parameters();
    for (const auto& [name, w] : (*trainer)->named_parameters()) params[name].copy_(w);
  }
  double weighted = 0, up = 0, down = 0;
  int n_up = 0, n_down = 0;
  for (const auto& g : groups) {
    std::vector<double> rewards;
    for (const auto& t : g.members) rewards.push_back(t.reward);
    const auto adv = group_advantages(rewards);
    for (size_t i = 0; i < g.members.size(); ++i) {
      const double delta = sequence_logp(trained, g.members[i]) - sequence_logp(actor, g.members[i]);
      weighted += adv[i] * delta;
      if (adv[i] > 0) {
        up += delta;
        ++n_up;
      } else if (adv[i] < 0) {
        down += delta;
        ++n_down;
      }
    }
  }
  ASSERT_GT(n_up, 0);
  ASSERT_GT(n_down, 0);
  std::printf("sum A * dlogp = %.5f, mean dlogp: positive advantage %.5f, negative %.5f\n", weighted, up / n_up,
              down / n_down);
  EXPECT_GT(weighted, 0.0);
  EXPECT_GT(up / n_up, down / n_down);
}

TEST(Trainer, ChunkedRecomputeAndPackedWholeSequenceStepsGiveTheSameGradient) {
  // chunk_tokens 16: every trajectory alone, two chunks, exact chunked backward with recompute.
  // chunk_tokens 4096, no recompute: all trajectories packed (right-padded) in one chunk.
  TempDir tmp;
  const std::string init = testing::save_init_checkpoint(tmp.str("init"), 3);
  model::Policy actor = load_tiny(init);
  auto groups = testing::sample_groups_from(actor, 2, 4, 8, 20, 7);
  // Unequal lengths, so packing pads.
  for (auto& g : groups)
    for (size_t i = 0; i < g.members.size(); ++i) {
      auto& t = g.members[i];
      const size_t keep = t.tokens.size() - 3 * i;
      t.tokens.resize(keep);
      t.logprobs.resize(keep);
      t.loss_mask.resize(keep);
    }
  std::vector<StepMetrics> results;
  for (int variant = 0; variant < 2; ++variant) {
    InProcessReplay replay(tmp.str("replay" + std::to_string(variant)));
    ASSERT_TRUE(testing::write_groups(replay.endpoint(), groups).ok());
    TrainerOptions o = testing::small_trainer_options(tmp.str("out" + std::to_string(variant)), replay.endpoint(), init);
    o.chunk_tokens = variant == 0 ? 16 : 4096;
    o.recompute = variant == 0;
    o.max_grad_norm = 0;
    auto trainer = Trainer::create(o);
    ASSERT_TRUE(trainer.ok()) << trainer.status().to_string();
    auto m = (*trainer)->step();
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    results.push_back(*m);
  }
  std::printf("grad_norm %.9g vs %.9g, loss %.9g vs %.9g\n", results[0].grad_norm, results[1].grad_norm,
              results[0].loss, results[1].loss);
  EXPECT_EQ(results[0].trained_tokens, results[1].trained_tokens);
  EXPECT_NEAR(results[0].grad_norm, results[1].grad_norm, 1e-5 * results[1].grad_norm);
  EXPECT_NEAR(results[0].loss, results[1].loss, 1e-5 * std::abs(results[1].loss) + 1e-7);
  EXPECT_NEAR(results[0].entropy, results[1].entropy, 1e-5 * results[1].entropy);
}

TEST(Trainer, ResumingFromACheckpointGivesBitIdenticalWeightsToAnUninterruptedRun) {
  TempDir tmp;
  const std::string init = testing::save_init_checkpoint(tmp.str("init"), 4);
  model::Policy actor = load_tiny(init);
  const auto groups = testing::sample_groups_from(actor, 8, 3, 4, 12, 8);

  // Uninterrupted: 4 steps.
  std::map<std::string, at::Tensor> uninterrupted;
  {
    InProcessReplay replay(tmp.str("replay-a"));
    ASSERT_TRUE(testing::write_groups(replay.endpoint(), groups).ok());
    TrainerOptions o = testing::small_trainer_options(tmp.str("out-a"), replay.endpoint(), init);
    o.checkpoint_every = 2;
    auto trainer = Trainer::create(o);
    ASSERT_TRUE(trainer.ok()) << trainer.status().to_string();
    for (int s = 0; s < 4; ++s) ASSERT_TRUE((*trainer)->step().ok());
    uninterrupted = weights_of(**trainer);
  }
  // Interrupted after the checkpoint of step 2 (the trainer is dropped, as by a crash), resumed.
  InProcessReplay replay(tmp.str("replay-b"));
  ASSERT_TRUE(testing::write_groups(replay.endpoint(), groups).ok());
  TrainerOptions o = testing::small_trainer_options(tmp.str("out-b"), replay.endpoint(), init);
  o.checkpoint_every = 2;
  {
    auto trainer = Trainer::create(o);
    ASSERT_TRUE(trainer.ok()) << trainer.status().to_string();
    for (int s = 0; s < 3; ++s) ASSERT_TRUE((*trainer)->step().ok());  // step 3 is lost with the crash
  }
  o.resume = true;
  auto resumed = Trainer::create(o);
  ASSERT_TRUE(resumed.ok()) << resumed.status().to_string();
  EXPECT_EQ((*resumed)->step_count(), 2);
  for (int s = 0; s < 2; ++s) ASSERT_TRUE((*resumed)->step().ok());
  EXPECT_EQ((*resumed)->step_count(), 4);
  const auto weights = weights_of(**resumed);
  ASSERT_EQ(weights.size(), uninterrupted.size());
  for (const auto& [name, w] : uninterrupted) EXPECT_TRUE(at::equal(w, weights.at(name))) << name << " differs";
  // Versions only grow across the restart (the lost step's version 4 stays behind).
  EXPECT_GT((*resumed)->version(), 4u);
}

}  // namespace
}  // namespace odyssey::learner
