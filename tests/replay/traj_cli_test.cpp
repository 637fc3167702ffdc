// `odyssey traj ls | show | export` on a store written by a real service: an agentic
// trajectory with a user prompt, an assistant tool call, a tool result and an answer.
#include <atomic>
#include <fstream>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/tokenizer.h"
#include "replay/client.h"
#include "replay/service.h"
#include "test_helpers.h"

namespace odyssey::replay {
namespace {

using testing::TempDir;

// Appends one turn (role header, text, end of turn) to `d`.
void add_turn(SegmentData& d, const Tokenizer& tok, schema::Role role, SpecialToken header, const std::string& text,
              bool model) {
  const uint32_t start = static_cast<uint32_t>(d.tokens.size());
  std::vector<uint32_t> ids = {tok.special_id(header)};
  auto body = tok.encode(text);
  ids.insert(ids.end(), body.begin(), body.end());
  ids.push_back(tok.special_id(SpecialToken::kEndTurn));
  for (uint32_t id : ids) {
    d.tokens.push_back(id);
    d.logprobs.push_back(model ? -0.1f : 0.0f);
    d.policy_versions.push_back(2);
    d.loss_mask.push_back(model ? 1 : 0);
  }
  d.turns.push_back({role, start, static_cast<uint32_t>(ids.size()), false});
}

class TrajCli : public ::testing::Test {
 protected:
  void SetUp() override {
    ServiceOptions so;
    so.store.dir = tmp_.str("store");
    so.listen = "tcp://127.0.0.1:*";
    so.stats_every_seconds = 0;
    auto service = ReplayService::create(so);
    ASSERT_TRUE(service.ok()) << service.status().to_string();
    std::atomic<bool> stop{false};
    std::thread loop([&] { (void)(*service)->run(stop); });
    ClientOptions co;
    co.endpoint = (*service)->endpoint();
    auto writer = TrajectoryWriter::connect(co);
    ASSERT_TRUE(writer.ok());
    ByteTokenizer tok;
    for (int i = 0; i < 3; ++i) {
      TrajectoryMeta meta;
      meta.id = 0x100 + i;
      meta.job = i == 2 ? "other-job" : "arith-rl";
      meta.environment = "arith";
      meta.environment_version = "1.0";
      meta.task = "task-" + std::to_string(i);
      auto id = (*writer)->begin(meta);
      ASSERT_TRUE(id.ok());
      SegmentData d;
      add_turn(d, tok, schema::Role::USER, SpecialToken::kUser, "What is 17*23?", false);
      const uint32_t call_at = static_cast<uint32_t>(d.tokens.size());
      add_turn(d, tok, schema::Role::ASSISTANT, SpecialToken::kAssistant,
               "Let me compute. {\"name\":\"calculator\",\"arguments\":{\"expression\":\"17*23\"}}", true);
      const uint32_t result_at = static_cast<uint32_t>(d.tokens.size());
      add_turn(d, tok, schema::Role::TOOL, SpecialToken::kTool, "391", false);
      add_turn(d, tok, schema::Role::ASSISTANT, SpecialToken::kAssistant, "The answer is 391.", true);
      ToolCallData call;
      call.call_id = "call_0";
      call.name = "calculator";
      call.arguments = R"({"expression":"17*23"})";
      call.result = "391";
      call.wall_time_nanos = 1500000;
      call.call_token_start = call_at + 1;
      call.result_token_start = result_at + 1;
      d.tool_calls.push_back(call);
      ASSERT_TRUE((*writer)->append(*id, d).ok());
      ASSERT_TRUE((*writer)->end(*id, Reward{i == 1 ? 0.0 : 1.0, {{"correct", i == 1 ? 0.0 : 1.0}}}).ok());
    }
    ASSERT_TRUE((*writer)->flush().ok());
    stop = true;
    loop.join();
  }
  std::string run(std::vector<std::string> args, int expect_code = 0) {
    args.insert(args.begin(), ODYSSEY_BINARY);
    std::string out;
    EXPECT_EQ(testing::run_command(args, &out), expect_code) << out;
    return out;
  }
  TempDir tmp_;
};

TEST_F(TrajCli, LsListsAndFilters) {
  auto all = run({"traj", "ls", "--dir", tmp_.str("store")});
  EXPECT_NE(all.find("0000000000000100"), std::string::npos) << all;
  EXPECT_NE(all.find("3 of 3 matching"), std::string::npos) << all;
  auto job = run({"traj", "ls", "--dir", tmp_.str("store"), "--job", "arith-rl", "--reward-min", "0.5"});
  EXPECT_NE(job.find("1 of 1 matching"), std::string::npos) << job;
  EXPECT_NE(job.find("0000000000000100"), std::string::npos) << job;
  auto bad = run({"traj", "ls", "--dir", tmp_.str("store"), "--status", "finished"}, 2);
  EXPECT_NE(bad.find("--status"), std::string::npos) << bad;
}

TEST_F(TrajCli, ShowPrintsTurnsToolCallsAndRewards) {
  auto out = run({"traj", "show", "--dir", tmp_.str("store"), "0000000000000100"});
  EXPECT_NE(out.find("What is 17*23?"), std::string::npos) << out;
  EXPECT_NE(out.find("calculator"), std::string::npos) << out;
  EXPECT_NE(out.find("391"), std::string::npos) << out;
  EXPECT_NE(out.find("arith"), std::string::npos) << out;
  auto missing = run({"traj", "show", "--dir", tmp_.str("store"), "00000000000000ff"}, 2);
  EXPECT_NE(missing.find("unknown trajectory 00000000000000ff"), std::string::npos) << missing;
}

TEST_F(TrajCli, ExportWritesOpenAiChatJsonlWithToolCallsAndTokens) {
  auto out = run({"traj", "export", "--dir", tmp_.str("store"), "--format", "jsonl", "--job", "arith-rl",
                  "--out", tmp_.str("out.jsonl")});
  std::ifstream in(tmp_.str("out.jsonl"));
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    ++lines;
    auto j = nlohmann::json::parse(line);
    ASSERT_TRUE(j["messages"].is_array());
    const auto& m = j["messages"];
    ASSERT_GE(m.size(), 4u) << line;
    EXPECT_EQ(m[0]["role"], "user");
    EXPECT_EQ(m[1]["role"], "assistant");
    ASSERT_TRUE(m[1].contains("tool_calls")) << line;
    EXPECT_EQ(m[1]["tool_calls"][0]["function"]["name"], "calculator");
    EXPECT_EQ(m[1]["tool_calls"][0]["type"], "function");
    EXPECT_EQ(m[2]["role"], "tool");
    EXPECT_EQ(m[2]["tool_call_id"], "call_0");
    EXPECT_EQ(m[2]["content"], "391");
    EXPECT_EQ(j["environment"]["name"], "arith");
    EXPECT_EQ(j["tokens"]["ids"].size(), j["tokens"]["loss_mask"].size());
    EXPECT_EQ(j["tokens"]["policy_versions"][0], 2);
  }
  EXPECT_EQ(lines, 2);
  run({"traj", "export", "--dir", tmp_.str("store"), "--format", "parquet"}, 2);
}

}  // namespace
}  // namespace odyssey::replay
