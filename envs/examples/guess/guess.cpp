// Example environment plugin: guess the hidden number.
//
// The environment picks an integer in [low, high] (from the task, or drawn from the seed) and
// the model finds it with one tool, `guess`, which answers "higher", "lower" or "correct".
// The episode ends when the number is found or the guesses run out; a turn without a guess
// uses one up, so every episode ends. Score: success when found; reward 1 for a first-try hit,
// falling linearly to 0.5 for a hit on the last allowed guess, 0 when not found.
//
// Config (all optional): {"low": 1, "high": 100, "max_guesses": 10}.
// Task: {} (draw the number from the seed) or {"target": 42}.
//
// It is the plugin docs/plugins.md walks through: copy this file to start your own.
#include <cstdint>
#include <random>
#include <string>

#include <nlohmann/json.hpp>

#include "odyssey/env_sdk.hpp"

namespace {

using nlohmann::json;
using odyssey::env::EnvError;
using odyssey::env::ToolError;

// Reads an optional integer key of a config or task object; names the key when it is wrong.
int64_t int_key(const json& object, const char* key, int64_t fallback, ody_env_status status) {
  auto it = object.find(key);
  if (it == object.end()) return fallback;
  if (!it->is_number_integer()) throw EnvError(status, std::string("'") + key + "' must be an integer");
  return it->get<int64_t>();
}

class Guess : public odyssey::env::Environment {
 public:
  explicit Guess(const json& config)
      : low_(int_key(config, "low", 1, ODY_ENV_ERR_INVALID_CONFIG)),
        high_(int_key(config, "high", 100, ODY_ENV_ERR_INVALID_CONFIG)),
        max_guesses_(int_key(config, "max_guesses", 10, ODY_ENV_ERR_INVALID_CONFIG)) {
    for (const auto& [key, value] : config.items()) {
      if (key != "low" && key != "high" && key != "max_guesses")
        throw EnvError(ODY_ENV_ERR_INVALID_CONFIG, "unknown config key '" + key + "' (known: low, high, max_guesses)");
    }
    if (low_ > high_) throw EnvError(ODY_ENV_ERR_INVALID_CONFIG, "'low' must not be greater than 'high'");
    if (max_guesses_ < 1) throw EnvError(ODY_ENV_ERR_INVALID_CONFIG, "'max_guesses' must be at least 1");
    add_tool({"guess", "Guess the hidden number; answers higher, lower or correct",
              {{"type", "object"},
               {"properties", {{"n", {{"type", "integer"}, {"description", "your guess"}}}}},
               {"required", {"n"}},
               {"additionalProperties", false}}},
             [this](const json& args) { return guess(args.at("n").get<int64_t>()); });
  }

  odyssey::env::Observation reset(const json& task, uint64_t seed) override {
    for (const auto& [key, value] : task.items()) {
      if (key != "target") throw EnvError(ODY_ENV_ERR_INVALID_TASK, "unknown task key '" + key + "' (known: target)");
    }
    if (task.contains("target")) {
      target_ = int_key(task, "target", 0, ODY_ENV_ERR_INVALID_TASK);
      if (target_ < low_ || target_ > high_)
        throw EnvError(ODY_ENV_ERR_INVALID_TASK, "'target' must lie in [" + std::to_string(low_) + ", " +
                                                     std::to_string(high_) + "]");
    } else {
      std::mt19937_64 rng(seed);
      target_ = std::uniform_int_distribution<int64_t>(low_, high_)(rng);
    }
    used_ = 0;
    found_ = false;
    done_ = false;
    odyssey::env::Observation obs;
    obs.text = "I am thinking of an integer between " + std::to_string(low_) + " and " + std::to_string(high_) +
               ". Find it with the guess tool; you have " + std::to_string(max_guesses_) + " guesses.";
    return obs;
  }

  odyssey::env::Observation step(const odyssey::env::Action& action) override {
    if (done_) throw EnvError(ODY_ENV_ERR_INVALID_ACTION, "the episode is over; call score");
    return Environment::step(action);
  }

  odyssey::env::Score score() override {
    odyssey::env::Score s;
    s.success = found_;
    const double efficiency = max_guesses_ == 1 ? 1.0 : 1.0 - 0.5 * double(used_ - 1) / double(max_guesses_ - 1);
    s.reward = found_ ? efficiency : 0.0;
    s.parts = {{"found", found_ ? 1.0 : 0.0}, {"efficiency", found_ ? efficiency : 0.0}};
    s.info = {{"target", target_}, {"guesses", used_}};
    return s;
  }

  std::string snapshot() override {
    return json{{"target", target_}, {"used", used_}, {"found", found_}, {"done", done_}}.dump();
  }
  void restore(std::string_view bytes) override {
    const json state = json::parse(bytes);  // a parse error becomes ODY_ENV_ERR_UNSUPPORTED
    target_ = state.at("target").get<int64_t>();
    used_ = state.at("used").get<int64_t>();
    found_ = state.at("found").get<bool>();
    done_ = state.at("done").get<bool>();
    if (target_ < low_ || target_ > high_ || used_ < 0 || used_ > max_guesses_)
      throw EnvError(ODY_ENV_ERR_UNSUPPORTED, "snapshot does not fit this config");
  }

 protected:
  void on_turn(const odyssey::env::Action& action, odyssey::env::Observation& obs) override {
    if (action.tool_calls.empty() && !found_) {
      ++used_;  // a turn without a guess still costs one, so every episode ends
      obs.text = "You made no guess. Call the guess tool with {\"n\": <integer>}.";
    }
    if (found_) {
      done_ = true;
      obs.text = "You found it in " + std::to_string(used_) + (used_ == 1 ? " guess." : " guesses.");
    } else if (used_ >= max_guesses_) {
      done_ = true;
      obs.text = "Out of guesses; the number was " + std::to_string(target_) + ".";
    }
    obs.done = done_;
  }

 private:
  std::string guess(int64_t n) {
    if (found_) throw ToolError("you already found the number");
    if (used_ >= max_guesses_) throw ToolError("no guesses left");
    if (n < low_ || n > high_)
      throw ToolError("n must lie in [" + std::to_string(low_) + ", " + std::to_string(high_) + "]; this guess is not counted");
    ++used_;
    if (n == target_) {
      found_ = true;
      return "correct";
    }
    return n < target_ ? "higher" : "lower";
  }

  int64_t low_, high_, max_guesses_;
  int64_t target_ = 0;
  int64_t used_ = 0;
  bool found_ = false;
  bool done_ = false;
};

}  // namespace

ODY_ENV_PLUGIN_WITH_SNAPSHOT(Guess, "guess", "1.0.0", "Guess the hidden number with higher/lower hints")
