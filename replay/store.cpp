#include "replay/store.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include <unistd.h>

#include <rocksdb/utilities/checkpoint.h>
#include <rocksdb/write_batch.h>
#include <spdlog/spdlog.h>

#include "replay/layout.h"

namespace odyssey::replay {

namespace fs = std::filesystem;
using schema::TrajectoryStatus;

namespace {

Status from_rocks(const rocksdb::Status& s, const std::string& what) {
  if (s.ok()) return Status::Ok();
  StatusCode code = s.IsCorruption() ? StatusCode::kCorrupt
                    : s.IsNotFound() ? StatusCode::kNotFound
                                     : StatusCode::kIo;
  return Status(code, fmt::format("{}: rocksdb: {}", what, s.ToString()));
}

std::string bytes_of(capnp::MallocMessageBuilder& m) { return encode_trajectory(m); }

Hash128 last_hash(schema::Trajectory::Reader t) { return Hash128{t.getLastHashLo(), t.getLastHashHi()}; }

bool same_identity(schema::Trajectory::Reader a, schema::Trajectory::Reader b) {
  return a.getJob() == b.getJob() && a.getEnvironment().getName() == b.getEnvironment().getName() &&
         a.getEnvironment().getVersion() == b.getEnvironment().getVersion() && a.getTask() == b.getTask() &&
         a.getSeed() == b.getSeed() && a.getGroupId() == b.getGroupId() && a.getGroupSize() == b.getGroupSize();
}

}  // namespace

// The mutable part of a trajectory whose segments are still arriving.
struct TrajectoryStore::InFlight {
  std::unique_ptr<capnp::MallocMessageBuilder> record;
  schema::Trajectory::Builder get() { return record->getRoot<schema::Trajectory>(); }
};

TrajectoryStore::TrajectoryStore(const StoreOptions& options) : options_(options) {}

TrajectoryStore::~TrajectoryStore() {
  if (db_) {
    for (auto* h : handles_) db_->DestroyColumnFamilyHandle(h);
    handles_.clear();
    db_->Close().PermitUncheckedError();
  }
}

rocksdb::ColumnFamilyOptions TrajectoryStore::segment_cf_options() {
  rocksdb::ColumnFamilyOptions o;
  // Segments are large and written once: keep them in blob files so compaction moves keys,
  // not tokens.
  o.enable_blob_files = true;
  o.min_blob_size = 4096;
  o.blob_file_size = 256ull << 20;
  o.compression = rocksdb::kNoCompression;
  o.blob_compression_type = rocksdb::kNoCompression;
  o.write_buffer_size = 64ull << 20;
  return o;
}

Result<std::unique_ptr<TrajectoryStore>> TrajectoryStore::open(const StoreOptions& options) {
  if (options.dir.empty()) return invalid_argument("replay store: no directory given (replay.dir / --dir)");
  std::unique_ptr<TrajectoryStore> store(new TrajectoryStore(options));
  ODY_ASSIGN_OR_RETURN(store->selector_, make_selector(options.sampler, options.priority_exponent));
  ODY_ASSIGN_OR_RETURN(store->limiter_, RateLimiter::create(options.rate_limiter));
  ODY_RETURN_IF_ERROR(store->open_db());
  if (options.read_only) return store;  // audit: reads records and segments directly
  ODY_RETURN_IF_ERROR(store->load_state());
  ODY_RETURN_IF_ERROR(store->rebuild_in_memory());
  return store;
}

Status TrajectoryStore::open_db() {
  rocksdb::DBOptions db_options;
  db_options.create_if_missing = !options_.read_only;
  db_options.create_missing_column_families = !options_.read_only;
  db_options.paranoid_checks = true;
  db_options.wal_recovery_mode = rocksdb::WALRecoveryMode::kPointInTimeRecovery;
  db_options.max_background_jobs = 2;
  rocksdb::ColumnFamilyOptions small;
  small.compression = rocksdb::kNoCompression;
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
      {rocksdb::kDefaultColumnFamilyName, small},
      {kSegmentsCf, segment_cf_options()},
      {kTrajectoriesCf, small},
      {kIndexCf, small},
      {kStateCf, small},
  };
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s;
  if (options_.read_only) {
    if (!fs::exists(fs::path(options_.dir) / "CURRENT"))
      return Status(StatusCode::kNotFound, fmt::format("{} is not a replay store (no RocksDB CURRENT file)", options_.dir));
    // A secondary instance reads a store that a running service keeps writing.
    std::string secondary = (fs::temp_directory_path() /
                             fmt::format("odyssey-secondary-{}-{}", ::getpid(), reinterpret_cast<uintptr_t>(this)))
                                .string();
    rocksdb::Options o(db_options, small);
    o.max_open_files = -1;
    s = rocksdb::DB::OpenAsSecondary(o, options_.dir, secondary, cfs, &handles_, &raw);
    if (s.ok()) s = raw->TryCatchUpWithPrimary();
  } else {
    std::error_code ec;
    fs::create_directories(options_.dir, ec);
    if (ec) return Status(StatusCode::kIo, fmt::format("cannot create {}: {}", options_.dir, ec.message()));
    s = rocksdb::DB::Open(db_options, options_.dir, cfs, &handles_, &raw);
  }
  if (!s.ok()) {
    std::string hint = s.IsIOError() && s.ToString().find("lock") != std::string::npos
                           ? " (is another `odyssey replay serve` using it?)"
                           : "";
    return from_rocks(s, fmt::format("opening replay store {}{}", options_.dir, hint));
  }
  db_.reset(raw);
  segments_ = handles_[1];
  trajectories_ = handles_[2];
  index_ = handles_[3];
  state_ = handles_[4];
  return Status::Ok();
}

Status TrajectoryStore::load_state() {
  std::string v;
  auto s = db_->Get(rocksdb::ReadOptions(), state_, "format", &v);
  if (s.ok()) {
    if (v.size() != 4 || get_be32(v.data()) != kFormatVersion)
      return Status(StatusCode::kFailedPrecondition,
                    fmt::format("replay store {} has on-disk format {}, this odyssey reads format {}", options_.dir,
                                v.size() == 4 ? get_be32(v.data()) : 0, kFormatVersion));
  } else if (s.IsNotFound()) {
    if (!options_.read_only) {
      std::string f;
      put_be32(f, kFormatVersion);
      rocksdb::WriteOptions wo;
      wo.sync = options_.sync;
      ODY_RETURN_IF_ERROR(from_rocks(db_->Put(wo, state_, "format", f), "writing format"));
    }
  } else {
    return from_rocks(s, "reading format");
  }
  s = db_->Get(rocksdb::ReadOptions(), state_, "limiter", &v);
  if (s.ok()) {
    ODY_ASSIGN_OR_RETURN(auto st, RateLimiter::decode(v));
    ODY_ASSIGN_OR_RETURN(limiter_, RateLimiter::create(options_.rate_limiter, st));
  } else if (!s.IsNotFound()) {
    return from_rocks(s, "reading rate limiter state");
  }
  rng_ = Rng(options_.sampler_seed, 0);
  s = db_->Get(rocksdb::ReadOptions(), state_, "rng", &v);
  if (s.ok() && v.size() == 16) rng_ = Rng(get_be64(v.data()), get_be64(v.data() + 8));
  s = db_->Get(rocksdb::ReadOptions(), state_, "counters", &v);
  if (s.ok() && v.size() == 16) {
    next_ready_seq_ = get_be64(v.data());
    next_delivery_ = get_be64(v.data() + 8);
  }
  // Leases: deliveries not yet committed by the consumer.
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), state_));
  for (it->Seek("lease/"); it->Valid() && it->key().starts_with("lease/"); it->Next()) {
    if (it->key().size() != 14 || it->value().size() % 8 != 0)
      return Status(StatusCode::kCorrupt, "malformed lease record in replay state");
    uint64_t delivery = get_be64(it->key().data() + 6);
    std::vector<uint64_t> ids;
    for (size_t i = 0; i < it->value().size(); i += 8) ids.push_back(get_be64(it->value().data() + i));
    leases_[delivery] = std::move(ids);
  }
  return from_rocks(it->status(), "reading leases");
}

SampleItem TrajectoryStore::item_of(schema::Trajectory::Reader t) const {
  SampleItem item;
  item.key = t.getId();
  item.ready_seq = t.getReadySeq();
  item.group_id = t.getGroupId();
  item.group_size = t.getGroupSize();
  item.priority = t.getPriority();
  item.times_sampled = t.getTimesSampled();
  return item;
}

// Scans every trajectory record: counters, the selector (sampleable items in ready order,
// minus leased ones), and in-flight trajectories.
Status TrajectoryStore::rebuild_in_memory() {
  counters_ = StoreCounters{};
  in_flight_.clear();
  ready_order_.clear();
  ODY_ASSIGN_OR_RETURN(selector_, make_selector(options_.sampler, options_.priority_exponent));
  std::unordered_map<uint64_t, bool> leased;
  for (const auto& [d, ids] : leases_)
    for (uint64_t id : ids) leased[id] = true;
  std::vector<std::pair<uint64_t, SampleItem>> ready;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), trajectories_));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    std::string_view value(it->value().data(), it->value().size());
    auto rec = decode_trajectory(value);
    if (!rec.ok()) {
      spdlog::error("replay store: trajectory {} is unreadable and is skipped: {} (run `odyssey traj verify`)",
                    it->key().size() == 8 ? format_trajectory_id(get_be64(it->key().data())) : "?",
                    rec.status().to_string());
      continue;
    }
    auto t = (*rec)->getRoot<schema::Trajectory>().asReader();
    ++counters_.trajectories;
    counters_.segments += t.getNumSegments();
    counters_.bytes += t.getNumBytes();
    switch (t.getStatus()) {
      case TrajectoryStatus::IN_FLIGHT: {
        ++counters_.in_flight;
        auto f = std::make_unique<InFlight>();
        f->record = std::move(*rec);
        in_flight_[t.getId()] = std::move(f);
        break;
      }
      case TrajectoryStatus::COMPLETE:
        ++counters_.complete;
        if (!leased.count(t.getId())) ready.emplace_back(t.getReadySeq(), item_of(t));
        break;
      case TrajectoryStatus::CONSUMED: ++counters_.consumed; break;
      case TrajectoryStatus::WITHHELD: ++counters_.withheld; break;
      case TrajectoryStatus::FAILED:
        ++counters_.failed;
        selector_->note_failed(item_of(t));
        break;
    }
    if (t.getReadySeq() > 0) ready_order_[t.getReadySeq()] = t.getId();
  }
  ODY_RETURN_IF_ERROR(from_rocks(it->status(), "scanning trajectories"));
  std::sort(ready.begin(), ready.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& [seq, item] : ready) ODY_RETURN_IF_ERROR(selector_->insert(item));
  return Status::Ok();
}

void TrajectoryStore::reset_staging() {
  batch_.Clear();
  staged_ops_ = 0;
  dirty_records_.clear();
  staged_segments_.clear();
}

uint64_t TrajectoryStore::staged_bytes() const { return batch_.GetDataSize(); }

Result<std::unique_ptr<capnp::MallocMessageBuilder>> TrajectoryStore::load_record(uint64_t id) const {
  std::string v;
  auto s = db_->Get(rocksdb::ReadOptions(), trajectories_, trajectory_key(id), &v);
  if (s.IsNotFound())
    return Status(StatusCode::kNotFound, fmt::format("unknown trajectory {}", format_trajectory_id(id)));
  ODY_RETURN_IF_ERROR(from_rocks(s, "reading trajectory record"));
  auto rec = decode_trajectory(v);
  if (!rec.ok()) return rec.status().with_context(fmt::format("trajectory {}", format_trajectory_id(id)));
  return rec;
}

// The latest version of a record, staged changes included, as a private copy to modify.
Result<std::unique_ptr<capnp::MallocMessageBuilder>> TrajectoryStore::record_for_update(uint64_t id) {
  auto f = in_flight_.find(id);
  if (f != in_flight_.end()) {
    auto copy = std::make_unique<capnp::MallocMessageBuilder>();
    copy->setRoot(f->second->get().asReader());
    return copy;
  }
  auto d = dirty_records_.find(id);
  if (d != dirty_records_.end()) {
    auto copy = std::make_unique<capnp::MallocMessageBuilder>();
    copy->setRoot(d->second->getRoot<schema::Trajectory>().asReader());
    return copy;
  }
  return load_record(id);
}

void TrajectoryStore::stage_record(uint64_t id, capnp::MallocMessageBuilder& record) {
  auto st = batch_.Put(trajectories_, trajectory_key(id), bytes_of(record));
  st.PermitUncheckedError();
  ++staged_ops_;
}

void TrajectoryStore::stage_index(schema::Trajectory::Reader t, bool add) {
  const uint64_t id = t.getId();
  std::vector<std::string> keys = {
      text_index_key('j', t.getJob().cStr(), id),
      text_index_key('e', t.getEnvironment().getName().cStr(), id),
      version_index_key(t.getMinPolicyVersion(), id),
      reward_index_key(t.getRewardTotal(), id),
  };
  if (t.getReadySeq() > 0) keys.push_back(ready_index_key(t.getReadySeq()));
  for (const auto& k : keys) {
    if (add) {
      std::string v;
      if (k[0] == 'r') put_be64(v, id);
      batch_.Put(index_, k, v).PermitUncheckedError();
    } else {
      batch_.Delete(index_, k).PermitUncheckedError();
    }
  }
}

void TrajectoryStore::stage_state() {
  batch_.Put(state_, "limiter", limiter_.encode()).PermitUncheckedError();
  std::string r;
  put_be64(r, rng_.seed());
  put_be64(r, rng_.counter());
  batch_.Put(state_, "rng", r).PermitUncheckedError();
  std::string c;
  put_be64(c, next_ready_seq_);
  put_be64(c, next_delivery_);
  batch_.Put(state_, "counters", c).PermitUncheckedError();
  ++staged_ops_;
}

Status TrajectoryStore::commit() {
  if (staged_ops_ == 0) return Status::Ok();
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync;
  auto s = db_->Write(wo, &batch_);
  if (!s.ok()) {
    // Memory may now be ahead of disk: rebuild it from what is durable.
    Status err = from_rocks(s, "committing replay writes");
    spdlog::error("{}; reloading state from disk", err.to_string());
    reset_staging();
    leases_.clear();
    Status reload = load_state();
    if (reload.ok()) reload = rebuild_in_memory();
    if (!reload.ok()) spdlog::critical("replay store could not reload after a failed commit: {}", reload.to_string());
    return err;
  }
  ++counters_.commits;
  reset_staging();
  return Status::Ok();
}

Result<WriteOutcome> TrajectoryStore::begin(schema::Trajectory::Reader meta) {
  const uint64_t id = meta.getId();
  if (id == 0) return invalid_argument("begin: trajectory id 0 is reserved; writers pick a non-zero id");
  // setEnvironment() copies the client's struct pointers and all: read every field as its schema
  // type first, or a malformed one is stored and fails every later reader of the record.
  ODY_RETURN_IF_ERROR(guarded("begin", [&]() -> Status {
    auto env = meta.getEnvironment();
    (void)env.getName(), (void)env.getVersion(), (void)env.getPluginHash();
    (void)meta.getJob(), (void)meta.getTask(), (void)meta.getTokenizer(), (void)meta.getWriter();
    return Status::Ok();
  }));
  // An infinite priority would be refused by every sampler at end(), leaving the trajectory
  // unable to end. (Zero, negative or NaN mean "unset": 1.)
  if (std::isinf(meta.getPriority()))
    return invalid_argument("begin {}: priority {} is not finite", format_trajectory_id(id), meta.getPriority());
  auto existing = record_for_update(id);  // staged, in flight, or stored
  if (existing.ok()) {
    if (same_identity((*existing)->getRoot<schema::Trajectory>().asReader(), meta)) return WriteOutcome::kDuplicate;
    return Status(StatusCode::kConflict,
                  fmt::format("begin: trajectory {} already exists with another job/environment/task/seed/group",
                              format_trajectory_id(id)));
  }
  if (existing.status().code() != StatusCode::kNotFound) return existing.status();

  auto f = std::make_unique<InFlight>();
  f->record = std::make_unique<capnp::MallocMessageBuilder>();
  auto t = f->record->initRoot<schema::Trajectory>();
  t.setId(id);
  t.setJob(meta.getJob());
  t.setEnvironment(meta.getEnvironment());
  t.setTask(meta.getTask());
  t.setSeed(meta.getSeed());
  t.setGroupId(meta.getGroupId());
  t.setGroupSize(meta.getGroupSize());
  t.setTokenizer(meta.getTokenizer());
  t.setWriter(meta.getWriter());
  t.setStatus(TrajectoryStatus::IN_FLIGHT);
  t.setStartedUnixNanos(meta.getStartedUnixNanos() ? meta.getStartedUnixNanos() : unix_nanos_now());
  t.setMinPolicyVersion(UINT32_MAX);
  t.setPriority(meta.getPriority() > 0 ? meta.getPriority() : 1.0);
  stage_record(id, *f->record);
  in_flight_[id] = std::move(f);
  ++counters_.trajectories;
  ++counters_.in_flight;
  return WriteOutcome::kStored;
}

Result<TrajectoryStore::InFlight*> TrajectoryStore::in_flight(uint64_t id) {
  auto f = in_flight_.find(id);
  if (f == in_flight_.end()) return Status(StatusCode::kNotFound, "");
  return f->second.get();
}

Result<WriteOutcome> TrajectoryStore::append(uint64_t id, uint32_t seq, std::string_view bytes) {
  const std::string where = fmt::format("segment {}/{}", format_trajectory_id(id), seq);
  if (bytes.size() > options_.max_segment_bytes)
    return Status(StatusCode::kResourceExhausted,
                  fmt::format("{}: {} bytes exceeds replay.max_message_bytes = {}; write smaller segments", where,
                              bytes.size(), options_.max_segment_bytes));
  MessageView view(bytes, options_.max_segment_bytes);
  if (!view.ok()) return view.status().with_context(where);
  auto hashes = check_self_hash(bytes);
  if (!hashes.ok()) return hashes.status().with_context(where);
  const Hash128 computed = hashes->computed;
  if (!hashes->ok())
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: hash {} does not match its content ({}): damaged in transit?", where,
                              hashes->stored.hex(), computed.hex()));
  uint64_t msg_id = 0, token_start = 0;
  uint32_t msg_seq = 0, n = 0, vmin = UINT32_MAX, vmax = 0;
  Hash128 prev;
  ODY_RETURN_IF_ERROR(guarded(where.c_str(), [&]() -> Status {
    auto s = view.root<schema::Segment>();
    ODY_RETURN_IF_ERROR(validate_segment(s));
    msg_id = s.getTrajectoryId();
    msg_seq = s.getSeq();
    prev = Hash128{s.getPrevHashLo(), s.getPrevHashHi()};
    token_start = s.getTokenStart();
    auto versions = s.getPolicyVersions();
    n = versions.size();
    for (uint32_t v : versions) {
      vmin = std::min(vmin, v);
      vmax = std::max(vmax, v);
    }
    return Status::Ok();
  }).with_context(where));
  if (msg_id != id || msg_seq != seq)
    return invalid_argument("{}: the segment says it is {}/{}", where, format_trajectory_id(msg_id), msg_seq);

  auto f = in_flight_.find(id);
  if (f == in_flight_.end()) {
    // Not in flight: either a resend of a stored segment of an ended trajectory, or unknown.
    auto rec = record_for_update(id);
    if (!rec.ok()) {
      if (rec.status().code() == StatusCode::kNotFound)
        return Status(StatusCode::kNotFound, fmt::format("{}: unknown trajectory; call begin() first", where));
      return rec.status();
    }
    auto t = (*rec)->getRoot<schema::Trajectory>().asReader();
    if (seq >= t.getNumSegments())
      return Status(StatusCode::kConflict, fmt::format("{}: the trajectory already ended with {} segments", where,
                                                       t.getNumSegments()));
  } else {
    auto t = f->second->get();
    const uint32_t next = t.getNumSegments();
    if (seq == next) {
      if (prev != last_hash(t.asReader()))
        return Status(StatusCode::kConflict, fmt::format("{}: prevHash {} does not continue the chain (last hash {})",
                                                         where, prev.hex(), last_hash(t.asReader()).hex()));
      if (token_start != t.getNumTokens())
        return Status(StatusCode::kConflict, fmt::format("{}: tokenStart {} but the trajectory has {} tokens", where,
                                                         token_start, t.getNumTokens()));
      batch_.Put(segments_, segment_key(id, seq), rocksdb::Slice(bytes.data(), bytes.size())).PermitUncheckedError();
      staged_segments_[{id, seq}] = computed;
      t.setNumSegments(next + 1);
      t.setNumTokens(t.getNumTokens() + n);
      t.setNumBytes(t.getNumBytes() + bytes.size());
      t.setLastHashLo(computed.lo);
      t.setLastHashHi(computed.hi);
      if (n) {
        t.setMinPolicyVersion(std::min(t.getMinPolicyVersion(), vmin));
        t.setMaxPolicyVersion(std::max(t.getMaxPolicyVersion(), vmax));
      }
      stage_record(id, *f->second->record);
      ++counters_.segments;
      counters_.bytes += bytes.size();
      ++counters_.segments_written;
      return WriteOutcome::kStored;
    }
    if (seq > next)
      return Status(StatusCode::kConflict,
                    fmt::format("{}: out of order, the service expects seq {} next", where, next));
  }
  // seq is already stored: the same bytes are a resend, other bytes a conflict.
  Hash128 have;
  auto staged = staged_segments_.find({id, seq});
  if (staged != staged_segments_.end()) {
    have = staged->second;  // a resend racing its original inside one batch
  } else {
    std::string existing;
    auto s = db_->Get(rocksdb::ReadOptions(), segments_, segment_key(id, seq), &existing);
    ODY_RETURN_IF_ERROR(from_rocks(s, where));
    ODY_ASSIGN_OR_RETURN(have, stored_self_hash(existing));
  }
  if (have == computed) {
    ++counters_.duplicates_ignored;
    return WriteOutcome::kDuplicate;
  }
  return Status(StatusCode::kConflict,
                fmt::format("{}: already stored with hash {}, this one has {}", where, have.hex(), computed.hex()));
}

Result<WriteOutcome> TrajectoryStore::end(schema::End::Reader end) {
  const uint64_t id = end.getTrajectoryId();
  const std::string where = fmt::format("end {}", format_trajectory_id(id));
  const Hash128 claimed{end.getLastHashLo(), end.getLastHashHi()};
  auto f = in_flight_.find(id);
  if (f == in_flight_.end()) {
    auto rec = record_for_update(id);
    if (!rec.ok()) {
      if (rec.status().code() == StatusCode::kNotFound)
        return Status(StatusCode::kNotFound, fmt::format("{}: unknown trajectory", where));
      return rec.status();
    }
    auto t = (*rec)->getRoot<schema::Trajectory>().asReader();
    if (t.getNumSegments() == end.getNumSegments() && last_hash(t) == claimed) return WriteOutcome::kDuplicate;
    return Status(StatusCode::kConflict, fmt::format("{}: already ended with {} segments (last hash {})", where,
                                                     t.getNumSegments(), last_hash(t).hex()));
  }
  auto t = f->second->get();
  if (end.getNumSegments() != t.getNumSegments())
    return Status(StatusCode::kConflict,
                  fmt::format("{}: the writer sent {} segments, the service has {}; resend the missing ones first",
                              where, end.getNumSegments(), t.getNumSegments()));
  if (claimed != last_hash(t.asReader()))
    return Status(StatusCode::kConflict, fmt::format("{}: last hash {} differs from the stored chain's {}", where,
                                                     claimed.hex(), last_hash(t.asReader()).hex()));
  if (!std::isfinite(end.getRewardTotal()))
    return invalid_argument("{}: reward total is not finite", where);
  // The ended record is built on a copy, and nothing else changes until every step that can fail
  // has passed: the client's reward parts and error may be malformed (reading or copying them
  // throws), and the sampler may refuse the trajectory (a group that disagrees on its size).
  auto record = std::make_unique<capnp::MallocMessageBuilder>();
  ODY_RETURN_IF_ERROR(guarded(where.c_str(), [&]() -> Status {
    record->setRoot(t.asReader());
    auto e = record->getRoot<schema::Trajectory>();
    e.setRewardTotal(end.getRewardTotal());
    e.setRewardParts(end.getRewardParts());
    for (auto part : e.getRewardParts()) (void)part.getName();  // setRewardParts() copies pointers unchecked
    e.setEndedUnixNanos(unix_nanos_now());
    if (e.getMinPolicyVersion() == UINT32_MAX) e.setMinPolicyVersion(0);
    if (end.getFailed()) {
      e.setStatus(TrajectoryStatus::FAILED);
      e.setError(end.getError());
    } else if (limiter_.is_stale(e.getMinPolicyVersion())) {
      e.setStatus(TrajectoryStatus::WITHHELD);
      e.setError(fmt::format("policy lag: oldest token from version {}, learner at {}", e.getMinPolicyVersion(),
                             limiter_.state().policy_version));
    } else {
      e.setStatus(TrajectoryStatus::COMPLETE);
      e.setReadySeq(next_ready_seq_);
    }
    (void)e.getJob(), (void)e.getEnvironment().getName();  // what stage_index() reads
    return Status::Ok();
  }));
  auto e = record->getRoot<schema::Trajectory>();
  switch (e.getStatus()) {
    case TrajectoryStatus::COMPLETE:
      ODY_RETURN_IF_ERROR(selector_->insert(item_of(e.asReader())));
      ++next_ready_seq_;
      ready_order_[e.getReadySeq()] = id;
      limiter_.on_insert(1);
      ++counters_.complete;
      break;
    case TrajectoryStatus::FAILED:
      ++counters_.failed;
      selector_->note_failed(item_of(e.asReader()));  // its group is served without it
      break;
    default: ++counters_.withheld; break;
  }
  --counters_.in_flight;
  stage_index(e.asReader(), /*add=*/true);
  stage_record(id, *record);
  dirty_records_[id] = std::move(record);
  in_flight_.erase(f);
  stage_state();
  return WriteOutcome::kStored;
}

Status TrajectoryStore::set_status(uint64_t id, TrajectoryStatus status, const std::string& why) {
  ODY_ASSIGN_OR_RETURN(auto rec, record_for_update(id));
  auto t = rec->getRoot<schema::Trajectory>();
  auto before = t.getStatus();
  if (before == status) return Status::Ok();
  auto adjust = [&](TrajectoryStatus s, int delta) {
    uint64_t* c = s == TrajectoryStatus::COMPLETE   ? &counters_.complete
                  : s == TrajectoryStatus::CONSUMED ? &counters_.consumed
                  : s == TrajectoryStatus::WITHHELD ? &counters_.withheld
                  : s == TrajectoryStatus::FAILED   ? &counters_.failed
                                                    : &counters_.in_flight;
    *c += delta;
  };
  adjust(before, -1);
  adjust(status, +1);
  t.setStatus(status);
  if (!why.empty()) t.setError(why);
  stage_record(id, *rec);
  dirty_records_[id] = std::move(rec);
  return Status::Ok();
}

Result<std::string> TrajectoryStore::read_record(uint64_t id) const {
  std::string v;
  auto s = db_->Get(rocksdb::ReadOptions(), trajectories_, trajectory_key(id), &v);
  if (s.IsNotFound())
    return Status(StatusCode::kNotFound, fmt::format("unknown trajectory {}", format_trajectory_id(id)));
  ODY_RETURN_IF_ERROR(from_rocks(s, "reading trajectory record"));
  return v;
}

Result<std::vector<std::string>> TrajectoryStore::read_segments(uint64_t id, uint32_t from_seq,
                                                                uint32_t max_segments, uint64_t max_bytes) const {
  std::vector<std::string> out;
  uint64_t bytes = 0;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), segments_));
  const std::string prefix = trajectory_key(id);
  uint32_t expect = from_seq;
  for (it->Seek(segment_key(id, from_seq)); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    if (out.size() >= std::max<uint32_t>(max_segments, 1)) break;
    if (!out.empty() && bytes + it->value().size() > max_bytes) break;
    uint64_t kid;
    uint32_t seq;
    if (!parse_segment_key(std::string_view(it->key().data(), it->key().size()), &kid, &seq) || seq != expect)
      return Status(StatusCode::kCorrupt, fmt::format("segment {}/{} is missing from the store",
                                                      format_trajectory_id(id), expect));
    ++expect;
    // Never hand out damaged bytes: a flipped bit on disk becomes a clear error here.
    std::string_view value(it->value().data(), it->value().size());
    auto hashes = check_self_hash(value);
    if (!hashes.ok() || !hashes->ok())
      return Status(StatusCode::kCorrupt,
                    fmt::format("segment {}/{} failed its integrity check ({}); run `odyssey traj verify`",
                                format_trajectory_id(id), seq,
                                hashes.ok() ? "hash mismatch" : hashes.status().message()));
    out.emplace_back(value);
    bytes += value.size();
  }
  ODY_RETURN_IF_ERROR(from_rocks(it->status(), "reading segments"));
  return out;
}

Status TrajectoryStore::remove_trajectory(uint64_t id) {
  ODY_ASSIGN_OR_RETURN(auto rec, record_for_update(id));
  auto t = rec->getRoot<schema::Trajectory>().asReader();
  batch_.DeleteRange(segments_, segment_key(id, 0), trajectory_key(id + 1)).PermitUncheckedError();
  if (id == UINT64_MAX) batch_.DeleteRange(segments_, segment_key(id, 0), segment_key(id, UINT32_MAX)).PermitUncheckedError();
  batch_.Delete(trajectories_, trajectory_key(id)).PermitUncheckedError();
  stage_index(t, /*add=*/false);
  ++staged_ops_;
  if (t.getStatus() == TrajectoryStatus::COMPLETE) {
    if (selector_->remove(id)) limiter_.on_delete(1);
  }
  counters_.segments -= t.getNumSegments();
  counters_.bytes -= t.getNumBytes();
  --counters_.trajectories;
  switch (t.getStatus()) {
    case TrajectoryStatus::COMPLETE: --counters_.complete; break;
    case TrajectoryStatus::CONSUMED: --counters_.consumed; break;
    case TrajectoryStatus::WITHHELD: --counters_.withheld; break;
    case TrajectoryStatus::FAILED: --counters_.failed; break;
    case TrajectoryStatus::IN_FLIGHT: --counters_.in_flight; break;
  }
  ready_order_.erase(t.getReadySeq());
  ++counters_.removed;
  dirty_records_.erase(id);
  return Status::Ok();
}

Result<uint64_t> TrajectoryStore::enforce_retention() {
  const auto& r = options_.retention;
  auto over = [&]() {
    return (r.max_trajectories && counters_.trajectories > r.max_trajectories) ||
           (r.max_bytes && counters_.bytes > r.max_bytes);
  };
  if (!over()) return uint64_t{0};
  std::unordered_map<uint64_t, bool> leased;
  for (const auto& [d, ids] : leases_)
    for (uint64_t id : ids) leased[id] = true;
  uint64_t removed = 0;
  // Oldest first; remove_trajectory() edits ready_order_, so walk a snapshot of it.
  std::vector<uint64_t> oldest_first;
  oldest_first.reserve(ready_order_.size());
  for (const auto& [seq, id] : ready_order_) oldest_first.push_back(id);
  for (uint64_t id : oldest_first) {
    if (!over()) break;
    if (leased.count(id)) continue;
    ODY_ASSIGN_OR_RETURN(auto rec, record_for_update(id));
    auto status = rec->getRoot<schema::Trajectory>().getStatus();
    bool removable = status == TrajectoryStatus::CONSUMED ||
                     (r.remove_unconsumed && status != TrajectoryStatus::IN_FLIGHT);
    if (!removable) continue;
    ODY_RETURN_IF_ERROR(remove_trajectory(id));
    ++removed;
  }
  if (removed) {
    stage_state();
    ODY_RETURN_IF_ERROR(commit());
    spdlog::info("retention removed {} trajectories ({} left, {} bytes)", removed, counters_.trajectories,
                 counters_.bytes);
  } else if (over()) {
    spdlog::warn("replay store is over its retention budget ({} trajectories, {} bytes) but nothing is consumed yet; "
                 "keeping everything (set replay.retention.remove_unconsumed to remove unconsumed data)",
                 counters_.trajectories, counters_.bytes);
  }
  return removed;
}

Status TrajectoryStore::checkpoint(const std::string& dir) {
  ODY_RETURN_IF_ERROR(commit());
  if (fs::exists(dir)) return Status(StatusCode::kAlreadyExists, fmt::format("checkpoint directory {} exists", dir));
  rocksdb::Checkpoint* raw = nullptr;
  ODY_RETURN_IF_ERROR(from_rocks(rocksdb::Checkpoint::Create(db_.get(), &raw), "creating checkpoint"));
  std::unique_ptr<rocksdb::Checkpoint> cp(raw);
  // Flush the memtables so the checkpoint does not depend on replaying a long WAL.
  return from_rocks(cp->CreateCheckpoint(dir, /*log_size_for_flush=*/0), fmt::format("checkpoint to {}", dir));
}

Result<SampleResult> TrajectoryStore::sample(uint32_t count) {
  SampleResult out;
  std::vector<uint64_t> leased;
  const bool with_replacement = selector_->with_replacement();
  while (out.group_starts.size() < count) {
    if (selector_->size() == 0) {
      if (out.records.empty())
        out.blocked = fmt::format("nothing to sample: {} complete trajectories, none sampleable as a unit by the "
                                  "{} sampler", counters_.complete, selector_->name());
      break;
    }
    if (!limiter_.can_sample(1)) {
      if (out.records.empty()) out.blocked = limiter_.sample_blocked_reason(1);
      break;
    }
    auto units = selector_->sample(1, rng_);
    if (units.empty()) break;
    const SampledUnit& unit = units.front();
    // Policy lag: a unit with a token older than the bound is withheld, kept for audit.
    uint32_t oldest = UINT32_MAX;
    std::vector<std::unique_ptr<capnp::MallocMessageBuilder>> records;
    for (uint64_t id : unit) {
      ODY_ASSIGN_OR_RETURN(auto rec, record_for_update(id));
      oldest = std::min(oldest, rec->getRoot<schema::Trajectory>().getMinPolicyVersion());
      records.push_back(std::move(rec));
    }
    if (limiter_.is_stale(oldest)) {
      const std::string why = fmt::format("policy lag: oldest token from version {}, learner at {}, bound {}", oldest,
                                          limiter_.state().policy_version, options_.rate_limiter.max_policy_lag);
      for (uint64_t id : unit) {
        if (with_replacement) selector_->remove(id);
        // Spent like a sample: counted as one, or with a samples_per_insert ratio the withheld
        // trajectories would hold new inserts back for good.
        limiter_.on_sample(1);
        limiter_.on_delete(1);
        ODY_RETURN_IF_ERROR(set_status(id, TrajectoryStatus::WITHHELD, why));
      }
      continue;
    }
    out.group_starts.push_back(static_cast<uint32_t>(out.records.size()));
    for (size_t i = 0; i < unit.size(); ++i) {
      const uint64_t id = unit[i];
      auto t = records[i]->getRoot<schema::Trajectory>();
      t.setTimesSampled(t.getTimesSampled() + 1);
      if (with_replacement) {
        if (options_.max_times_sampled && t.getTimesSampled() >= options_.max_times_sampled) {
          selector_->remove(id);
          limiter_.on_delete(1);
          t.setStatus(TrajectoryStatus::CONSUMED);
          --counters_.complete;
          ++counters_.consumed;
        }
      } else {
        leased.push_back(id);
        limiter_.on_delete(1);
      }
      out.records.push_back(bytes_of(*records[i]));
      stage_record(id, *records[i]);
      dirty_records_[id] = std::move(records[i]);
    }
    limiter_.on_sample(unit.size());
  }
  if (!leased.empty()) {
    out.cursor = next_delivery_++;
    std::string v;
    for (uint64_t id : leased) put_be64(v, id);
    batch_.Put(state_, lease_key(out.cursor), v).PermitUncheckedError();
    leases_[out.cursor] = std::move(leased);
  }
  stage_state();
  return out;
}

Status TrajectoryStore::commit_deliveries(uint64_t cursor) {
  for (auto it = leases_.begin(); it != leases_.end() && it->first <= cursor;) {
    for (uint64_t id : it->second) {
      auto rec = record_for_update(id);
      if (!rec.ok()) {
        if (rec.status().code() == StatusCode::kNotFound) continue;  // removed by retention meanwhile
        return rec.status();
      }
      if ((*rec)->getRoot<schema::Trajectory>().getStatus() == TrajectoryStatus::COMPLETE)
        ODY_RETURN_IF_ERROR(set_status(id, TrajectoryStatus::CONSUMED, ""));
    }
    batch_.Delete(state_, lease_key(it->first)).PermitUncheckedError();
    ++staged_ops_;
    it = leases_.erase(it);
  }
  return Status::Ok();
}

Status TrajectoryStore::resume(uint64_t cursor) {
  ODY_RETURN_IF_ERROR(commit_deliveries(cursor));
  // Everything delivered after the consumer's checkpoint was never trained on: offer it again.
  uint64_t released = 0;
  for (auto& [delivery, ids] : leases_) {
    for (uint64_t id : ids) {
      auto rec = record_for_update(id);
      if (!rec.ok()) continue;
      auto t = (*rec)->getRoot<schema::Trajectory>().asReader();
      if (t.getStatus() != TrajectoryStatus::COMPLETE) continue;
      ODY_RETURN_IF_ERROR(selector_->insert(item_of(t)));
      limiter_.on_insert(1);
      ++released;
    }
    batch_.Delete(state_, lease_key(delivery)).PermitUncheckedError();
  }
  leases_.clear();
  stage_state();
  if (released) spdlog::info("resume at cursor {}: {} delivered but uncommitted trajectories offered again", cursor, released);
  return Status::Ok();
}

StoreCounters TrajectoryStore::counters() const { return counters_; }

bool TrajectoryStore::can_insert() const { return limiter_.can_insert(1); }
std::string TrajectoryStore::insert_blocked_reason() const { return limiter_.insert_blocked_reason(1); }

Status TrajectoryStore::set_policy_version(uint32_t version) {
  limiter_.set_policy_version(version);
  stage_state();
  return Status::Ok();
}

Status TrajectoryStore::update_priority(uint64_t id, double priority) {
  if (!(priority >= 0) || !std::isfinite(priority))
    return invalid_argument("priority for {} must be a finite number >= 0, got {}", format_trajectory_id(id), priority);
  ODY_ASSIGN_OR_RETURN(auto rec, record_for_update(id));
  auto t = rec->getRoot<schema::Trajectory>();
  t.setPriority(priority);
  if (t.getStatus() == TrajectoryStatus::COMPLETE) {
    Status st = selector_->update_priority(id, priority);
    if (!st.ok() && st.code() != StatusCode::kNotFound) return st;
  }
  stage_record(id, *rec);
  dirty_records_[id] = std::move(rec);
  return Status::Ok();
}

}  // namespace odyssey::replay
