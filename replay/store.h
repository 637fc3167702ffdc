// TrajectoryStore: the replay service's durable state in RocksDB (layout: replay/layout.h).
//
// Writes are idempotent and validated: a segment is accepted only in order, with a valid
// self-hash and a prevHash equal to the trajectory's last hash; a resend of an already
// stored (trajectory, seq) with the same hash is a no-op, with another hash a conflict.
// Nothing partial is ever stored: every operation stages into one WriteBatch and
// `commit()` writes it atomically (fsynced WAL when `sync`), so callers acknowledge only
// after commit() returns OK. If a commit fails, the in-memory view is rebuilt from disk.
//
// Sampling state lives here too: the selector (rebuilt from trajectory records at open),
// the rate limiter's counters, the sampler RNG, and leases (deliveries not yet committed
// by the learner), all persisted with the operation that changed them, so a restarted
// store continues exactly where the old one stopped.
//
// Thread-compatibility: one thread drives a store (the service loop). Not thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <capnp/message.h>
#include <rocksdb/db.h>

#include "core/codec.h"
#include "core/schema/replay.capnp.h"
#include "core/schema/trajectory.capnp.h"
#include "core/status.h"
#include "replay/rate_limiter.h"
#include "replay/rng.h"
#include "replay/selectors/selector.h"

namespace odyssey::replay {

struct RetentionOptions {
  uint64_t max_trajectories = 0;  // 0 = unbounded
  uint64_t max_bytes = 0;         // 0 = unbounded
  bool remove_unconsumed = false; // also remove complete/withheld ones when over budget
};

struct StoreOptions {
  std::string dir;
  bool sync = true;                       // fsync the WAL in commit()
  std::string sampler = "fifo";
  uint32_t max_times_sampled = 1;         // uniform/prioritized: consumed after this many (0 = never)
  double priority_exponent = 1.0;
  uint64_t sampler_seed = 0;
  RateLimiterOptions rate_limiter;
  RetentionOptions retention;
  uint64_t max_segment_bytes = 64ull << 20;
  bool read_only = false;                 // open as a secondary instance (audit while serving)
};

// What one durable staged write acknowledges.
enum class WriteOutcome { kStored, kDuplicate };

struct SampleResult {
  std::vector<std::string> records;       // Trajectory record bytes, in delivery order
  std::vector<uint32_t> group_starts;     // index into records where each unit starts
  uint64_t cursor = 0;                    // delivery to commit (0 for with-replacement samplers)
  std::string blocked;                    // why nothing was sampled, when records is empty
};

struct StoreCounters {
  uint64_t trajectories = 0, in_flight = 0, complete = 0, consumed = 0, withheld = 0, failed = 0;
  uint64_t segments = 0, bytes = 0;
  uint64_t segments_written = 0, duplicates_ignored = 0, commits = 0, removed = 0;
};

class TrajectoryStore {
 public:
  static Result<std::unique_ptr<TrajectoryStore>> open(const StoreOptions& options);
  ~TrajectoryStore();
  TrajectoryStore(const TrajectoryStore&) = delete;
  TrajectoryStore& operator=(const TrajectoryStore&) = delete;

  // --- writes (staged; durable after commit()) ---
  // Registers a trajectory (identity fields of `meta`; id must be non-zero).
  Result<WriteOutcome> begin(schema::Trajectory::Reader meta);
  // `bytes`: a Segment message as encode_segment() makes it.
  Result<WriteOutcome> append(uint64_t trajectory_id, uint32_t seq, std::string_view bytes);
  Result<WriteOutcome> end(schema::End::Reader end);
  // Makes everything staged durable in one atomic write.
  Status commit();
  bool has_staged() const { return staged_ops_ > 0; }
  uint64_t staged_bytes() const;

  // --- sampling (staged like writes) ---
  // Takes up to `count` units (trajectories, or whole groups) if the rate limiter allows.
  Result<SampleResult> sample(uint32_t count);
  // Marks every delivery up to `cursor` consumed.
  Status commit_deliveries(uint64_t cursor);
  // A consumer restarted from a checkpoint taken at `cursor`: commit up to it, release the rest.
  Status resume(uint64_t cursor);
  Status update_priority(uint64_t trajectory_id, double priority);
  Status set_policy_version(uint32_t version);
  bool can_insert() const;                 // rate limiter: may a new trajectory begin?
  std::string insert_blocked_reason() const;

  // --- reads ---
  // Up to `max_segments` segment values from `from_seq` on, at most `max_bytes` (at least one).
  // Each value's self-hash is checked: kCorrupt naming the segment if it fails.
  Result<std::vector<std::string>> read_segments(uint64_t trajectory_id, uint32_t from_seq,
                                                 uint32_t max_segments, uint64_t max_bytes) const;
  Result<std::string> read_record(uint64_t trajectory_id) const;

  // --- maintenance ---
  // Removes the oldest trajectories beyond the retention budget (consumed ones only unless
  // remove_unconsumed). Returns how many were removed. Commits by itself.
  Result<uint64_t> enforce_retention();
  // A consistent copy of the store in `dir` (RocksDB checkpoint; writers keep going).
  Status checkpoint(const std::string& dir);

  StoreCounters counters() const;
  const RateLimiter& rate_limiter() const { return limiter_; }
  const StoreOptions& options() const { return options_; }
  rocksdb::DB* db() const { return db_.get(); }
  rocksdb::ColumnFamilyHandle* segments_cf() const { return segments_; }
  rocksdb::ColumnFamilyHandle* trajectories_cf() const { return trajectories_; }
  rocksdb::ColumnFamilyHandle* index_cf() const { return index_; }

  // Column-family options used for segments (shared with the raw-RocksDB benchmark baseline).
  static rocksdb::ColumnFamilyOptions segment_cf_options();

 private:
  struct InFlight;
  explicit TrajectoryStore(const StoreOptions& options);
  Status open_db();
  Status load_state();
  Status rebuild_in_memory();
  void reset_staging();
  Result<InFlight*> in_flight(uint64_t id);
  void stage_record(uint64_t id, capnp::MallocMessageBuilder& record);
  void stage_state();
  Result<std::unique_ptr<capnp::MallocMessageBuilder>> load_record(uint64_t id) const;
  Result<std::unique_ptr<capnp::MallocMessageBuilder>> record_for_update(uint64_t id);
  SampleItem item_of(schema::Trajectory::Reader t) const;
  void stage_index(schema::Trajectory::Reader t, bool add);
  Status set_status(uint64_t id, schema::TrajectoryStatus status, const std::string& why);
  Status remove_trajectory(uint64_t id);

  StoreOptions options_;
  std::unique_ptr<rocksdb::DB> db_;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;
  rocksdb::ColumnFamilyHandle* segments_ = nullptr;
  rocksdb::ColumnFamilyHandle* trajectories_ = nullptr;
  rocksdb::ColumnFamilyHandle* index_ = nullptr;
  rocksdb::ColumnFamilyHandle* state_ = nullptr;

  rocksdb::WriteBatch batch_;
  uint64_t staged_ops_ = 0;
  // Records changed by staged operations (visible to later operations before commit).
  std::unordered_map<uint64_t, std::unique_ptr<capnp::MallocMessageBuilder>> dirty_records_;
  std::unordered_map<uint64_t, std::unique_ptr<InFlight>> in_flight_;
  std::map<std::pair<uint64_t, uint32_t>, Hash128> staged_segments_;

  std::unique_ptr<Selector> selector_;
  RateLimiter limiter_;
  Rng rng_;
  uint64_t next_ready_seq_ = 1;
  uint64_t next_delivery_ = 1;
  std::map<uint64_t, std::vector<uint64_t>> leases_;  // delivery -> trajectory ids
  StoreCounters counters_;
  std::map<uint64_t, uint64_t> ready_order_;          // readySeq -> id, for retention
};

}  // namespace odyssey::replay
