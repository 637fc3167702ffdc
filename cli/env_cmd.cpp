// odyssey env list: the environment plugins this odyssey finds (built-in, $ODYSSEY_ENV_PATH,
// --dir), with their tools. odyssey env check PLUGIN: the conformance suite (envs/conformance.h)
// against one plugin, in this process or under env-host (--hosted); exit code 1 on any FAIL.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "envs/conformance.h"
#include "envs/env_host.h"
#include "envs/mcp.h"
#include "envs/plugin.h"

namespace odyssey::cli {
namespace {

using nlohmann::json;

// The first line of a description, cut to `max` bytes (at a UTF-8 boundary).
std::string one_line(const std::string& text, size_t max = 100) {
  std::string line = text.substr(0, text.find('\n'));
  if (line.size() <= max) return line;
  size_t cut = max;
  while (cut > 0 && (static_cast<unsigned char>(line[cut]) & 0xC0) == 0x80) --cut;
  return line.substr(0, cut) + "...";
}

struct ListArgs {
  bool json = false;
  std::vector<std::string> dirs;
};

int run_list(const ListArgs& args) {
  json plugins = json::array(), errors = json::array();
  std::string text;
  for (const std::string& path : envs::discover_plugins(args.dirs)) {
    auto plugin = envs::Plugin::load(path);
    if (!plugin.ok()) {
      errors.push_back({{"path", path}, {"error", plugin.status().message()}});
      continue;
    }
    const envs::EnvInfo& info = (*plugin)->info();
    json tools = json::array();
    size_t width = 0;
    for (const envs::ToolSpec& t : info.tools) width = std::max(width, t.name.size());
    std::string tool_lines;
    for (const envs::ToolSpec& t : info.tools) {
      tools.push_back({{"name", t.name}, {"description", t.description}, {"input_schema", t.input_schema}});
      tool_lines += fmt::format("    {:<{}}  {}\n", t.name, width, one_line(t.description));
    }
    plugins.push_back({{"name", info.name},
                       {"version", info.version},
                       {"description", info.description},
                       {"path", info.source},
                       {"source_hash", info.source_hash},
                       {"snapshots", info.snapshots},
                       {"images", info.images},
                       {"tools", tools}});
    std::string caps = info.snapshots ? "snapshots" : "";
    if (info.images) caps += caps.empty() ? "images" : ", images";
    text += fmt::format("{} {}  {}\n  path: {}\n  tools:{}\n{}{}", info.name, info.version, one_line(info.description),
                        info.source, info.tools.empty() ? " none" : "", tool_lines,
                        caps.empty() ? "" : "  offers: " + caps + "\n");
  }
  if (args.json) {
    std::printf("%s\n", json{{"plugins", plugins}, {"errors", errors}}.dump(2).c_str());
    return 0;
  }
  if (plugins.empty() && errors.empty()) {
    std::printf("no environment plugins found (add directories with $ODYSSEY_ENV_PATH or --dir)\n");
    return 0;
  }
  std::printf("%s", text.c_str());
  for (const json& e : errors)
    std::printf("could not load %s: %s\n", e["path"].get<std::string>().c_str(), e["error"].get<std::string>().c_str());
  return 0;
}

struct CheckArgs {
  std::string plugin;
  std::string config = "{}";
  std::string task = "{}";
  int episodes = 3;
  uint64_t seed = 1;
  int max_steps = 16;
  bool hosted = false;
  int64_t timeout_ms = 30000;
  bool json = false;
  std::vector<std::string> dirs;
};

// A JSON object from a flag's text, or an error naming the flag.
std::optional<json> json_object_flag(const std::string& text, const char* flag) {
  json value = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) {
    std::fprintf(stderr, "odyssey env check: %s is not valid JSON: %s\n", flag, text.c_str());
    return std::nullopt;
  }
  if (!value.is_object()) {
    std::fprintf(stderr, "odyssey env check: %s must be a JSON object, got %s\n", flag, value.type_name());
    return std::nullopt;
  }
  return value;
}

int run_check(const CheckArgs& args) {
  auto config = json_object_flag(args.config, "--config");
  auto task = json_object_flag(args.task, "--task");
  if (!config || !task) return 2;
  if (args.episodes < 0 || args.max_steps < 1) {
    std::fprintf(stderr, "odyssey env check: --episodes must be >= 0 and --max-steps >= 1\n");
    return 2;
  }
  envs::ConformanceOptions options;
  options.task = *task;
  options.seed = args.seed;
  options.episodes = args.episodes;
  options.max_steps = args.max_steps;
  auto path = envs::find_plugin(args.plugin, args.dirs);
  if (!path.ok()) {
    // Not a plugin: maybe an MCP server's environment config (configs/envs/NAME.json).
    auto mcp_path = envs::find_mcp_config(args.plugin, args.dirs);
    if (!mcp_path.ok()) {
      std::fprintf(stderr, "odyssey env check: %s\n(nor an MCP environment config: %s)\n",
                   path.status().message().c_str(), mcp_path.status().message().c_str());
      return 1;
    }
    auto mcp_config = envs::load_mcp_config_file(*mcp_path);
    if (!mcp_config.ok()) {
      std::fprintf(stderr, "odyssey env check: %s\n", mcp_config.status().message().c_str());
      return 1;
    }
    json merged = *mcp_config;
    merged.update(*config);  // --config overrides keys of the file
    const envs::ConformanceReport report = envs::run_conformance(
        [merged]() { return envs::make_mcp_session(merged); }, options);
    if (args.json) {
      json out = report.to_json();
      out["mode"] = "mcp";
      std::printf("%s\n", out.dump(2).c_str());
    } else {
      std::printf("%s", report.to_text().c_str());
    }
    return report.passed() ? 0 : 1;
  }

  envs::SessionFactory factory;
  std::shared_ptr<envs::Plugin> plugin;  // in-process: loaded once, kept for every session
  if (args.hosted) {
    envs::HostOptions host;
    host.call_timeout = std::chrono::milliseconds(args.timeout_ms);
    options.call_timeout = host.call_timeout;
    factory = [path = *path, config = *config, host]() -> Result<std::unique_ptr<envs::EnvSession>> {
      ODY_ASSIGN_OR_RETURN(auto session, envs::HostedSession::start(path, config, host));
      return std::unique_ptr<envs::EnvSession>(std::move(session));
    };
  } else {
    auto loaded = envs::Plugin::load(*path);
    if (!loaded.ok()) {
      std::fprintf(stderr, "odyssey env check: %s\n", loaded.status().message().c_str());
      return 1;
    }
    plugin = *loaded;
    factory = [plugin, config = *config]() { return plugin->create(config); };
  }
  const envs::ConformanceReport report = envs::run_conformance(factory, options);
  if (args.json) {
    json out = report.to_json();
    out["mode"] = args.hosted ? "hosted" : "in-process";
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    std::printf("%s", report.to_text().c_str());
  }
  return report.passed() ? 0 : 1;
}

}  // namespace

void add_env_commands(CLI::App& app, Action& action) {
  CLI::App* env = app.add_subcommand("env", "environment plugins: list them, check one");
  env->require_subcommand(1);

  auto list_args = std::make_shared<ListArgs>();
  CLI::App* list = env->add_subcommand(
      "list", "the environment plugins found (built-in, $ODYSSEY_ENV_PATH, --dir) with their tools");
  list->add_flag("--json", list_args->json, "print JSON: {\"plugins\": [...], \"errors\": [...]}");
  list->add_option("--dir", list_args->dirs, "also search this directory (repeatable)");
  list->callback([&action, list_args] { action = [list_args] { return run_list(*list_args); }; });

  auto check_args = std::make_shared<CheckArgs>();
  CLI::App* check = env->add_subcommand(
      "check", "run the conformance suite against a plugin; exit code 1 when a check fails");
  check->add_option("plugin", check_args->plugin, "a plugin name (guess) or a path with a '/' (./libody_env_mine.so)")
      ->required();
  check->add_option("--config", check_args->config, "the plugin's config, a JSON object")->capture_default_str();
  check->add_option("--task", check_args->task, "the task for every reset, a JSON object ({} draws from the seed)")
      ->capture_default_str();
  check->add_option("--episodes", check_args->episodes, "scripted episodes to play")->capture_default_str();
  check->add_option("--seed", check_args->seed, "the first seed")->capture_default_str();
  check->add_option("--max-steps", check_args->max_steps, "turns per scripted episode before scoring anyway")
      ->capture_default_str();
  check->add_flag("--hosted", check_args->hosted, "run the plugin under env-host (sandbox, per-call timeout)");
  check->add_option("--timeout-ms", check_args->timeout_ms, "per-call timeout when --hosted")->capture_default_str();
  check->add_option("--dir", check_args->dirs, "also search this directory for a plugin name (repeatable)");
  check->add_flag("--json", check_args->json, "print the report as JSON");
  check->callback([&action, check_args] { action = [check_args] { return run_check(*check_args); }; });
}

}  // namespace odyssey::cli
