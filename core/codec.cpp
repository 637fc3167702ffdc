#include "core/codec.h"

#include <chrono>
#include <cstring>

#include <capnp/any.h>
#include <kj/exception.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace odyssey {

std::string Hash128::hex() const { return fmt::format("{:016x}{:016x}", hi, lo); }

std::string format_trajectory_id(uint64_t id) { return fmt::format("{:016x}", id); }

Result<uint64_t> parse_trajectory_id(std::string_view text) {
  std::string_view t = text;
  if (t.size() > 2 && t[0] == '0' && (t[1] == 'x' || t[1] == 'X')) t.remove_prefix(2);
  if (t.empty() || t.size() > 16)
    return invalid_argument("trajectory id '{}' is not 1-16 hex digits (as `odyssey traj ls` prints)", text);
  uint64_t v = 0;
  for (char c : t) {
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
    else return invalid_argument("trajectory id '{}' has a non-hex character '{}'", text, c);
    v = (v << 4) | static_cast<uint64_t>(d);
  }
  return v;
}

capnp::ReaderOptions reader_options(uint64_t max_bytes) {
  capnp::ReaderOptions o;
  o.traversalLimitInWords = max_bytes / sizeof(capnp::word) + 1024;
  o.nestingLimit = 32;
  return o;
}

MessageView::MessageView(std::string_view bytes, uint64_t max_bytes) : bytes_(bytes) {
  if (bytes.size() < 16 || bytes.size() % sizeof(capnp::word) != 0) {
    status_ = invalid_argument("message of {} bytes is not a flat Cap'n Proto message "
                               "(needs a multiple of 8 bytes, at least 16)", bytes.size());
    return;
  }
  if (bytes.size() > max_bytes) {
    status_ = Status(StatusCode::kResourceExhausted,
                     fmt::format("message of {} bytes exceeds the limit of {}", bytes.size(), max_bytes));
    return;
  }
  const size_t words = bytes.size() / sizeof(capnp::word);
  kj::ArrayPtr<const capnp::word> view;
  if (reinterpret_cast<uintptr_t>(bytes.data()) % alignof(capnp::word) == 0) {
    view = kj::ArrayPtr<const capnp::word>(reinterpret_cast<const capnp::word*>(bytes.data()), words);
  } else {
    copy_ = kj::heapArray<capnp::word>(words);
    std::memcpy(copy_.begin(), bytes.data(), bytes.size());
    view = copy_.asPtr();
  }
  try {
    // The segment table must describe exactly the bytes we have (no trailing garbage).
    uint32_t nseg;
    std::memcpy(&nseg, bytes.data(), 4);
    if (nseg >= 512) {
      status_ = invalid_argument("message claims {} segments", uint64_t{nseg} + 1);
      return;
    }
    // Bound the work a reader may do by the message's own size (a few passes over it), not by
    // the largest message allowed: a tiny frame claiming huge lists of empty elements must
    // not cost milliseconds.
    const uint64_t budget = std::min<uint64_t>(max_bytes, bytes.size() * 8 + 8192);
    reader_ = std::make_unique<capnp::FlatArrayMessageReader>(view, reader_options(budget));
    if (reader_->getEnd() != view.end()) {
      status_ = invalid_argument("message has {} trailing bytes after its last segment",
                                 (view.end() - reader_->getEnd()) * sizeof(capnp::word));
      reader_.reset();
    }
  } catch (const kj::Exception& e) {
    status_ = invalid_argument("malformed Cap'n Proto message: {}", e.getDescription().cStr());
    reader_.reset();
  }
}

namespace {

// Byte offset of the root struct's data section inside `bytes`, read straight from the
// encoding (segment table, then the root struct pointer) without building a reader: a
// single segment whose table matches the byte count, a struct root pointer, and at least
// two data words that lie inside the segment.
Result<size_t> hash_words_offset(std::string_view bytes) {
  if (bytes.size() < 24 || bytes.size() % 8 != 0)
    return invalid_argument("message of {} bytes is too short or not whole words", bytes.size());
  uint32_t nseg, words;
  std::memcpy(&nseg, bytes.data(), 4);
  std::memcpy(&words, bytes.data() + 4, 4);
  if (nseg != 0) return invalid_argument("hashed messages must be a single segment, got {}", uint64_t{nseg} + 1);
  if (uint64_t{words} * 8 + 8 != bytes.size())
    return invalid_argument("segment table says {} bytes, message has {}", uint64_t{words} * 8, bytes.size() - 8);
  uint64_t ptr;
  std::memcpy(&ptr, bytes.data() + 8, 8);
  if ((ptr & 3) != 0) return invalid_argument("root pointer is not a struct pointer");
  const int64_t offset_words = static_cast<int32_t>(static_cast<uint32_t>(ptr)) >> 2;
  const uint64_t data_words = (ptr >> 32) & 0xffff;
  const int64_t start = 16 + offset_words * 8;  // root pointer sits at byte 8; offsets count from its end
  if (data_words < 2) return invalid_argument("root struct has no hash words ({} data words)", data_words);
  if (start < 16 || static_cast<uint64_t>(start) + 16 > bytes.size())
    return invalid_argument("root struct lies outside the message");
  return static_cast<size_t>(start);
}

Hash128 hash_with_zeroed(std::string_view bytes, size_t offset) {
  XXH3_state_t state;
  XXH3_128bits_reset(&state);
  XXH3_128bits_update(&state, bytes.data(), offset);
  static const char zeros[16] = {};
  XXH3_128bits_update(&state, zeros, 16);
  XXH3_128bits_update(&state, bytes.data() + offset + 16, bytes.size() - offset - 16);
  XXH128_hash_t h = XXH3_128bits_digest(&state);
  return Hash128{h.low64, h.high64};
}

}  // namespace

Result<Hash128> compute_self_hash(std::string_view bytes) {
  ODY_ASSIGN_OR_RETURN(size_t off, hash_words_offset(bytes));
  return hash_with_zeroed(bytes, off);
}

Result<Hash128> stored_self_hash(std::string_view bytes) {
  ODY_ASSIGN_OR_RETURN(size_t off, hash_words_offset(bytes));
  Hash128 h;
  std::memcpy(&h.lo, bytes.data() + off, 8);  // Cap'n Proto data is little-endian
  std::memcpy(&h.hi, bytes.data() + off + 8, 8);
  return h;
}

Result<SelfHash> check_self_hash(std::string_view bytes) {
  ODY_ASSIGN_OR_RETURN(size_t off, hash_words_offset(bytes));
  SelfHash h;
  std::memcpy(&h.stored.lo, bytes.data() + off, 8);
  std::memcpy(&h.stored.hi, bytes.data() + off + 8, 8);
  h.computed = hash_with_zeroed(bytes, off);
  return h;
}

Status stamp_self_hash(std::string& bytes) {
  ODY_ASSIGN_OR_RETURN(size_t off, hash_words_offset(bytes));
  Hash128 h = hash_with_zeroed(bytes, off);
  std::memcpy(bytes.data() + off, &h.lo, 8);
  std::memcpy(bytes.data() + off + 8, &h.hi, 8);
  return Status::Ok();
}

Status guarded(const char* what, const std::function<Status()>& fn) {
  try {
    return fn();
  } catch (const kj::Exception& e) {
    return invalid_argument("{}: malformed Cap'n Proto data: {}", what, e.getDescription().cStr());
  }
}

namespace {

// Flattens a builder into one segment (so the hash words sit at a fixed place).
std::string flatten_single_segment(capnp::MallocMessageBuilder& message) {
  auto segments = message.getSegmentsForOutput();
  if (segments.size() == 1) {
    // Segment table (count - 1 = 0, size in words), then the segment: one copy.
    const auto seg = segments[0];
    std::string out(8 + seg.size() * sizeof(capnp::word), '\0');
    const uint32_t table[2] = {0, static_cast<uint32_t>(seg.size())};
    std::memcpy(out.data(), table, 8);
    std::memcpy(out.data() + 8, seg.begin(), seg.size() * sizeof(capnp::word));
    return out;
  }
  size_t words = 0;
  for (auto s : segments) words += s.size();
  capnp::MallocMessageBuilder single(static_cast<unsigned>(words + 16), capnp::AllocationStrategy::FIXED_SIZE);
  single.getRoot<capnp::AnyPointer>().set(message.getRoot<capnp::AnyPointer>().asReader());
  return flatten_single_segment(single);
}

// Writable bytes of a freshly initialised list of primitives (little-endian, contiguous).
template <typename ListBuilder>
void copy_into(ListBuilder list, const void* src, size_t bytes) {
  if (bytes == 0) return;
  auto raw = capnp::AnyList::Reader(list.asReader()).getRawBytes();
  std::memcpy(const_cast<kj::byte*>(raw.begin()), src, bytes);
}

size_t estimate_words(const SegmentData& d) {
  size_t bytes = 1024 + d.tokens.size() * 14;
  for (const auto& c : d.tool_calls)
    bytes += 128 + c.call_id.size() + c.name.size() + c.arguments.size() + c.result.size() + c.error.size();
  for (const auto& i : d.images) bytes += 96 + i.media_type.size() + i.data.size();
  for (const auto& s : d.state_snapshots) bytes += 64 + s.format.size() + s.data.size();
  if (d.routed_experts) bytes += 32 + d.routed_experts->experts.size() * 2;
  bytes += d.turns.size() * 16;
  return bytes / 8 + 64;
}

}  // namespace

Result<EncodedSegment> encode_segment(const SegmentPosition& pos, const SegmentData& d) {
  const size_t n = d.tokens.size();
  if (d.logprobs.size() != n || d.policy_versions.size() != n || d.loss_mask.size() != n) {
    return invalid_argument("segment {}/{}: per-token fields differ in length: tokens {}, logprobs {}, "
                            "policy_versions {}, loss_mask {}", format_trajectory_id(pos.trajectory_id),
                            pos.seq, n, d.logprobs.size(), d.policy_versions.size(), d.loss_mask.size());
  }
  capnp::MallocMessageBuilder message(static_cast<unsigned>(estimate_words(d)));
  auto s = message.initRoot<schema::Segment>();
  s.setTrajectoryId(pos.trajectory_id);
  s.setSeq(pos.seq);
  s.setPrevHashLo(pos.prev_hash.lo);
  s.setPrevHashHi(pos.prev_hash.hi);
  s.setTokenStart(pos.token_start);
  s.setCreatedUnixNanos(d.created_unix_nanos ? d.created_unix_nanos : unix_nanos_now());
  {
    static_assert(sizeof(float) == 4, "logprobs are Float32");
    copy_into(s.initTokens(static_cast<unsigned>(n)), d.tokens.data(), n * 4);
    copy_into(s.initLogprobs(static_cast<unsigned>(n)), d.logprobs.data(), n * 4);
    copy_into(s.initPolicyVersions(static_cast<unsigned>(n)), d.policy_versions.data(), n * 4);
    auto m = s.initLossMask(static_cast<unsigned>(n));
    if (n) std::memcpy(m.begin(), d.loss_mask.data(), n);
  }
  auto turns = s.initTurns(static_cast<unsigned>(d.turns.size()));
  for (size_t i = 0; i < d.turns.size(); ++i) {
    turns[i].setRole(d.turns[i].role);
    turns[i].setStart(d.turns[i].start);
    turns[i].setLength(d.turns[i].length);
    turns[i].setContinued(d.turns[i].continued);
  }
  auto calls = s.initToolCalls(static_cast<unsigned>(d.tool_calls.size()));
  for (size_t i = 0; i < d.tool_calls.size(); ++i) {
    const auto& c = d.tool_calls[i];
    calls[i].setCallId(c.call_id);
    calls[i].setName(c.name);
    calls[i].setArguments(c.arguments);
    calls[i].setResult(kj::arrayPtr(reinterpret_cast<const kj::byte*>(c.result.data()), c.result.size()));
    calls[i].setStatus(c.status);
    calls[i].setError(c.error);
    calls[i].setWallTimeNanos(c.wall_time_nanos);
    calls[i].setCallTokenStart(c.call_token_start);
    calls[i].setResultTokenStart(c.result_token_start);
  }
  auto images = s.initImages(static_cast<unsigned>(d.images.size()));
  for (size_t i = 0; i < d.images.size(); ++i) {
    const auto& im = d.images[i];
    images[i].setTokenOffset(im.token_offset);
    images[i].setNumPatchTokens(im.num_patch_tokens);
    images[i].setMediaType(im.media_type);
    images[i].setWidth(im.width);
    images[i].setHeight(im.height);
    images[i].setData(kj::arrayPtr(reinterpret_cast<const kj::byte*>(im.data.data()), im.data.size()));
  }
  if (d.routed_experts) {
    auto re = s.initRoutedExperts();
    re.setNumLayers(d.routed_experts->num_layers);
    re.setTopK(d.routed_experts->top_k);
    auto e = re.initExperts(static_cast<unsigned>(d.routed_experts->experts.size()));
    for (size_t i = 0; i < d.routed_experts->experts.size(); ++i) e.set(i, d.routed_experts->experts[i]);
  }
  auto snaps = s.initStateSnapshots(static_cast<unsigned>(d.state_snapshots.size()));
  for (size_t i = 0; i < d.state_snapshots.size(); ++i) {
    const auto& sn = d.state_snapshots[i];
    snaps[i].setTokenPosition(sn.token_position);
    snaps[i].setPolicyVersion(sn.policy_version);
    snaps[i].setFormat(sn.format);
    snaps[i].setData(kj::arrayPtr(reinterpret_cast<const kj::byte*>(sn.data.data()), sn.data.size()));
  }
  ODY_RETURN_IF_ERROR(validate_segment(s.asReader())
                          .with_context(fmt::format("segment {}/{}", format_trajectory_id(pos.trajectory_id), pos.seq)));
  EncodedSegment out;
  out.bytes = flatten_single_segment(message);
  ODY_ASSIGN_OR_RETURN(size_t off, hash_words_offset(out.bytes));
  out.hash = hash_with_zeroed(out.bytes, off);
  std::memcpy(out.bytes.data() + off, &out.hash.lo, 8);
  std::memcpy(out.bytes.data() + off + 8, &out.hash.hi, 8);
  return out;
}

Status validate_segment(schema::Segment::Reader s) {
  return guarded("segment", [&]() -> Status {
    const uint64_t n = s.getTokens().size();
    if (s.getLogprobs().size() != n)
      return invalid_argument("field 'logprobs' has {} entries, 'tokens' has {}", s.getLogprobs().size(), n);
    if (s.getPolicyVersions().size() != n)
      return invalid_argument("field 'policyVersions' has {} entries, 'tokens' has {}", s.getPolicyVersions().size(), n);
    auto mask = s.getLossMask();
    if (mask.size() != n) return invalid_argument("field 'lossMask' has {} entries, 'tokens' has {}", mask.size(), n);
    for (size_t i = 0; i < mask.size(); ++i)
      if (mask[i] > 1) return invalid_argument("field 'lossMask'[{}] is {}, must be 0 or 1", i, int(mask[i]));
    auto turns = s.getTurns();
    for (unsigned i = 0; i < turns.size(); ++i) {
      uint64_t end = uint64_t{turns[i].getStart()} + turns[i].getLength();
      if (end > n) return invalid_argument("field 'turns'[{}] ends at token {}, past the segment's {}", i, end, n);
    }
    auto calls = s.getToolCalls();
    for (unsigned i = 0; i < calls.size(); ++i) {
      if (calls[i].getCallTokenStart() > n || calls[i].getResultTokenStart() > n)
        return invalid_argument("field 'toolCalls'[{}] points past the segment's {} tokens", i, n);
    }
    auto images = s.getImages();
    for (unsigned i = 0; i < images.size(); ++i) {
      if (images[i].getTokenOffset() > n)
        return invalid_argument("field 'images'[{}].tokenOffset {} is past the segment's {} tokens", i,
                                images[i].getTokenOffset(), n);
    }
    if (s.hasRoutedExperts()) {
      auto re = s.getRoutedExperts();
      uint64_t want = n * re.getNumLayers() * re.getTopK();
      if (re.getExperts().size() != want)
        return invalid_argument("field 'routedExperts.experts' has {} entries, expected tokens*numLayers*topK = {}",
                                re.getExperts().size(), want);
    }
    return Status::Ok();
  });
}

std::string encode_trajectory(capnp::MallocMessageBuilder& message) {
  std::string bytes = flatten_single_segment(message);
  Status st = stamp_self_hash(bytes);
  assert(st.ok());
  (void)st;
  return bytes;
}

Result<std::unique_ptr<capnp::MallocMessageBuilder>> decode_trajectory(std::string_view bytes, bool verify_hash) {
  if (verify_hash) {
    ODY_ASSIGN_OR_RETURN(Hash128 want, stored_self_hash(bytes));
    ODY_ASSIGN_OR_RETURN(Hash128 got, compute_self_hash(bytes));
    if (want != got)
      return Status(StatusCode::kCorrupt,
                    fmt::format("trajectory record hash mismatch (stored {}, computed {})", want.hex(), got.hex()));
  }
  MessageView view(bytes, uint64_t{64} << 20);
  if (!view.ok()) return view.status();
  auto out = std::make_unique<capnp::MallocMessageBuilder>();
  ODY_RETURN_IF_ERROR(guarded("trajectory record", [&]() -> Status {
    out->setRoot(view.root<schema::Trajectory>());
    return Status::Ok();
  }));
  return out;
}

int64_t unix_nanos_now() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace odyssey
