// odyssey: agentic long-horizon RL post-training. `odyssey --help` lists the subcommands.
#include <cstdio>

#include <spdlog/spdlog.h>

#include "cli/commands.h"
#include "cli/doctor.h"
#include "core/log.h"

int main(int argc, char** argv) {
  // Line-buffered stdout even into a file or pipe: progress lines (pretrain, bench, run) show up
  // in logs as they are printed, not when the process exits.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  CLI::App app{"odyssey: RL post-training for agentic, long-horizon tool use"};
  app.require_subcommand(1);
  app.fallthrough();  // --log-level may follow the subcommand
  std::string log_level;
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error, off (default: $ODYSSEY_LOG or info)");
  odyssey::cli::Action action;
  odyssey::cli::add_replay_commands(app, action);
  odyssey::cli::add_traj_commands(app, action);
  odyssey::cli::add_config_commands(app, action);
  odyssey::cli::add_bench_commands(app, action);
  odyssey::cli::add_model_commands(app, action);
  odyssey::cli::add_ckpt_commands(app, action);
  odyssey::cli::add_run_commands(app, action);
  odyssey::cli::add_plot_commands(app, action);
  odyssey::cli::add_env_commands(app, action);
  odyssey::cli::add_env_host_commands(app, action);
  odyssey::cli::add_learner_commands(app, action);
  odyssey::cli::add_actor_commands(app, action);
  odyssey::cli::add_pretrain_commands(app, action);
  app.add_subcommand("doctor", "check this machine: LibTorch, CUDA, c10d, RocksDB, ZeroMQ, for real")
      ->callback([&action] { action = [] { return odyssey::cli::run_doctor(); }; });
  // Name an unknown subcommand instead of CLI11's generic "a subcommand is required".
  if (argc > 1 && argv[1][0] != '-') {
    bool known = false;
    for (const auto* sub : app.get_subcommands([](const CLI::App*) { return true; })) known |= sub->get_name() == argv[1];
    if (!known) {
      std::fprintf(stderr, "odyssey: unknown subcommand '%s'\n\n%s", argv[1], app.help().c_str());
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  odyssey::init_logging("odyssey", log_level);
  odyssey::install_crash_handler();
  if (!action) {
    std::fprintf(stderr, "%s", app.help().c_str());
    return 2;
  }
  return action();
}
