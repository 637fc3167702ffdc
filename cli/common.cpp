#include <cstdio>

#include "cli/commands.h"

namespace odyssey::cli {

void add_config_options(CLI::App* app, ConfigArgs& args, bool with_dry_run) {
  app->add_option("--config", args.files, "job config TOML (repeatable; later files override earlier)")
      ->check(CLI::ExistingFile);
  app->add_option("--set", args.sets, "override one key: --set replay.credits=32 (repeatable)");
  if (with_dry_run) app->add_flag("--dry-run", args.dry_run, "print the resolved config and exit");
}

std::optional<Config> resolve_config(const ConfigArgs& args, const std::vector<std::string>& extra) {
  std::vector<std::string> sets = args.sets;
  sets.insert(sets.end(), extra.begin(), extra.end());
  auto config = load_config(args.files, sets);
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().message().c_str());
    return std::nullopt;
  }
  return std::move(config).value();
}

}  // namespace odyssey::cli
