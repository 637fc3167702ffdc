// `odyssey bench replay`: end-to-end ingest (writers -> ZeroMQ -> durable RocksDB,
// acknowledged) against raw RocksDB WriteBatch writes of the same bytes, measured in the
// same run on the same disk with the same column-family options, fsync setting and batching
// (each raw writer commits `credits` segments per WriteBatch, what a service writer may have
// in flight).
// Prints its figures and, last, `replay_ingest_ratio: X` (end-to-end / raw tokens per second).
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"

namespace odyssey::bench {

struct ReplayBenchOptions {
  uint32_t writers = 4;
  uint32_t trajectories = 64;
  uint32_t segments_per_trajectory = 8;
  uint32_t tokens_per_segment = 4096;
  bool million_token = true;     // also stream and verify one 1,048,576-token trajectory
  bool sync = true;
  uint32_t credits = 16;
  std::string work_dir;          // empty: a fresh directory under the system temp dir
};

struct ReplayBenchResult {
  double raw_tokens_per_s = 0, e2e_tokens_per_s = 0, ratio = 0;
  double million_stream_s = 0, million_verify_s = 0;
  long peak_rss_kb = 0;
};

// Runs the benchmark, printing progress and results to stdout.
Result<ReplayBenchResult> run_replay_bench(const ReplayBenchOptions& options);

}  // namespace odyssey::bench
