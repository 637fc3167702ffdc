// Helpers for the built-in environments' tests: each plugin loaded once from the build's plugin
// directory, sessions made from a config, tool calls written as the model's action would carry them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "envs/plugin.h"

namespace odyssey::envs::test_support {

// libody_env_<name>.so from ODYSSEY_PLUGIN_DIR, loaded on first use and kept (nullptr, with a
// test failure recorded, when it does not load).
std::shared_ptr<Plugin> builtin_plugin(const std::string& name);

// A session of the built-in `name` with `config` (nullptr, with a test failure recorded, when
// the plugin or the config is refused).
std::unique_ptr<EnvSession> builtin_session(const std::string& name,
                                            const nlohmann::json& config = nlohmann::json::object());

// An action of one tool call and no text.
env::Action tool_call(const std::string& tool, const nlohmann::json& arguments, const std::string& id = "call_1");

// The session's reset, step and score, each with a test failure recorded (and an empty value
// returned) when the session refuses.
env::Observation reset(EnvSession& session, const nlohmann::json& task, uint64_t seed = 0);
env::Observation step(EnvSession& session, const env::Action& action);
env::Score score(EnvSession& session);

// The value of the score's part `name` (-1, with a test failure recorded, when it has none).
double part(const env::Score& score, const std::string& name);

}  // namespace odyssey::envs::test_support
