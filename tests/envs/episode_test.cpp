// Episode: model turns (tokens) in, observations out, every call recorded; session failures
// become error observations and failed episodes. Real plugins, in-process and hosted.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/tokenizer.h"
#include "envs/env_host.h"
#include "envs/episode.h"
#include "envs/plugin.h"

namespace odyssey::envs {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

std::string test_plugin(const std::string& name) {
  return std::string(ODYSSEY_TEST_PLUGIN_DIR) + "/libody_env_" + name + ".so";
}
std::string example_plugin(const std::string& name) {
  return std::string(ODYSSEY_PLUGIN_DIR) + "/libody_env_" + name + ".so";
}

HostOptions test_options() {
  HostOptions o;
  o.odyssey_binary = ODYSSEY_BINARY;
  o.call_timeout = 5s;
  return o;
}

// A model turn: text, then each call's text between <|tool_call|> and <|/tool_call|>, then <|end_turn|>.
std::vector<uint32_t> turn(const Tokenizer& tok, const std::string& text, const std::vector<std::string>& calls) {
  std::vector<uint32_t> ids = tok.encode(text);
  for (const std::string& c : calls) {
    ids.push_back(tok.special_id(SpecialToken::kToolCall));
    const std::vector<uint32_t> body = tok.encode(c);
    ids.insert(ids.end(), body.begin(), body.end());
    ids.push_back(tok.special_id(SpecialToken::kToolCallEnd));
  }
  ids.push_back(tok.special_id(SpecialToken::kEndTurn));
  return ids;
}

std::unique_ptr<EnvSession> in_process(const std::string& path, const json& config) {
  auto plugin = Plugin::load(path);
  EXPECT_TRUE(plugin.ok()) << plugin.status().to_string();
  auto session = (*plugin)->create(config);
  EXPECT_TRUE(session.ok()) << session.status().to_string();
  return std::move(session).value();
}

TEST(Episode, RecordsEveryCallWithTheTrajectoryStatuses) {
  ByteTokenizer tok;
  auto session = in_process(example_plugin("guess"), json::object());
  Episode episode(*session, tok);
  const env::Observation prompt = episode.start({{"target", 42}}, 1);
  EXPECT_NE(prompt.text.find("between 1 and 100"), std::string::npos);

  const env::Observation obs = episode.take_turn(turn(tok, "Let me try.",
                                                      {R"({"name": "guess", "arguments": {"n": 50}})",
                                                       R"({"name": "guess", "arguments": {"n": )",
                                                       R"({"name": "peek", "arguments": {}})",
                                                       R"({"name": "guess", "arguments": {"n": "ten"}})",
                                                       R"({"name": "guess", "arguments": {"n": 101}})"}));
  EXPECT_FALSE(obs.done);
  ASSERT_EQ(obs.tool_results.size(), 5u);
  EXPECT_EQ(obs.tool_results[0].content, "lower");
  for (size_t i = 1; i < 5; ++i) EXPECT_TRUE(obs.tool_results[i].is_error) << i;

  const std::vector<ToolCallRecord>& calls = episode.calls();
  ASSERT_EQ(calls.size(), 5u);
  const std::vector<ToolCallStatus> expected = {ToolCallStatus::kOk, ToolCallStatus::kMalformedCall,
                                                ToolCallStatus::kUnknownTool, ToolCallStatus::kBadArguments,
                                                ToolCallStatus::kToolError};
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(calls[i].call_id, "call_" + std::to_string(i));
    EXPECT_EQ(calls[i].status, expected[i]) << i << ": " << tool_call_status_name(calls[i].status);
    EXPECT_EQ(calls[i].result, obs.tool_results[i].content);
    EXPECT_EQ(calls[i].turn, 0u);
  }
  EXPECT_EQ(calls[0].name, "guess");
  EXPECT_EQ(calls[0].arguments, R"({"n":50})");
  EXPECT_EQ(calls[0].error, "");
  EXPECT_GT(calls[0].wall_time_nanos, 0);
  EXPECT_EQ(calls[0].token_offset, tok.encode("Let me try.").size());
  EXPECT_EQ(calls[1].name, "");
  EXPECT_EQ(calls[1].arguments, R"({"name": "guess", "arguments": {"n": )");
  EXPECT_EQ(calls[1].wall_time_nanos, 0);
  EXPECT_EQ(calls[2].name, "peek");
  EXPECT_EQ(calls[3].name, "guess");
  EXPECT_NE(calls[4].error.find("n must lie in [1, 100]"), std::string::npos) << calls[4].error;
  EXPECT_STREQ(tool_call_status_name(calls[2].status), "unknownTool");

  const env::Observation found = episode.take_turn(turn(tok, "", {R"({"name": "guess", "arguments": {"n": 42}})"}));
  EXPECT_TRUE(found.done);
  EXPECT_TRUE(episode.done());
  EXPECT_FALSE(episode.failed());
  EXPECT_EQ(episode.calls().back().turn, 1u);
  EXPECT_EQ(episode.calls().back().call_id, "call_5");
  const EpisodeScore grade = episode.finish();
  EXPECT_FALSE(grade.failed);
  EXPECT_TRUE(grade.score.success);
  EXPECT_GT(grade.score.reward, 0.5);

  const env::Observation over = episode.take_turn(turn(tok, "more?", {}));
  EXPECT_TRUE(over.done);
  EXPECT_EQ(episode.calls().size(), 6u);
}

TEST(Episode, GivesTheSameObservationsHostedAndInProcess) {
  ByteTokenizer tok;
  const json config = {{"high", 500}};
  auto local = in_process(example_plugin("guess"), config);
  auto hosted = HostedSession::start(example_plugin("guess"), config, test_options());
  ASSERT_TRUE(hosted.ok()) << hosted.status().to_string();
  Episode a(*local, tok);
  Episode b(**hosted, tok);
  const env::Observation pa = a.start(json::object(), 2024);
  const env::Observation pb = b.start(json::object(), 2024);
  EXPECT_EQ(render_observation(pa, tok, SpecialToken::kUser).tokens,
            render_observation(pb, tok, SpecialToken::kUser).tokens);
  const std::vector<std::string> turns = {R"({"name": "guess", "arguments": {"n": 250}})",
                                          R"({"name": "guess", "arguments": {"n": 125}})", R"(not json)",
                                          R"({"name": "guess", "arguments": {"n": 375}})"};
  for (const std::string& call : turns) {
    const auto tokens = turn(tok, "thinking", {call});
    const env::Observation x = a.take_turn(tokens);
    const env::Observation y = b.take_turn(tokens);
    EXPECT_EQ(render_observation(x, tok).tokens, render_observation(y, tok).tokens);
    EXPECT_EQ(x.done, y.done);
  }
  ASSERT_EQ(a.calls().size(), b.calls().size());
  for (size_t i = 0; i < a.calls().size(); ++i) {
    EXPECT_EQ(a.calls()[i].result, b.calls()[i].result);
    EXPECT_EQ(a.calls()[i].status, b.calls()[i].status);
  }
  EXPECT_EQ(a.finish().score.reward, b.finish().score.reward);
}

TEST(Episode, TurnsAHostCrashIntoAnErrorObservationAndAFailedGrade) {
  ByteTokenizer tok;
  auto session = HostedSession::start(test_plugin("crashing"), json::object(), test_options());
  ASSERT_TRUE(session.ok()) << session.status().to_string();
  {
    Episode episode(**session, tok);
    episode.start(json::object(), 1);
    const env::Observation obs = episode.take_turn(
        turn(tok, "", {R"({"name": "echo", "arguments": {"text": "a"}})", R"({"name": "crash"})", R"({"name": "nope"})"}));
    EXPECT_TRUE(obs.done);
    EXPECT_TRUE(episode.done());
    EXPECT_TRUE(episode.failed());
    const std::string expected = "tool environment error: env-host for plugin 'crashing' died with SIGSEGV during step";
    EXPECT_EQ(obs.text, expected);
    ASSERT_EQ(obs.tool_results.size(), 3u);
    EXPECT_EQ(obs.tool_results[0].content, expected);
    EXPECT_TRUE(obs.tool_results[1].is_error);
    EXPECT_NE(obs.tool_results[2].content.find("unknown tool 'nope'"), std::string::npos);
    ASSERT_EQ(episode.calls().size(), 3u);
    EXPECT_EQ(episode.calls()[0].status, ToolCallStatus::kCrashed);
    EXPECT_EQ(episode.calls()[1].status, ToolCallStatus::kCrashed);
    EXPECT_EQ(episode.calls()[2].status, ToolCallStatus::kUnknownTool);
    EXPECT_EQ(episode.calls()[0].error, "env-host for plugin 'crashing' died with SIGSEGV during step");

    const EpisodeScore grade = episode.finish();
    EXPECT_TRUE(grade.failed);
    EXPECT_EQ(grade.failure, "env-host for plugin 'crashing' died with SIGSEGV during step");
    EXPECT_EQ(grade.score.reward, 0.0);
    EXPECT_FALSE(grade.score.success);
    EXPECT_EQ(grade.score.info["failed"], true);
  }
  // The next episode on the same session gets a fresh host and completes.
  Episode next(**session, tok);
  next.start(json::object(), 2);
  EXPECT_FALSE(next.failed());
  next.take_turn(turn(tok, "", {R"({"name": "echo", "arguments": {"text": "b"}})"}));
  const env::Observation last = next.take_turn(turn(tok, "done", {}));
  EXPECT_TRUE(last.done);
  const EpisodeScore grade = next.finish();
  EXPECT_FALSE(grade.failed) << grade.failure;
  EXPECT_EQ(grade.score.reward, 1.0);
  EXPECT_EQ((*session)->counters().restarts, 1u);
}

TEST(Episode, TurnsATimeoutIntoAnErrorObservationAndAFailedGrade) {
  ByteTokenizer tok;
  HostOptions options = test_options();
  options.call_timeout = 300ms;
  auto session = HostedSession::start(test_plugin("hanging"), json::object(), options);
  ASSERT_TRUE(session.ok()) << session.status().to_string();
  Episode episode(**session, tok);
  episode.start(json::object(), 1);
  const env::Observation obs = episode.take_turn(turn(tok, "", {R"({"name": "spin"})"}));
  EXPECT_TRUE(obs.done);
  EXPECT_EQ(obs.text.rfind("tool environment error: env-host for plugin 'hanging' did not answer step within 300 ms",
                           0),
            0u)
      << obs.text;
  ASSERT_EQ(episode.calls().size(), 1u);
  EXPECT_EQ(episode.calls()[0].status, ToolCallStatus::kTimeout);
  EXPECT_GE(episode.calls()[0].wall_time_nanos, 300'000'000);
  const EpisodeScore grade = episode.finish();
  EXPECT_TRUE(grade.failed);
  EXPECT_NE(grade.failure.find("did not answer step"), std::string::npos);
}

TEST(Episode, TurnsAFailedResetIntoAFailedEpisode) {
  ByteTokenizer tok;
  auto session = in_process(example_plugin("guess"), json::object());
  Episode episode(*session, tok);
  const env::Observation obs = episode.start({{"target", 1000}}, 1);
  EXPECT_TRUE(obs.done);
  EXPECT_EQ(obs.text.rfind(kEnvErrorPrefix, 0), 0u);
  EXPECT_NE(obs.text.find("'target' must lie in [1, 100]"), std::string::npos) << obs.text;
  EXPECT_TRUE(episode.failed());
  EXPECT_TRUE(episode.finish().failed);
}

}  // namespace
}  // namespace odyssey::envs
