// Parsing a model turn into an action, and rendering observations as tokens (envs/turn.h).
#include "envs/turn.h"

#include <map>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace odyssey::envs {
namespace {

using nlohmann::json;

constexpr size_t kMaxSchemaMessages = 5;

// nlohmann's what() without its "[json.exception.parse_error.101] " prefix.
std::string parser_message(const json::exception& e) {
  std::string text = e.what();
  if (!text.empty() && text[0] == '[') {
    const size_t end = text.find("] ");
    if (end != std::string::npos) text.erase(0, end + 2);
  }
  return text;
}

}  // namespace

TurnParser::TurnParser(std::vector<ToolSpec> tools, TurnLimits limits) : tools_(std::move(tools)), limits_(limits) {
  schemas_.reserve(tools_.size());
  for (const ToolSpec& tool : tools_)
    schemas_.push_back(JsonSchema::compile(tool.input_schema, fmt::format("tool '{}' input_schema", tool.name)));
}

TurnParser::Checked TurnParser::check_call(const std::string& raw, std::string id) const {
  Checked out;
  auto fail = [&out](std::string message, RejectReason reason = RejectReason::kMalformed) {
    out.error = std::move(message);
    out.reason = reason;
    return out;
  };
  if (raw.size() > limits_.max_call_bytes)
    return fail(fmt::format("tool call is {} bytes, over the limit of {} bytes; it was not run", raw.size(),
                            limits_.max_call_bytes),
                RejectReason::kTooLarge);
  json call;
  try {
    call = json::parse(raw);
  } catch (const json::parse_error& e) {
    return fail(fmt::format("malformed JSON in tool call: {}", parser_message(e)));
  }
  if (!call.is_object())
    return fail(fmt::format("a tool call must be a JSON object {{\"name\": ..., \"arguments\": {{...}}}}, got {}",
                            call.type_name()));
  // OpenAI's shape: {"type": "function", "function": {"name": ..., "arguments": "<JSON text>"}}.
  const json* body = &call;
  if (auto fn = call.find("function"); fn != call.end() && !call.contains("name")) {
    if (!fn->is_object()) return fail("\"function\" must be a JSON object {\"name\": ..., \"arguments\": ...}");
    body = &*fn;
  }
  auto name = body->find("name");
  if (name == body->end()) return fail("missing \"name\": write {\"name\": <tool>, \"arguments\": {...}}");
  if (!name->is_string()) return fail(fmt::format("\"name\" must be a string, got {}", name->type_name()));
  const std::string tool = name->get<std::string>();
  out.tool = tool;
  size_t index = 0;
  while (index < tools_.size() && tools_[index].name != tool) ++index;
  if (index == tools_.size()) {
    std::vector<std::string> known;
    for (const ToolSpec& t : tools_) known.push_back(t.name);
    if (known.empty())
      return fail(fmt::format("unknown tool '{}': this environment has no tools", tool), RejectReason::kUnknownTool);
    return fail(fmt::format("unknown tool '{}' (known tools: {})", tool, fmt::join(known, ", ")),
                RejectReason::kUnknownTool);
  }
  json arguments = json::object();
  if (auto args = body->find("arguments"); args != body->end()) {
    if (args->is_string()) {
      try {
        arguments = json::parse(args->get_ref<const std::string&>());
      } catch (const json::parse_error& e) {
        return fail(fmt::format("\"arguments\" of tool '{}' is a string that is not valid JSON: {}", tool,
                                parser_message(e)),
                    RejectReason::kBadArguments);
      }
    } else {
      arguments = *args;
    }
  }
  if (!arguments.is_object())
    return fail(fmt::format("\"arguments\" of tool '{}' must be a JSON object, got {}", tool, arguments.type_name()),
                RejectReason::kBadArguments);
  const Result<JsonSchema>& schema = schemas_[index];
  if (!schema.ok())
    return fail(fmt::format("tool '{}' cannot be called: {}", tool, schema.status().message()),
                RejectReason::kBadArguments);
  std::vector<std::string> violations = schema->validate(arguments);
  if (!violations.empty()) {
    const size_t more = violations.size() > kMaxSchemaMessages ? violations.size() - kMaxSchemaMessages : 0;
    violations.resize(violations.size() - more);
    std::string message = fmt::format("arguments of tool '{}' do not match its input schema: {}", tool,
                                      fmt::join(violations, "; "));
    if (more > 0) message += fmt::format("; and {} more", more);
    return fail(std::move(message), RejectReason::kBadArguments);
  }
  out.call = env::ToolCall{std::move(id), tool, std::move(arguments)};
  return out;
}

ParsedTurn TurnParser::parse_text_pieces(const std::vector<TurnPiece>& pieces) {
  ParsedTurn turn;
  size_t calls_this_turn = 0;
  bool in_call = false;
  std::string call_text;  // the text of the call being read

  auto take_call = [&](const std::string& raw, const std::string* unterminated_by) {
    std::string id = fmt::format("call_{}", next_call_++);
    turn.call_order.push_back(id);
    ++calls_this_turn;
    std::string error, tool;
    RejectReason reason = RejectReason::kMalformed;
    if (unterminated_by != nullptr) {
      reason = RejectReason::kUnterminated;
      error = *unterminated_by == ""
                  ? "unterminated tool call: the turn ended before <|/tool_call|>; it was not run"
                  : fmt::format("unterminated tool call: {} came before <|/tool_call|>; it was not run",
                                *unterminated_by);
    } else if (calls_this_turn > limits_.max_calls) {
      reason = RejectReason::kTooMany;
      error = fmt::format("too many tool calls in one turn (the limit is {}); this call was not run",
                          limits_.max_calls);
    } else {
      Checked checked = check_call(raw, id);
      if (checked.call) {
        turn.action.tool_calls.push_back(std::move(*checked.call));
        return;
      }
      error = std::move(checked.error);
      reason = checked.reason;
      tool = std::move(checked.tool);
    }
    turn.rejected.push_back(
        {raw, env::ToolResult{std::move(id), std::move(error), /*is_error=*/true}, reason, std::move(tool)});
  };

  for (const TurnPiece& piece : pieces) {
    if (piece.kind == TurnPiece::Kind::kText) {
      (in_call ? call_text : turn.action.text).append(piece.text);
      continue;
    }
    if (in_call) {
      in_call = false;
      if (piece.special == SpecialToken::kToolCallEnd) {
        take_call(call_text, nullptr);
        continue;
      }
      take_call(call_text, &piece.text);
    }
    if (piece.special == SpecialToken::kToolCall) {
      in_call = true;
      call_text.clear();
    }
    // Any other control token outside a call is layout, not text.
  }
  if (in_call) {
    const std::string end_of_turn;
    take_call(call_text, &end_of_turn);
  }
  return turn;
}

ParsedTurn TurnParser::parse(const std::vector<uint32_t>& tokens, const Tokenizer& tokenizer) {
  std::vector<TurnPiece> pieces;
  size_t run_start = 0;
  auto flush = [&](size_t end) {
    if (end > run_start) pieces.push_back(TurnPiece::Text(tokenizer.decode(tokens.data() + run_start, end - run_start)));
  };
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (!tokenizer.is_special(tokens[i])) continue;
    flush(i);
    run_start = i + 1;
    TurnPiece piece;
    piece.kind = TurnPiece::Kind::kSpecial;
    piece.special = tokenizer.special_kind(tokens[i]);
    piece.text = tokenizer.token_text(tokens[i]);
    pieces.push_back(std::move(piece));
  }
  flush(tokens.size());
  return parse_text_pieces(pieces);
}

env::Observation merge(const ParsedTurn& turn, env::Observation env_obs) {
  std::map<std::string, env::ToolResult> by_id;
  std::vector<env::ToolResult> unmatched;
  for (env::ToolResult& r : env_obs.tool_results) {
    if (!by_id.emplace(r.call_id, r).second) unmatched.push_back(std::move(r));
  }
  for (const RejectedCall& r : turn.rejected) by_id.emplace(r.result.call_id, r.result);
  std::vector<env::ToolResult> ordered;
  ordered.reserve(turn.call_order.size());
  for (const std::string& id : turn.call_order) {
    auto it = by_id.find(id);
    if (it == by_id.end()) {
      ordered.push_back({id, "the environment returned no result for this call", /*is_error=*/true});
      continue;
    }
    ordered.push_back(std::move(it->second));
    by_id.erase(it);
  }
  // Results for calls the model did not make (an environment's bug) stay visible, after the rest.
  for (auto& [id, r] : by_id) ordered.push_back(std::move(r));
  for (env::ToolResult& r : unmatched) ordered.push_back(std::move(r));
  env_obs.tool_results = std::move(ordered);
  return env_obs;
}

RenderedObservation render_observation(const env::Observation& obs, const Tokenizer& tokenizer, SpecialToken role) {
  RenderedObservation out;
  auto special = [&](SpecialToken t) { out.tokens.push_back(tokenizer.special_id(t)); };
  auto text = [&](const std::string& s) {
    const std::vector<uint32_t> ids = tokenizer.encode(s);
    out.tokens.insert(out.tokens.end(), ids.begin(), ids.end());
  };
  special(role);
  for (const env::ToolResult& r : obs.tool_results) {
    special(SpecialToken::kToolResult);
    text(r.is_error ? "error: " + r.content : r.content);
    special(SpecialToken::kToolResultEnd);
  }
  text(obs.text);
  out.image_position = out.tokens.size();
  out.image_count = obs.images.size();
  special(SpecialToken::kEndTurn);
  return out;
}

}  // namespace odyssey::envs
