// odyssey config show | keys
#include <cstdio>

#include "cli/commands.h"

namespace odyssey::cli {

void add_config_commands(CLI::App& app, Action& action) {
  auto* config = app.add_subcommand("config", "inspect job configs");
  config->require_subcommand(1);

  auto* show = config->add_subcommand("show", "print a resolved config (files layered, --set applied)");
  static ConfigArgs args;
  static std::vector<std::string> files;
  show->add_option("files", files, "config files, layered left to right")->check(CLI::ExistingFile);
  add_config_options(show, args, /*with_dry_run=*/false);
  show->callback([&action] {
    action = [] {
      ConfigArgs a = args;
      a.files.insert(a.files.begin(), files.begin(), files.end());
      auto c = resolve_config(a);
      if (!c) return 2;
      std::fputs(c->to_toml().c_str(), stdout);
      return 0;
    };
  });

  auto* keys = config->add_subcommand("keys", "every config key with its type, default and meaning");
  keys->callback([&action] {
    action = [] {
      std::fputs(config_schema().reference().c_str(), stdout);
      return 0;
    };
  });
}

}  // namespace odyssey::cli
