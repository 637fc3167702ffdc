// `odyssey bench actor` (CPU): decode speed of the policy at long contexts — the actor's
// inner loop — for the hybrid model of a model config (KDA layers with constant-size state,
// MLA layers with a latent cache) and for an all-MLA variant of the same size (the same
// config with every layer MLA), measured in the same run.
//
// Per variant, contexts in ascending order (1K, 64K, 1M by default) on one sequence:
//   1. fill the context: real prefill with Policy::forward_chunk (chunks of `chunk` tokens,
//      state carried) up to min(context, real_prefill); beyond that, the MLA latent caches are
//      extended to the context length by repeating their rows, while the KDA states stay as
//      the real prefill left them. A decode step's work depends on the context only through
//      the MLA cache length (the KDA state is constant-size), so decode is timed at the true
//      length either way; what a real prefill to 1M would cost (quadratic in MLA attention)
//      is reported as an estimate from the measured prefill, not run.
//   2. time `decode` Policy::step calls (one token each, after `warmup` untimed ones), best of
//      `repeats` runs, the two variants' runs interleaved so that both see the same load on a
//      shared machine (the cache grows by those few tokens meanwhile).
// Each row prints context, how it was filled, prefill time, decode tokens/s by wall time and by
// process CPU time, the MLA cache size and the resident memory; then the state sizes, the peak
// RSS, an estimate of a real prefill to the largest context, and the ratio lines
// decode_speedup_vs_mla_<ctx>: hybrid tokens/s ÷ all-MLA tokens/s, the last one being
// decode_speedup_vs_mla_1m.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace odyssey::bench {

struct ActorBenchOptions {
  std::string model_config = "configs/model/tiny.toml";
  std::vector<int64_t> contexts = {1024, 65536, 1048576};
  int64_t real_prefill = 4096;   // contexts are prefilled for real up to this many tokens
  int64_t chunk = 1024;          // forward_chunk size of the real prefill
  int64_t decode = 16;           // decode steps of one timed run
  int repeats = 3;               // timed runs per row; the best counts
  int64_t warmup = 2;            // untimed decode steps before them
  int threads = 0;               // LibTorch intra-op threads; 0 = LibTorch's default
};

struct ActorBenchRow {
  std::string variant;  // "hybrid" or "all-mla"
  int64_t context = 0;
  int64_t real_tokens = 0;  // of the context, prefilled for real
  double prefill_s = 0;
  double decode_tokens_per_s = 0;
  double mla_cache_mb = 0;
};

struct ActorBenchResult {
  std::vector<ActorBenchRow> rows;
  double peak_rss_mb = 0;
  double speedup_last = 0;  // at the largest context
};

Result<ActorBenchResult> run_actor_bench(const ActorBenchOptions& options);

}  // namespace odyssey::bench
