// Test plugin: an environment that breaks the seeded-determinism contract. Its prompt and
// hidden word come from a counter that survives reset, so the same task and seed give a
// different episode each time. The conformance suite must FAIL it with a readable reason.
#include <string>

#include <nlohmann/json.hpp>

#include "odyssey/env_sdk.hpp"

namespace {

int g_resets = 0;  // process-wide on purpose: the bug under test

class Nondeterministic : public odyssey::env::Environment {
 public:
  explicit Nondeterministic(const nlohmann::json&) {
    add_tool({"peek", "Shows one letter of the hidden word",
              {{"type", "object"}, {"properties", {{"i", {{"type", "integer"}, {"minimum", 0}}}}}, {"required", {"i"}}}},
             [this](const nlohmann::json& args) {
               const size_t i = args["i"].get<size_t>();
               if (i >= word_.size()) throw odyssey::env::ToolError("i is past the end of the word");
               return std::string(1, word_[i]);
             });
  }
  odyssey::env::Observation reset(const nlohmann::json&, uint64_t seed) override {
    word_ = "word" + std::to_string(seed) + "-" + std::to_string(++g_resets);
    turns_ = 0;
    odyssey::env::Observation obs;
    obs.text = "Puzzle #" + std::to_string(g_resets) + ": guess the hidden word.";
    return obs;
  }
  odyssey::env::Score score() override { return {0.0, false, {}, {{"word", word_}}}; }

 protected:
  void on_turn(const odyssey::env::Action&, odyssey::env::Observation& obs) override {
    obs.done = ++turns_ >= 3;
  }

 private:
  std::string word_;
  int turns_ = 0;
};

}  // namespace

ODY_ENV_PLUGIN(Nondeterministic, "nondeterministic", "0.1.0", "Breaks seeded determinism (a test plugin)")
