// Integrity audit of a replay store (`odyssey traj verify`).
//
// For every trajectory: the record's self-hash and id; every segment present from seq 0
// with no gaps, each segment's self-hash, schema validity, its (id, seq) against its key,
// prevHash against the previous segment's hash, tokenStart against the running count;
// and finally numSegments, numTokens and lastHash of the record against the chain. Then
// segments that belong to no trajectory. Problems are listed in key order, so the first
// one names the first bad trajectory and segment.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/status.h"
#include "replay/store.h"

namespace odyssey::replay {

struct VerifyProblem {
  uint64_t trajectory_id = 0;
  int64_t seq = -1;            // -1: the trajectory record itself
  std::string what;
  std::string to_string() const;
};

struct VerifyReport {
  uint64_t trajectories = 0, segments = 0, tokens = 0, bytes = 0;
  std::vector<VerifyProblem> problems;
  bool sound() const { return problems.empty(); }
};

struct VerifyOptions {
  size_t max_problems = 100;                    // stop listing after this many
  std::function<void(uint64_t done)> progress;  // called after each trajectory
};

// Reads the whole store once, segment by segment (memory stays bounded by one segment).
Result<VerifyReport> verify_store(const TrajectoryStore& store, const VerifyOptions& options = {});

// Verifies one trajectory (record + chain); problems are appended to `report`.
Status verify_trajectory(const TrajectoryStore& store, uint64_t id, VerifyReport& report);

}  // namespace odyssey::replay
