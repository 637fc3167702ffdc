#include "envs/env_host.h"

#include <fcntl.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "envs/plugin.h"

extern char** environ;

namespace odyssey::envs {

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// ---- Frames ------------------------------------------------------------------------------------

constexpr uint64_t kMaxJsonBytes = 64ull << 20;
constexpr uint32_t kMaxAttachments = 1u << 20;
constexpr uint64_t kMaxFrameBytes = 4ull << 30;

struct Frame {
  json body;
  std::vector<std::string> attachments;
};

// JSON text that never throws: strings that are not UTF-8 (which only a broken plugin puts into
// names) get U+FFFD; byte payloads travel as attachments and are never dumped.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// The frame's bytes: header, sizes, JSON, attachments.
std::string encode_frame(const json& body, const std::vector<std::string>& attachments) {
  const std::string text = dump(body);
  std::string out;
  const uint32_t json_size = static_cast<uint32_t>(text.size());
  const uint32_t count = static_cast<uint32_t>(attachments.size());
  size_t total = 8 + 8 * attachments.size() + text.size();
  for (const std::string& a : attachments) total += a.size();
  out.reserve(total);
  out.append(reinterpret_cast<const char*>(&json_size), 4);
  out.append(reinterpret_cast<const char*>(&count), 4);
  for (const std::string& a : attachments) {
    const uint64_t size = a.size();
    out.append(reinterpret_cast<const char*>(&size), 8);
  }
  out += text;
  for (const std::string& a : attachments) out += a;
  return out;
}

// Reads a frame through `read_exact(buffer, size) -> Status`; checks every size first.
template <class ReadExact>
Result<Frame> decode_frame(ReadExact&& read_exact) {
  char header[8];
  ODY_RETURN_IF_ERROR(read_exact(header, 8));
  uint32_t json_size, count;
  std::memcpy(&json_size, header, 4);
  std::memcpy(&count, header + 4, 4);
  if (json_size > kMaxJsonBytes || count > kMaxAttachments)
    return Status(StatusCode::kInternal, fmt::format("frame header claims {} JSON bytes and {} attachments (limits: "
                                                     "{} and {})",
                                                     json_size, count, kMaxJsonBytes, kMaxAttachments));
  std::vector<uint64_t> sizes(count);
  if (count > 0) ODY_RETURN_IF_ERROR(read_exact(reinterpret_cast<char*>(sizes.data()), 8 * size_t(count)));
  uint64_t total = json_size;
  for (uint64_t s : sizes) {
    if (s > kMaxFrameBytes || total + s > kMaxFrameBytes)
      return Status(StatusCode::kInternal, fmt::format("frame is larger than {} bytes", kMaxFrameBytes));
    total += s;
  }
  std::string text(json_size, '\0');
  ODY_RETURN_IF_ERROR(read_exact(text.data(), text.size()));
  Frame frame;
  frame.body = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (frame.body.is_discarded() || !frame.body.is_object())
    return Status(StatusCode::kInternal, "frame body is not a JSON object");
  frame.attachments.resize(count);
  for (uint32_t i = 0; i < count; ++i) {
    frame.attachments[i].resize(sizes[i]);
    ODY_RETURN_IF_ERROR(read_exact(frame.attachments[i].data(), sizes[i]));
  }
  return frame;
}

// ---- Values on the wire ------------------------------------------------------------------------

// Appends a payload and returns its index.
uint64_t attach(std::vector<std::string>& attachments, std::string bytes) {
  attachments.push_back(std::move(bytes));
  return attachments.size() - 1;
}

const std::string& attachment(const json& index, const std::vector<std::string>& attachments) {
  const uint64_t i = index.get<uint64_t>();
  if (i >= attachments.size())
    throw std::out_of_range(fmt::format("attachment {} of {}", i, attachments.size()));
  return attachments[i];
}

// Doubles round-trip exactly through JSON numbers; NaN and infinities, which JSON lacks, as text.
json encode_double(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}
double decode_double(const json& v) {
  if (v.is_number()) return v.get<double>();
  const std::string s = v.get<std::string>();
  if (s == "nan") return std::numeric_limits<double>::quiet_NaN();
  if (s == "inf") return std::numeric_limits<double>::infinity();
  if (s == "-inf") return -std::numeric_limits<double>::infinity();
  throw std::invalid_argument("bad number '" + s + "'");
}

json encode_parts(const std::vector<env::RewardPart>& parts) {
  json out = json::array();
  for (const auto& p : parts) out.push_back({{"name", p.name}, {"value", encode_double(p.value)}});
  return out;
}
std::vector<env::RewardPart> decode_parts(const json& in) {
  std::vector<env::RewardPart> out;
  for (const json& p : in) out.push_back({p.at("name").get<std::string>(), decode_double(p.at("value"))});
  return out;
}

json encode_observation(const env::Observation& obs, std::vector<std::string>& att) {
  json results = json::array();
  for (const auto& r : obs.tool_results)
    results.push_back({{"call_id", r.call_id}, {"content", attach(att, r.content)}, {"is_error", r.is_error}});
  json images = json::array();
  for (const auto& im : obs.images)
    images.push_back({{"format", int(im.format)},
                      {"width", im.width},
                      {"height", im.height},
                      {"data", attach(att, std::string(im.data.begin(), im.data.end()))}});
  return {{"text", attach(att, obs.text)}, {"tool_results", results}, {"images", images},
          {"rewards", encode_parts(obs.rewards)}, {"done", obs.done}, {"info", obs.info}};
}

env::Observation decode_observation(const json& j, const std::vector<std::string>& att) {
  env::Observation obs;
  obs.text = attachment(j.at("text"), att);
  for (const json& r : j.at("tool_results"))
    obs.tool_results.push_back(
        {r.at("call_id").get<std::string>(), attachment(r.at("content"), att), r.at("is_error").get<bool>()});
  for (const json& im : j.at("images")) {
    env::Image image;
    const int format = im.at("format").get<int>();
    if (format != ODY_ENV_IMAGE_RGB8 && format != ODY_ENV_IMAGE_PNG)
      throw std::invalid_argument(fmt::format("unknown image format {}", format));
    image.format = static_cast<ody_env_image_format>(format);
    image.width = im.at("width").get<uint32_t>();
    image.height = im.at("height").get<uint32_t>();
    const std::string& data = attachment(im.at("data"), att);
    image.data.assign(data.begin(), data.end());
    obs.images.push_back(std::move(image));
  }
  obs.rewards = decode_parts(j.at("rewards"));
  obs.done = j.at("done").get<bool>();
  obs.info = j.at("info");
  if (!obs.info.is_object()) throw std::invalid_argument("observation info is not an object");
  return obs;
}

json encode_score(const env::Score& s) {
  return {{"reward", encode_double(s.reward)}, {"success", s.success}, {"parts", encode_parts(s.parts)},
          {"info", s.info}};
}
env::Score decode_score(const json& j) {
  env::Score s;
  s.reward = decode_double(j.at("reward"));
  s.success = j.at("success").get<bool>();
  s.parts = decode_parts(j.at("parts"));
  s.info = j.at("info");
  if (!s.info.is_object()) throw std::invalid_argument("score info is not an object");
  return s;
}

json encode_action(const env::Action& a, std::vector<std::string>& att) {
  json calls = json::array();
  for (const auto& c : a.tool_calls) calls.push_back({{"id", c.id}, {"name", c.name}, {"arguments", c.arguments}});
  return {{"text", attach(att, a.text)}, {"tool_calls", calls}};
}
env::Action decode_action(const json& j, const std::vector<std::string>& att) {
  env::Action a;
  a.text = attachment(j.at("text"), att);
  for (const json& c : j.at("tool_calls"))
    a.tool_calls.push_back({c.at("id").get<std::string>(), c.at("name").get<std::string>(), c.at("arguments")});
  return a;
}

json encode_info(const EnvInfo& info) {
  json tools = json::array();
  for (const auto& t : info.tools)
    tools.push_back({{"name", t.name}, {"description", t.description}, {"input_schema", t.input_schema}});
  return {{"name", info.name},       {"version", info.version}, {"description", info.description},
          {"tools", tools},          {"snapshots", info.snapshots}, {"images", info.images},
          {"source", info.source},   {"source_hash", info.source_hash}};
}
EnvInfo decode_info(const json& j) {
  EnvInfo info;
  info.name = j.at("name").get<std::string>();
  info.version = j.at("version").get<std::string>();
  info.description = j.at("description").get<std::string>();
  for (const json& t : j.at("tools"))
    info.tools.push_back({t.at("name").get<std::string>(), t.at("description").get<std::string>(), t.at("input_schema")});
  info.snapshots = j.at("snapshots").get<bool>();
  info.images = j.at("images").get<bool>();
  info.source = j.at("source").get<std::string>();
  info.source_hash = j.at("source_hash").get<std::string>();
  return info;
}

json error_reply(const Status& s) { return {{"ok", false}, {"code", int(s.code())}, {"message", s.message()}}; }

double cpu_seconds_used() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) + 1e-6 * double(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

std::string signal_name(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  return abbrev != nullptr ? std::string("SIG") + abbrev : fmt::format("signal {}", sig);
}

// ---- The host side (blocking I/O on the inherited descriptor) --------------------------------

Status host_read_exact(int fd, char* data, size_t size) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::read(fd, data + done, size - done);
    if (n > 0) {
      done += size_t(n);
    } else if (n == 0) {
      return Status(StatusCode::kUnavailable, "the parent closed the channel");
    } else if (errno != EINTR) {
      return make_status(StatusCode::kIo, "reading the channel: {}", std::strerror(errno));
    }
  }
  return Status::Ok();
}

Status host_write_all(int fd, const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n >= 0) {
      done += size_t(n);
    } else if (errno != EINTR) {
      return make_status(StatusCode::kIo, "writing the channel: {}", std::strerror(errno));
    }
  }
  return Status::Ok();
}

bool write_file(const char* path, const std::string& text) {
  const int fd = ::open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::write(fd, text.data(), text.size()) == ssize_t(text.size());
  ::close(fd);
  return ok;
}

void bring_up_loopback() {
  const int s = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (s < 0) return;
  ifreq req{};
  std::strncpy(req.ifr_name, "lo", IFNAMSIZ - 1);
  if (::ioctl(s, SIOCGIFFLAGS, &req) == 0) {
    req.ifr_flags = short(req.ifr_flags | IFF_UP | IFF_RUNNING);
    (void)::ioctl(s, SIOCSIFFLAGS, &req);
  }
  ::close(s);
}

// A network namespace of its own (only a loopback device): "" when that worked, else why not.
std::string isolate_network() {
  const uid_t uid = ::getuid();
  const gid_t gid = ::getgid();
  if (::unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0) {
    // Keep our own ids inside the new user namespace, so files the plugin creates are ours.
    write_file("/proc/self/setgroups", "deny");
    write_file("/proc/self/uid_map", fmt::format("{} {} 1\n", uid, uid));
    write_file("/proc/self/gid_map", fmt::format("{} {} 1\n", gid, gid));
    bring_up_loopback();
    return "";
  }
  const int user_errno = errno;
  if (::unshare(CLONE_NEWNET) == 0) {  // privileged, without a user namespace
    bring_up_loopback();
    return "";
  }
  return fmt::format("unshare(CLONE_NEWUSER|CLONE_NEWNET) failed: {}", std::strerror(user_errno));
}

void scrub_environment(const std::vector<std::string>& extra) {
  std::vector<std::pair<std::string, std::string>> keep;
  for (const auto* list : {&host_env_allow_list(), &extra}) {
    for (const std::string& name : *list)
      if (const char* v = std::getenv(name.c_str())) keep.emplace_back(name, v);
  }
  ::clearenv();
  for (const auto& [name, value] : keep) ::setenv(name.c_str(), value.c_str(), 1);
}

Status set_limit(int resource, const char* name, rlim_t soft, rlim_t hard) {
  rlimit current{};
  ::getrlimit(resource, &current);
  // Never raise a hard limit someone above us already lowered.
  if (current.rlim_max != RLIM_INFINITY) {
    hard = std::min(hard, current.rlim_max);
    soft = std::min(soft, hard);
  }
  const rlimit lim{soft, hard};
  if (::setrlimit(resource, &lim) != 0)
    return make_status(StatusCode::kInternal, "setrlimit({}, {}, {}): {}", name, soft, hard, std::strerror(errno));
  return Status::Ok();
}

// The soft CPU limit for the episode that starts now: what the host used so far + the budget.
Status set_episode_cpu_limit(const HostOptions& limits) {
  const rlim_t used = rlim_t(std::ceil(cpu_seconds_used()));
  const rlim_t hard = rlim_t(limits.host_cpu_seconds) + 1;  // SIGKILL one second after SIGXCPU
  return set_limit(RLIMIT_CPU, "RLIMIT_CPU", std::min<rlim_t>(used + limits.cpu_seconds, hard - 1), hard);
}

uint64_t address_space_bytes() {
  std::ifstream statm("/proc/self/statm");
  uint64_t pages = 0;
  statm >> pages;
  return pages * uint64_t(::sysconf(_SC_PAGESIZE));
}

// Everything of the sandbox but RLIMIT_AS (which must come last, once the host's own size is known).
Status apply_sandbox(const EnvHostArgs& args, std::string* network_note) {
  const HostOptions& o = args.limits;
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (args.parent_pid != 0 && ::getppid() != args.parent_pid)
    return Status(StatusCode::kUnavailable, "the parent is already gone");
  if (::getpgrp() != ::getpid()) (void)::setpgid(0, 0);
  scrub_environment(o.extra_env);
  if (!o.allow_network) *network_note = isolate_network();
  if (!o.working_dir.empty() && ::chdir(o.working_dir.c_str()) != 0)
    return make_status(StatusCode::kInvalidArgument, "working directory {}: {}", o.working_dir, std::strerror(errno));
  ODY_RETURN_IF_ERROR(set_limit(RLIMIT_CORE, "RLIMIT_CORE", 0, 0));
  ODY_RETURN_IF_ERROR(set_limit(RLIMIT_FSIZE, "RLIMIT_FSIZE", o.file_bytes, o.file_bytes));
  ODY_RETURN_IF_ERROR(set_limit(RLIMIT_NOFILE, "RLIMIT_NOFILE", o.open_files, o.open_files));
  ODY_RETURN_IF_ERROR(set_episode_cpu_limit(o));
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
    return make_status(StatusCode::kInternal, "prctl(PR_SET_NO_NEW_PRIVS): {}", std::strerror(errno));
  return Status::Ok();
}

class HostServer {
 public:
  HostServer(int fd, const HostOptions& limits, std::shared_ptr<Plugin> plugin)
      : fd_(fd), limits_(limits), plugin_(std::move(plugin)) {}

  // Serves until the parent closes the channel or says "close".
  int serve() {
    for (;;) {
      auto frame = decode_frame([this](char* data, size_t size) { return host_read_exact(fd_, data, size); });
      if (!frame.ok()) {
        if (frame.status().code() == StatusCode::kUnavailable) break;  // the parent is done with us
        spdlog::error("env-host: {}", frame.status().message());
        return 1;
      }
      const std::string op = frame->body.value("op", std::string());
      std::vector<std::string> attachments;
      json reply;
      try {
        reply = handle(op, *frame, attachments);
      } catch (const std::bad_alloc&) {
        attachments.clear();
        reply = error_reply(make_status(StatusCode::kResourceExhausted, "env-host: out of memory during '{}' (limit: "
                                        "{} bytes for the plugin)", op, limits_.memory_bytes));
      } catch (const std::exception& e) {  // a request this host cannot read
        attachments.clear();
        reply = error_reply(invalid_argument("env-host: malformed '{}' request: {}", op, e.what()));
      }
      reply["cpu"] = cpu_seconds_used();
      if (!host_write_all(fd_, encode_frame(reply, attachments)).ok()) break;
      if (op == "close") break;
    }
    session_.reset();  // the plugin's destroy
    return 0;
  }

 private:
  json handle(const std::string& op, const Frame& req, std::vector<std::string>& att) {
    const json& body = req.body;
    if (op == "close") return {{"ok", true}};
    if (op == "create") {
      if (session_) return error_reply(Status(StatusCode::kFailedPrecondition, "env-host: the instance exists"));
      auto session = plugin_->create(body.at("config"));
      if (!session.ok()) return error_reply(session.status());
      session_ = std::move(session).value();
      return {{"ok", true}};
    }
    if (!session_) return error_reply(make_status(StatusCode::kFailedPrecondition, "env-host: '{}' before create", op));
    if (op == "reset") {
      const Status limited = set_episode_cpu_limit(limits_);
      if (!limited.ok()) return error_reply(limited);
      auto obs = session_->reset(body.at("task"), body.at("seed").get<uint64_t>());
      if (!obs.ok()) return error_reply(obs.status());
      return {{"ok", true}, {"observation", encode_observation(*obs, att)}};
    }
    if (op == "step") {
      auto obs = session_->step(decode_action(body.at("action"), req.attachments));
      if (!obs.ok()) return error_reply(obs.status());
      return {{"ok", true}, {"observation", encode_observation(*obs, att)}};
    }
    if (op == "score") {
      auto score = session_->score();
      if (!score.ok()) return error_reply(score.status());
      return {{"ok", true}, {"score", encode_score(*score)}};
    }
    if (op == "snapshot") {
      auto bytes = session_->snapshot();
      if (!bytes.ok()) return error_reply(bytes.status());
      return {{"ok", true}, {"snapshot", attach(att, std::move(bytes).value())}};
    }
    if (op == "restore") {
      const Status s = session_->restore(attachment(body.at("snapshot"), req.attachments));
      if (!s.ok()) return error_reply(s);
      return {{"ok", true}};
    }
    return error_reply(invalid_argument("env-host: unknown op '{}'", op));
  }

  int fd_;
  HostOptions limits_;
  std::shared_ptr<Plugin> plugin_;
  std::unique_ptr<EnvSession> session_;
};

// ---- The parent side ---------------------------------------------------------------------------

std::once_flag network_warning_once;

std::string describe_exit(int wstatus, const HostOptions& o) {
  if (WIFEXITED(wstatus)) return fmt::format("exited with status {}", WEXITSTATUS(wstatus));
  if (!WIFSIGNALED(wstatus)) return "stopped";
  const int sig = WTERMSIG(wstatus);
  std::string text = "died with " + signal_name(sig);
  if (sig == SIGXCPU)
    text += fmt::format(" (over its CPU limit: {} s per episode, {} s per host)", o.cpu_seconds, o.host_cpu_seconds);
  if (sig == SIGXFSZ) text += fmt::format(" (a file over the size limit of {} bytes)", o.file_bytes);
  if (sig == SIGKILL) text += " (by the hard CPU limit, the kernel's OOM killer or another process)";
  return text;
}

std::string resolve_binary(const std::string& configured) {
  if (!configured.empty()) return configured;
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  const std::string name = exe.filename().string();
  // A running binary that was rebuilt reads "odyssey (deleted)"; /proc/self/exe still runs it.
  if (!ec && (name == "odyssey" || name.rfind("odyssey ", 0) == 0)) return "/proc/self/exe";
  return "";
}

struct Spawned {
  pid_t pid;
  int sock;  // our end of the channel (non-blocking)
  int log;   // the read end of the host's stdout and stderr (non-blocking)
};

// Runs `binary` with `args` in a process group of its own: the allow-listed environment, stdin
// /dev/null, stdout and stderr into a pipe, the channel as fd 3, nothing else inherited, default
// signal dispositions. posix_spawn (vfork-like) keeps this cheap from a large, threaded actor.
Result<Spawned> spawn_host_process(const std::string& binary, std::vector<std::string> args,
                                   const std::vector<std::string>& extra_env) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  std::vector<std::string> env_strings;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('='));
    const auto& allow = host_env_allow_list();
    if (std::find(allow.begin(), allow.end(), name) != allow.end() ||
        std::find(extra_env.begin(), extra_env.end(), name) != extra_env.end())
      env_strings.push_back(entry);
  }
  std::vector<char*> envp;
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);

  int sv[2], lp[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
    return make_status(StatusCode::kResourceExhausted, "socketpair: {}", std::strerror(errno));
  if (::pipe2(lp, O_CLOEXEC) != 0) {
    ::close(sv[0]);
    ::close(sv[1]);
    return make_status(StatusCode::kResourceExhausted, "pipe: {}", std::strerror(errno));
  }
  // The child's ends, numbered above the slots 0-3 they are copied into, so no dup2 clobbers another.
  const int child_sock = ::fcntl(sv[1], F_DUPFD_CLOEXEC, 10);
  const int child_log = ::fcntl(lp[1], F_DUPFD_CLOEXEC, 10);
  ::close(sv[1]);
  ::close(lp[1]);
  if (child_sock < 0 || child_log < 0) {
    for (int fd : {child_sock, child_log, sv[0], lp[0]})
      if (fd >= 0) ::close(fd);
    return make_status(StatusCode::kResourceExhausted, "out of file descriptors");
  }

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, child_log, 1);
  posix_spawn_file_actions_adddup2(&actions, child_log, 2);
  posix_spawn_file_actions_adddup2(&actions, child_sock, 3);
  posix_spawn_file_actions_addclosefrom_np(&actions, 4);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  posix_spawnattr_setpgroup(&attr, 0);
  sigset_t none, defaults;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  sigemptyset(&defaults);
  for (int sig : {SIGPIPE, SIGXCPU, SIGXFSZ, SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2, SIGALRM, SIGCHLD})
    sigaddset(&defaults, sig);
  posix_spawnattr_setsigdefault(&attr, &defaults);

  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, binary.c_str(), &actions, &attr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  ::close(child_sock);
  ::close(child_log);
  if (rc != 0) {
    ::close(sv[0]);
    ::close(lp[0]);
    return make_status(StatusCode::kUnavailable, "cannot run {}: {}", binary, std::strerror(rc));
  }
  ::fcntl(sv[0], F_SETFL, ::fcntl(sv[0], F_GETFL) | O_NONBLOCK);
  ::fcntl(lp[0], F_SETFL, ::fcntl(lp[0], F_GETFL) | O_NONBLOCK);
  return Spawned{pid, sv[0], lp[0]};
}

}  // namespace

const std::vector<std::string>& host_env_allow_list() {
  static const std::vector<std::string> names = {"PATH",   "HOME",   "USER",     "LOGNAME",         "LANG",
                                                 "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ",            "TMPDIR",
                                                 "TERM",   "ODYSSEY_LOG", "ODYSSEY_ENV_PATH", "LD_LIBRARY_PATH"};
  return names;
}

// One running host process, as its parent sees it.
class HostedSession::Host {
 public:
  Host(pid_t pid, int sock, int log, std::string label)
      : pid_(pid), sock_(sock), log_(log), label_(std::move(label)) {
    // Readable once the host exits, even while something it forked still holds the channel open.
    exit_fd_ = int(::syscall(SYS_pidfd_open, pid, 0));
  }
  ~Host() {
    if (pid_ > 0) (void)finish(Clock::now());
    close_fds();
  }

  pid_t pid() const { return pid_; }
  void set_label(std::string label) { label_ = std::move(label); }

  // Writes the whole frame; kTimeout past the deadline, kUnavailable when the host is gone.
  Status send(const std::string& bytes, Clock::time_point deadline) {
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::send(sock_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
      if (n >= 0) {
        done += size_t(n);
        continue;
      }
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        return make_status(StatusCode::kUnavailable, "channel closed ({})", std::strerror(errno));
      ODY_RETURN_IF_ERROR(wait_for(POLLOUT, deadline));
    }
    return Status::Ok();
  }

  Result<Frame> receive(Clock::time_point deadline) {
    return decode_frame([&](char* data, size_t size) -> Status {
      size_t done = 0;
      while (done < size) {
        const ssize_t n = ::recv(sock_, data + done, size - done, 0);
        if (n > 0) {
          done += size_t(n);
          continue;
        }
        if (n == 0) return Status(StatusCode::kUnavailable, "channel closed");
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
          return make_status(StatusCode::kUnavailable, "channel closed ({})", std::strerror(errno));
        ODY_RETURN_IF_ERROR(wait_for(POLLIN, deadline));
      }
      return Status::Ok();
    });
  }

  // Waits until the host exits by itself (at most until `deadline`), then SIGKILLs its process
  // group (the host if still alive, and anything it started) and reaps it. Returns its wait status.
  int finish(Clock::time_point deadline) {
    for (;;) {
      siginfo_t info{};
      if (::waitid(P_PID, id_t(pid_), &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid == pid_) break;
      if (Clock::now() >= deadline) break;
      pollfd p{log_, POLLIN, 0};
      (void)::poll(&p, log_ >= 0 ? 1 : 0, 5);
      drain_log();
    }
    // The exited host stays a zombie until waitpid, so its group id cannot have been reused.
    ::kill(-pid_, SIGKILL);
    int wstatus = 0;
    pid_t r;
    do {
      r = ::waitpid(pid_, &wstatus, 0);
    } while (r < 0 && errno == EINTR);
    if (r != pid_) wstatus = W_EXITCODE(255, 0);
    pid_ = -1;
    drain_log();
    flush_partial_line();
    close_fds();
    return wstatus;
  }

 private:
  // Polls the channel for `events` and keeps the host's output flowing meanwhile.
  Status wait_for(short events, Clock::time_point deadline) {
    for (;;) {
      const auto now = Clock::now();
      if (now >= deadline) return Status(StatusCode::kTimeout, "no answer in time");
      const int ms = int(std::chrono::ceil<std::chrono::milliseconds>(deadline - now).count());
      // A negative descriptor is skipped by poll.
      pollfd fds[3] = {{sock_, events, 0}, {log_, POLLIN, 0}, {exit_fd_, POLLIN, 0}};
      const int n = ::poll(fds, 3, ms);
      if (n < 0 && errno != EINTR) return make_status(StatusCode::kUnavailable, "poll: {}", std::strerror(errno));
      if (fds[1].revents != 0) drain_log();
      if (fds[0].revents != 0) return Status::Ok();  // readable, writable, or closed: the caller finds out
      if (fds[2].revents != 0) return Status(StatusCode::kUnavailable, "the host exited");
    }
  }

  // Forwards what the host printed, a line at a time, to this process's log.
  void drain_log() {
    if (log_ < 0) return;
    char buf[8192];
    for (;;) {
      const ssize_t n = ::read(log_, buf, sizeof(buf));
      if (n > 0) {
        partial_.append(buf, size_t(n));
        size_t start = 0;
        for (size_t nl; (nl = partial_.find('\n', start)) != std::string::npos; start = nl + 1)
          spdlog::info("{} (pid {}): {}", label_, pid_, std::string_view(partial_).substr(start, nl - start));
        partial_.erase(0, start);
        if (partial_.size() > 65536) flush_partial_line();
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n == 0) {  // the host and everything it started closed their output
        ::close(log_);
        log_ = -1;
      }
      return;
    }
  }
  void flush_partial_line() {
    if (!partial_.empty()) spdlog::info("{}: {}", label_, partial_);
    partial_.clear();
  }
  void close_fds() {
    for (int* fd : {&sock_, &log_, &exit_fd_}) {
      if (*fd >= 0) ::close(*fd);
      *fd = -1;
    }
  }

  pid_t pid_;
  int sock_;
  int log_;
  int exit_fd_ = -1;
  std::string label_;
  std::string partial_;
};

HostedSession::HostedSession(std::string plugin_path, json config, HostOptions options)
    : plugin_path_(std::move(plugin_path)), config_(std::move(config)), options_(std::move(options)) {}

HostedSession::~HostedSession() {
  if (!host_) return;
  // A polite close lets the plugin's destroy run; a host that ignores it is killed after a second.
  const auto deadline = Clock::now() + std::min<std::chrono::milliseconds>(options_.call_timeout, std::chrono::seconds(1));
  (void)host_->send(encode_frame({{"op", "close"}}, {}), deadline);
  (void)host_->finish(deadline);
  host_.reset();
}

pid_t HostedSession::host_pid() const { return host_ ? host_->pid() : -1; }

Result<std::unique_ptr<HostedSession>> HostedSession::start(const std::string& plugin_path, const json& config,
                                                             HostOptions options) {
  if (!config.is_object())
    return invalid_argument("env-host for plugin {}: the config must be a JSON object, got {}", plugin_path,
                            config.type_name());
  std::error_code ec;
  std::string absolute = std::filesystem::absolute(plugin_path, ec).lexically_normal().string();
  if (ec) absolute = plugin_path;
  std::unique_ptr<HostedSession> session(new HostedSession(absolute, config, std::move(options)));
  ODY_RETURN_IF_ERROR(session->start_host());
  return session;
}

Status HostedSession::start_host() {
  const HostOptions& o = options_;
  const std::string who = info_.name.empty() ? plugin_path_ : "'" + info_.name + "'";
  const std::string binary = resolve_binary(o.odyssey_binary);
  if (binary.empty())
    return make_status(StatusCode::kFailedPrecondition,
                       "env-host for plugin {}: HostOptions.odyssey_binary is not set and this process is not odyssey",
                       who);
  if (o.call_timeout.count() <= 0 || o.start_timeout.count() <= 0)
    return invalid_argument("env-host for plugin {}: call_timeout and start_timeout must be positive", who);
  if (o.cpu_seconds == 0 || o.host_cpu_seconds < o.cpu_seconds)
    return invalid_argument("env-host for plugin {}: cpu_seconds ({}) must be at least 1 and at most host_cpu_seconds "
                            "({})",
                            who, o.cpu_seconds, o.host_cpu_seconds);

  std::vector<std::string> args = {
      "odyssey",        "env-host",
      "--plugin",       plugin_path_,
      "--fd",           "3",
      "--parent-pid",   std::to_string(::getpid()),
      "--cpu-seconds",  std::to_string(o.cpu_seconds),
      "--host-cpu-seconds", std::to_string(o.host_cpu_seconds),
      "--memory-bytes", std::to_string(o.memory_bytes),
      "--file-bytes",   std::to_string(o.file_bytes),
      "--open-files",   std::to_string(o.open_files)};
  if (o.allow_network) args.push_back("--allow-network");
  if (!o.working_dir.empty()) args.insert(args.end(), {"--working-dir", o.working_dir});
  for (const std::string& name : o.extra_env) args.insert(args.end(), {"--keep-env", name});
  auto spawned = spawn_host_process(binary, std::move(args), o.extra_env);
  if (!spawned.ok()) return spawned.status().with_context("env-host for plugin " + who);
  const auto [pid, sock, log] = *spawned;
  auto host = std::make_unique<Host>(pid, sock, log, "env-host for plugin " + who);
  ++counters_.starts;

  // The hello: the plugin loaded (its info), or why not.
  const auto deadline = Clock::now() + o.start_timeout;
  auto hello = host->receive(deadline);
  if (!hello.ok()) {
    const bool timed_out = hello.status().code() == StatusCode::kTimeout;
    const int wstatus = host->finish(timed_out ? Clock::now() : Clock::now() + std::chrono::seconds(1));
    if (timed_out)
      return make_status(StatusCode::kTimeout, "env-host for plugin {} did not start within {} ms; killed it", who,
                         o.start_timeout.count());
    return make_status(StatusCode::kUnavailable, "env-host for plugin {} {} while starting ({})", who,
                       describe_exit(wstatus, o), hello.status().message());
  }
  try {
    const json& body = hello->body;
    if (!body.at("ok").get<bool>()) {
      const Status refused(StatusCode(body.at("code").get<int>()), body.at("message").get<std::string>());
      (void)host->finish(Clock::now() + std::chrono::seconds(1));
      return refused;
    }
    info_ = decode_info(body.at("info"));
    host->set_label(fmt::format("env-host '{}'", info_.name));
    network_isolated_ = body.at("network_isolated").get<bool>();
    if (!o.allow_network && !network_isolated_) {
      const std::string note = body.value("network_note", std::string());
      std::call_once(network_warning_once, [&] {
        spdlog::warn("env-host: plugins keep network access: {} (unprivileged user namespaces are off on this "
                     "kernel?)",
                     note);
      });
    }
  } catch (const std::exception& e) {
    (void)host->finish(Clock::now());
    ++counters_.crashes;
    return make_status(StatusCode::kInternal, "env-host for plugin {} sent a malformed hello ({}); killed it", who,
                       e.what());
  }
  host_ = std::move(host);
  host_cpu_used_ = 0;
  auto created = call("create", {{"config", config_}}, {}, nullptr);
  if (!created.ok()) {
    host_.reset();  // a plugin that refuses its config is not a crash: stop the host quietly
    return created.status();
  }
  return Status::Ok();
}

Result<json> HostedSession::call(const char* op, json request, std::vector<std::string> attachments,
                                 std::vector<std::string>* reply_attachments) {
  if (!host_) return usable(op);
  const bool starting = std::strcmp(op, "create") == 0;
  const auto timeout = starting ? options_.start_timeout : options_.call_timeout;
  const auto deadline = Clock::now() + timeout;
  request["op"] = op;
  Status io = host_->send(encode_frame(request, attachments), deadline);
  Result<Frame> reply = io.ok() ? host_->receive(deadline) : Result<Frame>(io);
  if (!reply.ok()) {
    const pid_t pid = host_->pid();
    const StatusCode code = reply.status().code();
    if (code == StatusCode::kTimeout) {
      ++counters_.timeouts;
      (void)host_->finish(Clock::now());
      host_.reset();
      return make_status(StatusCode::kTimeout, "env-host for plugin '{}' did not answer {} within {} ms; killed it "
                         "(pid {})", info_.name, op, timeout.count(), pid);
    }
    ++counters_.crashes;
    if (code == StatusCode::kUnavailable) {
      const int wstatus = host_->finish(Clock::now() + std::chrono::seconds(1));
      host_.reset();
      return make_status(StatusCode::kUnavailable, "env-host for plugin '{}' {} during {}", info_.name,
                         describe_exit(wstatus, options_), op);
    }
    (void)host_->finish(Clock::now());
    host_.reset();
    return make_status(StatusCode::kInternal, "env-host for plugin '{}' sent a malformed answer to {} ({}); killed it",
                       info_.name, op, reply.status().message());
  }
  try {
    json& body = reply->body;
    host_cpu_used_ = body.at("cpu").get<double>();
    if (!body.at("ok").get<bool>()) {
      const int code = body.at("code").get<int>();
      if (code <= int(StatusCode::kOk) || code > int(StatusCode::kInternal))
        throw std::invalid_argument(fmt::format("unknown status code {}", code));
      return Status(StatusCode(code), body.at("message").get<std::string>());
    }
    if (reply_attachments != nullptr) *reply_attachments = std::move(reply->attachments);
    return std::move(body);
  } catch (const std::exception& e) {
    ++counters_.crashes;
    (void)host_->finish(Clock::now());
    host_.reset();
    return make_status(StatusCode::kInternal, "env-host for plugin '{}' sent a malformed answer to {} ({}); killed it",
                       info_.name, op, e.what());
  }
}

Status HostedSession::usable(const char* call) const {
  if (host_) return Status::Ok();
  return make_status(StatusCode::kFailedPrecondition,
                     "env-host for plugin '{}' {}: the host is gone (it crashed, hung or was stopped); reset() "
                     "starts a fresh one",
                     info_.name, call);
}

Result<env::Observation> HostedSession::reset(const json& task, uint64_t seed) {
  if (!task.is_object())
    return invalid_argument("plugin '{}' reset: the task must be a JSON object, got {}", info_.name, task.type_name());
  // A host whose CPU budget cannot cover another episode is replaced between episodes.
  if (host_ && host_cpu_used_ + double(options_.cpu_seconds) > double(options_.host_cpu_seconds)) {
    const auto deadline = Clock::now() + std::chrono::seconds(1);
    (void)host_->send(encode_frame({{"op", "close"}}, {}), deadline);
    (void)host_->finish(deadline);
    host_.reset();
    ++counters_.recycles;
  } else if (!host_) {
    ++counters_.restarts;
  }
  if (!host_) ODY_RETURN_IF_ERROR(start_host());
  std::vector<std::string> att;
  ODY_ASSIGN_OR_RETURN(json reply, call("reset", {{"task", task}, {"seed", seed}}, {}, &att));
  try {
    return decode_observation(reply.at("observation"), att);
  } catch (const std::exception& e) {
    return make_status(StatusCode::kInternal, "env-host for plugin '{}' sent a malformed observation for reset: {}",
                       info_.name, e.what());
  }
}

Result<env::Observation> HostedSession::step(const env::Action& action) {
  ODY_RETURN_IF_ERROR(usable("step"));
  std::vector<std::string> att;
  json request = {{"action", encode_action(action, att)}};
  std::vector<std::string> reply_att;
  ODY_ASSIGN_OR_RETURN(json reply, call("step", std::move(request), std::move(att), &reply_att));
  try {
    return decode_observation(reply.at("observation"), reply_att);
  } catch (const std::exception& e) {
    return make_status(StatusCode::kInternal, "env-host for plugin '{}' sent a malformed observation for step: {}",
                       info_.name, e.what());
  }
}

Result<env::Score> HostedSession::score() {
  ODY_RETURN_IF_ERROR(usable("score"));
  ODY_ASSIGN_OR_RETURN(json reply, call("score", json::object(), {}, nullptr));
  try {
    return decode_score(reply.at("score"));
  } catch (const std::exception& e) {
    return make_status(StatusCode::kInternal, "env-host for plugin '{}' sent a malformed score: {}", info_.name,
                       e.what());
  }
}

Result<std::string> HostedSession::snapshot() {
  if (!info_.snapshots)
    return make_status(StatusCode::kFailedPrecondition, "plugin '{}' does not offer snapshots", info_.name);
  ODY_RETURN_IF_ERROR(usable("snapshot"));
  std::vector<std::string> att;
  ODY_ASSIGN_OR_RETURN(json reply, call("snapshot", json::object(), {}, &att));
  try {
    return attachment(reply.at("snapshot"), att);
  } catch (const std::exception& e) {
    return make_status(StatusCode::kInternal, "env-host for plugin '{}' sent a malformed snapshot: {}", info_.name,
                       e.what());
  }
}

Status HostedSession::restore(std::string_view bytes) {
  if (!info_.snapshots)
    return make_status(StatusCode::kFailedPrecondition, "plugin '{}' does not offer snapshots", info_.name);
  if (!host_) {  // restoring is another way to begin: a fresh host, then the state
    ++counters_.restarts;
    ODY_RETURN_IF_ERROR(start_host());
  }
  std::vector<std::string> att{std::string(bytes)};
  ODY_ASSIGN_OR_RETURN(json reply, call("restore", {{"snapshot", 0}}, std::move(att), nullptr));
  (void)reply;
  return Status::Ok();
}

// ---- `odyssey env-host` ------------------------------------------------------------------------

int run_env_host(const EnvHostArgs& args) {
  const int fd = args.fd;
  // Nothing the plugin runs inherits the channel.
  if (::fcntl(fd, F_SETFD, FD_CLOEXEC) != 0) {
    spdlog::error("env-host: --fd {} is not an open descriptor", fd);
    return 2;
  }
  auto say = [fd](const json& body) { (void)host_write_all(fd, encode_frame(body, {})); };
  std::string network_note;
  const Status sandboxed = apply_sandbox(args, &network_note);
  if (!sandboxed.ok()) {
    spdlog::error("env-host: {}", sandboxed.message());
    say(error_reply(sandboxed.with_context("env-host sandbox")));
    return 1;
  }
  // Last, so the limit is the host's own size (the odyssey binary and its libraries) + the plugin's share.
  const uint64_t own = address_space_bytes();
  const uint64_t cap = args.limits.memory_bytes > std::numeric_limits<uint64_t>::max() - own
                           ? std::numeric_limits<uint64_t>::max()
                           : own + args.limits.memory_bytes;
  const Status limited = set_limit(RLIMIT_AS, "RLIMIT_AS", rlim_t(cap), rlim_t(cap));
  if (!limited.ok()) {
    say(error_reply(limited.with_context("env-host sandbox")));
    return 1;
  }
  auto plugin = Plugin::load(args.plugin_path);
  if (!plugin.ok()) {
    say(error_reply(plugin.status()));
    return 1;
  }
  say({{"ok", true},
       {"info", encode_info((*plugin)->info())},
       {"network_isolated", !args.limits.allow_network && network_note.empty()},
       {"network_note", args.limits.allow_network ? "allowed" : network_note},
       {"cpu", cpu_seconds_used()}});
  HostServer server(fd, args.limits, std::move(plugin).value());
  return server.serve();
}

}  // namespace odyssey::envs
