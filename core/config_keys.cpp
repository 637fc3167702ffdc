// Every configuration key odyssey reads: its path, type, default, one-line doc and limits.
// `odyssey config keys` prints this registry; configs/base.toml restates the defaults.
// To add a key, add one line to its section (or a new section) below.
#include "core/config.h"

namespace odyssey {

namespace {

ConfigSchema build_config_schema() {
  ConfigSchema s;

  // [job]: what every role of a job shares.
  s.add_string("job.name", "tiny", "job name: labels logs, metrics and output");
  s.add_int("job.seed", 0, "seed for every random choice the job makes, so a run repeats exactly");

  // [replay]: the replay service that stores trajectories and serves samples.
  s.add_string("replay.dir", "out/replay", "directory of the write-ahead log and stored trajectories");
  s.add_string("replay.listen", "tcp://127.0.0.1:5555", "ZeroMQ address the replay service binds");
  s.add_int("replay.credits", 16, "unacknowledged segments a writer may have in flight", at_least(1));
  s.add_int("replay.max_message_bytes", 67108864, "largest message accepted; larger ones are rejected",
            at_least(4096));
  s.add_bool("replay.sync", true, "fsync the write-ahead log before acknowledging");
  s.add_int("replay.group_commit_bytes", 8388608, "most bytes in one durable write batch", at_least(0));
  s.add_string("replay.sampler", "fifo", "which stored items a sample returns, and in what order",
               {"fifo", "uniform", "prioritized", "group_complete"});
  s.add_int("replay.max_times_sampled", 1,
            "uniform/prioritized items are consumed after this many samples; 0 = never", at_least(0));
  s.add_double("replay.priority_exponent", 1.0,
               "prioritized sampler: an item's chance is proportional to priority^exponent", at_least(0));
  s.add_int("replay.sampler_seed", 0, "seed of the uniform and prioritized samplers");
  s.add_string("replay.checkpoint_dir", "", "directory for replay checkpoints; empty = no checkpoints");
  s.add_int("replay.checkpoint_every_seconds", 0, "seconds between periodic checkpoints; 0 = none",
            at_least(0));

  // [replay.rate_limiter]: when samples may be served, relative to inserts.
  s.add_int("replay.rate_limiter.min_size_to_sample", 1, "items stored before any sample is served",
            at_least(1));
  s.add_double("replay.rate_limiter.samples_per_insert", 0.0,
               "target samples per inserted item; 0 disables the ratio", at_least(0));
  s.add_double("replay.rate_limiter.error_buffer", 64.0,
               "how many samples the ratio may run ahead of or behind samples_per_insert", at_least(0));
  s.add_int("replay.rate_limiter.max_policy_lag", 0,
            "oldest policy a sampled item may come from, in versions behind the newest; 0 = unbounded",
            at_least(0));

  // [replay.retention]: what the replay service removes to bound its storage.
  s.add_int("replay.retention.max_trajectories", 0, "most trajectories kept, oldest removed first; 0 = unbounded",
            at_least(0));
  s.add_int("replay.retention.max_bytes", 0, "most stored bytes kept, oldest removed first; 0 = unbounded",
            at_least(0));
  s.add_bool("replay.retention.remove_unconsumed", false,
             "whether retention may remove items that were never consumed by sampling");

  // [bench.replay]: `odyssey bench replay`.
  s.add_int("bench.replay.writers", 4, "concurrent trajectory writers", at_least(1));
  s.add_int("bench.replay.trajectories", 256, "trajectories written, spread over the writers", at_least(1));
  s.add_int("bench.replay.segments_per_trajectory", 8, "segments in each trajectory", at_least(1));
  s.add_int("bench.replay.tokens_per_segment", 4096, "tokens in each segment", at_least(1));
  s.add_bool("bench.replay.million_token", true, "also stream and verify one 1M-token trajectory");

  // [policy]: the model every role runs.
  s.add_string("policy.model", "configs/model/tiny.toml", "model config TOML (configs/model/)");
  s.add_string("policy.init", "", "stage checkpoint the job starts from; empty = random weights (warned)");
  s.add_string("policy.dtype", "fp32", "dtype of weights and activations in actors and learner",
               {"fp32", "bf16"});
  s.add_string("policy.device", "cpu", "device of actors and learner: cpu, or cuda (GPU build)");
  s.add_int("policy.threads", 1, "LibTorch intra-op threads per process", at_least(1));

  // [env]: the environment actors play in.
  s.add_string("env.name", "arith", "built-in plugin name, a plugin path, or \"mcp\" (then env.config has the command)");
  s.add_string("env.config", "{}", "the environment's JSON config (a JSON object, as text)");
  s.add_bool("env.hosted", false, "run each instance in a sandboxed `odyssey env-host` process");
  s.add_int("env.call_timeout_ms", 10000, "hosted: most milliseconds one environment call may take", at_least(1));
  s.add_int("env.memory_mb", 1024, "hosted: address-space limit of each env-host process", at_least(16));

  // [actor]: rollout processes.
  s.add_int("actor.count", 1, "actor processes `odyssey run` starts", at_least(1));
  s.add_int("actor.slots", 16, "episodes each actor runs at once (continuous batching)", at_least(1));
  s.add_int("actor.group_size", 8, "episodes per task with different sampling seeds (one GRPO group)", at_least(1));
  s.add_double("actor.temperature", 1.0, "sampling temperature; 0 = greedy", at_least(0));
  s.add_double("actor.top_p", 1.0, "nucleus sampling: smallest set of tokens with this much probability",
               between(0, 1));
  s.add_int("actor.top_k", 0, "sample among the k most likely tokens; 0 = all", at_least(0));
  s.add_int("actor.max_tokens", 1024, "token budget of one trajectory (prompt, turns and observations)",
            at_least(16));
  s.add_int("actor.max_turn_tokens", 256, "most tokens the model may write in one turn", at_least(1));
  s.add_int("actor.segment_tokens", 4096, "a segment is sent after this many tokens (or at a turn's end)",
            at_least(1));
  s.add_int("actor.snapshot_every_tokens", 0, "recurrent-state snapshot every this many tokens; 0 = none",
            at_least(0));
  s.add_int("actor.weights_poll_ms", 200, "how often an actor checks for newer weights between tokens",
            at_least(1));

  // [learner]: the trainer ranks.
  s.add_int("learner.ranks", 1, "data-parallel learner processes (c10d)", at_least(1));
  s.add_string("learner.backend", "gloo", "c10d backend: gloo (CPU) or nccl (GPU)", {"gloo", "nccl"});
  s.add_string("learner.master", "127.0.0.1:29500", "rendezvous address of rank 0 (c10d TCPStore)");
  s.add_int("learner.groups_per_step", 4, "GRPO groups in one optimizer step (over all ranks)", at_least(1));
  s.add_int("learner.chunk_tokens", 2048, "tokens per chunk when recomputing log-probs, state carried",
            at_least(16));
  s.add_bool("learner.recompute", true, "recompute activations in the backward, chunk by chunk");
  s.add_bool("learner.kda_keep_chunk_states", false,
             "GPU: with recompute, each chunk's KDA kernels keep their chunk states for its backward (one pass "
             "less; chunk_tokens * heads * d_k * d_v / 8 bytes per KDA layer held until the chunk's backward)");
  s.add_string("learner.float32_matmul_precision", "highest",
               "GPU: what fp32 training may trade for speed: highest (fp32 matmuls), high (cuBLAS TF32 for the "
               "projections), medium (high, and the KDA core, MoE routed experts and MLA attention on bf16 copies: their "
               "fast kernels; model/precision.h)",
               {"highest", "high", "medium"});
  s.add_int("learner.steps", 200, "optimizer steps of the job", at_least(1));
  s.add_double("learner.lr", 1e-4, "peak learning rate (AdamW)", at_least(0));
  s.add_double("learner.weight_decay", 0.0, "AdamW weight decay", at_least(0));
  s.add_double("learner.beta1", 0.9, "AdamW beta1", between(0, 1));
  s.add_double("learner.beta2", 0.95, "AdamW beta2", between(0, 1));
  s.add_int("learner.warmup_steps", 5, "linear warm-up steps", at_least(0));
  s.add_string("learner.schedule", "constant", "learning rate after warm-up", {"constant", "cosine"});
  s.add_double("learner.max_grad_norm", 1.0, "clip the global gradient norm to this; 0 = off", at_least(0));
  s.add_double("learner.clip_low", 0.2, "PPO: ratio floor 1 - clip_low", between(0, 1));
  s.add_double("learner.clip_high", 0.28, "PPO: ratio ceiling 1 + clip_high", at_least(0));
  s.add_double("learner.tis_cap", 2.0, "truncated importance weight cap against the actors' log-probs",
               at_least(1));
  s.add_double("learner.mask_ratio_above", 10.0,
               "tokens whose ratio to the actors' policy exceeds this (or is below its inverse) are masked",
               at_least(1));
  s.add_double("learner.kl_coef", 0.0, "KL penalty to the reference (initial) policy; 0 = off", at_least(0));
  s.add_double("learner.entropy_coef", 0.0, "entropy bonus", at_least(0));
  s.add_int("learner.publish_every", 1, "publish weights to actors every this many steps", at_least(1));
  s.add_int("learner.checkpoint_every", 20, "checkpoint every this many steps", at_least(1));
  s.add_int("learner.keep_checkpoints", 3, "checkpoints kept (older ones removed)", at_least(1));

  // [run]: `odyssey run`, the whole job on one machine.
  s.add_string("run.out", "out/run", "output directory: metrics.jsonl, checkpoints, weights, replay, logs");
  s.add_int("run.eval_every", 20, "held-out evaluation every this many learner steps; 0 = none", at_least(0));
  s.add_int("run.eval_tasks", 64, "held-out tasks per evaluation (env split \"eval\")", at_least(1));
  s.add_double("run.max_minutes", 0.0, "stop (with a final checkpoint) after this long; 0 = when the learner is done",
               at_least(0));
  s.add_int("run.restart_limit", 5, "restarts of a crashed role before the job gives up", at_least(0));
  s.add_int("run.log_every_seconds", 10, "progress log line period when not on a terminal", at_least(1));

  // [pretrain]: `odyssey pretrain`, the stage checkpoints RL starts from.
  s.add_string("pretrain.out", "out/pretrain", "directory of the stage checkpoints");
  s.add_strings("pretrain.stages", {"1K", "4K"}, "context stages in order; each continues the previous one");
  s.add_int("pretrain.steps_per_stage", 200, "optimizer steps in each stage", at_least(1));
  s.add_int("pretrain.batch_tokens", 8192, "tokens per optimizer step", at_least(16));
  s.add_double("pretrain.lr", 3e-3, "peak learning rate", at_least(0));
  s.add_int("pretrain.threads", 0, "LibTorch intra-op threads while pretraining (0: policy.threads)", at_least(0));
  s.add_string("pretrain.data", "demonstrations", "what to train on",
               {"demonstrations", "text", "mixed"});

  return s;
}

}  // namespace

const ConfigSchema& config_schema() {
  static const ConfigSchema schema = build_config_schema();
  return schema;
}

}  // namespace odyssey
