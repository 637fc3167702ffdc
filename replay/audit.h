// Audit views of stored trajectories: `odyssey traj show`, `traj export` and `traj ls`.
//
// Pure functions of a trajectory record and its segments; nothing here opens a database.
// A caller streams one trajectory through a TrajectoryRenderer: begin(record), then add()
// for each segment in order (seq 0, 1, ...), then finish(). A renderer copies what it needs
// during each call, so the record and segment readers need only live that long, and it
// holds one turn at a time (the show view) or what one output line needs (the export), so
// a million-token trajectory never sits in memory as segments.
//
// Text comes from token ids through the trajectory's Tokenizer; everything written is
// valid UTF-8 (ill-formed bytes from tools or corrupt data become U+FFFD), and the show
// view escapes control characters other than newline and tab so stored bytes cannot drive
// the reader's terminal.
//
// Errors: add() fails (kInvalidArgument, naming trajectory and segment) on a segment out of
// order, of another trajectory, or malformed; begin() on a malformed record. A renderer
// that failed writes nothing more for that trajectory: the export writes its line only in
// finish(), so a JSONL file never holds half a trajectory. begin() starts over, so one
// renderer serves many trajectories. Not thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/schema/trajectory.capnp.h"
#include "core/status.h"
#include "core/tokenizer.h"
#include "replay/turns.h"

namespace odyssey::replay {

// --- names and formats shared by the views ---

// "in_flight", "complete", "consumed", "withheld", "failed"; "unknown(N)" for a value a
// newer schema added.
std::string trajectory_status_name(schema::TrajectoryStatus status);
// Accepts the names above (and "in-flight").
Result<schema::TrajectoryStatus> parse_trajectory_status(std::string_view text);
std::string role_name(schema::Role role);                 // "system", "user", "assistant", "tool"
std::string tool_status_name(schema::ToolStatus status);  // "ok", "tool_error", "malformed_call", ...

// "850ns", "12.5us", "3.20ms", "2.50s", "4m05s", "1h02m03s", "3d04h05m"; negative with '-'.
std::string format_duration(int64_t nanos);
// ISO 8601 in UTC with milliseconds ("2024-05-01T12:00:00.123Z"); "-" for 0 (unset).
std::string format_unix_nanos(int64_t unix_nanos);

// --- streaming interface ---

class TrajectoryRenderer {
 public:
  virtual ~TrajectoryRenderer() = default;
  virtual Status begin(schema::Trajectory::Reader record) = 0;
  virtual Status add(schema::Segment::Reader segment) = 0;
  virtual Status finish() = 0;
};

// begin(record), add() for each of `segments`, finish(): for trajectories already in memory.
Status render_trajectory(TrajectoryRenderer& renderer, schema::Trajectory::Reader record,
                         const std::vector<schema::Segment::Reader>& segments);

// The same steps from stored bytes (TrajectoryStore::read_record / read_segments values):
// the record is decoded with its self-hash checked (decode_trajectory), the segment read in
// place; malformed bytes are an error, never a crash. Segment hashes and the hash chain are
// `traj verify`'s business, not checked here.
Status begin_stored_record(TrajectoryRenderer& renderer, std::string_view record_bytes);
Status add_stored_segment(TrajectoryRenderer& renderer, std::string_view segment_bytes);

// --- show: the view for people ---

struct ShowOptions {
  size_t max_turn_bytes = 4000;    // text shown per turn, cut at a character boundary; 0 = all
  size_t max_result_bytes = 1000;  // tool result text shown per call; 0 = all
  bool show_token_ids = false;     // also list each shown token: position, id, text, logprob,
                                   // policy version, loss mask
  int64_t now_unix_nanos = 0;      // "now" for the age of an in-flight trajectory; 0 = the clock
};

// Writes a header (identity, status, rewards, sizes, policy versions, timings), then each
// turn in order (role, token range, decoded text with special tokens by name, images as
// "[image WxH media_type, K bytes, P patch tokens]", the tool calls made in it with status,
// error, wall time and result), then summaries of state snapshots and routed experts, and
// notes on anything inconsistent (counts that disagree with the record, odd turn pieces).
// Turns are written as they complete.
class ShowRenderer final : public TrajectoryRenderer {
 public:
  ShowRenderer(const Tokenizer& tokenizer, std::ostream& out, ShowOptions options = {});
  Status begin(schema::Trajectory::Reader record) override;
  Status add(schema::Segment::Reader segment) override;
  Status finish() override;

 private:
  struct ExpertStats {
    uint64_t segments = 0, tokens = 0;
    uint16_t num_layers = 0, top_k = 0;
    bool shapes_differ = false;
    std::unordered_map<uint16_t, uint64_t> uses;  // expert -> times routed to
    uint64_t total_uses = 0;
  };
  struct SnapshotStats {
    uint64_t count = 0, bytes = 0;
    uint64_t first_position = 0, last_position = 0;
    uint32_t min_version = 0, max_version = 0;
    std::vector<std::string> formats;
  };
  void write_turn(AssembledTurn&& turn);
  void write_call(const AssembledToolCall& call);
  std::string turn_text(const AssembledTurn& turn) const;

  const Tokenizer& tokenizer_;
  std::ostream& out_;
  ShowOptions options_;
  TurnAssembler assembler_;
  uint64_t trajectory_id_ = 0;
  uint32_t record_segments_ = 0;
  uint64_t record_tokens_ = 0;
  bool record_in_flight_ = false;
  uint64_t turns_ = 0, calls_ = 0, failed_calls_ = 0, images_ = 0;
  ExpertStats experts_;
  SnapshotStats snapshots_;
};

// --- export: one JSON object per trajectory (JSONL) ---

struct ExportOptions {
  bool include_tokens = true;  // the "tokens" object (ids, logprobs, policy versions, loss mask)
  bool inline_images = false;  // images as OpenAI content parts with base64 data: URLs, instead
                               // of a "[image ...]" text placeholder
};

// Writes, in finish(), one line:
//   {"id": "<16 hex>", "job", "environment": {"name","version","plugin_hash"}, "task",
//    "seed", "group_id": "<16 hex>", "group_size", "tokenizer", "writer", "status",
//    "reward": total, "reward_parts": {name: value}, "error" (when set),
//    "messages": [...], "tokens": {"ids","logprobs","policy_versions","loss_mask"}}
// `messages` is the OpenAI chat format, one per turn in order:
// - system/user/assistant turns: {"role", "content": text}. Content is the turn's text
//   without the layout tokens (role headers, end of turn, bos/eos/pad, tool-result
//   brackets) and without the model's tool-call spans, which become the assistant message's
//   "tool_calls": [{"id", "type": "function", "function": {"name", "arguments"}}].
//   A call with an empty callId gets the id "call_<n>" (n counts calls from 0).
// - tool results: {"role": "tool", "tool_call_id", "name", "content": result text,
//   "status": tool status name, "error" (when set)}, one per call, in place of the tool turn
//   whose tokens hold the result (the turn containing the call's resultTokenStart), in call
//   order; a call whose result lies in no tool turn gets its message right after the
//   assistant message that made it. A tool turn with no call result in it becomes
//   {"role": "tool", "content": its text}.
// - calls outside any assistant turn come in a token-less assistant message
//   ({"role": "assistant", "content": "", "tool_calls": [...]}) after the turn they follow.
// Logprobs that are not finite are written as null.
class ChatJsonlRenderer final : public TrajectoryRenderer {
 public:
  ChatJsonlRenderer(const Tokenizer& tokenizer, std::ostream& out, ExportOptions options = {});
  Status begin(schema::Trajectory::Reader record) override;
  Status add(schema::Segment::Reader segment) override;
  Status finish() override;

 private:
  const Tokenizer& tokenizer_;
  std::ostream& out_;
  ExportOptions options_;
  TurnAssembler assembler_;
  std::string head_;  // the record's fields, as the start of a JSON object
  std::vector<AssembledTurn> turns_;
  std::vector<uint32_t> ids_;
  std::vector<float> logprobs_;
  std::vector<uint32_t> policy_versions_;
  std::vector<uint8_t> loss_mask_;
  bool begun_ = false;
};

// --- ls: filters and one line per trajectory ---

// Constraints on trajectory records; unset ones match everything.
struct TrajectoryFilter {
  std::optional<std::string> job;          // exact
  std::optional<std::string> environment;  // environment name, exact
  std::vector<schema::TrajectoryStatus> statuses;  // any of these; empty = all
  // Inclusive bounds on rewardTotal. A trajectory still in flight has no reward yet and
  // fails any reward bound.
  std::optional<double> reward_min, reward_max;
  // Inclusive bounds every token's policy version must lie within (minPolicyVersion >=
  // version_min, maxPolicyVersion <= version_max).
  std::optional<uint32_t> version_min, version_max;

  bool matches(schema::Trajectory::Reader record) const;
};

// The command-line strings of a filter, as given; "" leaves a constraint unset. Errors name
// the option as `odyssey traj ls` spells it (--job, --env, --status, --reward-min,
// --reward-max, --version-min, --version-max).
struct TrajectoryFilterArgs {
  std::string job, environment;
  std::string status;  // one name or a comma-separated list: "complete,consumed"
  std::string reward_min, reward_max;
  std::string version_min, version_max;
};
Result<TrajectoryFilter> parse_filter(const TrajectoryFilterArgs& args);

// Column titles, then one line per record, aligned: id, status, env (name@version), task,
// reward, tokens, segments, policy versions, age (since started, relative to now).
std::string format_ls_header();
std::string format_ls_row(schema::Trajectory::Reader record, int64_t now_unix_nanos);

}  // namespace odyssey::replay
