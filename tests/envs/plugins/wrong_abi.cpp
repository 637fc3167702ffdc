// Test plugin: a table that claims ABI version 2 (a future, incompatible ABI) and ignores the
// host's version. Plugin::load must refuse it, naming both versions.
#include "odyssey/env.h"

namespace {
ody_env_status create(ody_env_string, ody_env**, ody_env_error*) { return ODY_ENV_ERR_INTERNAL; }
void destroy(ody_env*) {}
ody_env_status reset(ody_env*, ody_env_string, uint64_t, ody_env_observation*, ody_env_error*) { return ODY_ENV_ERR_INTERNAL; }
ody_env_status step(ody_env*, const ody_env_action*, ody_env_observation*, ody_env_error*) { return ODY_ENV_ERR_INTERNAL; }
ody_env_status score(ody_env*, ody_env_score*, ody_env_error*) { return ODY_ENV_ERR_INTERNAL; }
void free_observation(ody_env*, ody_env_observation*) {}
void free_score(ody_env*, ody_env_score*) {}

const ody_env_plugin kTable = {
    /*abi_version=*/2, sizeof(ody_env_plugin), "wrong_abi", "1.0.0", "claims a future ABI", "[]", 0,
    create, destroy, reset, step, score, free_observation, free_score, nullptr, nullptr, nullptr};
}  // namespace

extern "C" ODY_ENV_EXPORT const ody_env_plugin* ody_env_plugin_v1(uint32_t /*host_abi_version*/) { return &kTable; }
