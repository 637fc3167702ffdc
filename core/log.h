// Logging through spdlog. One process-wide logger named after the process role
// ("replay", "actor-3", ...) writing to stderr; level from --log-level or ODYSSEY_LOG.
#pragma once

#include <string>

#include <spdlog/spdlog.h>

namespace odyssey {

// Sets up the default logger: "[time] [role] [level] message" on stderr.
// `level` is one of trace, debug, info, warn, error, off; empty reads ODYSSEY_LOG (default info).
void init_logging(const std::string& role, const std::string& level = "");

}  // namespace odyssey
