// Test plugin: a table of the right ABI whose step and score are NULL, and which claims
// snapshots without providing them. Plugin::load must refuse it, naming every missing function.
#include "odyssey/env.h"

namespace {
ody_env_status create(ody_env_string, ody_env**, ody_env_error*) { return ODY_ENV_ERR_INTERNAL; }
void destroy(ody_env*) {}
ody_env_status reset(ody_env*, ody_env_string, uint64_t, ody_env_observation*, ody_env_error*) { return ODY_ENV_ERR_INTERNAL; }
void free_observation(ody_env*, ody_env_observation*) {}
void free_score(ody_env*, ody_env_score*) {}

const ody_env_plugin kTable = {
    ODY_ENV_ABI_VERSION, sizeof(ody_env_plugin), "missing_functions", "1.0.0", "has no step or score", "[]",
    ODY_ENV_CAP_SNAPSHOT, create, destroy, reset, /*step=*/nullptr, /*score=*/nullptr, free_observation, free_score,
    /*snapshot=*/nullptr, /*restore=*/nullptr, /*free_buffer=*/nullptr};
}  // namespace

extern "C" ODY_ENV_EXPORT const ody_env_plugin* ody_env_plugin_v1(uint32_t host_abi_version) {
  return host_abi_version == ODY_ENV_ABI_VERSION ? &kTable : nullptr;
}
