// odyssey actor --config FILE [--set k=v]... --index I [--episodes N] [--eval [--evals N]]
#include <atomic>
#include <csignal>
#include <cstdio>

#include <spdlog/spdlog.h>

#include "actors/actor.h"
#include "cli/commands.h"

namespace odyssey::cli {

namespace {

std::atomic<bool> g_actor_stop{false};
void on_actor_signal(int) { g_actor_stop.store(true); }

}  // namespace

void add_actor_commands(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand(
      "actor",
      "run actor I of a job: episodes with the newest published weights, streamed to the replay service; "
      "--eval: greedy evaluation of published versions on held-out tasks (SIGTERM/Ctrl-C stops it cleanly)");
  static ConfigArgs args;
  static int index = 0;
  static int64_t episodes = 0;
  static bool eval = false;
  static int64_t evals = 0;
  add_config_options(cmd, args);
  cmd->add_option("--index", index, "which actor of the job this is (0 .. actor.count-1)")->capture_default_str();
  cmd->add_option("--episodes", episodes, "stop after this many finished episodes (0 = until stopped)")
      ->capture_default_str();
  cmd->add_flag("--eval", eval, "evaluate published weights (run.eval_every, run.eval_tasks) instead of rollouts");
  cmd->add_option("--evals", evals, "with --eval: stop after this many evaluations (0 = until stopped)")
      ->capture_default_str();
  cmd->callback([&action] {
    action = [] {
      auto c = resolve_config(args);
      if (!c) return 2;
      if (args.dry_run) {
        std::fputs(c->to_toml().c_str(), stdout);
        return 0;
      }
      auto options = actors::actor_options_from_config(*c, index);
      if (!options.ok()) {
        std::fprintf(stderr, "%s\n", options.status().message().c_str());
        return 2;
      }
      options->max_episodes = episodes;
      options->max_evals = evals;
      auto actor = actors::Actor::create(*options);
      if (!actor.ok()) {
        spdlog::error("actor {}: {}", index, actor.status().to_string());
        return 1;
      }
      std::signal(SIGINT, on_actor_signal);
      std::signal(SIGTERM, on_actor_signal);
      const Status st = eval ? (*actor)->run_eval(g_actor_stop) : (*actor)->run(g_actor_stop);
      if (!st.ok()) {
        spdlog::error("actor {}: {}", index, st.to_string());
        return 1;
      }
      return 0;
    };
  });
}

}  // namespace odyssey::cli
