// Data parallel over c10d Gloo: two learner ranks (two threads, each with its own
// ProcessGroupGloo over one TCPStore, one replay service) keep bit-identical weights, and their
// step equals one rank training on the same groups (the gradient is averaged by token count over
// both ranks, not per rank).
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <thread>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "learner/distributed.h"
#include "learner/trainer.h"
#include "learner_test_helpers.h"
#include "model/config.h"
#include "model/policy_checkpoint.h"
#include "test_helpers.h"

namespace odyssey::learner {
namespace {

using testing::InProcessReplay;
using testing::TempDir;

// ... and broadcast rank 0's tensor in place, bumping its version as an in-place op does (what
// keys on the version, model::Bf16Shadow, must see the new values).
TEST(DataParallel, GlooAllReduceSumsAndMaxesAcrossTwoRanks) {
  const std::string master = "127.0.0.1:" + std::to_string(testing::free_port());
  std::vector<at::Tensor> sums(2), maxes(2), broadcasts(2);
  std::vector<int64_t> version_bumps(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto dp = DataParallel::create(DataParallelOptions{r, 2, "gloo", master, std::chrono::seconds(30)});
      if (!dp.ok()) {
        errors[r] = dp.status().to_string();
        return;
      }
      at::Tensor s = at::full({3}, static_cast<double>(r + 1), at::kDouble);
      (*dp)->all_reduce_sum(s);
      at::Tensor m = at::tensor(std::vector<int64_t>{r == 0 ? 7 : 3, r == 0 ? -1 : 5}, at::kLong);
      (*dp)->all_reduce_max(m);
      sums[r] = s;
      maxes[r] = m;
      at::Tensor b = at::full({4}, static_cast<float>(r + 10));
      const int64_t version = b._version();
      (*dp)->broadcast(b, 0);
      broadcasts[r] = b;
      version_bumps[r] = b._version() - version;
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(errors[r].empty()) << errors[r];
    EXPECT_TRUE(at::equal(sums[r], at::full({3}, 3.0, at::kDouble)));
    EXPECT_EQ(maxes[r][0].item<int64_t>(), 7);
    EXPECT_EQ(maxes[r][1].item<int64_t>(), 5);
    EXPECT_TRUE(at::equal(broadcasts[r], at::full({4}, 10.0f))) << "rank " << r;
    EXPECT_GE(version_bumps[r], 1) << "rank " << r;
  }
}

TEST(DataParallel, TwoGlooRanksKeepIdenticalWeightsAndMatchOneRankOnTheSameGroups) {
  TempDir tmp;
  const std::string init = testing::save_init_checkpoint(tmp.str("init"), 21);
  auto config = model::load_model_config({testing::tiny_model_config()});
  ASSERT_TRUE(config.ok());
  model::Policy actor(*config);
  ASSERT_TRUE(model::load_policy(actor, init).ok());
  // Groups of different lengths, so a per-rank mean would weigh tokens differently.
  auto groups = testing::sample_groups_from(actor, 4, 4, 8, 24, 22);
  for (size_t g = 0; g < groups.size(); g += 2)
    for (auto& t : groups[g].members) {
      t.tokens.resize(20);
      t.logprobs.resize(20);
      t.loss_mask.resize(20);
    }
  constexpr int kSteps = 2;

  // Two ranks, one group each per step.
  InProcessReplay shared(tmp.str("replay-dp"));
  ASSERT_TRUE(testing::write_groups(shared.endpoint(), groups).ok());
  const std::string master = "127.0.0.1:" + std::to_string(testing::free_port());
  std::vector<std::map<std::string, at::Tensor>> weights(2);
  std::vector<std::vector<StepMetrics>> metrics(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      TrainerOptions o = testing::small_trainer_options(tmp.str("out-dp"), shared.endpoint(), init);
      o.rank = r;
      o.ranks = 2;
      o.master = master;
      o.max_grad_norm = 0;
      auto trainer = Trainer::create(o);
      if (!trainer.ok()) {
        errors[r] = trainer.status().to_string();
        return;
      }
      for (int s = 0; s < kSteps; ++s) {
        auto m = (*trainer)->step();
        if (!m.ok()) {
          errors[r] = m.status().to_string();
          return;
        }
        metrics[r].push_back(*m);
      }
      for (const auto& [name, p] : (*trainer)->named_parameters()) weights[r][name] = p.detach().clone();
    });
  }
  for (auto& t : ranks) t.join();
  ASSERT_TRUE(errors[0].empty()) << errors[0];
  ASSERT_TRUE(errors[1].empty()) << errors[1];
  for (const auto& [name, w] : weights[0]) EXPECT_TRUE(at::equal(w, weights[1].at(name))) << name << " differs between ranks";
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_EQ(metrics[0][s].grad_norm, metrics[1][s].grad_norm);
    EXPECT_EQ(metrics[0][s].groups, 2);
  }

  // One rank, both groups of each step.
  InProcessReplay single_replay(tmp.str("replay-one"));
  ASSERT_TRUE(testing::write_groups(single_replay.endpoint(), groups).ok());
  TrainerOptions o = testing::small_trainer_options(tmp.str("out-one"), single_replay.endpoint(), init);
  o.max_grad_norm = 0;
  auto single = Trainer::create(o);
  ASSERT_TRUE(single.ok()) << single.status().to_string();
  for (int s = 0; s < kSteps; ++s) {
    auto m = (*single)->step();
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    std::printf("step %d: grad_norm two ranks %.9g, one rank %.9g; loss %.9g vs %.9g\n", s + 1, metrics[0][s].grad_norm,
                m->grad_norm, metrics[0][s].loss, m->loss);
    EXPECT_NEAR(metrics[0][s].grad_norm, m->grad_norm, 1e-4 * m->grad_norm);
    EXPECT_NEAR(metrics[0][s].loss, m->loss, 1e-5 * std::abs(m->loss) + 1e-7);
    EXPECT_EQ(metrics[0][s].trained_tokens, m->trained_tokens);
  }
  int64_t close = 0, total = 0;
  for (const auto& [name, p] : (*single)->named_parameters()) {
    const at::Tensor d = (p.detach() - weights[0].at(name)).abs();
    close += (d <= 1e-6).sum().item<int64_t>();
    total += d.numel();
  }
  std::printf("%ld of %ld weights within 1e-6 of the one-rank run\n", static_cast<long>(close), static_cast<long>(total));
  EXPECT_GT(static_cast<double>(close), 0.999 * static_cast<double>(total));
}

}  // namespace
}  // namespace odyssey::learner
