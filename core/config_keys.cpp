// Every configuration key odyssey reads: its path, type, default, one-line doc and limits.
// `odyssey config keys` prints this registry; configs/base.toml restates the defaults.
// To add a key, add one line to its section (or a new section) below.
#include "core/config.h"

namespace odyssey {

namespace {

ConfigSchema build_config_schema() {
  ConfigSchema s;

  // [job]: what every role of a job shares.
  s.add_string("job.name", "tiny", "job name: labels logs, metrics and output");
  s.add_int("job.seed", 0, "seed for every random choice the job makes, so a run repeats exactly");

  // [replay]: the replay service that stores trajectories and serves samples.
  s.add_string("replay.dir", "out/replay", "directory of the write-ahead log and stored trajectories");
  s.add_string("replay.listen", "tcp://127.0.0.1:5555", "ZeroMQ address the replay service binds");
  s.add_int("replay.credits", 16, "unacknowledged segments a writer may have in flight", at_least(1));
  s.add_int("replay.max_message_bytes", 67108864, "largest message accepted; larger ones are rejected",
            at_least(4096));
  s.add_bool("replay.sync", true, "fsync the write-ahead log before acknowledging");
  s.add_int("replay.group_commit_bytes", 8388608, "most bytes in one durable write batch", at_least(0));
  s.add_string("replay.sampler", "fifo", "which stored items a sample returns, and in what order",
               {"fifo", "uniform", "prioritized", "group_complete"});
  s.add_int("replay.max_times_sampled", 1,
            "uniform/prioritized items are consumed after this many samples; 0 = never", at_least(0));
  s.add_double("replay.priority_exponent", 1.0,
               "prioritized sampler: an item's chance is proportional to priority^exponent", at_least(0));
  s.add_int("replay.sampler_seed", 0, "seed of the uniform and prioritized samplers");
  s.add_string("replay.checkpoint_dir", "", "directory for replay checkpoints; empty = no checkpoints");
  s.add_int("replay.checkpoint_every_seconds", 0, "seconds between periodic checkpoints; 0 = none",
            at_least(0));

  // [replay.rate_limiter]: when samples may be served, relative to inserts.
  s.add_int("replay.rate_limiter.min_size_to_sample", 1, "items stored before any sample is served",
            at_least(1));
  s.add_double("replay.rate_limiter.samples_per_insert", 0.0,
               "target samples per inserted item; 0 disables the ratio", at_least(0));
  s.add_double("replay.rate_limiter.error_buffer", 64.0,
               "how many samples the ratio may run ahead of or behind samples_per_insert", at_least(0));
  s.add_int("replay.rate_limiter.max_policy_lag", 0,
            "oldest policy a sampled item may come from, in versions behind the newest; 0 = unbounded",
            at_least(0));

  // [replay.retention]: what the replay service removes to bound its storage.
  s.add_int("replay.retention.max_trajectories", 0, "most trajectories kept, oldest removed first; 0 = unbounded",
            at_least(0));
  s.add_int("replay.retention.max_bytes", 0, "most stored bytes kept, oldest removed first; 0 = unbounded",
            at_least(0));
  s.add_bool("replay.retention.remove_unconsumed", false,
             "whether retention may remove items that were never consumed by sampling");

  // [bench.replay]: `odyssey bench replay`.
  s.add_int("bench.replay.writers", 4, "concurrent trajectory writers", at_least(1));
  s.add_int("bench.replay.trajectories", 256, "trajectories written, spread over the writers", at_least(1));
  s.add_int("bench.replay.segments_per_trajectory", 8, "segments in each trajectory", at_least(1));
  s.add_int("bench.replay.tokens_per_segment", 4096, "tokens in each segment", at_least(1));
  s.add_bool("bench.replay.million_token", true, "also stream and verify one 1M-token trajectory");

  return s;
}

}  // namespace

const ConfigSchema& config_schema() {
  static const ConfigSchema schema = build_config_schema();
  return schema;
}

}  // namespace odyssey
