// libFuzzer target for the bytes the replay service takes from outside: Request frames,
// Segment frames, stored Trajectory records, and the store's write path behind them.
// Bad input must get a Status, never crash, throw past `guarded`, leak, or leave the
// store with anything partial. Run it with fuzz/run.sh.
//
// Input layout: [mode] [frame-1 length, 16-bit little-endian] [frame 1] [frame 2: the rest]
//   mode & 0x07 (taken modulo kNumModes):
//     0 request  frame 1 as a Request, decoded as ReplayService::handle does (1 MiB limit), every
//                field of the present union member read
//     1 segment  frame 2 as a Segment: stored/computed/checked self-hash, MessageView, validate_segment,
//                every field read
//     2 record   frame 2 through decode_trajectory (with and without the hash check), every field read
//     3 append   frame 1 = [trajectory index] [seq, 32-bit little-endian]; frame 2 is appended to a
//                real TrajectoryStore, then committed
//     4 service  frame 1 as a Request driving the same store the way ReplayService::handle does
//                (begin, append with frame 2, end, sample, read, commit, resume, priorities, ...)
//   mode & 0x40: stamp frame 2's self-hash first (modes 3 and 4), so mutated segments get past the
//                hash check and reach validation and the chain rules
//   mode & 0x80: hand the frames over at an odd address (MessageView's copying path); otherwise
//                8-byte aligned (zero-copy). Either way the buffer ends exactly where the frame
//                does, so AddressSanitizer sees any read past it.
//
// After every store input the harness checks (and aborts when one fails):
//   - a rejected operation changed none of the store's counters (nothing partial);
//   - a stored append added exactly one segment, anything else (a duplicate included) none;
//   - on disk, the touched trajectory's record reads without throwing (as do sampled records),
//     counts exactly the segments stored for it, their hashes chain to its lastHash, and an
//     in-flight record carries no end-of-trajectory fields;
//   - every kReopenEvery store inputs, reopening the store from disk gives the same counters.
// Every few reopens the store starts afresh with the next sampler (fifo, group_complete, ...).
//
// ODYSSEY_FUZZ_WRITE_SEEDS=<dir>: write the seed corpus (valid inputs for every mode) and exit.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <spdlog/spdlog.h>

#include "core/codec.h"
#include "core/schema/replay.capnp.h"
#include "core/schema/trajectory.capnp.h"
#include "replay/store.h"

namespace odyssey::fuzz {
namespace {

namespace fs = std::filesystem;
using replay::StoreCounters;
using replay::TrajectoryStore;
using replay::WriteOutcome;

constexpr uint64_t kMaxRequestFrameBytes = 1ull << 20;  // as replay/service.cpp
// replay.max_message_bytes for the fuzz store, and the segment decoders' limit. Smaller than the
// 64 MiB default but far above -max_len: it rejects no input by size, and it keeps a list of
// zero-sized elements (which the traversal limit charges one word each) from costing each
// input millions of iterations, which would slow the fuzzer 64-fold.
constexpr uint64_t kMaxSegmentBytes = 1ull << 20;
constexpr uint64_t kMaxRecordBytes = 64ull << 20;       // decode_trajectory's limit
constexpr int kNumModes = 5;
constexpr uint64_t kReopenEvery = 4096;                 // store inputs between reopen checks
constexpr uint64_t kWipeEvery = 4;                      // reopens between fresh stores, ...
constexpr uint64_t kResetTrajectories = 512;            // ... or sooner beyond this many trajectories
constexpr uint64_t kResetSegments = 4096;               // ... or this many segments
// Each fresh store takes the next sampler (end() and sample() differ by sampler).
constexpr const char* kSamplers[] = {"fifo", "group_complete", "prioritized", "uniform"};

// Trajectories begun at start (and after each wipe); mode 3 appends to one of them.
constexpr uint64_t kBegunIds[] = {0x1, 0x2, 0x3, 0x00c0ffee00000001, 0xffffffffffffffff};
constexpr size_t kNumBegun = sizeof(kBegunIds) / sizeof(kBegunIds[0]);

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "replay_messages_fuzz: invariant violated: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

// ---------------------------------------------------------------- traversal
// Reads every field, and every byte of every Text/Data, so bounds the library let through are
// checked by AddressSanitizer in our code. `sink` keeps the reads from being optimized away.
volatile uint64_t sink = 0;

void mix(uint64_t v) { sink = sink * 31 + v; }
void mix(double d) {
  uint64_t b;
  std::memcpy(&b, &d, 8);
  mix(b);
}
void mix(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  mix(uint64_t{b});
}
void mix(capnp::Text::Reader t) {
  for (char c : t) mix(static_cast<uint64_t>(static_cast<unsigned char>(c)));
  if (t.cStr()[t.size()] != '\0') fail("Text without its NUL terminator");
}
void mix(capnp::Data::Reader d) {
  for (auto b : d) mix(uint64_t{b});
}
template <typename E>
void mix_enum(E e) { mix(static_cast<uint64_t>(e)); }
template <typename T>
void mix_list(typename capnp::List<T>::Reader l) {
  mix(uint64_t{l.size()});
  for (auto v : l) mix(v);
}

void traverse(schema::Environment::Reader e) {
  mix(e.getName());
  mix(e.getVersion());
  mix(e.getPluginHash());
}
void traverse(schema::RewardPart::Reader p) {
  mix(p.getName());
  mix(p.getValue());
}
void traverse(capnp::List<schema::RewardPart>::Reader parts) {
  for (auto p : parts) traverse(p);
}

void traverse(schema::Trajectory::Reader t) {
  mix(t.getHashLo());
  mix(t.getHashHi());
  mix(t.getId());
  mix(t.getJob());
  traverse(t.getEnvironment());
  mix(t.getTask());
  mix(t.getSeed());
  mix(t.getGroupId());
  mix(uint64_t{t.getGroupSize()});
  mix(t.getTokenizer());
  mix(t.getWriter());
  mix_enum(t.getStatus());
  mix(t.getRewardTotal());
  traverse(t.getRewardParts());
  mix(t.getError());
  mix(uint64_t{t.getNumSegments()});
  mix(t.getNumTokens());
  mix(t.getNumBytes());
  mix(t.getLastHashLo());
  mix(t.getLastHashHi());
  mix(uint64_t{t.getMinPolicyVersion()});
  mix(uint64_t{t.getMaxPolicyVersion()});
  mix(static_cast<uint64_t>(t.getStartedUnixNanos()));
  mix(static_cast<uint64_t>(t.getEndedUnixNanos()));
  mix(t.getReadySeq());
  mix(uint64_t{t.getTimesSampled()});
  mix(t.getPriority());
}

void traverse(schema::Segment::Reader s) {
  mix(s.getHashLo());
  mix(s.getHashHi());
  mix(s.getTrajectoryId());
  mix(uint64_t{s.getSeq()});
  mix(s.getPrevHashLo());
  mix(s.getPrevHashHi());
  mix(s.getTokenStart());
  for (uint32_t v : s.getTokens()) mix(uint64_t{v});
  for (float v : s.getLogprobs()) mix(v);
  for (uint32_t v : s.getPolicyVersions()) mix(uint64_t{v});
  mix(s.getLossMask());
  for (auto turn : s.getTurns()) {
    mix_enum(turn.getRole());
    mix(uint64_t{turn.getStart()});
    mix(uint64_t{turn.getLength()});
    mix(uint64_t{turn.getContinued()});
  }
  for (auto c : s.getToolCalls()) {
    mix(c.getCallId());
    mix(c.getName());
    mix(c.getArguments());
    mix(c.getResult());
    mix_enum(c.getStatus());
    mix(c.getError());
    mix(static_cast<uint64_t>(c.getWallTimeNanos()));
    mix(uint64_t{c.getCallTokenStart()});
    mix(uint64_t{c.getResultTokenStart()});
  }
  for (auto im : s.getImages()) {
    mix(uint64_t{im.getTokenOffset()});
    mix(uint64_t{im.getNumPatchTokens()});
    mix(im.getMediaType());
    mix(uint64_t{im.getWidth()});
    mix(uint64_t{im.getHeight()});
    mix(im.getData());
  }
  mix(uint64_t{s.hasRoutedExperts()});
  auto re = s.getRoutedExperts();  // the default (empty) struct when null
  mix(uint64_t{re.getNumLayers()});
  mix(uint64_t{re.getTopK()});
  for (uint16_t e : re.getExperts()) mix(uint64_t{e});
  for (auto sn : s.getStateSnapshots()) {
    mix(sn.getTokenPosition());
    mix(uint64_t{sn.getPolicyVersion()});
    mix(sn.getFormat());
    mix(sn.getData());
  }
  mix(static_cast<uint64_t>(s.getCreatedUnixNanos()));
}

void traverse(schema::Request::Reader r) {
  mix(r.getId());
  switch (r.which()) {
    case schema::Request::HELLO: {
      auto h = r.getHello();
      mix(h.getClient());
      mix(uint64_t{h.getProtocolVersion()});
      break;
    }
    case schema::Request::BEGIN: traverse(r.getBegin()); break;
    case schema::Request::APPEND: {
      auto a = r.getAppend();
      mix(a.getTrajectoryId());
      mix(uint64_t{a.getSeq()});
      break;
    }
    case schema::Request::END: {
      auto e = r.getEnd();
      mix(e.getTrajectoryId());
      mix(uint64_t{e.getNumSegments()});
      mix(e.getLastHashLo());
      mix(e.getLastHashHi());
      mix(uint64_t{e.getFailed()});
      mix(e.getError());
      mix(e.getRewardTotal());
      traverse(e.getRewardParts());
      break;
    }
    case schema::Request::SAMPLE: {
      auto s = r.getSample();
      mix(uint64_t{s.getCount()});
      mix(uint64_t{s.getTimeoutMillis()});
      break;
    }
    case schema::Request::READ: {
      auto rd = r.getRead();
      mix(rd.getTrajectoryId());
      mix(uint64_t{rd.getFromSeq()});
      mix(uint64_t{rd.getMaxSegments()});
      mix(rd.getMaxBytes());
      break;
    }
    case schema::Request::COMMIT: mix(r.getCommit().getCursor()); break;
    case schema::Request::RESUME: mix(r.getResume().getCursor()); break;
    case schema::Request::UPDATE_PRIORITIES:
      for (auto p : r.getUpdatePriorities()) {
        mix(p.getTrajectoryId());
        mix(p.getPriority());
      }
      break;
    case schema::Request::SET_POLICY_VERSION: mix(uint64_t{r.getSetPolicyVersion()}); break;
    case schema::Request::CHECKPOINT: mix(r.getCheckpoint()); break;
    case schema::Request::STATS: r.getStats(); break;
    default: mix(static_cast<uint64_t>(r.which())); break;  // a member from a newer schema
  }
}

// ---------------------------------------------------------------- input framing
// A copy of a frame in its own heap block that ends exactly where the frame ends.
class Frame {
 public:
  Frame(std::string_view bytes, bool odd)
      : block_(new char[bytes.size() + (odd ? 1 : 0) + (bytes.empty() ? 1 : 0)]) {
    char* p = block_.get() + (odd ? 1 : 0);
    if (!bytes.empty()) std::memcpy(p, bytes.data(), bytes.size());
    view_ = std::string_view(p, bytes.size());
  }
  std::string_view view() const { return view_; }

 private:
  std::unique_ptr<char[]> block_;
  std::string_view view_;
};

struct Input {
  int mode = 0;
  bool stamp = false;
  bool odd = false;
  std::string_view frame1, frame2;
};

Input split(const uint8_t* data, size_t size) {
  Input in;
  if (size == 0) return in;
  in.mode = (data[0] & 0x07) % kNumModes;
  in.stamp = data[0] & 0x40;
  in.odd = data[0] & 0x80;
  const char* p = reinterpret_cast<const char*>(data) + 1;
  size_t left = size - 1;
  size_t len = 0;
  if (left >= 2) {
    len = size_t{static_cast<uint8_t>(p[0])} | (size_t{static_cast<uint8_t>(p[1])} << 8);
    p += 2;
    left -= 2;
  } else {
    p += left;
    left = 0;
  }
  len = std::min(len, left);
  in.frame1 = std::string_view(p, len);
  in.frame2 = std::string_view(p + len, left - len);
  return in;
}

std::string join(uint8_t mode, std::string_view frame1, std::string_view frame2) {
  if (frame1.size() > 0xffff) fail("seed frame 1 over 64 KiB");
  std::string out(1, static_cast<char>(mode));
  out.push_back(static_cast<char>(frame1.size() & 0xff));
  out.push_back(static_cast<char>(frame1.size() >> 8));
  out.append(frame1);
  out.append(frame2);
  return out;
}

// ---------------------------------------------------------------- modes 0-2: decoders
// As ReplayService::handle: the size check, MessageView with the 1 MiB limit, then reads in
// guarded().
void fuzz_request(std::string_view bytes) {
  if (bytes.size() > kMaxRequestFrameBytes) return;
  MessageView view(bytes, kMaxRequestFrameBytes);
  if (!view.ok()) {
    mix(uint64_t(view.status().message().size()));
    return;
  }
  Status st = guarded("request", [&]() -> Status {
    traverse(view.root<schema::Request>());
    return Status::Ok();
  });
  mix(uint64_t(st.ok()));
}

void fuzz_segment(std::string_view bytes) {
  auto stored = stored_self_hash(bytes);
  auto computed = compute_self_hash(bytes);
  if (stored.ok() != computed.ok()) fail("stored_self_hash and compute_self_hash disagree on whether bytes are a message");
  auto both = check_self_hash(bytes);
  if (both.ok() != stored.ok()) fail("check_self_hash and stored_self_hash disagree on whether bytes are a message");
  if (stored.ok() && (both->stored != *stored || both->computed != *computed))
    fail("check_self_hash differs from stored_self_hash/compute_self_hash");
  if (stored.ok()) mix(uint64_t(both->ok()));
  MessageView view(bytes, kMaxSegmentBytes);
  if (!view.ok()) return;
  Status st = guarded("segment", [&]() -> Status {
    auto s = view.root<schema::Segment>();
    Status valid = validate_segment(s);
    mix(uint64_t(valid.ok()));
    traverse(s);
    return Status::Ok();
  });
  mix(uint64_t(st.ok()));
}

void fuzz_record(std::string_view bytes) {
  for (bool verify : {true, false}) {
    auto rec = decode_trajectory(bytes, verify);
    if (!rec.ok()) continue;
    // The owned copy holds whatever pointers the bytes held (setRoot copies them without
    // checking their types), so it is read inside guarded() too. Records the store writes
    // itself must read without throwing: check_on_disk() holds it to that.
    Status st = guarded("decoded record", [&]() -> Status {
      traverse((*rec)->getRoot<schema::Trajectory>().asReader());
      return Status::Ok();
    });
    mix(uint64_t(st.ok()));
  }
  MessageView view(bytes, kMaxRecordBytes);
  if (!view.ok()) return;
  Status st = guarded("trajectory record", [&]() -> Status {
    traverse(view.root<schema::Trajectory>());
    return Status::Ok();
  });
  mix(uint64_t(st.ok()));
}

// ---------------------------------------------------------------- modes 3-4: the store
struct FuzzStore {
  std::string dir;
  std::unique_ptr<TrajectoryStore> store;
  uint64_t inputs = 0;
  uint64_t reopens = 0;
  size_t sampler = 0;  // index into kSamplers
};
FuzzStore* g_store = nullptr;

replay::StoreOptions store_options() {
  replay::StoreOptions o;
  o.dir = g_store->dir;
  o.sync = false;
  o.sampler = kSamplers[g_store->sampler];
  o.max_segment_bytes = kMaxSegmentBytes;
  return o;
}

void open_store() {
  auto s = TrajectoryStore::open(store_options());
  if (!s.ok()) fail("cannot open the fuzz store: " + s.status().to_string());
  g_store->store = std::move(s).value();
}

void begin_fixed_trajectories() {
  for (size_t i = 0; i < kNumBegun; ++i) {
    capnp::MallocMessageBuilder m;
    auto t = m.initRoot<schema::Trajectory>();
    t.setId(kBegunIds[i]);
    t.setJob("fuzz");
    t.initEnvironment().setName("fuzz-env");
    t.setTask("task");
    t.setSeed(i);
    auto out = g_store->store->begin(t.asReader());
    if (!out.ok()) fail("begin in setup: " + out.status().to_string());
  }
  Status st = g_store->store->commit();
  if (!st.ok()) fail("commit in setup: " + st.to_string());
}

void wipe_store() {
  g_store->store.reset();
  g_store->sampler = (g_store->sampler + 1) % (sizeof(kSamplers) / sizeof(kSamplers[0]));
  std::error_code ec;
  fs::remove_all(g_store->dir, ec);
  fs::create_directories(g_store->dir, ec);
  open_store();
  begin_fixed_trajectories();
}

void remove_store_at_exit() {
  if (!g_store) return;
  g_store->store.reset();
  std::error_code ec;
  fs::remove_all(g_store->dir, ec);
}

void setup_store() {
  g_store = new FuzzStore;
  std::string tmpl = (fs::temp_directory_path() / "odyssey-fuzz-store-XXXXXX").string();
  if (!mkdtemp(tmpl.data())) fail("mkdtemp failed");
  g_store->dir = tmpl;
  open_store();
  begin_fixed_trajectories();
  std::atexit(remove_store_at_exit);
}

// The counters that describe what is stored (the rest count events since open).
bool same_stored(const StoreCounters& a, const StoreCounters& b) {
  return a.trajectories == b.trajectories && a.in_flight == b.in_flight && a.complete == b.complete &&
         a.consumed == b.consumed && a.withheld == b.withheld && a.failed == b.failed &&
         a.segments == b.segments && a.bytes == b.bytes;
}
std::string describe(const StoreCounters& c) {
  return fmt::format("trajectories {} (in flight {}, complete {}, consumed {}, withheld {}, failed {}), segments {}, "
                     "bytes {}", c.trajectories, c.in_flight, c.complete, c.consumed, c.withheld, c.failed,
                     c.segments, c.bytes);
}

// What is durable for `id` must be whole: the record counts exactly the stored segments, they
// chain to its lastHash, and an in-flight record holds nothing that only end() may set.
void check_on_disk(uint64_t id) {
  auto& store = *g_store->store;
  auto rec_bytes = store.read_record(id);
  if (!rec_bytes.ok()) {
    if (rec_bytes.status().code() != StatusCode::kNotFound)
      fail("read_record: " + rec_bytes.status().to_string());
    auto segs = store.read_segments(id, 0, 1, UINT64_MAX);
    if (!segs.ok() || !segs->empty()) fail(fmt::format("segments stored for unknown trajectory {:016x}", id));
    return;
  }
  auto rec = decode_trajectory(*rec_bytes);
  if (!rec.ok()) fail("stored record does not decode: " + rec.status().to_string());
  auto t = (*rec)->getRoot<schema::Trajectory>().asReader();
  traverse(t);  // outside guarded(): a record the store wrote must be readable by everyone
  auto segs = store.read_segments(id, 0, UINT32_MAX, UINT64_MAX);
  if (!segs.ok()) fail("read_segments: " + segs.status().to_string());
  if (segs->size() != t.getNumSegments())
    fail(fmt::format("trajectory {:016x}: record says {} segments, {} stored", id, t.getNumSegments(), segs->size()));
  Hash128 prev;
  uint64_t bytes = 0;
  for (const auto& s : *segs) {
    auto stored = stored_self_hash(s);
    auto computed = compute_self_hash(s);
    if (!stored.ok() || !computed.ok() || *stored != *computed)
      fail(fmt::format("trajectory {:016x}: a stored segment fails its self-hash", id));
    MessageView view(s, kMaxSegmentBytes);
    Status st = guarded("stored segment", [&]() -> Status {
      auto seg = view.root<schema::Segment>();
      if (Hash128{seg.getPrevHashLo(), seg.getPrevHashHi()} != prev)
        return Status(StatusCode::kCorrupt, "chain broken");
      return validate_segment(seg);
    });
    if (!view.ok() || !st.ok()) fail(fmt::format("trajectory {:016x}: stored segment: {}", id, st.to_string()));
    prev = *computed;
    bytes += s.size();
  }
  if (prev != Hash128{t.getLastHashLo(), t.getLastHashHi()})
    fail(fmt::format("trajectory {:016x}: lastHash {} but the stored chain ends at {}", id,
                     Hash128{t.getLastHashLo(), t.getLastHashHi()}.hex(), prev.hex()));
  if (bytes != t.getNumBytes())
    fail(fmt::format("trajectory {:016x}: record says {} bytes, {} stored", id, t.getNumBytes(), bytes));
  if (t.getStatus() == schema::TrajectoryStatus::IN_FLIGHT &&
      (t.getRewardTotal() != 0 || t.getRewardParts().size() != 0 || t.getEndedUnixNanos() != 0 ||
       t.getReadySeq() != 0))
    fail(fmt::format("trajectory {:016x}: in flight on disk but carries end() fields (reward {}, readySeq {})", id,
                     t.getRewardTotal(), t.getReadySeq()));
}

// Restart check: what is durable rebuilds the same counters.
void maybe_reopen() {
  if (++g_store->inputs % kReopenEvery != 0) return;
  const StoreCounters before = g_store->store->counters();
  g_store->store.reset();
  open_store();
  const StoreCounters after = g_store->store->counters();
  if (!same_stored(before, after))
    fail("reopen changed the counters: before " + describe(before) + "; after " + describe(after));
  if (++g_store->reopens % kWipeEvery == 0 || after.trajectories > kResetTrajectories ||
      after.segments > kResetSegments)
    wipe_store();
}

std::string stamped(std::string_view bytes) {
  std::string s(bytes);
  Status st = stamp_self_hash(s);  // leaves the bytes alone when they are not a stampable message
  (void)st;
  return s;
}

struct Outcome {
  bool ran = false;       // an operation was attempted
  bool ok = false;
  bool new_segment = false;
  std::string error;      // why it was rejected (for ODYSSEY_FUZZ_VERBOSE)
  std::vector<std::string> sampled;  // records a sample delivered
  std::vector<uint64_t> touched;
};
bool g_verbose = false;  // ODYSSEY_FUZZ_VERBOSE=1: print each store operation's outcome

// Mode 3: (trajectory id, seq, bytes) straight into append().
Outcome store_append(std::string_view header, std::string_view segment) {
  Outcome o;
  if (header.size() < 5) return o;
  const uint64_t id = kBegunIds[static_cast<uint8_t>(header[0]) % kNumBegun];
  uint32_t seq;
  std::memcpy(&seq, header.data() + 1, 4);
  o.ran = true;
  o.touched.push_back(id);
  auto r = g_store->store->append(id, seq, segment);
  o.ok = r.ok();
  if (!r.ok()) o.error = r.status().to_string();
  o.new_segment = r.ok() && *r == WriteOutcome::kStored;
  return o;
}

// Mode 4: the request handling of ReplayService::handle against the store, minus the socket.
Outcome store_request(std::string_view request, std::string_view segment) {
  Outcome o;
  if (request.size() > kMaxRequestFrameBytes) return o;
  MessageView view(request, kMaxRequestFrameBytes);
  if (!view.ok()) return o;
  auto& store = *g_store->store;
  o.ran = true;
  Status st = guarded("request", [&]() -> Status {
    auto req = view.root<schema::Request>();
    switch (req.which()) {
      case schema::Request::HELLO:
        mix(req.getHello().getClient());
        return Status::Ok();
      case schema::Request::BEGIN: {
        auto b = req.getBegin();
        o.touched.push_back(b.getId());
        if (!store.can_insert()) return Status(StatusCode::kTimeout, "rate limited: " + store.insert_blocked_reason());
        ODY_ASSIGN_OR_RETURN(auto outcome, store.begin(b));
        (void)outcome;
        return Status::Ok();
      }
      case schema::Request::APPEND: {
        auto a = req.getAppend();
        o.touched.push_back(a.getTrajectoryId());
        ODY_ASSIGN_OR_RETURN(auto outcome, store.append(a.getTrajectoryId(), a.getSeq(), segment));
        o.new_segment = outcome == WriteOutcome::kStored;
        return Status::Ok();
      }
      case schema::Request::END: {
        auto e = req.getEnd();
        o.touched.push_back(e.getTrajectoryId());
        ODY_ASSIGN_OR_RETURN(auto outcome, store.end(e));
        (void)outcome;
        return Status::Ok();
      }
      case schema::Request::SAMPLE: {
        auto s = req.getSample();
        if (s.getCount() == 0) return invalid_argument("sample: count must be at least 1");
        ODY_ASSIGN_OR_RETURN(auto result, store.sample(std::min<uint32_t>(s.getCount(), 64)));
        o.sampled = std::move(result.records);
        return Status::Ok();
      }
      case schema::Request::READ: {
        auto rd = req.getRead();
        o.touched.push_back(rd.getTrajectoryId());
        ODY_ASSIGN_OR_RETURN(auto segs, store.read_segments(rd.getTrajectoryId(), rd.getFromSeq(),
                                                            rd.getMaxSegments() ? rd.getMaxSegments() : 64,
                                                            rd.getMaxBytes() ? rd.getMaxBytes() : (16ull << 20)));
        mix(uint64_t{segs.size()});
        return Status::Ok();
      }
      case schema::Request::COMMIT: return store.commit_deliveries(req.getCommit().getCursor());
      case schema::Request::RESUME: return store.resume(req.getResume().getCursor());
      case schema::Request::UPDATE_PRIORITIES:
        for (auto p : req.getUpdatePriorities()) {
          o.touched.push_back(p.getTrajectoryId());
          ODY_RETURN_IF_ERROR(store.update_priority(p.getTrajectoryId(), p.getPriority()));
        }
        return Status::Ok();
      case schema::Request::SET_POLICY_VERSION: return store.set_policy_version(req.getSetPolicyVersion());
      case schema::Request::CHECKPOINT:  // writes directories named by the client: not fuzzed here
        mix(req.getCheckpoint());
        return Status::Ok();
      case schema::Request::STATS: mix(store.counters().segments); return Status::Ok();
      default:
        return Status(StatusCode::kFailedPrecondition, "unknown request kind");
    }
  });
  o.ok = st.ok();
  o.error = st.to_string();
  for (const auto& r : o.sampled) {  // outside guarded(), as check_on_disk()
    auto rec = decode_trajectory(r, /*verify_hash=*/true);
    if (!rec.ok()) fail("sample returned a record that does not decode: " + rec.status().to_string());
    traverse((*rec)->getRoot<schema::Trajectory>().asReader());
  }
  if (o.touched.size() > 8) o.touched.resize(8);
  return o;
}

void fuzz_store(const Input& in) {
  std::string owned;
  std::string_view segment = in.frame2;
  if (in.stamp) {
    owned = stamped(segment);
    segment = owned;
  }
  Frame f1(in.frame1, in.odd), f2(segment, in.odd);
  auto& store = *g_store->store;
  const StoreCounters before = store.counters();
  Outcome o = in.mode == 3 ? store_append(f1.view(), f2.view()) : store_request(f1.view(), f2.view());
  if (!o.ran) return;
  Status committed = store.commit();  // as the service's flush_writes: whatever is staged becomes durable
  if (!committed.ok()) fail("commit: " + committed.to_string());
  const StoreCounters after = store.counters();
  if (g_verbose)
    std::fprintf(stderr, "mode %d: %s%s; %s\n", in.mode, o.ok ? "ok" : o.error.c_str(),
                 o.new_segment ? " (new segment)" : "", describe(after).c_str());
  if (!o.ok && !same_stored(before, after))
    fail("a rejected operation changed the store: before " + describe(before) + "; after " + describe(after) +
         "; it was rejected with: " + o.error);
  // Only a stored append adds a segment, exactly one (no retention is configured here).
  if (after.segments != before.segments + (o.new_segment ? 1 : 0))
    fail(fmt::format("{}: segments {} -> {}", o.new_segment ? "a stored append" : "an operation that stored none",
                     before.segments, after.segments));
  for (uint64_t id : o.touched) check_on_disk(id);
  maybe_reopen();
}

// ---------------------------------------------------------------- seeds
std::string flat(capnp::MessageBuilder& m) {
  auto words = capnp::messageToFlatArray(m);
  auto bytes = words.asBytes();
  return std::string(reinterpret_cast<const char*>(bytes.begin()), bytes.size());
}

SegmentData seed_segment_data(bool rich) {
  SegmentData d;
  const size_t n = rich ? 24 : 8;
  for (size_t i = 0; i < n; ++i) {
    d.tokens.push_back(static_cast<uint32_t>(100 + i));
    d.logprobs.push_back(-0.5f * static_cast<float>(i % 3));
    d.policy_versions.push_back(1);
    d.loss_mask.push_back(static_cast<uint8_t>(i % 2));
  }
  d.turns.push_back({schema::Role::USER, 0, static_cast<uint32_t>(n / 2), false});
  d.turns.push_back({schema::Role::ASSISTANT, static_cast<uint32_t>(n / 2), static_cast<uint32_t>(n - n / 2), false});
  d.created_unix_nanos = 1700000000000000000;
  if (rich) {
    ToolCallData c;
    c.call_id = "call-1";
    c.name = "python";
    c.arguments = "{\"code\": \"print(1)\"}";
    c.result = "1\n";
    c.wall_time_nanos = 12345;
    c.call_token_start = 4;
    c.result_token_start = 8;
    d.tool_calls.push_back(c);
    ImageData im;
    im.token_offset = 2;
    im.num_patch_tokens = 4;
    im.width = 2;
    im.height = 2;
    im.media_type = "image/png";
    im.data = std::string("\x89PNG\r\n\x1a\n", 8);
    d.images.push_back(im);
    RoutedExpertsData re;
    re.num_layers = 2;
    re.top_k = 1;
    for (size_t i = 0; i < n * 2; ++i) re.experts.push_back(static_cast<uint16_t>(i % 8));
    d.routed_experts = re;
    StateSnapshotData sn;
    sn.token_position = n;
    sn.policy_version = 1;
    sn.format = "odyssey.model.state/1";
    sn.data = "state";
    d.state_snapshots.push_back(sn);
  }
  return d;
}

std::string seed_segment(uint64_t id, uint32_t seq, Hash128 prev, uint64_t token_start, bool rich) {
  auto enc = encode_segment(SegmentPosition{id, seq, token_start, prev}, seed_segment_data(rich));
  if (!enc.ok()) fail("seed segment: " + enc.status().to_string());
  return enc->bytes;
}

template <typename Fill>
std::string request(uint64_t id, Fill fill) {
  capnp::MallocMessageBuilder m;
  auto r = m.initRoot<schema::Request>();
  r.setId(id);
  fill(r);
  return flat(m);
}

void fill_identity(schema::Trajectory::Builder t, uint64_t id) {
  t.setId(id);
  t.setJob("seed-job");
  auto env = t.initEnvironment();
  env.setName("seed-env");
  env.setVersion("1");
  env.setPluginHash("abc123");
  t.setTask("task-7");
  t.setSeed(7);
  t.setGroupId(9);
  t.setGroupSize(1);
  t.setTokenizer("byte");
  t.setWriter("actor-0");
  t.setPriority(1.0);
}

void write_seeds(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail("cannot create " + dir + ": " + ec.message());
  int count = 0;
  auto put = [&](const std::string& name, const std::string& bytes) {
    std::ofstream f(fs::path(dir) / name, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!f) fail("cannot write seed " + name);
    ++count;
  };
  constexpr uint64_t kNewId = 0x5eed000000000001;  // begun by the service-mode seeds
  const std::string seg0 = seed_segment(kNewId, 0, Hash128{}, 0, /*rich=*/true);
  const std::string seg1_fixed = seed_segment(kBegunIds[0], 0, Hash128{}, 0, /*rich=*/false);
  auto seg0_hash = stored_self_hash(seg0);
  if (!seg0_hash.ok()) fail("seed hash");

  const std::string hello = request(1, [](auto r) {
    auto h = r.initHello();
    h.setClient("seed-writer");
    h.setProtocolVersion(schema::PROTOCOL_VERSION);
  });
  const std::string begin = request(2, [&](auto r) { fill_identity(r.initBegin(), kNewId); });
  const std::string append = request(3, [&](auto r) {
    auto a = r.initAppend();
    a.setTrajectoryId(kNewId);
    a.setSeq(0);
  });
  const std::string end = request(4, [&](auto r) {
    auto e = r.initEnd();
    e.setTrajectoryId(kNewId);
    e.setNumSegments(1);
    e.setLastHashLo(seg0_hash->lo);
    e.setLastHashHi(seg0_hash->hi);
    e.setRewardTotal(1.5);
    auto parts = e.initRewardParts(2);
    parts[0].setName("correct");
    parts[0].setValue(1.0);
    parts[1].setName("format");
    parts[1].setValue(0.5);
  });
  const std::string end_fixed = request(5, [&](auto r) {
    auto e = r.initEnd();
    e.setTrajectoryId(kBegunIds[1]);
    e.setNumSegments(0);
    e.setFailed(true);
    e.setError("env crashed");
  });
  const std::string sample = request(6, [](auto r) {
    auto s = r.initSample();
    s.setCount(1);
    s.setTimeoutMillis(0);
  });
  const std::string read = request(7, [&](auto r) {
    auto rd = r.initRead();
    rd.setTrajectoryId(kNewId);
    rd.setMaxSegments(4);
  });
  const std::string commit = request(8, [](auto r) { r.initCommit().setCursor(1); });
  const std::string resume = request(9, [](auto r) { r.initResume().setCursor(0); });
  const std::string priorities = request(10, [&](auto r) {
    auto l = r.initUpdatePriorities(2);
    l[0].setTrajectoryId(kNewId);
    l[0].setPriority(2.0);
    l[1].setTrajectoryId(kBegunIds[2]);
    l[1].setPriority(0.5);
  });
  const std::string policy = request(11, [](auto r) { r.setSetPolicyVersion(3); });
  const std::string checkpoint = request(12, [](auto r) { r.setCheckpoint("/nonexistent/ckpt"); });
  const std::string stats = request(13, [](auto r) { r.setStats(); });

  capnp::MallocMessageBuilder record_message;
  {
    auto t = record_message.initRoot<schema::Trajectory>();
    fill_identity(t, kNewId);
    t.setStatus(schema::TrajectoryStatus::COMPLETE);
    t.setRewardTotal(1.5);
    auto parts = t.initRewardParts(1);
    parts[0].setName("correct");
    parts[0].setValue(1.5);
    t.setError("");
    t.setNumSegments(1);
    t.setNumTokens(24);
    t.setNumBytes(seg0.size());
    t.setLastHashLo(seg0_hash->lo);
    t.setLastHashHi(seg0_hash->hi);
    t.setMinPolicyVersion(1);
    t.setMaxPolicyVersion(1);
    t.setStartedUnixNanos(1700000000000000000);
    t.setEndedUnixNanos(1700000001000000000);
    t.setReadySeq(1);
    t.setTimesSampled(0);
  }
  const std::string record = encode_trajectory(record_message);

  // Mode 0: every request kind.
  const std::pair<const char*, const std::string*> requests[] = {
      {"hello", &hello}, {"begin", &begin}, {"append", &append}, {"end", &end}, {"end-failed", &end_fixed},
      {"sample", &sample}, {"read", &read}, {"commit", &commit}, {"resume", &resume},
      {"priorities", &priorities}, {"policy", &policy}, {"checkpoint", &checkpoint}, {"stats", &stats}};
  for (const auto& [name, bytes] : requests) put(std::string("request-") + name, join(0, *bytes, ""));
  // Mode 1: a segment with every optional part, and a plain one.
  put("segment-rich", join(1, "", seg0));
  put("segment-plain", join(1, "", seg1_fixed));
  // Mode 2: a trajectory record.
  put("record", join(2, "", record));
  // Mode 3: the first segment of a trajectory begun at start, and the same again stamped.
  const std::string header0("\0\0\0\0\0", 5);
  put("append-fixed", join(3, header0, seg1_fixed));
  put("append-fixed-stamped", join(3 | 0x40, header0, seg1_fixed));
  // Mode 4: a writer's whole life through the service path, then the reader's requests.
  put("service-begin", join(4, begin, ""));
  put("service-append", join(4, append, seg0));
  put("service-append-stamped-odd", join(4 | 0x40 | 0x80, append, seg0));
  put("service-end", join(4, end, ""));
  put("service-end-failed", join(4, end_fixed, ""));
  for (const auto& [name, bytes] : requests)
    if (std::string_view(name).find("end") != 0 && std::string_view(name) != "begin" &&
        std::string_view(name) != "append")
      put(std::string("service-") + name, join(4, *bytes, ""));
  std::fprintf(stderr, "replay_messages_fuzz: wrote %d seeds to %s\n", count, dir.c_str());
}

}  // namespace
}  // namespace odyssey::fuzz

// glibc's list of thread_local destructors, allocated by a RocksDB background thread, is
// reported as leaked while that thread lives (rocksdb issue 5931); nothing of ours is hidden.
extern "C" const char* __lsan_default_suppressions() { return "leak:__cxa_thread_atexit_impl\n"; }

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  using namespace odyssey::fuzz;
  spdlog::set_level(spdlog::level::off);  // the store logs rejected input; libFuzzer's output is the report
  if (const char* dir = std::getenv("ODYSSEY_FUZZ_WRITE_SEEDS")) {
    write_seeds(dir);
    std::exit(0);
  }
  g_verbose = std::getenv("ODYSSEY_FUZZ_VERBOSE") != nullptr;
  setup_store();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace odyssey::fuzz;
  const Input in = split(data, size);
  switch (in.mode) {
    case 0: {
      Frame f(in.frame1, in.odd);
      fuzz_request(f.view());
      break;
    }
    case 1: {
      Frame f(in.frame2, in.odd);
      fuzz_segment(f.view());
      break;
    }
    case 2: {
      Frame f(in.frame2, in.odd);
      fuzz_record(f.view());
      break;
    }
    default:
      fuzz_store(in);
      break;
  }
  return 0;
}
