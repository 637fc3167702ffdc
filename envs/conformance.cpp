// The conformance suite of `odyssey env check` (envs/conformance.h).
#include "envs/conformance.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "envs/json_schema.h"
#include "envs/plugin.h"
#include "envs/turn.h"

namespace odyssey::envs {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr int kMaxSchemaDepth = 8;

// ---- Timing every call -------------------------------------------------------------------------

struct CallStats {
  Clock::duration slowest{0};
  std::string slowest_call;
  std::vector<std::string> timeouts;  // "step: <message>"
};

const Status& status_of(const Status& s) { return s; }
template <class T>
const Status& status_of(const Result<T>& r) { return r.status(); }

// An EnvSession that times each call of the one it wraps.
class TimedSession final : public EnvSession {
 public:
  TimedSession(std::unique_ptr<EnvSession> inner, CallStats* stats) : inner_(std::move(inner)), stats_(stats) {}
  const EnvInfo& info() const override { return inner_->info(); }
  Result<env::Observation> reset(const json& task, uint64_t seed) override {
    return timed("reset", [&] { return inner_->reset(task, seed); });
  }
  Result<env::Observation> step(const env::Action& action) override {
    return timed("step", [&] { return inner_->step(action); });
  }
  Result<env::Score> score() override { return timed("score", [&] { return inner_->score(); }); }
  Result<std::string> snapshot() override { return timed("snapshot", [&] { return inner_->snapshot(); }); }
  Status restore(std::string_view bytes) override { return timed("restore", [&] { return inner_->restore(bytes); }); }

 private:
  template <class Fn>
  auto timed(const char* call, Fn&& fn) -> decltype(fn()) {
    const Clock::time_point start = Clock::now();
    auto result = fn();
    const Clock::duration elapsed = Clock::now() - start;
    if (elapsed > stats_->slowest) {
      stats_->slowest = elapsed;
      stats_->slowest_call = call;
    }
    const Status& status = status_of(result);
    if (status.code() == StatusCode::kTimeout) stats_->timeouts.push_back(fmt::format("{}: {}", call, status.message()));
    return result;
  }

  std::unique_ptr<EnvSession> inner_;
  CallStats* stats_;
};

// ---- Arguments from a schema -------------------------------------------------------------------

std::string first_type(const json& schema) {
  auto type = schema.find("type");
  if (type == schema.end()) {
    if (schema.contains("properties") || schema.contains("required")) return "object";
    if (schema.contains("items") || schema.contains("prefixItems")) return "array";
    return "string";
  }
  if (type->is_string()) return type->get<std::string>();
  if (type->is_array()) {
    for (const json& t : *type)
      if (t.is_string() && t != "null") return t.get<std::string>();
    if (!type->empty() && (*type)[0].is_string()) return (*type)[0].get<std::string>();
  }
  return "string";
}

std::optional<double> number_key(const json& schema, const char* key) {
  auto it = schema.find(key);
  if (it == schema.end() || !it->is_number()) return std::nullopt;
  return it->get<double>();
}

std::optional<json> generate(const json& schema, int variant, bool hints, int depth) {
  if (depth > kMaxSchemaDepth) return std::nullopt;
  if (schema.is_boolean()) return schema.get<bool>() ? std::optional<json>(json(variant)) : std::nullopt;
  if (!schema.is_object()) return std::nullopt;
  if (hints) {
    if (auto d = schema.find("default"); d != schema.end() && variant == 0) return *d;
    if (auto ex = schema.find("examples"); ex != schema.end() && ex->is_array() && !ex->empty())
      return (*ex)[size_t(variant) % ex->size()];
  }
  if (auto c = schema.find("const"); c != schema.end()) return *c;
  if (auto e = schema.find("enum"); e != schema.end() && e->is_array() && !e->empty())
    return (*e)[size_t(variant) % e->size()];
  for (const char* key : {"anyOf", "oneOf"}) {
    auto alts = schema.find(key);
    if (alts == schema.end() || !alts->is_array() || alts->empty()) continue;
    if (!schema.contains("type") && !schema.contains("properties")) {
      for (const json& alt : *alts)
        if (auto v = generate(alt, variant, hints, depth + 1)) return v;
    }
  }
  if (auto all = schema.find("allOf"); all != schema.end() && all->is_array() && !all->empty() &&
                                        !schema.contains("type") && !schema.contains("properties"))
    return generate((*all)[0], variant, hints, depth + 1);

  const std::string type = first_type(schema);
  if (type == "integer" || type == "number") {
    std::optional<double> lo = number_key(schema, "minimum"), hi = number_key(schema, "maximum");
    if (auto x = number_key(schema, "exclusiveMinimum")) lo = type == "integer" ? std::floor(*x) + 1 : *x + 0.5;
    if (auto x = number_key(schema, "exclusiveMaximum")) hi = type == "integer" ? std::ceil(*x) - 1 : *x - 0.5;
    double value = variant;
    if (lo && hi) value = *hi >= *lo ? *lo + std::fmod(double(variant), std::floor(*hi - *lo) + 1) : *lo;
    else if (lo) value = *lo + variant;
    else if (hi) value = *hi - variant;
    if (auto m = number_key(schema, "multipleOf"); m && *m > 0) value = std::ceil(value / *m) * *m;
    if (type == "integer") return json(static_cast<int64_t>(std::llround(value)));
    return json(value);
  }
  if (type == "boolean") return json(variant % 2 == 1);
  if (type == "null") return json(nullptr);
  if (type == "string") {
    std::string value = variant == 0 ? "test" : fmt::format("test{}", variant);
    if (auto fmt_name = schema.find("format"); fmt_name != schema.end() && fmt_name->is_string()) {
      if (*fmt_name == "uri" || *fmt_name == "url") value = "https://example.com/";
      else if (*fmt_name == "email") value = "test@example.com";
      else if (*fmt_name == "date") value = "2024-01-01";
      else if (*fmt_name == "date-time") value = "2024-01-01T00:00:00Z";
    }
    if (auto min = number_key(schema, "minLength"); min && value.size() < size_t(*min)) value.resize(size_t(*min), 'x');
    if (auto max = number_key(schema, "maxLength"); max && value.size() > size_t(*max)) value.resize(size_t(*max));
    return json(value);
  }
  if (type == "array") {
    json items = json::array();
    size_t count = 0;
    if (auto min = number_key(schema, "minItems")) count = size_t(*min);
    if (auto prefix = schema.find("prefixItems"); prefix != schema.end() && prefix->is_array()) {
      for (const json& item_schema : *prefix) {
        if (items.size() >= std::max<size_t>(count, 1)) break;
        auto v = generate(item_schema, variant, hints, depth + 1);
        if (!v) return std::nullopt;
        items.push_back(std::move(*v));
      }
    }
    auto item_schema = schema.find("items");
    while (items.size() < count) {
      if (item_schema == schema.end()) {
        items.push_back(json(variant + int(items.size())));
        continue;
      }
      auto v = generate(*item_schema, variant + int(items.size()), hints, depth + 1);
      if (!v) return std::nullopt;
      items.push_back(std::move(*v));
    }
    return items;
  }
  if (type == "object") {
    json object = json::object();
    auto props = schema.find("properties");
    auto required = schema.find("required");
    if (required != schema.end() && required->is_array()) {
      for (const json& key : *required) {
        if (!key.is_string()) continue;
        const std::string name = key.get<std::string>();
        if (props != schema.end() && props->is_object() && props->contains(name)) {
          auto v = generate((*props)[name], variant, hints, depth + 1);
          if (!v) return std::nullopt;
          object[name] = std::move(*v);
        } else {
          object[name] = "test";
        }
      }
    }
    return object;
  }
  return std::nullopt;
}

// A value of another JSON type than the schema wants, for a schema-invalid call.
json wrong_type_value(const json& property_schema) {
  const std::string type = property_schema.is_object() ? first_type(property_schema) : "string";
  if (type == "string") return json::array({json::object()});
  return json("not a valid value");
}

// Arguments the schema rejects: a required property of the wrong type, or an unexpected
// property; nullopt when the schema accepts anything we try.
std::optional<json> invalid_arguments(const ToolSpec& tool, const JsonSchema& schema) {
  std::vector<json> candidates;
  if (auto valid = make_arguments(tool.input_schema, 0)) {
    for (auto& [key, value] : valid->items()) {
      json bad = *valid;
      const json& props = tool.input_schema.value("properties", json::object());
      bad[key] = wrong_type_value(props.is_object() && props.contains(key) ? props[key] : json());
      candidates.push_back(std::move(bad));
    }
  }
  candidates.push_back(json{{"__conformance_unexpected__", json::array({json::array()})}});
  candidates.push_back(json::object());
  for (json& c : candidates)
    if (!schema.validate(c).empty()) return c;
  return std::nullopt;
}

// ---- Scripted episodes -------------------------------------------------------------------------

// The turns the suite plays: step k calls tool k mod n with arguments made for variant k.
class Script {
 public:
  explicit Script(const std::vector<ToolSpec>& tools) {
    for (const ToolSpec& tool : tools) {
      auto compiled = JsonSchema::compile(tool.input_schema, tool.name);
      if (!compiled.ok()) continue;
      tools_.push_back({tool.name, tool.input_schema});
    }
  }
  void start_episode() { next_call_ = 0; }
  env::Action turn(int step) {
    env::Action action;
    action.text = fmt::format("conformance check, turn {}", step);
    if (tools_.empty()) return action;
    const auto& [name, schema] = tools_[size_t(step) % tools_.size()];
    if (auto args = make_arguments(schema, step))
      action.tool_calls.push_back({fmt::format("call_{}", next_call_++), name, std::move(*args)});
    else
      unscriptable_.push_back(name);
    return action;
  }
  // Tools for which no valid arguments could be made.
  std::vector<std::string> unscriptable() const {
    std::vector<std::string> names = unscriptable_;
    std::sort(names.begin(), names.end());
    names.erase(std::unique(names.begin(), names.end()), names.end());
    return names;
  }

 private:
  std::vector<std::pair<std::string, json>> tools_;
  std::vector<std::string> unscriptable_;
  uint64_t next_call_ = 0;
};

json observation_json(const env::Observation& obs, bool with_info) {
  json results = json::array();
  for (const env::ToolResult& r : obs.tool_results) results.push_back({r.call_id, r.content, r.is_error});
  json images = json::array();
  for (const env::Image& im : obs.images) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a: enough to tell two images apart
    for (uint8_t b : im.data) h = (h ^ b) * 1099511628211ull;
    images.push_back({int(im.format), im.width, im.height, im.data.size(), fmt::format("{:016x}", h)});
  }
  json rewards = json::array();
  for (const env::RewardPart& p : obs.rewards) rewards.push_back({p.name, p.value});
  json out = {{"text", obs.text}, {"tool_results", results}, {"images", images}, {"rewards", rewards}, {"done", obs.done}};
  if (with_info) out["info"] = obs.info;
  return out;
}

json score_json(const env::Score& s, bool with_info) {
  json parts = json::array();
  for (const env::RewardPart& p : s.parts) parts.push_back({p.name, p.value});
  json out = {{"reward", s.reward}, {"success", s.success}, {"parts", parts}};
  if (with_info) out["info"] = s.info;
  return out;
}

struct Trace {
  std::vector<env::Observation> observations;  // reset's first
  env::Score score;
  bool done = false;
  int steps = 0;

  json to_json(bool with_info) const {
    json obs = json::array();
    for (const env::Observation& o : observations) obs.push_back(observation_json(o, with_info));
    return {{"observations", obs}, {"score", score_json(score, with_info)}};
  }
};

std::string shorten(const std::string& s, size_t max = 60) {
  return s.size() <= max ? s : s.substr(0, max) + "...";
}

// Where two traces first differ, for a FAIL line: "step 2 /text: "a" vs "b"".
std::string first_difference(const json& a, const json& b) {
  const json patch = json::diff(a, b);
  if (patch.empty()) return "";
  const std::string path = patch[0].value("path", "");
  json::json_pointer pointer(path);
  std::string where = path;
  // "/observations/3/text" reads better as "observation 3 /text" (0 is reset's).
  const std::string prefix = "/observations/";
  if (path.compare(0, prefix.size(), prefix) == 0) {
    const size_t slash = path.find('/', prefix.size());
    const std::string index = path.substr(prefix.size(), slash == std::string::npos ? std::string::npos : slash - prefix.size());
    where = (index == "0" ? std::string("reset") : "step " + index) +
            (slash == std::string::npos ? std::string() : " " + path.substr(slash));
  }
  const std::string left = a.contains(pointer) ? shorten(a.at(pointer).dump()) : "(absent)";
  const std::string right = b.contains(pointer) ? shorten(b.at(pointer).dump()) : "(absent)";
  return fmt::format("{}: {} vs {}", where, left, right);
}

bool finite(double x) { return std::isfinite(x); }

// What a step's observation must be for `action`: one result per call, in order, by id.
std::string check_step(const env::Action& action, const env::Observation& obs) {
  if (obs.tool_results.size() != action.tool_calls.size())
    return fmt::format("{} tool results for {} calls", obs.tool_results.size(), action.tool_calls.size());
  for (size_t i = 0; i < obs.tool_results.size(); ++i)
    if (obs.tool_results[i].call_id != action.tool_calls[i].id)
      return fmt::format("tool result {} answers '{}', expected '{}'", i, obs.tool_results[i].call_id,
                         action.tool_calls[i].id);
  for (const env::RewardPart& p : obs.rewards)
    if (!finite(p.value)) return fmt::format("reward part '{}' is {}", p.name, p.value);
  return "";
}

std::string check_score(const env::Score& s) {
  if (!finite(s.reward)) return fmt::format("score reward is {}", s.reward);
  for (const env::RewardPart& p : s.parts)
    if (!finite(p.value)) return fmt::format("score part '{}' is {}", p.name, p.value);
  return "";
}

// ---- The suite ----------------------------------------------------------------------------------

class Suite {
 public:
  Suite(const SessionFactory& factory, const ConformanceOptions& options) : factory_(factory), options_(options) {}

  ConformanceReport run() {
    auto first = fresh();
    if (!first.ok()) {
      add("create", CheckOutcome::kFail, first.status().message());
      report_.subject = "(no session could be created)";
      return std::move(report_);
    }
    session_ = std::move(*first);
    const EnvInfo& info = session_->info();
    report_.subject = fmt::format("{} {} ({})", info.name, info.version, info.source);
    tools_ = info.tools;
    add("create", CheckOutcome::kPass,
        fmt::format("'{}': {} tool{}{}{}", info.name, tools_.size(), tools_.size() == 1 ? "" : "s",
                    info.snapshots ? ", snapshots" : "", info.images ? ", images" : ""));
    guarded("tool schemas", [&] { return check_tools(); });
    guarded("reset", [&] { return check_reset(); });
    guarded("episodes", [&] { return check_episodes(); });
    guarded("early score", [&] { return check_early_score(); });
    guarded("determinism", [&] { return check_determinism(); });
    guarded("different seeds", [&] { return check_seeds(); });
    guarded("rejected calls", [&] { return check_rejected_calls(); });
    guarded("step after done", [&] { return check_step_after_done(); });
    guarded("snapshot", [&] { return check_snapshot(); });
    check_call_time();
    return std::move(report_);
  }

 private:
  using Outcome = std::pair<CheckOutcome, std::string>;
  static Outcome pass(std::string d) { return {CheckOutcome::kPass, std::move(d)}; }
  static Outcome fail(std::string d) { return {CheckOutcome::kFail, std::move(d)}; }
  static Outcome warn(std::string d) { return {CheckOutcome::kWarn, std::move(d)}; }
  static Outcome skip(std::string d) { return {CheckOutcome::kSkip, std::move(d)}; }

  void add(std::string name, CheckOutcome outcome, std::string detail) {
    report_.checks.push_back({std::move(name), outcome, std::move(detail)});
  }
  // A check whose code throws (a bug in a check, or json trouble) fails instead of ending the run.
  template <class Fn>
  void guarded(const char* name, Fn&& fn) {
    try {
      Outcome o = fn();
      add(name, o.first, std::move(o.second));
    } catch (const std::exception& e) {
      add(name, CheckOutcome::kFail, fmt::format("the check itself failed: {}", e.what()));
    }
  }

  Result<std::unique_ptr<EnvSession>> fresh() {
    auto made = factory_();
    if (!made.ok()) return made.status().with_context("creating a session");
    return std::unique_ptr<EnvSession>(new TimedSession(std::move(*made), &stats_));
  }

  // Plays one scripted episode: reset, scripted turns until done or max_steps, score.
  Result<Trace> play(EnvSession& session, uint64_t seed, int max_steps = -1) {
    if (max_steps < 0) max_steps = options_.max_steps;
    Trace trace;
    Script script(tools_);
    auto first = session.reset(options_.task, seed);
    if (!first.ok()) return first.status().with_context(fmt::format("seed {}: reset", seed));
    trace.observations.push_back(std::move(*first));
    trace.done = trace.observations.back().done;
    while (!trace.done && trace.steps < max_steps) {
      const env::Action action = script.turn(trace.steps);
      auto obs = session.step(action);
      if (!obs.ok()) return obs.status().with_context(fmt::format("seed {}: step {}", seed, trace.steps + 1));
      ++trace.steps;
      if (std::string problem = check_step(action, *obs); !problem.empty())
        return Status(StatusCode::kInvalidArgument, fmt::format("seed {}: step {}: {}", seed, trace.steps, problem));
      trace.done = obs->done;
      trace.observations.push_back(std::move(*obs));
    }
    auto score = session.score();
    if (!score.ok()) return score.status().with_context(fmt::format("seed {}: score after {} steps", seed, trace.steps));
    if (std::string problem = check_score(*score); !problem.empty())
      return Status(StatusCode::kInvalidArgument, fmt::format("seed {}: {}", seed, problem));
    trace.score = std::move(*score);
    unscriptable_ = script.unscriptable();
    return trace;
  }

  Outcome check_tools() {
    json array = json::array();
    for (const ToolSpec& t : tools_)
      array.push_back({{"name", t.name}, {"description", t.description}, {"input_schema", t.input_schema}});
    auto parsed = parse_tools(array, "tools");
    if (!parsed.ok()) return fail(parsed.status().message());
    if (tools_.empty()) return pass("no tools: the model can only answer in text");
    std::vector<std::string> names, undocumented;
    for (const ToolSpec& t : tools_) {
      names.push_back(t.name);
      if (t.description.empty()) undocumented.push_back(t.name);
    }
    if (!undocumented.empty())
      return warn(fmt::format("no description for {} (the model reads it to choose a tool)", fmt::join(undocumented, ", ")));
    return pass(fmt::format("{}", fmt::join(names, ", ")));
  }

  Outcome check_reset() {
    auto obs = session_->reset(options_.task, options_.seed);
    if (!obs.ok()) return fail(obs.status().message());
    if (!obs->tool_results.empty()) return fail(fmt::format("reset returned {} tool results", obs->tool_results.size()));
    if (obs->done) return fail("reset returned done: the episode is over before the model's first turn");
    if (obs->text.empty() && obs->images.empty()) return warn("the first observation is empty: the model gets no task");
    return pass(fmt::format("\"{}\"", shorten(obs->text)));
  }

  Outcome check_episodes() {
    std::vector<std::string> lengths;
    int ended = 0, successes = 0;
    double low = std::numeric_limits<double>::infinity(), high = -low;
    for (int e = 0; e < options_.episodes; ++e) {
      auto trace = play(*session_, options_.seed + uint64_t(e));
      if (!trace.ok()) return fail(trace.status().message());
      lengths.push_back(std::to_string(trace->steps) + (trace->done ? "" : "+"));
      ended += trace->done ? 1 : 0;
      successes += trace->score.success ? 1 : 0;
      low = std::min(low, trace->score.reward);
      high = std::max(high, trace->score.reward);
    }
    if (options_.episodes <= 0) return skip("--episodes is 0");
    std::string detail = fmt::format("{} episode{}, steps {}, {} ended, success {}/{}, reward {:.3g}..{:.3g}",
                                     options_.episodes, options_.episodes == 1 ? "" : "s", fmt::join(lengths, " "),
                                     ended, successes, options_.episodes, low, high);
    if (ended < options_.episodes) detail += fmt::format(" ('+': not done after {} steps; scored anyway)", options_.max_steps);
    if (!unscriptable_.empty())
      return warn(detail + fmt::format("; no valid arguments could be made for {}", fmt::join(unscriptable_, ", ")));
    return pass(detail);
  }

  Outcome check_early_score() {
    auto obs = session_->reset(options_.task, options_.seed);
    if (!obs.ok()) return fail(obs.status().message());
    auto score = session_->score();
    if (!score.ok()) return fail("score right after reset: " + score.status().message());
    if (std::string problem = check_score(*score); !problem.empty()) return fail(problem);
    return pass(fmt::format("reward {:.3g}, success {}", score->reward, score->success));
  }

  Outcome check_determinism() {
    auto a = play(*session_, options_.seed);
    if (!a.ok()) return fail(a.status().message());
    auto other = fresh();
    if (!other.ok()) return fail(other.status().message());
    auto b = play(**other, options_.seed);
    if (!b.ok()) return fail("a second instance: " + b.status().message());
    auto c = play(*session_, options_.seed);  // the same instance, reset again
    if (!c.ok()) return fail("the same instance reset: " + c.status().message());
    const std::pair<const char*, const Trace*> others[] = {{"a second instance", &*b}, {"the same instance reset", &*c}};
    for (const auto& [who, trace] : others) {
      const std::string diff = first_difference(a->to_json(false), trace->to_json(false));
      if (!diff.empty()) return fail(fmt::format("seed {} twice, {} differs at {}", options_.seed, who, diff));
    }
    for (const auto& [who, trace] : others) {
      const std::string diff = first_difference(a->to_json(true), trace->to_json(true));
      if (!diff.empty()) return warn(fmt::format("only info differs ({}): {}", who, diff));
    }
    return pass(fmt::format("seed {}: {} step{} identical on a second instance and after a reset", options_.seed,
                            a->steps, a->steps == 1 ? "" : "s"));
  }

  Outcome check_seeds() {
    if (!options_.task.empty()) return skip("a fixed task was given");
    constexpr int kSeeds = 4;
    std::vector<json> traces;
    for (int i = 0; i < kSeeds; ++i) {
      auto t = play(*session_, options_.seed + 100 + uint64_t(i));
      if (!t.ok()) return fail(t.status().message());
      traces.push_back(t->to_json(true));
    }
    size_t distinct = 0;
    for (size_t i = 0; i < traces.size(); ++i)
      distinct += std::find(traces.begin(), traces.begin() + long(i), traces[i]) == traces.begin() + long(i) ? 1 : 0;
    if (distinct == 1)
      return warn(fmt::format("seeds {}..{} give identical episodes: does the environment draw its task from the seed?",
                              options_.seed + 100, options_.seed + 100 + kSeeds - 1));
    return pass(fmt::format("{} distinct episodes from {} seeds", distinct, kSeeds));
  }

  Outcome check_rejected_calls() {
    std::vector<std::pair<std::string, std::string>> calls = {
        {"malformed JSON", "{\"name\": \"" + (tools_.empty() ? std::string("x") : tools_[0].name) + "\", \"arguments\": {"},
        {"unknown tool", R"({"name": "conformance_no_such_tool", "arguments": {}})"},
    };
    std::string note;
    bool have_invalid = false;
    for (const ToolSpec& tool : tools_) {
      auto schema = JsonSchema::compile(tool.input_schema, tool.name);
      std::optional<json> bad = schema.ok() ? invalid_arguments(tool, *schema) : std::nullopt;
      if (!bad) continue;
      calls.push_back({"schema-invalid arguments", json{{"name", tool.name}, {"arguments", *bad}}.dump()});
      have_invalid = true;
      break;
    }
    if (!have_invalid && !tools_.empty()) note = "; every tool accepts any arguments we tried";
    std::vector<TurnPiece> pieces = {TurnPiece::Text("conformance check: bad calls")};
    for (const auto& call : calls) {
      pieces.push_back(TurnPiece::Special(SpecialToken::kToolCall));
      pieces.push_back(TurnPiece::Text(call.second));
      pieces.push_back(TurnPiece::Special(SpecialToken::kToolCallEnd));
    }
    TurnParser parser(tools_);
    const ParsedTurn turn = parser.parse_text_pieces(pieces);
    if (!turn.action.tool_calls.empty())
      return fail(fmt::format("the parser let '{}' through", turn.action.tool_calls[0].name));
    if (turn.rejected.size() != calls.size())
      return fail(fmt::format("{} of {} bad calls were rejected", turn.rejected.size(), calls.size()));

    auto obs = session_->reset(options_.task, options_.seed);
    if (!obs.ok()) return fail(obs.status().message());
    auto answered = session_->step(turn.action);
    if (!answered.ok()) return fail("a turn whose calls were all rejected: " + answered.status().message());
    if (std::string problem = check_step(turn.action, *answered); !problem.empty()) return fail(problem);
    const env::Observation merged = merge(turn, *answered);
    if (merged.tool_results.size() != calls.size())
      return fail(fmt::format("{} results for {} calls after merging", merged.tool_results.size(), calls.size()));
    std::vector<std::string> kinds;
    for (size_t i = 0; i < calls.size(); ++i) {
      const env::ToolResult& r = merged.tool_results[i];
      if (!r.is_error || r.content.empty() || r.call_id != turn.call_order[i])
        return fail(fmt::format("{} did not become an error result in its place", calls[i].first));
      kinds.push_back(calls[i].first);
    }
    return pass(fmt::format("{} became error results; the environment answered the turn that was left{}",
                            fmt::join(kinds, ", "), note));
  }

  Outcome check_step_after_done() {
    auto trace = play(*session_, options_.seed);
    if (!trace.ok()) return fail(trace.status().message());
    if (!trace->done) return skip(fmt::format("no episode ended within {} steps", options_.max_steps));
    Script script(tools_);
    const env::Action action = script.turn(trace->steps);
    auto obs = session_->step(action);
    std::string what;
    if (obs.ok()) {
      if (std::string problem = check_step(action, *obs); !problem.empty()) return fail(problem);
      what = fmt::format("answered (done={})", obs->done);
    } else {
      const StatusCode code = obs.status().code();
      if (code != StatusCode::kInvalidArgument && code != StatusCode::kFailedPrecondition)
        return fail(fmt::format("refused with {} (use ODY_ENV_ERR_INVALID_ACTION): {}", status_code_name(code),
                                obs.status().message()));
      what = "refused: " + shorten(obs.status().message(), 80);
    }
    auto score = session_->score();
    if (!score.ok()) return fail(what + "; then score failed: " + score.status().message());
    return pass(what + "; score still works");
  }

  Outcome check_snapshot() {
    if (!session_->info().snapshots) {
      auto bytes = session_->snapshot();
      if (bytes.ok()) return fail("snapshot() gave bytes, but the environment does not declare snapshots");
      return skip("not offered");
    }
    auto obs = session_->reset(options_.task, options_.seed);
    if (!obs.ok()) return fail(obs.status().message());
    Script script(tools_);
    int steps = 0;
    bool done = obs->done;
    if (!done) {
      auto first = session_->step(script.turn(steps++));
      if (!first.ok()) return fail(first.status().message());
      done = first->done;
    }
    auto bytes = session_->snapshot();
    if (!bytes.ok()) return fail(bytes.status().message());
    auto copy = fresh();
    if (!copy.ok()) return fail(copy.status().message());
    if (Status s = (*copy)->restore(*bytes); !s.ok()) return fail("restore into a fresh instance: " + s.message());
    int compared = 0;
    Script copy_script(tools_);
    for (int i = 0; i < steps; ++i) copy_script.turn(i);  // the same call ids from here on
    while (!done && steps < options_.max_steps) {
      const env::Action action = script.turn(steps);
      const env::Action copy_action = copy_script.turn(steps);
      ++steps;
      auto a = session_->step(action);
      auto b = (*copy)->step(copy_action);
      if (!a.ok()) return fail(fmt::format("original, step {}: {}", steps, a.status().message()));
      if (!b.ok()) return fail(fmt::format("restored copy, step {}: {}", steps, b.status().message()));
      const std::string diff = first_difference(observation_json(*a, true), observation_json(*b, true));
      if (!diff.empty()) return fail(fmt::format("the restored copy differs at step {}: {}", steps, diff));
      done = a->done;
      ++compared;
    }
    auto sa = session_->score();
    auto sb = (*copy)->score();
    if (!sa.ok() || !sb.ok()) return fail("score: " + (!sa.ok() ? sa.status() : sb.status()).message());
    if (std::string diff = first_difference(score_json(*sa, true), score_json(*sb, true)); !diff.empty())
      return fail("the restored copy's score differs: " + diff);

    auto garbage_target = fresh();
    if (!garbage_target.ok()) return fail(garbage_target.status().message());
    const std::string garbage("\x00\xff not a snapshot \x01", 20);
    Status restored = (*garbage_target)->restore(garbage);
    if (restored.ok()) return fail("restore accepted 20 bytes of garbage");
    std::string detail = fmt::format("{} bytes; a restored copy matched for {} step{} and the score; garbage refused",
                                     bytes->size(), compared, compared == 1 ? "" : "s");
    if (restored.code() == StatusCode::kInternal || restored.code() == StatusCode::kUnavailable)
      return warn(detail + fmt::format(", but as {} (use ODY_ENV_ERR_UNSUPPORTED)", status_code_name(restored.code())));
    return pass(detail);
  }

  void check_call_time() {
    const double ms = std::chrono::duration<double, std::milli>(stats_.slowest).count();
    const std::string slowest = fmt::format("slowest call: {} {:.1f} ms", stats_.slowest_call, ms);
    if (!stats_.timeouts.empty()) {
      add("call time", CheckOutcome::kFail,
          fmt::format("{} call{} timed out, first {}", stats_.timeouts.size(), stats_.timeouts.size() == 1 ? "" : "s",
                      shorten(stats_.timeouts[0], 120)));
      return;
    }
    if (!options_.call_timeout) {
      add("call time", CheckOutcome::kSkip, slowest + " (in-process calls cannot time out; --hosted enforces a limit)");
      return;
    }
    const double limit = double(options_.call_timeout->count());
    add("call time", ms > limit / 2 ? CheckOutcome::kWarn : CheckOutcome::kPass,
        fmt::format("{} of {:.0f} ms allowed", slowest, limit));
  }

  const SessionFactory& factory_;
  const ConformanceOptions& options_;
  ConformanceReport report_;
  CallStats stats_;
  std::unique_ptr<EnvSession> session_;
  std::vector<ToolSpec> tools_;
  std::vector<std::string> unscriptable_;
};

}  // namespace

const char* check_outcome_name(CheckOutcome outcome) {
  switch (outcome) {
    case CheckOutcome::kPass: return "PASS";
    case CheckOutcome::kFail: return "FAIL";
    case CheckOutcome::kWarn: return "WARN";
    case CheckOutcome::kSkip: return "SKIP";
  }
  return "?";
}

bool ConformanceReport::passed() const {
  return std::none_of(checks.begin(), checks.end(), [](const CheckResult& c) { return c.outcome == CheckOutcome::kFail; });
}

std::string ConformanceReport::to_text() const {
  std::string out = fmt::format("env check: {}\n", subject);
  int counts[4] = {0, 0, 0, 0};
  for (const CheckResult& c : checks) {
    out += fmt::format("{}  {:<16} {}\n", check_outcome_name(c.outcome), c.name, c.detail);
    ++counts[int(c.outcome)];
  }
  const int warnings = counts[int(CheckOutcome::kWarn)];
  out += fmt::format("{}: {} check{}, {} passed, {} failed, {} warning{}, {} skipped\n", passed() ? "PASSED" : "FAILED",
                     checks.size(), checks.size() == 1 ? "" : "s", counts[int(CheckOutcome::kPass)],
                     counts[int(CheckOutcome::kFail)], warnings, warnings == 1 ? "" : "s",
                     counts[int(CheckOutcome::kSkip)]);
  return out;
}

json ConformanceReport::to_json() const {
  json list = json::array();
  for (const CheckResult& c : checks)
    list.push_back({{"name", c.name}, {"outcome", check_outcome_name(c.outcome)}, {"detail", c.detail}});
  return {{"subject", subject}, {"passed", passed()}, {"checks", list}};
}

std::optional<json> make_arguments(const json& schema, int variant) {
  auto compiled = JsonSchema::compile(schema, "schema");
  if (!compiled.ok()) return std::nullopt;
  for (bool hints : {true, false}) {
    for (int v : {variant, 0}) {
      std::optional<json> value = generate(schema, v, hints, 0);
      if (value && value->is_object() && compiled->validate(*value).empty()) return value;
    }
  }
  return std::nullopt;
}

ConformanceReport run_conformance(const SessionFactory& make_session, const ConformanceOptions& options) {
  return Suite(make_session, options).run();
}

}  // namespace odyssey::envs
