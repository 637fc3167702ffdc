// Helpers for replay tests: temporary directories, free loopback ports, child processes
// (the real `odyssey` binary), and ready-made segments.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "core/codec.h"

namespace odyssey::testing {

// A fresh directory under the system temp dir, removed (recursively) on destruction unless
// ODYSSEY_KEEP_TEST_DIRS is set (to look at what a failing test left behind).
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::filesystem::path& path() const { return path_; }
  std::string str(const std::string& child = "") const { return (path_ / child).string(); }

 private:
  std::filesystem::path path_;
};

// A TCP port on 127.0.0.1 that was free a moment ago.
int free_port();

// A child process running `argv` (argv[0] is the program path); stdout and stderr go to files.
class Process {
 public:
  Process(std::vector<std::string> argv, const std::string& log_path);
  ~Process();  // SIGKILLs the child if it is still running
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  pid_t pid() const { return pid_; }
  void kill(int signal);
  // Exit code (128 + signal when killed), or -1 when it did not exit in time.
  int wait(std::chrono::milliseconds timeout);
  bool running();
  // Waits until the child's output contains `text` (true) or the timeout passes (false).
  bool wait_for_output(const std::string& text, std::chrono::milliseconds timeout);
  std::string output() const;

 private:
  pid_t pid_ = -1;
  int status_ = -1;
  std::string log_path_;
};

// Runs `argv` to completion; returns its exit code and puts stdout+stderr in `output`.
int run_command(const std::vector<std::string>& argv, std::string* output);

// `n` tokens, logprobs, versions `version`, alternating loss mask, one assistant turn.
SegmentData make_segment(size_t n, uint32_t version = 1, uint32_t token_base = 0);

}  // namespace odyssey::testing
