// Sandboxed environment hosts: `odyssey env-host` runs ONE plugin instance in its own process,
// and HostedSession is the EnvSession that starts such a process and forwards calls to it.
// A plugin that crashes, hangs, leaks or writes too much takes down its host, never the actor:
// the failure comes back as a Status, and the next reset() starts a fresh host.
//
// Channel: a Unix socketpair. The host's end is inherited as a file descriptor (`--fd 3`);
// its stdin is /dev/null and its stdout and stderr are a pipe the parent drains and forwards,
// line by line, to its own log (so a plugin's printing never corrupts the parent's output,
// and RLIMIT_FSIZE never trips on the parent's log file).
//
// Protocol (both ends on one machine, native byte order): a frame is
//   u32 json_size, u32 attachment_count, u64 attachment_size[attachment_count],
//   json bytes, attachment bytes (in order).
// The JSON object carries the structure; byte payloads (observation text, tool result
// contents, images, snapshots, the model's turn text) travel as attachments, referenced by
// index, so they are copied byte for byte, never escaped or base64-encoded. The host speaks
// first: {"ok": true, "info": {...}, "network_isolated": bool, "network_note": "..."} once the
// plugin is loaded (or {"ok": false, "code", "message"} if it cannot be). Then the parent
// sends {"op": "create" | "reset" | "step" | "score" | "snapshot" | "restore" | "close", ...}
// and the host answers each with {"ok": true, ...} or {"ok": false, "code": StatusCode as an
// integer, "message"}; every answer also says "cpu": CPU seconds the host has used.
//
// Sandbox: before loading the plugin the host applies to itself, in this order: PDEATHSIG
// SIGKILL (it dies with the thread that started it; it exits at once if that parent is already
// gone), its own process group, an environment scrubbed to an allow-list, a new user and
// network namespace unless allow_network (unprivileged where the kernel allows it; where it
// does not, the host says so in its hello and HostedSession logs one warning per process),
// the working directory, RLIMIT_CORE 0, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CPU,
// PR_SET_NO_NEW_PRIVS, and RLIMIT_AS last. Hitting a limit is fatal by the kernel's default:
// SIGXCPU (CPU), SIGXFSZ (file size); memory exhaustion makes allocations fail inside the
// plugin (an SDK plugin reports std::bad_alloc as a tool error; an uncaught one aborts).
//
// Failures (each names the plugin and the call):
//   kTimeout      no answer within call_timeout: the host's process group is SIGKILLed.
//   kUnavailable  the host died ("env-host for plugin 'x' died with SIGSEGV during step").
//   kInternal     the host sent a malformed frame (it is killed), or the plugin reported an
//                 internal error (the host keeps running and recreates the instance).
//   others        the plugin's own statuses, as from an in-process session.
// After kTimeout or kUnavailable (or a malformed frame) the host is gone; step / score /
// snapshot answer kFailedPrecondition, and reset() or restore() start a fresh host with the
// same plugin and config. counters() tells how often that happened.
//
// Threads: one thread at a time per session. The host dies with the THREAD that started it
// (PR_SET_PDEATHSIG follows the forking thread), so start and reset sessions from a thread
// that outlives them. Processes started by the plugin stay in the host's process group and are
// killed with it.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "envs/session.h"

namespace odyssey::envs {

// Every limit of a hosted plugin, with its default. `odyssey env-host --help` prints the same.
struct HostOptions {
  // The odyssey executable to run as `odyssey env-host`. "" means /proc/self/exe, which only
  // works when this process is odyssey (tests pass the build's binary).
  std::string odyssey_binary;
  // CPU seconds one episode may use (RLIMIT_CPU soft limit, moved forward at each reset).
  uint64_t cpu_seconds = 600;
  // CPU seconds one host process may use over its life (RLIMIT_CPU hard limit); reset()
  // replaces a host that has less than cpu_seconds left.
  uint64_t host_cpu_seconds = 3600;
  // Address space the plugin may add to the host's own at start (RLIMIT_AS = the host's size
  // before loading the plugin + this).
  uint64_t memory_bytes = 4ull << 30;
  uint64_t file_bytes = 1ull << 30;  // largest file the host may write (RLIMIT_FSIZE)
  uint64_t open_files = 256;         // open file descriptors (RLIMIT_NOFILE)
  // How long one call (reset, step, score, snapshot, restore) may take.
  std::chrono::milliseconds call_timeout{30000};
  // How long starting a host (exec, loading the plugin, create) may take.
  std::chrono::milliseconds start_timeout{30000};
  bool allow_network = false;
  std::string working_dir;             // "" keeps the parent's working directory
  std::vector<std::string> extra_env;  // names of variables passed on besides the allow-list
};

// Environment variables a host keeps (besides HostOptions::extra_env).
const std::vector<std::string>& host_env_allow_list();

// How often a session's host failed and was replaced.
struct HostCounters {
  uint64_t starts = 0;    // hosts started, the first included
  uint64_t restarts = 0;  // hosts started to replace a dead, hung or used-up one
  uint64_t timeouts = 0;  // calls that timed out (host killed)
  uint64_t crashes = 0;   // hosts that died during a call, or sent garbage
  uint64_t recycles = 0;  // hosts replaced at reset because their CPU budget ran low
};

class HostedSession final : public EnvSession {
 public:
  // Starts a host for the plugin file at `plugin_path` and creates an instance from `config`.
  static Result<std::unique_ptr<HostedSession>> start(const std::string& plugin_path, const nlohmann::json& config,
                                                      HostOptions options = {});
  // Asks the host to destroy the instance and exit (waiting at most a second), then kills
  // whatever is left of its process group.
  ~HostedSession() override;
  HostedSession(const HostedSession&) = delete;
  HostedSession& operator=(const HostedSession&) = delete;

  const EnvInfo& info() const override { return info_; }
  Result<env::Observation> reset(const nlohmann::json& task, uint64_t seed) override;
  Result<env::Observation> step(const env::Action& action) override;
  Result<env::Score> score() override;
  Result<std::string> snapshot() override;
  Status restore(std::string_view bytes) override;

  const HostCounters& counters() const { return counters_; }
  // The running host's pid (also its process group), or -1 when none runs.
  pid_t host_pid() const;
  // Whether the running host got its own network namespace.
  bool network_isolated() const { return network_isolated_; }
  const HostOptions& options() const { return options_; }

 private:
  class Host;
  HostedSession(std::string plugin_path, nlohmann::json config, HostOptions options);
  Status start_host();
  Status usable(const char* call) const;
  // Sends one request and waits for its answer; on a dead, hung or garbling host, kills it.
  Result<nlohmann::json> call(const char* op, nlohmann::json request, std::vector<std::string> attachments,
                              std::vector<std::string>* reply_attachments);

  std::string plugin_path_;
  nlohmann::json config_;
  HostOptions options_;
  EnvInfo info_;
  std::unique_ptr<Host> host_;
  HostCounters counters_;
  bool network_isolated_ = false;
  double host_cpu_used_ = 0;
};

// What `odyssey env-host` is told on its command line.
struct EnvHostArgs {
  std::string plugin_path;
  int fd = 3;            // the channel to the parent
  pid_t parent_pid = 0;  // exit at once unless this is still the parent (0: do not check)
  HostOptions limits;    // cpu, memory, file, open files, network, working dir, extra env
};

// The body of `odyssey env-host`: applies the sandbox, loads the plugin and serves requests
// until the parent closes the channel or says "close". Returns the process exit code.
int run_env_host(const EnvHostArgs& args);

}  // namespace odyssey::envs
