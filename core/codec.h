// Trajectory messages in and out of bytes: building segments, the 128-bit integrity hash
// that chains them, validation, and zero-copy reading of stored or received bytes.
//
// A segment's hash (schema: core/schema/trajectory.capnp) is XXH3-128 over its flat
// single-segment Cap'n Proto bytes, with the 16 bytes of the root struct's hash words read
// as zero. It covers every stored byte, padding included, so one flipped bit anywhere is
// detected and attributed to the exact value it sits in. XXH3 detects corruption, not
// tampering by an adversary who can rewrite the whole chain.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <capnp/message.h>
#include <capnp/serialize.h>

#include "core/schema/trajectory.capnp.h"
#include "core/status.h"

namespace odyssey {

struct Hash128 {
  uint64_t lo = 0;
  uint64_t hi = 0;
  bool operator==(const Hash128& o) const { return lo == o.lo && hi == o.hi; }
  bool operator!=(const Hash128& o) const { return !(*this == o); }
  bool is_zero() const { return lo == 0 && hi == 0; }
  std::string hex() const;  // 32 hex digits, hi first
};

// Trajectory ids print as 16 hex digits; parse accepts that form (with optional 0x).
std::string format_trajectory_id(uint64_t id);
Result<uint64_t> parse_trajectory_id(std::string_view text);

// Reading limits for untrusted bytes (network, disk). Traversal is bounded so a hostile
// message cannot make a reader walk more than `max_bytes`.
capnp::ReaderOptions reader_options(uint64_t max_bytes);

// A read-only view of a flat message. Zero-copy when `bytes` is 8-byte aligned, otherwise
// one aligned copy. Construction validates the segment table; `ok()` says whether it did.
class MessageView {
 public:
  MessageView(std::string_view bytes, uint64_t max_bytes = uint64_t{1} << 32);
  const Status& status() const { return status_; }
  bool ok() const { return status_.ok(); }
  // Root as T (throws kj::Exception on malformed pointers: call inside guarded()).
  template <typename T>
  typename T::Reader root() { return reader_->getRoot<T>(); }
  std::string_view bytes() const { return bytes_; }

 private:
  std::string_view bytes_;
  kj::Array<capnp::word> copy_;
  std::unique_ptr<capnp::FlatArrayMessageReader> reader_;
  Status status_;
};

// Self-hash of a flat message whose root struct keeps its hash in data words 0 and 1.
// Reads the encoding directly (no alignment needed): a single segment with a struct root.
Result<Hash128> compute_self_hash(std::string_view bytes);
// Both at once, reading the encoding once: what the message says its hash is, and what it is.
struct SelfHash {
  Hash128 stored, computed;
  bool ok() const { return stored == computed; }
};
Result<SelfHash> check_self_hash(std::string_view bytes);
// Writes the self-hash into the bytes' hash words (bytes produced by encode_*()).
Status stamp_self_hash(std::string& bytes);
// The hash stored in the message's hash words.
Result<Hash128> stored_self_hash(std::string_view bytes);

// Everything a writer puts in a segment, as plain C++ values.
struct TurnData {
  schema::Role role = schema::Role::ASSISTANT;
  uint32_t start = 0;
  uint32_t length = 0;
  bool continued = false;
};
struct ToolCallData {
  std::string call_id, name, arguments, result, error;
  schema::ToolStatus status = schema::ToolStatus::OK;
  int64_t wall_time_nanos = 0;
  uint32_t call_token_start = 0, result_token_start = 0;
};
struct ImageData {
  uint32_t token_offset = 0, num_patch_tokens = 0, width = 0, height = 0;
  std::string media_type, data;
};
struct RoutedExpertsData {
  uint16_t num_layers = 0, top_k = 0;
  std::vector<uint16_t> experts;  // [token][layer][k]
};
struct StateSnapshotData {
  uint64_t token_position = 0;
  uint32_t policy_version = 0;
  std::string format, data;
};
struct SegmentData {
  std::vector<uint32_t> tokens;
  std::vector<float> logprobs;
  std::vector<uint32_t> policy_versions;
  std::vector<uint8_t> loss_mask;
  std::vector<TurnData> turns;
  std::vector<ToolCallData> tool_calls;
  std::vector<ImageData> images;
  std::optional<RoutedExpertsData> routed_experts;
  std::vector<StateSnapshotData> state_snapshots;
  int64_t created_unix_nanos = 0;
};

// Where a segment sits in its trajectory.
struct SegmentPosition {
  uint64_t trajectory_id = 0;
  uint32_t seq = 0;
  uint64_t token_start = 0;
  Hash128 prev_hash;
};

struct EncodedSegment {
  std::string bytes;  // flat single-segment message, hash stamped
  Hash128 hash;
};

// Builds, validates and hashes a segment.
Result<EncodedSegment> encode_segment(const SegmentPosition& pos, const SegmentData& data);

// Checks a segment's internal consistency (per-token lists agree in length, offsets lie
// inside the segment, masks are 0/1). Messages name the first offending field.
Status validate_segment(schema::Segment::Reader segment);

// Runs `fn` and converts a kj::Exception (malformed Cap'n Proto) into kInvalidArgument.
Status guarded(const char* what, const std::function<Status()>& fn);

// Re-encodes a trajectory record from a builder and stamps its self-hash.
std::string encode_trajectory(capnp::MallocMessageBuilder& message);

// Decodes a stored trajectory record into an owned message (records are small).
Result<std::unique_ptr<capnp::MallocMessageBuilder>> decode_trajectory(std::string_view bytes,
                                                                      bool verify_hash = true);

int64_t unix_nanos_now();

}  // namespace odyssey
