// Built-in environment "arith": arithmetic problems, solved with an exact calculator tool.
//
// Config (all optional; unknown keys are refused):
//   min_steps (1), max_steps (3)   operations per problem, 1..8 (max_steps defaults to
//                                  min_steps when that is larger)
//   max_operand (20)               largest operand, 1..10000 (2.. with word_problems)
//   word_problems (false)          false: terse "(3+4)*2=?"; true: a short story and a question
//   max_turns (6)                  turns before the episode ends unanswered, 1..100
//   format_bonus (0.1)             reward for giving a well-formed answer, right or wrong, 0..1
//   tool_bonus (0.0)               reward for a correct answer that used the calculator, 0..1
// The easiest setting, {"min_steps": 1, "max_steps": 1, "max_operand": 9}, asks "3+4=?".
//
// Task: {} is train task number `seed`; {"split": "train"|"eval", "index": N} is task N of
// that split, whatever the seed. Train and eval never share a problem (problems.h says how).
//
// Tools:
//   calculator {"expression": string}  the exact value ("14", "7/2"), or an error saying where
//   answer {"value": integer}          the final answer; ends the episode
//
// The answer convention: call `answer`. A turn without any tool call is the model's final
// text and also ends the episode; it counts as an answer when its last non-empty line is
// exactly "answer: N" (N an integer; "answer" in any case, spaces around the parts allowed).
// Calls after the answer in the same turn are refused. After max_turns turns the episode ends
// unanswered.
//
// Reward parts: "correct" (1 for the exact answer), "format" (format_bonus for a well-formed
// answer), "tool_use" (tool_bonus when correct after at least one successful calculator call).
// reward = their sum; success = correct. score().info: expected, answer, answered_by, turns,
// calculator_calls, split, index, expression.
//
// Snapshots: JSON of the whole episode state (problem included) at a turn boundary; restore
// into an instance with the same config.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "calculator.h"
#include "odyssey/env_sdk.hpp"
#include "odyssey/env_util.hpp"
#include "problems.h"

namespace {

using nlohmann::json;
using odyssey::env::Action;
using odyssey::env::EnvError;
using odyssey::env::Observation;
using odyssey::env::Score;
using odyssey::env::ToolError;
using namespace odyssey::arith;

constexpr int kSnapshotVersion = 1;

double number_key(const json& object, const char* key, double fallback, double lo, double hi) {
  const auto it = object.find(key);
  if (it == object.end()) return fallback;
  if (!it->is_number() || !(it->get<double>() >= lo && it->get<double>() <= hi))
    throw EnvError(ODY_ENV_ERR_INVALID_CONFIG, std::string("config '") + key + "' must be a number in [" +
                                                   json(lo).dump() + ", " + json(hi).dump() + "], got " + it->dump());
  return it->get<double>();
}

bool bool_key(const json& object, const char* key, bool fallback) {
  const auto it = object.find(key);
  if (it == object.end()) return fallback;
  if (!it->is_boolean())
    throw EnvError(ODY_ENV_ERR_INVALID_CONFIG, std::string("config '") + key + "' must be true or false, got " +
                                                   it->dump());
  return it->get<bool>();
}

// The JSON value of the answer tool as an int64, or why not.
int64_t integer_value(const json& v) {
  if (v.is_number_integer() && !v.is_number_unsigned()) return v.get<int64_t>();
  if (v.is_number_unsigned() && v.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX)) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.2e18) return static_cast<int64_t>(d);
  }
  throw ToolError("'value' must be an integer in the 64-bit range, got " + v.dump());
}

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && (s[b] == ' ' || s[b] == '\t' || s[b] == '\r')) ++b;
  while (e > b && (s[e - 1] == ' ' || s[e - 1] == '\t' || s[e - 1] == '\r')) --e;
  return std::string(s.substr(b, e - b));
}

// N when the last non-empty line of `text` is "answer: N" (see the convention above).
std::optional<int64_t> text_answer(std::string_view text) {
  std::string line;
  size_t end = text.size();
  while (line.empty()) {
    if (end == 0) return std::nullopt;
    const size_t nl = text.rfind('\n', end - 1);
    const size_t begin = nl == std::string_view::npos ? 0 : nl + 1;
    line = trim(text.substr(begin, end - begin));
    end = nl == std::string_view::npos ? 0 : nl;
  }
  static constexpr std::string_view kWord = "answer";
  if (line.size() < kWord.size()) return std::nullopt;
  for (size_t i = 0; i < kWord.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(line[i])) != kWord[i]) return std::nullopt;
  std::string rest = trim(std::string_view(line).substr(kWord.size()));
  if (rest.empty() || rest[0] != ':') return std::nullopt;
  rest = trim(std::string_view(rest).substr(1));
  size_t i = 0;
  const bool negative = !rest.empty() && rest[0] == '-';
  if (negative) ++i;
  if (i == rest.size()) return std::nullopt;
  __int128 n = 0;
  for (; i < rest.size(); ++i) {
    if (rest[i] < '0' || rest[i] > '9') return std::nullopt;
    n = n * 10 + (rest[i] - '0');
    if (n > INT64_MAX) return std::nullopt;
  }
  return static_cast<int64_t>(negative ? -n : n);
}

class Arith : public odyssey::env::Environment {
 public:
  explicit Arith(const json& config) {
    odyssey::env::check_keys(config,
                             {"min_steps", "max_steps", "max_operand", "word_problems", "max_turns", "format_bonus",
                              "tool_bonus"},
                             "arith config", ODY_ENV_ERR_INVALID_CONFIG);
    auto int_key = [&](const char* key, int64_t fallback, int64_t lo, int64_t hi) {
      return static_cast<int64_t>(odyssey::env::integer_field(config, key, static_cast<uint64_t>(fallback),
                                                              static_cast<uint64_t>(lo), static_cast<uint64_t>(hi),
                                                              "arith config", ODY_ENV_ERR_INVALID_CONFIG));
    };
    settings_.min_steps = static_cast<int>(int_key("min_steps", 1, 1, 8));
    settings_.max_steps = static_cast<int>(int_key("max_steps", std::max(3, settings_.min_steps), 1, 8));
    settings_.max_operand = int_key("max_operand", 20, 1, 10000);
    settings_.word_problems = bool_key(config, "word_problems", false);
    max_turns_ = static_cast<int>(int_key("max_turns", 6, 1, 100));
    format_bonus_ = number_key(config, "format_bonus", 0.1, 0.0, 1.0);
    tool_bonus_ = number_key(config, "tool_bonus", 0.0, 0.0, 1.0);
    if (settings_.min_steps > settings_.max_steps)
      throw EnvError(ODY_ENV_ERR_INVALID_CONFIG, "config 'min_steps' (" + std::to_string(settings_.min_steps) +
                                                     ") must not exceed 'max_steps' (" +
                                                     std::to_string(settings_.max_steps) + ")");
    if (settings_.word_problems && settings_.max_operand < 2)
      throw EnvError(ODY_ENV_ERR_INVALID_CONFIG, "config 'max_operand' must be at least 2 with word_problems");

    add_tool({"calculator",
              "Evaluates an arithmetic expression exactly: integers, + - * /, parentheses and unary minus. "
              "Returns the value (a fraction such as 7/2 when a division is not exact) or an error saying where.",
              {{"type", "object"},
               {"properties", {{"expression", {{"type", "string"}, {"description", "e.g. (3+4)*2"}}}}},
               {"required", {"expression"}},
               {"additionalProperties", false}}},
             [this](const json& args) { return calculate(args); });
    add_tool({"answer", "Gives your final answer, an integer; this ends the episode.",
              {{"type", "object"},
               {"properties", {{"value", {{"type", "integer"}, {"description", "the final answer"}}}}},
               {"required", {"value"}},
               {"additionalProperties", false}}},
             [this](const json& args) { return record_answer(args); });
  }

  Observation reset(const json& task, uint64_t seed) override {
    const odyssey::env::SplitIndex chosen = odyssey::env::split_index_task(task, seed);
    const Split split = chosen.eval ? Split::kEval : Split::kTrain;
    const uint64_t index = chosen.index;
    try {
      problem_ = problem_for(settings_, split, index);
    } catch (const std::invalid_argument& e) {
      throw EnvError(ODY_ENV_ERR_INVALID_TASK, e.what());
    }
    split_ = split;
    index_ = index;
    turns_ = 0;
    calculator_calls_ = 0;
    calculator_ok_ = 0;
    answer_.reset();
    answered_by_.clear();
    done_ = false;

    Observation obs;
    obs.text = problem_.prompt;
    obs.info = {{"split", split_name(split_)}, {"index", index_}, {"steps", problem_.steps}};
    return obs;
  }

  Observation step(const Action& action) override {
    if (done_) throw EnvError(ODY_ENV_ERR_INVALID_ACTION, "the episode is over; call score");
    if (problem_.prompt.empty()) throw EnvError(ODY_ENV_ERR_INVALID_ACTION, "step before reset");
    ++turns_;
    Observation obs;
    for (const auto& call : action.tool_calls) obs.tool_results.push_back(run_tool(call));
    if (action.tool_calls.empty()) {
      // The final text: an answer when its last line says so, otherwise none.
      if (const auto n = text_answer(action.text)) {
        answer_ = *n;
        answered_by_ = "text";
      }
      done_ = true;
    }
    if (answer_) done_ = true;
    if (!done_ && turns_ >= max_turns_) {
      done_ = true;
      obs.text = "Out of turns.";
    }
    if (done_) obs.rewards = parts();
    obs.done = done_;
    return obs;
  }

  Score score() override {
    Score s;
    s.parts = parts();
    for (const auto& p : s.parts) s.reward += p.value;
    s.success = correct();
    s.info = {{"expected", problem_.answer},
              {"answer", answer_ ? json(*answer_) : json()},
              {"answered_by", answered_by_.empty() ? json() : json(answered_by_)},
              {"turns", turns_},
              {"calculator_calls", calculator_calls_},
              {"split", split_name(split_)},
              {"index", index_},
              {"expression", problem_.expression}};
    return s;
  }

  std::string snapshot() override {
    if (problem_.prompt.empty()) throw EnvError(ODY_ENV_ERR_INVALID_ACTION, "snapshot before reset");
    return json{{"kind", "arith"},
                {"version", kSnapshotVersion},
                {"config", config_json()},
                {"problem",
                 {{"prompt", problem_.prompt},
                  {"expression", problem_.expression},
                  {"answer", problem_.answer},
                  {"steps", problem_.steps}}},
                {"split", split_name(split_)},
                {"index", index_},
                {"turns", turns_},
                {"calculator_calls", calculator_calls_},
                {"calculator_ok", calculator_ok_},
                {"answer", answer_ ? json(*answer_) : json()},
                {"answered_by", answered_by_},
                {"done", done_}}
        .dump();
  }

  void restore(std::string_view bytes) override {
    const json state = odyssey::env::parse_snapshot(bytes, "arith", kSnapshotVersion, "kind");
    if (state.at("config") != config_json())
      throw EnvError(ODY_ENV_ERR_UNSUPPORTED, "the snapshot was taken with another config: " +
                                                  state.at("config").dump() + " (this instance: " +
                                                  config_json().dump() + ")");
    Problem p;
    const json& pj = state.at("problem");
    p.prompt = pj.at("prompt").get<std::string>();
    p.expression = pj.at("expression").get<std::string>();
    p.answer = pj.at("answer").get<int64_t>();
    p.steps = pj.at("steps").get<int>();
    const int turns = state.at("turns").get<int>();
    if (p.prompt.empty() || turns < 0 || turns > max_turns_)
      throw EnvError(ODY_ENV_ERR_UNSUPPORTED, "the snapshot's state does not fit this config");
    const std::string split = state.at("split").get<std::string>();
    if (split != "train" && split != "eval") throw EnvError(ODY_ENV_ERR_UNSUPPORTED, "bad split in snapshot");
    problem_ = p;
    split_ = split == "eval" ? Split::kEval : Split::kTrain;
    index_ = state.at("index").get<uint64_t>();
    turns_ = turns;
    calculator_calls_ = state.at("calculator_calls").get<int>();
    calculator_ok_ = state.at("calculator_ok").get<int>();
    answer_.reset();
    if (!state.at("answer").is_null()) answer_ = state.at("answer").get<int64_t>();
    answered_by_ = state.at("answered_by").get<std::string>();
    done_ = state.at("done").get<bool>();
  }

 private:
  std::string calculate(const json& args) {
    if (answer_) throw ToolError("you already answered; the episode is over");
    const auto it = args.find("expression");
    if (it == args.end() || !it->is_string()) throw ToolError("'expression' must be a string");
    ++calculator_calls_;
    const Evaluation e = evaluate(it->get<std::string>());
    if (!e.ok()) throw ToolError(e.error);
    ++calculator_ok_;
    return e.value->to_string();
  }

  std::string record_answer(const json& args) {
    if (answer_) throw ToolError("you already answered; the episode is over");
    const auto it = args.find("value");
    if (it == args.end()) throw ToolError("'value' is required");
    answer_ = integer_value(*it);
    answered_by_ = "tool";
    return "recorded " + std::to_string(*answer_);
  }

  bool correct() const { return answer_ && *answer_ == problem_.answer; }

  std::vector<odyssey::env::RewardPart> parts() const {
    return {{"correct", correct() ? 1.0 : 0.0},
            {"format", answer_ ? format_bonus_ : 0.0},
            {"tool_use", correct() && calculator_ok_ > 0 ? tool_bonus_ : 0.0}};
  }

  json config_json() const {
    return {{"min_steps", settings_.min_steps}, {"max_steps", settings_.max_steps},
            {"max_operand", settings_.max_operand}, {"word_problems", settings_.word_problems},
            {"max_turns", max_turns_}, {"format_bonus", format_bonus_}, {"tool_bonus", tool_bonus_}};
  }

  ProblemSettings settings_;
  int max_turns_ = 6;
  double format_bonus_ = 0.1;
  double tool_bonus_ = 0.0;

  Problem problem_;
  Split split_ = Split::kTrain;
  uint64_t index_ = 0;
  int turns_ = 0;
  int calculator_calls_ = 0;
  int calculator_ok_ = 0;
  std::optional<int64_t> answer_;
  std::string answered_by_;  // "tool", "text" or ""
  bool done_ = false;
};

}  // namespace

ODY_ENV_PLUGIN_WITH_SNAPSHOT(Arith, "arith", "1.0.0",
                             "Arithmetic problems (terse or word problems) with an exact calculator tool")
