// The conformance suite (envs/conformance.h) and the `odyssey env` commands, run as the real
// binary.
#include "envs/conformance.h"

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

#include <gtest/gtest.h>

#include "envs/json_schema.h"
#include "envs/plugin.h"

namespace odyssey::envs {
namespace {

using nlohmann::json;

const std::string kBinary = ODYSSEY_BINARY;
const std::string kTestPluginDir = ODYSSEY_TEST_PLUGIN_DIR;

// Runs a shell command line; returns stdout and stderr together, and the exit code.
std::string run_shell(const std::string& cmd, int* code) {
  std::string out;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  std::array<char, 4096> buf;
  while (size_t n = std::fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  *code = WEXITSTATUS(::pclose(p));
  return out;
}

SessionFactory in_process(const std::string& path, json config = json::object()) {
  auto plugin = Plugin::load(path);
  EXPECT_TRUE(plugin.ok()) << plugin.status().to_string();
  std::shared_ptr<Plugin> p = plugin.ok() ? *plugin : nullptr;
  return [p, config]() -> Result<std::unique_ptr<EnvSession>> {
    if (!p) return Status(StatusCode::kNotFound, "plugin did not load");
    return p->create(config);
  };
}

const CheckResult* find_check(const ConformanceReport& report, const std::string& name) {
  for (const CheckResult& c : report.checks)
    if (c.name == name) return &c;
  return nullptr;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(Conformance, TheExamplePluginPassesEveryCheck) {
  const ConformanceReport report =
      run_conformance(in_process(std::string(ODYSSEY_PLUGIN_DIR) + "/libody_env_guess.so"), ConformanceOptions{});
  EXPECT_TRUE(report.passed()) << report.to_text();
  for (const char* name : {"create", "tool schemas", "reset", "episodes", "early score", "determinism",
                           "different seeds", "rejected calls", "step after done", "snapshot"}) {
    const CheckResult* c = find_check(report, name);
    ASSERT_NE(c, nullptr) << name << "\n" << report.to_text();
    EXPECT_EQ(c->outcome, CheckOutcome::kPass) << name << ": " << c->detail;
  }
  EXPECT_EQ(find_check(report, "call time")->outcome, CheckOutcome::kSkip);  // in-process: no timeout to check
  EXPECT_TRUE(contains(find_check(report, "step after done")->detail, "refused: ")) << report.to_text();
  EXPECT_TRUE(contains(report.to_text(), "PASSED: 11 checks")) << report.to_text();
}

TEST(Conformance, ANondeterministicPluginFailsWithAReadableReason) {
  const ConformanceReport report =
      run_conformance(in_process(kTestPluginDir + "/libody_env_nondeterministic.so"), ConformanceOptions{});
  EXPECT_FALSE(report.passed());
  const CheckResult* c = find_check(report, "determinism");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->outcome, CheckOutcome::kFail);
  EXPECT_TRUE(contains(c->detail, "seed 1 twice, a second instance differs at reset /text")) << c->detail;
  const std::string text = report.to_text();
  EXPECT_TRUE(contains(text, "FAIL  determinism")) << text;
  EXPECT_TRUE(contains(text, "FAILED: 11 checks")) << text;
  // The rest of the suite still ran and passed.
  EXPECT_EQ(find_check(report, "episodes")->outcome, CheckOutcome::kPass) << text;
  EXPECT_EQ(find_check(report, "snapshot")->outcome, CheckOutcome::kSkip) << text;
}

TEST(Conformance, ASessionThatCannotBeCreatedIsOneFailedCheck) {
  const ConformanceReport report = run_conformance(
      in_process(std::string(ODYSSEY_PLUGIN_DIR) + "/libody_env_guess.so", json{{"max_guesses", "ten"}}),
      ConformanceOptions{});
  ASSERT_EQ(report.checks.size(), 1u) << report.to_text();
  EXPECT_TRUE(contains(report.to_text(), "FAILED: 1 check, 0 passed, 1 failed, 0 warnings, 0 skipped")) << report.to_text();
  EXPECT_EQ(report.checks[0].outcome, CheckOutcome::kFail);
  EXPECT_TRUE(contains(report.checks[0].detail, "'max_guesses' must be an integer")) << report.checks[0].detail;
}

TEST(MakeArguments, MakesValuesTheSchemaAccepts) {
  const json schema = json::parse(R"({"type": "object", "required": ["path", "count", "mode", "tags", "opt"],
      "properties": {"path": {"type": "string", "minLength": 6}, "count": {"type": "integer", "minimum": 3, "maximum": 5},
                     "mode": {"enum": ["r", "w"]}, "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
                     "opt": {"type": ["null", "boolean"]}},
      "additionalProperties": false})");
  auto compiled = JsonSchema::compile(schema, "test");
  ASSERT_TRUE(compiled.ok());
  for (int variant = 0; variant < 5; ++variant) {
    auto args = make_arguments(schema, variant);
    ASSERT_TRUE(args.has_value()) << variant;
    EXPECT_TRUE(compiled->validate(*args).empty()) << args->dump();
    EXPECT_GE((*args)["count"].get<int>(), 3);
    EXPECT_LE((*args)["count"].get<int>(), 5);
  }
  EXPECT_NE(make_arguments(schema, 0), make_arguments(schema, 1));  // variants differ
  // A schema no generated value satisfies.
  EXPECT_FALSE(make_arguments(json::parse(R"({"type": "object", "required": ["x"],
      "properties": {"x": {"type": "string", "pattern": "^[0-9]{4}$"}}})"),
                              0)
                   .has_value());
}

TEST(EnvCommand, ListShowsTheExamplePluginAndItsTools) {
  int code = 0;
  const std::string out = run_shell(kBinary + " env list", &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(contains(out, "guess 1.0.0  Guess the hidden number")) << out;
  EXPECT_TRUE(contains(out, "libody_env_guess.so")) << out;
  EXPECT_TRUE(contains(out, "guess  Guess the hidden number; answers higher, lower or correct")) << out;
  EXPECT_FALSE(contains(out, "nondeterministic")) << out;  // test plugins are not on the search path

  const std::string js = run_shell(kBinary + " env list --json --dir " + kTestPluginDir, &code);
  EXPECT_EQ(code, 0) << js;
  const json listed = json::parse(js, nullptr, false);
  ASSERT_TRUE(listed.is_object()) << js;
  bool found_guess = false;
  for (const json& p : listed["plugins"]) {
    if (p["name"] != "guess") continue;
    found_guess = true;
    EXPECT_EQ(p["tools"][0]["name"], "guess");
    EXPECT_EQ(p["source_hash"].get<std::string>().size(), 32u);
    EXPECT_TRUE(p["snapshots"].get<bool>());
  }
  EXPECT_TRUE(found_guess) << js;
  bool bad_schema_reported = false;
  for (const json& e : listed["errors"])
    bad_schema_reported |= contains(e["path"].get<std::string>(), "libody_env_bad_schema.so") &&
                           contains(e["error"].get<std::string>(), "tool 'search'");
  EXPECT_TRUE(bad_schema_reported) << js;
}

TEST(EnvCommand, CheckPassesTheExampleAndFailsTheNondeterministicPlugin) {
  int code = 0;
  const std::string good = run_shell(kBinary + " env check guess --episodes 2", &code);
  EXPECT_EQ(code, 0) << good;
  EXPECT_TRUE(contains(good, "PASS  determinism")) << good;
  EXPECT_TRUE(contains(good, "PASSED: 11 checks")) << good;

  const std::string bad = run_shell(kBinary + " env check " + kTestPluginDir + "/libody_env_nondeterministic.so", &code);
  EXPECT_EQ(code, 1) << bad;
  EXPECT_TRUE(contains(bad, "FAIL  determinism")) << bad;

  const std::string missing = run_shell(kBinary + " env check no_such_env", &code);
  EXPECT_EQ(code, 1) << missing;
  EXPECT_TRUE(contains(missing, "no environment plugin 'no_such_env'")) << missing;

  const std::string bad_config = run_shell(kBinary + " env check guess --config '{\"low\": '", &code);
  EXPECT_EQ(code, 2) << bad_config;
  EXPECT_TRUE(contains(bad_config, "--config is not valid JSON")) << bad_config;
}

TEST(EnvCommand, CheckHostedFailsACallThatTimesOutAndSaysWhich) {
  // hanging's second tool, spin, never returns: the scripted episode's second step calls it.
  int code = 0;
  const std::string out = run_shell(kBinary + " env check --hosted " + kTestPluginDir +
                                        "/libody_env_hanging.so --timeout-ms 300 --episodes 1 --max-steps 2",
                                    &code);
  EXPECT_EQ(code, 1) << out;
  EXPECT_TRUE(contains(out, "PASS  reset")) << out;
  EXPECT_TRUE(contains(out, "FAIL  episodes         seed 1: step 2: ")) << out;
  EXPECT_TRUE(contains(out, "did not answer step within 300 ms")) << out;
  EXPECT_TRUE(contains(out, "FAIL  call time")) << out;
  EXPECT_TRUE(contains(out, "calls timed out, first step: ")) << out;
}

}  // namespace
}  // namespace odyssey::envs
