// The actor as a job runs it: a real replay service on loopback (ZeroMQ, RocksDB), the real
// built-in plugins, the tiny policy with weights published through the weight channel.
//
// Most tests use "constant" policies: real tiny policies whose layers all output zero, so the
// next-token distribution is the same after every prefix and is chosen by the test (which
// tokens a random model writes, and with what log-probability, is then known exactly).
#include "actors/actor.h"

#include <signal.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <thread>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include "actors/ragged_decoder.h"
#include "core/codec.h"
#include "core/tokenizer.h"
#include "model/config.h"
#include "model/weight_channel.h"
#include "replay/service.h"
#include "replay/verify.h"
#include "test_helpers.h"

namespace odyssey::actors {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace std::chrono_literals;
using testing::TempDir;

const std::string kTinyConfig = std::string(ODYSSEY_SOURCE_DIR) + "/configs/model/tiny.toml";
const ByteTokenizer kTok;
uint32_t sp(SpecialToken t) { return kTok.special_id(t); }

model::ModelConfig tiny() {
  auto c = model::load_model_config({kTinyConfig});
  EXPECT_TRUE(c.ok()) << c.status().message();
  return *c;
}

// Target logits: bytes 0, every special token -30 except those given.
std::vector<double> logits_with(const std::map<SpecialToken, double>& specials) {
  std::vector<double> z(271, 0.0);
  for (uint32_t i = 256; i < 271; ++i) z[i] = -30.0;
  for (const auto& [t, v] : specials) z[sp(t)] = v;
  return z;
}

// A real policy whose every layer outputs zero: the last mix is a fixed multiple of the token
// embedding (all rows the same vector of ones), so the logits are lm_head · const, whatever
// the prefix. lm_head row v is logits[v] / hidden.
model::Policy constant_policy(const model::ModelConfig& config, const std::vector<double>& logits) {
  model::Policy p(config);
  c10::NoGradGuard no_grad;
  for (auto& item : p->named_parameters()) item.value().zero_();
  for (auto& item : p->named_buffers()) item.value().zero_();
  p->embed->weight.fill_(1.0);
  p->norm->weight.fill_(1.0);
  const at::Tensor rows = at::tensor(logits, at::kDouble).to(at::kFloat).unsqueeze(1) / static_cast<double>(config.hidden_size);
  p->lm_head->weight.copy_(rows.expand({config.vocab_size, config.hidden_size}));
  return p;
}

// log q(token) of the policy's (constant) next-token distribution, read back from the model.
std::vector<double> log_probs(model::Policy& p) {
  c10::NoGradGuard no_grad;
  const at::Tensor logits = p->forward(at::tensor({1, 2, 3, 4}, at::kLong).view({1, 4})).select(0, 0);
  const at::Tensor last = at::log_softmax(logits.select(0, 3).to(at::kDouble), 0);
  EXPECT_LT((at::log_softmax(logits.select(0, 0).to(at::kDouble), 0) - last).abs().max().item<double>(), 1e-5)
      << "the policy is not constant";
  return std::vector<double>(last.data_ptr<double>(), last.data_ptr<double>() + last.numel());
}

void publish(const std::string& out, model::Policy& p, uint32_t version) {
  model::WeightPublisher publisher(out + "/weights", json{{"model", "tiny"}});
  const Status st = publisher.publish(p, version);
  ASSERT_TRUE(st.ok()) << st.to_string();
}

// An in-process replay service on a free loopback port.
class Replay {
 public:
  explicit Replay(const TempDir& tmp) {
    replay::ServiceOptions o;
    o.store.dir = tmp.str("replay");
    o.store.sync = false;
    o.listen = "tcp://127.0.0.1:" + std::to_string(testing::free_port());
    o.stats_every_seconds = 0;
    auto s = replay::ReplayService::create(o);
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    service_ = std::move(s).value();
    thread_ = std::thread([this] { EXPECT_TRUE(service_->run(stop_).ok()); });
  }
  ~Replay() { stop(); }
  void stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  std::string endpoint() const { return service_->endpoint(); }
  replay::TrajectoryStore& store() { return service_->store(); }

 private:
  std::unique_ptr<replay::ReplayService> service_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// One stored trajectory with its segments joined (offsets made absolute).
struct Stored {
  std::unique_ptr<capnp::MallocMessageBuilder> record_message;
  schema::Trajectory::Reader record() const { return record_message->getRoot<schema::Trajectory>().asReader(); }
  std::vector<uint32_t> tokens, versions;
  std::vector<float> logprobs;
  std::vector<uint8_t> mask;
  struct Turn {
    schema::Role role;
    uint64_t start, length;
  };
  std::vector<Turn> turns;  // continued pieces merged
  struct Call {
    std::string id, name, arguments, result;
    schema::ToolStatus status;
    uint64_t call_position, result_position;
  };
  std::vector<Call> calls;
  struct Image {
    uint64_t position;
    uint32_t patches, width, height;
    std::string media_type, data;
  };
  std::vector<Image> images;
  std::vector<std::pair<uint64_t, std::string>> snapshots;  // position, format
  std::vector<size_t> segment_sizes;
};

// Every trajectory of the store (stop the service first).
std::vector<Stored> read_all(replay::TrajectoryStore& store) {
  std::vector<Stored> out;
  std::unique_ptr<rocksdb::Iterator> it(store.db()->NewIterator(rocksdb::ReadOptions(), store.trajectories_cf()));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    auto record = decode_trajectory(std::string_view(it->value().data(), it->value().size()));
    EXPECT_TRUE(record.ok());
    if (!record.ok()) continue;
    Stored t;
    t.record_message = std::move(record).value();
    auto segments = store.read_segments(t.record().getId(), 0, 1u << 20, uint64_t{1} << 32);
    EXPECT_TRUE(segments.ok());
    for (const std::string& bytes : *segments) {
      MessageView view(bytes);
      EXPECT_TRUE(view.ok());
      auto seg = view.root<schema::Segment>();
      const uint64_t base = seg.getTokenStart();
      EXPECT_EQ(base, t.tokens.size());
      t.segment_sizes.push_back(seg.getTokens().size());
      for (uint32_t x : seg.getTokens()) t.tokens.push_back(x);
      for (float x : seg.getLogprobs()) t.logprobs.push_back(x);
      for (uint32_t x : seg.getPolicyVersions()) t.versions.push_back(x);
      for (uint8_t x : seg.getLossMask()) t.mask.push_back(x);
      for (auto turn : seg.getTurns()) {
        if (turn.getContinued() && !t.turns.empty()) {
          EXPECT_EQ(t.turns.back().role, turn.getRole());
          t.turns.back().length += turn.getLength();
        } else {
          t.turns.push_back({turn.getRole(), base + turn.getStart(), turn.getLength()});
        }
      }
      for (auto c : seg.getToolCalls()) {
        const auto result = c.getResult();
        t.calls.push_back({c.getCallId().cStr(), c.getName().cStr(), c.getArguments().cStr(),
                           std::string(reinterpret_cast<const char*>(result.begin()), result.size()), c.getStatus(),
                           base + c.getCallTokenStart(), base + c.getResultTokenStart()});
      }
      for (auto im : seg.getImages()) {
        const auto data = im.getData();
        t.images.push_back({base + im.getTokenOffset(), im.getNumPatchTokens(), im.getWidth(), im.getHeight(),
                            im.getMediaType().cStr(), std::string(reinterpret_cast<const char*>(data.begin()), data.size())});
      }
      for (auto s : seg.getStateSnapshots()) t.snapshots.emplace_back(s.getTokenPosition(), s.getFormat().cStr());
    }
    out.push_back(std::move(t));
  }
  return out;
}

ActorOptions options_for(const TempDir& tmp, const std::string& endpoint) {
  ActorOptions o;
  o.out_dir = tmp.str("out");
  o.model_config = kTinyConfig;
  o.env_name = "arith";
  o.env_config = {{"min_steps", 1}, {"max_steps", 1}, {"max_operand", 9}};
  o.replay_endpoint = endpoint;
  o.replay_give_up_ms = 20000;
  o.slots = 3;
  o.group_size = 2;
  o.max_tokens = 160;
  o.max_turn_tokens = 64;
  o.segment_tokens = 32;
  o.weights_poll_ms = 20;
  o.metrics_every_s = 0.2;
  return o;
}

std::vector<json> read_lines(const fs::path& path) {
  std::vector<json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_discarded()) out.push_back(std::move(j));  // a line still being written
  }
  return out;
}

// Checks what every trajectory must satisfy; `logq` is the policy's constant log q by version.
void check_transcript(const Stored& t, const std::map<uint32_t, std::vector<double>>& logq, int64_t max_tokens) {
  ASSERT_GE(t.tokens.size(), 4u);
  const size_t n = t.tokens.size();
  EXPECT_EQ(t.record().getNumTokens(), n);
  EXPECT_LE(static_cast<int64_t>(n), max_tokens);
  EXPECT_EQ(t.tokens.front(), sp(SpecialToken::kBos));
  EXPECT_EQ(t.tokens[1], sp(SpecialToken::kUser));
  EXPECT_EQ(t.tokens.back(), sp(SpecialToken::kEos));
  ASSERT_EQ(t.logprobs.size(), n);
  ASSERT_EQ(t.versions.size(), n);
  ASSERT_EQ(t.mask.size(), n);
  // Model tokens are exactly the tokens of assistant turns after their header.
  std::vector<uint8_t> model(n, 0);
  for (const Stored::Turn& turn : t.turns) {
    if (turn.role != schema::Role::ASSISTANT) continue;
    EXPECT_EQ(t.tokens[turn.start], sp(SpecialToken::kAssistant));
    for (uint64_t i = turn.start + 1; i < turn.start + turn.length; ++i) model[i] = 1;
  }
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(t.mask[i], model[i]) << "token " << i;
    if (t.mask[i]) {
      const auto& q = logq.at(t.versions[i]);
      EXPECT_NEAR(t.logprobs[i], q[t.tokens[i]], 1e-4) << "token " << i << " version " << t.versions[i];
    } else {
      EXPECT_EQ(t.logprobs[i], 0.0f) << "token " << i;
    }
    if (i > 0) {
      EXPECT_GE(t.versions[i], t.versions[i - 1]) << "versions only grow";
    }
  }
  // Turns: the user turn first, then assistant and tool turns alternating.
  ASSERT_GE(t.turns.size(), 2u);
  EXPECT_EQ(t.turns[0].role, schema::Role::USER);
  EXPECT_EQ(t.turns[0].start, 1u);
  for (size_t k = 1; k < t.turns.size(); ++k) {
    EXPECT_EQ(t.turns[k].role, k % 2 == 1 ? schema::Role::ASSISTANT : schema::Role::TOOL) << "turn " << k;
    EXPECT_EQ(t.turns[k].start, t.turns[k - 1].start + t.turns[k - 1].length) << "turn " << k;
  }
  // The reward is the sum of its parts.
  double parts = 0;
  for (auto p : t.record().getRewardParts()) parts += p.getValue();
  EXPECT_NEAR(t.record().getRewardTotal(), parts, 1e-9);
}

TEST(Actor, StoresCompleteGroupedTrajectoriesWithMasksLogprobsVersionsAndSnapshots) {
  TempDir tmp;
  Replay replay(tmp);
  const model::ModelConfig config = tiny();
  // Bytes, and <|end_turn|> often enough that turns end on their own.
  model::Policy policy = constant_policy(config, logits_with({{SpecialToken::kEndTurn, std::log(6.0)}}));
  publish(tmp.str("out"), policy, 1);
  ActorOptions o = options_for(tmp, replay.endpoint());
  o.max_episodes = 6;
  o.snapshot_every_tokens = 40;
  auto actor = Actor::create(o);
  ASSERT_TRUE(actor.ok()) << actor.status().to_string();
  std::atomic<bool> stop{false};
  const Status st = (*actor)->run(stop);
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ((*actor)->stats().episodes, 6u);
  EXPECT_EQ((*actor)->stats().failures, 0u);
  replay.stop();

  auto report = replay::verify_store(replay.store());
  ASSERT_TRUE(report.ok());
  for (const auto& p : report->problems) ADD_FAILURE() << p.to_string();
  EXPECT_EQ(report->trajectories, 6u);

  const std::vector<Stored> all = read_all(replay.store());
  ASSERT_EQ(all.size(), 6u);
  const std::map<uint32_t, std::vector<double>> logq = {{1, log_probs(policy)}};
  std::map<uint64_t, std::vector<const Stored*>> groups;
  int multi_segment = 0;
  for (const Stored& t : all) {
    SCOPED_TRACE(format_trajectory_id(t.record().getId()));
    EXPECT_EQ(t.record().getStatus(), schema::TrajectoryStatus::COMPLETE);
    EXPECT_EQ(std::string(t.record().getJob().cStr()), "tiny");
    EXPECT_EQ(std::string(t.record().getEnvironment().getName().cStr()), "arith");
    EXPECT_FALSE(std::string(t.record().getEnvironment().getPluginHash().cStr()).empty());
    EXPECT_EQ(t.record().getGroupSize(), 2u);
    EXPECT_EQ(t.record().getMinPolicyVersion(), 1u);
    EXPECT_EQ(t.record().getMaxPolicyVersion(), 1u);
    check_transcript(t, logq, o.max_tokens);
    groups[t.record().getGroupId()].push_back(&t);
    // Streamed: segments of at most 32 tokens (full ones, then the rest of each round).
    for (size_t size : t.segment_sizes) EXPECT_LE(size, 32u);
    multi_segment += t.segment_sizes.size() >= 2;
    // Snapshots at every 40 tokens the model consumed (it never consumes the final <|eos|>).
    std::vector<uint64_t> want;
    for (uint64_t p = 40; p < t.tokens.size(); p += 40) want.push_back(p);
    std::vector<uint64_t> got;
    for (const auto& [pos, format] : t.snapshots) {
      got.push_back(pos);
      EXPECT_EQ(format, kKdaSnapshotFormat);
    }
    EXPECT_LE(got.size(), want.size());
    for (size_t k = 0; k < got.size(); ++k) EXPECT_EQ(got[k], want[k]);
  }
  EXPECT_GT(multi_segment, 0);
  // Three groups of two: one task and environment seed per group, a different task per group,
  // different sampled tokens within a group.
  ASSERT_EQ(groups.size(), 3u);
  std::set<std::string> tasks;
  for (const auto& [id, members] : groups) {
    ASSERT_EQ(members.size(), 2u);
    const std::string task = members[0]->record().getTask().cStr();
    EXPECT_EQ(task, std::string(members[1]->record().getTask().cStr()));
    EXPECT_EQ(members[0]->record().getSeed(), members[1]->record().getSeed());
    EXPECT_NE(members[0]->tokens, members[1]->tokens);
    EXPECT_EQ(json::parse(task)["split"], "train");
    tasks.insert(task);
  }
  EXPECT_EQ(tasks.size(), 3u);
  // Metrics lines.
  const auto lines = read_lines(tmp.str("out") + "/metrics/actor-0.jsonl");
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines.back()["role"], "actor-0");
  EXPECT_EQ(lines.back()["episodes"], 6);
  EXPECT_EQ(lines.back()["version"], 1);
  EXPECT_TRUE(lines.back().contains("time"));
  // The group counter is persisted: a second actor run continues with new groups.
  EXPECT_EQ(read_lines(tmp.str("out") + "/actors/actor-0.json").at(0)["next_group"], 3);
}

TEST(Actor, RandomToolCallsBecomeErrorObservationsAndTheActorCarriesOn) {
  TempDir tmp;
  Replay replay(tmp);
  const model::ModelConfig config = tiny();
  // <|tool_call|> about one token in ten, never a turn end: every turn is max_turn_tokens of
  // calls cut short by the next call (malformed JSON, unterminated, too many).
  model::Policy policy = constant_policy(config, logits_with({{SpecialToken::kToolCall, std::log(28.0)}}));
  publish(tmp.str("out"), policy, 1);
  ActorOptions o = options_for(tmp, replay.endpoint());
  o.max_episodes = 4;
  o.max_tokens = 4000;      // room for every error message
  o.segment_tokens = 4096;  // a turn's calls and its results in one segment
  auto actor = Actor::create(o);
  ASSERT_TRUE(actor.ok()) << actor.status().to_string();
  std::atomic<bool> stop{false};
  ASSERT_TRUE((*actor)->run(stop).ok());
  EXPECT_EQ((*actor)->stats().episodes, 4u);
  replay.stop();
  const std::vector<Stored> all = read_all(replay.store());
  ASSERT_EQ(all.size(), 4u);
  const std::map<uint32_t, std::vector<double>> logq = {{1, log_probs(policy)}};
  for (const Stored& t : all) {
    check_transcript(t, logq, o.max_tokens);
    EXPECT_EQ(t.record().getStatus(), schema::TrajectoryStatus::COMPLETE);
    ASSERT_FALSE(t.calls.empty());
    ASSERT_GE(t.turns.size(), 3u);  // user, assistant, tool
    const Stored::Turn& tool = t.turns[2];
    ASSERT_EQ(tool.role, schema::Role::TOOL);
    const std::string observation = kTok.decode(std::vector<uint32_t>(
        t.tokens.begin() + static_cast<std::ptrdiff_t>(tool.start),
        t.tokens.begin() + static_cast<std::ptrdiff_t>(tool.start + tool.length)));
    EXPECT_NE(observation.find("error: "), std::string::npos) << observation;
    std::set<std::string> ids;
    for (const Stored::Call& c : t.calls) {
      EXPECT_NE(c.status, schema::ToolStatus::OK);
      EXPECT_EQ(t.tokens[c.call_position], sp(SpecialToken::kToolCall)) << c.id;
      EXPECT_EQ(c.result_position, tool.start) << c.id;
      EXPECT_FALSE(c.result.empty());
      ids.insert(c.id);
    }
    EXPECT_EQ(ids.size(), t.calls.size());
  }
}

TEST(Actor, MultiTurnEpisodesFeedObservationsWithImagesBackToThePolicy) {
  TempDir tmp;
  Replay replay(tmp);
  const model::ModelConfig config = tiny();
  model::Policy policy = constant_policy(config, logits_with({{SpecialToken::kEndTurn, std::log(8.0)}}));
  publish(tmp.str("out"), policy, 1);
  ActorOptions o = options_for(tmp, replay.endpoint());
  o.env_name = "gridworld";
  o.env_config = {{"size", 3}, {"walls", 0}, {"cell_pixels", 4}, {"max_turns", 3}};
  o.max_episodes = 2;
  o.max_tokens = 600;
  o.slots = 2;
  auto actor = Actor::create(o);
  ASSERT_TRUE(actor.ok()) << actor.status().to_string();
  std::atomic<bool> stop{false};
  ASSERT_TRUE((*actor)->run(stop).ok());
  replay.stop();
  const std::vector<Stored> all = read_all(replay.store());
  ASSERT_EQ(all.size(), 2u);
  const std::map<uint32_t, std::vector<double>> logq = {{1, log_probs(policy)}};
  for (const Stored& t : all) {
    check_transcript(t, logq, o.max_tokens);
    // user, then three rounds of assistant + tool (the episode ends after max_turns = 3).
    ASSERT_EQ(t.turns.size(), 7u);
    // One 12x12 image per observation (reset + 3 turns): 8-pixel patches, 2 x 2.
    ASSERT_EQ(t.images.size(), 4u);
    for (const Stored::Image& im : t.images) {
      EXPECT_EQ(im.width, 12u);
      EXPECT_EQ(im.patches, 4u);
      EXPECT_EQ(im.media_type, "image/x-portable-pixmap");
      EXPECT_EQ(im.data.size(), std::string("P6\n12 12\n255\n").size() + 12 * 12 * 3);
      EXPECT_EQ(t.tokens[im.position], sp(SpecialToken::kImage));
      for (uint32_t j = 1; j <= im.patches; ++j) EXPECT_EQ(t.tokens[im.position + j], sp(SpecialToken::kImagePatch));
      EXPECT_EQ(t.tokens[im.position + im.patches + 1], sp(SpecialToken::kImageEnd));
    }
  }
}

TEST(Actor, WeightsPublishedMidEpisodeShowUpInLaterTokensWithoutDroppingTheEpisode) {
  TempDir tmp;
  Replay replay(tmp);
  const model::ModelConfig config = tiny();
  // Version 1 and 2 differ in how likely byte 'a' is, so later log-probs prove the switch.
  // No turn ends by itself: one long turn per episode.
  model::Policy v1 = constant_policy(config, logits_with({}));
  std::vector<double> z2 = logits_with({});
  z2['a'] = 3.0;
  model::Policy v2 = constant_policy(config, z2);
  publish(tmp.str("out"), v1, 1);
  ActorOptions o = options_for(tmp, replay.endpoint());
  o.slots = 1;
  o.group_size = 1;
  o.max_episodes = 1;
  o.max_turn_tokens = 300;
  o.max_tokens = 400;
  o.segment_tokens = 64;
  o.metrics_every_s = 0.02;
  auto actor = Actor::create(o);
  ASSERT_TRUE(actor.ok()) << actor.status().to_string();
  std::atomic<bool> stop{false};
  Status st;
  std::thread runner([&] { st = (*actor)->run(stop); });
  // Publish version 2 once the actor is writing tokens of its only episode.
  const fs::path metrics = tmp.str("out") + "/metrics/actor-0.jsonl";
  bool started = false;
  for (int i = 0; i < 3000 && !started; ++i) {
    for (const json& line : read_lines(metrics)) started |= line["tokens"].get<int64_t>() > 0;
    if (!started) std::this_thread::sleep_for(5ms);
  }
  EXPECT_TRUE(started);
  publish(tmp.str("out"), v2, 2);
  runner.join();
  ASSERT_TRUE(st.ok()) << st.to_string();
  replay.stop();
  const std::vector<Stored> all = read_all(replay.store());
  ASSERT_EQ(all.size(), 1u);
  const Stored& t = all[0];
  EXPECT_EQ(t.record().getStatus(), schema::TrajectoryStatus::COMPLETE);
  EXPECT_EQ(t.record().getMinPolicyVersion(), 1u);
  EXPECT_EQ(t.record().getMaxPolicyVersion(), 2u);
  check_transcript(t, {{1, log_probs(v1)}, {2, log_probs(v2)}}, o.max_tokens);
  size_t model_v1 = 0, model_v2 = 0;
  for (size_t i = 0; i < t.tokens.size(); ++i) {
    if (!t.mask[i]) continue;
    (t.versions[i] == 1 ? model_v1 : model_v2) += 1;
  }
  EXPECT_GT(model_v1, 0u);
  EXPECT_GT(model_v2, 0u);
  std::printf("model tokens: %zu with version 1, %zu with version 2\n", model_v1, model_v2);
}

TEST(Actor, HostedEnvironmentsAndRerunsGiveTheSameTrajectories) {
  const model::ModelConfig config = tiny();
  model::Policy policy = constant_policy(config, logits_with({{SpecialToken::kEndTurn, std::log(6.0)}}));
  // The same job three times: twice in-process (fresh output folders), once in sandboxed
  // env-host processes. Same seeds, same tokens.
  std::vector<std::vector<std::vector<uint32_t>>> runs;
  for (int run = 0; run < 3; ++run) {
    TempDir tmp;
    Replay replay(tmp);
    publish(tmp.str("out"), policy, 1);
    ActorOptions o = options_for(tmp, replay.endpoint());
    o.max_episodes = 4;
    o.env_hosted = run == 2;
    o.odyssey_binary = ODYSSEY_BINARY;
    auto actor = Actor::create(o);
    ASSERT_TRUE(actor.ok()) << actor.status().to_string();
    std::atomic<bool> stop{false};
    const Status st = (*actor)->run(stop);
    ASSERT_TRUE(st.ok()) << st.to_string();
    replay.stop();
    std::vector<std::vector<uint32_t>> tokens;
    for (const Stored& t : read_all(replay.store())) tokens.push_back(t.tokens);
    std::sort(tokens.begin(), tokens.end());
    ASSERT_EQ(tokens.size(), 4u);
    runs.push_back(tokens);
  }
  EXPECT_EQ(runs[0], runs[1]);
  EXPECT_EQ(runs[0], runs[2]);
}

TEST(Actor, EvalWritesOneLinePerQualifyingVersionAndNothingToReplay) {
  TempDir tmp;
  const model::ModelConfig config = tiny();
  model::Policy policy = constant_policy(config, logits_with({{SpecialToken::kEndTurn, std::log(6.0)}}));
  publish(tmp.str("out"), policy, 1);
  ActorOptions o = options_for(tmp, "tcp://127.0.0.1:1");  // no replay service: eval never writes
  o.eval_every = 2;
  o.eval_tasks = 3;
  o.max_evals = 2;
  o.max_tokens = 120;
  auto actor = Actor::create(o);
  ASSERT_TRUE(actor.ok()) << actor.status().to_string();
  std::atomic<bool> stop{false};
  Status st;
  std::thread runner([&] { st = (*actor)->run_eval(stop); });
  const fs::path lines_path = tmp.str("out") + "/metrics/eval.jsonl";
  for (int i = 0; i < 3000 && read_lines(lines_path).empty(); ++i) std::this_thread::sleep_for(5ms);
  // Version 2 does not qualify ((2 - 1) % 2 != 0); version 3 does.
  publish(tmp.str("out"), policy, 2);
  publish(tmp.str("out"), policy, 3);
  runner.join();
  ASSERT_TRUE(st.ok()) << st.to_string();
  const auto lines = read_lines(lines_path);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["version"], 1);
  EXPECT_EQ(lines[1]["version"], 3);
  for (const json& line : lines) {
    EXPECT_EQ(line["role"], "eval");
    EXPECT_EQ(line["tasks"], 3);
    EXPECT_GE(line["eval_success"].get<double>(), 0.0);
    EXPECT_LE(line["eval_success"].get<double>(), 1.0);
    EXPECT_TRUE(line.contains("eval_reward"));
    EXPECT_TRUE(line.contains("time"));
  }
  EXPECT_FALSE(fs::exists(tmp.str("out") + "/metrics/actor-0.jsonl"));
}

TEST(ActorCommand, RunsUntilSigtermThenEndsRunningEpisodesAndExitsZero) {
  TempDir tmp;
  Replay replay(tmp);
  const model::ModelConfig config = tiny();
  model::Policy policy = constant_policy(config, logits_with({{SpecialToken::kEndTurn, std::log(6.0)}}));
  publish(tmp.str("out"), policy, 1);
  {
    std::ofstream toml(tmp.str("job.toml"));
    toml << "[job]\nname = \"cli\"\n"
         << "[policy]\nmodel = \"" << kTinyConfig << "\"\n"
         << "[env]\nname = \"arith\"\nconfig = '{\"max_operand\": 9}'\n"
         << "[actor]\nslots = 2\ngroup_size = 2\nmax_tokens = 200\nmax_turn_tokens = 64\nweights_poll_ms = 20\n"
         << "[replay]\nlisten = \"" << replay.endpoint() << "\"\n"
         << "[run]\nout = \"" << tmp.str("out") << "\"\n";
  }
  testing::Process actor({ODYSSEY_BINARY, "actor", "--config", tmp.str("job.toml"), "--index", "0"},
                         tmp.str("actor.log"));
  // Let it finish a few episodes, then stop it.
  const fs::path state = tmp.str("out") + "/actors/actor-0.json";
  bool progressed = false;
  for (int i = 0; i < 600 && !progressed; ++i) {
    std::this_thread::sleep_for(50ms);
    std::ifstream in(state);
    json s = json::parse(in, nullptr, false);
    progressed = s.is_object() && s.value("next_group", 0) >= 4;  // groups 0 and 1 are done
  }
  ASSERT_TRUE(progressed) << actor.output();
  actor.kill(SIGTERM);
  EXPECT_EQ(actor.wait(30s), 0) << actor.output();
  replay.stop();
  auto report = replay::verify_store(replay.store());
  ASSERT_TRUE(report.ok());
  EXPECT_TRUE(report->sound());
  const std::vector<Stored> all = read_all(replay.store());
  ASSERT_GE(all.size(), 4u);
  size_t complete = 0;
  for (const Stored& t : all) {
    EXPECT_EQ(std::string(t.record().getJob().cStr()), "cli");
    // Nothing is left in flight: an episode the signal interrupted is ended as failed.
    if (t.record().getStatus() == schema::TrajectoryStatus::FAILED) {
      EXPECT_NE(std::string(t.record().getError().cStr()).find("actor stopped"), std::string::npos);
    } else {
      EXPECT_EQ(t.record().getStatus(), schema::TrajectoryStatus::COMPLETE);
      ++complete;
    }
  }
  EXPECT_GE(complete, 4u);
  EXPECT_NE(actor.output().find("episodes"), std::string::npos);
}

}  // namespace
}  // namespace odyssey::actors
