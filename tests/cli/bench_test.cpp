// The benchmarks run end to end at small sizes and end with their ratio line (the figures
// themselves are for `odyssey bench ...` runs, not for tests).
#include <gtest/gtest.h>

#include "cli/run_command.h"
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace {

std::string run(const std::string& args, int* code) {
  return odyssey::testing::run_shell(std::string(ODYSSEY_BINARY) + " " + args, code);
}

std::string last_line(const std::string& out) {
  auto end = out.find_last_not_of('\n');
  auto start = out.rfind('\n', end);
  return out.substr(start == std::string::npos ? 0 : start + 1, end - (start == std::string::npos ? 0 : start + 1) + 1);
}

TEST(Bench, ReplayEndsWithItsIngestRatio) {
  int code = -1;
  auto out = run("bench replay --log-level warn --set bench.replay.trajectories=8 --set bench.replay.segments_per_trajectory=2"
                 " --set bench.replay.tokens_per_segment=64 --set bench.replay.million_token=false",
                 &code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_EQ(last_line(out).rfind("replay_ingest_ratio: ", 0), 0u) << out;
}

TEST(Bench, ModelEndsWithTheKdaChunkedSpeedup) {
  int code = -1;
  auto out = run("bench model --model-config " + std::string(ODYSSEY_SOURCE_DIR) +
                     "/configs/model/tiny.toml --sequence 64 --decode 4 --kda-tokens 64 --repeats 1",
                 &code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_EQ(last_line(out).rfind("kda_chunked_speedup: ", 0), 0u) << out;
  EXPECT_NE(out.find("one token at a time"), std::string::npos) << out;
}

}  // namespace
