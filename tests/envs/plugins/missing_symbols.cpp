// Test plugin: a shared library without the entry point ody_env_plugin_v1 (it exports a
// similarly named function instead). Plugin::load must refuse it, naming the missing symbol.
#include "odyssey/env.h"

extern "C" ODY_ENV_EXPORT const ody_env_plugin* ody_env_plugin_v0(uint32_t /*host_abi_version*/) { return nullptr; }
