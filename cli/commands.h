// The odyssey command line: each file in cli/ registers one group of subcommands.
// A subcommand's parse callback stores what to run in `action`; main() runs it once parsing
// succeeded, so `--help` and parse errors never start anything.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/config.h"

namespace odyssey::cli {

using Action = std::function<int()>;

// `--config FILE` (repeatable, layered), `--set key=value` (repeatable) and `--dry-run`.
struct ConfigArgs {
  std::vector<std::string> files;
  std::vector<std::string> sets;
  bool dry_run = false;
};
void add_config_options(CLI::App* app, ConfigArgs& args, bool with_dry_run = true);
// Resolves the config; `extra` are overrides from dedicated flags (--dir, --listen), applied last.
// On error prints it and returns nullopt.
std::optional<Config> resolve_config(const ConfigArgs& args, const std::vector<std::string>& extra = {});

void add_replay_commands(CLI::App& app, Action& action);
void add_traj_commands(CLI::App& app, Action& action);
void add_config_commands(CLI::App& app, Action& action);
void add_bench_commands(CLI::App& app, Action& action);
void add_model_commands(CLI::App& app, Action& action);
void add_ckpt_commands(CLI::App& app, Action& action);
void add_run_commands(CLI::App& app, Action& action);
void add_plot_commands(CLI::App& app, Action& action);
void add_env_commands(CLI::App& app, Action& action);
void add_env_host_commands(CLI::App& app, Action& action);
void add_learner_commands(CLI::App& app, Action& action);
void add_actor_commands(CLI::App& app, Action& action);
void add_pretrain_commands(CLI::App& app, Action& action);

}  // namespace odyssey::cli
