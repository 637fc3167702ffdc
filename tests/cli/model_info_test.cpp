// `odyssey model info` run as a real process: the count lines, and errors that name the file.
#include <gtest/gtest.h>

#include "cli/run_command.h"
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <sys/wait.h>

namespace {

std::string run(const std::string& cmd, int* code) { return odyssey::testing::run_shell(cmd, code); }

// The N of the line "key: N", or -1.
long long count_line(const std::string& out, const std::string& key) {
  const std::string prefix = "\n" + key + ": ";
  const auto at = out.find(prefix);
  if (at == std::string::npos) return -1;
  return std::stoll(out.substr(at + prefix.size()));
}

std::string model_config(const std::string& name) {
  return std::string(ODYSSEY_SOURCE_DIR) + "/configs/model/" + name + ".toml";
}

TEST(ModelInfo, FullSizePrintsTotalAndActiveParams) {
  int code = -1;
  const std::string out = run(std::string(ODYSSEY_BINARY) + " model info " + model_config("full-2p8t"), &code);
  ASSERT_EQ(code, 0) << out;
  const long long total = count_line(out, "total_params");
  const long long active = count_line(out, "active_params");
  std::printf("full-2p8t: total_params %lld, active_params %lld\n", total, active);
  EXPECT_LT(std::abs(total / 2.78e12 - 1), 0.01) << out;
  EXPECT_LT(std::abs(active / 104.2e9 - 1), 0.01) << out;
  EXPECT_NE(out.find("routed experts"), std::string::npos) << out;
  EXPECT_NE(out.find("mla + moe"), std::string::npos) << out;
  EXPECT_NE(out.find("decode cache for 1M"), std::string::npos) << out;
}

TEST(ModelInfo, FindsShippedConfigsByName) {
  int code = -1;
  const std::string out =
      run("cd " + std::string(ODYSSEY_SOURCE_DIR) + " && " + std::string(ODYSSEY_BINARY) + " model info tiny", &code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_GT(count_line(out, "total_params"), 0) << out;
  EXPECT_GT(count_line(out, "active_params"), 0) << out;
  EXPECT_NE(out.find("configs/model/tiny.toml"), std::string::npos) << out;
}

TEST(ModelInfo, OverridesChangeTheCounts) {
  int code = -1;
  const std::string base = run(std::string(ODYSSEY_BINARY) + " model info " + model_config("tiny"), &code);
  ASSERT_EQ(code, 0) << base;
  const std::string tied =
      run(std::string(ODYSSEY_BINARY) + " model info " + model_config("tiny") + " --set model.tie_embeddings=true", &code);
  ASSERT_EQ(code, 0) << tied;
  EXPECT_EQ(count_line(tied, "total_params"), count_line(base, "total_params") - 271 * 128);
}

TEST(ModelInfo, BadConfigNamesFileLineAndKey) {
  const std::string path = (std::filesystem::path(::testing::TempDir()) / ("model_info_bad_" + std::to_string(::getpid()) + ".toml")).string();
  std::ofstream(path) << "[model]\nnum_layers = 6\n\n[model.moe]\nrouted_experts = 8\ntop_k = 9\n";
  int code = -1;
  const std::string out = run(std::string(ODYSSEY_BINARY) + " model info " + path, &code);
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find(path + ":6: key 'model.moe.top_k' is 9"), std::string::npos) << out;
  EXPECT_EQ(out.find("total_params"), std::string::npos) << out;
}

TEST(ModelInfo, MissingConfigIsNamed) {
  int code = -1;
  const std::string out = run(std::string(ODYSSEY_BINARY) + " model info /nonexistent/model.toml", &code);
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("/nonexistent/model.toml"), std::string::npos) << out;
}

}  // namespace
