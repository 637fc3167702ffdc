// `odyssey bench model` (CPU): the whole policy and its layers in each way they run — parallel over a
// sequence, chunk by chunk with state carried, one token at a time — in tokens per second,
// at the sizes of a model config (tiny by default), a training step of the whole policy
// (forward, cross-entropy, backward, AdamW), and the chunked KDA form against its
// token-by-token recurrence at T = 4096 measured in the same run. Last line:
// `kda_chunked_speedup: X` (recurrence time / chunked time).
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"

namespace odyssey::bench {

struct ModelBenchOptions {
  std::string model_config = "configs/model/tiny.toml";
  int64_t sequence = 1024;   // tokens for the parallel and chunked forms
  int64_t chunk = 128;       // chunk of the chunk-by-chunk form
  int64_t decode = 256;      // tokens for the one-at-a-time form
  int64_t kda_tokens = 4096; // T of the chunked-vs-recurrent comparison
  int64_t train_tokens = 0;   // tokens of the training-step row (< sequence); 0 = min(512, sequence - 1)
  int repeats = 3;           // best of
  std::string device = "cpu"; // or "cuda" (GPU build): absolute times count only from the GPU machine
  std::string dtype = "fp32"; // or "bf16" (model and activations; the KDA core comparison stays fp32)
};

struct ModelBenchResult {
  double kda_chunked_s = 0, kda_recurrent_s = 0, kda_chunked_speedup = 0;
};

Result<ModelBenchResult> run_model_bench(const ModelBenchOptions& options);

}  // namespace odyssey::bench
