// `odyssey pretrain` (learner/pretrain.h): a short two-stage run on demonstrations writes both
// stage checkpoints with their stage and provenance, the loss drops, the second stage starts from
// the first's weights and a saved stage reproduces its logits; the chunked path agrees with the
// whole-sequence one; bad stage lists are errors naming the key; the greedy evaluation plays
// the real environment in the transcript format.
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/types.h>

#include "envs/plugin.h"
#include "learner/pretrain.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/policy_checkpoint.h"
#include "test_helpers.h"

namespace odyssey::learner {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::TempDir;

std::string tiny_config() { return std::string(ODYSSEY_SOURCE_DIR) + "/configs/model/tiny.toml"; }

// A scaled-down schedule: stages labelled 1K and 2K, trained at 128 and 256 tokens per row.
PretrainOptions short_run(const std::string& out) {
  PretrainOptions o;
  o.out_dir = out;
  o.model_config = tiny_config();
  o.stages = {{"1K", 128}, {"2K", 256}};
  o.steps_per_stage = 12;
  o.batch_tokens = 256;
  o.lr = 1e-2;
  o.seed = 1;
  o.data.seed = 1;
  o.threads = 1;
  return o;
}

at::Tensor probe_logits(model::Policy& policy) {
  const at::NoGradGuard no_grad;
  const ByteTokenizer tok;
  std::vector<int64_t> ids{tok.special_id(SpecialToken::kBos), tok.special_id(SpecialToken::kUser)};
  for (uint32_t t : tok.encode("7*8=?")) ids.push_back(t);
  ids.push_back(tok.special_id(SpecialToken::kEndTurn));
  ids.push_back(tok.special_id(SpecialToken::kAssistant));
  const bool training = policy->is_training();
  policy->eval();
  at::Tensor logits = policy->forward(at::tensor(ids, at::kLong).unsqueeze(0)).clone();
  policy->train(training);
  return logits;
}

TEST(Pretrain, TwoShortStagesWriteCheckpointsAndTheSecondContinuesTheFirst) {
  TempDir tmp;
  PretrainOptions o = short_run(tmp.str("out"));
  at::Tensor end_of_first, start_of_second, end_of_second;
  o.on_stage_begin = [&](const StageSummary& s, model::Policy& p) {
    if (s.stage.name == "2K") start_of_second = probe_logits(p);
  };
  o.on_stage_end = [&](const StageSummary& s, model::Policy& p) {
    (s.stage.name == "1K" ? end_of_first : end_of_second) = probe_logits(p);
  };
  std::vector<PretrainProgress> progress;
  o.on_progress = [&](const PretrainProgress& p) { progress.push_back(p); };
  auto summary = run_pretrain(o);
  ASSERT_TRUE(summary.ok()) << summary.status().to_string();
  ASSERT_EQ(summary->stages.size(), 2u);

  // Progress every tenth of a stage (here every step) with a throughput figure.
  ASSERT_EQ(progress.size(), 24u);
  EXPECT_EQ(progress.back().stage, "2K");
  EXPECT_GT(progress.back().tokens_per_s, 0);

  std::set<std::string> entries;
  for (const auto& e : fs::directory_iterator(o.out_dir)) entries.insert(e.path().filename().string());
  EXPECT_EQ(entries, (std::set<std::string>{"stage-1K", "stage-2K"})) << "only complete stage folders remain";

  const int64_t rows[] = {2, 1};
  for (size_t i = 0; i < 2; ++i) {
    const StageSummary& s = summary->stages[i];
    EXPECT_EQ(s.dir, o.out_dir + "/stage-" + s.stage.name);
    EXPECT_TRUE(fs::exists(fs::path(s.dir) / "COMPLETE"));
    auto info = model::inspect_checkpoint(s.dir);
    ASSERT_TRUE(info.ok()) << info.status().to_string();
    EXPECT_EQ(info->meta.stage, s.stage.name);
    const json& p = info->meta.provenance;
    EXPECT_EQ(p["steps"], 12);
    EXPECT_EQ(p["tokens"], 12 * rows[i] * (s.stage.context - 1));
    EXPECT_EQ(p["context"], s.stage.context);
    EXPECT_EQ(p["data"], "demonstrations");
    EXPECT_EQ(p["seed"], 1);
    EXPECT_GT(p["loss_tokens"].get<int64_t>(), 0);
    EXPECT_DOUBLE_EQ(p["final_loss"].get<double>(), s.final_loss);
    EXPECT_EQ(p["parent_stage"], i == 0 ? json() : json("1K"));
  }
  // The loss drops: ln(271) = 5.6 at the start; the transcript's fixed parts are learned fast.
  const StageSummary& first = summary->stages[0];
  EXPECT_GT(first.first_loss, 4.5);
  EXPECT_LT(first.final_loss, 0.6 * first.first_loss) << first.first_loss << " -> " << first.final_loss;
  EXPECT_LT(summary->stages[1].final_loss, first.first_loss * 0.6);

  // Stage 2 starts from stage 1's weights, and stage 1's checkpoint reproduces them.
  ASSERT_TRUE(end_of_first.defined() && start_of_second.defined() && end_of_second.defined());
  EXPECT_TRUE(at::equal(end_of_first, start_of_second));
  auto config = model::load_model_config({tiny_config()});
  ASSERT_TRUE(config.ok());
  at::manual_seed(1234);
  model::Policy fresh(*config);
  EXPECT_FALSE(at::allclose(probe_logits(fresh), end_of_first));
  auto meta = model::load_policy(fresh, o.out_dir + "/stage-1K");
  ASSERT_TRUE(meta.ok()) << meta.status().to_string();
  EXPECT_TRUE(at::allclose(probe_logits(fresh), end_of_first, /*rtol=*/0, /*atol=*/1e-6))
      << (probe_logits(fresh) - end_of_first).abs().max().item<double>();
  ASSERT_TRUE(model::load_policy(fresh, o.out_dir + "/stage-2K").ok());
  EXPECT_TRUE(at::allclose(probe_logits(fresh), end_of_second, 0, 1e-6));
  EXPECT_FALSE(at::allclose(end_of_second, end_of_first, 0, 1e-3)) << "stage 2 trained";

  // A second run refuses to overwrite; --resume keeps both stages and trains nothing.
  PretrainOptions again = short_run(o.out_dir);
  auto refused = run_pretrain(again);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kAlreadyExists);
  EXPECT_NE(refused.status().message().find(o.out_dir + "/stage-1K"), std::string::npos) << refused.status().message();
  again.resume = true;
  int trained = 0;
  again.on_progress = [&](const PretrainProgress&) { ++trained; };
  auto resumed = run_pretrain(again);
  ASSERT_TRUE(resumed.ok()) << resumed.status().to_string();
  EXPECT_EQ(trained, 0);
  ASSERT_EQ(resumed->stages.size(), 2u);
  EXPECT_TRUE(resumed->stages[0].resumed && resumed->stages[1].resumed);
  EXPECT_DOUBLE_EQ(resumed->stages[1].final_loss, summary->stages[1].final_loss);
  EXPECT_FALSE(resumed->stages[1].eval.has_value()) << "no evaluation was asked for";

  // --resume --eval-tasks N: the complete last stage is evaluated without training.
  again.eval.episodes = 3;
  again.eval.max_tokens = 120;  // short: an untrained-looking policy may never end a turn
  again.eval.max_turn_tokens = 40;
  auto evaluated = run_pretrain(again);
  ASSERT_TRUE(evaluated.ok()) << evaluated.status().to_string();
  EXPECT_EQ(trained, 0);
  EXPECT_FALSE(evaluated->stages[0].eval.has_value()) << "only the last stage";
  ASSERT_TRUE(evaluated->stages[1].eval.has_value());
  EXPECT_EQ(evaluated->stages[1].eval->episodes, 3);
}

TEST(Pretrain, ChunkedStepAgreesWithTheWholeSequenceStep) {
  TempDir tmp;
  double first_loss[2] = {0, 0}, final_loss[2] = {0, 0};
  for (int chunked = 0; chunked < 2; ++chunked) {
    PretrainOptions o = short_run(tmp.str(chunked ? "chunked" : "whole"));
    o.stages = {{"1K", 256}};
    o.steps_per_stage = 2;
    o.lr = 3e-3;
    o.chunk_tokens = chunked ? 96 : 4096;  // 255 positions: three chunks, or one forward
    auto summary = run_pretrain(o);
    ASSERT_TRUE(summary.ok()) << summary.status().to_string();
    first_loss[chunked] = summary->stages[0].first_loss;
    final_loss[chunked] = summary->stages[0].final_loss;
  }
  EXPECT_NEAR(first_loss[0], first_loss[1], 1e-4);
  EXPECT_NEAR(final_loss[0], final_loss[1], 2e-2);
}

std::string write_config(const TempDir& tmp, const std::string& name, const std::string& text) {
  std::ofstream(tmp.str(name)) << text;
  return tmp.str(name);
}

TEST(Pretrain, BadStageListsAreErrorsNamingTheKeyAndWhere) {
  TempDir tmp;
  const std::string unknown = write_config(tmp, "unknown.toml", "[pretrain]\nstages = [\"1K\", \"1X\"]\n");
  auto config = load_config({unknown}, {});
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  auto options = pretrain_options(*config);
  ASSERT_FALSE(options.ok());
  EXPECT_NE(options.status().message().find("unknown.toml:2: key 'pretrain.stages'"), std::string::npos)
      << options.status().message();
  EXPECT_NE(options.status().message().find("'1X'"), std::string::npos) << options.status().message();

  const std::string shrinking = write_config(tmp, "shrinking.toml", "[pretrain]\nstages = [\"4K\", \"1K\"]\n");
  config = load_config({shrinking}, {});
  ASSERT_TRUE(config.ok());
  options = pretrain_options(*config);
  ASSERT_FALSE(options.ok());
  EXPECT_NE(options.status().message().find("key 'pretrain.stages'"), std::string::npos) << options.status().message();
  EXPECT_NE(options.status().message().find("must grow"), std::string::npos) << options.status().message();

  config = load_config({}, {});
  ASSERT_TRUE(config.ok());
  options = pretrain_options(*config);
  ASSERT_TRUE(options.ok()) << options.status().to_string();
  ASSERT_EQ(options->stages.size(), 2u);
  EXPECT_EQ(options->stages[1].context, 4096);

  // The command says the same and exits 2 before training anything.
  std::string out;
  const int code = testing::run_command({ODYSSEY_BINARY, "pretrain", "--config", shrinking, "--set",
                                         "pretrain.out=" + tmp.str("never")},
                                        &out);
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("pretrain.stages"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(tmp.str("never")));
}

TEST(Pretrain, StageNamesAreContextLengths) {
  EXPECT_EQ(*stage_tokens("1K"), 1024);
  EXPECT_EQ(*stage_tokens("64K"), 65536);
  EXPECT_EQ(*stage_tokens("1M"), 1048576);
  for (const char* bad : {"", "K", "0K", "1k", "1.5K", "12", "1G"}) EXPECT_FALSE(stage_tokens(bad).ok()) << bad;
  auto same = parse_stages({"1K", "1K"}, "where");
  ASSERT_FALSE(same.ok());
  EXPECT_NE(same.status().message().find("where: stages must grow"), std::string::npos) << same.status().message();
  EXPECT_FALSE(parse_stages({}, "where").ok());
}

TEST(GreedyEvaluation, PlaysHeldOutTasksInTheTranscriptFormat) {
  auto config = model::load_model_config({tiny_config()});
  ASSERT_TRUE(config.ok());
  at::manual_seed(3);
  model::Policy policy(*config);
  policy->train();
  const ByteTokenizer tok;
  GreedyEvalOptions o;
  o.env_config = {{"min_steps", 1}, {"max_steps", 1}, {"max_operand", 9}};
  o.episodes = 3;
  o.max_tokens = 120;
  o.max_turn_tokens = 40;
  o.keep_transcripts = 3;
  auto result = evaluate_greedy(policy, tok, o);
  ASSERT_TRUE(result.ok()) << result.status().to_string();
  EXPECT_TRUE(policy->is_training()) << "the caller's mode is restored";
  EXPECT_EQ(result->episodes, 3);
  EXPECT_LE(result->successes, 3);
  EXPECT_GT(result->generated_tokens, 0);
  EXPECT_LE(result->generated_tokens, 3 * 120);
  ASSERT_EQ(result->transcripts.size(), 3u);
  auto plugin = envs::Plugin::load(*envs::find_plugin("arith"));
  ASSERT_TRUE(plugin.ok());
  auto session = (*plugin)->create(o.env_config);
  ASSERT_TRUE(session.ok());
  for (uint64_t i = 0; i < 3; ++i) {
    auto obs = (*session)->reset({{"split", "eval"}, {"index", i}}, 0);
    ASSERT_TRUE(obs.ok());
    const std::string& t = result->transcripts[i];
    EXPECT_EQ(t.rfind("<|bos|><|user|>" + obs->text + "<|end_turn|><|assistant|>", 0), 0u) << t;
    EXPECT_EQ(t.substr(t.size() - 7), "<|eos|>") << t;
  }
}

}  // namespace
}  // namespace odyssey::learner
