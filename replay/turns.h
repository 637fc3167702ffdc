// Turns of a stored trajectory, reassembled from its segments as they stream past.
//
// A segment holds turn pieces (token ranges with a role; `continued` when the turn began
// in the segment before), tool calls and images positioned by token offsets. TurnAssembler
// takes the segments of one trajectory in order, one at a time, merges continued pieces
// into whole turns, attaches tool calls and images to their turns, and hands each turn on
// as soon as it is complete. It keeps only the turn still open, so a trajectory of a
// million tokens passes through in the memory of its longest turn (less with limits).
//
// Attachment rules, on absolute token positions (segment tokenStart + offset):
// - A tool call belongs to the turn that is the last to start at or before its
//   callTokenStart, searched among this segment's pieces and the turn left open by the
//   segment before. When that turn is an assistant turn the call is in its `calls`;
//   otherwise (or when no turn precedes it) the call is handed on right after that turn as
//   a `synthetic` assistant turn with no tokens, so no recorded call is ever lost.
// - An image belongs to the turn that is the last to start at or before its tokenOffset;
//   an image before every turn is reported in notes() and dropped.
// - Tokens in no turn piece are counted (tokens_outside_turns()), not handed on.
//
// Errors (kInvalidArgument, naming the segment): a segment of another trajectory, a seq
// out of order, a tokenStart that does not follow the tokens before, a segment that fails
// validate_segment(), or malformed Cap'n Proto data anywhere in the segment. Oddities that still leave a readable
// trajectory (a `continued` piece with nothing to continue, or a different role than the
// open turn) become notes() instead.
//
// Not thread-safe; one assembler per trajectory being read (reset() to reuse).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "core/schema/trajectory.capnp.h"
#include "core/status.h"

namespace odyssey::replay {

// A tool call copied out of its segment, positioned in the whole trajectory.
struct AssembledToolCall {
  std::string call_id, name, arguments, error;
  std::string result;        // the result bytes, at most TurnAssemblyOptions::max_result_bytes
  uint64_t result_size = 0;  // the full size of the stored result
  schema::ToolStatus status = schema::ToolStatus::OK;
  int64_t wall_time_nanos = 0;
  uint64_t call_position = 0, result_position = 0;  // absolute token positions
  uint32_t seq = 0;                                 // the segment that recorded it
};

struct AssembledImage {
  uint64_t position = 0;  // absolute position of its begin-image token
  uint32_t num_patch_tokens = 0, width = 0, height = 0;
  std::string media_type;
  uint64_t size = 0;      // encoded bytes stored
  std::string data;       // the encoded bytes, only with TurnAssemblyOptions::keep_image_data
};

struct AssembledTurn {
  schema::Role role = schema::Role::ASSISTANT;
  uint64_t start = 0;       // absolute position of its first token
  uint64_t num_tokens = 0;  // all of them, kept or not
  uint32_t first_seq = 0, last_seq = 0;
  // The first tokens of the turn (all of them unless TurnAssemblyOptions::max_turn_tokens).
  std::vector<uint32_t> ids;
  // Parallel to `ids` with TurnAssemblyOptions::keep_token_details, else empty.
  std::vector<float> logprobs;
  std::vector<uint32_t> policy_versions;
  std::vector<uint8_t> loss_mask;
  std::vector<AssembledToolCall> calls;
  std::vector<AssembledImage> images;
  // True for the token-less assistant turn that carries calls found outside any assistant
  // turn (see the attachment rules).
  bool synthetic = false;
};

struct TurnAssemblyOptions {
  size_t max_turn_tokens = std::numeric_limits<size_t>::max();
  size_t max_result_bytes = std::numeric_limits<size_t>::max();
  bool keep_token_details = false;
  bool keep_image_data = false;
};

class TurnAssembler {
 public:
  using TurnSink = std::function<void(AssembledTurn&&)>;

  explicit TurnAssembler(TurnAssemblyOptions options = {}) : options_(options) {}

  // Starts a trajectory: its segments must come with this id, from seq 0 at token 0.
  void reset(uint64_t trajectory_id);
  // Reads one segment (the reader need only live during the call) and hands every turn it
  // completes to `sink`, in order. On error nothing of the segment is used.
  Status add(schema::Segment::Reader segment, const TurnSink& sink);
  // Hands on the turn still open. The assembler is then empty until reset().
  void finish(const TurnSink& sink);

  uint32_t segments_read() const { return next_seq_; }
  uint64_t tokens_read() const { return next_token_; }
  uint64_t tokens_outside_turns() const { return tokens_outside_turns_; }
  // Oddities found so far, one sentence each, naming the segment.
  const std::vector<std::string>& notes() const { return notes_; }

 private:
  struct PendingTurn {
    AssembledTurn turn;
    std::vector<AssembledToolCall> loose_calls;  // calls that follow a non-assistant turn
  };
  static void hand_on(PendingTurn&& pending, const TurnSink& sink);
  static void hand_on_loose_calls(std::vector<AssembledToolCall>&& calls, const TurnSink& sink);
  // Appends tokens [begin, begin+length) of `segment` to `turn`, keeping at most
  // max_turn_tokens together with the `kept_before` tokens it continues.
  void append_tokens(schema::Segment::Reader segment, uint32_t begin, uint32_t length, size_t kept_before,
                     AssembledTurn& turn) const;

  TurnAssemblyOptions options_;
  uint64_t trajectory_id_ = 0;
  uint32_t next_seq_ = 0;
  uint64_t next_token_ = 0;
  uint64_t tokens_outside_turns_ = 0;
  std::optional<PendingTurn> open_;
  std::vector<std::string> notes_;
};

}  // namespace odyssey::replay
