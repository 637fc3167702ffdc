// The MCP bridge: any Model Context Protocol server (JSON-RPC 2.0 over stdio, one message per
// line, spec 2025-06-18; older versions the server answers with are accepted) as an
// environment's toolset.
//
// McpClient runs one server process and speaks the protocol to it:
//   start()      spawns `command args...` (PATH search, extra env, working dir) in its own process
//                group, sends initialize {protocolVersion, capabilities: {}, clientInfo {name:
//                "odyssey", version}} and then notifications/initialized;
//   list_tools() follows tools/list's nextCursor pages;
//   call_tool()  sends tools/call {name, arguments}. Text parts are joined with "\n", image parts
//                are kept (base64 data + mimeType), embedded resources and resource links are
//                rendered as text, isError is kept. A JSON-RPC error answer to tools/call (how
//                servers report unknown tools and invalid arguments) is an is_error result too.
// Every request has a timeout (kTimeout; the client sends notifications/cancelled and stays
// usable, a late answer is dropped); initialize has its own, for slow start-ups. Notifications and log messages from the server are
// logged and otherwise ignored; requests from the server are answered: ping with {}, anything
// else (roots/list, sampling/createMessage, elicitation/create: we declare no client
// capabilities) with JSON-RPC error -32601. The server's stderr goes to our log, line by line,
// and its last lines are quoted in errors.
// Errors: the server exiting (EOF on its stdout) is kUnavailable naming the command line and
// its exit code or signal; a line that is not a JSON-RPC message (not JSON, not an object, an
// answer with neither result nor error, over 64 MiB) is kInternal quoting the line. After
// either, the client is dead (alive() is false) and every request returns that Status.
// close() (and the destructor) closes the server's stdin, waits, then SIGTERMs and at last
// SIGKILLs its process group. Not thread-safe: one thread at a time per client.
//
// McpSession (make_mcp_session) is an EnvSession whose tools are the server's tools and whose
// episodes come from a task list. Config (a JSON object; errors name the key):
//   command (string, required), args ([string]), env ({string: string}, added to ours),
//   cwd (string), timeout_ms (int > 0, default 30000: per request), startup_timeout_ms (int > 0,
//   default 30000: for the server to start and answer initialize),
//   tasks ([task]) or tasks_file (string: JSONL, one task per line, blank lines skipped),
//   restart_per_episode (bool, default false), max_turns (int > 0, default 16),
//   tools ([string]: expose only these server tools), name, description (strings),
//   answer_instructions (string appended to each prompt; default says how to answer; "" for
//   none), type ("mcp", ignored), config_dir (string: what relative paths in command (when it
//   holds a '/'), cwd and tasks_file are taken against, and the value of ${CONFIG_DIR}; set by
//   load_mcp_config_file). args are not taken as paths (the server reads them from its cwd).
// In command, args, env values, cwd and tasks_file, ${VAR} and ${VAR:-default} are replaced by
// the environment variable (an unset VAR without a default is an error naming the key).
// A task is {"prompt": string, "answer": string?, "check": {"tool": string, "arguments":
// object?, "expect_contains": string?}?, "id": string?}; it needs an answer or a check.
// reset(task): {"index": i} picks tasks[i]; {} or null draws one from the seed; an object with
// "prompt" is an ad-hoc task. The observation's text is the prompt plus answer_instructions.
// The server is (re)started at reset when it is not running, when it died, or always with
// restart_per_episode.
// step(): each tool call goes to tools/call in order. An unknown tool, arguments that fail the
// tool's schema, a tool error and a timed-out call are is_error results the model sees. The
// final-answer convention: a line "ANSWER: <text>" in the turn's text (the last one counts)
// ends the episode, after that turn's calls ran; so does a turn without tool calls, and the
// max_turns-th turn. A server that exits mid-episode makes step() fail with kUnavailable;
// the next reset restarts it.
// score(): the "answer" part is 1 when the given answer equals the expected one (both
// trimmed); the "check" part runs the check's tool call and is 1 when it succeeds and its text
// contains expect_contains. reward = success = every part passed.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "envs/session.h"

namespace odyssey::envs {

struct McpServerConfig {
  std::string command;
  std::vector<std::string> args;
  std::map<std::string, std::string> env;  // set in the server's environment, over ours
  std::string cwd;                         // "" = ours
  std::chrono::milliseconds timeout{30000};          // each request
  std::chrono::milliseconds startup_timeout{30000};  // initialize (start-up included)
};

struct McpImage {
  std::string mime_type;
  std::string data_base64;
};

struct McpToolResult {
  std::string text;
  std::vector<McpImage> images;
  bool is_error = false;
};

class McpClient {
 public:
  // Spawns the server and does the handshake; fails naming the command line.
  static Result<std::unique_ptr<McpClient>> start(const McpServerConfig& config);
  ~McpClient();
  McpClient(const McpClient&) = delete;
  McpClient& operator=(const McpClient&) = delete;

  Result<std::vector<ToolSpec>> list_tools();
  // Tool-level failures are is_error results; a Status means the call could not be made
  // (timeout, server gone, protocol violation).
  Result<McpToolResult> call_tool(const std::string& name, const nlohmann::json& arguments);
  // Any request; a JSON-RPC error answer is kFailedPrecondition with its code and message.
  Result<nlohmann::json> request(const std::string& method, const nlohmann::json& params);

  const std::string& protocol_version() const { return protocol_version_; }
  const nlohmann::json& server_info() const { return server_info_; }     // {name, version}
  const nlohmann::json& capabilities() const { return capabilities_; }  // the server's
  const std::string& instructions() const { return instructions_; }
  const std::string& command_line() const { return command_line_; }
  pid_t pid() const { return pid_; }
  // False once the server exited or broke the protocol (also checks for an exit now).
  bool alive();
  // OK, or why the client is dead.
  const Status& failure() const { return failure_; }
  // Stops the server (stdin closed, then SIGTERM, then SIGKILL); returns how it ended,
  // e.g. "exited with code 0". Idempotent.
  std::string close();

 private:
  McpClient() = default;
  struct Answer {
    nlohmann::json result;
    nlohmann::json error;  // null unless the server answered with an error
  };
  Status spawn(const McpServerConfig& config);
  Status initialize();
  Result<Answer> exchange(const std::string& method, const nlohmann::json& params, std::chrono::milliseconds timeout);
  Status send(const nlohmann::json& message, std::chrono::steady_clock::time_point deadline);
  Status fail(Status status);
  Status server_gone();
  void handle_request(const nlohmann::json& message);
  void drain_stderr(bool flush);
  std::string stderr_tail() const;
  std::string reap(std::chrono::milliseconds wait);

  std::chrono::milliseconds timeout_{30000};
  std::chrono::milliseconds startup_timeout_{30000};
  std::string command_line_;
  std::string log_name_;  // the server's name once known, else the command's file name
  pid_t pid_ = -1;
  int stdin_fd_ = -1;
  int stdout_fd_ = -1;
  int stderr_fd_ = -1;
  std::string stdout_buffer_;
  std::string stderr_buffer_;
  std::deque<std::string> stderr_lines_;
  int64_t next_id_ = 1;
  std::string protocol_version_;
  nlohmann::json server_info_ = nlohmann::json::object();
  nlohmann::json capabilities_ = nlohmann::json::object();
  std::string instructions_;
  Status failure_;
  std::string ended_;  // how the process ended, once reaped
};

// The MCP environment for a config (see above). Validates the config and the tasks, starts the
// server, lists its tools (checking their schemas) and keeps it running for the episodes.
Result<std::unique_ptr<EnvSession>> make_mcp_session(const nlohmann::json& config);

// Reads an MCP environment file (a JSON object as above, usually with "type": "mcp") and sets
// its config_dir to the file's directory (unless it sets one).
Result<nlohmann::json> load_mcp_config_file(const std::string& path);

// True for a config that asks for the MCP bridge: an object with "type": "mcp".
bool is_mcp_config(const nlohmann::json& config);

// The MCP environment file for `name_or_path`: a path (containing '/' or ending in .json) as is,
// else NAME.json in, in order, the directories of $ODYSSEY_ENV_PATH, `extra_dirs` and
// ./configs/envs. kNotFound lists where it looked.
Result<std::string> find_mcp_config(const std::string& name_or_path, const std::vector<std::string>& extra_dirs = {});

}  // namespace odyssey::envs
