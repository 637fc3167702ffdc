// The MCP bridge: a stdio JSON-RPC client for MCP servers and the EnvSession built on it
// (envs/mcp.h).
#include "envs/mcp.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "envs/json_schema.h"
#include "envs/plugin.h"
#include "odyssey/env_util.hpp"

extern char** environ;

namespace odyssey::envs {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

constexpr const char* kProtocolVersion = "2025-06-18";
// Versions whose stdio transport, initialize and tools/* messages we speak.
const std::set<std::string> kKnownProtocolVersions = {"2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"};
constexpr const char* kClientVersion = "0.1.0";
constexpr size_t kMaxLineBytes = size_t{64} << 20;
constexpr size_t kStderrTailLines = 8;
constexpr milliseconds kStdinCloseGrace{1000};
constexpr milliseconds kTermGrace{500};

std::string trim(const std::string& s) {
  const char* ws = " \t\r\n\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

// At most `n` bytes of `s` for an error message, with a note of what was left out.
std::string excerpt(const std::string& s, size_t n = 200) {
  if (s.size() <= n) return s;
  return fmt::format("{}... ({} bytes in all)", s.substr(0, n), s.size());
}

std::string dump(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? sep : "") + parts[i];
  return out;
}

// A command line as a user would type it (arguments with spaces quoted).
std::string shell_words(const std::string& command, const std::vector<std::string>& args) {
  auto quote = [](const std::string& w) {
    if (!w.empty() && w.find_first_of(" \t\"'\\$") == std::string::npos) return w;
    std::string q = "'";
    for (char c : w) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
  };
  std::string out = quote(command);
  for (const auto& a : args) out += " " + quote(a);
  return out;
}

std::string describe_wait_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return fmt::format("ended with wait status {}", status);
}

void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left, 1 << 30));
}

// Has `pid` exited? Looks without reaping, so its process group id stays reserved until we kill
// what is left of the group and reap it.
bool has_exited(pid_t pid) {
  siginfo_t info{};
  info.si_pid = 0;
  if (waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0) return errno == ECHILD;
  return info.si_pid == pid;
}

bool wait_exit(pid_t pid, milliseconds grace) {
  const auto deadline = Clock::now() + grace;
  while (!has_exited(pid)) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(milliseconds(5));
  }
  return true;
}

// Writes `data` to a pipe without letting a closed reader raise SIGPIPE in this process.
// Returns bytes written, or -1 with errno (EAGAIN when the pipe is full).
ssize_t write_nosigpipe(int fd, const char* data, size_t size) {
  sigset_t pipe_set, old;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  sigset_t pending;
  sigpending(&pending);
  const bool was_pending = sigismember(&pending, SIGPIPE) == 1;
  pthread_sigmask(SIG_BLOCK, &pipe_set, &old);
  ssize_t n = write(fd, data, size);
  const int saved = errno;
  if (n < 0 && saved == EPIPE && !was_pending) {
    const struct timespec zero {0, 0};
    while (sigtimedwait(&pipe_set, nullptr, &zero) == -1 && errno == EINTR) {
    }
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  errno = saved;
  return n;
}

int base64_value(unsigned char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+' || c == '-') return 62;
  if (c == '/' || c == '_') return 63;
  return -1;
}

std::optional<std::vector<uint8_t>> base64_decode(const std::string& text) {
  std::vector<uint8_t> out;
  out.reserve(text.size() / 4 * 3);
  uint32_t acc = 0;
  int bits = 0;
  for (unsigned char c : text) {
    if (c == '=' || c == '\n' || c == '\r' || c == ' ') continue;
    const int v = base64_value(c);
    if (v < 0) return std::nullopt;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<uint8_t>((acc >> bits) & 0xff));
    }
  }
  return out;
}

// Width and height from a PNG's IHDR chunk, or nothing when `bytes` is not a PNG.
std::optional<std::pair<uint32_t, uint32_t>> png_size(const std::vector<uint8_t>& bytes) {
  static const uint8_t kSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (bytes.size() < 24 || !std::equal(kSignature, kSignature + 8, bytes.begin())) return std::nullopt;
  if (std::memcmp(bytes.data() + 12, "IHDR", 4) != 0) return std::nullopt;
  auto be32 = [&](size_t at) {
    return (uint32_t{bytes[at]} << 24) | (uint32_t{bytes[at + 1]} << 16) | (uint32_t{bytes[at + 2]} << 8) |
           uint32_t{bytes[at + 3]};
  };
  return std::make_pair(be32(16), be32(20));
}

std::string did_you_mean(const std::string& key, const std::vector<std::string>& known) {
  const std::string best = odyssey::env::closest_key(key, known);
  return best.empty() ? "" : fmt::format(" (did you mean '{}'?)", best);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// McpClient

Result<std::unique_ptr<McpClient>> McpClient::start(const McpServerConfig& config) {
  std::unique_ptr<McpClient> client(new McpClient());
  client->timeout_ = config.timeout;
  client->startup_timeout_ = config.startup_timeout;
  client->command_line_ = shell_words(config.command, config.args);
  ODY_RETURN_IF_ERROR(client->spawn(config));
  Status s = client->initialize();
  if (!s.ok()) {
    client->close();
    return s;
  }
  return client;
}

McpClient::~McpClient() { close(); }

Status McpClient::spawn(const McpServerConfig& config) {
  if (config.command.empty()) return invalid_argument("MCP server: the command is empty");
  if (!config.cwd.empty()) {
    std::error_code ec;
    if (!fs::is_directory(config.cwd, ec))
      return make_status(StatusCode::kNotFound, "cannot start MCP server `{}`: working directory '{}' does not exist",
                         command_line_, config.cwd);
  }
  int in[2], out[2], err[2];
  if (pipe2(in, O_CLOEXEC) != 0) return make_status(StatusCode::kIo, "MCP server: pipe: {}", strerror(errno));
  if (pipe2(out, O_CLOEXEC) != 0) {
    ::close(in[0]), ::close(in[1]);
    return make_status(StatusCode::kIo, "MCP server: pipe: {}", strerror(errno));
  }
  if (pipe2(err, O_CLOEXEC) != 0) {
    ::close(in[0]), ::close(in[1]), ::close(out[0]), ::close(out[1]);
    return make_status(StatusCode::kIo, "MCP server: pipe: {}", strerror(errno));
  }

  std::vector<std::string> argv_s = {config.command};
  argv_s.insert(argv_s.end(), config.args.begin(), config.args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);

  std::map<std::string, std::string> env_map;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string entry(*e);
    const size_t eq = entry.find('=');
    if (eq != std::string::npos) env_map[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  for (const auto& [k, v] : config.env) env_map[k] = v;
  std::vector<std::string> env_s;
  for (const auto& [k, v] : env_map) env_s.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& e : env_s) envp.push_back(e.data());
  envp.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, err[1], STDERR_FILENO);
  if (!config.cwd.empty()) posix_spawn_file_actions_addchdir_np(&actions, config.cwd.c_str());
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  // Its own process group, so close() reaches what it spawns (npx, shells); default signal
  // dispositions and an empty mask, whatever this process set.
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGPIPE);
  sigaddset(&defaults, SIGTERM);
  sigaddset(&defaults, SIGINT);
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);

  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, config.command.c_str(), &actions, &attr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  ::close(in[0]);
  ::close(out[1]);
  ::close(err[1]);
  if (rc != 0) {
    ::close(in[1]), ::close(out[0]), ::close(err[0]);
    return make_status(rc == ENOENT ? StatusCode::kNotFound : StatusCode::kFailedPrecondition,
                       "cannot start MCP server `{}`: {}{}", command_line_, strerror(rc),
                       rc == ENOENT ? " (is the command installed and on PATH?)" : "");
  }
  pid_ = pid;
  log_name_ = fs::path(config.command).filename().string();
  stdin_fd_ = in[1];
  stdout_fd_ = out[0];
  stderr_fd_ = err[0];
  set_nonblocking(stdin_fd_);
  set_nonblocking(stdout_fd_);
  set_nonblocking(stderr_fd_);
  spdlog::debug("mcp: started `{}` as pid {}", command_line_, pid_);
  return Status::Ok();
}

Status McpClient::initialize() {
  nlohmann::json params = {{"protocolVersion", kProtocolVersion},
                           {"capabilities", nlohmann::json::object()},
                           {"clientInfo", {{"name", "odyssey"}, {"version", kClientVersion}}}};
  auto answer = exchange("initialize", params, startup_timeout_);
  if (!answer.ok()) return answer.status().with_context("MCP initialize");
  if (!answer->error.is_null())
    return make_status(StatusCode::kFailedPrecondition, "MCP server `{}` refused initialize: {}", command_line_,
                       excerpt(dump(answer->error), 500));
  const nlohmann::json& result = answer->result;
  if (!result.is_object() || !result.contains("protocolVersion") || !result["protocolVersion"].is_string())
    return fail(make_status(StatusCode::kInternal,
                            "MCP server `{}` answered initialize without a protocolVersion string: {}", command_line_,
                            excerpt(dump(result), 500)));
  protocol_version_ = result["protocolVersion"].get<std::string>();
  if (kKnownProtocolVersions.count(protocol_version_) == 0)
    return fail(make_status(StatusCode::kFailedPrecondition,
                            "MCP server `{}` speaks protocol version '{}', which odyssey does not know (it speaks {})",
                            command_line_, protocol_version_, join({kKnownProtocolVersions.begin(), kKnownProtocolVersions.end()}, ", ")));
  if (auto it = result.find("serverInfo"); it != result.end() && it->is_object()) {
    server_info_ = *it;
    if (server_info_.value("name", nlohmann::json()).is_string()) log_name_ = server_info_["name"].get<std::string>();
  }
  if (auto it = result.find("capabilities"); it != result.end() && it->is_object()) capabilities_ = *it;
  if (auto it = result.find("instructions"); it != result.end() && it->is_string()) instructions_ = *it;
  return send({{"jsonrpc", "2.0"}, {"method", "notifications/initialized"}}, Clock::now() + timeout_);
}

Status McpClient::fail(Status status) {
  if (failure_.ok()) failure_ = std::move(status);
  return failure_;
}

bool McpClient::alive() {
  if (!failure_.ok() || pid_ < 0) return false;
  if (has_exited(pid_)) {
    (void)server_gone();
    return false;
  }
  return true;
}

Status McpClient::send(const nlohmann::json& message, Clock::time_point deadline) {
  if (!failure_.ok()) return failure_;
  const std::string line = dump(message) + "\n";
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = write_nosigpipe(stdin_fd_, line.data() + done, line.size() - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EPIPE) return server_gone();
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
      return fail(make_status(StatusCode::kIo, "MCP server `{}`: writing to its stdin: {}", command_line_,
                              strerror(errno)));
    // The pipe is full: the server is not reading. Wait for room, its output, or the deadline.
    pollfd fds[2] = {{stdin_fd_, POLLOUT, 0}, {stderr_fd_, POLLIN, 0}};
    const int wait = remaining_ms(deadline);
    if (wait == 0)
      return make_status(StatusCode::kTimeout, "MCP server `{}` did not read its stdin within {} ms", command_line_,
                         timeout_.count());
    if (poll(fds, 2, wait) < 0 && errno != EINTR)
      return fail(make_status(StatusCode::kIo, "MCP server `{}`: poll: {}", command_line_, strerror(errno)));
    if (fds[1].revents != 0) drain_stderr(false);
    if ((fds[0].revents & (POLLERR | POLLHUP)) != 0) return server_gone();
  }
  return Status::Ok();
}

void McpClient::drain_stderr(bool flush) {
  if (stderr_fd_ < 0) return;
  char buffer[4096];
  while (true) {
    const ssize_t n = read(stderr_fd_, buffer, sizeof(buffer));
    if (n > 0) {
      stderr_buffer_.append(buffer, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) {  // the server closed its stderr (or exited)
      ::close(stderr_fd_);
      stderr_fd_ = -1;
      flush = true;
    }
    break;
  }
  size_t start = 0;
  for (size_t nl; (nl = stderr_buffer_.find('\n', start)) != std::string::npos; start = nl + 1) {
    std::string line = stderr_buffer_.substr(start, nl - start);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    spdlog::info("mcp server {} (pid {}) stderr: {}", log_name_, pid_, line);
    stderr_lines_.push_back(excerpt(line, 300));
    if (stderr_lines_.size() > kStderrTailLines) stderr_lines_.pop_front();
  }
  stderr_buffer_.erase(0, start);
  if (flush && !stderr_buffer_.empty()) {
    spdlog::info("mcp server {} (pid {}) stderr: {}", log_name_, pid_, stderr_buffer_);
    stderr_lines_.push_back(excerpt(stderr_buffer_, 300));
    if (stderr_lines_.size() > kStderrTailLines) stderr_lines_.pop_front();
    stderr_buffer_.clear();
  }
}

std::string McpClient::stderr_tail() const {
  if (stderr_lines_.empty()) return "";
  std::vector<std::string> lines(stderr_lines_.begin(), stderr_lines_.end());
  return "; its last stderr lines: " + join(lines, " | ");
}

Status McpClient::server_gone() {
  if (!failure_.ok()) return failure_;
  // Its stdout closed: it exited or is about to; collect the rest of its stderr and its status.
  const pid_t pid = pid_;
  const std::string how = reap(kStdinCloseGrace);
  return fail(make_status(StatusCode::kUnavailable, "MCP server `{}` (pid {}) {}{}", command_line_, pid, how,
                          stderr_tail()));
}

std::string McpClient::reap(milliseconds grace) {
  if (pid_ < 0) return ended_;
  std::string how_stopped;
  if (!wait_exit(pid_, grace)) {
    kill(-pid_, SIGTERM);
    how_stopped = " after SIGTERM";
    if (!wait_exit(pid_, kTermGrace)) {
      kill(-pid_, SIGKILL);
      how_stopped = " after SIGKILL";
    }
  }
  // The leader is a zombie now and keeps the group id reserved: end whatever it left behind.
  kill(-pid_, SIGKILL);
  int status = 0;
  while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  if (stderr_fd_ >= 0) {
    // Whatever it wrote before exiting (its stderr may also be held open by an orphan: bounded).
    const auto deadline = Clock::now() + milliseconds(200);
    while (stderr_fd_ >= 0) {
      pollfd fd{stderr_fd_, POLLIN, 0};
      if (poll(&fd, 1, remaining_ms(deadline)) <= 0) break;
      drain_stderr(false);
    }
    drain_stderr(true);
  }
  ended_ = describe_wait_status(status) + how_stopped;
  spdlog::debug("mcp: server `{}` (pid {}) {}", command_line_, pid_, ended_);
  pid_ = -1;
  for (int* fd : {&stdin_fd_, &stdout_fd_, &stderr_fd_}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
  return ended_;
}

std::string McpClient::close() {
  if (pid_ < 0) return ended_;
  // The stdio transport's shutdown: close its stdin and let it exit; then signals.
  if (stdin_fd_ >= 0) {
    ::close(stdin_fd_);
    stdin_fd_ = -1;
  }
  const pid_t pid = pid_;
  const std::string how = reap(kStdinCloseGrace);
  (void)fail(make_status(StatusCode::kFailedPrecondition, "MCP server `{}` (pid {}) was closed: it {}", command_line_, pid,
                   how));
  return how;
}

void McpClient::handle_request(const nlohmann::json& message) {
  const std::string method = message["method"].is_string() ? message["method"].get<std::string>() : "";
  nlohmann::json reply = {{"jsonrpc", "2.0"}, {"id", message["id"]}};
  if (method == "ping") {
    reply["result"] = nlohmann::json::object();
  } else {
    // We declare no client capabilities (no roots, sampling or elicitation): servers that ask
    // anyway get "method not found", and the filesystem server then uses its own arguments.
    spdlog::debug("mcp server `{}` asked '{}', which odyssey does not offer", command_line_, method);
    reply["error"] = {{"code", -32601},
                      {"message", fmt::format("odyssey's MCP client does not support '{}'", method)}};
  }
  (void)send(reply, Clock::now() + timeout_);
}

Result<McpClient::Answer> McpClient::exchange(const std::string& method, const nlohmann::json& params,
                                              milliseconds timeout) {
  if (!failure_.ok()) return failure_;
  const int64_t id = next_id_++;
  const auto deadline = Clock::now() + timeout;
  nlohmann::json message = {{"jsonrpc", "2.0"}, {"id", id}, {"method", method}};
  if (!params.is_null()) message["params"] = params;
  ODY_RETURN_IF_ERROR(send(message, deadline));
  size_t scanned = 0;  // bytes of stdout_buffer_ known to hold no newline
  while (true) {
    size_t nl;
    while ((nl = stdout_buffer_.find('\n', scanned)) != std::string::npos) {
      std::string line = stdout_buffer_.substr(0, nl);
      stdout_buffer_.erase(0, nl + 1);
      scanned = 0;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (trim(line).empty()) continue;
      nlohmann::json msg = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (msg.is_discarded())
        return fail(make_status(StatusCode::kInternal,
                                "MCP server `{}` wrote a line that is not JSON while we waited for the answer to {}: "
                                "'{}'",
                                command_line_, method, excerpt(line)));
      if (!msg.is_object())
        return fail(make_status(StatusCode::kInternal,
                                "MCP server `{}` wrote a JSON {} where a JSON-RPC message (an object) belongs: '{}'",
                                command_line_, msg.type_name(), excerpt(line)));
      const bool has_id = msg.contains("id") && !msg["id"].is_null();
      if (msg.contains("method")) {
        if (has_id) {
          handle_request(msg);
          if (!failure_.ok()) return failure_;
        } else if (msg["method"] == "notifications/message") {
          const nlohmann::json& p = msg.value("params", nlohmann::json::object());
          const nlohmann::json data = p.is_object() ? p.value("data", nlohmann::json()) : nlohmann::json();
          spdlog::info("mcp server {} (pid {}) log ({}): {}", log_name_, pid_,
                       p.is_object() && p.value("level", nlohmann::json()).is_string() ? p["level"].get<std::string>()
                                                                                        : "info",
                       data.is_string() ? data.get<std::string>() : dump(data));
        } else {
          spdlog::debug("mcp server `{}` notification: {}", command_line_, excerpt(line));
        }
        continue;
      }
      if (!has_id)
        return fail(make_status(StatusCode::kInternal,
                                "MCP server `{}` wrote a message that is neither a request, a notification nor an "
                                "answer: '{}'",
                                command_line_, excerpt(line)));
      if (msg["id"] != id) {
        spdlog::debug("mcp server `{}`: dropping an answer to request {} (not the one waited for)", command_line_,
                      dump(msg["id"]));
        continue;
      }
      if (msg.contains("error")) return Answer{nlohmann::json(), msg["error"].is_null() ? nlohmann::json::object() : msg["error"]};
      if (msg.contains("result")) return Answer{msg["result"], nlohmann::json()};
      return fail(make_status(StatusCode::kInternal, "MCP server `{}` answered {} with neither result nor error: '{}'",
                              command_line_, method, excerpt(line)));
    }
    scanned = stdout_buffer_.size();
    if (stdout_buffer_.size() > kMaxLineBytes)
      return fail(make_status(StatusCode::kInternal, "MCP server `{}` wrote a line over {} MiB while answering {}",
                              command_line_, kMaxLineBytes >> 20, method));

    const int wait = remaining_ms(deadline);
    if (wait == 0) {
      // Tell it to stop working on the request; its answer, if one comes, is dropped later.
      nlohmann::json cancel = {{"jsonrpc", "2.0"},
                               {"method", "notifications/cancelled"},
                               {"params", {{"requestId", id}, {"reason", "timed out"}}}};
      (void)send(cancel, Clock::now() + milliseconds(100));
      if (!failure_.ok()) return failure_;
      return make_status(StatusCode::kTimeout, "MCP server `{}` did not answer {} within {} ms", command_line_, method,
                         timeout.count());
    }
    pollfd fds[2] = {{stdout_fd_, POLLIN, 0}, {stderr_fd_, POLLIN, 0}};
    if (poll(fds, 2, wait) < 0) {
      if (errno == EINTR) continue;
      return fail(make_status(StatusCode::kIo, "MCP server `{}`: poll: {}", command_line_, strerror(errno)));
    }
    if (fds[1].revents != 0) drain_stderr(false);
    if (fds[0].revents != 0) {
      char buffer[1 << 16];
      while (true) {
        const ssize_t n = read(stdout_fd_, buffer, sizeof(buffer));
        if (n > 0) {
          stdout_buffer_.append(buffer, static_cast<size_t>(n));
          if (stdout_buffer_.size() > kMaxLineBytes) break;
          continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n == 0) return server_gone();
        break;  // EAGAIN: all read
      }
    }
  }
}

Result<nlohmann::json> McpClient::request(const std::string& method, const nlohmann::json& params) {
  ODY_ASSIGN_OR_RETURN(Answer answer, exchange(method, params, timeout_));
  if (!answer.error.is_null())
    return make_status(StatusCode::kFailedPrecondition, "MCP server `{}` answered {} with error {}: {}", command_line_,
                       method, dump(answer.error.value("code", nlohmann::json())),
                       answer.error.value("message", nlohmann::json()).is_string()
                           ? answer.error["message"].get<std::string>()
                           : excerpt(dump(answer.error)));
  return std::move(answer.result);
}

Result<std::vector<ToolSpec>> McpClient::list_tools() {
  nlohmann::json all = nlohmann::json::array();
  std::set<std::string> cursors;
  nlohmann::json params = nlohmann::json::object();
  while (true) {
    ODY_ASSIGN_OR_RETURN(nlohmann::json page, request("tools/list", params));
    if (!page.is_object() || !page.contains("tools") || !page["tools"].is_array())
      return make_status(StatusCode::kInternal, "MCP server `{}` answered tools/list without a \"tools\" array: {}",
                         command_line_, excerpt(dump(page), 300));
    for (const auto& t : page["tools"]) {
      if (!t.is_object())
        return make_status(StatusCode::kInternal, "MCP server `{}`: tools/list holds a {} where a tool belongs",
                           command_line_, t.type_name());
      nlohmann::json tool = {{"name", t.value("name", nlohmann::json())}};
      if (auto d = t.find("description"); d != t.end() && d->is_string()) {
        tool["description"] = *d;
      } else if (auto title = t.find("title"); title != t.end() && title->is_string()) {
        tool["description"] = *title;
      }
      if (auto s = t.find("inputSchema"); s != t.end()) tool["input_schema"] = *s;
      all.push_back(std::move(tool));
    }
    auto next = page.find("nextCursor");
    if (next == page.end() || next->is_null()) break;
    if (!next->is_string())
      return make_status(StatusCode::kInternal, "MCP server `{}`: tools/list nextCursor must be a string, got {}",
                         command_line_, next->type_name());
    if (!cursors.insert(next->get<std::string>()).second)
      return make_status(StatusCode::kInternal, "MCP server `{}`: tools/list repeats cursor '{}' (a loop)",
                         command_line_, excerpt(next->get<std::string>(), 80));
    params = {{"cursor", *next}};
  }
  return parse_tools(all, fmt::format("MCP server `{}`", command_line_));
}

Result<McpToolResult> McpClient::call_tool(const std::string& name, const nlohmann::json& arguments) {
  ODY_ASSIGN_OR_RETURN(Answer answer, exchange("tools/call", {{"name", name}, {"arguments", arguments}}, timeout_));
  McpToolResult out;
  if (!answer.error.is_null()) {
    // Older servers (and the SDK for unknown tools or bad arguments) answer with a JSON-RPC
    // error: the model sees it like any failed call.
    const nlohmann::json& e = answer.error;
    out.is_error = true;
    out.text = fmt::format("MCP error {}: {}", dump(e.value("code", nlohmann::json())),
                           e.value("message", nlohmann::json()).is_string() ? e["message"].get<std::string>()
                                                                              : dump(e));
    return out;
  }
  const nlohmann::json& r = answer.result;
  if (!r.is_object())
    return fail(make_status(StatusCode::kInternal, "MCP server `{}` answered tools/call '{}' with a {}, not an object",
                            command_line_, name, r.type_name()));
  out.is_error = r.value("isError", nlohmann::json(false)) == true;
  std::vector<std::string> texts;
  const nlohmann::json content = r.value("content", nlohmann::json::array());
  if (content.is_array()) {
    for (const auto& part : content) {
      const std::string type = part.is_object() && part.value("type", nlohmann::json()).is_string()
                                   ? part["type"].get<std::string>()
                                   : "";
      if (type == "text" && part.value("text", nlohmann::json()).is_string()) {
        texts.push_back(part["text"].get<std::string>());
      } else if (type == "image" && part.value("data", nlohmann::json()).is_string()) {
        out.images.push_back({part.value("mimeType", nlohmann::json()).is_string() ? part["mimeType"].get<std::string>()
                                                                                   : "application/octet-stream",
                              part["data"].get<std::string>()});
      } else if (type == "resource" && part.value("resource", nlohmann::json()).is_object()) {
        const nlohmann::json& res = part["resource"];
        const std::string uri = res.value("uri", nlohmann::json()).is_string() ? res["uri"].get<std::string>() : "";
        if (res.value("text", nlohmann::json()).is_string()) {
          texts.push_back(fmt::format("[resource {}]\n{}", uri, res["text"].get<std::string>()));
        } else {
          const size_t size = res.value("blob", nlohmann::json()).is_string() ? res["blob"].get<std::string>().size() / 4 * 3 : 0;
          texts.push_back(fmt::format("[resource {}: {} binary data, about {} bytes]", uri,
                                      res.value("mimeType", nlohmann::json("unknown type")).is_string()
                                          ? res.value("mimeType", std::string("unknown type"))
                                          : "unknown type",
                                      size));
        }
      } else if (type == "resource_link") {
        texts.push_back(fmt::format("[resource link {}{}]", part.value("uri", std::string()),
                                    part.value("name", nlohmann::json()).is_string()
                                        ? " (" + part["name"].get<std::string>() + ")"
                                        : ""));
      } else if (type == "audio") {
        texts.push_back(fmt::format("[audio {} omitted]", part.value("mimeType", std::string("of unknown type"))));
      } else {
        texts.push_back(fmt::format("[content part odyssey does not show: {}]", excerpt(dump(part), 200)));
      }
    }
  }
  if (texts.empty() && out.images.empty() && r.contains("structuredContent"))
    texts.push_back(dump(r["structuredContent"]));
  out.text = join(texts, "\n");
  return out;
}

// ---------------------------------------------------------------------------------------------
// McpSession

namespace {

const std::vector<std::string> kConfigKeys = {
    "type",      "name",      "description", "command",    "args",      "env",
    "cwd",       "timeout_ms", "startup_timeout_ms", "tasks",      "tasks_file", "restart_per_episode",
    "max_turns", "tools",     "answer_instructions", "config_dir"};

constexpr const char* kDefaultAnswerInstructions =
    "\n\nUse the tools to work on the task. When you are done, write your final answer on a line of its own as:\n"
    "ANSWER: <your answer>";

struct TaskCheck {
  std::string tool;
  nlohmann::json arguments = nlohmann::json::object();
  std::optional<std::string> expect_contains;
};

struct Task {
  std::string id;
  std::string prompt;
  std::optional<std::string> answer;
  std::optional<TaskCheck> check;
};

struct SessionConfig {
  McpServerConfig server;
  std::string name;
  std::string description;
  std::vector<Task> tasks;
  bool restart_per_episode = false;
  int max_turns = 16;
  std::optional<std::vector<std::string>> tools;
  std::string answer_instructions = kDefaultAnswerInstructions;
};

// ${VAR} and ${VAR:-default} (the default may itself use ${...}); ${CONFIG_DIR} is config_dir.
Result<std::string> expand(const std::string& text, const std::string& key, const std::string& config_dir,
                           int depth = 0) {
  if (depth > 8) return invalid_argument("mcp config: key '{}': ${{...}} nested too deeply", key);
  std::string out;
  size_t i = 0;
  while (i < text.size()) {
    if (text.compare(i, 2, "${") != 0) {
      out += text[i++];
      continue;
    }
    // Find the matching '}' (defaults may nest).
    size_t j = i + 2;
    int open = 1;
    for (; j < text.size() && open > 0; ++j) {
      if (text.compare(j, 2, "${") == 0) {
        ++open;
        ++j;
      } else if (text[j] == '}') {
        --open;
      }
    }
    if (open != 0) return invalid_argument("mcp config: key '{}': unclosed '${{' in '{}'", key, text);
    const std::string inner = text.substr(i + 2, j - 1 - (i + 2));
    const size_t sep = inner.find(":-");
    const std::string var = inner.substr(0, sep);
    if (var.empty() || !std::all_of(var.begin(), var.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }))
      return invalid_argument("mcp config: key '{}': '${{{}}}' does not name a variable", key, inner);
    std::optional<std::string> value;
    if (var == "CONFIG_DIR") {
      if (config_dir.empty())
        return invalid_argument("mcp config: key '{}' uses ${{CONFIG_DIR}}, but the config has no config_dir (load it "
                                "from a file, or set config_dir)",
                                key);
      value = config_dir;
    } else if (const char* env = std::getenv(var.c_str()); env != nullptr && *env != '\0') {
      value = env;
    }
    if (!value) {
      if (sep == std::string::npos)
        return invalid_argument("mcp config: key '{}' uses ${{{}}}, which is not set in the environment", key, var);
      ODY_ASSIGN_OR_RETURN(value, expand(inner.substr(sep + 2), key, config_dir, depth + 1));
    }
    out += *value;
    i = j;
  }
  return out;
}

Result<std::string> get_string(const nlohmann::json& obj, const char* key, const std::string& where) {
  const auto& v = obj[key];
  if (!v.is_string()) return invalid_argument("{}: key '{}' must be a string, got {}", where, key, v.type_name());
  return v.get<std::string>();
}

Result<Task> parse_task(const nlohmann::json& t, const std::string& where) {
  if (!t.is_object()) return invalid_argument("{}: a task must be a JSON object, got {}", where, t.type_name());
  static const std::vector<std::string> keys = {"id", "prompt", "answer", "check"};
  for (const auto& [k, v] : t.items())
    if (std::find(keys.begin(), keys.end(), k) == keys.end())
      return invalid_argument("{}: unknown key '{}'{}; a task has prompt, answer, check, id", where, k,
                              did_you_mean(k, keys));
  Task task;
  if (!t.contains("prompt")) return invalid_argument("{}: missing key 'prompt'", where);
  ODY_ASSIGN_OR_RETURN(task.prompt, get_string(t, "prompt", where));
  if (trim(task.prompt).empty()) return invalid_argument("{}: key 'prompt' is empty", where);
  if (t.contains("id")) {
    ODY_ASSIGN_OR_RETURN(task.id, get_string(t, "id", where));
  }
  if (t.contains("answer")) {
    ODY_ASSIGN_OR_RETURN(task.answer, get_string(t, "answer", where));
  }
  if (t.contains("check")) {
    const nlohmann::json& c = t["check"];
    const std::string cw = where + ": check";
    if (!c.is_object()) return invalid_argument("{}: must be a JSON object, got {}", cw, c.type_name());
    static const std::vector<std::string> check_keys = {"tool", "arguments", "expect_contains"};
    for (const auto& [k, v] : c.items())
      if (std::find(check_keys.begin(), check_keys.end(), k) == check_keys.end())
        return invalid_argument("{}: unknown key '{}'{}; a check has tool, arguments, expect_contains", cw, k,
                                did_you_mean(k, check_keys));
    TaskCheck check;
    if (!c.contains("tool")) return invalid_argument("{}: missing key 'tool'", cw);
    ODY_ASSIGN_OR_RETURN(check.tool, get_string(c, "tool", cw));
    if (c.contains("arguments")) {
      if (!c["arguments"].is_object())
        return invalid_argument("{}: key 'arguments' must be a JSON object, got {}", cw, c["arguments"].type_name());
      check.arguments = c["arguments"];
    }
    if (c.contains("expect_contains")) {
      ODY_ASSIGN_OR_RETURN(check.expect_contains, get_string(c, "expect_contains", cw));
    }
    task.check = std::move(check);
  }
  if (!task.answer && !task.check)
    return invalid_argument("{}: a task needs an 'answer', a 'check' or both, to be scored", where);
  return task;
}

Result<std::vector<Task>> read_tasks_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return make_status(StatusCode::kNotFound, "mcp config: key 'tasks_file': cannot read '{}'", path);
  std::vector<Task> tasks;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (trim(line).empty()) continue;
    const std::string where = fmt::format("mcp tasks_file {}:{}", path, number);
    nlohmann::json t = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (t.is_discarded()) return invalid_argument("{}: not valid JSON", where);
    ODY_ASSIGN_OR_RETURN(Task task, parse_task(t, where));
    tasks.push_back(std::move(task));
  }
  if (tasks.empty()) return invalid_argument("mcp config: key 'tasks_file': '{}' holds no tasks", path);
  return tasks;
}

std::string resolve(const std::string& path, const std::string& config_dir) {
  if (path.empty() || config_dir.empty() || fs::path(path).is_absolute()) return path;
  return (fs::path(config_dir) / path).lexically_normal().string();
}

Result<SessionConfig> parse_config(const nlohmann::json& config) {
  const std::string where = "mcp config";
  if (!config.is_object()) return invalid_argument("{}: must be a JSON object, got {}", where, config.type_name());
  for (const auto& [k, v] : config.items())
    if (std::find(kConfigKeys.begin(), kConfigKeys.end(), k) == kConfigKeys.end())
      return invalid_argument("{}: unknown key '{}'{}; the keys are {}", where, k, did_you_mean(k, kConfigKeys),
                              join(kConfigKeys, ", "));
  SessionConfig out;
  std::string config_dir;
  if (config.contains("config_dir")) {
    ODY_ASSIGN_OR_RETURN(config_dir, get_string(config, "config_dir", where));
  }
  if (config.contains("type")) {
    ODY_ASSIGN_OR_RETURN(std::string type, get_string(config, "type", where));
    if (type != "mcp") return invalid_argument("{}: key 'type' must be \"mcp\", got \"{}\"", where, type);
  }
  if (!config.contains("command")) return invalid_argument("{}: missing key 'command' (the MCP server to run)", where);
  ODY_ASSIGN_OR_RETURN(std::string command, get_string(config, "command", where));
  ODY_ASSIGN_OR_RETURN(out.server.command, expand(command, "command", config_dir));
  if (trim(out.server.command).empty()) return invalid_argument("{}: key 'command' is empty", where);
  if (out.server.command.find('/') != std::string::npos) out.server.command = resolve(out.server.command, config_dir);
  if (config.contains("args")) {
    const auto& args = config["args"];
    if (!args.is_array()) return invalid_argument("{}: key 'args' must be an array of strings, got {}", where, args.type_name());
    for (size_t i = 0; i < args.size(); ++i) {
      if (!args[i].is_string())
        return invalid_argument("{}: key 'args[{}]' must be a string, got {}", where, i, args[i].type_name());
      ODY_ASSIGN_OR_RETURN(std::string a, expand(args[i].get<std::string>(), fmt::format("args[{}]", i), config_dir));
      out.server.args.push_back(std::move(a));
    }
  }
  if (config.contains("env")) {
    const auto& env = config["env"];
    if (!env.is_object()) return invalid_argument("{}: key 'env' must be an object of strings, got {}", where, env.type_name());
    for (const auto& [k, v] : env.items()) {
      if (!v.is_string())
        return invalid_argument("{}: key 'env.{}' must be a string, got {}", where, k, v.type_name());
      if (k.empty() || k.find('=') != std::string::npos)
        return invalid_argument("{}: key 'env.{}' is not a valid variable name", where, k);
      ODY_ASSIGN_OR_RETURN(out.server.env[k], expand(v.get<std::string>(), "env." + k, config_dir));
    }
  }
  if (config.contains("cwd")) {
    ODY_ASSIGN_OR_RETURN(std::string cwd, get_string(config, "cwd", where));
    ODY_ASSIGN_OR_RETURN(cwd, expand(cwd, "cwd", config_dir));
    out.server.cwd = resolve(cwd, config_dir);
  }
  if (config.contains("timeout_ms")) {
    const auto& t = config["timeout_ms"];
    if (!t.is_number_integer() || t.get<int64_t>() <= 0 || t.get<int64_t>() > 86400000)
      return invalid_argument("{}: key 'timeout_ms' must be an integer in 1..86400000, got {}", where, dump(t));
    out.server.timeout = milliseconds(t.get<int64_t>());
  }
  if (config.contains("startup_timeout_ms")) {
    const auto& t = config["startup_timeout_ms"];
    if (!t.is_number_integer() || t.get<int64_t>() <= 0 || t.get<int64_t>() > 86400000)
      return invalid_argument("{}: key 'startup_timeout_ms' must be an integer in 1..86400000, got {}", where, dump(t));
    out.server.startup_timeout = milliseconds(t.get<int64_t>());
  }
  if (config.contains("max_turns")) {
    const auto& t = config["max_turns"];
    if (!t.is_number_integer() || t.get<int64_t>() <= 0 || t.get<int64_t>() > 100000)
      return invalid_argument("{}: key 'max_turns' must be an integer in 1..100000, got {}", where, dump(t));
    out.max_turns = static_cast<int>(t.get<int64_t>());
  }
  if (config.contains("restart_per_episode")) {
    const auto& r = config["restart_per_episode"];
    if (!r.is_boolean())
      return invalid_argument("{}: key 'restart_per_episode' must be true or false, got {}", where, dump(r));
    out.restart_per_episode = r.get<bool>();
  }
  if (config.contains("name")) {
    ODY_ASSIGN_OR_RETURN(out.name, get_string(config, "name", where));
  }
  if (config.contains("description")) {
    ODY_ASSIGN_OR_RETURN(out.description, get_string(config, "description", where));
  }
  if (config.contains("answer_instructions")) {
    ODY_ASSIGN_OR_RETURN(out.answer_instructions, get_string(config, "answer_instructions", where));
  }
  if (config.contains("tools")) {
    const auto& tools = config["tools"];
    if (!tools.is_array() || tools.empty())
      return invalid_argument("{}: key 'tools' must be a non-empty array of tool names", where);
    std::vector<std::string> names;
    for (size_t i = 0; i < tools.size(); ++i) {
      if (!tools[i].is_string())
        return invalid_argument("{}: key 'tools[{}]' must be a string, got {}", where, i, tools[i].type_name());
      names.push_back(tools[i].get<std::string>());
    }
    out.tools = std::move(names);
  }
  const bool inline_tasks = config.contains("tasks");
  if (inline_tasks == config.contains("tasks_file"))
    return invalid_argument("{}: give exactly one of 'tasks' (a list) and 'tasks_file' (a JSONL file)", where);
  if (inline_tasks) {
    const auto& tasks = config["tasks"];
    if (!tasks.is_array() || tasks.empty())
      return invalid_argument("{}: key 'tasks' must be a non-empty array of tasks", where);
    for (size_t i = 0; i < tasks.size(); ++i) {
      ODY_ASSIGN_OR_RETURN(Task task, parse_task(tasks[i], fmt::format("{}: tasks[{}]", where, i)));
      out.tasks.push_back(std::move(task));
    }
  } else {
    ODY_ASSIGN_OR_RETURN(std::string file, get_string(config, "tasks_file", where));
    ODY_ASSIGN_OR_RETURN(file, expand(file, "tasks_file", config_dir));
    ODY_ASSIGN_OR_RETURN(out.tasks, read_tasks_file(resolve(file, config_dir)));
  }
  return out;
}

// Lines "ANSWER: ..." in a turn's text; the last one is the answer.
std::optional<std::string> find_answer(const std::string& text) {
  std::optional<std::string> answer;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    const std::string t = trim(line);
    if (t.rfind("ANSWER:", 0) == 0) answer = trim(t.substr(7));
  }
  return answer;
}

class McpSession : public EnvSession {
 public:
  explicit McpSession(SessionConfig config) : config_(std::move(config)) {}
  ~McpSession() override {
    if (client_) client_->close();
  }

  // Starts the server and learns its tools; checks the tasks' checks against them.
  Status start_server() {
    if (client_) client_->close();
    client_.reset();
    episodes_on_server_ = 0;
    ODY_ASSIGN_OR_RETURN(client_, McpClient::start(config_.server));
    auto listed = client_->list_tools();
    if (!listed.ok()) return listed.status();
    std::map<std::string, ToolSpec> by_name;
    for (auto& spec : *listed) by_name[spec.name] = spec;
    auto available = [&] {
      std::vector<std::string> names;
      for (const auto& [n, s] : by_name) names.push_back(n);
      return join(names, ", ");
    };
    std::vector<ToolSpec> exposed;
    if (config_.tools) {
      for (const auto& name : *config_.tools) {
        auto it = by_name.find(name);
        if (it == by_name.end())
          return invalid_argument("mcp config: key 'tools' names '{}', which MCP server `{}` does not offer (it has: {})",
                                  name, client_->command_line(), available());
        exposed.push_back(it->second);
      }
    } else {
      exposed = *listed;
    }
    schemas_.clear();
    for (const auto& [name, spec] : by_name) {
      ODY_ASSIGN_OR_RETURN(JsonSchema schema,
                           JsonSchema::compile(spec.input_schema, fmt::format("MCP tool '{}' input schema", name)));
      schemas_.emplace(name, std::move(schema));
    }
    for (size_t i = 0; i < config_.tasks.size(); ++i) {
      const auto& check = config_.tasks[i].check;
      if (!check) continue;
      auto it = schemas_.find(check->tool);
      if (it == schemas_.end())
        return invalid_argument("mcp config: task {}: check.tool '{}' is not a tool of the server (it has: {})", i,
                                check->tool, available());
      const auto errors = it->second.validate(check->arguments);
      if (!errors.empty())
        return invalid_argument("mcp config: task {}: check.arguments do not fit tool '{}': {}", i, check->tool,
                                join(errors, "; "));
    }
    exposed_.clear();
    for (const auto& spec : exposed) exposed_.insert(spec.name);
    const nlohmann::json& si = client_->server_info();
    info_.name = !config_.name.empty() ? config_.name
                 : si.value("name", nlohmann::json()).is_string() ? si["name"].get<std::string>()
                                                                  : "mcp";
    info_.version = si.value("version", nlohmann::json()).is_string() ? si["version"].get<std::string>() : "";
    info_.description = !config_.description.empty() ? config_.description : client_->instructions();
    info_.tools = std::move(exposed);
    info_.snapshots = false;
    info_.images = true;
    info_.source = client_->command_line();
    info_.source_hash.clear();
    return Status::Ok();
  }

  const EnvInfo& info() const override { return info_; }

  Result<env::Observation> reset(const nlohmann::json& task, uint64_t seed) override {
    started_ = false;
    ODY_ASSIGN_OR_RETURN(Task chosen, pick_task(task, seed));
    const bool dead = !client_ || !client_->alive();
    if (dead || (config_.restart_per_episode && episodes_on_server_ > 0)) {
      if (dead && client_) spdlog::warn("mcp: restarting the server: {}", client_->failure().message());
      Status s = start_server();
      if (!s.ok()) return s.with_context("mcp reset: restarting the server");
    }
    ++episodes_on_server_;
    task_ = std::move(chosen);
    started_ = true;
    done_ = false;
    turns_ = 0;
    answer_.reset();
    env::Observation obs;
    obs.text = task_.prompt + config_.answer_instructions;
    obs.info = {{"task", task_info()}};
    return obs;
  }

  Result<env::Observation> step(const env::Action& action) override {
    if (!started_) return make_status(StatusCode::kFailedPrecondition, "mcp step: no episode is running; call reset first");
    if (done_) return make_status(StatusCode::kFailedPrecondition, "mcp step: the episode is over; call reset");
    env::Observation obs;
    for (const auto& call : action.tool_calls) {
      ODY_ASSIGN_OR_RETURN(env::ToolResult result, run_call(call, obs));
      obs.tool_results.push_back(std::move(result));
    }
    ++turns_;
    std::string ended_by;
    if (auto answer = find_answer(action.text)) {
      answer_ = std::move(answer);
      ended_by = "answer";
    } else if (action.tool_calls.empty()) {
      ended_by = "no_tool_calls";
    } else if (turns_ >= config_.max_turns) {
      ended_by = "max_turns";
      obs.text = fmt::format("The episode ended: {} turns is the limit.", config_.max_turns);
    }
    obs.done = done_ = !ended_by.empty();
    obs.info = {{"turn", turns_}};
    if (done_) obs.info["ended_by"] = ended_by;
    return obs;
  }

  Result<env::Score> score() override {
    if (!started_) return make_status(StatusCode::kFailedPrecondition, "mcp score: no episode to score; call reset first");
    env::Score score;
    score.info = {{"task", task_info()}, {"answer", answer_ ? nlohmann::json(*answer_) : nlohmann::json()}};
    bool success = true;
    if (task_.answer) {
      const bool right = answer_ && trim(*answer_) == trim(*task_.answer);
      score.parts.push_back({"answer", right ? 1.0 : 0.0});
      score.info["expected_answer"] = *task_.answer;
      success = success && right;
    }
    if (task_.check) {
      if (!client_ || !client_->alive())
        return Status(StatusCode::kUnavailable, client_ ? client_->failure().message() : "no server")
            .with_context("mcp score: running the check");
      auto result = client_->call_tool(task_.check->tool, task_.check->arguments);
      bool passed = false;
      nlohmann::json check_info = {{"tool", task_.check->tool}};
      if (result.ok()) {
        passed = !result->is_error &&
                 (!task_.check->expect_contains || result->text.find(*task_.check->expect_contains) != std::string::npos);
        check_info["is_error"] = result->is_error;
        check_info["text"] = excerpt(result->text, 2000);
      } else if (result.status().code() == StatusCode::kTimeout) {
        check_info["error"] = result.status().message();
      } else {
        return result.status().with_context("mcp score: running the check");
      }
      check_info["passed"] = passed;
      score.info["check"] = check_info;
      score.parts.push_back({"check", passed ? 1.0 : 0.0});
      success = success && passed;
    }
    score.success = success;
    score.reward = success ? 1.0 : 0.0;
    return score;
  }

  Result<std::string> snapshot() override {
    return make_status(StatusCode::kFailedPrecondition, "mcp environment '{}' cannot snapshot (an MCP server's state is its own)",
                       info_.name);
  }
  Status restore(std::string_view) override {
    return make_status(StatusCode::kFailedPrecondition, "mcp environment '{}' cannot restore snapshots", info_.name);
  }

 private:
  Result<Task> pick_task(const nlohmann::json& task, uint64_t seed) {
    const size_t n = config_.tasks.size();
    if (task.is_null() || (task.is_object() && task.empty())) {
      task_index_ = static_cast<int64_t>(odyssey::env::splitmix64(seed) % n);
      return config_.tasks[static_cast<size_t>(task_index_)];
    }
    if (!task.is_object()) return invalid_argument("mcp reset: the task must be a JSON object, got {}", task.type_name());
    if (task.contains("prompt")) {
      task_index_ = -1;
      ODY_ASSIGN_OR_RETURN(Task adhoc, parse_task(task, "mcp reset: task"));
      if (adhoc.check && schemas_.count(adhoc.check->tool) == 0)
        return invalid_argument("mcp reset: task: check.tool '{}' is not a tool of the server", adhoc.check->tool);
      if (adhoc.check) {
        const auto errors = schemas_.at(adhoc.check->tool).validate(adhoc.check->arguments);
        if (!errors.empty())
          return invalid_argument("mcp reset: task: check.arguments do not fit tool '{}': {}", adhoc.check->tool,
                                  join(errors, "; "));
      }
      return adhoc;
    }
    if (!task.contains("index") || task.size() != 1)
      return invalid_argument("mcp reset: the task must be {{\"index\": i}}, {{}} (drawn from the seed) or a task with "
                              "a 'prompt'; got {}",
                              excerpt(dump(task), 200));
    const auto& index = task["index"];
    if (!index.is_number_integer())
      return invalid_argument("mcp reset: task key 'index' must be an integer, got {}", index.type_name());
    const int64_t i = index.get<int64_t>();
    if (i < 0 || static_cast<size_t>(i) >= n)
      return invalid_argument("mcp reset: task index {} is out of range: the task list has {} tasks", i, n);
    task_index_ = i;
    return config_.tasks[static_cast<size_t>(i)];
  }

  nlohmann::json task_info() const {
    nlohmann::json info = {{"index", task_index_ < 0 ? nlohmann::json() : nlohmann::json(task_index_)}};
    if (!task_.id.empty()) info["id"] = task_.id;
    return info;
  }

  Result<env::ToolResult> run_call(const env::ToolCall& call, env::Observation& obs) {
    env::ToolResult out{call.id, "", true};
    if (exposed_.count(call.name) == 0) {
      std::vector<std::string> names;
      for (const auto& t : info_.tools) names.push_back(t.name);
      out.content = fmt::format("unknown tool '{}'; the tools are: {}", call.name, join(names, ", "));
      return out;
    }
    if (!call.arguments.is_object()) {
      out.content = fmt::format("invalid arguments for tool '{}': expected a JSON object, got {}", call.name,
                                call.arguments.type_name());
      return out;
    }
    const auto errors = schemas_.at(call.name).validate(call.arguments);
    if (!errors.empty()) {
      out.content = fmt::format("invalid arguments for tool '{}': {}", call.name, join(errors, "; "));
      return out;
    }
    if (!client_->alive()) return Status(StatusCode::kUnavailable, client_->failure().message()).with_context("mcp step");
    auto result = client_->call_tool(call.name, call.arguments);
    if (!result.ok()) {
      if (result.status().code() == StatusCode::kTimeout) {
        out.content = fmt::format("tool '{}' did not finish within {} ms", call.name, config_.server.timeout.count());
        return out;
      }
      return result.status().with_context(fmt::format("mcp step: tool '{}'", call.name));
    }
    out.is_error = result->is_error;
    out.content = result->text;
    for (const McpImage& image : result->images) {
      auto bytes = base64_decode(image.data_base64);
      std::optional<std::pair<uint32_t, uint32_t>> size;
      if (bytes) size = png_size(*bytes);
      if (image.mime_type == "image/png" && size) {
        env::Image im;
        im.format = ODY_ENV_IMAGE_PNG;
        im.width = size->first;
        im.height = size->second;
        im.data = std::move(*bytes);
        obs.images.push_back(std::move(im));
        out.content += fmt::format("{}[image {}: {}x{} PNG]", out.content.empty() ? "" : "\n", obs.images.size(),
                                   size->first, size->second);
      } else {
        out.content += fmt::format("{}[{} image of {} bytes not shown: only PNG images are passed on]",
                                   out.content.empty() ? "" : "\n", image.mime_type, bytes ? bytes->size() : 0);
      }
    }
    return out;
  }

  SessionConfig config_;
  EnvInfo info_;
  std::unique_ptr<McpClient> client_;
  std::map<std::string, JsonSchema> schemas_;
  std::set<std::string> exposed_;
  int episodes_on_server_ = 0;
  bool started_ = false;
  bool done_ = false;
  int turns_ = 0;
  Task task_;
  int64_t task_index_ = -1;
  std::optional<std::string> answer_;
};

}  // namespace

Result<std::unique_ptr<EnvSession>> make_mcp_session(const nlohmann::json& config) {
  ODY_ASSIGN_OR_RETURN(SessionConfig parsed, parse_config(config));
  auto session = std::make_unique<McpSession>(std::move(parsed));
  ODY_RETURN_IF_ERROR(session->start_server());
  return std::unique_ptr<EnvSession>(std::move(session));
}

Result<nlohmann::json> load_mcp_config_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return make_status(StatusCode::kNotFound, "mcp config {}: cannot read the file", path);
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::parse_error& e) {
    return invalid_argument("mcp config {}: not valid JSON: {}", path, e.what());
  }
  if (!config.is_object()) return invalid_argument("mcp config {}: must be a JSON object, got {}", path, config.type_name());
  if (!config.contains("config_dir")) {
    std::error_code ec;
    fs::path dir = fs::absolute(fs::path(path), ec).parent_path();
    config["config_dir"] = dir.lexically_normal().string();
  }
  return config;
}

bool is_mcp_config(const nlohmann::json& config) {
  return config.is_object() && config.contains("type") && config["type"] == "mcp";
}

Result<std::string> find_mcp_config(const std::string& name_or_path, const std::vector<std::string>& extra_dirs) {
  auto is_file = [](const fs::path& p) {
    std::error_code ec;
    return fs::is_regular_file(p, ec);
  };
  const bool is_path = name_or_path.find('/') != std::string::npos ||
                       (name_or_path.size() > 5 && name_or_path.compare(name_or_path.size() - 5, 5, ".json") == 0);
  if (is_path) {
    if (is_file(name_or_path)) return name_or_path;
    return make_status(StatusCode::kNotFound, "mcp config {}: no such file", name_or_path);
  }
  std::vector<std::string> dirs;
  if (const char* path = std::getenv("ODYSSEY_ENV_PATH"); path != nullptr) {
    std::stringstream ss(path);
    for (std::string d; std::getline(ss, d, ':');)
      if (!d.empty()) dirs.push_back(d);
  }
  dirs.insert(dirs.end(), extra_dirs.begin(), extra_dirs.end());
  dirs.push_back("configs/envs");
  for (const auto& d : dirs) {
    const fs::path candidate = fs::path(d) / (name_or_path + ".json");
    if (is_file(candidate)) return candidate.string();
  }
  return make_status(StatusCode::kNotFound, "no MCP environment file {}.json in {}", name_or_path, join(dirs, ", "));
}

}  // namespace odyssey::envs
