// Confinement for the files environment: paths the model names are resolved inside the task
// directory, and the check runs as a child process with limits.
//
// confine(): a path is refused (PathError, a message for the model) when it is absolute, when
// `..` would leave the directory, or when an existing component is a symlink that dangles or
// resolves outside it. Symlinks inside are followed. The result is absolute, under `root`, and
// free of symlinks up to its first missing component, so a write that opens it with O_NOFOLLOW
// cannot land outside. (Nothing else runs in the directory while a tool call is served: the
// check's processes are killed, as a group, before run_limited returns.)
//
// run_limited(): fork + exec with setrlimit in the child (CPU seconds, address space, file size,
// open files, no core dumps), stdin from /dev/null, stdout+stderr into one pipe read by the
// parent (kept up to output_bytes, the rest counted and dropped), its own process group, a
// wall-clock timeout after which the whole group gets SIGKILL, and SIGKILL to the group after
// the child exits too (stray background processes). The child calls only async-signal-safe
// functions before exec, so it is safe from a multi-threaded host. It does not isolate the
// filesystem or network: that is env-host's job (envs/env_host.h) when the model is untrusted.
#pragma once

#include <cstdint>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

namespace odyssey::files {

struct PathError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The absolute path for `relative` inside `root` (a canonical directory); see above.
std::filesystem::path confine(const std::filesystem::path& root, const std::string& relative);

// `p` is `root` or below it (both canonical).
bool inside(const std::filesystem::path& root, const std::filesystem::path& p);

struct RunLimits {
  double timeout_s = 10;
  uint64_t cpu_s = 11;
  uint64_t memory_bytes = 512ull << 20;  // RLIMIT_AS
  uint64_t file_bytes = 16ull << 20;     // RLIMIT_FSIZE
  size_t output_bytes = 8192;
};

struct RunResult {
  int exit_code = -1;  // 128 + signal when killed by one
  int signal = 0;
  bool timed_out = false;
  std::string output;        // stdout and stderr, interleaved, truncated
  uint64_t dropped = 0;      // output bytes past output_bytes
  double seconds = 0;
  std::string error;         // set when the process could not be started
};

RunResult run_limited(const std::vector<std::string>& argv, const std::string& directory,
                      const std::vector<std::string>& environment, const RunLimits& limits);

// Removes a directory tree without following symlinks, first making its directories writable
// (the model's code may have made them read-only). Never throws.
void remove_tree(const std::filesystem::path& directory) noexcept;

}  // namespace odyssey::files
