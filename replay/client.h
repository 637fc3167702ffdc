// Clients of the replay service: TrajectoryWriter (actors) and ReplaySampler (learner).
//
// TrajectoryWriter streams trajectories segment by segment. It keeps the hash chain, sends
// each segment as soon as it is appended, and keeps at most `credits` (from the service's
// hello) segments unacknowledged: append() blocks beyond that (back-pressure, never a
// drop). An acknowledgement means the segment is durable. When the service does not
// answer within `ack_timeout_ms` (it crashed, restarted, the network hiccuped) the writer
// reconnects and resends everything unacknowledged, in order; the service's idempotent
// writes turn resends of stored segments into no-ops. begin() waits while the service's
// rate limiter does not admit new trajectories. A writer gives up (kUnavailable) only after
// `give_up_after_ms` without any progress. Errors the service reports for a request
// (conflict, bad segment) are returned by the next call.
//
// ReplaySampler samples trajectory records (or whole groups), reads segments of one
// trajectory in bounded chunks (a million-token trajectory is never held whole), commits
// what it trained on, and reports the policy version.
//
// Neither class is thread-safe; use one per thread. Both own their ZeroMQ context.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <capnp/message.h>
#include <zmq.hpp>

#include "core/codec.h"
#include "core/schema/replay.capnp.h"
#include "core/status.h"

namespace odyssey::replay {

struct ClientOptions {
  std::string endpoint = "tcp://127.0.0.1:5555";
  std::string name = "client";
  int ack_timeout_ms = 2000;        // silence after which the client reconnects and resends
  int give_up_after_ms = 120000;    // no progress for this long: kUnavailable
  // When set and true, TrajectoryWriter::begin() stops waiting for the rate limiter and returns
  // kTimeout ("stopped ..."), so a process asked to stop is not held up by back-pressure.
  const std::atomic<bool>* stop = nullptr;
};

// Who and what a trajectory is; the service fills in everything else.
struct TrajectoryMeta {
  uint64_t id = 0;                  // 0: the writer draws a random non-zero id
  std::string job, environment, environment_version, plugin_hash, task, tokenizer = "byte-v1";
  uint64_t seed = 0, group_id = 0;
  uint32_t group_size = 0;
  double priority = 1.0;
};

struct Reward {
  double total = 0;
  std::vector<std::pair<std::string, double>> parts;
};

// A request/response channel to the service with reconnect (shared by both clients).
class ServiceConnection {
 public:
  explicit ServiceConnection(const ClientOptions& options);
  Status connect();                 // (re)creates the socket and says hello
  // Sends an encoded request, with the payload (a segment) as a second frame when not empty.
  Status send_raw(std::string_view request, std::string_view payload);
  // The next response within timeout_ms, or nullopt on timeout.
  Result<std::optional<std::vector<zmq::message_t>>> receive(int timeout_ms);
  uint64_t next_id() { return ++last_id_; }
  uint32_t credits() const { return credits_; }
  uint64_t max_message_bytes() const { return max_message_bytes_; }
  const ClientOptions& options() const { return options_; }

 private:
  ClientOptions options_;
  zmq::context_t context_{1};
  std::unique_ptr<zmq::socket_t> socket_;
  uint64_t last_id_ = 0;
  uint32_t credits_ = 16;
  uint64_t max_message_bytes_ = 64ull << 20;
};

class TrajectoryWriter {
 public:
  static Result<std::unique_ptr<TrajectoryWriter>> connect(const ClientOptions& options);

  // Registers a trajectory; waits while the rate limiter holds new trajectories back.
  Result<uint64_t> begin(const TrajectoryMeta& meta);
  // Sends the next segment of `trajectory_id` (seq, tokenStart and the chain are filled in).
  Status append(uint64_t trajectory_id, const SegmentData& segment);
  // Ends the trajectory with its rewards (or as failed, with why).
  Status end(uint64_t trajectory_id, const Reward& reward, bool failed = false, const std::string& error = "");
  // Waits until everything sent is acknowledged (durable).
  Status flush();

  uint64_t segments_acknowledged() const { return segments_acked_; }
  uint64_t resends() const { return resends_; }
  uint64_t reconnects() const { return reconnects_; }

 private:
  struct Chain {
    uint32_t next_seq = 0;
    uint64_t tokens = 0;
    Hash128 last;
  };
  struct Outgoing {
    std::string request;
    std::string payload;
    bool is_segment = false;
  };
  explicit TrajectoryWriter(const ClientOptions& options) : conn_(options) {}
  // Processes responses for up to `timeout_ms`; reconnects and resends on silence.
  Status pump(int timeout_ms);
  Status send_tracked(capnp::MallocMessageBuilder& request, std::string payload, bool is_segment);
  uint32_t unacked_segments() const { return unacked_segments_; }

  ServiceConnection conn_;
  std::map<uint64_t, Outgoing> unacked_;   // by request id = send order
  uint32_t unacked_segments_ = 0;
  std::unordered_map<uint64_t, Chain> chains_;
  std::chrono::steady_clock::time_point last_progress_, last_reconnect_;
  std::optional<Status> error_;             // first error reported by the service
  uint64_t segments_acked_ = 0, resends_ = 0, reconnects_ = 0;
  uint64_t rate_limited_begin_ = 0;         // request id of a begin answered rateLimited
};

// A trajectory record returned by sample(), owning its bytes.
class TrajectoryInfo {
 public:
  explicit TrajectoryInfo(std::unique_ptr<capnp::MallocMessageBuilder> record) : record_(std::move(record)) {}
  schema::Trajectory::Reader record() const { return record_->getRoot<schema::Trajectory>().asReader(); }
  uint64_t id() const { return record().getId(); }

 private:
  std::shared_ptr<capnp::MallocMessageBuilder> record_;
};

struct SampleBatch {
  std::vector<TrajectoryInfo> items;
  std::vector<uint32_t> group_starts;   // where each sampled unit (trajectory or group) starts
  uint64_t cursor = 0;                  // commit(cursor) once trained on; 0: nothing to commit
};

struct ServiceStats {
  uint64_t trajectories = 0, in_flight = 0, complete = 0, consumed = 0, withheld = 0, failed = 0;
  uint64_t segments = 0, bytes = 0, inserts = 0, samples = 0;
  uint32_t policy_version = 0;
  std::string sampler;
  uint64_t segments_written = 0, duplicates_ignored = 0, commits_synced = 0;
};

class ReplaySampler {
 public:
  static Result<std::unique_ptr<ReplaySampler>> connect(const ClientOptions& options);

  // Up to `count` units; waits up to timeout_ms for data or the rate limiter
  // (kTimeout with the limiter's reason when nothing came).
  Result<SampleBatch> sample(uint32_t count, uint32_t timeout_ms);
  // Segment values of one trajectory from `from_seq`, at most max_segments / max_bytes.
  Result<std::vector<std::string>> read(uint64_t trajectory_id, uint32_t from_seq, uint32_t max_segments = 16,
                                        uint64_t max_bytes = 16ull << 20);
  Status commit(uint64_t cursor);
  Status resume(uint64_t cursor);
  Status update_priorities(const std::vector<std::pair<uint64_t, double>>& priorities);
  Status set_policy_version(uint32_t version);
  Status checkpoint(const std::string& dir);
  Result<ServiceStats> stats();

 private:
  explicit ReplaySampler(const ClientOptions& options) : conn_(options) {}
  // Sends and waits for the response (retrying idempotent requests after a reconnect).
  Result<std::vector<zmq::message_t>> call(capnp::MallocMessageBuilder& request, int timeout_ms, bool idempotent);
  ServiceConnection conn_;
};

// Reads a trajectory's segments in chunks: `while (auto seg = reader.next()) ...`.
class SegmentStream {
 public:
  SegmentStream(ReplaySampler& sampler, uint64_t trajectory_id, uint32_t chunk = 8)
      : sampler_(sampler), id_(trajectory_id), chunk_(chunk) {}
  // The next segment's bytes, std::nullopt at the end; an error when the service fails.
  Result<std::optional<std::string>> next();

 private:
  ReplaySampler& sampler_;
  uint64_t id_;
  uint32_t chunk_;
  uint32_t next_seq_ = 0;
  std::deque<std::string> buffered_;
  bool done_ = false;
};

}  // namespace odyssey::replay
