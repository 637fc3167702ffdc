// Test plugin: tools that try to get out of the sandbox.
//   spawn {}            forks a child that sleeps forever; returns the child's pid
//   connect {"port"}    connects to 127.0.0.1:port over TCP; "connected" or the error
//   getenv {"name"}     the value of an environment variable, or an error when unset
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "odyssey/env_sdk.hpp"

namespace {

using nlohmann::json;
using odyssey::env::ToolError;

class Forking : public odyssey::env::Environment {
 public:
  explicit Forking(const json&) {
    add_tool({"spawn", "Forks a sleeping child", {{"type", "object"}}}, [](const json&) {
      const pid_t pid = ::fork();
      if (pid < 0) throw ToolError(std::string("fork: ") + std::strerror(errno));
      if (pid == 0) {
        for (;;) ::pause();
      }
      return std::to_string(pid);
    });
    add_tool({"connect", "Connects to a local TCP port",
              {{"type", "object"}, {"properties", {{"port", {{"type", "integer"}}}}}, {"required", {"port"}}}},
             [](const json& args) {
               const int s = ::socket(AF_INET, SOCK_STREAM, 0);
               if (s < 0) throw ToolError(std::string("socket: ") + std::strerror(errno));
               sockaddr_in addr{};
               addr.sin_family = AF_INET;
               addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
               addr.sin_port = htons(uint16_t(args.at("port").get<int>()));
               const int rc = ::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
               const int e = errno;
               ::close(s);
               if (rc != 0) throw ToolError(std::string("connect: ") + std::strerror(e));
               return std::string("connected");
             });
    add_tool({"getenv", "Reads an environment variable",
              {{"type", "object"}, {"properties", {{"name", {{"type", "string"}}}}}, {"required", {"name"}}}},
             [](const json& args) {
               const char* v = std::getenv(args.at("name").get<std::string>().c_str());
               if (v == nullptr) throw ToolError("unset");
               return std::string(v);
             });
  }
  odyssey::env::Observation reset(const json&, uint64_t) override {
    odyssey::env::Observation obs;
    obs.text = "Try to get out.";
    return obs;
  }
  odyssey::env::Score score() override { return {}; }
};

}  // namespace

ODY_ENV_PLUGIN(Forking, "forking", "1.0.0", "Forks, connects and reads the environment on request")
