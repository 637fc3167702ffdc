// ReplayService: the replay store behind a ZeroMQ ROUTER socket (`odyssey replay serve`).
//
// Protocol: core/schema/replay.capnp. Writes (begin, append, end) from all connected
// writers are staged and made durable together (group commit: one fsynced WriteBatch per
// loop turn or per `group_commit_bytes`); a write is acknowledged only after its batch is
// durable. Other requests are answered in arrival order after the writes before them are
// durable, so a client always reads its own acknowledged writes.
//
// Bad input (malformed or oversized frames, unknown ids, conflicts) gets an error response
// naming the problem; the service keeps running and stores nothing of a rejected request.
// Back-pressure: a writer may keep `credits` segments unacknowledged; a `begin` the rate
// limiter does not allow yet is answered `rateLimited` and retried by the writer.
// A sample that cannot be served waits up to its timeout for data or the rate limiter.
//
// Thread-compatibility: run() drives everything from the calling thread; `stop` may be set
// from any thread or a signal handler.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <string>

#include <zmq.hpp>

#include "replay/store.h"

namespace odyssey::replay {

struct ServiceOptions {
  StoreOptions store;
  std::string listen = "tcp://127.0.0.1:5555";
  uint32_t credits = 16;
  uint64_t max_message_bytes = 64ull << 20;
  uint64_t group_commit_bytes = 8ull << 20;
  std::string checkpoint_dir;            // periodic checkpoints go to <dir>/<unix seconds>
  uint32_t checkpoint_every_seconds = 0;
  uint32_t stats_every_seconds = 10;     // log a stats line this often (0 = never)
};

class ReplayService {
 public:
  static Result<std::unique_ptr<ReplayService>> create(const ServiceOptions& options);
  ~ReplayService();

  // Serves until `stop` becomes true, then commits what is staged and returns.
  Status run(const std::atomic<bool>& stop);
  // The bound address (with the real port when listening on port *).
  const std::string& endpoint() const { return endpoint_; }
  TrajectoryStore& store() { return *store_; }

 private:
  struct PendingAck {
    std::string identity;
    uint64_t id;
  };
  struct WaitingSample {
    std::string identity;
    uint64_t id;
    uint32_t count;
    std::chrono::steady_clock::time_point deadline;
  };
  explicit ReplayService(const ServiceOptions& options);
  void handle(std::vector<zmq::message_t>& frames);
  void flush_writes();
  void serve_waiting_samples(bool expire_all);
  void reply(const std::string& identity, capnp::MallocMessageBuilder& response,
             const std::vector<std::string>& extra_frames = {});
  void reply_error(const std::string& identity, uint64_t id, const Status& status);
  void reply_ack(const std::string& identity, uint64_t id);
  bool try_sample(const WaitingSample& w, bool last_chance);
  void periodic();

  ServiceOptions options_;
  std::unique_ptr<TrajectoryStore> store_;
  zmq::context_t context_;
  zmq::socket_t socket_;
  std::string endpoint_;
  std::vector<PendingAck> pending_acks_;
  std::deque<WaitingSample> waiting_samples_;
  std::chrono::steady_clock::time_point last_checkpoint_, last_stats_, last_retention_;
  StoreCounters last_counters_;
};

}  // namespace odyssey::replay
