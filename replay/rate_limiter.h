// RateLimiter: decides when trajectories may be inserted and sampled, and which ones are too
// old to train on. DeepMind Reverb's semantics (its rate_limiter.cc and SampleToInsertRatio),
// plus a policy-lag bound.
//
// Counts are of trajectories, not units: a sampled group of 8 is 8 samples. The store calls
// on_insert when a trajectory enters the sampleable set (again, for a released lease) and
// on_delete when one leaves it (consumed, withheld, removed, or taken by a sampler without
// replacement, as in Reverb's queues), so inserts - deletes is the number sampleable.
//
//   Sampling n is blocked while fewer than min_size_to_sample trajectories are present
//   (inserts - deletes), and, when samples_per_insert > 0, while
//     inserts * samples_per_insert - (samples + n) < min_diff.
//   Inserting n is always allowed while inserts + n - deletes <= min_size_to_sample; past
//   that, when samples_per_insert > 0, it is blocked while
//     (inserts + n) * samples_per_insert - samples > max_diff.
//   Here min_diff/max_diff = min_size_to_sample * samples_per_insert -/+ error_buffer, so the
//   error tolerated counts only operations after the first min_size_to_sample inserts.
//   samples_per_insert = 0 turns the ratio off (Reverb's MinSize limiter).
//   A trajectory whose oldest token came from policy version m is stale when
//   max_policy_lag > 0 and policy_version - m > max_policy_lag.
//   A stale trajectory that comes up for sampling is withheld: the store counts it as a sample
//   and a delete (it was spent), so withholding never drifts the ratio against inserts.
//
// The limiter never waits: can_insert/can_sample answer now, and the service waits (or
// withholds credits from actors) and asks again after on_sample/on_insert/on_delete.
// encode()/decode() carry the counters and the policy version, so a restarted store keeps
// the ratio it had. Not thread-safe: the service calls it from one thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/status.h"

namespace odyssey::replay {

struct RateLimiterOptions {
  int64_t min_size_to_sample = 1;   // >= 1
  double samples_per_insert = 0.0;  // >= 0; 0 = no ratio
  double error_buffer = 0.0;        // with a ratio: >= max(1, samples_per_insert), else deadlock
  int64_t max_policy_lag = 0;       // versions, >= 0; 0 = unbounded

  // kInvalidArgument naming the option (negative, NaN, infinite, or a deadlocking buffer).
  Status validate() const;
};

struct RateLimiterState {
  uint64_t inserts = 0;
  uint64_t samples = 0;
  uint64_t deletes = 0;             // never more than inserts
  uint32_t policy_version = 0;
  bool operator==(const RateLimiterState& o) const {
    return inserts == o.inserts && samples == o.samples && deletes == o.deletes &&
           policy_version == o.policy_version;
  }
};

class RateLimiter {
 public:
  RateLimiter() = default;  // default options: sampling needs one trajectory, nothing else
  // Checks the options and the state (deletes <= inserts).
  static Result<RateLimiter> create(const RateLimiterOptions& options,
                                    const RateLimiterState& state = {});

  bool can_insert(uint64_t n = 1) const;
  bool can_sample(uint64_t n = 1) const;
  void on_insert(uint64_t n = 1) { state_.inserts += n; }
  void on_sample(uint64_t n = 1) { state_.samples += n; }
  // Clamped so deletes never exceed inserts (a state that would not decode).
  void on_delete(uint64_t n = 1);
  void set_policy_version(uint32_t version) { state_.policy_version = version; }
  bool is_stale(uint32_t min_policy_version) const;

  // Why inserting/sampling `n` is blocked, or "" when it is not:
  //   "sampling blocked: 3 of min_size_to_sample=10 inserted"
  std::string insert_blocked_reason(uint64_t n = 1) const;
  std::string sample_blocked_reason(uint64_t n = 1) const;
  // One line for logs and stats: counters, then what is blocked and why.
  std::string describe() const;

  const RateLimiterOptions& options() const { return options_; }
  const RateLimiterState& state() const { return state_; }
  double min_diff() const;
  double max_diff() const;

  // The state in a fixed 29-byte layout: version byte 1, then inserts, samples, deletes
  // (u64) and policy_version (u32), little-endian.
  std::string encode() const;
  // kCorrupt saying what is wrong: size, unknown version, deletes beyond inserts.
  static Result<RateLimiterState> decode(std::string_view bytes);

 private:
  RateLimiter(const RateLimiterOptions& options, const RateLimiterState& state)
      : options_(options), state_(state) {}
  uint64_t present() const { return state_.inserts - state_.deletes; }

  RateLimiterOptions options_;
  RateLimiterState state_;
};

}  // namespace odyssey::replay
