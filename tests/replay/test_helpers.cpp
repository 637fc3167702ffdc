#include "test_helpers.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

namespace odyssey::testing {

namespace fs = std::filesystem;

TempDir::TempDir() {
  std::random_device rd;
  path_ = fs::temp_directory_path() / ("odyssey-test-" + std::to_string(::getpid()) + "-" + std::to_string(rd()));
  fs::create_directories(path_);
}

TempDir::~TempDir() {
  if (std::getenv("ODYSSEY_KEEP_TEST_DIRS")) {
    std::fprintf(stderr, "kept test directory %s\n", path_.c_str());
    return;
  }
  std::error_code ec;
  fs::remove_all(path_, ec);
}

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  int port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

Process::Process(std::vector<std::string> argv, const std::string& log_path) : log_path_(log_path) {
  pid_ = ::fork();
  if (pid_ == 0) {
    int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::close(fd);
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
}

Process::~Process() {
  if (running()) {
    kill(SIGKILL);
    wait(std::chrono::seconds(10));
  }
}

void Process::kill(int signal) {
  if (pid_ > 0) ::kill(pid_, signal);
}

bool Process::running() {
  if (pid_ <= 0 || status_ != -1) return false;
  int st;
  pid_t r = ::waitpid(pid_, &st, WNOHANG);
  if (r == pid_) {
    status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    return false;
  }
  return true;
}

int Process::wait(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (running()) {
    if (std::chrono::steady_clock::now() > deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return status_;
}

std::string Process::output() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool Process::wait_for_output(const std::string& text, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (output().find(text) != std::string::npos) return true;
    if (!running()) return output().find(text) != std::string::npos;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

int run_command(const std::vector<std::string>& argv, std::string* output) {
  char tmpl[] = "/tmp/odyssey-cmd-XXXXXX";
  int fd = ::mkstemp(tmpl);
  ::close(fd);
  int code;
  {
    Process p(argv, tmpl);
    code = p.wait(std::chrono::minutes(5));
    if (output) *output = p.output();
  }
  ::unlink(tmpl);
  return code;
}

SegmentData make_segment(size_t n, uint32_t version, uint32_t token_base) {
  SegmentData d;
  for (size_t i = 0; i < n; ++i) {
    d.tokens.push_back(token_base + static_cast<uint32_t>(i % 256));
    d.logprobs.push_back(-0.25f * static_cast<float>(i % 7));
    d.policy_versions.push_back(version);
    d.loss_mask.push_back(static_cast<uint8_t>(i % 2));
  }
  if (n) d.turns.push_back({schema::Role::ASSISTANT, 0, static_cast<uint32_t>(n), false});
  return d;
}

}  // namespace odyssey::testing
