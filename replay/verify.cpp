#include "replay/verify.h"

#include <memory>
#include <unordered_set>

#include "replay/layout.h"

namespace odyssey::replay {

std::string VerifyProblem::to_string() const {
  if (seq < 0) return fmt::format("trajectory {}: {}", format_trajectory_id(trajectory_id), what);
  return fmt::format("trajectory {} segment {}: {}", format_trajectory_id(trajectory_id), seq, what);
}

namespace {

void problem(VerifyReport& r, uint64_t id, int64_t seq, std::string what) {
  r.problems.push_back(VerifyProblem{id, seq, std::move(what)});
}

// Checks one record and its chain. `value` is the stored record bytes.
Status check_trajectory(const TrajectoryStore& store, uint64_t id, std::string_view value, VerifyReport& r) {
  ++r.trajectories;
  auto rec = decode_trajectory(value, /*verify_hash=*/true);
  if (!rec.ok()) {
    problem(r, id, -1, "record: " + rec.status().message());
    return Status::Ok();
  }
  auto t = (*rec)->getRoot<schema::Trajectory>().asReader();
  if (t.getId() != id) {
    problem(r, id, -1, fmt::format("record says it is trajectory {}", format_trajectory_id(t.getId())));
    return Status::Ok();
  }
  std::unique_ptr<rocksdb::Iterator> it(store.db()->NewIterator(rocksdb::ReadOptions(), store.segments_cf()));
  const std::string prefix = trajectory_key(id);
  uint32_t expect = 0;
  uint64_t tokens = 0;
  Hash128 prev;
  for (it->Seek(segment_key(id, 0)); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    uint64_t kid;
    uint32_t seq;
    if (!parse_segment_key(std::string_view(it->key().data(), it->key().size()), &kid, &seq)) {
      problem(r, id, -1, fmt::format("malformed segment key of {} bytes", it->key().size()));
      return Status::Ok();
    }
    if (seq != expect) {
      problem(r, id, expect, fmt::format("missing (the next stored segment is {})", seq));
      return Status::Ok();
    }
    std::string_view bytes(it->value().data(), it->value().size());
    ++r.segments;
    r.bytes += bytes.size();
    auto hashes = check_self_hash(bytes);
    if (!hashes.ok()) {
      problem(r, id, seq, "unreadable: " + hashes.status().message());
      return Status::Ok();
    }
    if (!hashes->ok()) {
      problem(r, id, seq, fmt::format("hash mismatch: stored {}, content hashes to {} (the value was altered)",
                                      hashes->stored.hex(), hashes->computed.hex()));
      return Status::Ok();
    }
    const Hash128* computed = &hashes->computed;
    MessageView view(bytes);
    uint64_t n = 0;
    Status st = guarded("segment", [&]() -> Status {
      auto s = view.root<schema::Segment>();
      ODY_RETURN_IF_ERROR(validate_segment(s));
      if (s.getTrajectoryId() != id || s.getSeq() != seq)
        return invalid_argument("says it is {}/{}", format_trajectory_id(s.getTrajectoryId()), s.getSeq());
      if (Hash128{s.getPrevHashLo(), s.getPrevHashHi()} != prev)
        return invalid_argument("prevHash {} does not match the previous segment's hash {}",
                                Hash128{s.getPrevHashLo(), s.getPrevHashHi()}.hex(), prev.hex());
      if (s.getTokenStart() != tokens)
        return invalid_argument("tokenStart {} but {} tokens precede it", s.getTokenStart(), tokens);
      n = s.getTokens().size();
      return Status::Ok();
    });
    if (!view.ok()) st = view.status();
    if (!st.ok()) {
      problem(r, id, seq, st.message());
      return Status::Ok();
    }
    tokens += n;
    prev = *computed;
    ++expect;
  }
  if (!it->status().ok()) {
    problem(r, id, expect, "rocksdb: " + it->status().ToString());
    return Status::Ok();
  }
  r.tokens += tokens;
  if (expect != t.getNumSegments())
    problem(r, id, -1, fmt::format("incomplete: record says {} segments, {} stored", t.getNumSegments(), expect));
  else if (tokens != t.getNumTokens())
    problem(r, id, -1, fmt::format("record says {} tokens, segments hold {}", t.getNumTokens(), tokens));
  else if (Hash128{t.getLastHashLo(), t.getLastHashHi()} != prev)
    problem(r, id, -1, fmt::format("record's lastHash {} is not the chain's end {}",
                                   Hash128{t.getLastHashLo(), t.getLastHashHi()}.hex(), prev.hex()));
  return Status::Ok();
}

}  // namespace

Status verify_trajectory(const TrajectoryStore& store, uint64_t id, VerifyReport& report) {
  std::string value;
  auto s = store.db()->Get(rocksdb::ReadOptions(), store.trajectories_cf(), trajectory_key(id), &value);
  if (s.IsNotFound()) return Status(StatusCode::kNotFound, fmt::format("unknown trajectory {}", format_trajectory_id(id)));
  if (!s.ok()) {
    problem(report, id, -1, "rocksdb: " + s.ToString());
    return Status::Ok();
  }
  return check_trajectory(store, id, value, report);
}

Result<VerifyReport> verify_store(const TrajectoryStore& store, const VerifyOptions& options) {
  VerifyReport report;
  std::unordered_set<uint64_t> ids;
  std::unique_ptr<rocksdb::Iterator> it(store.db()->NewIterator(rocksdb::ReadOptions(), store.trajectories_cf()));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    if (it->key().size() != 8) {
      problem(report, 0, -1, fmt::format("malformed trajectory key of {} bytes", it->key().size()));
      continue;
    }
    const uint64_t id = get_be64(it->key().data());
    ids.insert(id);
    ODY_RETURN_IF_ERROR(check_trajectory(store, id, std::string_view(it->value().data(), it->value().size()), report));
    if (options.progress) options.progress(report.trajectories);
    if (report.problems.size() >= options.max_problems) return report;
  }
  if (!it->status().ok()) {
    problem(report, 0, -1, "rocksdb: " + it->status().ToString());
    return report;
  }
  // Segments nobody owns (a record lost while its segments stayed).
  std::unique_ptr<rocksdb::Iterator> seg(store.db()->NewIterator(rocksdb::ReadOptions(), store.segments_cf()));
  for (seg->SeekToFirst(); seg->Valid(); seg->Next()) {
    uint64_t id;
    uint32_t sq;
    if (!parse_segment_key(std::string_view(seg->key().data(), seg->key().size()), &id, &sq)) continue;
    if (!ids.count(id)) {
      problem(report, id, sq, "segment without a trajectory record");
      seg->Seek(trajectory_key(id + 1));
      if (!seg->Valid()) break;
      seg->Prev();
    }
  }
  return report;
}

}  // namespace odyssey::replay
