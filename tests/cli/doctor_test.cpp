// `odyssey doctor` runs every check for real on this machine and reports success.
#include <gtest/gtest.h>

#include "cli/run_command.h"

#include <array>
#include <cstdio>
#include <memory>
#include <string>

#include <sys/wait.h>

namespace {

std::string run(const std::string& cmd, int* code) { return odyssey::testing::run_shell(cmd, code); }

TEST(Doctor, EveryCheckPassesOnThisMachine) {
  int code = -1;
  std::string out = run(std::string(ODYSSEY_BINARY) + " doctor", &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("doctor: all checks passed"), std::string::npos) << out;
  EXPECT_NE(out.find("c10d"), std::string::npos) << out;
}

TEST(Cli, UnknownSubcommandFailsWithHelp) {
  int code = -1;
  std::string out = run(std::string(ODYSSEY_BINARY) + " frobnicate", &code);
  EXPECT_NE(code, 0);
  EXPECT_NE(out.find("frobnicate"), std::string::npos) << out;
}

}  // namespace
