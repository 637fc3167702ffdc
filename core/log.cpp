#include "core/log.h"

#include <cstdlib>

#include <spdlog/sinks/stdout_color_sinks.h>

namespace odyssey {

void init_logging(const std::string& role, const std::string& level) {
  const std::string name = role.empty() ? "odyssey" : role;
  spdlog::drop(name);
  auto logger = spdlog::stderr_color_mt(name);
  logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n] [%^%l%$] %v");
  std::string lvl = level;
  if (lvl.empty()) {
    const char* env = std::getenv("ODYSSEY_LOG");
    lvl = env ? env : "info";
  }
  logger->set_level(spdlog::level::from_str(lvl));
  spdlog::set_default_logger(logger);
}

}  // namespace odyssey
