// What one learner rank trains on in one step: whole GRPO groups sampled from the replay
// service, each trajectory read segment by segment into compact per-token arrays.
//
// Sampling: sample_more() asks the service (replay/client.h ReplaySampler) for units, as many
// times as it takes to hold the groups a step needs (load_batch loops; the trainer loops with a
// collective between requests so data-parallel ranks wait together); with the group_complete sampler a unit is one whole group (the
// trajectories of one task), with any other sampler a single trajectory (a group of one, whose
// advantage is 0). Every answered sample is a delivery with a cursor; the batch keeps the
// largest, which the learner commits once a checkpoint covers the step (learner/README.md says
// why that keeps every acknowledged trajectory trained exactly once).
//
// Reading: read_trajectory() pulls a trajectory's segments in pieces of at most
// `max_segments` segments / `max_bytes` bytes (ReplaySampler::read), checks each segment
// (validate_segment, contiguous tokenStart) and appends its tokens, the actor's sampling
// log-probs, the loss mask and the policy lag of every model-written token. Per token this holds
// 4 + 4 + 1 bytes, never the segment messages or any model activation, so a million-token
// trajectory takes ~9 MB here.
//
// Rewards and success: reward = the record's rewardTotal. success = the reward part named
// "correct" is > 0 when the record has one, else rewardTotal >= 1 (arith and needle report
// "correct"; an environment without it counts a full reward as a success).
//
// Policy lag of a token = the learner's current version − the version that produced it (0 when
// the token is newer, which happens only across a learner restart).
//
// Errors: kUnavailable when the service does not answer
// (a sample whose reply was lost may have leased trajectories the learner never saw: the
// learner must then restart from its checkpoint, see README), kCorrupt / kInvalidArgument for a
// malformed record or segment (naming the trajectory and segment).
// Thread-safety: none; one sampler per thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "core/schema/trajectory.capnp.h"
#include "core/status.h"
#include "replay/client.h"

namespace odyssey::learner {

struct TrajectoryTokens {
  uint64_t id = 0;
  uint64_t group_id = 0;
  double reward = 0;
  bool success = false;
  double advantage = 0;          // filled by the trainer (group_advantages)
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;   // the actor's sampling log-probs
  std::vector<uint8_t> loss_mask;
  // Policy lag over the loss_mask tokens.
  double lag_sum = 0;
  uint64_t lag_tokens = 0;
  uint32_t lag_max = 0;

  int64_t length() const { return static_cast<int64_t>(tokens.size()); }
  // Positions that are trained: loss_mask tokens with a token before them (position 0 is never
  // predicted).
  int64_t trained_tokens() const;
};

struct TrainingBatch {
  std::vector<TrajectoryTokens> trajectories;
  std::vector<size_t> group_starts;  // index of each group's first trajectory; groups are contiguous
  uint64_t cursor = 0;               // largest delivery cursor of the batch (0: none)
  bool interrupted = false;          // stop was raised before all groups came
};

// success as defined above, from a trajectory record.
bool trajectory_success(schema::Trajectory::Reader record);

struct ReadLimits {
  uint32_t max_segments = 16;
  uint64_t max_bytes = 16ull << 20;
};

// One sample request for up to `count` more units, waiting at most `wait_ms` for the service:
// appends what came (records, group starts, cursor) and returns how many units. 0 when nothing
// was sampleable in time (or the rate limiter held samples back).
Result<uint32_t> sample_more(replay::ReplaySampler& sampler, uint32_t count, uint32_t wait_ms, TrainingBatch* batch,
                             std::vector<replay::TrajectoryInfo>* records);

// Fills batch->trajectories from the records (rewards, success) and reads every trajectory.
Status read_batch(replay::ReplaySampler& sampler, const std::vector<replay::TrajectoryInfo>& records,
                  uint32_t version_now, const ReadLimits& limits, TrainingBatch* batch);

// sample_more until `groups` units are held (checking `stop` between requests; a stop returns
// the partial batch with `interrupted` set and nothing read), then read_batch.
Result<TrainingBatch> load_batch(replay::ReplaySampler& sampler, uint32_t groups, uint32_t version_now,
                                 const ReadLimits& limits, uint32_t wait_ms, const std::atomic<bool>* stop);

}  // namespace odyssey::learner
