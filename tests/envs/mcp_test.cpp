// The MCP bridge (envs/mcp.h) against real servers: the reference filesystem server
// (@modelcontextprotocol/server-filesystem, installed by ./dev.sh test into $BUILD_DIR/npm from
// tests/envs/mcp/package.json; ODYSSEY_NPM_DIR overrides where) and a scripted peer
// (tests/envs/mcp/peer.js) that misbehaves on purpose. Both run under the machine's node.
#include "envs/mcp.h"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>

namespace odyssey::envs {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

const std::string kSourceDir = ODYSSEY_SOURCE_DIR;
const std::string kPeer = kSourceDir + "/tests/envs/mcp/peer.js";

// A fresh directory for one test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "odyssey-mcp-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = fs::canonical(pattern);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string str(const std::string& child = "") const { return child.empty() ? path_.string() : (path_ / child).string(); }

 private:
  fs::path path_;
};

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The npm prefix holding node_modules/@modelcontextprotocol/server-filesystem: $ODYSSEY_NPM_DIR,
// else <build dir>/npm, the build dir being the one holding the odyssey binary's CMakeCache.txt.
std::string npm_dir() {
  if (const char* dir = std::getenv("ODYSSEY_NPM_DIR"); dir != nullptr && *dir != '\0') return dir;
  for (fs::path p = fs::path(ODYSSEY_BINARY).parent_path(); !p.empty() && p != p.root_path(); p = p.parent_path())
    if (fs::exists(p / "CMakeCache.txt")) return (p / "npm").string();
  return "";
}

// The filesystem server's entry point; fails the test (not skips) when it is not installed.
std::string filesystem_server() {
  const std::string script = npm_dir() + "/node_modules/@modelcontextprotocol/server-filesystem/dist/index.js";
  if (!fs::exists(script)) {
    ADD_FAILURE() << "the MCP filesystem server is not installed at " << script
                  << "; run ./dev.sh test (it installs tests/envs/mcp/package.json with npm into $BUILD_DIR/npm), "
                     "or set ODYSSEY_NPM_DIR to an npm prefix that has it";
  }
  return script;
}

McpServerConfig filesystem_config(const std::string& root) {
  return {"node", {filesystem_server(), root}, {}, "", std::chrono::milliseconds(10000)};
}

McpServerConfig peer_config(const std::string& mode, int timeout_ms = 10000) {
  return {"node", {kPeer, mode}, {}, "", std::chrono::milliseconds(timeout_ms)};
}

json filesystem_session_config(const std::string& root, json tasks) {
  return {{"command", "node"}, {"args", {filesystem_server(), root}}, {"timeout_ms", 10000}, {"tasks", std::move(tasks)}};
}

json peer_session_config(json tasks, const std::string& mode = "normal") {
  return {{"command", "node"}, {"args", {kPeer, mode}}, {"timeout_ms", 10000}, {"tasks", std::move(tasks)}};
}

std::unique_ptr<EnvSession> make_session(const json& config) {
  auto session = make_mcp_session(config);
  EXPECT_TRUE(session.ok()) << session.status().to_string();
  return session.ok() ? std::move(session).value() : nullptr;
}

std::unique_ptr<McpClient> start(const McpServerConfig& config) {
  auto client = McpClient::start(config);
  EXPECT_TRUE(client.ok()) << client.status().to_string();
  return client.ok() ? std::move(client).value() : nullptr;
}

env::Action call(const std::string& name, json arguments, const std::string& text = "", const std::string& id = "c1") {
  return {text, {{id, name, std::move(arguments)}}};
}

// Child processes of this test process whose command line contains `needle`.
std::vector<pid_t> children_running(const std::string& needle) {
  std::vector<pid_t> pids;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string stat = read_file(entry.path().string() + "/stat");
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream fields(stat.substr(close + 2));
    char state = 0;
    pid_t ppid = 0;
    fields >> state >> ppid;
    if (ppid != getpid() || state == 'Z') continue;
    std::string cmdline = read_file(entry.path().string() + "/cmdline");
    if (cmdline.find(needle) != std::string::npos) pids.push_back(std::stoi(name));
  }
  return pids;
}

std::vector<std::string> tool_names(const std::vector<ToolSpec>& tools) {
  std::vector<std::string> names;
  for (const auto& t : tools) names.push_back(t.name);
  return names;
}

// ----- McpClient against the filesystem server

TEST(McpClient, HandshakesWithTheFilesystemServerAndListsItsTools) {
  TempDir dir;
  auto client = start(filesystem_config(dir.str()));
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->protocol_version(), "2025-06-18");
  EXPECT_TRUE(client->server_info().contains("name"));
  auto tools = client->list_tools();
  ASSERT_TRUE(tools.ok()) << tools.status().to_string();
  const std::vector<std::string> names = tool_names(*tools);
  for (const char* expected : {"read_file", "read_text_file", "list_directory", "write_file", "search_files"})
    EXPECT_NE(std::find(names.begin(), names.end(), expected), names.end()) << expected;
  for (const auto& t : *tools) EXPECT_EQ(t.input_schema["type"], "object") << t.name;
  EXPECT_TRUE(client->alive());
  EXPECT_EQ(client->close(), "exited with code 0");
  EXPECT_FALSE(client->alive());
}

// ----- McpClient against the scripted peer

TEST(McpClient, FollowsToolsListPagesAndAcceptsAnOlderProtocolVersion) {
  auto client = start(peer_config("normal"));
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->protocol_version(), "2024-11-05");
  EXPECT_EQ(client->server_info()["version"], "1.2.3");
  EXPECT_EQ(client->instructions(), "a scripted peer");
  auto tools = client->list_tools();
  ASSERT_TRUE(tools.ok()) << tools.status().to_string();
  EXPECT_EQ(tool_names(*tools), (std::vector<std::string>{"echo", "pid", "image", "resource", "sleep", "fail",
                                                          "rpc_error", "garbage", "exit", "client_replies"}));
  EXPECT_EQ((*tools)[2].description, "An image");  // the title stands in for a missing description
}

TEST(McpClient, AnswersServerRequestsItDoesNotSupportAndIgnoresNotifications) {
  auto client = start(peer_config("normal"));
  ASSERT_NE(client, nullptr);
  // tools/list makes the peer log, ask roots/list and ping before answering.
  ASSERT_TRUE(client->list_tools().ok());
  auto replies = client->call_tool("client_replies", json::object());
  ASSERT_TRUE(replies.ok()) << replies.status().to_string();
  const json got = json::parse(replies->text);
  EXPECT_EQ(got["roots-1"]["error"]["code"], -32601) << got.dump();
  EXPECT_EQ(got["ping-1"]["result"], json::object()) << got.dump();
}

TEST(McpClient, KeepsImagesAndRendersResourcesAsText) {
  auto client = start(peer_config("normal"));
  ASSERT_NE(client, nullptr);
  auto image = client->call_tool("image", json::object());
  ASSERT_TRUE(image.ok()) << image.status().to_string();
  EXPECT_EQ(image->text, "a red pixel");
  ASSERT_EQ(image->images.size(), 2u);
  EXPECT_EQ(image->images[0].mime_type, "image/png");
  EXPECT_EQ(image->images[0].data_base64.substr(0, 8), "iVBORw0K");
  EXPECT_EQ(image->images[1].mime_type, "image/jpeg");

  auto resource = client->call_tool("resource", json::object());
  ASSERT_TRUE(resource.ok()) << resource.status().to_string();
  EXPECT_FALSE(resource->is_error);
  EXPECT_NE(resource->text.find("[resource file:///notes.txt]\nresource text"), std::string::npos) << resource->text;
  EXPECT_NE(resource->text.find("file:///blob.bin: application/octet-stream binary data"), std::string::npos)
      << resource->text;
  EXPECT_NE(resource->text.find("[resource link file:///linked.txt (linked)]"), std::string::npos) << resource->text;
}

TEST(McpClient, ReportsToolFailuresAndJsonRpcErrorsAsErrorResults) {
  auto client = start(peer_config("normal"));
  ASSERT_NE(client, nullptr);
  auto failed = client->call_tool("fail", json::object());
  ASSERT_TRUE(failed.ok()) << failed.status().to_string();
  EXPECT_TRUE(failed->is_error);
  EXPECT_EQ(failed->text, "it failed");
  auto rpc = client->call_tool("rpc_error", json::object());
  ASSERT_TRUE(rpc.ok()) << rpc.status().to_string();
  EXPECT_TRUE(rpc->is_error);
  EXPECT_EQ(rpc->text, "MCP error -32602: no such thing");
  auto echo = client->call_tool("echo", {{"text", "still here"}});
  ASSERT_TRUE(echo.ok());
  EXPECT_EQ(echo->text, "still here");
}

TEST(McpClient, TurnsALineThatIsNotJsonIntoAnError) {
  auto client = start(peer_config("garbage"));
  ASSERT_NE(client, nullptr);
  auto tools = client->list_tools();
  ASSERT_FALSE(tools.ok());
  EXPECT_EQ(tools.status().code(), StatusCode::kInternal);
  EXPECT_NE(tools.status().message().find("not JSON"), std::string::npos) << tools.status().message();
  EXPECT_NE(tools.status().message().find("<html>garbage</html>"), std::string::npos) << tools.status().message();
  EXPECT_NE(tools.status().message().find("peer.js"), std::string::npos) << tools.status().message();
  EXPECT_FALSE(client->alive());
  // Every later request gives the same error rather than reading a stream out of step.
  auto again = client->call_tool("echo", {{"text", "x"}});
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().message(), tools.status().message());
}

TEST(McpClient, TimesOutOnAServerThatNeverAnswers) {
  const auto t0 = Clock::now();
  McpServerConfig config = peer_config("silent");
  config.startup_timeout = std::chrono::milliseconds(300);
  auto client = McpClient::start(config);
  const auto elapsed = Clock::now() - t0;
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), StatusCode::kTimeout);
  EXPECT_NE(client.status().message().find("did not answer initialize within 300 ms"), std::string::npos)
      << client.status().message();
  EXPECT_LT(elapsed, std::chrono::seconds(4));
}

TEST(McpClient, DropsALateAnswerAfterATimeoutAndStaysUsable) {
  auto client = start(peer_config("normal", /*timeout_ms=*/1000));
  ASSERT_NE(client, nullptr);
  auto slow = client->call_tool("sleep", {{"ms", 1300}});
  ASSERT_FALSE(slow.ok());
  EXPECT_EQ(slow.status().code(), StatusCode::kTimeout);
  EXPECT_NE(slow.status().message().find("tools/call within 1000 ms"), std::string::npos) << slow.status().message();
  EXPECT_TRUE(client->alive());
  std::this_thread::sleep_for(std::chrono::milliseconds(400));  // the late answer arrives meanwhile
  auto echo = client->call_tool("echo", {{"text", "after the timeout"}});
  ASSERT_TRUE(echo.ok()) << echo.status().to_string();
  EXPECT_EQ(echo->text, "after the timeout");
}

TEST(McpClient, NamesTheCommandAndExitCodeWhenTheServerExitsEarly) {
  auto client = McpClient::start(peer_config("exit-early"));
  ASSERT_FALSE(client.ok());
  const std::string& message = client.status().message();
  EXPECT_EQ(client.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(message.find("`node " + kPeer + " exit-early`"), std::string::npos) << message;
  EXPECT_NE(message.find("exited with code 3"), std::string::npos) << message;
  EXPECT_NE(message.find("giving up before the handshake"), std::string::npos) << message;  // its stderr
}

TEST(McpClient, NamesTheSignalWhenTheServerIsKilled) {
  auto client = start(peer_config("normal"));
  ASSERT_NE(client, nullptr);
  const pid_t pid = client->pid();
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  auto echo = client->call_tool("echo", {{"text", "x"}});
  ASSERT_FALSE(echo.ok());
  EXPECT_EQ(echo.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(echo.status().message().find("peer.js normal` (pid " + std::to_string(pid) + ") was killed"),
            std::string::npos)
      << echo.status().message();
  EXPECT_NE(echo.status().message().find("was killed by signal 9"), std::string::npos) << echo.status().message();
  EXPECT_FALSE(client->alive());
}

TEST(McpClient, ReportsAServerThatExitsWhileAnswering) {
  auto client = start(peer_config("normal"));
  ASSERT_NE(client, nullptr);
  auto result = client->call_tool("exit", {{"code", 7}});
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(result.status().message().find("exited with code 7"), std::string::npos) << result.status().message();
}

TEST(McpClient, ReportsACommandThatCannotBeStarted) {
  auto missing = McpClient::start({"/nonexistent/mcp-server", {"--stdio"}, {}, "", std::chrono::milliseconds(1000)});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("`/nonexistent/mcp-server --stdio`"), std::string::npos)
      << missing.status().message();
  auto bad_cwd = McpClient::start({"node", {kPeer}, {}, "/nonexistent/dir", std::chrono::milliseconds(1000)});
  ASSERT_FALSE(bad_cwd.ok());
  EXPECT_NE(bad_cwd.status().message().find("working directory '/nonexistent/dir'"), std::string::npos)
      << bad_cwd.status().message();
}

TEST(McpClient, RefusesAProtocolVersionItDoesNotKnow) {
  auto client = McpClient::start(peer_config("bad-version"));
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(client.status().message().find("'1999-01-01'"), std::string::npos) << client.status().message();
}

TEST(McpClient, PassesEnvAndWorkingDirectoryToTheServer) {
  TempDir dir;
  // A shell stands in for the server: it answers initialize with what it sees, then exits.
  const std::string script =
      "read line; printf '{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{\"protocolVersion\":\"2025-06-18\","
      "\"serverInfo\":{\"name\":\"%s\",\"version\":\"%s\"}}}\\n' \"$MCP_TEST_NAME\" \"$(pwd)\"; cat >/dev/null";
  auto client = start({"sh", {"-c", script}, {{"MCP_TEST_NAME", "from env"}}, dir.str(), std::chrono::milliseconds(5000)});
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->server_info()["name"], "from env");
  EXPECT_EQ(client->server_info()["version"], dir.str());
}

TEST(McpClient, ClosesAServerThatIgnoresTheEndOfItsInputAndSigterm) {
  auto client = start(peer_config("stubborn"));
  ASSERT_NE(client, nullptr);
  const pid_t pid = client->pid();
  const auto t0 = Clock::now();
  const std::string how = client->close();
  EXPECT_EQ(how, "was killed by signal 9 (Killed) after SIGKILL");
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(3));
  EXPECT_NE(kill(pid, 0), 0);  // gone and reaped
}

// ----- McpSession against the filesystem server

TEST(McpSession, ScoresAnEpisodeWhoseToolCallsReadAFileInTheAllowedDirectory) {
  TempDir dir;
  fs::create_directories(dir.str("notes"));
  write_file(dir.str("notes/code.txt"), "the code word is heliotrope\n");
  auto session = make_session(filesystem_session_config(
      dir.str(), json::array({{{"prompt", "What is the code word in notes/code.txt?"}, {"answer", "heliotrope"}}})));
  ASSERT_NE(session, nullptr);
  EXPECT_EQ(session->info().name, "secure-filesystem-server");
  EXPECT_FALSE(session->info().tools.empty());

  auto first = session->reset({{"index", 0}}, 1);
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  EXPECT_EQ(first->text.rfind("What is the code word in notes/code.txt?", 0), 0u);
  EXPECT_NE(first->text.find("ANSWER: <your answer>"), std::string::npos);

  auto listed = session->step(call("list_directory", {{"path", dir.str()}}, "Let me look."));
  ASSERT_TRUE(listed.ok()) << listed.status().to_string();
  ASSERT_EQ(listed->tool_results.size(), 1u);
  EXPECT_EQ(listed->tool_results[0].call_id, "c1");
  EXPECT_FALSE(listed->tool_results[0].is_error) << listed->tool_results[0].content;
  EXPECT_NE(listed->tool_results[0].content.find("[DIR] notes"), std::string::npos) << listed->tool_results[0].content;
  EXPECT_FALSE(listed->done);

  auto read = session->step(call("read_text_file", {{"path", dir.str("notes/code.txt")}}, "", "c2"));
  ASSERT_TRUE(read.ok()) << read.status().to_string();
  ASSERT_EQ(read->tool_results.size(), 1u);
  EXPECT_EQ(read->tool_results[0].content, "the code word is heliotrope\n");
  EXPECT_FALSE(read->done);

  auto answered = session->step({"The file says so.\nANSWER: heliotrope\n", {}});
  ASSERT_TRUE(answered.ok()) << answered.status().to_string();
  EXPECT_TRUE(answered->done);
  EXPECT_EQ(answered->info["ended_by"], "answer");

  auto score = session->score();
  ASSERT_TRUE(score.ok()) << score.status().to_string();
  EXPECT_TRUE(score->success);
  EXPECT_EQ(score->reward, 1.0);
  ASSERT_EQ(score->parts.size(), 1u);
  EXPECT_EQ(score->parts[0].name, "answer");
  EXPECT_EQ(score->parts[0].value, 1.0);

  // A wrong answer in the next episode scores 0.
  ASSERT_TRUE(session->reset({{"index", 0}}, 2).ok());
  ASSERT_TRUE(session->step({"ANSWER: marigold", {}}).ok());
  auto wrong = session->score();
  ASSERT_TRUE(wrong.ok());
  EXPECT_FALSE(wrong->success);
  EXPECT_EQ(wrong->reward, 0.0);
  EXPECT_EQ(wrong->info["answer"], "marigold");
}

TEST(McpSession, ShowsTheModelAnErrorForAPathOutsideTheAllowedDirectory) {
  TempDir dir;
  TempDir outside;
  write_file(outside.str("secret.txt"), "top secret\n");
  auto session = make_session(filesystem_session_config(dir.str(), json::array({{{"prompt", "p"}, {"answer", "a"}}})));
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session->reset({{"index", 0}}, 0).ok());
  auto obs = session->step(call("read_text_file", {{"path", outside.str("secret.txt")}}));
  ASSERT_TRUE(obs.ok()) << obs.status().to_string();
  ASSERT_EQ(obs->tool_results.size(), 1u);
  EXPECT_TRUE(obs->tool_results[0].is_error);
  EXPECT_NE(obs->tool_results[0].content.find("Access denied"), std::string::npos) << obs->tool_results[0].content;
  EXPECT_EQ(obs->tool_results[0].content.find("top secret"), std::string::npos);
  EXPECT_FALSE(obs->done);
}

TEST(McpSession, AnswersUnknownToolsAndBadArgumentsWithErrorResults) {
  TempDir dir;
  write_file(dir.str("a.txt"), "alpha\n");
  auto session = make_session(filesystem_session_config(dir.str(), json::array({{{"prompt", "p"}, {"answer", "a"}}})));
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session->reset({{"index", 0}}, 0).ok());
  env::Action action{"", {{"c1", "delete_everything", json::object()},
                          {"c2", "read_text_file", {{"path", 42}}},
                          {"c3", "read_text_file", json::object()},
                          {"c4", "read_text_file", json::array({1})},
                          {"c5", "read_text_file", {{"path", dir.str("a.txt")}}}}};
  auto obs = session->step(action);
  ASSERT_TRUE(obs.ok()) << obs.status().to_string();
  ASSERT_EQ(obs->tool_results.size(), 5u);
  EXPECT_TRUE(obs->tool_results[0].is_error);
  EXPECT_NE(obs->tool_results[0].content.find("unknown tool 'delete_everything'; the tools are: read_file"),
            std::string::npos)
      << obs->tool_results[0].content;
  EXPECT_TRUE(obs->tool_results[1].is_error);
  EXPECT_NE(obs->tool_results[1].content.find("invalid arguments for tool 'read_text_file': /path"), std::string::npos)
      << obs->tool_results[1].content;
  EXPECT_TRUE(obs->tool_results[2].is_error);
  EXPECT_NE(obs->tool_results[2].content.find("'path'"), std::string::npos) << obs->tool_results[2].content;
  EXPECT_TRUE(obs->tool_results[3].is_error);
  EXPECT_NE(obs->tool_results[3].content.find("expected a JSON object, got array"), std::string::npos);
  // The good call after the bad ones still runs.
  EXPECT_FALSE(obs->tool_results[4].is_error);
  EXPECT_EQ(obs->tool_results[4].content, "alpha\n");
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(obs->tool_results[i].call_id, "c" + std::to_string(i + 1));
}

TEST(McpSession, ReportsAKilledServerAndRecoversOnTheNextReset) {
  TempDir dir;
  write_file(dir.str("a.txt"), "alpha\n");
  auto session = make_session(filesystem_session_config(dir.str(), json::array({{{"prompt", "p"}, {"answer", "alpha"}}})));
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session->reset({{"index", 0}}, 0).ok());
  const std::vector<pid_t> servers = children_running("server-filesystem");
  ASSERT_EQ(servers.size(), 1u);
  ASSERT_EQ(kill(servers[0], SIGKILL), 0);

  auto obs = session->step(call("read_text_file", {{"path", dir.str("a.txt")}}));
  ASSERT_FALSE(obs.ok());
  EXPECT_EQ(obs.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(obs.status().message().find("server-filesystem"), std::string::npos) << obs.status().message();
  EXPECT_NE(obs.status().message().find("was killed by signal 9"), std::string::npos) << obs.status().message();

  auto again = session->reset({{"index", 0}}, 0);
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  const std::vector<pid_t> restarted = children_running("server-filesystem");
  ASSERT_EQ(restarted.size(), 1u);
  EXPECT_NE(restarted[0], servers[0]);
  auto read = session->step(call("read_text_file", {{"path", dir.str("a.txt")}}, "ANSWER: alpha"));
  ASSERT_TRUE(read.ok()) << read.status().to_string();
  EXPECT_EQ(read->tool_results[0].content, "alpha\n");
  EXPECT_TRUE(read->done);
  auto score = session->score();
  ASSERT_TRUE(score.ok());
  EXPECT_TRUE(score->success);
}

TEST(McpSession, RunsTheCheckCallToScoreAFileTheModelWrote) {
  TempDir dir;
  const json check = {{"tool", "read_text_file"}, {"arguments", {{"path", dir.str("hello.txt")}}},
                      {"expect_contains", "hello, world"}};
  auto session =
      make_session(filesystem_session_config(dir.str(), json::array({{{"prompt", "Write hello.txt"}, {"check", check}}})));
  ASSERT_NE(session, nullptr);

  // Before the model writes the file, the check fails (the read is an error).
  ASSERT_TRUE(session->reset({{"index", 0}}, 0).ok());
  ASSERT_TRUE(session->step({"I give up.", {}}).ok());
  auto failed = session->score();
  ASSERT_TRUE(failed.ok()) << failed.status().to_string();
  EXPECT_FALSE(failed->success);
  EXPECT_TRUE(failed->info["check"]["is_error"].get<bool>());

  ASSERT_TRUE(session->reset({{"index", 0}}, 0).ok());
  auto wrote = session->step(call("write_file", {{"path", dir.str("hello.txt")}, {"content", "hello, world\n"}}));
  ASSERT_TRUE(wrote.ok()) << wrote.status().to_string();
  EXPECT_FALSE(wrote->tool_results[0].is_error) << wrote->tool_results[0].content;
  EXPECT_EQ(read_file(dir.str("hello.txt")), "hello, world\n");
  ASSERT_TRUE(session->step({"Done.", {}}).ok());
  auto score = session->score();
  ASSERT_TRUE(score.ok()) << score.status().to_string();
  EXPECT_TRUE(score->success);
  ASSERT_EQ(score->parts.size(), 1u);
  EXPECT_EQ(score->parts[0].name, "check");
  EXPECT_EQ(score->parts[0].value, 1.0);
}

TEST(McpSession, RunsTheExampleFilesystemConfigByName) {
  // configs/envs/mcp-filesystem.json finds the server through ${ODYSSEY_NPM_DIR}.
  ASSERT_FALSE(filesystem_server().empty());
  setenv("ODYSSEY_NPM_DIR", npm_dir().c_str(), 1);
  auto path = find_mcp_config("mcp-filesystem", {kSourceDir + "/configs/envs"});
  ASSERT_TRUE(path.ok()) << path.status().to_string();
  auto config = load_mcp_config_file(*path);
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  EXPECT_TRUE(is_mcp_config(*config));
  auto session = make_session(*config);
  ASSERT_NE(session, nullptr);
  EXPECT_EQ(session->info().name, "mcp-filesystem");
  for (const auto& t : session->info().tools) EXPECT_NE(t.name, "write_file");  // the config exposes reads only

  auto obs = session->reset({{"index", 0}}, 0);
  ASSERT_TRUE(obs.ok()) << obs.status().to_string();
  EXPECT_NE(obs->text.find("codeword.txt"), std::string::npos) << obs->text;
  auto read = session->step(call("read_text_file", {{"path", "notes/codeword.txt"}}));
  ASSERT_TRUE(read.ok()) << read.status().to_string();
  ASSERT_FALSE(read->tool_results[0].is_error) << read->tool_results[0].content;
  const std::string word = read->tool_results[0].content.substr(read->tool_results[0].content.rfind(' ') + 1);
  ASSERT_TRUE(session->step({"ANSWER: " + word, {}}).ok());
  auto score = session->score();
  ASSERT_TRUE(score.ok());
  EXPECT_TRUE(score->success) << score->info.dump();
}

// ----- McpSession against the scripted peer

TEST(McpSession, RestartsTheServerPerEpisodeOnlyWhenConfigured) {
  const json tasks = json::array({{{"prompt", "p"}, {"answer", "a"}}});
  auto pid_in_episode = [](EnvSession& session) {
    EXPECT_TRUE(session.reset({{"index", 0}}, 0).ok());
    auto obs = session.step(call("pid", json::object()));
    EXPECT_TRUE(obs.ok()) << obs.status().to_string();
    return obs.ok() ? obs->tool_results.at(0).content : std::string();
  };
  auto kept = make_session(peer_session_config(tasks));
  ASSERT_NE(kept, nullptr);
  const std::string first = pid_in_episode(*kept);
  EXPECT_EQ(pid_in_episode(*kept), first);

  json config = peer_session_config(tasks);
  config["restart_per_episode"] = true;
  auto restarted = make_session(config);
  ASSERT_NE(restarted, nullptr);
  const std::string a = pid_in_episode(*restarted);
  const std::string b = pid_in_episode(*restarted);
  EXPECT_FALSE(a.empty());
  EXPECT_NE(a, b);
}

TEST(McpSession, PicksTasksByIndexOrFromTheSeed) {
  json tasks = json::array();
  for (int i = 0; i < 5; ++i) tasks.push_back({{"prompt", "task " + std::to_string(i)}, {"answer", std::to_string(i)}});
  json config = peer_session_config(tasks);
  config["answer_instructions"] = "";
  auto session = make_session(config);
  ASSERT_NE(session, nullptr);
  auto by_index = session->reset({{"index", 3}}, 99);
  ASSERT_TRUE(by_index.ok());
  EXPECT_EQ(by_index->text, "task 3");
  EXPECT_EQ(by_index->info["task"]["index"], 3);

  std::set<std::string> drawn;
  for (uint64_t seed = 0; seed < 20; ++seed) {
    auto a = session->reset(json::object(), seed);
    auto b = session->reset(nullptr, seed);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->text, b->text);  // same seed, same task
    drawn.insert(a->text);
  }
  EXPECT_GT(drawn.size(), 2u);

  auto adhoc = session->reset({{"prompt", "say hi"}, {"answer", "hi"}}, 0);
  ASSERT_TRUE(adhoc.ok()) << adhoc.status().to_string();
  EXPECT_EQ(adhoc->text, "say hi");
  ASSERT_TRUE(session->step({"ANSWER:   hi  ", {}}).ok());
  auto score = session->score();
  ASSERT_TRUE(score.ok());
  EXPECT_TRUE(score->success);  // compared trimmed

  auto bad_check = session->reset({{"prompt", "p"}, {"check", {{"tool", "nope"}}}}, 0);
  ASSERT_FALSE(bad_check.ok());
  EXPECT_NE(bad_check.status().message().find("check.tool 'nope' is not a tool of the server"), std::string::npos);
  auto out_of_range = session->reset({{"index", 5}}, 0);
  ASSERT_FALSE(out_of_range.ok());
  EXPECT_NE(out_of_range.status().message().find("task index 5 is out of range: the task list has 5 tasks"),
            std::string::npos);
  auto bad = session->reset({{"index", "two"}}, 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'index' must be an integer"), std::string::npos);
  EXPECT_EQ(session->step({"", {}}).status().code(), StatusCode::kFailedPrecondition);  // no episode after a bad reset
}

TEST(McpSession, EndsTheEpisodeOnAnAnswerLineNoToolCallsOrTheTurnLimit) {
  json config = peer_session_config(json::array({{{"prompt", "p"}, {"answer", "42"}}}));
  config["max_turns"] = 2;
  auto session = make_session(config);
  ASSERT_NE(session, nullptr);

  ASSERT_TRUE(session->reset({{"index", 0}}, 0).ok());
  auto with_calls = session->step(call("echo", {{"text", "x"}}, "thinking\nANSWER: 42\n"));
  ASSERT_TRUE(with_calls.ok());
  EXPECT_EQ(with_calls->tool_results.size(), 1u);  // the calls of the answering turn still run
  EXPECT_TRUE(with_calls->done);
  EXPECT_EQ(session->step({"more", {}}).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(session->score()->success);

  ASSERT_TRUE(session->reset({{"index", 0}}, 0).ok());
  auto silent = session->step({"no tools, no answer", {}});
  ASSERT_TRUE(silent.ok());
  EXPECT_TRUE(silent->done);
  EXPECT_EQ(silent->info["ended_by"], "no_tool_calls");
  EXPECT_FALSE(session->score()->success);

  ASSERT_TRUE(session->reset({{"index", 0}}, 0).ok());
  EXPECT_FALSE(session->step(call("echo", {{"text", "1"}})).value().done);
  auto last = session->step(call("echo", {{"text", "2"}}));
  ASSERT_TRUE(last.ok());
  EXPECT_TRUE(last->done);
  EXPECT_EQ(last->info["ended_by"], "max_turns");
}

TEST(McpSession, ShowsATimedOutToolCallToTheModelAsAnError) {
  json config = peer_session_config(json::array({{{"prompt", "p"}, {"answer", "a"}}}));
  config["timeout_ms"] = 1000;  // start-up has its own (startup_timeout_ms)
  auto session = make_session(config);
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session->reset({{"index", 0}}, 0).ok());
  env::Action action{"", {{"c1", "sleep", {{"ms", -1}}}, {"c2", "echo", {{"text", "next"}}}}};
  auto obs = session->step(action);
  ASSERT_TRUE(obs.ok()) << obs.status().to_string();
  ASSERT_EQ(obs->tool_results.size(), 2u);
  EXPECT_TRUE(obs->tool_results[0].is_error);
  EXPECT_EQ(obs->tool_results[0].content, "tool 'sleep' did not finish within 1000 ms");
  EXPECT_FALSE(obs->tool_results[1].is_error);
  EXPECT_EQ(obs->tool_results[1].content, "next");
}

TEST(McpSession, PassesPngImagesOnAndNotesOtherKinds) {
  auto session = make_session(peer_session_config(json::array({{{"prompt", "p"}, {"answer", "a"}}})));
  ASSERT_NE(session, nullptr);
  EXPECT_TRUE(session->info().images);
  ASSERT_TRUE(session->reset({{"index", 0}}, 0).ok());
  auto obs = session->step(call("image", json::object()));
  ASSERT_TRUE(obs.ok()) << obs.status().to_string();
  ASSERT_EQ(obs->images.size(), 1u);
  EXPECT_EQ(obs->images[0].format, ODY_ENV_IMAGE_PNG);
  EXPECT_EQ(obs->images[0].width, 1u);
  EXPECT_EQ(obs->images[0].height, 1u);
  EXPECT_EQ(obs->images[0].data.size(), 70u);
  EXPECT_EQ(obs->tool_results[0].content,
            "a red pixel\n[image 1: 1x1 PNG]\n[image/jpeg image of 17 bytes not shown: only PNG images are passed on]");
}

TEST(McpSession, RestartsAServerThatWroteGarbageOnTheNextReset) {
  auto session = make_session(peer_session_config(json::array({{{"prompt", "p"}, {"answer", "a"}}})));
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session->reset({{"index", 0}}, 0).ok());
  auto broken = session->step(call("garbage", json::object()));
  ASSERT_FALSE(broken.ok());
  EXPECT_EQ(broken.status().code(), StatusCode::kInternal);
  EXPECT_NE(broken.status().message().find("mcp step: tool 'garbage'"), std::string::npos) << broken.status().message();
  EXPECT_NE(broken.status().message().find("this is not JSON {"), std::string::npos) << broken.status().message();
  ASSERT_TRUE(session->reset({{"index", 0}}, 0).ok());
  auto echo = session->step(call("echo", {{"text", "fine again"}}));
  ASSERT_TRUE(echo.ok()) << echo.status().to_string();
  EXPECT_EQ(echo->tool_results[0].content, "fine again");
}

TEST(McpSession, ExposesOnlyTheConfiguredTools) {
  json config = peer_session_config(json::array({{{"prompt", "p"}, {"answer", "a"}}}));
  config["tools"] = {"echo", "pid"};
  auto session = make_session(config);
  ASSERT_NE(session, nullptr);
  EXPECT_EQ(tool_names(session->info().tools), (std::vector<std::string>{"echo", "pid"}));
  ASSERT_TRUE(session->reset({{"index", 0}}, 0).ok());
  auto obs = session->step(call("fail", json::object()));
  ASSERT_TRUE(obs.ok());
  EXPECT_EQ(obs->tool_results[0].content, "unknown tool 'fail'; the tools are: echo, pid");

  config["tools"] = {"echo", "ecko"};
  auto missing = make_mcp_session(config);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("key 'tools' names 'ecko', which MCP server"), std::string::npos)
      << missing.status().message();
}

// The message make_mcp_session gives for `config`, which must be refused.
std::string refusal(const json& config) {
  auto session = make_mcp_session(config);
  EXPECT_FALSE(session.ok()) << config.dump();
  return session.ok() ? "" : session.status().message();
}

TEST(McpSession, RejectsBadConfigsNamingTheKey) {
  const json tasks = json::array({{{"prompt", "p"}, {"answer", "a"}}});
  const json good = peer_session_config(tasks);
  auto with = [&](const std::string& key, json value) {
    json c = good;
    c[key] = std::move(value);
    return c;
  };
  auto without = [&](const std::string& key) {
    json c = good;
    c.erase(key);
    return c;
  };
  EXPECT_EQ(refusal(json::array()), "mcp config: must be a JSON object, got array");
  EXPECT_NE(refusal(without("command")).find("missing key 'command'"), std::string::npos);
  EXPECT_NE(refusal(with("command", 3)).find("key 'command' must be a string, got number"), std::string::npos);
  EXPECT_NE(refusal(with("comand", "node")).find("unknown key 'comand' (did you mean 'command'?)"), std::string::npos);
  EXPECT_NE(refusal(with("args", "peer.js")).find("key 'args' must be an array of strings"), std::string::npos);
  EXPECT_NE(refusal(with("args", {"a", 1})).find("key 'args[1]' must be a string"), std::string::npos);
  EXPECT_NE(refusal(with("env", {{"A", 1}})).find("key 'env.A' must be a string"), std::string::npos);
  EXPECT_NE(refusal(with("timeout_ms", 0)).find("key 'timeout_ms' must be an integer in 1..86400000, got 0"),
            std::string::npos);
  EXPECT_NE(refusal(with("startup_timeout_ms", 1.5)).find("key 'startup_timeout_ms' must be an integer"),
            std::string::npos);
  EXPECT_NE(refusal(with("restart_per_episode", "yes")).find("key 'restart_per_episode' must be true or false"),
            std::string::npos);
  EXPECT_NE(refusal(with("type", "plugin")).find("key 'type' must be \"mcp\""), std::string::npos);
  EXPECT_NE(refusal(without("tasks")).find("give exactly one of 'tasks'"), std::string::npos);
  EXPECT_NE(refusal(with("tasks_file", "x.jsonl")).find("give exactly one of 'tasks'"), std::string::npos);
  EXPECT_NE(refusal(with("tasks", json::array())).find("key 'tasks' must be a non-empty array"), std::string::npos);
  EXPECT_NE(refusal(with("tasks", {{{"answer", "a"}}})).find("tasks[0]: missing key 'prompt'"), std::string::npos);
  EXPECT_NE(refusal(with("tasks", {{{"prompt", "p"}}})).find("tasks[0]: a task needs an 'answer', a 'check'"),
            std::string::npos);
  EXPECT_NE(refusal(with("tasks", {{{"prompt", "p"}, {"answr", "a"}}})).find("unknown key 'answr' (did you mean 'answer'?)"),
            std::string::npos);
  EXPECT_NE(refusal(with("tasks", {{{"prompt", "p"}, {"check", {{"tool", "echo"}, {"arguments", 1}}}}}))
                .find("tasks[0]: check: key 'arguments' must be a JSON object"),
            std::string::npos);
  EXPECT_NE(refusal(with("command", "${ODYSSEY_MCP_TEST_UNSET_VARIABLE}"))
                .find("key 'command' uses ${ODYSSEY_MCP_TEST_UNSET_VARIABLE}, which is not set"),
            std::string::npos);
  // Checked against the server's tools once it runs.
  EXPECT_NE(refusal(with("tasks", {{{"prompt", "p"}, {"check", {{"tool", "nope"}}}}}))
                .find("check.tool 'nope' is not a tool of the server (it has: client_replies, echo,"),
            std::string::npos);
  EXPECT_NE(refusal(with("tasks", {{{"prompt", "p"}, {"check", {{"tool", "echo"}, {"arguments", {{"text", 5}}}}}}}))
                .find("check.arguments do not fit tool 'echo': /text"),
            std::string::npos);
  EXPECT_NE(refusal(with("command", "/nonexistent/server")).find("cannot start MCP server `/nonexistent/server"),
            std::string::npos);
}

TEST(McpSession, ReadsTasksFilesAndNamesTheBadLine) {
  TempDir dir;
  write_file(dir.str("tasks.jsonl"), "{\"prompt\": \"one\", \"answer\": \"1\"}\n\n{\"prompt\": \"two\", \"answer\": \"2\"}\n");
  write_file(dir.str("bad.jsonl"), "{\"prompt\": \"one\", \"answer\": \"1\"}\n{\"prompt\": \n");
  write_file(dir.str("env.json"), json{{"type", "mcp"},
                                       {"command", "node"},
                                       {"args", {"${CONFIG_DIR}/peer.js", "normal"}},
                                       {"tasks_file", "tasks.jsonl"},
                                       {"answer_instructions", ""}}
                                      .dump());
  fs::copy_file(kPeer, dir.str("peer.js"));
  auto config = load_mcp_config_file(dir.str("env.json"));
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  EXPECT_EQ((*config)["config_dir"], dir.str());
  auto session = make_session(*config);
  ASSERT_NE(session, nullptr);
  auto second = session->reset({{"index", 1}}, 0);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->text, "two");

  (*config)["tasks_file"] = "bad.jsonl";
  EXPECT_NE(refusal(*config).find("mcp tasks_file " + dir.str("bad.jsonl") + ":2: not valid JSON"), std::string::npos);
  (*config)["tasks_file"] = "missing.jsonl";
  EXPECT_NE(refusal(*config).find("cannot read '" + dir.str("missing.jsonl") + "'"), std::string::npos);
  write_file(dir.str("broken.json"), "{\"command\": ");
  auto broken = load_mcp_config_file(dir.str("broken.json"));
  ASSERT_FALSE(broken.ok());
  EXPECT_NE(broken.status().message().find("broken.json: not valid JSON"), std::string::npos);
  auto not_found = find_mcp_config("no-such-env", {dir.str()});
  ASSERT_FALSE(not_found.ok());
  EXPECT_NE(not_found.status().message().find("no MCP environment file no-such-env.json in"), std::string::npos);
}

TEST(McpSession, RefusesSnapshots) {
  auto session = make_session(peer_session_config(json::array({{{"prompt", "p"}, {"answer", "a"}}})));
  ASSERT_NE(session, nullptr);
  EXPECT_FALSE(session->info().snapshots);
  EXPECT_EQ(session->snapshot().status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(session->restore("x").code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(session->score().status().code(), StatusCode::kFailedPrecondition);  // no episode yet
}

}  // namespace
}  // namespace odyssey::envs
