// odyssey env-host: serves one environment plugin to the parent process over an inherited
// socket, inside the sandbox envs/env_host.h describes. HostedSession starts it; people do not.
#include <fmt/format.h>

#include "cli/commands.h"
#include "envs/env_host.h"

namespace odyssey::cli {

void add_env_host_commands(CLI::App& app, Action& action) {
  auto args = std::make_shared<envs::EnvHostArgs>();
  envs::HostOptions& limits = args->limits;
  CLI::App* cmd = app.add_subcommand(
      "env-host", "serve one environment plugin to the parent process over an inherited socket, in a sandbox "
                  "(started by the actor; see envs/env_host.h)");
  cmd->add_option("--plugin", args->plugin_path, "the plugin file (libody_env_NAME.so)")->required();
  cmd->add_option("--fd", args->fd, "the descriptor of the channel to the parent")->capture_default_str();
  cmd->add_option("--parent-pid", args->parent_pid, "exit at once unless this process is still the parent (0: skip)")
      ->capture_default_str();
  cmd->add_option("--cpu-seconds", limits.cpu_seconds, "CPU seconds per episode (RLIMIT_CPU soft limit)")
      ->capture_default_str();
  cmd->add_option("--host-cpu-seconds", limits.host_cpu_seconds,
                  "CPU seconds over the host's life (RLIMIT_CPU hard limit)")
      ->capture_default_str();
  cmd->add_option("--memory-bytes", limits.memory_bytes,
                  "address space the plugin may add to the host's own (RLIMIT_AS)")
      ->capture_default_str();
  cmd->add_option("--file-bytes", limits.file_bytes, "largest file the plugin may write (RLIMIT_FSIZE)")
      ->capture_default_str();
  cmd->add_option("--open-files", limits.open_files, "open file descriptors (RLIMIT_NOFILE)")->capture_default_str();
  cmd->add_flag("--allow-network", limits.allow_network,
                "keep the parent's network (default: a network namespace of its own, when the kernel allows)");
  cmd->add_option("--working-dir", limits.working_dir, "run the plugin in this directory");
  cmd->add_option("--keep-env", limits.extra_env, "also keep this environment variable (repeatable)");
  cmd->callback([&action, args] { action = [args] { return envs::run_env_host(*args); }; });
}

}  // namespace odyssey::cli
