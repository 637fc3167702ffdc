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

env::Observation reset(EnvSession& session, const nlohmann::json& task, uint64_t seed) {
  auto obs = session.reset(task, seed);
  EXPECT_TRUE(obs.ok()) << obs.status().to_string();
  return obs.ok() ? *obs : env::Observation{};
}

env::Observation step(EnvSession& session, const env::Action& action) {
  auto obs = session.step(action);
  EXPECT_TRUE(obs.ok()) << obs.status().to_string();
  return obs.ok() ? *obs : env::Observation{};
}

env::Score score(EnvSession& session) {
  auto result = session.score();
  EXPECT_TRUE(result.ok()) << result.status().to_string();
  return result.ok() ? *result : env::Score{};
}

double part(const env::Score& score, const std::string& name) {
  for (const auto& p : score.parts)
    if (p.name == name) return p.value;
  ADD_FAILURE() << "no reward part " << name;
  return -1;
}

}  // namespace odyssey::envs::test_support
