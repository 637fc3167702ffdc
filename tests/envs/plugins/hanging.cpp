// Test plugin: an echo environment whose `spin` tool loops forever burning CPU and whose
// `sleep` tool blocks for the given seconds. Hosted, a call that never returns must time out
// (or hit the CPU limit) and the host must be killed.
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

#include "odyssey/env_sdk.hpp"

namespace {

using nlohmann::json;

class Hanging : public odyssey::env::Environment {
 public:
  explicit Hanging(const json&) {
    add_tool({"echo", "Returns its text", {{"type", "object"}, {"properties", {{"text", {{"type", "string"}}}}},
                                          {"required", {"text"}}}},
             [](const json& args) { return args.at("text").get<std::string>(); });
    add_tool({"spin", "Loops forever", {{"type", "object"}}}, [](const json&) -> std::string {
      for (volatile uint64_t i = 0;; i = i + 1) {
      }
    });
    add_tool({"sleep", "Sleeps", {{"type", "object"}, {"properties", {{"seconds", {{"type", "number"}}}}},
                                  {"required", {"seconds"}}}},
             [](const json& args) {
               std::this_thread::sleep_for(std::chrono::duration<double>(args.at("seconds").get<double>()));
               return std::string("slept");
             });
  }
  odyssey::env::Observation reset(const json&, uint64_t) override {
    odyssey::env::Observation obs;
    obs.text = "Call a tool.";
    return obs;
  }
  odyssey::env::Score score() override { return {}; }
};

}  // namespace

ODY_ENV_PLUGIN(Hanging, "hanging", "1.0.0", "Echoes, spins forever or sleeps on request")
