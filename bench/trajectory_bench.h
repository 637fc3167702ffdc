// `odyssey bench trajectory`: one long needle trajectory end to end, the way a job makes it.
// A real actor (actors/actor.h) runs the policy on one `needle` episode whose first
// observation holds the whole corpus (needle's inline_corpus: a corpus_tokens-byte corpus is a
// trajectory that long), streams it in segments with KDA snapshots to a real replay service
// (ZeroMQ on loopback, RocksDB on disk, fsynced group commits) in this process, and then the
// stored trajectory is verified:
//   * the store's own audit (replay/verify.h: hash chains, completeness, schema validity);
//   * content: the stored prompt is token for token the transcript of the environment's first
//     observation, regenerated from the record's task and seed by a fresh needle instance; the
//     number of tokens equals what the actor wrote; loss mask 1 exactly on the model's turn.
// Reported: tokens, segments, snapshots, time and tokens/s, bytes on disk, the process's
// resident memory before the episode and at its peak, and the MLA latent cache the policy
// must hold at the end (the only per-token state that grows; KDA states are constant). The
// ratio printed is peak growth / that cache (about 1 + allocator slack when memory is
// bounded by the cache, far more if anything else grew with the trajectory). Last line:
// `trajectory_peak_rss_mb: X`.
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"

namespace odyssey::bench {

struct TrajectoryBenchOptions {
  std::string model_config = "configs/model/tiny.toml";
  std::string init;                 // a policy checkpoint; "" = random weights (seed 0)
  int64_t corpus_tokens = 1000000;  // needle corpus_tokens (a byte tokenizer: bytes = tokens)
  int64_t answer_tokens = 64;       // the model's one turn (actor.max_turn_tokens)
  int64_t segment_tokens = 4096;    // actor.segment_tokens
  int64_t snapshot_every = 65536;   // actor.snapshot_every_tokens
  std::string device = "cpu";
  std::string dtype = "fp32";
  int threads = 1;
  std::string dir;                  // work folder (replay store, weights); "" = a temporary one, removed after
};

struct TrajectoryBenchResult {
  uint64_t tokens = 0;
  uint64_t segments = 0;
  double peak_rss_mb = 0;
  bool verified = false;
};

Result<TrajectoryBenchResult> run_trajectory_bench(const TrajectoryBenchOptions& options);

}  // namespace odyssey::bench
