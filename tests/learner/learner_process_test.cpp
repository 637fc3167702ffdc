// `odyssey learner` as users run it: a real process with a config file, killed with SIGKILL in
// the middle of its run and started again with --resume. The step count continues from the last
// checkpoint, and every acknowledged trajectory is trained on exactly once by the surviving run:
// the final checkpoint's accounting (count and sum of trajectory ids) matches what was written,
// and the replay service has consumed all of them.
#include <signal.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "learner/checkpoint.h"
#include "learner_test_helpers.h"
#include "model/config.h"
#include "model/policy_checkpoint.h"
#include "replay/client.h"
#include "test_helpers.h"

namespace odyssey::learner {
namespace {

using namespace std::chrono_literals;
using testing::InProcessReplay;
using testing::Process;
using testing::TempDir;

std::string write_config(const TempDir& tmp, const std::string& endpoint, const std::string& init, int steps) {
  const std::string path = tmp.str("job.toml");
  std::ofstream f(path);
  f << "[job]\nseed = 3\n"
    << "[run]\nout = \"" << tmp.str("out") << "\"\n"
    << "[replay]\nlisten = \"" << endpoint << "\"\n"
    << "[policy]\nmodel = \"" << testing::tiny_model_config() << "\"\ninit = \"" << init << "\"\n"
    << "[learner]\ngroups_per_step = 2\nchunk_tokens = 64\nsteps = " << steps
    << "\ncheckpoint_every = 3\nlr = 1e-3\nwarmup_steps = 0\n";
  return path;
}

int ready_step(const std::string& output) {
  std::smatch m;
  static const std::regex re("ready at step (\\d+)");
  return std::regex_search(output, m, re) ? std::stoi(m[1]) : -1;
}

TEST(LearnerProcess, SigkilledMidRunAndResumedItTrainsEveryAcknowledgedTrajectoryExactlyOnce) {
  TempDir tmp;
  InProcessReplay replay(tmp.str("replay"));
  const std::string init = testing::save_init_checkpoint(tmp.str("init"), 9);
  auto config = model::load_model_config({testing::tiny_model_config()});
  ASSERT_TRUE(config.ok());
  model::Policy actor(*config);
  ASSERT_TRUE(model::load_policy(actor, init).ok());
  constexpr int kSteps = 10;
  const auto groups = testing::sample_groups_from(actor, 2 * kSteps, 3, 4, 12, 10);
  ASSERT_TRUE(testing::write_groups(replay.endpoint(), groups).ok());
  uint64_t written = 0, id_sum = 0;
  for (const auto& g : groups)
    for (const auto& t : g.members) {
      ++written;
      id_sum += t.id;
    }
  const std::string cfg = write_config(tmp, replay.endpoint(), init, kSteps);

  {
    Process first({ODYSSEY_BINARY, "learner", "--config", cfg, "--rank", "0"}, tmp.str("learner-1.log"));
    ASSERT_TRUE(first.wait_for_output("learner: step 4 ", 120s)) << first.output();
    first.kill(SIGKILL);
    EXPECT_EQ(first.wait(10s), 128 + SIGKILL);
  }
  Process second({ODYSSEY_BINARY, "learner", "--config", cfg, "--rank", "0", "--resume"}, tmp.str("learner-2.log"));
  ASSERT_EQ(second.wait(180s), 0) << second.output();
  // The last checkpoint before the kill was step 3 (checkpoint_every 3; killed during step 5 at
  // the latest, so step 6's may or may not have been reached): the count continues from it.
  const int resumed_at = ready_step(second.output());
  EXPECT_TRUE(resumed_at == 3 || resumed_at == 6) << second.output();
  EXPECT_NE(second.output().find("done at step 10"), std::string::npos) << second.output();

  const auto latest = latest_checkpoint(tmp.str("out/checkpoints"));
  ASSERT_TRUE(latest.has_value());
  std::ifstream in(*latest + "/learner.json");
  const auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["step"].get<int64_t>(), kSteps);
  EXPECT_EQ(j["trajectories_trained"].get<uint64_t>(), written) << "a trajectory was lost or trained twice";
  EXPECT_EQ(j["trajectory_id_sum"].get<uint64_t>(), id_sum) << "a trajectory was lost or trained twice";

  replay::ClientOptions o;
  o.endpoint = replay.endpoint();
  auto sampler = replay::ReplaySampler::connect(o);
  ASSERT_TRUE(sampler.ok());
  auto stats = (*sampler)->stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->consumed, written);
  EXPECT_EQ(stats->complete, 0u);

  // The metrics continue the step count: the resumed run's lines start right after the checkpoint.
  std::ifstream metrics(tmp.str("out/metrics/learner.jsonl"));
  std::string line;
  int last = 0, lines = 0;
  while (std::getline(metrics, line)) {
    last = nlohmann::json::parse(line)["step"].get<int>();
    ++lines;
  }
  EXPECT_EQ(last, kSteps);
  EXPECT_GE(lines, kSteps);
}

TEST(LearnerProcess, SigtermWhileWaitingForDataWritesAFinalCheckpointAndExitsZero) {
  TempDir tmp;
  InProcessReplay replay(tmp.str("replay"));
  const std::string init = testing::save_init_checkpoint(tmp.str("init"), 11);
  auto config = model::load_model_config({testing::tiny_model_config()});
  ASSERT_TRUE(config.ok());
  model::Policy actor(*config);
  ASSERT_TRUE(model::load_policy(actor, init).ok());
  // One step's worth (two groups) and one more group: the second step waits for a fourth.
  ASSERT_TRUE(testing::write_groups(replay.endpoint(), testing::sample_groups_from(actor, 3, 3, 4, 12, 12)).ok());
  const std::string cfg = write_config(tmp, replay.endpoint(), init, /*steps=*/10);
  Process learner({ODYSSEY_BINARY, "learner", "--config", cfg, "--rank", "0"}, tmp.str("learner.log"));
  ASSERT_TRUE(learner.wait_for_output("learner: step 1 ", 120s)) << learner.output();
  std::this_thread::sleep_for(1s);
  learner.kill(SIGTERM);
  ASSERT_EQ(learner.wait(60s), 0) << learner.output();
  EXPECT_NE(learner.output().find("done at step 1 "), std::string::npos) << learner.output();
  const auto latest = latest_checkpoint(tmp.str("out/checkpoints"));
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(*latest, checkpoint_dir(tmp.str("out/checkpoints"), 1));
  replay::ClientOptions o;
  o.endpoint = replay.endpoint();
  auto sampler = replay::ReplaySampler::connect(o);
  ASSERT_TRUE(sampler.ok());
  auto stats = (*sampler)->stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->consumed, 6u);  // the trained step, committed with the final checkpoint
  EXPECT_EQ(stats->complete, 3u);  // the third group: sampled, never trained, not consumed
}

}  // namespace
}  // namespace odyssey::learner
