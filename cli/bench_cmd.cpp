// odyssey bench replay | model | learner | actor | trajectory
#include <cstdio>

#include <spdlog/spdlog.h>

#include "bench/actor_bench.h"
#include "bench/kernels_bench.h"
#include "bench/learner_bench.h"
#include "bench/model_bench.h"
#include "bench/replay_bench.h"
#include "bench/trajectory_bench.h"
#include "cli/commands.h"

namespace odyssey::cli {

void add_bench_commands(CLI::App& app, Action& action) {
  auto* bench = app.add_subcommand("bench", "benchmarks; each ends with a `name: ratio` line");
  bench->require_subcommand(1);
  static ConfigArgs args;
  auto* replay = bench->add_subcommand(
      "replay", "replay ingest end to end vs raw RocksDB writes of the same bytes ([bench.replay] keys)");
  add_config_options(replay, args);
  replay->callback([&action] {
    action = [] {
      auto c = resolve_config(args);
      if (!c) return 2;
      if (args.dry_run) {
        std::fputs(c->to_toml().c_str(), stdout);
        return 0;
      }
      bench::ReplayBenchOptions o;
      o.writers = static_cast<uint32_t>(c->get_int("bench.replay.writers"));
      o.trajectories = static_cast<uint32_t>(c->get_int("bench.replay.trajectories"));
      o.segments_per_trajectory = static_cast<uint32_t>(c->get_int("bench.replay.segments_per_trajectory"));
      o.tokens_per_segment = static_cast<uint32_t>(c->get_int("bench.replay.tokens_per_segment"));
      o.million_token = c->get_bool("bench.replay.million_token");
      o.sync = c->get_bool("replay.sync");
      o.credits = static_cast<uint32_t>(c->get_int("replay.credits"));
      auto r = bench::run_replay_bench(o);
      if (!r.ok()) {
        spdlog::error("bench replay: {}", r.status().to_string());
        return 1;
      }
      return 0;
    };
  });

  static bench::ModelBenchOptions model_options;
  auto* model = bench->add_subcommand(
      "model", "the whole policy and its layers in each form, a training step (tokens/s), and chunked KDA vs its recurrence at T=4096 (CPU)");
  model->add_option("--model-config", model_options.model_config, "model config TOML")->capture_default_str();
  model->add_option("--sequence", model_options.sequence, "tokens for the parallel and chunked forms")
      ->capture_default_str();
  model->add_option("--decode", model_options.decode, "tokens for the one-at-a-time forms")->capture_default_str();
  model->add_option("--kda-tokens", model_options.kda_tokens, "T of the chunked-vs-recurrent comparison")
      ->capture_default_str();
  model->add_option("--train-tokens", model_options.train_tokens, "tokens of the training-step row")
      ->capture_default_str();
  model->add_option("--device", model_options.device, "cpu or cuda")->capture_default_str();
  model->add_option("--dtype", model_options.dtype, "fp32 or bf16")->capture_default_str();
  model->add_option("--repeats", model_options.repeats, "best of this many runs")->capture_default_str();
  model->callback([&action] {
    action = [] {
      auto r = bench::run_model_bench(model_options);
      if (!r.ok()) {
        spdlog::error("bench model: {}", r.status().to_string());
        return 1;
      }
      return 0;
    };
  });

  static bench::KernelsBenchOptions kernels_options;
  auto* kernels = bench->add_subcommand(
      "kernels", "CUDA kernels vs their LibTorch references: chunked KDA forward (B=2 T=16K H=64, B=1 T=64K H=4), "
                 "backward and decode (batch 256), ms, TFLOP/s, fraction of the memory floor; the MoE layer at the "
                 "small config's expert shapes (8K tokens, bf16) vs a dense matmul of the same FLOPs (GPU build only)");
  kernels->add_option("--suite", kernels_options.suite, "kda, moe, attn_res or all")
      ->check(CLI::IsMember({"kda", "moe", "attn_res", "all"}))
      ->capture_default_str();
  kernels->add_option("--moe-tokens", kernels_options.moe_tokens, "tokens of the MoE layer rows")
      ->capture_default_str();
  kernels->add_option("--repeats", kernels_options.repeats, "kernel timings: best/median of this many")
      ->capture_default_str();
  kernels->add_option("--warmup", kernels_options.warmup, "untimed runs first")->capture_default_str();
  kernels->add_option("--reference-repeats", kernels_options.reference_repeats,
                      "LibTorch reference timings: best of this many")
      ->capture_default_str();
  kernels->add_flag("!--no-reference", kernels_options.reference, "skip timing the LibTorch references");
  kernels->callback([&action] {
    action = [] {
      auto r = bench::run_kernels_bench(kernels_options);
      if (!r.ok()) {
        spdlog::error("bench kernels: {}", r.status().to_string());
        return 1;
      }
      return 0;
    };
  });

  static bench::ActorBenchOptions actor_options;
  auto* actor = bench->add_subcommand(
      "actor", "decode tokens/s at long contexts, hybrid (KDA + MLA) vs an all-MLA variant of the same size (CPU)");
  actor->add_option("--model-config", actor_options.model_config, "model config TOML")->capture_default_str();
  actor->add_option("--contexts", actor_options.contexts, "context lengths, ascending")->capture_default_str();
  actor->add_option("--real-prefill", actor_options.real_prefill,
                    "prefill for real up to this many tokens; longer contexts extend the MLA caches")
      ->capture_default_str();
  actor->add_option("--chunk", actor_options.chunk, "forward_chunk size of the prefill")->capture_default_str();
  actor->add_option("--decode", actor_options.decode, "decode steps per timed run")->capture_default_str();
  actor->add_option("--repeats", actor_options.repeats, "timed runs per row (best counts)")->capture_default_str();
  actor->add_option("--threads", actor_options.threads, "LibTorch threads (0 = default)")->capture_default_str();
  actor->callback([&action] {
    action = [] {
      auto r = bench::run_actor_bench(actor_options);
      if (!r.ok()) {
        spdlog::error("bench actor: {}", r.status().to_string());
        return 1;
      }
      return 0;
    };
  });

  static bench::LearnerBenchOptions learner_options;
  auto* learner = bench->add_subcommand(
      "learner", "the learner's training step (chunked recompute, loss, AdamW) in tokens/s vs a plain LibTorch "
                 "whole-sequence step, at a few lengths (CPU); --long N: one step on an N-token trajectory");
  learner->add_option("--model-config", learner_options.model_config, "model config TOML")->capture_default_str();
  learner->add_option("--lengths", learner_options.lengths, "sequence lengths")->capture_default_str();
  learner->add_option("--batch-tokens", learner_options.batch_tokens, "tokens per step at every length")
      ->capture_default_str();
  learner->add_option("--chunk-tokens", learner_options.chunk_tokens, "learner.chunk_tokens")->capture_default_str();
  learner->add_option("--threads", learner_options.threads, "LibTorch intra-op threads")->capture_default_str();
  learner->add_option("--repeats", learner_options.repeats, "best of this many runs")->capture_default_str();
  learner->add_option("--long", learner_options.long_tokens, "instead: one step on one trajectory of this many tokens");
  learner->add_option("--device", learner_options.device, "cpu or cuda (GPU build)")->capture_default_str();
  learner->add_option("--float32-matmul-precision", learner_options.float32_matmul_precision,
                      "learner.float32_matmul_precision: highest, high (TF32) or medium (and bf16 KDA / MoE kernels)")
      ->capture_default_str();
  learner->add_option("--profile", learner_options.profile_path,
                      "with --long: profile one more warm step with LibTorch's profiler, write its Chrome trace to "
                      "this file and print where the device's time went");
  learner->add_flag("--kda-keep-chunk-states", learner_options.kda_keep_chunk_states,
                    "learner.kda_keep_chunk_states: each chunk's forward keeps its KDA chunk states for the backward");
  learner->callback([&action] {
    action = [] {
      auto r = bench::run_learner_bench(learner_options);
      if (!r.ok()) {
        spdlog::error("bench learner: {}", r.status().to_string());
        return 1;
      }
      return 0;
    };
  });

  static bench::TrajectoryBenchOptions trajectory_options;
  auto* trajectory = bench->add_subcommand(
      "trajectory", "one long needle trajectory (the corpus inline) generated by a real actor, streamed to a real "
                    "replay service, stored, verified; time and peak memory");
  trajectory->add_option("--tokens", trajectory_options.corpus_tokens, "needle corpus_tokens (the trajectory's length)")
      ->capture_default_str();
  trajectory->add_option("--model-config", trajectory_options.model_config, "model config TOML")->capture_default_str();
  trajectory->add_option("--init", trajectory_options.init, "policy checkpoint (default: random weights)");
  trajectory->add_option("--answer-tokens", trajectory_options.answer_tokens, "tokens of the model's turn")
      ->capture_default_str();
  trajectory->add_option("--segment-tokens", trajectory_options.segment_tokens, "actor.segment_tokens")
      ->capture_default_str();
  trajectory->add_option("--snapshot-every", trajectory_options.snapshot_every, "actor.snapshot_every_tokens")
      ->capture_default_str();
  trajectory->add_option("--device", trajectory_options.device, "cpu or cuda")->capture_default_str();
  trajectory->add_option("--dtype", trajectory_options.dtype, "fp32, bf16 or fp16")->capture_default_str();
  trajectory->add_option("--threads", trajectory_options.threads, "LibTorch intra-op threads")->capture_default_str();
  trajectory->add_option("--dir", trajectory_options.dir, "work folder kept afterwards (default: a temporary one)");
  trajectory->callback([&action] {
    action = [] {
      auto r = bench::run_trajectory_bench(trajectory_options);
      if (!r.ok()) {
        spdlog::error("bench trajectory: {}", r.status().to_string());
        return 1;
      }
      return 0;
    };
  });
}

}  // namespace odyssey::cli
