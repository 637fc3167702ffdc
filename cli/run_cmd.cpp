// odyssey run CONFIG --out DIR: a whole RL job on one machine, every role its own process.
//
//   DIR/config.toml          the resolved config every role reads (so a run repeats exactly)
//   DIR/replay/              the replay store (replay.dir)
//   DIR/weights/             versioned weights, learner -> actors (model/weight_channel.h)
//   DIR/checkpoints/         learner checkpoints (weights, optimizer, RNG, step, replay cursor)
//   DIR/metrics/<role>.jsonl what each role reports; DIR/metrics.jsonl all of it, merged in order
//   DIR/logs/<role>.log      each process's output
//   DIR/processes.json       the pid of every role, rewritten at each (re)start
//
// Start order: replay service (waits for its "listening on" line), learner ranks, actors, the
// eval actor. Supervision: a crashed actor, eval actor or replay service is restarted; a crashed
// learner is restarted with --resume (it continues from its last checkpoint, and the replay
// cursor it kept makes the service hand back what it had not trained on); more than
// run.restart_limit restarts of one role ends the job. The job ends when learner rank 0 exits 0
// (learner.steps done), at run.max_minutes, or on Ctrl-C / SIGTERM: learners first (they write a
// final checkpoint), then actors, then the replay service. A run started again with --resume
// continues from the checkpoints and store in DIR.
//
// Progress: a live line on a terminal, a log line every run.log_every_seconds otherwise; a
// summary line at the end.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "cli/commands.h"
#include "core/config.h"
#include "model/checkpoint.h"
#include "model/config.h"

namespace odyssey::cli {

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::atomic<int> g_signal{0};
void on_stop_signal(int sig) { g_signal.store(sig); }

// SIGINT and SIGTERM set g_signal. Without SA_RESTART, so that a blocking waitpid returns EINTR
// and the supervisor can pass the stop on (std::signal restarts it on glibc). Installed over an
// inherited SIG_IGN too: a shell's background job starts with SIGINT ignored.
void install_stop_handlers() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = 0;
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
}

std::string self_exe() {
  std::error_code ec;
  const fs::path p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("odyssey") : p.string();
}

std::string signal_text(int status) {
  if (WIFSIGNALED(status)) return fmt::format("killed by {} ({})", strsignal(WTERMSIG(status)), WTERMSIG(status));
  if (WIFEXITED(status)) return fmt::format("exit code {}", WEXITSTATUS(status));
  return "stopped";
}

struct Role {
  std::string name;               // "replay", "learner-0", "actor-1", "eval"
  std::vector<std::string> args;  // after the binary
  bool is_learner = false;
  bool is_rank0 = false;
  pid_t pid = -1;
  int restarts = 0;
  Clock::time_point started{};
};

// Follows DIR/metrics/*.jsonl and keeps the latest figures for the progress line.
class MetricsTail {
 public:
  explicit MetricsTail(std::string dir) : dir_(std::move(dir)) {}

  void poll() {
    // Opened on first use: the supervisor creates DIR after constructing this.
    if (!merged_.is_open()) merged_.open(dir_ + "/metrics.jsonl", std::ios::app);
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir_ + "/metrics", ec)) {
      if (entry.path().extension() != ".jsonl") continue;
      const std::string path = entry.path().string();
      std::ifstream in(path, std::ios::binary);
      in.seekg(static_cast<std::streamoff>(offsets_[path]));
      std::string line;
      while (std::getline(in, line)) {
        if (in.eof()) break;  // a line still being written: read it next time
        offsets_[path] += line.size() + 1;
        take(line);
      }
    }
    merged_.flush();
  }

  std::optional<nlohmann::json> learner, eval, first_eval;
  std::map<std::string, nlohmann::json> actors;
  uint64_t lines = 0;

 private:
  void take(const std::string& line) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) return;
    merged_ << line << '\n';
    ++lines;
    const std::string role = j.value("role", "");
    if (role == "learner") {
      learner = j;
    } else if (role == "eval") {
      if (!first_eval) first_eval = j;
      eval = j;
    } else if (role.rfind("actor", 0) == 0) {
      actors[role] = j;
    }
  }

  std::string dir_;
  std::ofstream merged_;
  std::map<std::string, uint64_t> offsets_;
};

std::string number(const nlohmann::json* j, const char* key, const char* fmt_spec = "{:.3f}") {
  if (j == nullptr || !j->contains(key) || !(*j)[key].is_number()) return "-";
  return fmt::format(fmt::runtime(fmt_spec), (*j)[key].get<double>());
}

std::string human_rate(double x) {
  if (x >= 1e6) return fmt::format("{:.2f}M", x / 1e6);
  if (x >= 1e3) return fmt::format("{:.1f}K", x / 1e3);
  return fmt::format("{:.0f}", x);
}

class Supervisor {
 public:
  Supervisor(const Config& config, std::string out, bool resume)
      : config_(config), out_(std::move(out)), resume_(resume), exe_(self_exe()), metrics_(out_) {}

  int run() {
    std::error_code ec;
    for (const char* sub : {"logs", "metrics", "checkpoints", "weights"}) fs::create_directories(out_ + "/" + sub, ec);
    if (ec) {
      spdlog::error("run: cannot create {}: {}", out_, ec.message());
      return 1;
    }
    if (!write_config()) return 1;
    install_stop_handlers();
    if (!ensure_init_checkpoint()) return 1;
    // The roles share the machine's cores. An OpenMP thread that spin-waits between parallel
    // regions (libgomp's default) burns a core another role needs: a 2-thread pretrain sharing
    // two cores spent three quarters of its cycles spinning. Children inherit this; a value the
    // user set wins.
    ::setenv("OMP_WAIT_POLICY", "PASSIVE", /*overwrite=*/0);
    plan_roles();
    start_ = Clock::now();
    if (!start_role(roles_[0]) || !wait_for_replay(roles_[0])) {
      stop_all();
      return 1;
    }
    for (size_t i = 1; i < roles_.size(); ++i) {
      if (!start_role(roles_[i])) {
        stop_all();
        return 1;
      }
    }
    spdlog::info("run: {} processes up; output in {}", roles_.size(), out_);
    const int code = supervise();
    stop_all();
    metrics_.poll();
    summary();
    return code;
  }

 private:
  bool write_config() {
    const std::string path = out_ + "/config.toml";
    std::ofstream f(path);
    f << "# The resolved configuration of this run (every key), written by `odyssey run`.\n" << config_.to_toml();
    if (!f) {
      spdlog::error("run: cannot write {}", path);
      return false;
    }
    config_path_ = path;
    return true;
  }

  // policy.init names a stage checkpoint; when it is missing but pretraining would produce it
  // (it lies under pretrain.out), run `odyssey pretrain` first.
  bool ensure_init_checkpoint() {
    const std::string init = config_.get_string("policy.init");
    std::error_code ec;
    const std::string pretrain_out = config_.get_string("pretrain.out");
    if (init.empty()) return true;
    if (fs::exists(init + "/COMPLETE", ec)) return init_fits_model(init, pretrain_out);
    const auto rel = fs::path(init).lexically_relative(pretrain_out).string();
    if (pretrain_out.empty() || rel.empty() || rel.rfind("..", 0) == 0) {
      spdlog::error("run: policy.init = '{}' has no complete checkpoint, and it is not under pretrain.out = '{}' "
                    "(run `odyssey pretrain`, or set policy.init to a stage checkpoint)",
                    init, pretrain_out);
      return false;
    }
    spdlog::info("run: {} does not exist yet; running `odyssey pretrain` first (log: {}/logs/pretrain.log)", init,
                 out_);
    // --resume: the stages an interrupted run completed are kept, and pretraining continues after them.
    Role pretrain{"pretrain", {"pretrain", "--config", config_path_, "--resume"}};
    if (g_signal.load() != 0 || !start_role(pretrain)) return false;
    int status = 0;
    bool stopped = false;
    while (::waitpid(pretrain.pid, &status, 0) < 0 && errno == EINTR) {
      if (g_signal.load() != 0 && !stopped) {
        ::kill(pretrain.pid, SIGTERM);
        stopped = true;
      }
    }
    if (stopped || g_signal.load() != 0) {
      spdlog::info("run: {} received during pretraining; stopped it. The complete stage checkpoints under {} are "
                   "kept; `odyssey run` again continues after them",
                   strsignal(g_signal.load()), pretrain_out);
      return false;
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || !fs::exists(init + "/COMPLETE", ec)) {
      spdlog::error("run: pretraining failed ({}); see {}/logs/pretrain.log", signal_text(status), out_);
      return false;
    }
    return true;
  }

  // A stage checkpoint made for another model (e.g. by an earlier version of the model config)
  // would fail every learner and actor start the same way; say so once, before any role starts.
  bool init_fits_model(const std::string& init, const std::string& pretrain_out) {
    const std::string model_path = config_.get_string("policy.model");
    auto model = model::load_model_config({model_path});
    if (!model.ok()) {
      spdlog::error("run: policy.model: {}", model.status().to_string());
      return false;
    }
    auto info = model::inspect_checkpoint(init);
    if (!info.ok()) {
      spdlog::error("run: policy.init: {}", info.status().to_string());
      return false;
    }
    std::vector<std::string> problems;
    std::map<std::string, std::vector<int64_t>> expected;
    for (const model::ModelTensor& t : model::model_tensors(*model)) expected[t.name] = t.shape;
    for (const auto& [name, shape] : expected) {
      auto stored = info->tensors.find(name);
      if (stored == info->tensors.end()) {
        problems.push_back(fmt::format("missing '{}'", name));
      } else if (stored->second.info.shape != shape) {
        problems.push_back(fmt::format("'{}' has shape [{}], the model [{}]", name,
                                       fmt::join(stored->second.info.shape, ", "), fmt::join(shape, ", ")));
      }
    }
    for (const auto& [name, entry] : info->tensors) {
      if (!expected.count(name)) problems.push_back(fmt::format("unexpected '{}'", name));
    }
    if (problems.empty()) return true;
    const auto rel = fs::path(init).lexically_relative(pretrain_out).string();
    const bool ours = !pretrain_out.empty() && !rel.empty() && rel.rfind("..", 0) != 0;
    spdlog::error("run: policy.init = '{}' was made for another model than policy.model = '{}' ({} tensor{} differ; "
                  "first: {}). {}",
                  init, model_path, problems.size(), problems.size() == 1 ? "" : "s", problems.front(),
                  ours ? fmt::format("It lies under pretrain.out: move '{}' away and `odyssey run` pretrains "
                                     "this model again, or set policy.init to a checkpoint of this model",
                                     pretrain_out)
                       : std::string("Set policy.init to a checkpoint of this model, or policy.model to the "
                                     "model it was made for"));
    return false;
  }

  void plan_roles() {
    const std::vector<std::string> common = {"--config", config_path_};
    auto with = [&](std::vector<std::string> head, std::vector<std::string> tail = {}) {
      head.insert(head.end(), common.begin(), common.end());
      head.insert(head.end(), tail.begin(), tail.end());
      return head;
    };
    roles_.push_back({"replay", with({"replay", "serve"})});
    const int64_t ranks = config_.get_int("learner.ranks");
    for (int64_t r = 0; r < ranks; ++r) {
      Role learner{fmt::format("learner-{}", r), with({"learner"}, {"--rank", std::to_string(r)})};
      if (resume_) learner.args.push_back("--resume");
      learner.is_learner = true;
      learner.is_rank0 = r == 0;
      roles_.push_back(learner);
    }
    for (int64_t i = 0; i < config_.get_int("actor.count"); ++i) {
      roles_.push_back({fmt::format("actor-{}", i), with({"actor"}, {"--index", std::to_string(i)})});
    }
    if (config_.get_int("run.eval_every") > 0) roles_.push_back({"eval", with({"actor"}, {"--eval"})});
  }

  bool start_role(Role& role) {
    const std::string log = out_ + "/logs/" + role.name + ".log";
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) {
      spdlog::error("run: fork for {} failed: {}", role.name, std::strerror(errno));
      return false;
    }
    if (pid == 0) {
      ::setpgid(0, 0);                       // Ctrl-C reaches the supervisor only; it stops roles in order
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);    // a killed supervisor takes its roles with it
      if (::getppid() != parent) ::_exit(1);
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd >= 0) {
        ::dup2(fd, STDOUT_FILENO);
        ::dup2(fd, STDERR_FILENO);
        ::close(fd);
      }
      std::vector<char*> argv;
      argv.push_back(const_cast<char*>(exe_.c_str()));
      for (auto& a : role.args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(exe_.c_str(), argv.data());
      std::fprintf(stderr, "run: exec %s failed: %s\n", exe_.c_str(), std::strerror(errno));
      ::_exit(127);
    }
    role.pid = pid;
    role.started = Clock::now();
    spdlog::debug("run: started {} (pid {})", role.name, pid);
    write_process_table();
    return true;
  }

  // DIR/processes.json: {"supervisor": pid, "roles": {name: {"pid", "restarts"}}}, rewritten
  // whenever a role (re)starts, for operators and tests that need to signal one role.
  void write_process_table() const {
    nlohmann::json roles = nlohmann::json::object();
    for (const auto& r : roles_) roles[r.name] = {{"pid", r.pid}, {"restarts", r.restarts}};
    const nlohmann::json table = {{"supervisor", ::getpid()}, {"roles", roles}};
    const std::string path = out_ + "/processes.json", tmp = path + ".tmp";
    {
      std::ofstream f(tmp, std::ios::trunc);
      f << table.dump(2) << '\n';
    }
    std::error_code ec;
    fs::rename(tmp, path, ec);
  }

  bool wait_for_replay(const Role& replay) {
    const std::string log = out_ + "/logs/replay.log";
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    while (Clock::now() < deadline) {
      std::ifstream in(log);
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (text.find("listening on") != std::string::npos) return true;
      int status = 0;
      if (::waitpid(replay.pid, &status, WNOHANG) == replay.pid) {
        spdlog::error("run: the replay service exited at start ({}); see {}", signal_text(status), log);
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    spdlog::error("run: the replay service did not start listening within 60 s; see {}", log);
    return false;
  }

  Role* find(pid_t pid) {
    for (auto& r : roles_) {
      if (r.pid == pid) return &r;
    }
    return nullptr;
  }

  // Returns the job's exit code.
  int supervise() {
    const double max_minutes = config_.get_double("run.max_minutes");
    const int64_t restart_limit = config_.get_int("run.restart_limit");
    auto last_log = Clock::now();
    while (true) {
      if (const int sig = g_signal.load(); sig != 0) {
        end_progress();
        spdlog::info("run: {} received; stopping (learners write a final checkpoint)", strsignal(sig));
        return 0;
      }
      if (max_minutes > 0 && Clock::now() - start_ > std::chrono::duration<double>(max_minutes * 60)) {
        end_progress();
        spdlog::info("run: run.max_minutes = {} reached; stopping", max_minutes);
        return 0;
      }
      int status = 0;
      pid_t pid;
      while ((pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
        Role* role = find(pid);
        if (role == nullptr) continue;
        role->pid = -1;
        if (role->is_rank0 && WIFEXITED(status) && WEXITSTATUS(status) == 0) {
          end_progress();
          spdlog::info("run: the learner finished its {} steps", config_.get_int("learner.steps"));
          return 0;
        }
        end_progress();
        if (role->restarts >= restart_limit) {
          spdlog::error("run: {} failed ({}) after {} restarts (run.restart_limit); giving up; see {}/logs/{}.log",
                        role->name, signal_text(status), role->restarts, out_, role->name);
          return 1;
        }
        ++role->restarts;
        if (role->is_learner &&
            std::find(role->args.begin(), role->args.end(), "--resume") == role->args.end()) {
          role->args.push_back("--resume");
        }
        spdlog::warn("run: {} {}; restarting it (restart {} of {})", role->name, signal_text(status), role->restarts,
                     restart_limit);
        if (!start_role(*role)) return 1;
      }
      metrics_.poll();
      const bool tty = ::isatty(STDOUT_FILENO) != 0;
      if (tty) {
        std::printf("\r\033[K%s", progress_text().c_str());
        std::fflush(stdout);
        line_open_ = true;
      } else if (Clock::now() - last_log >= std::chrono::seconds(config_.get_int("run.log_every_seconds"))) {
        last_log = Clock::now();
        spdlog::info("run: {}", progress_text());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }

  std::string progress_text() const {
    const nlohmann::json* l = metrics_.learner ? &*metrics_.learner : nullptr;
    const nlohmann::json* e = metrics_.eval ? &*metrics_.eval : nullptr;
    double actor_rate = 0;
    for (const auto& [name, j] : metrics_.actors) actor_rate += j.value("tokens_per_s", 0.0);
    const auto secs = std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - start_).count();
    return fmt::format("step {}/{} | reward {} | success {} | eval {} | actors {} tok/s | learner {} tok/s | lag {} | "
                       "{}m{:02d}s",
                       l ? std::to_string(l->value("step", 0)) : "-", config_.get_int("learner.steps"),
                       number(l, "reward_mean"), number(l, "success_rate", "{:.2f}"),
                       number(e, "eval_success", "{:.2f}"), human_rate(actor_rate),
                       l ? human_rate(l->value("tokens_per_s", 0.0)) : "-", number(l, "policy_lag_mean", "{:.2f}"),
                       secs / 60, secs % 60);
  }

  void end_progress() {
    if (line_open_) {
      std::printf("\n");
      std::fflush(stdout);
      line_open_ = false;
    }
  }

  // Learners first (final checkpoint), then actors and eval, then the replay service.
  void stop_all() {
    auto stop = [&](auto pick, std::chrono::seconds grace) {
      for (auto& r : roles_) {
        if (r.pid > 0 && pick(r)) ::kill(r.pid, SIGTERM);
      }
      const auto deadline = Clock::now() + grace;
      while (Clock::now() < deadline) {
        bool alive = false;
        for (auto& r : roles_) {
          if (r.pid > 0 && pick(r)) {
            int status = 0;
            if (::waitpid(r.pid, &status, WNOHANG) == r.pid) {
              r.pid = -1;
            } else {
              alive = true;
            }
          }
        }
        if (!alive) return;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      for (auto& r : roles_) {
        if (r.pid > 0 && pick(r)) {
          spdlog::warn("run: {} did not stop within {} s; killing it", r.name, grace.count());
          ::kill(r.pid, SIGKILL);
          ::waitpid(r.pid, nullptr, 0);
          r.pid = -1;
        }
      }
    };
    stop([](const Role& r) { return r.is_learner; }, std::chrono::seconds(120));
    stop([](const Role& r) { return !r.is_learner && r.name != "replay"; }, std::chrono::seconds(30));
    stop([](const Role& r) { return r.name == "replay"; }, std::chrono::seconds(30));
  }

  void summary() {
    const double secs = std::chrono::duration<double>(Clock::now() - start_).count();
    const nlohmann::json* l = metrics_.learner ? &*metrics_.learner : nullptr;
    uint64_t actor_tokens = 0;
    for (const auto& [name, j] : metrics_.actors) actor_tokens += j.value("tokens_total", j.value("tokens", uint64_t{0}));
    int restarts = 0;
    for (const auto& r : roles_) restarts += r.restarts;
    std::printf("run: %s steps, eval_success %s -> %s, reward %s, %.0f s, restarts %d, metrics %s/metrics.jsonl\n",
                l ? std::to_string(l->value("step", 0)).c_str() : "0",
                number(metrics_.first_eval ? &*metrics_.first_eval : nullptr, "eval_success", "{:.3f}").c_str(),
                number(metrics_.eval ? &*metrics_.eval : nullptr, "eval_success", "{:.3f}").c_str(),
                number(l, "reward_mean").c_str(), secs, restarts, out_.c_str());
    std::fflush(stdout);
  }

  const Config& config_;
  std::string out_;
  bool resume_;
  std::string exe_;
  std::string config_path_;
  std::vector<Role> roles_;
  MetricsTail metrics_;
  Clock::time_point start_;
  bool line_open_ = false;
};

}  // namespace

void add_run_commands(CLI::App& app, Action& action) {
  static ConfigArgs config;
  static std::string out;
  static bool resume = false;
  auto* run = app.add_subcommand("run", "run a whole RL job on this machine: replay, learner ranks, actors, eval");
  run->add_option("config", config.files, "job config TOML, e.g. configs/tiny.toml (more files layer on top)")
      ->required();
  add_config_options(run, config);
  run->add_option("--out", out, "output directory (run.out): metrics, checkpoints, weights, replay, logs");
  run->add_flag("--resume", resume, "continue the run in --out from its checkpoints and replay store");
  run->callback([&action] {
    action = [] {
      std::vector<std::string> extra;
      if (!out.empty()) extra.push_back("run.out=" + out);
      auto resolved = resolve_config(config, extra);
      if (!resolved) return 2;
      // Every role's files live under run.out: the replay store too.
      const std::string dir = resolved->get_string("run.out");
      auto placed = resolve_config(config, {extra.empty() ? "run.out=" + dir : extra[0], "replay.dir=" + dir + "/replay"});
      if (!placed) return 2;
      if (config.dry_run) {
        std::fputs(placed->to_toml().c_str(), stdout);
        return 0;
      }
      std::error_code ec;
      if (!resume && fs::exists(dir + "/checkpoints", ec) && !fs::is_empty(dir + "/checkpoints", ec)) {
        spdlog::error("run: {} already holds a run (checkpoints/); pass --resume to continue it, or choose another "
                      "--out",
                      dir);
        return 2;
      }
      Supervisor supervisor(*placed, dir, resume);
      return supervisor.run();
    };
  });
}

}  // namespace odyssey::cli
