// The learner: one rank of the RL trainer (`odyssey learner`). learner/README.md describes the
// whole step, the exactly-once argument and the metrics; this is the contract.
//
// Start (Trainer::create):
//   * builds the policy from policy.model (fp32 on policy.device) and, with learner.ranks > 1,
//     joins the c10d group (learner/distributed.h);
//   * weights: with `resume` the newest complete checkpoint under run.out/checkpoints (weights,
//     AdamW state, RNG, balancer biases, step, version, replay cursor, accounting); otherwise
//     policy.init (a stage checkpoint; empty = random init from job.seed, with a warning).
//     Rank 0's weights are broadcast to every rank;
//   * rank 0 tells the replay service resume(cursor) (deliveries after the checkpoint come back;
//     cursor 0 for a fresh start) before any rank samples, then publishes the weights as version
//     LATEST + 1 (or 1) to run.out/weights and reports it (set_policy_version).
// Step (Trainer::step), every rank in lockstep:
//   sample this rank's share of learner.groups_per_step whole groups → read their segments in
//   bounded pieces → GRPO advantages per group → recompute log-probs chunk by chunk with the
//   state carried (learner.chunk_tokens; exact chunked backward with learner.recompute,
//   learner/chunked_policy.h) → loss (learner/loss.h) summed over tokens → all-reduce the
//   gradient sums and divide by the global loss-token count → clip the global norm → AdamW at
//   the scheduled learning rate → quantile-balancer update of every MoE layer from the step's
//   routing (histograms summed over chunks and ranks) → every learner.publish_every steps rank 0
//   publishes the next version → rank 0 appends one JSON line to run.out/metrics/learner.jsonl →
//   every learner.checkpoint_every steps rank 0 checkpoints, then commits the replay cursor.
// Run (Trainer::run): steps until learner.steps are done or `stop` is raised (SIGTERM/SIGINT),
// then a final checkpoint (and commit). A stop raised while waiting for data abandons the partial
// batch: its deliveries stay leased and come back at the next resume.
//
// Errors: create/step/run return a Status (config, checkpoint, replay, c10d problems, each
// naming what failed); LibTorch exceptions inside a step are caught at that boundary and returned
// as kInternal. After an error the trainer must not be stepped again (restart with --resume).
// Thread-safety: one thread drives a Trainer.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/status.h"
#include "learner/loss.h"
#include "learner/optimizer.h"

namespace odyssey::learner {

struct TrainerOptions {
  // [run], [policy], [job], [replay]
  std::string out_dir = "out/run";
  std::string model_config = "configs/model/tiny.toml";
  std::string init;                  // policy.init
  std::string device = "cpu";
  std::string publish_dtype = "fp32";  // policy.dtype: the dtype of published weights
  int threads = 1;
  uint64_t seed = 0;
  std::string replay_endpoint = "tcp://127.0.0.1:5555";
  // [learner]
  int rank = 0;
  int ranks = 1;
  std::string backend = "gloo";
  std::string master = "127.0.0.1:29500";
  int64_t groups_per_step = 4;
  int64_t chunk_tokens = 2048;
  bool recompute = true;
  bool kda_keep_chunk_states = false;  // learner.kda_keep_chunk_states
  std::string float32_matmul_precision = "highest";  // learner.float32_matmul_precision (model/precision.h)
  int64_t steps = 200;
  AdamWOptions adamw;
  ScheduleOptions schedule;
  double max_grad_norm = 1.0;
  LossOptions loss;
  int64_t publish_every = 1;
  int64_t checkpoint_every = 20;
  int keep_checkpoints = 3;
  bool resume = false;
  // Not config keys: test and bench knobs.
  uint32_t sample_wait_ms = 500;     // slice of a blocking sample (stop is checked between slices)
  int replay_timeout_ms = 60000;     // the replay client gives up after this long without progress
  bool publish = true;               // publish weights (rank 0)
  bool write_metrics = true;         // rank 0
};

// Reads every key above from a resolved job config (core/config_keys.cpp).
TrainerOptions trainer_options(const Config& config, int rank, bool resume);

// One step's figures (over all ranks), as written to learner.jsonl.
struct StepMetrics {
  int64_t step = 0;
  uint32_t version = 0;
  double loss = 0, reward_mean = 0, success_rate = 0;
  double tokens = 0, trained_tokens = 0, tokens_per_s = 0, seconds = 0, wait_seconds = 0;
  double policy_lag_mean = 0, policy_lag_max = 0;
  double clip_fraction = 0, entropy = 0, ratio_mean = 0, ratio_max = 0, masked_fraction = 0, kl = 0;
  double grad_norm = 0, lr = 0;
  int64_t groups = 0, trajectories = 0;
  nlohmann::json to_json() const;
};

class Trainer {
 public:
  static Result<std::unique_ptr<Trainer>> create(const TrainerOptions& options);
  ~Trainer();

  // One optimizer step. kTimeout (and no step taken) when `stop` was raised while waiting for
  // data.
  Result<StepMetrics> step(const std::atomic<bool>* stop = nullptr);
  // Steps until options.steps are done or `stop`; then a final checkpoint. OK in both cases.
  Status run(const std::atomic<bool>& stop);
  // Writes a checkpoint of the current step (rank 0; a no-op elsewhere) and commits the cursor.
  Status checkpoint();

  int64_t step_count() const;
  uint32_t version() const;
  uint64_t trained_cursor() const;
  // The policy's parameters by name (the weights, for tests).
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  const TrainerOptions& options() const;

 private:
  struct Impl;
  explicit Trainer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace odyssey::learner
