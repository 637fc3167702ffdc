// The replay service's options from a resolved job config (keys: core/config_keys.cpp,
// sections [replay], [replay.rate_limiter], [replay.retention]).
#pragma once

#include "core/config.h"
#include "replay/service.h"

namespace odyssey::replay {

ServiceOptions service_options(const Config& config);

}  // namespace odyssey::replay
