// The C++ SDK for odyssey environment plugins: derive from odyssey::env::Environment, declare
// tools, implement reset / answer / score, and register the class with one macro. The SDK turns
// it into the C ABI of <odyssey/env.h> (no exception crosses it; memory is freed by the pairs
// the ABI defines). Header-only; needs nlohmann/json (Debian: nlohmann-json3-dev) and C++17.
//
//   class Counter : public odyssey::env::Environment {
//    public:
//     explicit Counter(const nlohmann::json& config) {
//       add_tool({"add", "Adds n to the counter", {{"type", "object"},
//                 {"properties", {{"n", {{"type", "integer"}}}}}, {"required", {"n"}}}},
//                [this](const nlohmann::json& args) { total_ += args["n"].get<int>();
//                                                     return std::to_string(total_); });
//     }
//     Observation reset(const nlohmann::json& task, uint64_t seed) override { ... }
//     Score score() override { ... }
//   };
//   ODY_ENV_PLUGIN(Counter, "counter", "1.0.0", "Counts to a target")
//
// The default step() runs each tool call through its handler, in order: a handler that throws
// ToolError (or any std::exception) gives an error result the model sees; after the calls it
// asks on_turn(action, observation) to add text, rewards or done (e.g. grade a final answer).
// Override step() itself for full control. envs/examples/ has a complete plugin.
#pragma once

#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "odyssey/env.h"

namespace odyssey::env {

// Thrown by a tool handler: the call fails with this message as its result (is_error = 1).
struct ToolError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Thrown from create / reset / step: the whole call fails with this status and message.
struct EnvError : std::runtime_error {
  EnvError(ody_env_status s, const std::string& message) : std::runtime_error(message), status(s) {}
  ody_env_status status;
};

struct Tool {
  std::string name;
  std::string description;
  nlohmann::json input_schema;  // a JSON Schema with "type": "object"
};

struct ToolCall {
  std::string id;
  std::string name;
  nlohmann::json arguments;  // an object, already valid against the tool's schema
};

struct Action {
  std::string text;  // the turn's text outside tool calls
  std::vector<ToolCall> tool_calls;
};

struct ToolResult {
  std::string call_id;
  std::string content;
  bool is_error = false;
};

struct Image {
  ody_env_image_format format = ODY_ENV_IMAGE_RGB8;
  uint32_t width = 0;
  uint32_t height = 0;
  std::vector<uint8_t> data;
};

struct RewardPart {
  std::string name;
  double value = 0.0;
};

struct Observation {
  std::string text;
  std::vector<ToolResult> tool_results;
  std::vector<Image> images;
  std::vector<RewardPart> rewards;
  bool done = false;
  nlohmann::json info = nlohmann::json::object();
};

struct Score {
  double reward = 0.0;
  bool success = false;
  std::vector<RewardPart> parts;
  nlohmann::json info = nlohmann::json::object();
};

class Environment {
 public:
  using Handler = std::function<std::string(const nlohmann::json& arguments)>;
  virtual ~Environment() = default;

  virtual Observation reset(const nlohmann::json& task, uint64_t seed) = 0;
  virtual Observation step(const Action& action) {
    Observation obs;
    for (const ToolCall& call : action.tool_calls) obs.tool_results.push_back(run_tool(call));
    on_turn(action, obs);
    return obs;
  }
  virtual Score score() = 0;

  // Snapshot support: override both and register with ODY_ENV_PLUGIN_WITH_SNAPSHOT.
  virtual std::string snapshot() { throw EnvError(ODY_ENV_ERR_UNSUPPORTED, "snapshot is not supported"); }
  virtual void restore(std::string_view /*bytes*/) {
    throw EnvError(ODY_ENV_ERR_UNSUPPORTED, "restore is not supported");
  }

  const std::vector<Tool>& tools() const { return tools_; }

 protected:
  // Called by the default step() after the tool calls ran; add text, rewards, done.
  virtual void on_turn(const Action& /*action*/, Observation& /*obs*/) {}

  void add_tool(Tool tool, Handler handler) {
    tools_.push_back(std::move(tool));
    handlers_.push_back(std::move(handler));
  }

  ToolResult run_tool(const ToolCall& call) {
    for (size_t i = 0; i < tools_.size(); ++i) {
      if (tools_[i].name != call.name) continue;
      try {
        return {call.id, handlers_[i](call.arguments), false};
      } catch (const std::exception& e) {
        return {call.id, e.what(), true};
      }
    }
    return {call.id, "unknown tool '" + call.name + "'", true};
  }

 private:
  std::vector<Tool> tools_;
  std::vector<Handler> handlers_;
};

namespace detail {

inline void set_error(ody_env_error* err, const char* message) {
  if (err == nullptr) return;
  std::strncpy(err->message, message, ODY_ENV_ERROR_CAPACITY - 1);
  err->message[ODY_ENV_ERROR_CAPACITY - 1] = '\0';
}

inline std::string_view view(ody_env_string s) { return {s.data == nullptr ? "" : s.data, s.size}; }
inline ody_env_string str(const std::string& s) { return {s.data(), s.size()}; }

// Runs fn, turning exceptions into a status and message.
template <class Fn>
ody_env_status guarded(ody_env_error* err, ody_env_status fallback, Fn&& fn) {
  try {
    fn();
    return ODY_ENV_OK;
  } catch (const EnvError& e) {
    set_error(err, e.what());
    return e.status;
  } catch (const nlohmann::json::exception& e) {
    set_error(err, e.what());
    return fallback;
  } catch (const std::exception& e) {
    set_error(err, e.what());
    return fallback;
  } catch (...) {
    set_error(err, "unknown exception");
    return ODY_ENV_ERR_INTERNAL;
  }
}

// Keeps an Observation's C view alive until free_observation.
struct ObservationHolder {
  Observation obs;
  std::string info;
  std::vector<ody_env_tool_result> results;
  std::vector<ody_env_image> images;
  std::vector<ody_env_reward_part> rewards;

  void fill(ody_env_observation* out) {
    info = obs.info.is_null() || obs.info.empty() ? std::string() : obs.info.dump();
    for (const auto& r : obs.tool_results) results.push_back({str(r.call_id), str(r.content), r.is_error ? 1 : 0});
    for (const auto& im : obs.images) images.push_back({im.format, im.width, im.height, im.data.data(), im.data.size()});
    for (const auto& p : obs.rewards) rewards.push_back({str(p.name), p.value});
    *out = ody_env_observation{};
    out->text = str(obs.text);
    out->tool_results = results.data();
    out->tool_result_count = static_cast<uint32_t>(results.size());
    out->images = images.data();
    out->image_count = static_cast<uint32_t>(images.size());
    out->rewards = rewards.data();
    out->reward_count = static_cast<uint32_t>(rewards.size());
    out->done = obs.done ? 1 : 0;
    out->info_json = str(info);
    out->plugin_data = this;
  }
};

struct ScoreHolder {
  Score score;
  std::string info;
  std::vector<ody_env_reward_part> parts;

  void fill(ody_env_score* out) {
    info = score.info.is_null() || score.info.empty() ? std::string() : score.info.dump();
    for (const auto& p : score.parts) parts.push_back({str(p.name), p.value});
    *out = ody_env_score{};
    out->reward = score.reward;
    out->success = score.success ? 1 : 0;
    out->parts = parts.data();
    out->part_count = static_cast<uint32_t>(parts.size());
    out->info_json = str(info);
    out->plugin_data = this;
  }
};

inline std::string tools_json(const std::vector<Tool>& tools) {
  nlohmann::json array = nlohmann::json::array();
  for (const Tool& t : tools)
    array.push_back({{"name", t.name}, {"description", t.description}, {"input_schema", t.input_schema}});
  return array.dump();
}

// The ody_env_plugin table for environment class T.
template <class T>
struct Adapter {
  static Environment* self(ody_env* env) { return reinterpret_cast<Environment*>(env); }

  static ody_env_status create(ody_env_string config, ody_env** out, ody_env_error* err) {
    return guarded(err, ODY_ENV_ERR_INVALID_CONFIG, [&] {
      const std::string_view text = view(config);
      nlohmann::json cfg = text.empty() ? nlohmann::json::object() : nlohmann::json::parse(text);
      if (!cfg.is_object()) throw EnvError(ODY_ENV_ERR_INVALID_CONFIG, "config must be a JSON object");
      std::unique_ptr<Environment> env(new T(cfg));
      *out = reinterpret_cast<ody_env*>(env.release());
    });
  }
  static void destroy(ody_env* env) { delete self(env); }
  static ody_env_status reset(ody_env* env, ody_env_string task, uint64_t seed, ody_env_observation* out,
                              ody_env_error* err) {
    return guarded(err, ODY_ENV_ERR_INVALID_TASK, [&] {
      const std::string_view text = view(task);
      nlohmann::json t = text.empty() ? nlohmann::json::object() : nlohmann::json::parse(text);
      if (!t.is_object()) throw EnvError(ODY_ENV_ERR_INVALID_TASK, "task must be a JSON object");
      auto holder = std::make_unique<ObservationHolder>();
      holder->obs = self(env)->reset(t, seed);
      holder.release()->fill(out);
    });
  }
  static ody_env_status step(ody_env* env, const ody_env_action* action, ody_env_observation* out,
                             ody_env_error* err) {
    return guarded(err, ODY_ENV_ERR_INTERNAL, [&] {
      Action a;
      a.text = std::string(view(action->text));
      for (uint32_t i = 0; i < action->tool_call_count; ++i) {
        const ody_env_tool_call& c = action->tool_calls[i];
        const std::string_view args = view(c.arguments_json);
        a.tool_calls.push_back({std::string(view(c.id)), std::string(view(c.name)),
                                args.empty() ? nlohmann::json::object() : nlohmann::json::parse(args)});
      }
      auto holder = std::make_unique<ObservationHolder>();
      holder->obs = self(env)->step(a);
      holder.release()->fill(out);
    });
  }
  static ody_env_status score(ody_env* env, ody_env_score* out, ody_env_error* err) {
    return guarded(err, ODY_ENV_ERR_INTERNAL, [&] {
      auto holder = std::make_unique<ScoreHolder>();
      holder->score = self(env)->score();
      holder.release()->fill(out);
    });
  }
  static void free_observation(ody_env*, ody_env_observation* obs) {
    delete static_cast<ObservationHolder*>(obs->plugin_data);
    *obs = ody_env_observation{};
  }
  static void free_score(ody_env*, ody_env_score* s) {
    delete static_cast<ScoreHolder*>(s->plugin_data);
    *s = ody_env_score{};
  }
  static ody_env_status snapshot(ody_env* env, ody_env_buffer* out, ody_env_error* err) {
    return guarded(err, ODY_ENV_ERR_INTERNAL, [&] {
      const std::string bytes = self(env)->snapshot();
      out->data = new uint8_t[bytes.size() == 0 ? 1 : bytes.size()];
      std::memcpy(out->data, bytes.data(), bytes.size());
      out->size = bytes.size();
    });
  }
  static ody_env_status restore(ody_env* env, ody_env_string bytes, ody_env_error* err) {
    return guarded(err, ODY_ENV_ERR_UNSUPPORTED, [&] { self(env)->restore(view(bytes)); });
  }
  static void free_buffer(ody_env*, ody_env_buffer* buffer) {
    delete[] buffer->data;
    *buffer = ody_env_buffer{};
  }

  // The tools are declared in T's constructor; an instance from an empty config lists them.
  // A class whose constructor needs config keys can instead define
  //   static std::vector<Tool> declared_tools();
  static const std::string& tools() {
    static const std::string json = [] {
      if constexpr (has_declared_tools<T>(0)) {
        return tools_json(T::declared_tools());
      } else {
        try {
          T probe(nlohmann::json::object());
          return tools_json(probe.tools());
        } catch (...) {
          return std::string("[]");
        }
      }
    }();
    return json;
  }

  template <class U>
  static constexpr auto has_declared_tools(int) -> decltype(U::declared_tools(), bool()) { return true; }
  template <class U>
  static constexpr bool has_declared_tools(...) { return false; }

  static const ody_env_plugin* table(const char* name, const char* version, const char* description,
                                     bool with_snapshot, uint64_t extra_capabilities) {
    static ody_env_plugin plugin = [&] {
      ody_env_plugin p{};
      p.abi_version = ODY_ENV_ABI_VERSION;
      p.struct_size = sizeof(ody_env_plugin);
      p.name = name;
      p.version = version;
      p.description = description;
      p.tools_json = tools().c_str();
      p.capabilities = extra_capabilities | (with_snapshot ? ODY_ENV_CAP_SNAPSHOT : 0);
      p.create = &create;
      p.destroy = &destroy;
      p.reset = &reset;
      p.step = &step;
      p.score = &score;
      p.free_observation = &free_observation;
      p.free_score = &free_score;
      if (with_snapshot) {
        p.snapshot = &snapshot;
        p.restore = &restore;
      }
      p.free_buffer = &free_buffer;
      return p;
    }();
    return &plugin;
  }
};

}  // namespace detail
}  // namespace odyssey::env

// Registers environment class CLASS as this library's plugin. One per shared library.
#define ODY_ENV_PLUGIN_EX(CLASS, NAME, VERSION, DESCRIPTION, WITH_SNAPSHOT, CAPABILITIES)                    \
  extern "C" ODY_ENV_EXPORT const ody_env_plugin* ody_env_plugin_v1(uint32_t host_abi_version) {          \
    if (host_abi_version != ODY_ENV_ABI_VERSION) return nullptr;                                           \
    return ::odyssey::env::detail::Adapter<CLASS>::table(NAME, VERSION, DESCRIPTION, WITH_SNAPSHOT,        \
                                                         CAPABILITIES);                                    \
  }
#define ODY_ENV_PLUGIN(CLASS, NAME, VERSION, DESCRIPTION) \
  ODY_ENV_PLUGIN_EX(CLASS, NAME, VERSION, DESCRIPTION, false, 0)
#define ODY_ENV_PLUGIN_WITH_SNAPSHOT(CLASS, NAME, VERSION, DESCRIPTION) \
  ODY_ENV_PLUGIN_EX(CLASS, NAME, VERSION, DESCRIPTION, true, 0)
