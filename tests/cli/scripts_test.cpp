// The developer scripts that need no GPU, run for real on a scratch git repository.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "cli/run_command.h"

namespace {

namespace fs = std::filesystem;

// A git repository in a fresh temporary directory (removed afterwards) holding a copy of
// scripts/gpu_overlay.sh, with scratch/ ignored as in the project.
class ScratchRepo {
 public:
  ScratchRepo() {
    std::string pattern = (fs::temp_directory_path() / "odyssey-scripts-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) {
      ADD_FAILURE() << "mkdtemp " << pattern << ": " << std::strerror(errno);
      return;
    }
    dir_ = pattern;
  }
  ~ScratchRepo() {
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }
  // Runs a shell command line in the repository; returns its output.
  std::string sh(const std::string& cmd, int* code) const {
    if (dir_.empty()) {
      *code = -1;
      return "no scratch directory";
    }
    return odyssey::testing::run_shell("cd '" + dir_.string() + "' && " + cmd, code);
  }
  // Makes the repository (branch `base`, the script and .gitignore committed), then runs `then`.
  std::string init(const std::string& then, int* code) const {
    return sh("git init -q -b base . && git config user.email t@example.org && git config user.name t && "
              "mkdir -p scripts && cp '" ODYSSEY_SOURCE_DIR "/scripts/gpu_overlay.sh' scripts/ && "
              "printf 'scratch/\\n' > .gitignore && git add -A && git commit -qm base && " + then,
              code);
  }
  std::string read(const std::string& path) const {
    std::ifstream in(dir_ / path);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  bool exists(const std::string& path) const { return fs::exists(dir_ / path); }
  bool executable(const std::string& path) const {
    struct stat st {};
    return ::stat((dir_ / path).c_str(), &st) == 0 && (st.st_mode & S_IXUSR) != 0;
  }

 private:
  fs::path dir_;
};

TEST(GpuOverlay, CarriesABranchsChangesOntoTheTreeAndKeepsWhatTheTreeChangedSince) {
  ScratchRepo repo;
  int code = -1;
  // A base commit; a branch that changes one file, deletes one and adds an executable one; then
  // the base moves on with a file of its own.
  std::string out = repo.init(
      "mkdir kernels && echo a > kernels/a.cu && echo b > kernels/b.cu && "
      "git add -A && git commit -qm kernels && git checkout -qb work && echo a2 > kernels/a.cu && "
      "git rm -q kernels/b.cu && echo '#!/bin/sh' > kernels/run.sh && chmod +x kernels/run.sh && "
      "git add -A && git commit -qm work && git checkout -q base && echo c > kernels/c.cu && "
      "git add -A && git commit -qm later && "
      // What the tree should become: the branch merged onto the base.
      "git checkout -qb merged work && git merge -q --no-edit base && git checkout -q base",
      &code);
  ASSERT_EQ(code, 0) << out;

  out = repo.sh("scripts/gpu_overlay.sh prepare work", &code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("2 files of"), std::string::npos) << out;
  EXPECT_NE(out.find("(1 deleted) in scratch/overlay"), std::string::npos) << out;
  EXPECT_NE(out.find("carry [\".gpu\", \"scratch/overlay\"]"), std::string::npos) << out;
  EXPECT_EQ(out.find("warning"), std::string::npos) << out;
  // Preparing touches nothing in the tree.
  EXPECT_EQ(repo.read("kernels/a.cu"), "a\n");
  EXPECT_TRUE(repo.exists("kernels/b.cu"));

  out = repo.sh("scripts/gpu_overlay.sh apply", &code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_EQ(repo.read("kernels/a.cu"), "a2\n");
  EXPECT_FALSE(repo.exists("kernels/b.cu"));
  EXPECT_TRUE(repo.executable("kernels/run.sh"));
  EXPECT_EQ(repo.read("kernels/c.cu"), "c\n");  // the base's own later change stays
  // The tree is now the branch merged onto the base, file for file.
  out = repo.sh("git add -A && git diff --cached --quiet merged", &code);
  EXPECT_EQ(code, 0) << out;
}

TEST(GpuOverlay, WarnsWhenTheTreeChangedAFileTheBranchChangesToo) {
  ScratchRepo repo;
  int code = -1;
  std::string out = repo.init(
      "echo a > a.cu && git add -A && git commit -qm a && "
      "git checkout -qb work && echo branch > a.cu && git commit -qam work && git checkout -q base && "
      "echo tree > a.cu && git commit -qam later",
      &code);
  ASSERT_EQ(code, 0) << out;
  out = repo.sh("scripts/gpu_overlay.sh prepare work", &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("warning: a.cu changed on HEAD too"), std::string::npos) << out;
  EXPECT_NE(out.find("rebase work onto HEAD"), std::string::npos) << out;
}

TEST(GpuOverlay, RefusesAnUnknownRevisionAnOverlayGitWouldCopyAndAMissingOverlay) {
  ScratchRepo repo;
  int code = -1;
  std::string out = repo.init("true", &code);
  ASSERT_EQ(code, 0) << out;

  out = repo.sh("scripts/gpu_overlay.sh prepare no-such-branch", &code);
  EXPECT_EQ(code, 2);
  EXPECT_NE(out.find("no commit 'no-such-branch'"), std::string::npos) << out;

  out = repo.sh("scripts/gpu_overlay.sh prepare base overlay-here", &code);
  EXPECT_EQ(code, 2);
  EXPECT_NE(out.find("overlay-here is not git-ignored"), std::string::npos) << out;
  EXPECT_FALSE(repo.exists("overlay-here"));

  out = repo.sh("scripts/gpu_overlay.sh apply scratch/none", &code);
  EXPECT_EQ(code, 2);
  EXPECT_NE(out.find("no overlay in scratch/none"), std::string::npos) << out;

  out = repo.sh("scripts/gpu_overlay.sh", &code);
  EXPECT_EQ(code, 2);
  EXPECT_NE(out.find("usage:"), std::string::npos) << out;
}

}  // namespace
