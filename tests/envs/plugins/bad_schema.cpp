// Test plugin: a complete table whose second tool's input schema is not a valid JSON Schema
// (its "query" property has type "strng"). Plugin::load must refuse it, naming the tool.
#include "odyssey/env.h"

namespace {
ody_env_status create(ody_env_string, ody_env**, ody_env_error*) { return ODY_ENV_ERR_INTERNAL; }
void destroy(ody_env*) {}
ody_env_status reset(ody_env*, ody_env_string, uint64_t, ody_env_observation*, ody_env_error*) { return ODY_ENV_ERR_INTERNAL; }
ody_env_status step(ody_env*, const ody_env_action*, ody_env_observation*, ody_env_error*) { return ODY_ENV_ERR_INTERNAL; }
ody_env_status score(ody_env*, ody_env_score*, ody_env_error*) { return ODY_ENV_ERR_INTERNAL; }
void free_observation(ody_env*, ody_env_observation*) {}
void free_score(ody_env*, ody_env_score*) {}

const char kTools[] = R"([
  {"name": "fetch", "description": "Fetches a page",
   "input_schema": {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]}},
  {"name": "search", "description": "Searches the web",
   "input_schema": {"type": "object", "properties": {"query": {"type": "strng"}}}}
])";

const ody_env_plugin kTable = {
    ODY_ENV_ABI_VERSION, sizeof(ody_env_plugin), "bad_schema", "1.0.0", "a tool with an invalid schema", kTools, 0,
    create, destroy, reset, step, score, free_observation, free_score, nullptr, nullptr, nullptr};
}  // namespace

extern "C" ODY_ENV_EXPORT const ody_env_plugin* ody_env_plugin_v1(uint32_t host_abi_version) {
  return host_abi_version == ODY_ENV_ABI_VERSION ? &kTable : nullptr;
}
