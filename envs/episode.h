// One episode as an actor runs it: an EnvSession (in-process or hosted) joined with the turn
// parser (envs/turn.h), turning model turns (tokens) into observations and recording every
// tool call the way trajectories store them (core/schema/trajectory.capnp, struct ToolCall).
//
//   Episode episode(*session, tokenizer);
//   env::Observation prompt = episode.start(task, seed);
//   while (!episode.done() && budget_left) obs = episode.take_turn(model_turn_tokens);
//   EpisodeScore grade = episode.finish();
//
// Nothing here throws or returns an error: every failure becomes something the model sees.
// - A call the parser rejects (malformed JSON, unknown tool, arguments the schema rejects, ...)
//   becomes an error tool result; the other calls of the turn still run.
// - A failing session (hosted plugin timed out or crashed, internal error, the plugin refusing
//   the action) ends the episode: every valid call of that turn gets the error result
//   "tool environment error: <message>", the observation's text says the same, done() is
//   true, and failure() keeps the message. finish() then reports a failed episode (reward 0,
//   success false, info {"failed": true, "failure": message}) without asking the session.
//   A hosted session restarts its host on the next reset, so the next Episode can use it.
//
// Records: every call, in the order the model made it, with the trajectory schema's status
// vocabulary. The calls of one turn run in one step, so each valid call records that step's
// wall time; rejected calls record 0.
//
// Thread-safety: one thread at a time; the session and tokenizer must outlive the Episode.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tokenizer.h"
#include "envs/session.h"
#include "envs/turn.h"

namespace odyssey::envs {

// trajectory.capnp's ToolStatus, value for value.
enum class ToolCallStatus : uint8_t {
  kOk = 0,
  kToolError = 1,      // the tool ran and reported an error, or the environment failed
  kMalformedCall = 2,  // the call could not be read (bad JSON, no name, unterminated, over a limit)
  kUnknownTool = 3,
  kBadArguments = 4,   // arguments did not match the tool's schema (or were not an object)
  kTimeout = 5,        // the hosted environment did not answer in time
  kCrashed = 6,        // the plugin or its host died
};
// The schema's spelling: "ok", "toolError", "malformedCall", ...
const char* tool_call_status_name(ToolCallStatus status);

struct ToolCallRecord {
  uint32_t turn = 0;          // index of the model turn (0 = the first take_turn)
  std::string call_id;        // "call_<n>", as the parser numbered it
  std::string name;           // the tool named; "" when the call could not be read
  std::string arguments;      // valid calls: the arguments object the tool got (JSON);
                              // rejected calls: the call's text exactly as the model wrote it
  std::string result;         // what the model sees (UTF-8 text)
  ToolCallStatus status = ToolCallStatus::kOk;
  std::string error;          // why it is not kOk ("" when it is)
  int64_t wall_time_nanos = 0;
  uint32_t token_offset = 0;  // index of the call's <|tool_call|> token in the turn's tokens
};

// The episode's grade. A failed episode has reward 0 and success false.
struct EpisodeScore {
  env::Score score;
  bool failed = false;
  std::string failure;  // why, when failed
};

inline constexpr const char* kEnvErrorPrefix = "tool environment error: ";

class Episode {
 public:
  Episode(EnvSession& session, const Tokenizer& tokenizer, TurnLimits limits = {});

  // Resets the session: the task prompt. If the reset fails, the observation says so and the
  // episode is over and failed.
  env::Observation start(const nlohmann::json& task, uint64_t seed);
  // The model's turn (its tokens, up to and including its end-of-turn token) -> what the
  // environment answers, rejected calls merged in the order the model made them. After the
  // episode is done, answers that it is over without calling the session.
  env::Observation take_turn(const std::vector<uint32_t>& tokens);
  // The final grade: the session's score, or a failed one (see the header comment). Call once,
  // when done() or when the actor stops the episode (e.g. out of tokens).
  EpisodeScore finish();

  bool done() const { return done_; }
  bool failed() const { return failure_.has_value(); }
  const std::string& failure() const;
  uint32_t turns() const { return turns_; }
  const std::vector<ToolCallRecord>& calls() const { return calls_; }

 private:
  // The episode is over with this failure; returns the observation that says so.
  env::Observation fail(const Status& status);

  EnvSession& session_;
  const Tokenizer& tokenizer_;
  TurnParser parser_;
  bool started_ = false;
  bool done_ = false;
  std::optional<std::string> failure_;
  uint32_t turns_ = 0;
  std::vector<ToolCallRecord> calls_;
};

}  // namespace odyssey::envs
