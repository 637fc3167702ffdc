// `odyssey run`: a short RL job end to end with real processes (replay service, learner, actor,
// eval actor), and the supervisor restarting a SIGKILLed learner and actor.
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/run_command.h"

namespace odyssey {
namespace {

namespace fs = std::filesystem;

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

std::vector<nlohmann::json> read_metrics(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object()) out.push_back(j);
  }
  return out;
}

class RunJob : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::path(::testing::TempDir()) / "run_test_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    root_ = pattern;
  }
  void TearDown() override {
    if (std::getenv("ODYSSEY_KEEP_TEST_DIRS") == nullptr) fs::remove_all(root_);
  }
  std::string out() const { return (root_ / "run").string(); }

  // A job of a few seconds of work: random initial weights, tiny batches, short episodes.
  std::string command(int steps, const std::string& extra = "") const {
    return "cd " + std::string(ODYSSEY_SOURCE_DIR) + " && " + ODYSSEY_BINARY + " run configs/tiny.toml --out " + out() +
           " --set 'policy.init=\"\"' --set learner.steps=" + std::to_string(steps) +
           " --set replay.listen=tcp://127.0.0.1:" + std::to_string(free_port()) +
           " --set learner.master=127.0.0.1:" + std::to_string(free_port()) +
           " --set actor.slots=4 --set actor.group_size=2 --set learner.groups_per_step=1"
           " --set actor.max_tokens=96 --set actor.max_turn_tokens=24 --set learner.checkpoint_every=2"
           " --set replay.rate_limiter.min_size_to_sample=2 --set run.eval_every=2 --set run.eval_tasks=4"
           " --set run.max_minutes=8 --set run.log_every_seconds=1 " +
           extra;
  }

  fs::path root_;
};

TEST_F(RunJob, ShortJobStoresTrajectoriesStepsTheLearnerPublishesWeightsAndWritesMetrics) {
  int code = 0;
  const std::string output = odyssey::testing::run_shell(command(3), &code);
  ASSERT_EQ(code, 0) << output;
  EXPECT_NE(output.find("run: 3 steps"), std::string::npos) << "summary line missing:\n" << output;
  const auto metrics = read_metrics(out() + "/metrics.jsonl");
  int last_step = 0, actor_lines = 0, eval_lines = 0;
  for (const auto& j : metrics) {
    const std::string role = j.value("role", "");
    if (role == "learner") last_step = std::max(last_step, j.value("step", 0));
    if (role.rfind("actor", 0) == 0) ++actor_lines;
    if (role == "eval") {
      ++eval_lines;
      EXPECT_TRUE(j.contains("eval_success")) << j.dump();
    }
  }
  EXPECT_EQ(last_step, 3) << "the learner's steps in metrics.jsonl";
  EXPECT_GT(actor_lines, 0) << "actors report their throughput";
  EXPECT_GT(eval_lines, 0) << "the eval actor reports eval_success";
  EXPECT_TRUE(fs::exists(out() + "/weights/LATEST")) << "weights reached the actors' folder";
  EXPECT_TRUE(fs::exists(out() + "/config.toml"));
  EXPECT_FALSE(fs::is_empty(out() + "/checkpoints"));
  EXPECT_FALSE(fs::is_empty(out() + "/replay")) << "trajectories were stored";

  const std::string plot = odyssey::testing::run_shell(std::string(ODYSSEY_BINARY) + " plot " + out(), &code);
  ASSERT_EQ(code, 0) << plot;
  EXPECT_GT(fs::file_size(out() + "/curves.png"), 1000u);

  // The same --out again without --resume is refused; a run is never silently overwritten.
  const std::string again = odyssey::testing::run_shell(command(3), &code);
  EXPECT_NE(code, 0);
  EXPECT_NE(again.find("--resume"), std::string::npos) << again;
}

TEST_F(RunJob, SupervisorRestartsAKilledLearnerAndActorAndTheStepCountContinues) {
  // Start the job in the background, kill the learner and the actor once the learner has
  // stepped, and let the job finish.
  const std::string log = (root_ / "run.log").string();
  const std::string cmd = command(6) + " > " + log + " 2>&1; echo $? > " + (root_ / "rc").string();
  std::thread job([cmd] { int c = 0; odyssey::testing::run_shell(cmd, &c); });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(6);
  bool killed = false;
  while (std::chrono::steady_clock::now() < deadline && !killed) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    int step = 0;
    for (const auto& j : read_metrics(out() + "/metrics.jsonl"))
      if (j.value("role", "") == "learner") step = std::max(step, j.value("step", 0));
    if (step < 2) continue;
    std::ifstream in(out() + "/processes.json");
    const auto table = nlohmann::json::parse(in, nullptr, false);
    ASSERT_TRUE(table.is_object());
    ::kill(table["roles"]["learner-0"]["pid"].get<int>(), SIGKILL);
    ::kill(table["roles"]["actor-0"]["pid"].get<int>(), SIGKILL);
    killed = true;
  }
  job.join();
  ASSERT_TRUE(killed) << "the learner never reached step 2";
  std::ifstream rc_in((root_ / "rc").string());
  int rc = -1;
  rc_in >> rc;
  std::ifstream log_in(log);
  const std::string text((std::istreambuf_iterator<char>(log_in)), std::istreambuf_iterator<char>());
  ASSERT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("learner-0 killed by"), std::string::npos) << text;
  EXPECT_NE(text.find("actor-0 killed by"), std::string::npos) << text;
  std::ifstream in(out() + "/processes.json");
  const auto table = nlohmann::json::parse(in, nullptr, false);
  EXPECT_GE(table["roles"]["learner-0"]["restarts"].get<int>(), 1);
  EXPECT_GE(table["roles"]["actor-0"]["restarts"].get<int>(), 1);
  int last_step = 0;
  for (const auto& j : read_metrics(out() + "/metrics.jsonl"))
    if (j.value("role", "") == "learner") last_step = std::max(last_step, j.value("step", 0));
  EXPECT_EQ(last_step, 6) << "the resumed learner continued to the last step";
}

// A stage checkpoint made for another model (here: the tiny model with 5 layers, as after an
// edit of configs/model/tiny.toml) is refused before any role starts, with what to do about it,
// instead of every learner start failing the same way until the restart limit.
TEST_F(RunJob, AStageCheckpointOfAnotherModelIsRefusedBeforeAnyRoleStarts) {
  std::ifstream tiny_in(std::string(ODYSSEY_SOURCE_DIR) + "/configs/model/tiny.toml");
  std::string model((std::istreambuf_iterator<char>(tiny_in)), std::istreambuf_iterator<char>());
  const auto layers = model.find("num_layers = ");
  ASSERT_NE(layers, std::string::npos);
  model.replace(layers, model.find('\n', layers) - layers, "num_layers = 5");
  const auto mla = model.find("mla_layers = ");
  ASSERT_NE(mla, std::string::npos);
  model.replace(mla, model.find('\n', mla) - mla, "mla_layers = \"4, 5\"");
  const std::string other = (root_ / "five-layers.toml").string();
  std::ofstream(other) << model;
  const std::string pretrain_out = (root_ / "pretrain").string();

  int code = 0;
  const std::string made = odyssey::testing::run_shell(
      "cd " + std::string(ODYSSEY_SOURCE_DIR) + " && " + ODYSSEY_BINARY +
          " pretrain --config configs/tiny.toml --set policy.model='\"" + other + "\"' --set pretrain.out='\"" +
          pretrain_out + "\"' --set 'pretrain.stages=[\"1K\"]' --set pretrain.steps_per_stage=1"
          " --set pretrain.batch_tokens=1024 --set pretrain.threads=1",
      &code);
  ASSERT_EQ(code, 0) << made;
  const std::string init = pretrain_out + "/stage-1K";
  ASSERT_TRUE(fs::exists(init + "/COMPLETE")) << made;

  const std::string output = odyssey::testing::run_shell(
      command(2, "--set policy.init='\"" + init + "\"' --set pretrain.out='\"" + pretrain_out + "\"'"), &code);
  EXPECT_NE(code, 0) << output;
  EXPECT_NE(output.find("was made for another model"), std::string::npos) << output;
  EXPECT_NE(output.find("move '" + pretrain_out + "' away"), std::string::npos) << output;
  EXPECT_EQ(output.find("restarting"), std::string::npos) << "no role should have started:\n" << output;
  EXPECT_FALSE(fs::exists(out() + "/processes.json")) << output;
}

// Pretraining runs first when policy.init is missing. SIGINT to the supervisor then stops the
// pretraining process too (it sits in its own process group, out of reach of a terminal's
// Ctrl-C), and a second `odyssey run` keeps the stages that were complete and continues after
// them.
TEST_F(RunJob, CtrlCDuringPretrainingStopsItAndTheNextRunContinuesAfterTheCompleteStages) {
  const std::string pretrain_out = (root_ / "pretrain").string();
  int code = 0;
  const std::string made = odyssey::testing::run_shell(
      "cd " + std::string(ODYSSEY_SOURCE_DIR) + " && " + ODYSSEY_BINARY +
          " pretrain --config configs/tiny.toml --set pretrain.out='\"" + pretrain_out +
          "\"' --set 'pretrain.stages=[\"1K\"]' --set pretrain.steps_per_stage=1 --set pretrain.batch_tokens=1024"
          " --set pretrain.threads=1",
      &code);
  ASSERT_EQ(code, 0) << made;
  const std::string pretrain =
      " --set pretrain.out='\"" + pretrain_out + "\"' --set 'pretrain.stages=[\"1K\", \"4K\"]'"
      " --set pretrain.batch_tokens=1024 --set pretrain.threads=1 --set policy.init='\"" + pretrain_out +
      "/stage-4K\"'";

  // Long enough stages that the signal arrives while pretraining; the shell waits for the supervisor.
  const std::string log = (root_ / "run.log").string();
  const std::string cmd = command(1, pretrain + " --set pretrain.steps_per_stage=100000") + " > " + log +
                          " 2>&1; echo $? > " + (root_ / "rc").string();
  std::thread job([cmd] { int c = 0; odyssey::testing::run_shell(cmd, &c); });
  const std::string pretrain_log = out() + "/logs/pretrain.log";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline && (!fs::exists(pretrain_log) || fs::file_size(pretrain_log) == 0))
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_TRUE(fs::exists(pretrain_log)) << "pretraining never started";
  const auto signalled = std::chrono::steady_clock::now();
  odyssey::testing::run_shell("pkill -INT -f -- '--out " + out() + "'", &code);
  job.join();
  EXPECT_LT(std::chrono::steady_clock::now() - signalled, std::chrono::seconds(20)) << "the supervisor took long to stop";
  std::ifstream log_in(log);
  const std::string text((std::istreambuf_iterator<char>(log_in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("received during pretraining"), std::string::npos) << text;
  // "confi[g]" so that the pattern does not match the shell that runs pgrep.
  const std::string left = odyssey::testing::run_shell("pgrep -f -- '" + out() + "/confi[g].toml' || true", &code);
  EXPECT_TRUE(left.empty()) << "a pretraining process outlived the supervisor: " << left;
  EXPECT_FALSE(fs::exists(pretrain_out + "/stage-4K")) << "the interrupted stage must not look complete";

  // Again, with stages that finish: stage 1K is kept (resumed), 4K is trained, then RL runs.
  fs::remove_all(out());
  const std::string again = odyssey::testing::run_shell(command(1, pretrain + " --set pretrain.steps_per_stage=1"), &code);
  ASSERT_EQ(code, 0) << again;
  std::ifstream pretrain_in(pretrain_log);
  const std::string pretrain_text((std::istreambuf_iterator<char>(pretrain_in)), std::istreambuf_iterator<char>());
  EXPECT_NE(pretrain_text.find("stage 1K: resumed"), std::string::npos) << pretrain_text;
  EXPECT_TRUE(fs::exists(pretrain_out + "/stage-4K/COMPLETE")) << pretrain_text;
  EXPECT_NE(again.find("run: 1 steps"), std::string::npos) << again;
}

}  // namespace
}  // namespace odyssey
