// Logging through spdlog. One process-wide logger named after the process role
// ("replay", "actor-3", ...) writing to stderr; level from --log-level or ODYSSEY_LOG.
#pragma once

#include <string>

#include <spdlog/spdlog.h>

namespace odyssey {

// Sets up the default logger: "[time] [role] [level] message" on stderr.
// `level` is one of trace, debug, info, warn, error, off; empty reads ODYSSEY_LOG (default info).
void init_logging(const std::string& role, const std::string& level = "");

// On SIGSEGV, SIGBUS, SIGFPE, SIGILL and SIGABRT: write the signal and a raw backtrace to
// stderr, then die of the same signal (so supervisors and shells still see it).
void install_crash_handler();

}  // namespace odyssey
