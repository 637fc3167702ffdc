#include "replay/options.h"

namespace odyssey::replay {

ServiceOptions service_options(const Config& c) {
  ServiceOptions o;
  o.listen = c.get_string("replay.listen");
  o.credits = static_cast<uint32_t>(c.get_int("replay.credits"));
  o.max_message_bytes = static_cast<uint64_t>(c.get_int("replay.max_message_bytes"));
  o.group_commit_bytes = static_cast<uint64_t>(c.get_int("replay.group_commit_bytes"));
  o.checkpoint_dir = c.get_string("replay.checkpoint_dir");
  o.checkpoint_every_seconds = static_cast<uint32_t>(c.get_int("replay.checkpoint_every_seconds"));
  StoreOptions& s = o.store;
  s.dir = c.get_string("replay.dir");
  s.sync = c.get_bool("replay.sync");
  s.sampler = c.get_string("replay.sampler");
  s.max_times_sampled = static_cast<uint32_t>(c.get_int("replay.max_times_sampled"));
  s.priority_exponent = c.get_double("replay.priority_exponent");
  s.sampler_seed = static_cast<uint64_t>(c.get_int("replay.sampler_seed"));
  s.max_segment_bytes = o.max_message_bytes;
  s.rate_limiter.min_size_to_sample = c.get_int("replay.rate_limiter.min_size_to_sample");
  s.rate_limiter.samples_per_insert = c.get_double("replay.rate_limiter.samples_per_insert");
  s.rate_limiter.error_buffer = c.get_double("replay.rate_limiter.error_buffer");
  s.rate_limiter.max_policy_lag = c.get_int("replay.rate_limiter.max_policy_lag");
  s.retention.max_trajectories = static_cast<uint64_t>(c.get_int("replay.retention.max_trajectories"));
  s.retention.max_bytes = static_cast<uint64_t>(c.get_int("replay.retention.max_bytes"));
  s.retention.remove_unconsumed = c.get_bool("replay.retention.remove_unconsumed");
  return o;
}

}  // namespace odyssey::replay
