// Runs a shell command line and returns what it printed (stdout and stderr) and its exit code.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace odyssey::testing {

inline std::string run_shell(const std::string& cmd, int* code) {
  std::string out;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  std::array<char, 4096> buf;
  while (size_t n = std::fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  *code = WEXITSTATUS(::pclose(p));
  return out;
}

}  // namespace odyssey::testing
