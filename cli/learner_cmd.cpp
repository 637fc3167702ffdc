// odyssey learner --config FILE [--set k=v]... [--rank R] [--resume]
// One learner rank (learner/trainer.h): runs learner.steps steps, or until SIGTERM / SIGINT, then
// writes a final checkpoint and exits 0. Exits 1 on an error it cannot work around (the `odyssey
// run` supervisor restarts it with --resume), 2 on a bad config or command line.
#include <atomic>
#include <csignal>
#include <cstdio>

#include <spdlog/spdlog.h>

#include "cli/commands.h"
#include "learner/trainer.h"

namespace odyssey::cli {

namespace {

std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop.store(true); }

struct LearnerArgs {
  ConfigArgs config;
  int rank = 0;
  bool resume = false;
};

int run_learner(const LearnerArgs& a) {
  auto config = resolve_config(a.config);
  if (!config) return 2;
  if (a.config.dry_run) {
    std::fputs(config->to_toml().c_str(), stdout);
    return 0;
  }
  const int64_t ranks = config->get_int("learner.ranks");
  if (a.rank < 0 || a.rank >= ranks) {
    spdlog::error("learner: --rank {} is outside [0, learner.ranks = {})", a.rank, ranks);
    return 2;
  }
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  const learner::TrainerOptions options = learner::trainer_options(*config, a.rank, a.resume);
  auto trainer = learner::Trainer::create(options);
  if (!trainer.ok()) {
    spdlog::error("{}", trainer.status().to_string());
    return 1;
  }
  const int64_t first = (*trainer)->step_count();
  // The line scripts and tests wait for: the learner is up, where it continues from.
  std::printf("learner rank %d of %ld ready at step %ld, version %u\n", a.rank, static_cast<long>(ranks),
              static_cast<long>(first), (*trainer)->version());
  std::fflush(stdout);
  const Status st = (*trainer)->run(g_stop);
  if (!st.ok()) {
    spdlog::error("{}", st.to_string());
    return 1;
  }
  std::printf("learner rank %d: done at step %ld (%ld this run), version %u\n", a.rank,
              static_cast<long>((*trainer)->step_count()), static_cast<long>((*trainer)->step_count() - first),
              (*trainer)->version());
  return 0;
}

}  // namespace

void add_learner_commands(CLI::App& app, Action& action) {
  static LearnerArgs args;
  auto* l = app.add_subcommand("learner", "one learner rank: trains on groups from the replay service, publishes "
                                          "weights, checkpoints (SIGTERM: final checkpoint, exit 0)");
  add_config_options(l, args.config);
  l->add_option("--rank", args.rank, "this process's rank in [0, learner.ranks)")->capture_default_str();
  l->add_flag("--resume", args.resume, "continue from the newest complete checkpoint under run.out/checkpoints");
  l->callback([&action] { action = [] { return run_learner(args); }; });
}

}  // namespace odyssey::cli
