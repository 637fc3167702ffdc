#include "envs/episode.h"

#include <chrono>
#include <map>

#include <fmt/format.h>

namespace odyssey::envs {

namespace {

using json = nlohmann::json;

bool starts_with(const std::string& s, std::string_view prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

// Which kind of rejection TurnParser's message describes (envs/turn.cpp words them).
ToolCallStatus rejection_status(const std::string& message) {
  if (starts_with(message, "unknown tool")) return ToolCallStatus::kUnknownTool;
  if (starts_with(message, "arguments of tool") || starts_with(message, "\"arguments\" of tool") ||
      (starts_with(message, "tool '") && message.find("' cannot be called") != std::string::npos))
    return ToolCallStatus::kBadArguments;
  return ToolCallStatus::kMalformedCall;
}

// The tool a rejected call names, when its text says so.
std::string named_tool(const std::string& raw) {
  const json call = json::parse(raw, nullptr, /*allow_exceptions=*/false);
  if (!call.is_object()) return "";
  const json* body = &call;
  if (auto fn = call.find("function"); fn != call.end() && fn->is_object() && !call.contains("name")) body = &*fn;
  auto name = body->find("name");
  return name != body->end() && name->is_string() ? name->get<std::string>() : "";
}

struct RawCall {
  std::string text;
  uint32_t offset = 0;
};

// Each call's text and the index of its <|tool_call|> token, in the order TurnParser numbers
// them: a call runs from <|tool_call|> to the next control token, or to the end of the turn.
std::vector<RawCall> raw_calls(const std::vector<uint32_t>& tokens, const Tokenizer& tokenizer) {
  std::vector<RawCall> out;
  bool in_call = false;
  size_t start = 0;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (!tokenizer.is_special(tokens[i])) continue;
    if (in_call) {
      out.back().text = tokenizer.decode(tokens.data() + start, i - start);
      in_call = false;
    }
    if (tokenizer.special_kind(tokens[i]) == SpecialToken::kToolCall) {
      out.push_back({"", static_cast<uint32_t>(i)});
      in_call = true;
      start = i + 1;
    }
  }
  if (in_call) out.back().text = tokenizer.decode(tokens.data() + start, tokens.size() - start);
  return out;
}

ToolCallStatus failure_status(const Status& status) {
  switch (status.code()) {
    case StatusCode::kTimeout: return ToolCallStatus::kTimeout;
    case StatusCode::kUnavailable: return ToolCallStatus::kCrashed;
    default: return ToolCallStatus::kToolError;
  }
}

}  // namespace

const char* tool_call_status_name(ToolCallStatus status) {
  switch (status) {
    case ToolCallStatus::kOk: return "ok";
    case ToolCallStatus::kToolError: return "toolError";
    case ToolCallStatus::kMalformedCall: return "malformedCall";
    case ToolCallStatus::kUnknownTool: return "unknownTool";
    case ToolCallStatus::kBadArguments: return "badArguments";
    case ToolCallStatus::kTimeout: return "timeout";
    case ToolCallStatus::kCrashed: return "crashed";
  }
  return "unknown";
}

Episode::Episode(EnvSession& session, const Tokenizer& tokenizer, TurnLimits limits)
    : session_(session), tokenizer_(tokenizer), parser_(session.info().tools, limits) {}

const std::string& Episode::failure() const {
  static const std::string none;
  return failure_ ? *failure_ : none;
}

env::Observation Episode::fail(const Status& status) {
  failure_ = status.message();
  done_ = true;
  env::Observation obs;
  obs.text = kEnvErrorPrefix + status.message();
  obs.done = true;
  return obs;
}

env::Observation Episode::start(const json& task, uint64_t seed) {
  started_ = true;
  done_ = false;
  failure_.reset();
  turns_ = 0;
  calls_.clear();
  parser_.start_episode();
  Result<env::Observation> obs = session_.reset(task, seed);
  if (!obs.ok()) return fail(obs.status());
  done_ = obs->done;
  return std::move(obs).value();
}

env::Observation Episode::take_turn(const std::vector<uint32_t>& tokens) {
  if (!started_) return fail(Status(StatusCode::kFailedPrecondition, "take_turn before start"));
  if (done_) {
    env::Observation over;
    over.text = failure_ ? kEnvErrorPrefix + *failure_ : "the episode is over";
    over.done = true;
    return over;
  }
  const uint32_t turn = turns_++;
  const ParsedTurn parsed = parser_.parse(tokens, tokenizer_);

  const auto t0 = std::chrono::steady_clock::now();
  Result<env::Observation> stepped = session_.step(parsed.action);
  const int64_t wall =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  std::optional<Status> failed;
  env::Observation env_obs;
  if (stepped.ok()) {
    env_obs = std::move(stepped).value();
  } else {
    failed = stepped.status();
    failure_ = failed->message();
    env_obs.text = kEnvErrorPrefix + failed->message();
    env_obs.done = true;
    for (const env::ToolCall& call : parsed.action.tool_calls)
      env_obs.tool_results.push_back({call.id, env_obs.text, /*is_error=*/true});
  }
  env::Observation obs = merge(parsed, std::move(env_obs));
  done_ = obs.done;

  std::map<std::string, const env::ToolResult*> results;
  for (const env::ToolResult& r : obs.tool_results) results.emplace(r.call_id, &r);
  std::map<std::string, const env::ToolCall*> valid;
  for (const env::ToolCall& c : parsed.action.tool_calls) valid.emplace(c.id, &c);
  std::map<std::string, const RejectedCall*> rejected;
  for (const RejectedCall& r : parsed.rejected) rejected.emplace(r.result.call_id, &r);
  const std::vector<RawCall> raws = raw_calls(tokens, tokenizer_);

  for (size_t i = 0; i < parsed.call_order.size(); ++i) {
    ToolCallRecord rec;
    rec.turn = turn;
    rec.call_id = parsed.call_order[i];
    if (i < raws.size()) rec.token_offset = raws[i].offset;
    auto result = results.find(rec.call_id);
    const bool is_error = result == results.end() || result->second->is_error;
    if (result != results.end()) rec.result = result->second->content;
    if (auto v = valid.find(rec.call_id); v != valid.end()) {
      rec.name = v->second->name;
      rec.arguments = v->second->arguments.dump(-1, ' ', false, json::error_handler_t::replace);
      rec.wall_time_nanos = wall;
      if (failed) {
        rec.status = failure_status(*failed);
        rec.error = failed->message();
      } else if (is_error) {
        rec.status = ToolCallStatus::kToolError;
        rec.error = rec.result;
      }
    } else if (auto r = rejected.find(rec.call_id); r != rejected.end()) {
      rec.arguments = r->second->raw;
      rec.name = named_tool(r->second->raw);
      rec.status = rejection_status(r->second->result.content);
      rec.error = r->second->result.content;
    }
    calls_.push_back(std::move(rec));
  }
  return obs;
}

EpisodeScore Episode::finish() {
  EpisodeScore out;
  if (!failure_ && started_) {
    Result<env::Score> score = session_.score();
    if (score.ok()) {
      out.score = std::move(score).value();
      return out;
    }
    failure_ = score.status().message();
  }
  if (!failure_) failure_ = "the episode was never started";
  done_ = true;
  out.failed = true;
  out.failure = *failure_;
  out.score.reward = 0.0;
  out.score.success = false;
  out.score.info = {{"failed", true}, {"failure", *failure_}};
  return out;
}

}  // namespace odyssey::envs
