// Loading environment plugins (shared libraries with the C ABI of <odyssey/env.h>) and running
// them in this process.
//
//   ODY_ASSIGN_OR_RETURN(auto plugin, Plugin::load("build/envs/libody_env_arith.so"));
//   ODY_ASSIGN_OR_RETURN(auto session, plugin->create(nlohmann::json::object()));
//
// load() refuses, with a message that names the file and what is wrong: a file dlopen cannot
// open (dlerror's text), a missing entry point ody_env_plugin_v1, a table for another ABI
// version or a smaller struct_size, missing required functions (named), a bad plugin name,
// tools_json that is not a JSON array of {name, description, input_schema} with unique names
// and valid JSON Schemas of type "object", and snapshot capability without snapshot/restore.
//
// In-process sessions are for trusted plugins: a plugin that crashes takes the process with
// it, and a call cannot be interrupted. Untrusted or fragile plugins run under env-host
// (envs/env_host.h), which offers the same EnvSession with limits, timeouts and restarts.
//
// Discovery: find_plugin("arith") looks for lib<prefix>arith.so (prefix "ody_env_") in, in
// order, the directories of $ODYSSEY_ENV_PATH (':'-separated), `extra_dirs`, and the built-in
// plugin directory next to the odyssey binary (<exe dir>/../envs/plugins, and the build tree's
// envs/ output directory). A name containing '/' is taken as a path.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "envs/session.h"
#include "odyssey/env.h"

namespace odyssey::envs {

class Plugin : public std::enable_shared_from_this<Plugin> {
 public:
  static Result<std::shared_ptr<Plugin>> load(const std::string& path);
  ~Plugin();

  const EnvInfo& info() const { return info_; }
  const ody_env_plugin& table() const { return *table_; }
  const std::string& path() const { return path_; }

  // A new instance from a JSON config (an object); the session keeps the plugin loaded.
  Result<std::unique_ptr<EnvSession>> create(const nlohmann::json& config);

 private:
  Plugin() = default;
  void* handle_ = nullptr;
  const ody_env_plugin* table_ = nullptr;
  std::string path_;
  EnvInfo info_;
};

// The plugin file for `name_or_path` (see Discovery above); kNotFound lists where it looked.
Result<std::string> find_plugin(const std::string& name_or_path, const std::vector<std::string>& extra_dirs = {});
// Every plugin file found in those directories (for `odyssey env list`), by path.
std::vector<std::string> discover_plugins(const std::vector<std::string>& extra_dirs = {});
// Checks a tools JSON array as load() does; the message names the tool and field.
Result<std::vector<ToolSpec>> parse_tools(const nlohmann::json& tools, const std::string& where);

}  // namespace odyssey::envs
