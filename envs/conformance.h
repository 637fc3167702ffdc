// The conformance suite `odyssey env check` runs: does an environment keep the EnvSession
// contract (envs/session.h, odyssey/env.h)? It talks to sessions only through EnvSession, so
// the same checks run against an in-process plugin, a plugin under env-host, or an MCP bridge.
//
// Checks, in order (each PASS, FAIL, WARN or SKIP with a one-line reason):
//   create            a session comes up from the config
//   tool schemas      names unique and well-formed, every input_schema a valid JSON Schema of an
//                     object (the same rules as parse_tools)
//   reset             the first observation: no tool results, not done
//   episodes          `episodes` scripted episodes (seeds seed, seed+1, ...): each step answers
//                     every call once, in order, with its id; rewards finite; score works after
//                     done (or after max_steps, when the host would stop the episode)
//   early score       score right after reset works (a host may stop an episode at any time)
//   determinism       the same task and seed twice (a fresh instance, and the same instance reset
//                     again) give identical observations and scores (info excepted: a WARN)
//   different seeds   seeds give different episodes (WARN when they do not: only with task {})
//   rejected calls    malformed JSON, an unknown tool and schema-invalid arguments, run through
//                     TurnParser, become error observations; the turn that is left reaches the
//                     environment and is answered
//   step after done   refused with a clean error (not an internal one), or answered
//   snapshot          when offered: restore into a fresh instance continues identically, and
//                     restoring garbage is an error; when not offered, snapshot() says so
//   call time         the slowest call; with a call timeout (hosted sessions), FAIL for a call
//                     that timed out and WARN for one over half the limit
//
// Scripted turns call the tools in turn with arguments made from each tool's schema ("default"
// or "examples" when given, else the smallest value of each required property, varied per
// step); a turn whose arguments cannot be made valid carries no call.
//
// A plugin that crashes takes an in-process check with it; run hosted (`--hosted`) to see the
// crash as a FAIL.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "envs/session.h"

namespace odyssey::envs {

struct ConformanceOptions {
  nlohmann::json task = nlohmann::json::object();  // passed to every reset; {} draws from the seed
  uint64_t seed = 1;
  int episodes = 3;        // scripted episodes in the "episodes" check
  int max_steps = 16;      // per scripted episode
  // The session's per-call limit, when it has one (hosted); nullopt: calls cannot time out.
  std::optional<std::chrono::milliseconds> call_timeout;
};

enum class CheckOutcome { kPass, kFail, kWarn, kSkip };
const char* check_outcome_name(CheckOutcome outcome);  // "PASS", "FAIL", "WARN", "SKIP"

struct CheckResult {
  std::string name;
  CheckOutcome outcome = CheckOutcome::kPass;
  std::string detail;  // one line
};

struct ConformanceReport {
  std::string subject;  // "guess 1.0.0 (/path/libody_env_guess.so)"
  std::vector<CheckResult> checks;

  bool passed() const;  // no FAIL
  // One line per check ("PASS  episodes         3 episodes, ..."), then a summary line.
  std::string to_text() const;
  nlohmann::json to_json() const;
};

// Makes a fresh session (a new instance of the same environment and config) each call.
using SessionFactory = std::function<Result<std::unique_ptr<EnvSession>>()>;

ConformanceReport run_conformance(const SessionFactory& make_session, const ConformanceOptions& options);

// Arguments valid against `schema` for scripted calls (variant varies numbers and choices), or
// nullopt when none could be made.
std::optional<nlohmann::json> make_arguments(const nlohmann::json& schema, int variant);

}  // namespace odyssey::envs
