// odyssey pretrain --config FILE [--set k=v]...: the stage checkpoints RL starts from
// (learner/pretrain.h), one progress line every tenth of a stage and a summary line at the end.
#include <cstdio>
#include <string>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "cli/commands.h"
#include "learner/pretrain.h"

namespace odyssey::cli {

namespace {

struct PretrainArgs {
  ConfigArgs config;
  bool resume = false;
  bool overwrite = false;
  int64_t log_every = 0;
  int64_t eval_tasks = 0;
  std::string eval_config;
  int64_t show = 0;
};

std::string count(double n) {
  if (n >= 1e9) return fmt::format("{:.2f}G", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f}M", n / 1e6);
  if (n >= 1e4) return fmt::format("{:.1f}K", n / 1e3);
  return fmt::format("{:.0f}", n);
}

int run(const PretrainArgs& a) {
  auto config = resolve_config(a.config);
  if (!config) return 2;
  if (a.config.dry_run) {
    std::fputs(config->to_toml().c_str(), stdout);
    return 0;
  }
  Result<learner::PretrainOptions> options = learner::pretrain_options(*config);
  if (!options.ok()) {
    std::fprintf(stderr, "%s\n", options.status().message().c_str());
    return 2;
  }
  learner::PretrainOptions& o = *options;
  o.resume = a.resume;
  o.overwrite = a.overwrite;
  o.log_every = a.log_every;
  if (a.eval_tasks > 0) {
    o.eval.episodes = a.eval_tasks;
    o.eval.keep_transcripts = a.show;
    if (!a.eval_config.empty()) {
      o.eval.env_config = nlohmann::json::parse(a.eval_config, nullptr, /*allow_exceptions=*/false);
      if (!o.eval.env_config.is_object()) {
        std::fprintf(stderr, "pretrain: --eval-config '%s' is not a JSON object\n", a.eval_config.c_str());
        return 2;
      }
    }
  }
  std::string stages;
  for (const auto& s : o.stages) stages += (stages.empty() ? "" : " -> ") + s.name;
  std::printf("pretrain %s: stages %s, %lld steps each of %lld tokens, lr %g, data %s, seed %llu -> %s\n", o.job.c_str(),
              stages.c_str(), static_cast<long long>(o.steps_per_stage), static_cast<long long>(o.batch_tokens), o.lr,
              learner::data_kind_name(o.data.kind), static_cast<unsigned long long>(o.seed), o.out_dir.c_str());
  std::fflush(stdout);
  o.on_progress = [](const learner::PretrainProgress& p) {
    std::printf("pretrain %s step %lld/%lld  loss %.4f  lr %.2e  grad_norm %.3f  tokens/s %s  %.0fs\n", p.stage.c_str(),
                static_cast<long long>(p.step), static_cast<long long>(p.steps), p.loss, p.lr, p.grad_norm,
                count(p.tokens_per_s).c_str(), p.seconds);
    std::fflush(stdout);
  };
  o.on_stage_end = [](const learner::StageSummary& s, model::Policy&) {
    std::string line = fmt::format("stage {}: {} steps, {} tokens, loss {:.4f} -> {:.4f} in {:.1f}s", s.stage.name,
                                   s.steps, count(static_cast<double>(s.tokens)), s.first_loss, s.final_loss, s.seconds);
    if (s.eval) {
      line += fmt::format(", eval success {}/{} = {:.3f}", s.eval->successes, s.eval->episodes, s.eval->success_rate);
      for (const std::string& t : s.eval->transcripts) std::printf("  eval transcript: %s\n", t.c_str());
    }
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  };

  Result<learner::PretrainSummary> summary = learner::run_pretrain(o);
  if (!summary.ok()) {
    spdlog::error("{}", summary.status().to_string());
    return 1;
  }
  for (const auto& s : summary->stages) {
    if (!s.resumed) continue;
    if (s.eval) {
      for (const std::string& t : s.eval->transcripts) std::printf("  eval transcript: %s\n", t.c_str());
      std::printf("stage %s: resumed from %s, eval success %lld/%lld = %.3f\n", s.stage.name.c_str(), s.dir.c_str(),
                  static_cast<long long>(s.eval->successes), static_cast<long long>(s.eval->episodes),
                  s.eval->success_rate);
    } else {
      std::printf("stage %s: resumed from %s\n", s.stage.name.c_str(), s.dir.c_str());
    }
  }
  const learner::StageSummary& last = summary->stages.back();
  std::string line = fmt::format("pretrain done: {} stages, {} tokens in {:.1f}s ({} tokens/s), final loss {:.4f}, {}",
                                 summary->stages.size(), count(static_cast<double>(summary->tokens)), summary->seconds,
                                 count(static_cast<double>(summary->tokens) / std::max(1e-9, summary->seconds)),
                                 last.final_loss, last.dir);
  if (last.eval) line += fmt::format(", eval_success: {:.3f}", last.eval->success_rate);
  std::printf("%s\n", line.c_str());
  return 0;
}

}  // namespace

void add_pretrain_commands(CLI::App& app, Action& action) {
  static PretrainArgs args;
  auto* cmd = app.add_subcommand(
      "pretrain", "train the stage checkpoints RL starts from: a progressive context schedule on demonstrations and text");
  add_config_options(cmd, args.config);
  cmd->add_flag("--resume", args.resume, "keep the complete stage checkpoints under pretrain.out and continue after them");
  cmd->add_flag("--overwrite", args.overwrite, "replace stage checkpoints that already exist under pretrain.out");
  cmd->add_option("--log-every", args.log_every, "steps between progress lines (default: a tenth of a stage)");
  cmd->add_option("--eval-tasks", args.eval_tasks,
                  "greedy evaluation of each stage on this many held-out tasks of env.name (split \"eval\"); 0 = none")
      ->capture_default_str();
  cmd->add_option("--eval-config", args.eval_config, "the environment config of the evaluation (default: env.config)");
  cmd->add_option("--show", args.show, "print the first N evaluation transcripts")->capture_default_str();
  cmd->callback([&action] { action = [] { return run(args); }; });
}

}  // namespace odyssey::cli
