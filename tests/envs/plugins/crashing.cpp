// Test plugin: a working echo environment whose `crash` tool dereferences a null pointer.
// An episode that only echoes completes normally: it ends when the turn's text says "done";
// the reward is the number of echoes. Hosted, `crash` must cost the host, not the actor.
#include <cstdint>
#include <string>

#include "odyssey/env_sdk.hpp"

namespace {

using nlohmann::json;

volatile uintptr_t null_address = 0;  // volatile: the compiler cannot prove the store faults

class Crashing : public odyssey::env::Environment {
 public:
  explicit Crashing(const json&) {
    add_tool({"echo", "Returns its text", {{"type", "object"}, {"properties", {{"text", {{"type", "string"}}}}},
                                          {"required", {"text"}}}},
             [this](const json& args) {
               ++echoes_;
               return args.at("text").get<std::string>();
             });
    add_tool({"crash", "Segfaults", {{"type", "object"}}}, [](const json&) -> std::string {
      *reinterpret_cast<volatile int*>(null_address) = 1;
      return "unreachable";
    });
  }
  odyssey::env::Observation reset(const json&, uint64_t seed) override {
    echoes_ = 0;
    odyssey::env::Observation obs;
    obs.text = "Echo something, then say done. Seed " + std::to_string(seed) + ".";
    return obs;
  }
  odyssey::env::Score score() override {
    odyssey::env::Score s;
    s.reward = double(echoes_);
    s.success = echoes_ > 0;
    s.parts = {{"echoes", double(echoes_)}};
    return s;
  }

 protected:
  void on_turn(const odyssey::env::Action& action, odyssey::env::Observation& obs) override {
    obs.done = action.text.find("done") != std::string::npos;
    obs.text = obs.done ? "Bye." : "Go on.";
  }

 private:
  int echoes_ = 0;
};

}  // namespace

ODY_ENV_PLUGIN(Crashing, "crashing", "1.0.0", "Echoes, or segfaults on request")
