// `odyssey bench learner` at toy sizes: a row per length with both step rates, and the last line
// `learner_tokens_per_s: X`; `--long N` trains one N-token trajectory and reports peak memory.
#include <string>

#include <gtest/gtest.h>

#include "test_helpers.h"

namespace odyssey {
namespace {

const std::string kTiny = std::string(ODYSSEY_SOURCE_DIR) + "/configs/model/tiny.toml";

double last_value(const std::string& out, const std::string& name) {
  const size_t at = out.rfind(name + ": ");
  if (at == std::string::npos) return -1;
  const std::string line = out.substr(at);
  EXPECT_EQ(line.find('\n'), line.size() - 1) << "the figure is the last line:\n" << out;
  return std::stod(line.substr(name.size() + 2));
}

TEST(LearnerBench, PrintsARowPerLengthAgainstTheReferenceAndEndsWithTokensPerSecond) {
  std::string out;
  const int code = testing::run_command({ODYSSEY_BINARY, "bench", "learner", "--model-config", kTiny, "--lengths", "32",
                                         "96", "--batch-tokens", "96", "--chunk-tokens", "32"},
                                        &out);
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("      32      3 "), std::string::npos) << out;
  EXPECT_NE(out.find("      96      1 "), std::string::npos) << out;
  EXPECT_GT(last_value(out, "learner_tokens_per_s"), 0.0) << out;
}

TEST(LearnerBench, LongTrajectoryReportsTheStepAndPeakMemory) {
  std::string out;
  const int code = testing::run_command(
      {ODYSSEY_BINARY, "bench", "learner", "--model-config", kTiny, "--long", "300", "--chunk-tokens", "64"}, &out);
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("one trajectory of 300 tokens (150 trained)"), std::string::npos) << out;
  EXPECT_NE(out.find("peak RSS"), std::string::npos) << out;
  EXPECT_GT(last_value(out, "learner_long_tokens_per_s"), 0.0) << out;
}

// The long check's phases, the optimizer and clipping against their baselines, and --profile's
// summary (on the CPU, LibTorch's operators; Debian's LibTorch has no Kineto to write the trace
// with, which the summary says rather than failing).
TEST(LearnerBench, LongTrajectoryPrintsItsPhasesAndAProfile) {
  std::string out;
  const testing::TempDir tmp;
  const std::string trace = tmp.str("trace.json");
  const int code = testing::run_command({ODYSSEY_BINARY, "bench", "learner", "--model-config", kTiny, "--long", "200",
                                         "--chunk-tokens", "64", "--profile", trace},
                                        &out);
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("its phases: policy gradient (forward and backward) "), std::string::npos) << out;
  EXPECT_NE(out.find("optimizer step alone: "), std::string::npos) << out;
  EXPECT_NE(out.find("torch::nn::utils::clip_grad_norm_ "), std::string::npos) << out;
  EXPECT_NE(out.find("profile of one more step: "), std::string::npos) << out;
  EXPECT_NE(out.find("aten::mm"), std::string::npos) << "the operators' table names LibTorch's ops:\n" << out;
  EXPECT_GT(last_value(out, "learner_long_tokens_per_s"), 0.0) << out;
}

TEST(LearnerBench, RejectsALengthTooShortToTrain) {
  std::string out;
  EXPECT_NE(testing::run_command({ODYSSEY_BINARY, "bench", "learner", "--lengths", "1"}, &out), 0);
  EXPECT_NE(out.find("--lengths: 1 is too short"), std::string::npos) << out;
  EXPECT_NE(testing::run_command({ODYSSEY_BINARY, "bench", "learner", "--device", "tpu"}, &out), 0);
  EXPECT_NE(out.find("--device must be cpu or cuda"), std::string::npos) << out;
  EXPECT_NE(testing::run_command({ODYSSEY_BINARY, "bench", "learner", "--float32-matmul-precision", "low"}, &out), 0);
  EXPECT_NE(out.find("--float32-matmul-precision: float32 matmul precision 'low'"), std::string::npos) << out;
  EXPECT_NE(testing::run_command({ODYSSEY_BINARY, "bench", "learner", "--profile", "t.json"}, &out), 0);
  EXPECT_NE(out.find("--profile needs --long N"), std::string::npos) << out;
}

}  // namespace
}  // namespace odyssey
