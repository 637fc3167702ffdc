#include "sandbox.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

namespace odyssey::files {
namespace fs = std::filesystem;

bool inside(const fs::path& root, const fs::path& p) {
  const std::string& r = root.native();
  const std::string& s = p.native();
  return s == r || (s.size() > r.size() && s.compare(0, r.size(), r) == 0 && (s[r.size()] == '/' || r == "/"));
}

fs::path confine(const fs::path& root, const std::string& relative) {
  if (relative.empty()) throw PathError("the path is empty; give a path relative to the task directory, e.g. \".\"");
  if (relative.size() > 1024) throw PathError("the path is longer than 1024 bytes");
  if (relative.find('\0') != std::string::npos) throw PathError("the path contains a NUL byte");
  if (relative[0] == '/')
    throw PathError("'" + relative + "' is absolute; paths are relative to the task directory");
  const fs::path normal = fs::path(relative).lexically_normal();
  std::vector<fs::path> parts;
  for (const fs::path& part : normal) {
    if (part == "..") throw PathError("'" + relative + "' leaves the task directory (..)");
    if (part == "." || part.empty()) continue;
    parts.push_back(part);
  }
  fs::path at = root;
  for (size_t i = 0; i < parts.size(); ++i) {
    at /= parts[i];
    struct stat st;
    if (::lstat(at.c_str(), &st) != 0) {
      if (errno != ENOENT && errno != ENOTDIR) throw PathError("'" + relative + "': " + std::strerror(errno));
      for (size_t j = i + 1; j < parts.size(); ++j) at /= parts[j];  // the rest does not exist yet
      return at;
    }
    if (S_ISLNK(st.st_mode)) {
      std::error_code ec;
      const fs::path target = fs::canonical(at, ec);
      if (ec) throw PathError("'" + relative + "' goes through a symlink that points nowhere");
      if (!inside(root, target)) throw PathError("'" + relative + "' goes through a symlink that points outside the task directory");
      at = target;
    }
  }
  return at;
}

namespace {

double since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void close_from(int first, int last_fd) {
#ifdef SYS_close_range
  if (::syscall(SYS_close_range, first, ~0u, 0) == 0) return;
#endif
  for (int fd = first; fd <= last_fd; ++fd) ::close(fd);
}

void keep(RunResult& result, const char* data, size_t n, size_t cap) {
  const size_t room = result.output.size() < cap ? cap - result.output.size() : 0;
  const size_t take = std::min(room, n);
  result.output.append(data, take);
  result.dropped += n - take;
}

// Reads what is available; false on EOF or error.
bool read_some(int fd, RunResult& result, size_t cap) {
  char buffer[16384];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n > 0) {
      keep(result, buffer, static_cast<size_t>(n), cap);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
  }
}

void make_writable(const fs::path& dir, int depth) {
  ::chmod(dir.c_str(), 0700);
  if (depth > 64) return;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    struct stat st;
    if (::lstat(it->path().c_str(), &st) == 0 && S_ISDIR(st.st_mode)) make_writable(it->path(), depth + 1);
  }
}

}  // namespace

RunResult run_limited(const std::vector<std::string>& argv, const std::string& directory,
                      const std::vector<std::string>& environment, const RunLimits& limits) {
  RunResult result;
  const auto start = std::chrono::steady_clock::now();
  // Everything the child needs is prepared before fork: it may only call async-signal-safe
  // functions until exec.
  std::vector<char*> args, envs;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  for (const std::string& e : environment) envs.push_back(const_cast<char*>(e.c_str()));
  envs.push_back(nullptr);
  struct rlimit nofile_now {};
  ::getrlimit(RLIMIT_NOFILE, &nofile_now);
  const int last_fd = nofile_now.rlim_cur == RLIM_INFINITY || nofile_now.rlim_cur > 65536 ? 65536
                                                                                          : static_cast<int>(nofile_now.rlim_cur);
  const struct rlimit cpu = {limits.cpu_s, limits.cpu_s + 1};
  const struct rlimit memory = {limits.memory_bytes, limits.memory_bytes};
  const struct rlimit file = {limits.file_bytes, limits.file_bytes};
  const struct rlimit nofile = {256, 256};
  const struct rlimit core = {0, 0};

  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) {
    result.error = std::string("pipe: ") + std::strerror(errno);
    return result;
  }
  const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  const pid_t pid = ::fork();
  if (pid < 0) {
    result.error = std::string("fork: ") + std::strerror(errno);
    ::close(pipe_fds[0]);
    ::close(pipe_fds[1]);
    if (null_fd >= 0) ::close(null_fd);
    return result;
  }
  if (pid == 0) {
    ::setpgid(0, 0);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (const int s : {SIGPIPE, SIGINT, SIGTERM, SIGHUP, SIGCHLD}) ::sigaction(s, &dfl, nullptr);
    if (null_fd >= 0) ::dup2(null_fd, 0);
    ::dup2(pipe_fds[1], 1);
    ::dup2(pipe_fds[1], 2);
    close_from(3, last_fd);
    if (::chdir(directory.c_str()) != 0) ::_exit(126);
    ::setrlimit(RLIMIT_CPU, &cpu);
    ::setrlimit(RLIMIT_AS, &memory);
    ::setrlimit(RLIMIT_FSIZE, &file);
    ::setrlimit(RLIMIT_NOFILE, &nofile);
    ::setrlimit(RLIMIT_CORE, &core);
    ::execve(args[0], args.data(), envs.data());
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also here, so the group exists before we might signal it
  ::close(pipe_fds[1]);
  if (null_fd >= 0) ::close(null_fd);
  const int out = pipe_fds[0];
  ::fcntl(out, F_SETFL, ::fcntl(out, F_GETFL) | O_NONBLOCK);
  bool pipe_open = true;
  int status = 0;
  int idle_ms = 1;
  for (;;) {
    const pid_t got = ::waitpid(pid, &status, WNOHANG);
    if (got == pid || (got < 0 && errno != EINTR)) break;
    const double left = limits.timeout_s - since(start);
    if (left <= 0) {
      result.timed_out = true;
      ::kill(-pid, SIGKILL);
      ::kill(pid, SIGKILL);
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      break;
    }
    if (pipe_open) {
      struct pollfd p = {out, POLLIN, 0};
      const int wait_ms = static_cast<int>(std::min(50.0, left * 1000.0)) + 1;
      if (::poll(&p, 1, wait_ms) > 0) pipe_open = read_some(out, result, limits.output_bytes);
    } else {
      // The output is closed, so the child is most likely exiting: look again soon, then less often.
      ::poll(nullptr, 0, static_cast<int>(std::min<double>({static_cast<double>(idle_ms), 50.0, left * 1000.0})) + 1);
      idle_ms = std::min(idle_ms * 2, 50);
    }
  }
  ::kill(-pid, SIGKILL);  // whatever the check left running in its group
  if (pipe_open) read_some(out, result, limits.output_bytes);
  ::close(out);
  result.seconds = since(start);
  if (WIFEXITED(status)) {
    result.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    result.signal = WTERMSIG(status);
    result.exit_code = 128 + result.signal;
  }
  return result;
}

void remove_tree(const fs::path& directory) noexcept {
  try {
    struct stat st;
    if (::lstat(directory.c_str(), &st) != 0) return;
    if (S_ISDIR(st.st_mode)) make_writable(directory, 0);
    std::error_code ec;
    fs::remove_all(directory, ec);
  } catch (...) {
  }
}

}  // namespace odyssey::files
