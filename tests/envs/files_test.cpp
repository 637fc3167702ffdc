// The built-in files environment (envs/builtin/files), loaded as a plugin through the C ABI:
// every task variant fails as given and passes with its reference fix (the real check, run by
// /bin/sh and python3), paths cannot leave the task directory (.., absolute paths, symlinks to
// outside, made by the test or by the model's own code during a check), a check that loops is
// killed and reported, the check's files cannot be changed to pass, writes are bounded, task
// directories are removed, episodes are deterministic, splits disjoint, snapshots resume.
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "envs/conformance.h"
#include "envs/env_test_helpers.h"
#include "envs/plugin.h"

namespace odyssey::envs {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A fresh directory per test (and per process: ctest runs cases in parallel), removed after.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = (fs::temp_directory_path() / "ody-files-test-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed";
    path_ = fs::canonical(pattern);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::shared_ptr<Plugin> files_plugin() { return test_support::builtin_plugin("files"); }

std::unique_ptr<EnvSession> make_session(const json& config = json::object()) {
  return test_support::builtin_session("files", config);
}

env::Action call(const std::string& tool, const json& arguments) { return test_support::tool_call(tool, arguments); }

using test_support::reset;
using test_support::score;
using test_support::step;

// One tool call: {content, is_error}.
std::pair<std::string, bool> use(EnvSession& s, const std::string& tool, const json& arguments) {
  const env::Observation obs = step(s, call(tool, arguments));
  EXPECT_EQ(obs.tool_results.size(), 1u);
  if (obs.tool_results.empty()) return {"", true};
  return {obs.tool_results[0].content, obs.tool_results[0].is_error};
}
std::string ok(EnvSession& s, const std::string& tool, const json& arguments) {
  auto [content, is_error] = use(s, tool, arguments);
  EXPECT_FALSE(is_error) << tool << " " << arguments.dump() << ": " << content;
  return content;
}
std::string refused(EnvSession& s, const std::string& tool, const json& arguments) {
  auto [content, is_error] = use(s, tool, arguments);
  EXPECT_TRUE(is_error) << tool << " " << arguments.dump() << " should be refused, got: " << content;
  return content;
}

// The path of the main source file of a python project, from its prompt ("in `src/x.py`").
std::string python_source(const std::string& prompt) {
  const size_t at = prompt.find("`src/");
  EXPECT_NE(at, std::string::npos) << prompt;
  return prompt.substr(at + 1, prompt.find('`', at + 1) - at - 1);
}

// Runs the reference fix of one task per variant of `family`: the given project fails its check,
// the reference passes it through the tools, and the grade follows.
void reference_fixes_pass(const std::string& family, size_t variants) {
  ScratchDir scratch;
  const json config = {{"root", scratch.path().string()}};
  auto probe = make_session(config);
  ASSERT_TRUE(probe);
  std::map<std::string, json> task_of;  // variant -> a task with it
  for (int i = 0; i < 400 && task_of.size() < variants; ++i) {
    const json task = {{"split", i % 2 ? "eval" : "train"}, {"index", i}, {"family", family}};
    const env::Observation obs = reset(*probe, task);
    EXPECT_EQ(obs.info["family"], family);
    task_of.emplace(obs.info["variant"].get<std::string>(), task);
  }
  ASSERT_EQ(task_of.size(), variants) << family << ": variants seen";
  for (const auto& [variant, task] : task_of) {
    SCOPED_TRACE(family + "/" + variant);
    auto given = make_session(config);
    ASSERT_TRUE(given);
    reset(*given, task);
    EXPECT_TRUE(step(*given, env::Action{"Done.", {}}).done);
    const env::Score failed = score(*given);
    EXPECT_FALSE(failed.success) << "the project as given must fail its check:\n" << failed.info.dump(2);
    EXPECT_DOUBLE_EQ(failed.reward, 0.0);
    EXPECT_NE(failed.info["exit_code"], 0);

    auto fixed = make_session(config);
    ASSERT_TRUE(fixed);
    reset(*fixed, task);
    for (const auto& [path, content] : failed.info["solution"].items())
      ok(*fixed, "write", {{"path", path}, {"content", content}});
    const std::string check = ok(*fixed, "run_check", json::object());
    EXPECT_EQ(check.rfind("exit code: 0 (passed)", 0), 0u) << check;
    step(*fixed, env::Action{"Done.", {}});
    const env::Score passed = score(*fixed);
    EXPECT_TRUE(passed.success) << passed.info.dump(2);
    EXPECT_DOUBLE_EQ(passed.reward, 1.0);
  }
}

TEST(FilesEnv, PythonFixTasksFailAsGivenAndPassWithTheReferenceFix) { reference_fixes_pass("python_fix", 7); }
TEST(FilesEnv, PythonImplementTasksFailAsGivenAndPassWithTheReference) { reference_fixes_pass("python_implement", 5); }
TEST(FilesEnv, ShellFixTasksFailAsGivenAndPassWithTheReferenceFix) { reference_fixes_pass("shell_fix", 5); }
TEST(FilesEnv, ConfigTasksFailAsGivenAndPassWhenCompleted) { reference_fixes_pass("config", 2); }

TEST(FilesEnv, PathEscapesAreToolErrorsAndNothingOutsideIsTouched) {
  ScratchDir scratch;
  const fs::path outside = scratch.path() / "outside.txt";
  std::ofstream(outside) << "keep me\n";
  auto s = make_session({{"root", scratch.path().string()}});
  ASSERT_TRUE(s);
  const env::Observation first = reset(*s, {{"family", "python_fix"}}, 4);
  const fs::path dir = first.info["directory"].get<std::string>();
  ASSERT_EQ(dir.parent_path(), scratch.path());
  const std::string source = python_source(first.text);

  EXPECT_NE(refused(*s, "read", {{"path", "../outside.txt"}}).find("leaves the task directory"), std::string::npos);
  EXPECT_NE(refused(*s, "write", {{"path", "../outside.txt"}, {"content", "owned"}}).find(".."), std::string::npos);
  refused(*s, "write", {{"path", "src/../../outside.txt"}, {"content", "owned"}});
  EXPECT_NE(refused(*s, "read", {{"path", "/etc/passwd"}}).find("absolute"), std::string::npos);
  refused(*s, "write", {{"path", "/tmp/ody-files-owned"}, {"content", "owned"}});
  refused(*s, "list", {{"path", ".."}});

  // Symlinks out, as the model's code could leave them: followed by no tool.
  fs::create_directory_symlink("/", dir / "root_link");
  fs::create_symlink(outside, dir / "outside_link");
  fs::create_symlink(scratch.path() / "not_there_yet", dir / "dangling");
  EXPECT_NE(refused(*s, "read", {{"path", "root_link/etc/passwd"}}).find("outside the task directory"), std::string::npos);
  refused(*s, "list", {{"path", "root_link"}});
  refused(*s, "read", {{"path", "outside_link"}});
  refused(*s, "write", {{"path", "outside_link"}, {"content", "owned"}});
  refused(*s, "write", {{"path", "root_link/tmp/ody-files-owned"}, {"content", "owned"}});
  EXPECT_NE(refused(*s, "write", {{"path", "dangling"}, {"content", "owned"}}).find("points nowhere"), std::string::npos);
  refused(*s, "write", {{"path", "dangling/x"}, {"content", "owned"}});
  // A symlink that stays inside is fine.
  fs::create_directory_symlink(dir / "src", dir / "alias");
  EXPECT_EQ(ok(*s, "read", {{"path", "alias/" + source.substr(4)}}), slurp(dir / source));

  // The model's own code makes a link to / while the check runs; the tools still refuse it.
  ok(*s, "write", {{"path", source}, {"content", "import os\nos.symlink('/', 'escape')\n"}});
  ok(*s, "run_check", json::object());
  ASSERT_TRUE(fs::is_symlink(dir / "escape"));
  refused(*s, "read", {{"path", "escape/etc/hostname"}});
  refused(*s, "write", {{"path", "escape/tmp/ody-files-owned"}, {"content", "owned"}});

  // The check's own files are read-only.
  EXPECT_NE(refused(*s, "write", {{"path", "check.sh"}, {"content", "exit 0\n"}}).find("read-only"), std::string::npos);
  refused(*s, "write", {{"path", "./tests/../check.sh"}, {"content", "exit 0\n"}});
  refused(*s, "write", {{"path", "tests/json.py"}, {"content", "x = 1\n"}});

  EXPECT_EQ(slurp(outside), "keep me\n");
  EXPECT_FALSE(fs::exists(scratch.path() / "not_there_yet"));
  EXPECT_FALSE(fs::exists("/tmp/ody-files-owned"));
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(scratch.path())) names.insert(e.path().filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"outside.txt", dir.filename().string()}));
}

TEST(FilesEnv, ACheckThatLoopsForeverIsKilledAndReportedAsATimeout) {
  ScratchDir scratch;
  auto s = make_session({{"root", scratch.path().string()}, {"check_timeout_s", 1}});
  ASSERT_TRUE(s);
  const env::Observation first = reset(*s, {{"family", "python_fix"}}, 8);
  const fs::path dir = first.info["directory"].get<std::string>();
  // The module starts a helper process in the check's process group, records its pid, then spins.
  ok(*s, "write", {{"path", python_source(first.text)},
                   {"content", "import os, subprocess\n"
                               "p = subprocess.Popen(['sleep', '60'])\n"
                               "open('helper.pid', 'w').write(str(p.pid))\n"
                               "while True:\n    pass\n"}});
  const auto t0 = std::chrono::steady_clock::now();
  const std::string report = ok(*s, "run_check", json::object());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(report.find("timed out after 1 s"), std::string::npos) << report;
  EXPECT_LT(seconds, 3.0);

  // The helper went with the group: gone, or a zombie waiting for its reaper.
  const std::string pid = slurp(dir / "helper.pid");
  ASSERT_FALSE(pid.empty());
  bool alive = true;
  for (int i = 0; i < 100 && alive; ++i) {
    const std::string stat = slurp("/proc/" + pid + "/stat");
    alive = !stat.empty() && stat.find(") Z") == std::string::npos;
    if (alive) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_FALSE(alive) << "process " << pid << " survived the check";

  step(*s, env::Action{"Done.", {}});
  const env::Score sc = score(*s);
  EXPECT_FALSE(sc.success);
  EXPECT_TRUE(sc.info["timed_out"].get<bool>());
}

TEST(FilesEnv, ChangingTheCheckFromTheModelsCodeDoesNotChangeTheGrade) {
  ScratchDir scratch;
  auto s = make_session({{"root", scratch.path().string()}});
  ASSERT_TRUE(s);
  const env::Observation first = reset(*s, {{"family", "python_fix"}}, 2);
  const fs::path dir = first.info["directory"].get<std::string>();
  const std::string pristine = slurp(dir / "check.sh");
  // Still buggy, but replaces check.sh with `exit 0` when imported.
  const std::string source = python_source(first.text);
  ok(*s, "write", {{"path", source}, {"content", slurp(dir / source) + "\nopen('check.sh', 'w').write('exit 0\\n')\n"}});
  EXPECT_EQ(ok(*s, "run_check", json::object()).rfind("exit code: 1", 0), 0u);
  ASSERT_EQ(slurp(dir / "check.sh"), "exit 0\n") << "the model's code ran";
  EXPECT_EQ(ok(*s, "run_check", json::object()).rfind("exit code: 1", 0), 0u) << "the check was put back first";
  step(*s, env::Action{"Done.", {}});
  EXPECT_FALSE(score(*s).success);
  EXPECT_NE(pristine, "exit 0\n");
}

TEST(FilesEnv, WritesAreBoundedInSizeAndCount) {
  ScratchDir scratch;
  auto s = make_session({{"root", scratch.path().string()}, {"max_file_bytes", 1024}, {"max_files", 8}});
  ASSERT_TRUE(s);
  reset(*s, {{"family", "python_fix"}}, 1);  // TASK.md, check.sh, one source, one test: 4 files
  EXPECT_NE(refused(*s, "write", {{"path", "big.txt"}, {"content", std::string(1025, 'x')}}).find("limit is 1024"),
            std::string::npos);
  for (int i = 0; i < 4; ++i) ok(*s, "write", {{"path", "notes/" + std::to_string(i) + ".txt"}, {"content", "x"}});
  EXPECT_NE(refused(*s, "write", {{"path", "notes/one-more.txt"}, {"content", "x"}}).find("files"), std::string::npos);
  ok(*s, "write", {{"path", "notes/0.txt"}, {"content", "replacing is fine"}});
  EXPECT_EQ(ok(*s, "read", {{"path", "notes/0.txt"}}), "replacing is fine");
  refused(*s, "write", {{"path", "notes"}, {"content", "a directory"}});
  refused(*s, "read", {{"path", "notes"}});
  refused(*s, "read", {{"path", "missing.txt"}});
}

TEST(FilesEnv, ReadShowsLineRanges) {
  ScratchDir scratch;
  auto s = make_session({{"root", scratch.path().string()}});
  ASSERT_TRUE(s);
  reset(*s, {{"family", "config"}}, 1);
  ok(*s, "write", {{"path", "lines.txt"}, {"content", "one\ntwo\nthree\nfour\n"}});
  EXPECT_EQ(ok(*s, "read", {{"path", "lines.txt"}, {"start_line", 2}, {"end_line", 3}}), "two\nthree\n");
  EXPECT_EQ(ok(*s, "read", {{"path", "lines.txt"}, {"start_line", 4}}), "four\n");
  EXPECT_NE(refused(*s, "read", {{"path", "lines.txt"}, {"start_line", 9}}).find("has 4 lines"), std::string::npos);
  refused(*s, "read", {{"path", "lines.txt"}, {"start_line", 3}, {"end_line", 2}});
  const std::string listing = ok(*s, "list", json::object());
  EXPECT_NE(listing.find("lines.txt  (19 bytes)"), std::string::npos) << listing;
  EXPECT_NE(listing.find("tests/check_config.py"), std::string::npos) << listing;
}

TEST(FilesEnv, TaskDirectoriesAreRemovedOnResetAndDestroy) {
  ScratchDir scratch;
  auto s = make_session({{"root", scratch.path().string()}});
  ASSERT_TRUE(s);
  const fs::path first = reset(*s, json::object(), 1).info["directory"].get<std::string>();
  ASSERT_TRUE(fs::is_directory(first));
  // The model's code may leave read-only directories behind; they go too.
  fs::create_directories(first / "locked" / "inner");
  fs::permissions(first / "locked", fs::perms::owner_read | fs::perms::owner_exec);
  const fs::path second = reset(*s, json::object(), 2).info["directory"].get<std::string>();
  EXPECT_FALSE(fs::exists(first));
  EXPECT_TRUE(fs::is_directory(second));
  s.reset();
  EXPECT_FALSE(fs::exists(second));
  EXPECT_TRUE(fs::is_empty(scratch.path()));
}

TEST(FilesEnv, TheSameTaskAndSeedGiveTheSameProject) {
  ScratchDir scratch;
  const json config = {{"root", scratch.path().string()}};
  auto a = make_session(config), b = make_session(config);
  ASSERT_TRUE(a && b);
  auto fingerprint = [](EnvSession& s, const json& task, uint64_t seed) {
    const env::Observation obs = reset(s, task, seed);
    std::string all = obs.text;
    const fs::path dir = obs.info["directory"].get<std::string>();
    for (const auto& e : fs::recursive_directory_iterator(dir))
      if (e.is_regular_file()) all += "\n== " + e.path().lexically_relative(dir).string() + "\n" + slurp(e.path());
    return all;
  };
  EXPECT_EQ(fingerprint(*a, json::object(), 77), fingerprint(*b, json::object(), 77));
  EXPECT_NE(fingerprint(*a, json::object(), 77), fingerprint(*b, json::object(), 78));
  const json task = {{"split", "eval"}, {"index", 3}};
  EXPECT_EQ(fingerprint(*a, task, 1), fingerprint(*b, task, 2)) << "a split task ignores the seed";
  EXPECT_EQ(fingerprint(*a, json::object(), 9), fingerprint(*b, {{"split", "train"}, {"index", 9}}, 0))
      << "{} with seed S is train task S";

  std::set<std::string> train, eval;
  for (int i = 0; i < 60; ++i) {
    train.insert(fingerprint(*a, {{"split", "train"}, {"index", i}}, 0));
    eval.insert(fingerprint(*a, {{"split", "eval"}, {"index", i}}, 0));
  }
  EXPECT_EQ(train.size(), 60u);
  EXPECT_EQ(eval.size(), 60u);
  for (const std::string& p : eval) EXPECT_EQ(train.count(p), 0u) << "a project in both splits:\n" << p;
}

TEST(FilesEnv, ASnapshotCarriesTheEditsIntoAFreshInstance) {
  ScratchDir scratch;
  const json config = {{"root", scratch.path().string()}};
  auto a = make_session(config);
  ASSERT_TRUE(a);
  const json task = {{"split", "train"}, {"index", 12}, {"family", "shell_fix"}};
  reset(*a, task);
  step(*a, env::Action{"Done.", {}});
  const json solution = score(*a).info["solution"];

  reset(*a, task);
  ok(*a, "write", {{"path", "notes/plan.txt"}, {"content", "fix the loop\n"}});
  ok(*a, "write", {{"path", "notes/bytes.bin"}, {"content", "caf\xc3\xa9"}});
  auto bytes = a->snapshot();
  ASSERT_TRUE(bytes.ok()) << bytes.status().to_string();

  auto b = make_session(config);
  ASSERT_TRUE(b);
  ASSERT_TRUE(b->restore(*bytes).ok());
  EXPECT_EQ(ok(*b, "read", {{"path", "notes/plan.txt"}}), "fix the loop\n");
  EXPECT_EQ(ok(*b, "read", {{"path", "notes/bytes.bin"}}), "caf\xc3\xa9");
  for (const auto& [path, content] : solution.items()) ok(*b, "write", {{"path", path}, {"content", content}});
  step(*b, env::Action{"Done.", {}});
  EXPECT_TRUE(score(*b).success);

  EXPECT_FALSE(b->restore("{\"env\": \"files\", \"version\": 1, \"task\": {}, \"seed\": 1, \"turn\": 0, \"done\": false, "
                          "\"files\": [{\"path\": \"../escape.txt\", \"content\": \"x\"}]}")
                   .ok());
  EXPECT_FALSE(fs::exists(scratch.path() / "escape.txt"));
  EXPECT_FALSE(b->restore("[1, 2]").ok());
}

TEST(FilesEnv, ATurnWithoutToolCallsEndsTheEpisode) {
  ScratchDir scratch;
  auto s = make_session({{"root", scratch.path().string()}, {"max_turns", 3}});
  ASSERT_TRUE(s);
  reset(*s, json::object(), 5);
  EXPECT_FALSE(step(*s, call("list", json::object())).done);
  EXPECT_TRUE(step(*s, env::Action{"I am done.", {}}).done);
  EXPECT_FALSE(s->step(call("list", json::object())).ok()) << "no steps after the end";

  reset(*s, json::object(), 5);
  step(*s, call("list", json::object()));
  step(*s, call("list", json::object()));
  const env::Observation last = step(*s, call("list", json::object()));
  EXPECT_TRUE(last.done);
  EXPECT_NE(last.text.find("Turn limit (3)"), std::string::npos);
}

TEST(FilesEnv, BadConfigsAndTasksAreRefusedNamingTheField) {
  auto plugin = files_plugin();
  ASSERT_TRUE(plugin);
  auto refused_config = [&](const json& config) {
    auto s = plugin->create(config);
    EXPECT_FALSE(s.ok()) << config.dump();
    return s.ok() ? std::string() : s.status().message();
  };
  EXPECT_NE(refused_config({{"root", "/no/such/dir"}}).find("'root'"), std::string::npos);
  EXPECT_NE(refused_config({{"check_timeout", 5}}).find("did you mean 'check_timeout_s'"), std::string::npos);
  EXPECT_NE(refused_config({{"check_timeout_s", 0}}).find("'check_timeout_s'"), std::string::npos);
  EXPECT_NE(refused_config({{"max_files", "many"}}).find("'max_files'"), std::string::npos);

  ScratchDir scratch;
  auto s = make_session({{"root", scratch.path().string()}});
  ASSERT_TRUE(s);
  auto bad_task = [&](const json& task) {
    auto obs = s->reset(task, 0);
    EXPECT_FALSE(obs.ok()) << task.dump();
    return obs.ok() ? std::string() : obs.status().message();
  };
  EXPECT_NE(bad_task({{"family", "rust"}}).find("'family'"), std::string::npos);
  EXPECT_NE(bad_task({{"split", "dev"}, {"index", 0}}).find("'split'"), std::string::npos);
  EXPECT_NE(bad_task({{"index", 0}}).find("'split'"), std::string::npos);
  EXPECT_NE(bad_task({{"famliy", "config"}}).find("did you mean 'family'"), std::string::npos);
}

TEST(FilesEnv, PassesTheConformanceSuite) {
  ScratchDir scratch;
  auto plugin = files_plugin();
  ASSERT_TRUE(plugin);
  const json config = {{"root", scratch.path().string()}};
  ConformanceOptions options;
  options.episodes = 2;  // each scripted step may run the check: keep it short
  options.max_steps = 8;
  const ConformanceReport report = run_conformance(
      [plugin, config]() -> Result<std::unique_ptr<EnvSession>> { return plugin->create(config); }, options);
  EXPECT_TRUE(report.passed()) << report.to_text();
  for (const CheckResult& c : report.checks) {
    if (c.name == "determinism") continue;  // reset's info names the (fresh) directory
    EXPECT_NE(c.outcome, CheckOutcome::kWarn) << c.name << ": " << c.detail;
  }
}

}  // namespace
}  // namespace odyssey::envs
