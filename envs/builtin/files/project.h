// Task projects for the files environment: a tiny software project generated from a seed, with
// a check script that exits 0 exactly when the task is solved.
//
// Families (each with several variants; arguments, names and expected values come from the seed):
//   python_fix        a Python function with a bug; tests/test_*.py lists the cases it must pass
//   python_implement  a Python function stub with a docstring to implement
//   shell_fix         a POSIX sh script with a bug; check.sh runs it and compares its output
//   config            a config file (INI or JSON) to complete as TASK.md describes
// Every project has TASK.md, check.sh (run as `sh check.sh` in the project directory) and the
// check's own files, listed in protected_paths: the environment refuses to write them and puts
// the pristine copies back before each check, so a solution cannot pass by editing the check.
// The expected values are computed here, in C++, from reference implementations; each generated
// project is verified to fail as given (some case exercises the bug or the stub).
//
// Checks need /bin/sh and, for the Python and config families, python3 (Debian 12: python3).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace odyssey::files {

struct ProjectFile {
  std::string path;  // relative, '/'-separated
  std::string content;
};

struct Project {
  std::string family;
  std::string variant;
  std::string statement;  // what to do (also in TASK.md)
  std::vector<ProjectFile> files;
  std::vector<std::string> protected_paths;
  std::vector<ProjectFile> solution;  // written over `files`, these pass the check
};

// The family names, in a fixed order.
const std::vector<std::string>& families();

// The project for `seed`; family "" draws one from the seed. Throws std::invalid_argument for an
// unknown family.
Project make_project(const std::string& family, uint64_t seed);

}  // namespace odyssey::files
