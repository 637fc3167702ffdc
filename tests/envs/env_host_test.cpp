// env-host and HostedSession against real processes and real plugins: the example `guess`
// plugin, and the hostile test plugins in tests/envs/plugins (crashing, hanging, leaking,
// forking).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "envs/env_host.h"
#include "envs/plugin.h"

namespace odyssey::envs {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

std::string test_plugin(const std::string& name) {
  return std::string(ODYSSEY_TEST_PLUGIN_DIR) + "/libody_env_" + name + ".so";
}
std::string example_plugin(const std::string& name) {
  return std::string(ODYSSEY_PLUGIN_DIR) + "/libody_env_" + name + ".so";
}

HostOptions test_options() {
  HostOptions o;
  o.odyssey_binary = ODYSSEY_BINARY;
  o.call_timeout = 5s;
  return o;
}

env::Action call(const std::string& id, const std::string& tool, json arguments, std::string text = "") {
  env::Action a;
  a.text = std::move(text);
  a.tool_calls.push_back({id, tool, std::move(arguments)});
  return a;
}

// Gone, or a zombie nobody has reaped yet (an orphan of a test plugin).
bool process_gone(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  return paren == std::string::npos || (paren + 2 < text.size() && text[paren + 2] == 'Z');
}
bool wait_gone(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!process_gone(pid)) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

// A fresh directory for this test process, removed afterwards.
struct ScratchDir {
  ScratchDir() {
    std::string tmpl = (fs::temp_directory_path() / "odyssey-env-host-XXXXXX").string();
    path = ::mkdtemp(tmpl.data());
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string path;
};

void expect_same(const env::Observation& a, const env::Observation& b) {
  EXPECT_EQ(a.text, b.text);
  ASSERT_EQ(a.tool_results.size(), b.tool_results.size());
  for (size_t i = 0; i < a.tool_results.size(); ++i) {
    EXPECT_EQ(a.tool_results[i].call_id, b.tool_results[i].call_id);
    EXPECT_EQ(a.tool_results[i].content, b.tool_results[i].content);
    EXPECT_EQ(a.tool_results[i].is_error, b.tool_results[i].is_error);
  }
  ASSERT_EQ(a.rewards.size(), b.rewards.size());
  for (size_t i = 0; i < a.rewards.size(); ++i) {
    EXPECT_EQ(a.rewards[i].name, b.rewards[i].name);
    EXPECT_EQ(a.rewards[i].value, b.rewards[i].value);
  }
  EXPECT_EQ(a.images.size(), b.images.size());
  EXPECT_EQ(a.done, b.done);
  EXPECT_EQ(a.info, b.info);
}

TEST(HostedSession, PlaysTheSameEpisodeAsTheInProcessSession) {
  auto plugin = Plugin::load(example_plugin("guess"));
  ASSERT_TRUE(plugin.ok()) << plugin.status().to_string();
  const json config = {{"low", 1}, {"high", 1000}, {"max_guesses", 12}};
  auto local = (*plugin)->create(config);
  ASSERT_TRUE(local.ok()) << local.status().to_string();
  auto hosted = HostedSession::start(example_plugin("guess"), config, test_options());
  ASSERT_TRUE(hosted.ok()) << hosted.status().to_string();

  EXPECT_EQ((*hosted)->info().name, "guess");
  EXPECT_EQ((*hosted)->info().source_hash, (*local)->info().source_hash);
  ASSERT_EQ((*hosted)->info().tools.size(), 1u);
  EXPECT_EQ((*hosted)->info().tools[0].input_schema, (*local)->info().tools[0].input_schema);

  auto a = (*local)->reset(json::object(), 77);
  auto b = (*hosted)->reset(json::object(), 77);
  ASSERT_TRUE(a.ok() && b.ok());
  expect_same(*a, *b);
  // Binary search, driven by the in-process answers; the hosted one must answer the same.
  int64_t low = 1, high = 1000;
  for (int turn = 0; turn < 12; ++turn) {
    const int64_t guess = (low + high) / 2;
    const env::Action action = call("call_" + std::to_string(turn), "guess", {{"n", guess}}, "trying");
    auto x = (*local)->step(action);
    auto y = (*hosted)->step(action);
    ASSERT_TRUE(x.ok()) << x.status().to_string();
    ASSERT_TRUE(y.ok()) << y.status().to_string();
    expect_same(*x, *y);
    if (x->done) break;
    if (x->tool_results[0].content == "higher") {
      low = guess + 1;
    } else {
      high = guess - 1;
    }
  }
  auto sa = (*local)->score();
  auto sb = (*hosted)->score();
  ASSERT_TRUE(sa.ok() && sb.ok());
  EXPECT_TRUE(sb->success);
  EXPECT_EQ(sa->reward, sb->reward);
  EXPECT_EQ(sa->info, sb->info);
  ASSERT_EQ(sa->parts.size(), sb->parts.size());

  // Snapshots travel as bytes and restore into a fresh instance elsewhere.
  auto snap = (*hosted)->snapshot();
  ASSERT_TRUE(snap.ok()) << snap.status().to_string();
  EXPECT_EQ(*snap, *(*local)->snapshot());
  ASSERT_TRUE((*local)->reset(json::object(), 1).ok());
  ASSERT_TRUE((*local)->restore(*snap).ok());
  EXPECT_EQ((*local)->score()->reward, sb->reward);
  ASSERT_TRUE((*hosted)->reset(json::object(), 5).ok());
  ASSERT_TRUE((*hosted)->restore(*snap).ok());
  EXPECT_EQ((*hosted)->score()->info, sb->info);
  EXPECT_EQ((*hosted)->counters().starts, 1u);
  EXPECT_EQ((*hosted)->counters().crashes, 0u);
}

TEST(HostedSession, ReportsASegfaultAsUnavailableAndRestartsOnTheNextReset) {
  auto session = HostedSession::start(test_plugin("crashing"), json::object(), test_options());
  ASSERT_TRUE(session.ok()) << session.status().to_string();
  HostedSession& s = **session;
  ASSERT_TRUE(s.reset(json::object(), 1).ok());
  const pid_t first = s.host_pid();

  auto crashed = s.step(call("call_0", "crash", json::object()));
  ASSERT_FALSE(crashed.ok());
  EXPECT_EQ(crashed.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(crashed.status().message(), "env-host for plugin 'crashing' died with SIGSEGV during step");
  EXPECT_TRUE(process_gone(first));
  EXPECT_EQ(s.host_pid(), -1);
  EXPECT_EQ(s.counters().crashes, 1u);

  auto after = s.step(call("call_1", "echo", {{"text", "hi"}}));
  EXPECT_EQ(after.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(after.status().message().find("reset"), std::string::npos) << after.status().message();

  // A fresh host serves a whole episode.
  auto prompt = s.reset(json::object(), 2);
  ASSERT_TRUE(prompt.ok()) << prompt.status().to_string();
  EXPECT_NE(s.host_pid(), first);
  EXPECT_EQ(prompt->text, "Echo something, then say done. Seed 2.");
  auto echoed = s.step(call("call_0", "echo", {{"text", "hello"}}));
  ASSERT_TRUE(echoed.ok()) << echoed.status().to_string();
  EXPECT_EQ(echoed->tool_results[0].content, "hello");
  auto last = s.step(call("call_1", "echo", {{"text", "again"}}, "done"));
  ASSERT_TRUE(last.ok());
  EXPECT_TRUE(last->done);
  auto score = s.score();
  ASSERT_TRUE(score.ok());
  EXPECT_EQ(score->reward, 2.0);
  EXPECT_EQ(s.counters().starts, 2u);
  EXPECT_EQ(s.counters().restarts, 1u);
}

TEST(HostedSession, KillsAHungCallAtItsTimeout) {
  HostOptions options = test_options();
  options.call_timeout = 400ms;
  auto session = HostedSession::start(test_plugin("hanging"), json::object(), options);
  ASSERT_TRUE(session.ok()) << session.status().to_string();
  HostedSession& s = **session;
  ASSERT_TRUE(s.reset(json::object(), 1).ok());
  const pid_t pid = s.host_pid();

  const auto t0 = std::chrono::steady_clock::now();
  auto hung = s.step(call("call_0", "spin", json::object()));
  const auto elapsed = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(hung.ok());
  EXPECT_EQ(hung.status().code(), StatusCode::kTimeout);
  EXPECT_NE(hung.status().message().find("plugin 'hanging' did not answer step within 400 ms"), std::string::npos)
      << hung.status().message();
  EXPECT_GE(elapsed, 400ms);
  EXPECT_LT(elapsed, 400ms + 1500ms);
  EXPECT_TRUE(process_gone(pid));  // killed and reaped before step returned
  EXPECT_EQ(s.counters().timeouts, 1u);

  ASSERT_TRUE(s.reset(json::object(), 1).ok());
  auto echoed = s.step(call("call_0", "echo", {{"text", "back"}}));
  ASSERT_TRUE(echoed.ok()) << echoed.status().to_string();
  EXPECT_EQ(echoed->tool_results[0].content, "back");
}

TEST(HostedSession, StopsACpuHogAtItsCpuLimit) {
  HostOptions options = test_options();
  options.cpu_seconds = 1;
  options.call_timeout = 20s;
  auto session = HostedSession::start(test_plugin("hanging"), json::object(), options);
  ASSERT_TRUE(session.ok()) << session.status().to_string();
  ASSERT_TRUE((*session)->reset(json::object(), 1).ok());
  auto hog = (*session)->step(call("call_0", "spin", json::object()));
  ASSERT_FALSE(hog.ok());
  EXPECT_EQ(hog.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(hog.status().message().find("died with SIGXCPU (over its CPU limit: 1 s per episode"), std::string::npos)
      << hog.status().message();
}

TEST(HostedSession, StopsAMemoryHogAtItsMemoryLimit) {
  HostOptions options = test_options();
  options.memory_bytes = 64ull << 20;
  auto session = HostedSession::start(test_plugin("leaking"), json::object(), options);
  ASSERT_TRUE(session.ok()) << session.status().to_string();
  HostedSession& s = **session;
  ASSERT_TRUE(s.reset(json::object(), 1).ok());
  const pid_t pid = s.host_pid();
  auto hog = s.step(call("call_0", "allocate", {{"mib", 4096}}));
  ASSERT_TRUE(hog.ok()) << hog.status().to_string();
  ASSERT_EQ(hog->tool_results.size(), 1u);
  EXPECT_TRUE(hog->tool_results[0].is_error);
  const std::string& text = hog->tool_results[0].content;
  ASSERT_EQ(text.rfind("out of memory after ", 0), 0u) << text;
  EXPECT_LT(std::stoi(text.substr(20)), 64) << text;
  // The host survived its plugin's hunger and still answers.
  EXPECT_EQ(s.host_pid(), pid);
  EXPECT_TRUE(s.score().ok());
}

TEST(HostedSession, KillsAHostThatWritesPastTheFileSizeLimit) {
  ScratchDir dir;
  HostOptions options = test_options();
  options.file_bytes = 1 << 20;
  auto session = HostedSession::start(test_plugin("leaking"), json::object(), options);
  ASSERT_TRUE(session.ok()) << session.status().to_string();
  ASSERT_TRUE((*session)->reset(json::object(), 1).ok());
  const std::string path = dir.path + "/big";
  auto small = (*session)->step(call("call_0", "write_file", {{"path", path}, {"bytes", 1000}}));
  ASSERT_TRUE(small.ok()) << small.status().to_string();
  EXPECT_EQ(fs::file_size(path), 1000u);
  auto big = (*session)->step(call("call_1", "write_file", {{"path", path}, {"bytes", 8 << 20}}));
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(big.status().message().find("died with SIGXFSZ (a file over the size limit of 1048576 bytes)"),
            std::string::npos)
      << big.status().message();
  EXPECT_EQ(fs::file_size(path), 1u << 20);
}

TEST(HostedSession, LimitsOpenFiles) {
  HostOptions options = test_options();
  options.open_files = 32;
  auto session = HostedSession::start(test_plugin("leaking"), json::object(), options);
  ASSERT_TRUE(session.ok()) << session.status().to_string();
  ASSERT_TRUE((*session)->reset(json::object(), 1).ok());
  auto many = (*session)->step(call("call_0", "open_files", {{"count", 100}}));
  ASSERT_TRUE(many.ok()) << many.status().to_string();
  EXPECT_TRUE(many->tool_results[0].is_error);
  EXPECT_NE(many->tool_results[0].content.find("Too many open files"), std::string::npos)
      << many->tool_results[0].content;
}

TEST(HostedSession, DiesWhenItsParentIsKilled) {
  // Orphans are reparented to this process, so it can wait for the host itself.
  ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  const pid_t parent = ::fork();
  ASSERT_GE(parent, 0);
  if (parent == 0) {  // the parent: starts a host, says its pid, waits to be killed
    ::close(pipe_fds[0]);
    auto s = HostedSession::start(test_plugin("hanging"), json::object(), test_options());
    const pid_t host = s.ok() ? (*s)->host_pid() : -1;
    (void)!::write(pipe_fds[1], &host, sizeof(host));
    for (;;) ::pause();
  }
  ::close(pipe_fds[1]);
  pid_t host = -1;
  pollfd p{pipe_fds[0], POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 30000), 1);
  ASSERT_EQ(::read(pipe_fds[0], &host, sizeof(host)), ssize_t(sizeof(host)));
  ::close(pipe_fds[0]);
  ASSERT_GT(host, 0);
  ASSERT_FALSE(process_gone(host));

  ::kill(parent, SIGKILL);
  int status = 0;
  ASSERT_EQ(::waitpid(parent, &status, 0), parent);
  const auto deadline = std::chrono::steady_clock::now() + 3s;
  pid_t reaped = 0;
  while (reaped == 0 && std::chrono::steady_clock::now() < deadline) {
    reaped = ::waitpid(host, &status, WNOHANG);
    if (reaped == 0) std::this_thread::sleep_for(5ms);
  }
  ::prctl(PR_SET_CHILD_SUBREAPER, 0);
  ASSERT_EQ(reaped, host) << "the host outlived its parent";
  ASSERT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(WTERMSIG(status), SIGKILL);
}

TEST(HostedSession, KillsWhatThePluginStartedWhenItEnds) {
  pid_t grandchild = -1;
  {
    auto session = HostedSession::start(test_plugin("forking"), json::object(), test_options());
    ASSERT_TRUE(session.ok()) << session.status().to_string();
    ASSERT_TRUE((*session)->reset(json::object(), 1).ok());
    auto spawned = (*session)->step(call("call_0", "spawn", json::object()));
    ASSERT_TRUE(spawned.ok()) << spawned.status().to_string();
    grandchild = std::stoi(spawned->tool_results[0].content);
    EXPECT_FALSE(process_gone(grandchild));
  }
  EXPECT_TRUE(wait_gone(grandchild, 2s));
}

TEST(HostedSession, NoticesACrashWhileSomethingItForkedHoldsTheChannel) {
  // The sleeping child inherited the host's socket; the host's exit must still be seen at once.
  HostOptions options = test_options();
  options.call_timeout = 20s;
  auto session = HostedSession::start(test_plugin("forking"), json::object(), options);
  ASSERT_TRUE(session.ok()) << session.status().to_string();
  ASSERT_TRUE((*session)->reset(json::object(), 1).ok());
  const pid_t host = (*session)->host_pid();
  auto spawned = (*session)->step(call("call_0", "spawn", json::object()));
  ASSERT_TRUE(spawned.ok());
  const pid_t grandchild = std::stoi(spawned->tool_results[0].content);
  ::kill(host, SIGSEGV);
  const auto t0 = std::chrono::steady_clock::now();
  auto after = (*session)->step(call("call_1", "getenv", {{"name", "PATH"}}));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  EXPECT_EQ(after.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(after.status().message().find("SIGSEGV"), std::string::npos) << after.status().message();
  EXPECT_TRUE(wait_gone(grandchild, 2s));
}

TEST(HostedSession, KeepsThePluginOffTheNetworkUnlessAllowed) {
  const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(server, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(server, 8), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(server, reinterpret_cast<sockaddr*>(&addr), &len);
  const int port = ntohs(addr.sin_port);

  HostOptions options = test_options();
  options.allow_network = true;
  auto open = HostedSession::start(test_plugin("forking"), json::object(), options);
  ASSERT_TRUE(open.ok()) << open.status().to_string();
  ASSERT_TRUE((*open)->reset(json::object(), 1).ok());
  auto reached = (*open)->step(call("call_0", "connect", {{"port", port}}));
  ASSERT_TRUE(reached.ok());
  EXPECT_EQ(reached->tool_results[0].content, "connected");
  EXPECT_FALSE((*open)->network_isolated());

  auto closed = HostedSession::start(test_plugin("forking"), json::object(), test_options());
  ASSERT_TRUE(closed.ok()) << closed.status().to_string();
  if (!(*closed)->network_isolated()) {
    ::close(server);
    GTEST_SKIP() << "this kernel does not let an unprivileged process have its own network namespace";
  }
  ASSERT_TRUE((*closed)->reset(json::object(), 1).ok());
  auto blocked = (*closed)->step(call("call_0", "connect", {{"port", port}}));
  ASSERT_TRUE(blocked.ok());
  EXPECT_TRUE(blocked->tool_results[0].is_error);
  EXPECT_EQ(blocked->tool_results[0].content.rfind("connect: ", 0), 0u) << blocked->tool_results[0].content;
  ::close(server);
}

TEST(HostedSession, PassesOnlyAllowedEnvironmentVariables) {
  ::setenv("ODYSSEY_TEST_SECRET", "hunter2", 1);
  auto plain = HostedSession::start(test_plugin("forking"), json::object(), test_options());
  ASSERT_TRUE(plain.ok()) << plain.status().to_string();
  ASSERT_TRUE((*plain)->reset(json::object(), 1).ok());
  auto secret = (*plain)->step(call("call_0", "getenv", {{"name", "ODYSSEY_TEST_SECRET"}}));
  ASSERT_TRUE(secret.ok());
  EXPECT_TRUE(secret->tool_results[0].is_error);
  if (std::getenv("PATH") != nullptr) {
    auto path = (*plain)->step(call("call_1", "getenv", {{"name", "PATH"}}));
    EXPECT_EQ(path->tool_results[0].content, std::getenv("PATH"));
  }

  HostOptions options = test_options();
  options.extra_env = {"ODYSSEY_TEST_SECRET"};
  auto passed = HostedSession::start(test_plugin("forking"), json::object(), options);
  ASSERT_TRUE(passed.ok());
  ASSERT_TRUE((*passed)->reset(json::object(), 1).ok());
  auto shown = (*passed)->step(call("call_0", "getenv", {{"name", "ODYSSEY_TEST_SECRET"}}));
  EXPECT_EQ(shown->tool_results[0].content, "hunter2");
  ::unsetenv("ODYSSEY_TEST_SECRET");
}

TEST(HostedSession, RefusesAPluginItCannotLoadSayingWhy) {
  auto missing = HostedSession::start("/nonexistent/libody_env_nothing.so", json::object(), test_options());
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent/libody_env_nothing.so"), std::string::npos)
      << missing.status().message();

  auto wrong_abi = HostedSession::start(test_plugin("wrong_abi"), json::object(), test_options());
  ASSERT_FALSE(wrong_abi.ok());
  EXPECT_EQ(wrong_abi.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wrong_abi.status().message().find("libody_env_wrong_abi.so"), std::string::npos)
      << wrong_abi.status().message();
}

TEST(HostedSession, RefusesABadConfigSayingWhy) {

  auto bad_config = HostedSession::start(example_plugin("guess"), {{"hihg", 5}}, test_options());
  ASSERT_FALSE(bad_config.ok());
  EXPECT_EQ(bad_config.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_config.status().message().find("unknown config key 'hihg'"), std::string::npos)
      << bad_config.status().message();

  auto not_object = HostedSession::start(example_plugin("guess"), json::array(), test_options());
  EXPECT_EQ(not_object.status().code(), StatusCode::kInvalidArgument);

  HostOptions no_binary = test_options();
  no_binary.odyssey_binary = "/nonexistent/odyssey";
  auto unstartable = HostedSession::start(example_plugin("guess"), json::object(), no_binary);
  ASSERT_FALSE(unstartable.ok());
  EXPECT_NE(unstartable.status().message().find("/nonexistent/odyssey"), std::string::npos)
      << unstartable.status().message();
}

TEST(HostedSession, PassesPluginErrorsThroughAndKeepsTheHost) {
  auto session = HostedSession::start(example_plugin("guess"), {{"max_guesses", 1}}, test_options());
  ASSERT_TRUE(session.ok()) << session.status().to_string();
  HostedSession& s = **session;
  auto bad_task = s.reset({{"target", "seven"}}, 1);
  EXPECT_EQ(bad_task.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_task.status().message().find("'target' must be an integer"), std::string::npos)
      << bad_task.status().message();
  const pid_t pid = s.host_pid();
  ASSERT_TRUE(s.reset({{"target", 7}}, 1).ok());
  auto once = s.step(call("call_0", "guess", {{"n", 3}}));
  ASSERT_TRUE(once.ok());
  EXPECT_TRUE(once->done);
  auto twice = s.step(call("call_1", "guess", {{"n", 7}}));
  EXPECT_EQ(twice.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.host_pid(), pid);
  EXPECT_EQ(s.restore("not a snapshot").code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.counters().starts, 1u);
}

TEST(HostedSession, ReplacesAHostWhoseCpuBudgetRanLowBetweenEpisodes) {
  HostOptions options = test_options();
  options.cpu_seconds = 2;
  options.host_cpu_seconds = 2;  // starting odyssey alone uses part of it: every reset needs a fresh host
  auto session = HostedSession::start(test_plugin("crashing"), json::object(), options);
  ASSERT_TRUE(session.ok()) << session.status().to_string();
  const pid_t first = (*session)->host_pid();
  auto prompt = (*session)->reset(json::object(), 3);
  ASSERT_TRUE(prompt.ok()) << prompt.status().to_string();
  EXPECT_NE((*session)->host_pid(), first);
  EXPECT_TRUE(process_gone(first));
  EXPECT_EQ((*session)->counters().recycles, 1u);
  EXPECT_EQ((*session)->counters().restarts, 0u);
  EXPECT_EQ((*session)->counters().starts, 2u);

  options.host_cpu_seconds = 1;
  auto inverted = HostedSession::start(test_plugin("crashing"), json::object(), options);
  EXPECT_EQ(inverted.status().code(), StatusCode::kInvalidArgument);
}

TEST(EnvHostCommand, PrintsEveryLimitWithItsDefault) {
  const std::string cmd = std::string(ODYSSEY_BINARY) + " env-host --help 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  EXPECT_EQ(::pclose(p), 0) << out;
  const HostOptions defaults;
  for (const std::string& option : {std::string("--cpu-seconds"), std::string("--host-cpu-seconds"),
                                    std::string("--memory-bytes"), std::string("--file-bytes"),
                                    std::string("--open-files"), std::string("--allow-network"),
                                    std::string("--working-dir"), std::string("--keep-env")})
    EXPECT_NE(out.find(option), std::string::npos) << option << " missing from:\n" << out;
  EXPECT_NE(out.find(std::to_string(defaults.memory_bytes)), std::string::npos) << out;
  EXPECT_NE(out.find(std::to_string(defaults.host_cpu_seconds)), std::string::npos) << out;
}

}  // namespace
}  // namespace odyssey::envs
