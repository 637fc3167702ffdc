#include "replay/service.h"

#include <cmath>
#include <filesystem>

#include <capnp/serialize.h>
#include <spdlog/spdlog.h>

#include "core/transport.h"

namespace odyssey::replay {

namespace {

schema::ErrorCode error_code(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument: return schema::ErrorCode::BAD_REQUEST;
    case StatusCode::kResourceExhausted: return schema::ErrorCode::TOO_LARGE;
    case StatusCode::kNotFound: return schema::ErrorCode::UNKNOWN_TRAJECTORY;
    case StatusCode::kConflict:
    case StatusCode::kAlreadyExists: return schema::ErrorCode::CONFLICT;
    case StatusCode::kTimeout: return schema::ErrorCode::RATE_LIMITED;
    case StatusCode::kCorrupt: return schema::ErrorCode::CORRUPT;
    case StatusCode::kFailedPrecondition: return schema::ErrorCode::UNSUPPORTED;
    default: return schema::ErrorCode::STORAGE;
  }
}

constexpr uint64_t kMaxRequestFrameBytes = 1ull << 20;  // requests are small; segments travel in frame 2

}  // namespace

ReplayService::ReplayService(const ServiceOptions& options)
    : options_(options), context_(1), socket_(context_, zmq::socket_type::router) {}

ReplayService::~ReplayService() = default;

Result<std::unique_ptr<ReplayService>> ReplayService::create(const ServiceOptions& options) {
  ODY_RETURN_IF_ERROR(check_endpoint(options.listen).with_context("replay.listen"));
  if (options.credits == 0) return invalid_argument("replay.credits must be at least 1");
  std::unique_ptr<ReplayService> service(new ReplayService(options));
  StoreOptions so = options.store;
  so.max_segment_bytes = options.max_message_bytes;
  ODY_ASSIGN_OR_RETURN(service->store_, TrajectoryStore::open(so));
  try {
    auto& s = service->socket_;
    s.set(zmq::sockopt::linger, 0);
    s.set(zmq::sockopt::rcvhwm, 0);
    s.set(zmq::sockopt::sndhwm, 0);
    // A hard cap far above the app-level limit: frames between the two get a clear error.
    s.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(options.max_message_bytes * 2 + (1 << 20)));
    s.bind(options.listen);
    service->endpoint_ = s.get(zmq::sockopt::last_endpoint);
  } catch (const zmq::error_t& e) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("cannot listen on {}: {} (is another service on that port?)", options.listen, e.what()));
  }
  auto now = std::chrono::steady_clock::now();
  service->last_checkpoint_ = service->last_stats_ = service->last_retention_ = now;
  return service;
}

void ReplayService::reply(const std::string& identity, capnp::MallocMessageBuilder& response,
                          const std::vector<std::string>& extra_frames) {
  std::string body = flat_bytes(response);
  std::vector<std::string_view> frames = {identity, body};
  for (const auto& f : extra_frames) frames.push_back(f);
  Status st = send_frames(socket_, frames, /*dont_wait=*/true);
  if (!st.ok()) spdlog::debug("dropping a reply to a departed client: {}", st.to_string());
}

void ReplayService::reply_error(const std::string& identity, uint64_t id, const Status& status) {
  capnp::MallocMessageBuilder m;
  auto r = m.initRoot<schema::Response>();
  r.setId(id);
  r.setError(error_code(status));
  r.setMessage(status.message());
  r.setAck();
  reply(identity, m);
}

void ReplayService::reply_ack(const std::string& identity, uint64_t id) {
  capnp::MallocMessageBuilder m;
  auto r = m.initRoot<schema::Response>();
  r.setId(id);
  r.setAck();
  reply(identity, m);
}

void ReplayService::flush_writes() {
  if (!store_->has_staged()) {
    for (const auto& p : pending_acks_) reply_ack(p.identity, p.id);
    pending_acks_.clear();
    return;
  }
  Status st = store_->commit();
  for (const auto& p : pending_acks_) {
    if (st.ok()) reply_ack(p.identity, p.id);
    else reply_error(p.identity, p.id, st);  // the writer resends; nothing was stored
  }
  pending_acks_.clear();
}

void ReplayService::handle(std::vector<zmq::message_t>& frames) {
  if (frames.size() < 2) return;  // ROUTER always prefixes the identity; an empty message is noise
  const std::string identity(view_of(frames[0]));
  std::string_view body = view_of(frames[1]);
  if (body.size() > kMaxRequestFrameBytes) {
    reply_error(identity, 0, Status(StatusCode::kResourceExhausted,
                                    fmt::format("request frame of {} bytes; segments go in a second frame", body.size())));
    return;
  }
  MessageView view(body, kMaxRequestFrameBytes);
  if (!view.ok()) {
    reply_error(identity, 0, view.status().with_context("request"));
    return;
  }
  uint64_t id = 0;
  Status st = guarded("request", [&]() -> Status {
    auto req = view.root<schema::Request>();
    id = req.getId();
    switch (req.which()) {
      case schema::Request::HELLO: {
        auto h = req.getHello();
        capnp::MallocMessageBuilder m;
        auto r = m.initRoot<schema::Response>();
        r.setId(id);
        if (h.getProtocolVersion() != schema::PROTOCOL_VERSION) {
          r.setError(schema::ErrorCode::UNSUPPORTED);
          r.setMessage(fmt::format("client '{}' speaks protocol {}, this service speaks {}; upgrade the older side",
                                   h.getClient().cStr(), h.getProtocolVersion(), schema::PROTOCOL_VERSION));
        }
        auto hr = r.initHello();
        hr.setProtocolVersion(schema::PROTOCOL_VERSION);
        hr.setMaxMessageBytes(options_.max_message_bytes);
        hr.setCredits(options_.credits);
        hr.setServer("odyssey replay");
        reply(identity, m);
        return Status::Ok();
      }
      case schema::Request::BEGIN: {
        if (!store_->can_insert())
          return Status(StatusCode::kTimeout, "rate limited: " + store_->insert_blocked_reason());
        ODY_ASSIGN_OR_RETURN(auto outcome, store_->begin(req.getBegin()));
        (void)outcome;
        pending_acks_.push_back({identity, id});
        return Status::Ok();
      }
      case schema::Request::APPEND: {
        auto a = req.getAppend();
        if (frames.size() != 3)
          return invalid_argument("append {}/{}: expected the segment in a second frame, got {} frames",
                                  format_trajectory_id(a.getTrajectoryId()), a.getSeq(), frames.size() - 1);
        ODY_ASSIGN_OR_RETURN(auto outcome, store_->append(a.getTrajectoryId(), a.getSeq(), view_of(frames[2])));
        (void)outcome;
        pending_acks_.push_back({identity, id});
        if (store_->staged_bytes() >= options_.group_commit_bytes) flush_writes();
        return Status::Ok();
      }
      case schema::Request::END: {
        ODY_ASSIGN_OR_RETURN(auto outcome, store_->end(req.getEnd()));
        (void)outcome;
        pending_acks_.push_back({identity, id});
        return Status::Ok();
      }
      default:
        break;
    }
    // Everything else sees only durable writes.
    flush_writes();
    switch (req.which()) {
      case schema::Request::SAMPLE: {
        auto s = req.getSample();
        WaitingSample w{identity, id, s.getCount(),
                        std::chrono::steady_clock::now() + std::chrono::milliseconds(s.getTimeoutMillis())};
        if (s.getCount() == 0) return invalid_argument("sample: count must be at least 1");
        if (!try_sample(w, s.getTimeoutMillis() == 0)) waiting_samples_.push_back(w);
        return Status::Ok();
      }
      case schema::Request::READ: {
        auto rd = req.getRead();
        // The record first: an unknown trajectory is an error, not an empty read.
        ODY_ASSIGN_OR_RETURN(auto rec_bytes, store_->read_record(rd.getTrajectoryId()));
        ODY_ASSIGN_OR_RETURN(auto rec, decode_trajectory(rec_bytes));
        auto t = rec->getRoot<schema::Trajectory>();
        ODY_ASSIGN_OR_RETURN(auto segs, store_->read_segments(rd.getTrajectoryId(), rd.getFromSeq(),
                                                              rd.getMaxSegments() ? rd.getMaxSegments() : 64,
                                                              rd.getMaxBytes() ? rd.getMaxBytes() : (16ull << 20)));
        capnp::MallocMessageBuilder m;
        auto r = m.initRoot<schema::Response>();
        r.setId(id);
        auto rr = r.initRead();
        rr.setNumSegments(static_cast<uint32_t>(segs.size()));
        rr.setEndOfTrajectory(t.getStatus() != schema::TrajectoryStatus::IN_FLIGHT &&
                              rd.getFromSeq() + segs.size() >= t.getNumSegments());
        reply(identity, m, segs);
        return Status::Ok();
      }
      case schema::Request::COMMIT:
        ODY_RETURN_IF_ERROR(store_->commit_deliveries(req.getCommit().getCursor()));
        break;
      case schema::Request::RESUME:
        ODY_RETURN_IF_ERROR(store_->resume(req.getResume().getCursor()));
        break;
      case schema::Request::UPDATE_PRIORITIES: {
        // All or nothing: check every entry before staging any.
        for (auto p : req.getUpdatePriorities()) {
          if (!(p.getPriority() >= 0) || !std::isfinite(p.getPriority()))
            return invalid_argument("priority for {} must be a finite number >= 0, got {}",
                                    format_trajectory_id(p.getTrajectoryId()), p.getPriority());
          ODY_RETURN_IF_ERROR(store_->read_record(p.getTrajectoryId()).status());
        }
        for (auto p : req.getUpdatePriorities())
          ODY_RETURN_IF_ERROR(store_->update_priority(p.getTrajectoryId(), p.getPriority()));
        break;
      }
      case schema::Request::SET_POLICY_VERSION:
        ODY_RETURN_IF_ERROR(store_->set_policy_version(req.getSetPolicyVersion()));
        break;
      case schema::Request::CHECKPOINT:
        ODY_RETURN_IF_ERROR(store_->checkpoint(req.getCheckpoint()));
        spdlog::info("checkpoint written to {}", req.getCheckpoint().cStr());
        break;
      case schema::Request::STATS: {
        auto c = store_->counters();
        const auto& ls = store_->rate_limiter().state();
        capnp::MallocMessageBuilder m;
        auto r = m.initRoot<schema::Response>();
        r.setId(id);
        auto s = r.initStats();
        s.setTrajectories(c.trajectories);
        s.setInFlight(c.in_flight);
        s.setComplete(c.complete);
        s.setConsumed(c.consumed);
        s.setWithheld(c.withheld);
        s.setFailed(c.failed);
        s.setSegments(c.segments);
        s.setBytes(c.bytes);
        s.setInserts(ls.inserts);
        s.setSamples(ls.samples);
        s.setPolicyVersion(ls.policy_version);
        s.setSampler(store_->options().sampler);
        s.setSegmentsWritten(c.segments_written);
        s.setDuplicatesIgnored(c.duplicates_ignored);
        s.setCommitsSynced(c.commits);
        reply(identity, m);
        return Status::Ok();
      }
      default:
        return Status(StatusCode::kFailedPrecondition,
                      fmt::format("request kind {} is not known to this service (newer client?)",
                                  static_cast<int>(req.which())));
    }
    ODY_RETURN_IF_ERROR(store_->commit());
    reply_ack(identity, id);
    return Status::Ok();
  });
  if (!st.ok()) reply_error(identity, id, st);
}

bool ReplayService::try_sample(const WaitingSample& w, bool last_chance) {
  auto result = store_->sample(w.count);
  if (!result.ok()) {
    reply_error(w.identity, w.id, result.status());
    return true;
  }
  if (result->records.empty() && !last_chance) return false;
  Status st = store_->commit();  // leases, limiter counters and the RNG are durable before delivery
  if (!st.ok()) {
    reply_error(w.identity, w.id, st);
    return true;
  }
  capnp::MallocMessageBuilder m;
  auto r = m.initRoot<schema::Response>();
  r.setId(w.id);
  if (result->records.empty()) {
    r.setError(schema::ErrorCode::RATE_LIMITED);
    r.setMessage(result->blocked);
  }
  auto sr = r.initSample();
  sr.setCursor(result->cursor);
  auto items = sr.initItems(static_cast<unsigned>(result->records.size()));
  for (size_t i = 0; i < result->records.size(); ++i) {
    MessageView v(result->records[i]);
    items.setWithCaveats(static_cast<unsigned>(i), v.root<schema::Trajectory>());
  }
  auto gs = sr.initGroupBoundaries(static_cast<unsigned>(result->group_starts.size()));
  for (size_t i = 0; i < result->group_starts.size(); ++i) gs.set(static_cast<unsigned>(i), result->group_starts[i]);
  reply(w.identity, m);
  return true;
}

void ReplayService::serve_waiting_samples(bool expire_all) {
  const auto now = std::chrono::steady_clock::now();
  for (size_t i = 0; i < waiting_samples_.size();) {
    const auto& w = waiting_samples_[i];
    if (try_sample(w, expire_all || now >= w.deadline)) {
      waiting_samples_.erase(waiting_samples_.begin() + static_cast<long>(i));
    } else {
      ++i;
    }
  }
}

void ReplayService::periodic() {
  const auto now = std::chrono::steady_clock::now();
  if (now - last_retention_ >= std::chrono::seconds(1)) {
    last_retention_ = now;
    auto removed = store_->enforce_retention();
    if (!removed.ok()) spdlog::error("retention: {}", removed.status().to_string());
  }
  if (options_.checkpoint_every_seconds && !options_.checkpoint_dir.empty() &&
      now - last_checkpoint_ >= std::chrono::seconds(options_.checkpoint_every_seconds)) {
    last_checkpoint_ = now;
    auto dir = (std::filesystem::path(options_.checkpoint_dir) / std::to_string(unix_nanos_now() / 1000000000)).string();
    Status st = store_->checkpoint(dir);
    if (st.ok()) spdlog::info("checkpoint written to {}", dir);
    else spdlog::error("periodic checkpoint: {}", st.to_string());
  }
  if (options_.stats_every_seconds && now - last_stats_ >= std::chrono::seconds(options_.stats_every_seconds)) {
    const double secs = std::chrono::duration<double>(now - last_stats_).count();
    last_stats_ = now;
    auto c = store_->counters();
    spdlog::info("trajectories {} (in flight {}, complete {}, consumed {}, withheld {}, failed {}), segments {}, "
                 "{:.1f} MB; last {:.0f}s: {:.1f} segments/s, {} duplicates ignored",
                 c.trajectories, c.in_flight, c.complete, c.consumed, c.withheld, c.failed, c.segments,
                 c.bytes / 1e6, secs, (c.segments_written - last_counters_.segments_written) / secs,
                 c.duplicates_ignored - last_counters_.duplicates_ignored);
    last_counters_ = c;
  }
}

Status ReplayService::run(const std::atomic<bool>& stop) {
  spdlog::info("replay service on {} storing in {} (sampler {}, sync {})", endpoint_, store_->options().dir,
               store_->options().sampler, store_->options().sync);
  while (!stop.load()) {
    const int timeout_ms = waiting_samples_.empty() ? 50 : 5;
    auto first = recv_frames(socket_, timeout_ms);
    if (!first.ok()) {
      if (stop.load()) break;
      spdlog::warn("{}", first.status().to_string());
      continue;
    }
    if (first->has_value()) {
      handle(**first);
      // Drain what is already queued so its writes share one durable commit.
      for (int i = 0; i < 4096; ++i) {
        auto more = recv_frames(socket_, 0);
        if (!more.ok() || !more->has_value()) break;
        handle(**more);
      }
    }
    flush_writes();
    if (!waiting_samples_.empty()) serve_waiting_samples(/*expire_all=*/false);
    periodic();
  }
  flush_writes();
  serve_waiting_samples(/*expire_all=*/true);
  spdlog::info("replay service stopping; {} trajectories stored", store_->counters().trajectories);
  return Status::Ok();
}

}  // namespace odyssey::replay
