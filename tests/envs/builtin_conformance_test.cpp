// Every built-in environment and the example pass the conformance suite (envs/conformance.h),
// in-process and, for one of them, under the sandboxed env-host. (needle and files run it in
// their own suites with their own configs.)
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "envs/conformance.h"
#include "envs/env_host.h"
#include "envs/plugin.h"

namespace odyssey::envs {
namespace {

using nlohmann::json;

void expect_conformant(const std::string& name, const json& config) {
  auto path = find_plugin(name, {ODYSSEY_PLUGIN_DIR});
  ASSERT_TRUE(path.ok()) << path.status().to_string();
  auto plugin = Plugin::load(*path);
  ASSERT_TRUE(plugin.ok()) << plugin.status().to_string();
  std::shared_ptr<Plugin> p = *plugin;
  const ConformanceReport report = run_conformance([p, config]() { return p->create(config); }, ConformanceOptions{});
  EXPECT_TRUE(report.passed()) << report.to_text();
  std::printf("%s", report.to_text().c_str());
}

TEST(BuiltinConformance, ArithPasses) { expect_conformant("arith", json::object()); }
TEST(BuiltinConformance, ArithPassesAtTheEasiestSetting) {
  expect_conformant("arith", {{"min_steps", 1}, {"max_steps", 1}, {"max_operand", 9}});
}
TEST(BuiltinConformance, GridworldPasses) { expect_conformant("gridworld", json::object()); }
TEST(BuiltinConformance, GuessExamplePasses) { expect_conformant("guess", json::object()); }

TEST(BuiltinConformance, ArithPassesUnderTheSandboxedHost) {
  auto path = find_plugin("arith", {ODYSSEY_PLUGIN_DIR});
  ASSERT_TRUE(path.ok()) << path.status().to_string();
  HostOptions host;
  host.odyssey_binary = ODYSSEY_BINARY;
  host.call_timeout = std::chrono::milliseconds(10000);
  ConformanceOptions options;
  options.call_timeout = host.call_timeout;
  options.episodes = 1;
  const ConformanceReport report = run_conformance(
      [p = *path, host]() -> Result<std::unique_ptr<EnvSession>> {
        ODY_ASSIGN_OR_RETURN(auto session, HostedSession::start(p, json::object(), host));
        return std::unique_ptr<EnvSession>(std::move(session));
      },
      options);
  EXPECT_TRUE(report.passed()) << report.to_text();
}

}  // namespace
}  // namespace odyssey::envs
