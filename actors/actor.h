// The actor: runs episodes of an environment with the current policy and streams them to the
// replay service (`odyssey actor`), or evaluates published weights on held-out tasks
// (`odyssey actor --eval`).
//
// Rollouts (run):
//   * Weights: waits for the learner's first publication in <run.out>/weights (logs once
//     "waiting for weights in ..."), loads it, and between tokens takes newer versions
//     (model::WeightSubscriber::refresh, at most every actor.weights_poll_ms). In-flight
//     episodes continue across a change; each token records the version that sampled it.
//   * Episodes: actor.slots run at once. Tasks come in GRPO groups: actor.group_size episodes
//     of one task {"split": "train", "index": N} with one environment seed and different
//     sampling sequences. Group g of actor i of `actor.count` uses task index
//     g * count + i (offset by job.seed * 1e6), group id and environment seed hashed from
//     (job.name, job.seed, i, g). The next group number is kept in
//     <run.out>/actors/actor-<i>.json, so a restarted actor never reuses a group id; a fresh
//     output folder repeats a run exactly (job.seed, actor index, episode counter -> seeds).
//   * Continuous batching (actors/ragged_decoder.h): every slot with one token to feed joins
//     one batched decode step; prompts and observations are prefilled per slot with
//     forward_chunk (in chunks of at most 4096 tokens, cut at snapshot positions). A finished
//     episode frees its slot for the next one. Environment calls (reset, each turn's step,
//     the final score) run on worker threads, so a slot waiting on its environment never
//     holds back the others.
//   * The tool-call loop and the transcript format: actors/transcript.h. Malformed calls,
//     unknown tools and environment failures are observations the model sees (envs::Episode);
//     an environment that fails ends its trajectory as failed (reason recorded).
//   * Streaming: TrajectoryWriter (replay/client.h) at replay.listen; meta: job.name,
//     environment name/version/plugin hash, task JSON, environment seed, group id and size.
//     Segments are sent as they fill (actor.segment_tokens) and at each turn's round end;
//     recurrent-state snapshots (KDA states, actors/ragged_decoder.h) every
//     actor.snapshot_every_tokens tokens; end() carries the score's reward and its parts.
//     TrajectoryWriter::begin blocks while the replay's rate limiter holds new trajectories
//     back: that is the actor's back-pressure.
//   * Metrics: <run.out>/metrics/actor-<i>.jsonl gets a JSON line about every 5 s:
//     {"role": "actor-<i>", "time", "index", "episodes", "failures", "tokens" (model-written,
//     total), "trajectory_tokens", "tokens_per_s" (model tokens since the last line),
//     "version", "window_episodes"} and, when window_episodes > 0, "reward_mean" and
//     "success_rate" over the episodes finished since the last line.
//   * Stopping: when `stop` becomes true (SIGTERM/SIGINT in the CLI) or max_episodes
//     episodes have finished: episodes still running are ended as failed ("actor stopped"),
//     everything is flushed to the replay service, and run() returns OK.
//   * Memory: per slot the KDA states (constant) and the MLA latent caches (growing with the
//     trajectory); tokens leave as segments, so nothing else grows with the trajectory.
//
// Evaluation (run_eval): for the first version seen and every version v with
// (v - 1) % run.eval_every == 0 (eval_every 0: the first version only), greedy decoding
// (temperature 0) of run.eval_tasks tasks {"split": "eval", "index": 0..n-1} (environment seed
// = index), all with weights v, nothing written to replay; then one line in
// <run.out>/metrics/eval.jsonl: {"role": "eval", "time", "version", "eval_success",
// "eval_reward", "tasks"}. A qualifying version that was pruned before its turn came is
// skipped. Stops on `stop` or after max_evals evaluations.
//
// Errors: run / run_eval return a Status for what the actor cannot work around (no replay
// service within its give-up time, an environment that cannot be created, a broken model
// config, LibTorch errors, converted at this boundary). Thread-safety: one thread calls
// run or run_eval; the Actor owns its worker threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "actors/sampling.h"
#include "core/config.h"
#include "core/status.h"

namespace odyssey::actors {

struct ActorOptions {
  int index = 0;
  std::string out_dir = "out/run";  // run.out
  std::string job = "tiny";         // job.name
  uint64_t seed = 0;                // job.seed
  int actor_count = 1;              // actor.count

  std::string model_config = "configs/model/tiny.toml";  // policy.model
  std::string dtype = "fp32";                            // policy.dtype
  std::string device = "cpu";                            // policy.device
  int threads = 1;                                       // policy.threads

  std::string env_name = "arith";  // env.name
  nlohmann::json env_config = nlohmann::json::object();
  bool env_hosted = false;
  int env_call_timeout_ms = 10000;
  int env_memory_mb = 1024;
  std::string odyssey_binary;  // hosted environments: the odyssey executable ("" = this one)

  int slots = 16;
  int group_size = 8;
  SamplingOptions sampling;
  int64_t max_tokens = 1024;
  int64_t max_turn_tokens = 256;
  int64_t segment_tokens = 4096;
  int64_t snapshot_every_tokens = 0;
  int weights_poll_ms = 200;

  std::string replay_endpoint = "tcp://127.0.0.1:5555";
  int replay_give_up_ms = 120000;

  int eval_every = 20;
  int eval_tasks = 64;

  int64_t max_episodes = 0;  // rollouts: stop after this many finished episodes; 0 = never
  int64_t max_evals = 0;     // eval: stop after this many evaluations; 0 = never
  double metrics_every_s = 5.0;
  int env_workers = 0;       // threads for environment calls; 0 = min(slots, 8)
};

// The options of actor `index` from a job config; kInvalidArgument names the key at fault.
Result<ActorOptions> actor_options_from_config(const Config& config, int index);

struct ActorStats {
  uint64_t episodes = 0;           // finished (failed ones included)
  uint64_t failures = 0;           // episodes ended as failed
  uint64_t model_tokens = 0;       // tokens the model wrote
  uint64_t trajectory_tokens = 0;  // every token of finished and running trajectories
  uint64_t segments = 0;           // segments sent
  uint64_t evals = 0;              // evaluation lines written
  uint32_t version = 0;            // weights version in use
};

class Actor {
 public:
  static Result<std::unique_ptr<Actor>> create(const ActorOptions& options);
  ~Actor();
  Actor(const Actor&) = delete;
  Actor& operator=(const Actor&) = delete;

  Status run(const std::atomic<bool>& stop);
  Status run_eval(const std::atomic<bool>& stop);

  const ActorStats& stats() const;

 private:
  class Impl;
  explicit Actor(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace odyssey::actors
