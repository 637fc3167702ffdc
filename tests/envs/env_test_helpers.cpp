#include "envs/env_test_helpers.h"

#include <map>
#include <mutex>

#include <gtest/gtest.h>

namespace odyssey::envs::test_support {

std::shared_ptr<Plugin> builtin_plugin(const std::string& name) {
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<Plugin>> loaded;
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = loaded.find(name);
  if (it != loaded.end()) return it->second;
  auto plugin = Plugin::load(std::string(ODYSSEY_PLUGIN_DIR) + "/libody_env_" + name + ".so");
  EXPECT_TRUE(plugin.ok()) << plugin.status().to_string();
  return loaded[name] = plugin.ok() ? *plugin : nullptr;
}

std::unique_ptr<EnvSession> builtin_session(const std::string& name, const nlohmann::json& config) {
  auto plugin = builtin_plugin(name);
  if (!plugin) return nullptr;
  auto session = plugin->create(config);
  EXPECT_TRUE(session.ok()) << session.status().to_string();
  return session.ok() ? std::move(*session) : nullptr;
}

env::Action tool_call(const std::string& tool, const nlohmann::json& arguments, const std::string& id) {
  return {"", {{id, tool, arguments}}};
}

}  // namespace odyssey::envs::test_support
