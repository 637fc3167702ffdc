// Test plugin: the entry point exists but returns no table (as a plugin does for a host ABI
// version it cannot serve). Plugin::load must refuse it and say so.
#include "odyssey/env.h"

extern "C" ODY_ENV_EXPORT const ody_env_plugin* ody_env_plugin_v1(uint32_t /*host_abi_version*/) { return nullptr; }
