// `odyssey env check` on an MCP server's environment config (configs/envs/mcp-filesystem.json,
// the reference filesystem server from npm): the conformance suite runs through McpSession.
#include <cstdlib>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "cli/run_command.h"

namespace odyssey::envs {
namespace {

namespace fs = std::filesystem;

std::string npm_prefix() {
  if (const char* dir = std::getenv("ODYSSEY_NPM_DIR"); dir != nullptr && *dir != '\0') return dir;
  for (fs::path p = fs::path(ODYSSEY_BINARY).parent_path(); !p.empty() && p != p.root_path(); p = p.parent_path())
    if (fs::exists(p / "CMakeCache.txt")) return (p / "npm").string();
  return "";
}

TEST(EnvCheckMcp, ConformanceSuitePassesOnTheFilesystemServerConfigByName) {
  const std::string npm = npm_prefix();
  ASSERT_TRUE(fs::exists(npm + "/node_modules/@modelcontextprotocol/server-filesystem"))
      << "the MCP filesystem server is not installed under " << npm << "; run ./dev.sh test";
  int code = 0;
  const std::string out = odyssey::testing::run_shell(
      "cd " + std::string(ODYSSEY_SOURCE_DIR) + " && ODYSSEY_NPM_DIR=" + npm + " " + ODYSSEY_BINARY +
          " env check mcp-filesystem --episodes 1",
      &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("PASS  tool schemas"), std::string::npos) << out;
  EXPECT_NE(out.find("PASS  rejected calls"), std::string::npos) << out;
  EXPECT_NE(out.find("0 failed"), std::string::npos) << out;
}

TEST(EnvCheckMcp, AnUnknownNameSaysNeitherPluginNorMcpConfigWasFound) {
  int code = 0;
  const std::string out =
      odyssey::testing::run_shell(std::string(ODYSSEY_BINARY) + " env check no-such-environment-xyz", &code);
  EXPECT_NE(code, 0);
  EXPECT_NE(out.find("nor an MCP environment config"), std::string::npos) << out;
}

}  // namespace
}  // namespace odyssey::envs
