#include "replay/audit.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/codec.h"
#include "core/utf8.h"

namespace odyssey::replay {
namespace {

using nlohmann::json;

constexpr uint64_t kId = 0xabc;
constexpr int64_t kStarted = 1714564800000000000;  // 2024-05-01T12:00:00Z
const std::string kImageBytes = "\x89PNG\r\n\x1a\n";

// Builds one segment's tokens with the layout an actor writes.
class SegmentBuilder {
 public:
  uint32_t size() const { return static_cast<uint32_t>(data.tokens.size()); }
  void special(SpecialToken t, bool model = false) { push(tok.special_id(t), model); }
  void text(std::string_view s, bool model = false) {
    for (uint32_t id : tok.encode(s)) push(id, model);
  }
  // Opens a turn piece; close_turn() sets its length.
  void open_turn(schema::Role role, bool continued = false) {
    data.turns.push_back({role, size(), 0, continued});
  }
  void close_turn() { data.turns.back().length = size() - data.turns.back().start; }

  ByteTokenizer tok;
  SegmentData data;
  uint32_t version = 3;

 private:
  void push(uint32_t id, bool model) {
    data.tokens.push_back(id);
    data.logprobs.push_back(model ? -0.25f : 0.0f);
    data.policy_versions.push_back(version);
    data.loss_mask.push_back(model ? 1 : 0);
  }
};

// A trajectory record plus encoded segments, readable through MessageViews.
class StoredTrajectory {
 public:
  StoredTrajectory() {
    auto r = record_message.initRoot<schema::Trajectory>();
    r.setId(kId);
    r.setJob("job-1");
    r.initEnvironment().setName("calculator");
    r.getEnvironment().setVersion("1.0");
    r.getEnvironment().setPluginHash("sha256:feed");
    r.setTask("add two numbers");
    r.setSeed(42);
    r.setGroupId(7);
    r.setGroupSize(4);
    r.setTokenizer("byte-v1");
    r.setWriter("actor-0");
    r.setStatus(schema::TrajectoryStatus::COMPLETE);
    r.setRewardTotal(1.5);
    auto parts = r.initRewardParts(2);
    parts[0].setName("correct");
    parts[0].setValue(1.0);
    parts[1].setName("format");
    parts[1].setValue(0.5);
    r.setMinPolicyVersion(3);
    r.setMaxPolicyVersion(4);
    r.setStartedUnixNanos(kStarted);
    r.setEndedUnixNanos(kStarted + 62500000000);  // 1m02.5s later
  }

  void add(const SegmentData& data) {
    SegmentPosition pos{kId, static_cast<uint32_t>(bytes.size()), tokens, prev};
    auto enc = encode_segment(pos, data);
    ASSERT_TRUE(enc.ok()) << enc.status().to_string();
    prev = enc->hash;
    tokens += data.tokens.size();
    bytes.push_back(std::move(enc->bytes));
    auto r = record_message.getRoot<schema::Trajectory>();
    r.setNumSegments(static_cast<uint32_t>(bytes.size()));
    r.setNumTokens(tokens);
  }

  schema::Trajectory::Reader record() { return record_message.getRoot<schema::Trajectory>().asReader(); }

  std::vector<schema::Segment::Reader> segments() {
    views.clear();
    std::vector<schema::Segment::Reader> out;
    for (const auto& b : bytes) {
      views.push_back(std::make_unique<MessageView>(b));
      out.push_back(views.back()->root<schema::Segment>());
    }
    return out;
  }

  capnp::MallocMessageBuilder record_message;
  std::vector<std::string> bytes;
  std::vector<std::unique_ptr<MessageView>> views;
  uint64_t tokens = 0;
  Hash128 prev;
};

// system, user, then an assistant turn that starts in segment 0 and ends in segment 1 with
// a tool call whose result (with invalid UTF-8) is the tool turn after it; segment 2 has a
// user turn with an image and the final answer, routed experts and a state snapshot.
void build_calculator_trajectory(StoredTrajectory& t) {
  SegmentBuilder s0;
  s0.open_turn(schema::Role::SYSTEM);
  s0.special(SpecialToken::kSystem);
  s0.text("You are a calculator.");
  s0.special(SpecialToken::kEndTurn);
  s0.close_turn();
  s0.open_turn(schema::Role::USER);
  s0.special(SpecialToken::kUser);
  s0.text("What is 2+2? <|eos|>");  // spelled, not the control token
  s0.special(SpecialToken::kEndTurn);
  s0.close_turn();
  s0.open_turn(schema::Role::ASSISTANT);
  s0.special(SpecialToken::kAssistant, true);
  s0.text("Let me comp", true);
  s0.close_turn();
  t.add(s0.data);

  SegmentBuilder s1;
  s1.version = 4;
  s1.open_turn(schema::Role::ASSISTANT, /*continued=*/true);
  s1.text("ute.", true);
  const uint32_t call_at = s1.size();
  s1.special(SpecialToken::kToolCall, true);
  s1.text(R"({"name":"calc","arguments":{"expression":"2+2"}})", true);
  s1.special(SpecialToken::kToolCallEnd, true);
  s1.special(SpecialToken::kEndTurn, true);
  s1.close_turn();
  const uint32_t result_at = s1.size();
  s1.open_turn(schema::Role::TOOL);
  s1.special(SpecialToken::kTool);
  s1.special(SpecialToken::kToolResult);
  s1.text("4 \xff\xfe");
  s1.special(SpecialToken::kToolResultEnd);
  s1.special(SpecialToken::kEndTurn);
  s1.close_turn();
  ToolCallData call;
  call.call_id = "call-1";
  call.name = "calc";
  call.arguments = R"({"expression":"2+2"})";
  call.result = "4 \xff\xfe";
  call.wall_time_nanos = 1200000;
  call.call_token_start = call_at;
  call.result_token_start = result_at;
  s1.data.tool_calls.push_back(call);
  t.add(s1.data);

  SegmentBuilder s2;
  s2.version = 4;
  s2.open_turn(schema::Role::USER);
  s2.special(SpecialToken::kUser);
  s2.text("And this?");
  ImageData image;
  image.token_offset = s2.size();
  image.num_patch_tokens = 4;
  image.width = 32;
  image.height = 16;
  image.media_type = "image/png";
  image.data = kImageBytes;
  s2.data.images.push_back(image);
  s2.special(SpecialToken::kImage);
  for (int i = 0; i < 4; ++i) s2.special(SpecialToken::kImagePatch);
  s2.special(SpecialToken::kImageEnd);
  s2.special(SpecialToken::kEndTurn);
  s2.close_turn();
  s2.open_turn(schema::Role::ASSISTANT);
  s2.special(SpecialToken::kAssistant, true);
  s2.text("The answer is 4.", true);
  s2.special(SpecialToken::kEndTurn, true);
  s2.close_turn();
  RoutedExpertsData experts;
  experts.num_layers = 2;
  experts.top_k = 1;
  for (uint32_t i = 0; i < s2.size(); ++i) {
    experts.experts.push_back(5);
    experts.experts.push_back(static_cast<uint16_t>(i % 3));
  }
  s2.data.routed_experts = experts;
  s2.data.state_snapshots.push_back({/*token_position=*/t.tokens + s2.size(), /*policy_version=*/4,
                                     "odyssey.model.state/1", std::string(2048, 'x')});
  t.add(s2.data);
}

std::string show(StoredTrajectory& t, ShowOptions options = {}) {
  ByteTokenizer tok;
  std::ostringstream out;
  ShowRenderer renderer(tok, out, options);
  Status st = render_trajectory(renderer, t.record(), t.segments());
  EXPECT_TRUE(st.ok()) << st.to_string();
  return out.str();
}

json export_line(StoredTrajectory& t, ExportOptions options = {}) {
  ByteTokenizer tok;
  std::ostringstream out;
  ChatJsonlRenderer renderer(tok, out, options);
  Status st = render_trajectory(renderer, t.record(), t.segments());
  EXPECT_TRUE(st.ok()) << st.to_string();
  const std::string line = out.str();
  EXPECT_TRUE(is_valid_utf8(line));
  EXPECT_EQ(std::count(line.begin(), line.end(), '\n'), 1) << "one line per trajectory";
  return json::parse(line);
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

TEST(ShowRenderer, WritesTheHeaderWithIdentityRewardsSizesAndTimings) {
  StoredTrajectory t;
  build_calculator_trajectory(t);
  const std::string text = show(t);
  EXPECT_TRUE(contains(text, "trajectory 0000000000000abc\n")) << text;
  EXPECT_TRUE(contains(text, "job          job-1\n")) << text;
  EXPECT_TRUE(contains(text, "environment  calculator 1.0 (plugin sha256:feed)\n")) << text;
  EXPECT_TRUE(contains(text, "task         add two numbers\n")) << text;
  EXPECT_TRUE(contains(text, "seed         42\n")) << text;
  EXPECT_TRUE(contains(text, "group        0000000000000007 (size 4)\n")) << text;
  EXPECT_TRUE(contains(text, "status       complete\n")) << text;
  EXPECT_TRUE(contains(text, "reward       1.5 (correct 1, format 0.5)\n")) << text;
  EXPECT_TRUE(contains(text, fmt::format("tokens       {} in 3 segments", t.tokens))) << text;
  EXPECT_TRUE(contains(text, "policy       versions 3..4\n")) << text;
  EXPECT_TRUE(contains(text, "started      2024-05-01T12:00:00.000Z\n")) << text;
  EXPECT_TRUE(contains(text, "ended        2024-05-01T12:01:02.500Z (took 1m02s)\n")) << text;
}

TEST(ShowRenderer, WritesTurnsInOrderAndMergesATurnSplitAcrossSegments) {
  StoredTrajectory t;
  build_calculator_trajectory(t);
  const std::string text = show(t);
  EXPECT_TRUE(contains(text, "[0] system")) << text;
  EXPECT_TRUE(contains(text, "<|system|>You are a calculator.<|end_turn|>")) << text;
  EXPECT_TRUE(contains(text, "What is 2+2? <|eos|><|end_turn|>")) << text;
  // One assistant turn over segments 0 and 1, its text whole.
  EXPECT_TRUE(contains(text, "[2] assistant")) << text;
  EXPECT_TRUE(contains(text, "seq 0-1)")) << text;
  EXPECT_TRUE(contains(text, "<|assistant|>Let me compute.<|tool_call|>")) << text;
  EXPECT_FALSE(contains(text, "[3] assistant")) << text;
  EXPECT_TRUE(contains(text, "[3] tool")) << text;
  EXPECT_TRUE(contains(text, "[5] assistant")) << text;
  EXPECT_LT(text.find("[0] system"), text.find("[2] assistant"));
  EXPECT_LT(text.find("[3] tool"), text.find("[4] user"));
  EXPECT_TRUE(contains(text, "summary: 6 turns, 1 tool call (0 not ok), 1 image, 0 tokens outside any turn")) << text;
  EXPECT_FALSE(contains(text, "note:")) << text;
  EXPECT_TRUE(is_valid_utf8(text));
}

TEST(ShowRenderer, ShowsToolCallsImagesSnapshotsAndExperts) {
  StoredTrajectory t;
  build_calculator_trajectory(t);
  const std::string text = show(t);
  EXPECT_TRUE(contains(text, "tool call call-1 calc: ok, 1.20ms\n")) << text;
  EXPECT_TRUE(contains(text, R"(arguments: {"expression":"2+2"})")) << text;
  EXPECT_TRUE(contains(text, "result (4 bytes): 4 \xEF\xBF\xBD\xEF\xBF\xBD\n")) << text;
  EXPECT_TRUE(contains(text, "And this?[image 32x16 image/png, 8 bytes, 4 patch tokens]<|end_turn|>")) << text;
  EXPECT_TRUE(contains(text, "state snapshots: 1, 2.0 KiB")) << text;
  EXPECT_TRUE(contains(text, "odyssey.model.state/1")) << text;
  EXPECT_TRUE(contains(text, "routed experts: ")) << text;
  EXPECT_TRUE(contains(text, "2 layers x top-1, 4 distinct experts; most used: 5 (50.0%)")) << text;
}

TEST(ShowRenderer, CutsLongTurnsAndResultsAtTheLimitsWithANote) {
  StoredTrajectory t;
  build_calculator_trajectory(t);
  ShowOptions options;
  options.max_turn_bytes = 12;
  options.max_result_bytes = 2;
  const std::string text = show(t, options);
  EXPECT_TRUE(contains(text, "    <|system|>Yo\n")) << text;
  EXPECT_TRUE(contains(text, "    ... [cut at 12 bytes; the turn has 23 tokens]\n")) << text;
  EXPECT_TRUE(contains(text, "result (4 bytes, first 2 shown): 4 \n")) << text;
}

TEST(ShowRenderer, ListsTokenIdsWhenAsked) {
  StoredTrajectory t;
  build_calculator_trajectory(t);
  ShowOptions options;
  options.show_token_ids = true;
  const std::string text = show(t, options);
  // The first token: position 0, id 259 (<|system|>), not a model token.
  EXPECT_TRUE(contains(text, "       0     259  <|system|>         lp    0.0000  v3  mask 0\n")) << text;
}

TEST(ShowRenderer, EscapesTerminalControlBytesFromStoredData) {
  StoredTrajectory t;
  SegmentBuilder s;
  s.open_turn(schema::Role::TOOL);
  s.text("\x1b[2Jgone");
  s.close_turn();
  t.add(s.data);
  const std::string text = show(t);
  EXPECT_FALSE(contains(text, "\x1b")) << text;
  EXPECT_TRUE(contains(text, "\\x1b[2Jgone")) << text;
}

TEST(ShowRenderer, NotesCountsThatDisagreeWithTheRecord) {
  StoredTrajectory t;
  build_calculator_trajectory(t);
  t.record_message.getRoot<schema::Trajectory>().setNumSegments(5);
  const std::string text = show(t);
  EXPECT_TRUE(contains(text, "note: the record counts 5 segments")) << text;
}

TEST(ChatJsonlRenderer, ExportsOpenAiChatMessagesWithToolCallsAndResults) {
  StoredTrajectory t;
  build_calculator_trajectory(t);
  const json j = export_line(t);
  EXPECT_EQ(j["id"], "0000000000000abc");
  EXPECT_EQ(j["job"], "job-1");
  EXPECT_EQ(j["environment"]["name"], "calculator");
  EXPECT_EQ(j["environment"]["version"], "1.0");
  EXPECT_EQ(j["task"], "add two numbers");
  EXPECT_EQ(j["seed"], 42);
  EXPECT_EQ(j["group_id"], "0000000000000007");
  EXPECT_EQ(j["status"], "complete");
  EXPECT_EQ(j["reward"], 1.5);
  EXPECT_EQ(j["reward_parts"]["correct"], 1.0);
  EXPECT_EQ(j["reward_parts"]["format"], 0.5);

  const json& m = j["messages"];
  ASSERT_EQ(m.size(), 6u) << m.dump(1);
  std::vector<std::string> roles;
  for (const auto& msg : m) roles.push_back(msg["role"]);
  EXPECT_EQ(roles, (std::vector<std::string>{"system", "user", "assistant", "tool", "user", "assistant"}));
  EXPECT_EQ(m[0]["content"], "You are a calculator.");
  EXPECT_EQ(m[1]["content"], "What is 2+2? <|eos|>");  // spelled text survives as text
  // The assistant turn split over two segments is one message; its call is not in its text.
  EXPECT_EQ(m[2]["content"], "Let me compute.");
  ASSERT_EQ(m[2]["tool_calls"].size(), 1u);
  EXPECT_EQ(m[2]["tool_calls"][0]["id"], "call-1");
  EXPECT_EQ(m[2]["tool_calls"][0]["type"], "function");
  EXPECT_EQ(m[2]["tool_calls"][0]["function"]["name"], "calc");
  EXPECT_EQ(m[2]["tool_calls"][0]["function"]["arguments"], R"({"expression":"2+2"})");
  EXPECT_EQ(m[3]["tool_call_id"], "call-1");
  EXPECT_EQ(m[3]["name"], "calc");
  EXPECT_EQ(m[3]["content"], "4 \xEF\xBF\xBD\xEF\xBF\xBD");  // invalid bytes replaced, JSON valid
  EXPECT_EQ(m[3]["status"], "ok");
  EXPECT_EQ(m[4]["content"], "And this?[image 32x16 image/png, 8 bytes, 4 patch tokens]");
  EXPECT_EQ(m[5]["content"], "The answer is 4.");
  EXPECT_FALSE(m[5].contains("tool_calls"));
}

TEST(ChatJsonlRenderer, ExportsEveryTokenWithLogprobsVersionsAndMask) {
  StoredTrajectory t;
  build_calculator_trajectory(t);
  const json j = export_line(t);
  const json& tokens = j["tokens"];
  ASSERT_EQ(tokens["ids"].size(), t.tokens);
  ASSERT_EQ(tokens["logprobs"].size(), t.tokens);
  ASSERT_EQ(tokens["policy_versions"].size(), t.tokens);
  ASSERT_EQ(tokens["loss_mask"].size(), t.tokens);
  ByteTokenizer tok;
  EXPECT_EQ(tokens["ids"][0], tok.special_id(SpecialToken::kSystem));
  EXPECT_EQ(tokens["logprobs"][0], 0.0);
  EXPECT_EQ(tokens["policy_versions"][0], 3);
  EXPECT_EQ(tokens["policy_versions"][t.tokens - 1], 4);
  EXPECT_EQ(tokens["loss_mask"][t.tokens - 1], 1);
  EXPECT_EQ(tokens["logprobs"][t.tokens - 1], -0.25);
  std::vector<uint32_t> ids = tokens["ids"];
  EXPECT_TRUE(contains(tok.decode(ids), "Let me compute."));
}

TEST(ChatJsonlRenderer, InlinesImagesAsDataUrlsWhenAsked) {
  StoredTrajectory t;
  build_calculator_trajectory(t);
  ExportOptions options;
  options.inline_images = true;
  options.include_tokens = false;
  const json j = export_line(t, options);
  EXPECT_FALSE(j.contains("tokens"));
  const json& content = j["messages"][4]["content"];
  ASSERT_TRUE(content.is_array()) << content.dump();
  ASSERT_EQ(content.size(), 2u);
  EXPECT_EQ(content[0]["type"], "text");
  EXPECT_EQ(content[0]["text"], "And this?");
  EXPECT_EQ(content[1]["type"], "image_url");
  EXPECT_EQ(content[1]["image_url"]["url"], "data:image/png;base64,iVBORw0KGgo=");
}

TEST(ChatJsonlRenderer, NonFiniteLogprobsBecomeNull) {
  StoredTrajectory t;
  SegmentBuilder s;
  s.open_turn(schema::Role::ASSISTANT);
  s.text("ab", true);
  s.close_turn();
  s.data.logprobs[1] = -std::numeric_limits<float>::infinity();
  t.add(s.data);
  const json j = export_line(t);
  EXPECT_EQ(j["tokens"]["logprobs"][0], -0.25);
  EXPECT_TRUE(j["tokens"]["logprobs"][1].is_null());
}

TEST(ChatJsonlRenderer, PlacesAResultOutsideAnyToolTurnRightAfterItsCall) {
  StoredTrajectory t;
  SegmentBuilder s;
  s.open_turn(schema::Role::ASSISTANT);
  s.special(SpecialToken::kAssistant, true);
  s.special(SpecialToken::kToolCall, true);
  s.text("{}", true);
  s.special(SpecialToken::kToolCallEnd, true);
  s.close_turn();
  ToolCallData call;  // no callId: one is made up
  call.name = "clock";
  call.result = "noon";
  call.status = schema::ToolStatus::TIMEOUT;
  call.error = "took too long";
  call.call_token_start = 1;
  call.result_token_start = s.size();
  s.data.tool_calls.push_back(call);
  s.open_turn(schema::Role::USER);
  s.text("thanks");
  s.close_turn();
  t.add(s.data);
  const json m = export_line(t)["messages"];
  ASSERT_EQ(m.size(), 3u) << m.dump(1);
  EXPECT_EQ(m[0]["role"], "assistant");
  EXPECT_EQ(m[0]["content"], "");
  EXPECT_EQ(m[0]["tool_calls"][0]["id"], "call_0");
  EXPECT_EQ(m[1]["role"], "tool");
  EXPECT_EQ(m[1]["tool_call_id"], "call_0");
  EXPECT_EQ(m[1]["content"], "noon");
  EXPECT_EQ(m[1]["status"], "timeout");
  EXPECT_EQ(m[1]["error"], "took too long");
  EXPECT_EQ(m[2]["role"], "user");
}

TEST(ChatJsonlRenderer, KeepsACallOutsideAnyAssistantTurnInATokenlessAssistantMessage) {
  StoredTrajectory t;
  SegmentBuilder s;
  s.open_turn(schema::Role::USER);
  s.text("hi");
  s.close_turn();
  ToolCallData call;
  call.call_id = "c9";
  call.name = "probe";
  call.call_token_start = 1;  // inside the user turn
  s.data.tool_calls.push_back(call);
  t.add(s.data);
  const json m = export_line(t)["messages"];
  ASSERT_EQ(m.size(), 3u) << m.dump(1);
  EXPECT_EQ(m[0]["role"], "user");
  EXPECT_EQ(m[1]["role"], "assistant");
  EXPECT_EQ(m[1]["content"], "");
  EXPECT_EQ(m[1]["tool_calls"][0]["id"], "c9");
  EXPECT_EQ(m[2]["role"], "tool");
  EXPECT_EQ(m[2]["tool_call_id"], "c9");
}

TEST(ChatJsonlRenderer, WritesNothingForATrajectoryWhoseSegmentsComeOutOfOrder) {
  StoredTrajectory t;
  build_calculator_trajectory(t);
  auto segments = t.segments();
  ByteTokenizer tok;
  std::ostringstream out;
  ChatJsonlRenderer renderer(tok, out);
  ASSERT_TRUE(renderer.begin(t.record()).ok());
  ASSERT_TRUE(renderer.add(segments[0]).ok());
  Status st = renderer.add(segments[2]);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(st.message(), "segment 1")) << st.message();
  EXPECT_TRUE(contains(st.message(), "seq 2 where seq 1 was expected")) << st.message();
  EXPECT_FALSE(renderer.finish().ok());
  EXPECT_EQ(out.str(), "");
  // The renderer serves the next trajectory.
  EXPECT_TRUE(render_trajectory(renderer, t.record(), segments).ok());
  EXPECT_NO_THROW(json::parse(out.str()));
}

TEST(ChatJsonlRenderer, RejectsASegmentOfAnotherTrajectory) {
  StoredTrajectory t;
  build_calculator_trajectory(t);
  t.record_message.getRoot<schema::Trajectory>().setId(0xdef);
  ByteTokenizer tok;
  std::ostringstream out;
  ChatJsonlRenderer renderer(tok, out);
  Status st = render_trajectory(renderer, t.record(), t.segments());
  EXPECT_TRUE(contains(st.message(), "belongs to trajectory 0000000000000abc")) << st.message();
}

// Streams stored bytes through `renderer` as `traj show/export` will.
Status render_stored(TrajectoryRenderer& renderer, const std::string& record, const std::vector<std::string>& segments) {
  ODY_RETURN_IF_ERROR(begin_stored_record(renderer, record));
  for (const auto& bytes : segments) ODY_RETURN_IF_ERROR(add_stored_segment(renderer, bytes));
  return renderer.finish();
}

TEST(ChatJsonlRenderer, CorruptStoredBytesGiveAnErrorOrValidOutputNeverACrash) {
  StoredTrajectory t;
  build_calculator_trajectory(t);
  const std::string record = encode_trajectory(t.record_message);
  ByteTokenizer tok;
  size_t rejected = 0;
  for (size_t which = 0; which < t.bytes.size(); ++which) {
    for (size_t i = 0; i < t.bytes[which].size(); ++i) {
      std::vector<std::string> segments = t.bytes;
      segments[which][i] ^= 0x5a;
      const std::string where = fmt::format("segment {} byte {}", which, i);
      std::ostringstream json_out, show_out;
      ChatJsonlRenderer exporter(tok, json_out);
      ShowRenderer shower(tok, show_out);
      const bool exported = render_stored(exporter, record, segments).ok();
      const bool shown = render_stored(shower, record, segments).ok();
      // The views read different fields (only show reads snapshot formats), so they may
      // disagree on a flip there; each either fails or writes valid output.
      if (exported) EXPECT_NO_THROW(json::parse(json_out.str())) << where;
      else EXPECT_EQ(json_out.str(), "") << where;
      EXPECT_TRUE(is_valid_utf8(show_out.str())) << where;
      if (!exported || !shown) ++rejected;
    }
  }
  EXPECT_GT(rejected, 0u);
}

TEST(ChatJsonlRenderer, RejectsARecordWhoseHashDoesNotMatch) {
  StoredTrajectory t;
  std::string record = encode_trajectory(t.record_message);
  record[record.size() - 9] ^= 1;
  ByteTokenizer tok;
  std::ostringstream out;
  ChatJsonlRenderer renderer(tok, out);
  EXPECT_EQ(begin_stored_record(renderer, record).code(), StatusCode::kCorrupt);
}

TEST(TrajectoryFilter, ParsesCommandLineStrings) {
  TrajectoryFilterArgs args;
  args.job = "job-1";
  args.environment = "calculator";
  args.status = "complete,in-flight";
  args.reward_min = "0.5";
  args.reward_max = "2";
  args.version_min = "3";
  args.version_max = "10";
  auto f = parse_filter(args);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(f->job, "job-1");
  EXPECT_EQ(f->environment, "calculator");
  EXPECT_EQ(f->statuses, (std::vector<schema::TrajectoryStatus>{schema::TrajectoryStatus::COMPLETE,
                                                                schema::TrajectoryStatus::IN_FLIGHT}));
  EXPECT_EQ(f->reward_min, 0.5);
  EXPECT_EQ(f->reward_max, 2.0);
  EXPECT_EQ(f->version_min, 3u);
  EXPECT_EQ(f->version_max, 10u);
}

TEST(TrajectoryFilter, ErrorsNameTheOptionTheBadValueAndTheAllowedOnes) {
  TrajectoryFilterArgs bad_status;
  bad_status.status = "complete,done";
  auto f = parse_filter(bad_status);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().message(),
            "--status: 'done' is not a trajectory status (one of in_flight, complete, consumed, withheld, failed)");
  TrajectoryFilterArgs bad_reward;
  bad_reward.reward_min = "high";
  EXPECT_TRUE(contains(parse_filter(bad_reward).status().message(), "--reward-min 'high' is not a number"));
  TrajectoryFilterArgs bad_version;
  bad_version.version_max = "-1";
  EXPECT_TRUE(contains(parse_filter(bad_version).status().message(), "--version-max '-1' is not a policy version"));
  TrajectoryFilterArgs crossed;
  crossed.version_min = "5";
  crossed.version_max = "4";
  EXPECT_TRUE(contains(parse_filter(crossed).status().message(), "--version-min 5 is above --version-max 4"));
}

TEST(TrajectoryFilter, MatchesOnEveryConstraint) {
  StoredTrajectory t;
  auto record = t.record();
  EXPECT_TRUE(TrajectoryFilter{}.matches(record));
  TrajectoryFilter f;
  f.job = "job-1";
  f.environment = "calculator";
  f.statuses = {schema::TrajectoryStatus::COMPLETE};
  f.reward_min = 1.5;
  f.reward_max = 1.5;
  f.version_min = 3;
  f.version_max = 4;
  EXPECT_TRUE(f.matches(record));
  auto mismatch = [&](auto change) {
    TrajectoryFilter g = f;
    change(g);
    return !g.matches(record);
  };
  EXPECT_TRUE(mismatch([](TrajectoryFilter& g) { g.job = "job-2"; }));
  EXPECT_TRUE(mismatch([](TrajectoryFilter& g) { g.environment = "chess"; }));
  EXPECT_TRUE(mismatch([](TrajectoryFilter& g) { g.statuses = {schema::TrajectoryStatus::FAILED}; }));
  EXPECT_TRUE(mismatch([](TrajectoryFilter& g) { g.reward_min = 1.6; }));
  EXPECT_TRUE(mismatch([](TrajectoryFilter& g) { g.reward_max = 1.4; }));
  EXPECT_TRUE(mismatch([](TrajectoryFilter& g) { g.version_min = 4; }));
  EXPECT_TRUE(mismatch([](TrajectoryFilter& g) { g.version_max = 3; }));
  // In flight: no reward yet, so any reward bound excludes it.
  t.record_message.getRoot<schema::Trajectory>().setStatus(schema::TrajectoryStatus::IN_FLIGHT);
  TrajectoryFilter reward_only;
  reward_only.reward_max = 10;
  EXPECT_FALSE(reward_only.matches(t.record()));
}

TEST(LsFormat, AlignsOneRowPerTrajectoryUnderItsHeader) {
  StoredTrajectory t;
  build_calculator_trajectory(t);
  const std::string header = format_ls_header();
  const std::string row = format_ls_row(t.record(), kStarted + 300 * int64_t{1000000000});
  EXPECT_EQ(header.rfind("ID", 0), 0u);
  EXPECT_EQ(utf8_length(header), utf8_length(row)) << header << "\n" << row;
  EXPECT_EQ(row.rfind("0000000000000abc  complete ", 0), 0u) << row;
  EXPECT_TRUE(contains(row, "calculator@1.0")) << row;
  EXPECT_TRUE(contains(row, "add two numbers")) << row;
  EXPECT_TRUE(contains(row, "     1.5")) << row;
  EXPECT_TRUE(contains(row, fmt::format(" {} ", t.tokens))) << row;
  EXPECT_TRUE(contains(row, "3..4")) << row;
  EXPECT_TRUE(contains(row, "   5m")) << row;
  EXPECT_EQ(header.find("REWARD") + 6, row.find("1.5") + 3) << "reward is right-aligned under its title";
}

TEST(LsFormat, CutsLongTextToItsColumnAndKeepsRowsOnOneLine) {
  StoredTrajectory t;
  t.record_message.getRoot<schema::Trajectory>().setTask("a very long task name\nwith a newline in it");
  const std::string row = format_ls_row(t.record(), kStarted);
  EXPECT_EQ(row.find('\n'), std::string::npos) << row;
  EXPECT_TRUE(contains(row, "a very long task name\\n…")) << row;
  EXPECT_EQ(utf8_length(row), utf8_length(format_ls_header()));
}

TEST(AuditFormat, DurationsAndDates) {
  EXPECT_EQ(format_duration(850), "850ns");
  EXPECT_EQ(format_duration(12500), "12.5us");
  EXPECT_EQ(format_duration(3200000), "3.20ms");
  EXPECT_EQ(format_duration(2500000000), "2.50s");
  EXPECT_EQ(format_duration(245 * int64_t{1000000000}), "4m05s");
  EXPECT_EQ(format_duration(3723 * int64_t{1000000000}), "1h02m03s");
  EXPECT_EQ(format_duration(-2500000000), "-2.50s");
  EXPECT_EQ(format_unix_nanos(0), "-");
  EXPECT_EQ(format_unix_nanos(kStarted + 123456789), "2024-05-01T12:00:00.123Z");
  EXPECT_EQ(trajectory_status_name(static_cast<schema::TrajectoryStatus>(9)), "unknown(9)");
  EXPECT_EQ(tool_status_name(schema::ToolStatus::MALFORMED_CALL), "malformed_call");
}

}  // namespace
}  // namespace odyssey::replay
