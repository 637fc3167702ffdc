// Test plugin: tools that use up resources until a limit stops them.
//   allocate {"mib"}       mallocs and touches 1 MiB blocks, keeping them; reports how far it got
//   open_files {"count"}   opens /dev/null `count` times, keeping the descriptors
//   write_file {"path", "bytes"}  writes `bytes` zero bytes to a file
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "odyssey/env_sdk.hpp"

namespace {

using nlohmann::json;
using odyssey::env::ToolError;

json int_args(std::initializer_list<const char*> names) {
  json props = json::object();
  json required = json::array();
  for (const char* n : names) {
    props[n] = {{"type", "integer"}, {"minimum", 0}};
    required.push_back(n);
  }
  return {{"type", "object"}, {"properties", props}, {"required", required}};
}

class Leaking : public odyssey::env::Environment {
 public:
  explicit Leaking(const json&) {
    add_tool({"allocate", "Allocates and keeps memory", int_args({"mib"})}, [this](const json& args) {
      const int64_t mib = args.at("mib").get<int64_t>();
      for (int64_t i = 0; i < mib; ++i) {
        void* block = std::malloc(1 << 20);
        if (block == nullptr)
          throw ToolError("out of memory after " + std::to_string(i) + " MiB of " + std::to_string(mib));
        std::memset(block, 1, 1 << 20);
        blocks_.push_back(block);
      }
      return "allocated " + std::to_string(mib) + " MiB";
    });
    add_tool({"open_files", "Opens and keeps files", int_args({"count"})}, [this](const json& args) {
      const int64_t count = args.at("count").get<int64_t>();
      for (int64_t i = 0; i < count; ++i) {
        const int fd = ::open("/dev/null", O_RDONLY);
        if (fd < 0)
          throw ToolError("open failed after " + std::to_string(i) + " files: " + std::strerror(errno));
        fds_.push_back(fd);
      }
      return "opened " + std::to_string(count) + " files";
    });
    json write_schema = int_args({"bytes"});
    write_schema["properties"]["path"] = {{"type", "string"}};
    write_schema["required"].push_back("path");
    add_tool({"write_file", "Writes zero bytes to a file", write_schema}, [](const json& args) {
      const std::string path = args.at("path").get<std::string>();
      int64_t left = args.at("bytes").get<int64_t>();
      const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd < 0) throw ToolError(path + ": " + std::strerror(errno));
      std::vector<char> chunk(1 << 16, 0);
      while (left > 0) {
        const ssize_t n = ::write(fd, chunk.data(), size_t(std::min<int64_t>(left, int64_t(chunk.size()))));
        if (n < 0) {
          const int e = errno;
          ::close(fd);
          throw ToolError(path + ": " + std::strerror(e));
        }
        left -= n;
      }
      ::close(fd);
      return std::string("written");
    });
  }
  ~Leaking() override {
    for (void* b : blocks_) std::free(b);
    for (int fd : fds_) ::close(fd);
  }
  odyssey::env::Observation reset(const json&, uint64_t) override {
    odyssey::env::Observation obs;
    obs.text = "Use something up.";
    return obs;
  }
  odyssey::env::Score score() override { return {}; }

 private:
  std::vector<void*> blocks_;
  std::vector<int> fds_;
};

}  // namespace

ODY_ENV_PLUGIN(Leaking, "leaking", "1.0.0", "Uses up memory, files and descriptors on request")
