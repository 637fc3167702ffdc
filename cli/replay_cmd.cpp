// odyssey replay serve | stats | checkpoint
#include <csignal>
#include <cstdio>

#include <spdlog/spdlog.h>

#include "cli/commands.h"
#include "replay/client.h"
#include "replay/options.h"
#include "replay/service.h"

namespace odyssey::cli {

namespace {

std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop.store(true); }

struct ReplayArgs {
  ConfigArgs config;
  std::string dir, listen, connect = "tcp://127.0.0.1:5555", checkpoint_to;
  int timeout_ms = 10000;
};

int serve(const ReplayArgs& a) {
  std::vector<std::string> extra;
  if (!a.dir.empty()) extra.push_back("replay.dir=" + a.dir);
  if (!a.listen.empty()) extra.push_back("replay.listen=" + a.listen);
  auto config = resolve_config(a.config, extra);
  if (!config) return 2;
  if (a.config.dry_run) {
    std::fputs(config->to_toml().c_str(), stdout);
    return 0;
  }
  auto service = replay::ReplayService::create(replay::service_options(*config));
  if (!service.ok()) {
    spdlog::error("{}", service.status().to_string());
    return 1;
  }
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  // The one stdout line scripts wait for: the service is up and where.
  std::printf("listening on %s\n", (*service)->endpoint().c_str());
  std::fflush(stdout);
  Status st = (*service)->run(g_stop);
  if (!st.ok()) {
    spdlog::error("{}", st.to_string());
    return 1;
  }
  return 0;
}

replay::ClientOptions client_options(const ReplayArgs& a) {
  replay::ClientOptions o;
  o.endpoint = a.connect;
  o.name = "odyssey-cli";
  o.ack_timeout_ms = a.timeout_ms;
  o.give_up_after_ms = a.timeout_ms;
  return o;
}

int stats(const ReplayArgs& a) {
  auto sampler = replay::ReplaySampler::connect(client_options(a));
  if (!sampler.ok()) {
    spdlog::error("{}", sampler.status().to_string());
    return 1;
  }
  auto s = (*sampler)->stats();
  if (!s.ok()) {
    spdlog::error("{}", s.status().to_string());
    return 1;
  }
  std::printf("trajectories: %lu\nin_flight: %lu\ncomplete: %lu\nconsumed: %lu\nwithheld: %lu\nfailed: %lu\n"
              "segments: %lu\nbytes: %lu\ninserts: %lu\nsamples: %lu\npolicy_version: %u\nsampler: %s\n"
              "segments_written: %lu\nduplicates_ignored: %lu\ncommits_synced: %lu\n",
              s->trajectories, s->in_flight, s->complete, s->consumed, s->withheld, s->failed, s->segments,
              s->bytes, s->inserts, s->samples, s->policy_version, s->sampler.c_str(), s->segments_written,
              s->duplicates_ignored, s->commits_synced);
  return 0;
}

int checkpoint(const ReplayArgs& a) {
  auto sampler = replay::ReplaySampler::connect(client_options(a));
  if (!sampler.ok()) {
    spdlog::error("{}", sampler.status().to_string());
    return 1;
  }
  Status st = (*sampler)->checkpoint(a.checkpoint_to);
  if (!st.ok()) {
    spdlog::error("{}", st.to_string());
    return 1;
  }
  std::printf("checkpoint written to %s (serve it with: odyssey replay serve --dir %s)\n", a.checkpoint_to.c_str(),
              a.checkpoint_to.c_str());
  return 0;
}

}  // namespace

void add_replay_commands(CLI::App& app, Action& action) {
  static ReplayArgs args;
  auto* replay = app.add_subcommand("replay", "the replay service: trajectories in, samples out");
  replay->require_subcommand(1);

  auto* s = replay->add_subcommand("serve", "run the replay service (Ctrl-C stops it cleanly)");
  add_config_options(s, args.config);
  s->add_option("--dir", args.dir, "store directory (replay.dir)");
  s->add_option("--listen", args.listen, "ZeroMQ address to bind, e.g. tcp://127.0.0.1:5555 (replay.listen)");
  s->callback([&action] { action = [] { return serve(args); }; });

  auto* st = replay->add_subcommand("stats", "counters of a running replay service");
  st->add_option("--connect", args.connect, "the service's address")->capture_default_str();
  st->add_option("--timeout-ms", args.timeout_ms, "give up after this long")->capture_default_str();
  st->callback([&action] { action = [] { return stats(args); }; });

  auto* cp = replay->add_subcommand("checkpoint", "write a consistent copy of a running service's store");
  cp->add_option("--connect", args.connect, "the service's address")->capture_default_str();
  cp->add_option("--timeout-ms", args.timeout_ms, "give up after this long")->capture_default_str();
  cp->add_option("dir", args.checkpoint_to, "new directory for the checkpoint (on the service's machine)")->required();
  cp->callback([&action] { action = [] { return checkpoint(args); }; });
}

}  // namespace odyssey::cli
