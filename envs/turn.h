// A model turn as the environment sees it, and an observation as the model sees it.
//
// The framework owns tokenization. A model turn is a token sequence; the text between
// <|tool_call|> and <|/tool_call|> is one tool call written as JSON,
//
//     {"name": "guess", "arguments": {"n": 50}}
//
// (OpenAI's shape {"type": "function", "function": {"name": ..., "arguments": "<JSON text>"}}
// is accepted too, and "arguments" may be a JSON object or a string holding one; a call without
// "arguments" has {}). TurnParser turns the tokens into an env::Action holding only the calls
// that are well-formed, name a known tool and whose arguments validate against its input
// schema, and one error ToolResult for every other call, saying what is wrong so the model can
// learn from it: malformed JSON (with the parser's line and column), missing "name", unknown
// tool (naming the known ones), arguments that are not an object, arguments the tool's schema
// rejects (the validator's messages), an unterminated call, too many calls in one turn, a call
// over the size limit. Rejected calls never reach the environment.
//
// Every call, valid or not, gets an id "call_<n>", n counting the model's calls across the
// episode (start_episode() restarts it), so results can be matched to calls in records.
// Text outside tool calls becomes action.text; framework control tokens there (<|end_turn|>,
// <|eos|>, ...) and a foreign vocabulary's special tokens are dropped. Inside a call, any
// special token other than <|/tool_call|> ends it as unterminated (and a <|tool_call|> there
// opens the next call).
//
// merge() puts the environment's results and the rejections together in the order the model
// made the calls; render_observation() turns that observation into the tokens the model sees
// next:
//
//     <|tool|> (<|tool_result|> content <|/tool_result|>)* text <|end_turn|>
//
// with "error: " before the content of a failed call. Images are not tokenized here: an
// observation's images stay in Observation::images, and the caller (the actor) splices their
// <|image|> patch <|/image|> blocks in at RenderedObservation::image_position.
//
// Thread-safety: a TurnParser holds the episode's call counter; use one per episode, from one
// thread at a time. The free functions are pure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/tokenizer.h"
#include "envs/json_schema.h"
#include "envs/session.h"

namespace odyssey::envs {

struct TurnLimits {
  size_t max_calls = 8;              // per turn; later calls are rejected without being read
  size_t max_call_bytes = 64 * 1024; // the JSON text of one call, decoded
};

// A turn as text runs and control tokens, as parse() sees it after decoding.
struct TurnPiece {
  enum class Kind { kText, kSpecial };
  Kind kind = Kind::kText;
  std::string text;                     // kText: the text; kSpecial: the token's name, for messages
  std::optional<SpecialToken> special;  // kSpecial: which framework token; nullopt for a foreign one

  static TurnPiece Text(std::string text) { return {Kind::kText, std::move(text), std::nullopt}; }
  static TurnPiece Special(SpecialToken token) { return {Kind::kSpecial, special_token_text(token), token}; }
};

// Why a call was rejected (records map these onto trajectory.capnp's ToolStatus).
enum class RejectReason {
  kMalformed,     // not JSON, not an object, no "name" or a "name" that is not a string
  kUnknownTool,
  kBadArguments,  // "arguments" not an object (or not JSON text), or the schema rejects them
  kUnterminated,  // no <|/tool_call|> before another control token or the end of the turn
  kTooMany,       // over TurnLimits::max_calls in this turn
  kTooLarge,      // over TurnLimits::max_call_bytes
};

struct RejectedCall {
  std::string raw;          // the text between the call tokens, as the model wrote it
  env::ToolResult result;   // is_error = true; content says what is wrong
  RejectReason reason = RejectReason::kMalformed;
  std::string tool;         // the tool the call names, when it got that far; else ""
};

struct ParsedTurn {
  env::Action action;                   // text outside calls, and the valid calls
  std::vector<RejectedCall> rejected;   // every other call
  std::vector<std::string> call_order;  // the id of every call, as the model made them
};

class TurnParser {
 public:
  // Tools usually come from EnvInfo (already checked by parse_tools); a tool whose schema does
  // not compile rejects every call to it with the compiler's message.
  explicit TurnParser(std::vector<ToolSpec> tools, TurnLimits limits = {});

  ParsedTurn parse(const std::vector<uint32_t>& tokens, const Tokenizer& tokenizer);
  ParsedTurn parse_text_pieces(const std::vector<TurnPiece>& pieces);

  // The next call is "call_0" again.
  void start_episode() { next_call_ = 0; }
  uint64_t calls_seen() const { return next_call_; }
  const std::vector<ToolSpec>& tools() const { return tools_; }

 private:
  struct Checked {
    std::optional<env::ToolCall> call;
    std::string error;
    RejectReason reason = RejectReason::kMalformed;
    std::string tool;
  };
  Checked check_call(const std::string& raw, std::string id) const;

  std::vector<ToolSpec> tools_;
  std::vector<Result<JsonSchema>> schemas_;  // parallel to tools_
  TurnLimits limits_;
  uint64_t next_call_ = 0;
};

// `env_obs` (what the environment returned for turn.action) with turn's rejections added, its
// tool results in the order of turn.call_order. A valid call the environment left unanswered
// gets an error result saying so.
env::Observation merge(const ParsedTurn& turn, env::Observation env_obs);

struct RenderedObservation {
  std::vector<uint32_t> tokens;
  size_t image_position = 0;  // index in tokens where the observation's images belong (before <|end_turn|>)
  size_t image_count = 0;     // obs.images.size(), left to the caller
};

// The tokens of `obs` under role header `role` (<|tool|> after a step; <|user|> for the task
// prompt reset returns). Text is encoded as plain text, so nothing an environment writes can
// become a control token.
RenderedObservation render_observation(const env::Observation& obs, const Tokenizer& tokenizer,
                                       SpecialToken role = SpecialToken::kTool);

}  // namespace odyssey::envs
