// `odyssey bench actor` at toy sizes: every row is there and the last line is the 1M-style ratio
// line of the largest context (the full-size run takes minutes; see the README's figures).
#include <string>

#include <gtest/gtest.h>

#include "test_helpers.h"

namespace odyssey {
namespace {

TEST(ActorBench, PrintsRowsForBothVariantsAndEndsWithTheRatioAtTheLargestContext) {
  std::string out;
  const int code = testing::run_command(
      {ODYSSEY_BINARY, "bench", "actor", "--model-config", std::string(ODYSSEY_SOURCE_DIR) + "/configs/model/tiny.toml",
       "--contexts", "64", "2048", "--real-prefill", "128", "--chunk", "64", "--decode", "2", "--repeats", "1"},
      &out);
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("hybrid         64  real prefill"), std::string::npos) << out;
  EXPECT_NE(out.find("all-mla        2k  real 128 + tiled"), std::string::npos) << out;
  EXPECT_NE(out.find("peak rss:"), std::string::npos) << out;
  const size_t last = out.rfind("decode_speedup_vs_mla_");
  ASSERT_NE(last, std::string::npos) << out;
  const std::string line = out.substr(last);
  EXPECT_EQ(line.rfind("decode_speedup_vs_mla_2k: ", 0), 0u) << line;
  EXPECT_GT(std::stod(line.substr(line.find(':') + 1)), 0.0) << line;
  EXPECT_EQ(line.find('\n'), line.size() - 1) << "the ratio is the last line:\n" << out;
}

TEST(ActorBench, RejectsContextsThatAreNotAscending) {
  std::string out;
  EXPECT_NE(testing::run_command({ODYSSEY_BINARY, "bench", "actor", "--contexts", "2048", "64"}, &out), 0);
  EXPECT_NE(out.find("ascending"), std::string::npos) << out;
}

}  // namespace
}  // namespace odyssey
