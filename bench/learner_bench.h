// `odyssey bench learner` (CPU): training tokens per second of the learner's step compute on a
// fixed synthetic batch — the chunked forward/backward with the state carried and activation
// recomputation (learner/policy_gradient.h), the GRPO/PPO loss, gradient clipping and AdamW —
// at a few sequence lengths, against the plain LibTorch reference measured in the same run: one
// whole-sequence Policy::forward, the same token-mean policy-gradient loss, backward and
// torch::optim::AdamW. The batch holds about `batch_tokens` tokens at every length (rows =
// batch_tokens / length), half of each sequence model-written. Last line:
// `learner_tokens_per_s: X` (the learner at the longest length).
//
// --long N instead trains one step on a single N-token trajectory through the learner's path
// (the 64K check on the CPU, 1M with --device cuda: time, the process's peak resident memory and,
// on a GPU, the peak of LibTorch's CUDA allocator), and prints
// `learner_long_tokens_per_s: X` last; with --repeats R > 1 it times the first step and then the
// best of R - 1 more (warm). --float32-matmul-precision: learner.float32_matmul_precision
// (model/precision.h), what the GPU may trade for speed. The long check also prints the step's
// phases (policy gradient, clipping, optimizer, each timed to its end on the device) and the
// optimizer step and clipping alone against their baselines (the per-parameter AdamW on the same
// moments, LibTorch's clip_grad_norm_). --profile FILE: one more warm step under LibTorch's
// profiler (Kineto); its Chrome trace goes to FILE (chrome://tracing, Perfetto) and a summary to
// stdout: the device's kernels by total time, by kind, and how busy the device was.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace odyssey::bench {

struct LearnerBenchOptions {
  std::string model_config = "configs/model/tiny.toml";
  std::vector<int64_t> lengths = {256, 2048};
  int64_t batch_tokens = 2048;
  int64_t chunk_tokens = 1024;  // learner.chunk_tokens
  bool recompute = true;
  bool kda_keep_chunk_states = false;  // learner.kda_keep_chunk_states (kept KDA states from forward to backward)
  int repeats = 1;        // best of (after one warm-up run)
  int threads = 1;
  int64_t long_tokens = 0;  // > 0: the long-trajectory check only
  std::string device = "cpu";  // "cuda" on the GPU build: the long check also reports peak GPU memory
  std::string float32_matmul_precision = "highest";  // learner.float32_matmul_precision (model/precision.h)
  std::string profile_path;  // with long_tokens: profile one more step, its trace here
};

struct LearnerBenchResult {
  double learner_tokens_per_s = 0;
  double reference_tokens_per_s = 0;
};

Result<LearnerBenchResult> run_learner_bench(const LearnerBenchOptions& options);

}  // namespace odyssey::bench
