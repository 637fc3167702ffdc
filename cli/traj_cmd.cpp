// odyssey traj ls | show | export | verify: replay and audit stored trajectories.
// They open the store as a RocksDB secondary, so they work while a service is writing it.
#include <chrono>
#include <cstdio>

#include <spdlog/spdlog.h>

#include "cli/commands.h"
#include "replay/store.h"
#include "replay/verify.h"

namespace odyssey::cli {

namespace {

struct TrajArgs {
  std::string dir;
  size_t max_problems = 20;
};

Result<std::unique_ptr<replay::TrajectoryStore>> open_for_audit(const std::string& dir) {
  replay::StoreOptions o;
  o.dir = dir;
  o.read_only = true;
  return replay::TrajectoryStore::open(o);
}

int verify(const TrajArgs& a) {
  auto store = open_for_audit(a.dir);
  if (!store.ok()) {
    std::fprintf(stderr, "traj verify: %s\n", store.status().to_string().c_str());
    return 2;
  }
  const auto start = std::chrono::steady_clock::now();
  replay::VerifyOptions vo;
  vo.max_problems = a.max_problems;
  auto report = replay::verify_store(**store, vo);
  if (!report.ok()) {
    std::fprintf(stderr, "traj verify: %s\n", report.status().to_string().c_str());
    return 2;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const auto& p : report->problems) std::printf("BAD %s\n", p.to_string().c_str());
  std::printf("%s: %lu trajectories, %lu segments, %lu tokens, %.1f MB checked in %.2f s (%.1fM tokens/s)%s\n",
              report->sound() ? "sound" : "NOT SOUND", report->trajectories, report->segments, report->tokens,
              report->bytes / 1e6, secs, report->tokens / std::max(secs, 1e-9) / 1e6,
              report->sound() ? "" : fmt::format("; first problem: {}", report->problems.front().to_string()).c_str());
  return report->sound() ? 0 : 1;
}

}  // namespace

void add_traj_commands(CLI::App& app, Action& action) {
  static TrajArgs args;
  auto* traj = app.add_subcommand("traj", "replay and audit stored trajectories");
  traj->require_subcommand(1);

  auto* v = traj->add_subcommand("verify",
                                 "check hash chains, completeness and schema validity; exit 0 only when all is sound");
  v->add_option("--dir", args.dir, "replay store directory")->required();
  v->add_option("--max-problems", args.max_problems, "stop after listing this many problems")->capture_default_str();
  v->callback([&action] { action = [] { return verify(args); }; });
}

}  // namespace odyssey::cli
