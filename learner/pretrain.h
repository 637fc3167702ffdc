// `odyssey pretrain`: the stage checkpoints RL starts from, trained with a progressive context
// schedule on demonstrations and text (learner/demonstrations.h), and a greedy evaluation of a
// policy on held-out tasks.
//
// Stages (pretrain.stages, e.g. 1K -> 4K -> 16K -> 64K) run in order, each continuing from the
// previous one's weights. A stage with context L trains pretrain.steps_per_stage steps; a step
// is max(1, batch_tokens / L) rows of exactly L packed tokens (SequencePacker): next-token
// cross-entropy on the tokens whose loss mask is 1, averaged over those tokens; the gradient's
// global norm clipped to 1; AdamW (learner/optimizer.h: β = 0.9/0.95, weight decay 0.01) at
// pretrain.lr with linear warm-up over the first tenth of the stage's steps and cosine decay to
// zero at its end (each stage its own schedule and fresh moments); then every MoE layer's
// quantile balancer moves its bias from the step's routing (pad positions left out), as the
// learner does. Rows longer than learner.chunk_tokens go through the exact chunked backward with
// the state carried (learner/chunked_policy.h, activation recomputation per learner.recompute),
// so a 64K row never materializes its activations at once.
//
// When a stage is done its weights are saved with model::save_policy to
// pretrain.out/stage-<STAGE>/ (written to a temporary folder, renamed, COMPLETE last: a stage's
// folder exists only once complete), with CheckpointMeta{stage, provenance}: provenance holds
// "steps", "tokens" (rows × positions trained on), "loss_tokens", "data", "final_loss" (mean
// loss of the stage's last tenth of steps, 1 to 10 of them), "first_loss", "seed", "parent_stage" (null for
// the first stage), "context", "batch_tokens", "lr", "job", "seconds", and "eval" when an
// evaluation ran. Weights are stored in policy.dtype; training runs in fp32 on policy.device.
//
// An existing stage folder is an error (kAlreadyExists, naming it) unless `resume` (a complete
// stage is loaded and skipped; training continues with the next one) or `overwrite`. A resumed
// last stage is still evaluated when eval.episodes > 0 (evaluating existing checkpoints).
//
// Errors: pretrain_options names the key and where it was set (file:line, --set, default) for a
// bad stage string, stages not strictly increasing, and the like. run_pretrain returns a Status
// for plugin, checkpoint and I/O problems; LibTorch errors inside a step come back as kInternal.
// Thread-safety: run_pretrain drives one Policy on the calling thread.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/status.h"
#include "core/tokenizer.h"
#include "learner/demonstrations.h"
#include "model/policy.h"

namespace odyssey::learner {

struct PretrainStage {
  std::string name;     // the checkpoint's stage label: "1K", "64K", "1M"
  int64_t context = 0;  // tokens per row: 1K = 1024, 1M = 1048576
};

// "1K" -> 1024, "1M" -> 1048576 (model::validate_stage's spelling); kInvalidArgument otherwise.
Result<int64_t> stage_tokens(const std::string& stage);
// Checks every name and that contexts strictly increase; `where` prefixes errors (e.g.
// "config configs/pretrain-tiny.toml:7: key 'pretrain.stages'").
Result<std::vector<PretrainStage>> parse_stages(const std::vector<std::string>& names, const std::string& where);

// Greedy rollouts of a policy in an environment: the transcript format of actors/transcript.h,
// the model's turns decoded with Policy::step (argmax) up to <|end_turn|>, <|eos|> or
// max_turn_tokens, each turn handed to envs::Episode (TurnParser + the real plugin).
struct GreedyEvalOptions {
  std::string env = "arith";                  // plugin name or path
  nlohmann::json env_config = nlohmann::json::object();
  std::string split = "eval";                 // tasks {"split": split, "index": first_index + i}
  uint64_t first_index = 0;
  int64_t episodes = 64;
  int64_t max_tokens = 1024;                  // per episode, prompt included
  int64_t max_turn_tokens = 256;
  int64_t keep_transcripts = 0;               // decoded transcripts of the first N episodes
};

struct EvalResult {
  int64_t episodes = 0;
  int64_t successes = 0;
  double success_rate = 0;
  double mean_reward = 0;
  int64_t generated_tokens = 0;
  double seconds = 0;
  std::vector<std::string> transcripts;
  nlohmann::json to_json() const;
};

// Runs without autograd; the policy's weights are only read.
Result<EvalResult> evaluate_greedy(model::Policy& policy, const Tokenizer& tokenizer, const GreedyEvalOptions& options);

// One progress report (every PretrainOptions::log_every steps and at a stage's last step).
struct PretrainProgress {
  std::string stage;
  int64_t step = 0;   // 1-based within the stage
  int64_t steps = 0;
  double loss = 0;    // mean loss of the steps since the last report
  double lr = 0;
  double grad_norm = 0;
  double tokens_per_s = 0;  // positions trained on per second, since the last report
  double seconds = 0;       // since the run started
};

struct StageSummary {
  PretrainStage stage;
  std::string dir;
  int64_t steps = 0;
  int64_t tokens = 0;
  int64_t loss_tokens = 0;
  double first_loss = 0;
  double final_loss = 0;
  double seconds = 0;
  bool resumed = false;  // loaded from an existing checkpoint, not trained
  std::optional<EvalResult> eval;
};

struct PretrainSummary {
  std::vector<StageSummary> stages;
  int64_t tokens = 0;
  double seconds = 0;
};

struct PretrainOptions {
  std::string out_dir = "out/pretrain";
  std::string model_config = "configs/model/tiny.toml";
  std::vector<PretrainStage> stages;
  int64_t steps_per_stage = 200;
  int64_t batch_tokens = 8192;
  double lr = 3e-3;
  double weight_decay = 0.01;
  double max_grad_norm = 1.0;
  int64_t chunk_tokens = 2048;  // learner.chunk_tokens
  bool recompute = true;        // learner.recompute
  bool kda_keep_chunk_states = false;  // learner.kda_keep_chunk_states
  std::string float32_matmul_precision = "highest";  // learner.float32_matmul_precision (model/precision.h)
  DataOptions data;             // data.seed = job.seed
  uint64_t seed = 0;            // job.seed: initial weights and data
  std::string job = "tiny";
  std::string device = "cpu";
  std::string save_dtype = "fp32";  // policy.dtype
  int threads = 1;
  int64_t log_every = 0;  // steps between progress reports; 0 = a tenth of a stage
  bool resume = false;
  bool overwrite = false;
  // Evaluate each stage's final weights before saving (recorded in provenance); 0 episodes = no.
  GreedyEvalOptions eval{"arith", nlohmann::json::object(), "eval", 0, 0};

  std::function<void(const PretrainProgress&)> on_progress;
  // Called with the policy as a stage begins (weights it starts from) and as it ends (weights
  // about to be saved); for tests and tools.
  std::function<void(const StageSummary&, model::Policy&)> on_stage_begin;
  std::function<void(const StageSummary&, model::Policy&)> on_stage_end;
};

// Every key above from a resolved job config ([pretrain], [policy], [job], learner.chunk_tokens,
// learner.recompute; the evaluation's environment from [env]).
Result<PretrainOptions> pretrain_options(const Config& config);

Result<PretrainSummary> run_pretrain(const PretrainOptions& options);

}  // namespace odyssey::learner
