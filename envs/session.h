// An environment as the framework sees it: one episode-running instance, whatever serves it
// (a plugin in this process, a plugin in a sandboxed `odyssey env-host` process, or an MCP
// server's tools). Actors, `odyssey env check` and the tests talk to this interface only.
//
// The data types are the SDK's own (odyssey::env::Action, Observation, Score, ... in
// <odyssey/env_sdk.hpp>), so a plugin's C++ values and the host's are the same structs.
//
// Contract: reset starts an episode (same task and seed -> same episode); step takes the
// model's turn with tool calls that are already parsed and validated (envs/turn.h does that);
// score grades the episode. Failures come back as Status (naming the plugin and call); a
// session whose last call failed with kInternal or kUnavailable (crashed or hung host) must be
// reset before it is used again. One thread at a time per session.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "odyssey/env_sdk.hpp"

namespace odyssey::envs {

struct ToolSpec {
  std::string name;
  std::string description;
  nlohmann::json input_schema;  // JSON Schema, "type": "object"
};

// What a plugin (or MCP server) says about itself.
struct EnvInfo {
  std::string name;
  std::string version;
  std::string description;
  std::vector<ToolSpec> tools;
  bool snapshots = false;  // snapshot/restore offered
  bool images = false;     // observations may carry images
  std::string source;      // the plugin file, or the MCP command line
  std::string source_hash; // hex XXH3-128 of the plugin file (recorded in trajectories); "" for MCP
};

class EnvSession {
 public:
  virtual ~EnvSession() = default;
  virtual const EnvInfo& info() const = 0;
  virtual Result<env::Observation> reset(const nlohmann::json& task, uint64_t seed) = 0;
  virtual Result<env::Observation> step(const env::Action& action) = 0;
  virtual Result<env::Score> score() = 0;
  // kFailedPrecondition when !info().snapshots.
  virtual Result<std::string> snapshot() = 0;
  virtual Status restore(std::string_view bytes) = 0;
};

}  // namespace odyssey::envs
