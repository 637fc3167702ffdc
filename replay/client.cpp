#include "replay/client.h"

#include <random>
#include <thread>

#include <spdlog/spdlog.h>

#include "core/transport.h"

namespace odyssey::replay {

namespace {

using Clock = std::chrono::steady_clock;

StatusCode status_code(schema::ErrorCode e) {
  switch (e) {
    case schema::ErrorCode::NONE: return StatusCode::kOk;
    case schema::ErrorCode::BAD_REQUEST: return StatusCode::kInvalidArgument;
    case schema::ErrorCode::TOO_LARGE: return StatusCode::kResourceExhausted;
    case schema::ErrorCode::UNKNOWN_TRAJECTORY: return StatusCode::kNotFound;
    case schema::ErrorCode::CONFLICT: return StatusCode::kConflict;
    case schema::ErrorCode::RATE_LIMITED: return StatusCode::kTimeout;
    case schema::ErrorCode::STORAGE: return StatusCode::kIo;
    case schema::ErrorCode::CORRUPT: return StatusCode::kCorrupt;
    case schema::ErrorCode::UNSUPPORTED: return StatusCode::kFailedPrecondition;
  }
  return StatusCode::kInternal;
}

int elapsed_ms(Clock::time_point since) {
  return static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - since).count());
}

uint64_t random_trajectory_id() {
  static thread_local std::mt19937_64 gen([] {
    std::random_device rd;
    return (uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  }());
  uint64_t id;
  do id = gen();
  while (id == 0);
  return id;
}

}  // namespace

// ---------------------------------------------------------------- ServiceConnection

ServiceConnection::ServiceConnection(const ClientOptions& options) : options_(options) {}

Status ServiceConnection::connect() {
  ODY_RETURN_IF_ERROR(check_endpoint(options_.endpoint));
  try {
    socket_ = std::make_unique<zmq::socket_t>(context_, zmq::socket_type::dealer);
    socket_->set(zmq::sockopt::linger, 0);
    socket_->set(zmq::sockopt::sndhwm, 0);
    socket_->set(zmq::sockopt::rcvhwm, 0);
    socket_->set(zmq::sockopt::reconnect_ivl, 50);
    socket_->set(zmq::sockopt::reconnect_ivl_max, 500);
    socket_->connect(options_.endpoint);
  } catch (const zmq::error_t& e) {
    return Status(StatusCode::kUnavailable, fmt::format("connecting to {}: {}", options_.endpoint, e.what()));
  }
  capnp::MallocMessageBuilder m;
  auto req = m.initRoot<schema::Request>();
  const uint64_t id = next_id();
  req.setId(id);
  auto h = req.initHello();
  h.setClient(options_.name);
  h.setProtocolVersion(schema::PROTOCOL_VERSION);
  std::string bytes = flat_bytes(m);
  ODY_RETURN_IF_ERROR(send_raw(bytes, {}));
  const auto start = Clock::now();
  while (elapsed_ms(start) < options_.ack_timeout_ms) {
    ODY_ASSIGN_OR_RETURN(auto frames, receive(options_.ack_timeout_ms - elapsed_ms(start)));
    if (!frames) break;
    MessageView view(view_of((*frames)[0]));
    if (!view.ok()) continue;
    Status st = guarded("hello reply", [&]() -> Status {
      auto r = view.root<schema::Response>();
      if (r.getId() != id) return Status(StatusCode::kNotFound, "");
      if (r.getError() != schema::ErrorCode::NONE) return Status(status_code(r.getError()), r.getMessage());
      credits_ = std::max<uint32_t>(1, r.getHello().getCredits());
      max_message_bytes_ = r.getHello().getMaxMessageBytes();
      return Status::Ok();
    });
    if (st.code() == StatusCode::kNotFound) continue;
    return st;
  }
  return Status(StatusCode::kUnavailable,
                fmt::format("replay service at {} did not answer within {} ms", options_.endpoint, options_.ack_timeout_ms));
}

Status ServiceConnection::send_raw(std::string_view request, std::string_view payload) {
  if (!socket_) return Status(StatusCode::kUnavailable, "not connected");
  if (payload.empty()) return send_frames(*socket_, {request});
  return send_frames(*socket_, {request, payload});
}

Result<std::optional<std::vector<zmq::message_t>>> ServiceConnection::receive(int timeout_ms) {
  if (!socket_) return Status(StatusCode::kUnavailable, "not connected");
  return recv_frames(*socket_, std::max(timeout_ms, 0));
}

// ---------------------------------------------------------------- TrajectoryWriter

Result<std::unique_ptr<TrajectoryWriter>> TrajectoryWriter::connect(const ClientOptions& options) {
  std::unique_ptr<TrajectoryWriter> w(new TrajectoryWriter(options));
  const auto start = Clock::now();
  for (;;) {
    Status st = w->conn_.connect();
    if (st.ok()) break;
    if (st.code() != StatusCode::kUnavailable || elapsed_ms(start) > options.give_up_after_ms) return st;
  }
  w->last_progress_ = Clock::now();
  return w;
}

Status TrajectoryWriter::send_tracked(capnp::MallocMessageBuilder& request, std::string payload, bool is_segment) {
  auto req = request.getRoot<schema::Request>();
  req.setId(conn_.next_id());
  Outgoing out{flat_bytes(request), std::move(payload), is_segment};
  Status st = conn_.send_raw(out.request, out.payload);
  if (!st.ok()) spdlog::debug("send failed ({}); will resend after reconnect", st.to_string());
  if (is_segment) ++unacked_segments_;
  if (unacked_.empty()) last_progress_ = Clock::now();
  unacked_.emplace(req.getId(), std::move(out));
  return Status::Ok();
}

Status TrajectoryWriter::pump(int timeout_ms) {
  ODY_ASSIGN_OR_RETURN(auto frames, conn_.receive(timeout_ms));
  if (!frames) {
    if (unacked_.empty()) return Status::Ok();
    if (elapsed_ms(last_progress_) > conn_.options().give_up_after_ms)
      return Status(StatusCode::kUnavailable,
                    fmt::format("replay service at {} made no progress for {} ms ({} requests unacknowledged)",
                                conn_.options().endpoint, conn_.options().give_up_after_ms, unacked_.size()));
    // Silence for a whole ack timeout: the service may have restarted. Reconnect, resend in order.
    const auto quiet_since = std::max(last_progress_, last_reconnect_);
    if (elapsed_ms(quiet_since) < conn_.options().ack_timeout_ms) return Status::Ok();
    last_reconnect_ = Clock::now();
    Status st = conn_.connect();
    if (!st.ok()) return Status::Ok();  // still down; try again on the next pump
    ++reconnects_;
    for (const auto& [id, out] : unacked_) {
      ODY_RETURN_IF_ERROR(conn_.send_raw(out.request, out.payload));
      ++resends_;
    }
    spdlog::info("reconnected to {}; resent {} unacknowledged requests", conn_.options().endpoint, unacked_.size());
    return Status::Ok();
  }
  MessageView view(view_of((*frames)[0]));
  if (!view.ok()) return Status::Ok();  // not ours to crash on; the resend logic covers it
  return guarded("replay response", [&]() -> Status {
    auto r = view.root<schema::Response>();
    auto it = unacked_.find(r.getId());
    if (it == unacked_.end()) return Status::Ok();  // a second answer to a resend
    const auto err = r.getError();
    if (err == schema::ErrorCode::RATE_LIMITED && !it->second.is_segment) {
      rate_limited_begin_ = r.getId();
      return Status::Ok();
    }
    if (err == schema::ErrorCode::STORAGE) {
      // The batch did not become durable; nothing was stored. Send it again.
      spdlog::warn("replay service storage error ({}); resending", r.getMessage().cStr());
      return conn_.send_raw(it->second.request, it->second.payload);
    }
    if (err != schema::ErrorCode::NONE && !error_) {
      error_ = Status(status_code(err), std::string("replay service: ") + r.getMessage().cStr());
    }
    if (it->second.is_segment) {
      --unacked_segments_;
      if (err == schema::ErrorCode::NONE) ++segments_acked_;
    }
    unacked_.erase(it);
    last_progress_ = Clock::now();
    return Status::Ok();
  });
}

Result<uint64_t> TrajectoryWriter::begin(const TrajectoryMeta& meta) {
  if (error_) return *error_;
  const uint64_t id = meta.id ? meta.id : random_trajectory_id();
  if (chains_.count(id)) return invalid_argument("begin: trajectory {} is already open in this writer", format_trajectory_id(id));
  capnp::MallocMessageBuilder m;
  auto t = m.initRoot<schema::Request>().initBegin();
  t.setId(id);
  t.setJob(meta.job);
  auto env = t.initEnvironment();
  env.setName(meta.environment);
  env.setVersion(meta.environment_version);
  env.setPluginHash(meta.plugin_hash);
  t.setTask(meta.task);
  t.setSeed(meta.seed);
  t.setGroupId(meta.group_id);
  t.setGroupSize(meta.group_size);
  t.setTokenizer(meta.tokenizer);
  t.setWriter(conn_.options().name);
  t.setPriority(meta.priority);
  t.setStartedUnixNanos(unix_nanos_now());
  ODY_RETURN_IF_ERROR(send_tracked(m, {}, /*is_segment=*/false));
  const uint64_t req_id = m.getRoot<schema::Request>().getId();
  int backoff_ms = 5;
  while (unacked_.count(req_id)) {
    ODY_RETURN_IF_ERROR(pump(conn_.options().ack_timeout_ms));
    if (rate_limited_begin_ == req_id) {
      // Back-pressure: the service does not admit new trajectories yet.
      rate_limited_begin_ = 0;
      if (conn_.options().stop != nullptr && conn_.options().stop->load()) {
        // Refused, not admitted: nothing of it is stored, so nothing is left open.
        unacked_.erase(req_id);
        return Status(StatusCode::kTimeout,
                      "begin: stopped while the replay service's rate limiter held new trajectories back");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
      backoff_ms = std::min(backoff_ms * 2, 200);
      last_progress_ = Clock::now();
      ODY_RETURN_IF_ERROR(conn_.send_raw(unacked_[req_id].request, {}));
    }
  }
  if (error_) return *error_;
  chains_[id] = Chain{};
  return id;
}

Status TrajectoryWriter::append(uint64_t id, const SegmentData& segment) {
  if (error_) return *error_;
  auto c = chains_.find(id);
  if (c == chains_.end())
    return invalid_argument("append: trajectory {} was not begun by this writer (or has ended)", format_trajectory_id(id));
  while (unacked_segments_ >= conn_.credits()) {
    ODY_RETURN_IF_ERROR(pump(conn_.options().ack_timeout_ms));
    if (error_) return *error_;
  }
  SegmentPosition pos{id, c->second.next_seq, c->second.tokens, c->second.last};
  ODY_ASSIGN_OR_RETURN(auto enc, encode_segment(pos, segment));
  if (enc.bytes.size() > conn_.max_message_bytes())
    return Status(StatusCode::kResourceExhausted,
                  fmt::format("segment {}/{} is {} bytes, over the service's limit of {}; split it",
                              format_trajectory_id(id), pos.seq, enc.bytes.size(), conn_.max_message_bytes()));
  capnp::MallocMessageBuilder m;
  auto a = m.initRoot<schema::Request>().initAppend();
  a.setTrajectoryId(id);
  a.setSeq(pos.seq);
  ODY_RETURN_IF_ERROR(send_tracked(m, std::move(enc.bytes), /*is_segment=*/true));
  c->second.next_seq += 1;
  c->second.tokens += segment.tokens.size();
  c->second.last = enc.hash;
  // Take acknowledgements that are already there without waiting.
  while (true) {
    size_t before = unacked_.size();
    ODY_RETURN_IF_ERROR(pump(0));
    if (unacked_.size() == before) break;
  }
  return error_ ? *error_ : Status::Ok();
}

Status TrajectoryWriter::end(uint64_t id, const Reward& reward, bool failed, const std::string& error) {
  if (error_) return *error_;
  auto c = chains_.find(id);
  if (c == chains_.end())
    return invalid_argument("end: trajectory {} was not begun by this writer (or has ended)", format_trajectory_id(id));
  capnp::MallocMessageBuilder m;
  auto e = m.initRoot<schema::Request>().initEnd();
  e.setTrajectoryId(id);
  e.setNumSegments(c->second.next_seq);
  e.setLastHashLo(c->second.last.lo);
  e.setLastHashHi(c->second.last.hi);
  e.setFailed(failed);
  e.setError(error);
  e.setRewardTotal(reward.total);
  auto parts = e.initRewardParts(static_cast<unsigned>(reward.parts.size()));
  for (size_t i = 0; i < reward.parts.size(); ++i) {
    parts[i].setName(reward.parts[i].first);
    parts[i].setValue(reward.parts[i].second);
  }
  chains_.erase(c);
  return send_tracked(m, {}, /*is_segment=*/false);
}

Status TrajectoryWriter::flush() {
  while (!unacked_.empty()) {
    ODY_RETURN_IF_ERROR(pump(conn_.options().ack_timeout_ms));
    if (error_) return *error_;
  }
  return error_ ? *error_ : Status::Ok();
}

// ---------------------------------------------------------------- ReplaySampler

Result<std::unique_ptr<ReplaySampler>> ReplaySampler::connect(const ClientOptions& options) {
  std::unique_ptr<ReplaySampler> s(new ReplaySampler(options));
  const auto start = Clock::now();
  for (;;) {
    Status st = s->conn_.connect();
    if (st.ok()) break;
    if (st.code() != StatusCode::kUnavailable || elapsed_ms(start) > options.give_up_after_ms) return st;
  }
  return s;
}

Result<std::vector<zmq::message_t>> ReplaySampler::call(capnp::MallocMessageBuilder& request, int timeout_ms,
                                                         bool idempotent) {
  auto req = request.getRoot<schema::Request>();
  req.setId(conn_.next_id());
  const uint64_t id = req.getId();
  std::string bytes = flat_bytes(request);
  ODY_RETURN_IF_ERROR(conn_.send_raw(bytes, {}));
  const auto start = Clock::now();
  auto waited_since = Clock::now();
  for (;;) {
    ODY_ASSIGN_OR_RETURN(auto frames, conn_.receive(100));
    if (frames) {
      MessageView view(view_of((*frames)[0]));
      if (!view.ok()) continue;
      uint64_t rid = 0;
      schema::ErrorCode err = schema::ErrorCode::NONE;
      std::string message;
      Status st = guarded("response", [&]() -> Status {
        auto r = view.root<schema::Response>();
        rid = r.getId();
        err = r.getError();
        message = r.getMessage();
        return Status::Ok();
      });
      if (!st.ok() || rid != id) continue;
      if (err != schema::ErrorCode::NONE && err != schema::ErrorCode::RATE_LIMITED)
        return Status(status_code(err), "replay service: " + message);
      return std::move(*frames);
    }
    if (elapsed_ms(waited_since) > timeout_ms + conn_.options().ack_timeout_ms) {
      if (!idempotent || elapsed_ms(start) > conn_.options().give_up_after_ms)
        return Status(StatusCode::kUnavailable,
                      fmt::format("replay service at {} did not answer", conn_.options().endpoint));
      Status st = conn_.connect();
      if (st.ok()) ODY_RETURN_IF_ERROR(conn_.send_raw(bytes, {}));
      waited_since = Clock::now();
    }
  }
}

Result<SampleBatch> ReplaySampler::sample(uint32_t count, uint32_t timeout_ms) {
  capnp::MallocMessageBuilder m;
  auto s = m.initRoot<schema::Request>().initSample();
  s.setCount(count);
  s.setTimeoutMillis(timeout_ms);
  ODY_ASSIGN_OR_RETURN(auto frames, call(m, static_cast<int>(timeout_ms), /*idempotent=*/false));
  MessageView view(view_of(frames[0]));
  if (!view.ok()) return view.status();
  SampleBatch batch;
  Status st = guarded("sample reply", [&]() -> Status {
    auto r = view.root<schema::Response>();
    if (r.getError() == schema::ErrorCode::RATE_LIMITED)
      return Status(StatusCode::kTimeout, std::string("nothing sampled: ") + r.getMessage().cStr());
    auto sr = r.getSample();
    batch.cursor = sr.getCursor();
    for (auto item : sr.getItems()) {
      auto rec = std::make_unique<capnp::MallocMessageBuilder>();
      rec->setRoot(item);
      batch.items.emplace_back(std::move(rec));
    }
    for (uint32_t g : sr.getGroupBoundaries()) batch.group_starts.push_back(g);
    return Status::Ok();
  });
  ODY_RETURN_IF_ERROR(st);
  return batch;
}

Result<std::vector<std::string>> ReplaySampler::read(uint64_t id, uint32_t from_seq, uint32_t max_segments,
                                                     uint64_t max_bytes) {
  capnp::MallocMessageBuilder m;
  auto r = m.initRoot<schema::Request>().initRead();
  r.setTrajectoryId(id);
  r.setFromSeq(from_seq);
  r.setMaxSegments(max_segments);
  r.setMaxBytes(max_bytes);
  ODY_ASSIGN_OR_RETURN(auto frames, call(m, 0, /*idempotent=*/true));
  std::vector<std::string> out;
  for (size_t i = 1; i < frames.size(); ++i) out.emplace_back(view_of(frames[i]));
  return out;
}

Status ReplaySampler::commit(uint64_t cursor) {
  capnp::MallocMessageBuilder m;
  m.initRoot<schema::Request>().initCommit().setCursor(cursor);
  auto r = call(m, 0, /*idempotent=*/true);
  return r.ok() ? Status::Ok() : r.status();
}

Status ReplaySampler::resume(uint64_t cursor) {
  capnp::MallocMessageBuilder m;
  m.initRoot<schema::Request>().initResume().setCursor(cursor);
  auto r = call(m, 0, /*idempotent=*/true);
  return r.ok() ? Status::Ok() : r.status();
}

Status ReplaySampler::update_priorities(const std::vector<std::pair<uint64_t, double>>& priorities) {
  capnp::MallocMessageBuilder m;
  auto l = m.initRoot<schema::Request>().initUpdatePriorities(static_cast<unsigned>(priorities.size()));
  for (size_t i = 0; i < priorities.size(); ++i) {
    l[i].setTrajectoryId(priorities[i].first);
    l[i].setPriority(priorities[i].second);
  }
  auto r = call(m, 0, /*idempotent=*/true);
  return r.ok() ? Status::Ok() : r.status();
}

Status ReplaySampler::set_policy_version(uint32_t version) {
  capnp::MallocMessageBuilder m;
  m.initRoot<schema::Request>().setSetPolicyVersion(version);
  auto r = call(m, 0, /*idempotent=*/true);
  return r.ok() ? Status::Ok() : r.status();
}

Status ReplaySampler::checkpoint(const std::string& dir) {
  capnp::MallocMessageBuilder m;
  m.initRoot<schema::Request>().setCheckpoint(dir);
  auto r = call(m, 60000, /*idempotent=*/false);
  return r.ok() ? Status::Ok() : r.status();
}

Result<ServiceStats> ReplaySampler::stats() {
  capnp::MallocMessageBuilder m;
  m.initRoot<schema::Request>().setStats();
  ODY_ASSIGN_OR_RETURN(auto frames, call(m, 0, /*idempotent=*/true));
  MessageView view(view_of(frames[0]));
  if (!view.ok()) return view.status();
  ServiceStats out;
  ODY_RETURN_IF_ERROR(guarded("stats reply", [&]() -> Status {
    auto s = view.root<schema::Response>().getStats();
    out.trajectories = s.getTrajectories();
    out.in_flight = s.getInFlight();
    out.complete = s.getComplete();
    out.consumed = s.getConsumed();
    out.withheld = s.getWithheld();
    out.failed = s.getFailed();
    out.segments = s.getSegments();
    out.bytes = s.getBytes();
    out.inserts = s.getInserts();
    out.samples = s.getSamples();
    out.policy_version = s.getPolicyVersion();
    out.sampler = s.getSampler();
    out.segments_written = s.getSegmentsWritten();
    out.duplicates_ignored = s.getDuplicatesIgnored();
    out.commits_synced = s.getCommitsSynced();
    return Status::Ok();
  }));
  return out;
}

Result<std::optional<std::string>> SegmentStream::next() {
  if (buffered_.empty() && !done_) {
    ODY_ASSIGN_OR_RETURN(auto segs, sampler_.read(id_, next_seq_, chunk_));
    if (segs.empty()) done_ = true;
    next_seq_ += static_cast<uint32_t>(segs.size());
    for (auto& s : segs) buffered_.push_back(std::move(s));
  }
  if (buffered_.empty()) return std::optional<std::string>();
  std::string s = std::move(buffered_.front());
  buffered_.pop_front();
  return std::optional<std::string>(std::move(s));
}

}  // namespace odyssey::replay
