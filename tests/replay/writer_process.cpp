// A trajectory writer as its own process, for crash tests: writes `count` trajectories of
// `segments` segments with deterministic ids ((writer+1) << 32 | (i+1)) and exits 0 only
// once every one of them is acknowledged (durable).
//   replay_test_writer ENDPOINT WRITER COUNT SEGMENTS TOKENS [PACE_MS [GATE_FILE]]
// PACE_MS: pause between trajectories, like an actor waiting on its environment.
// GATE_FILE: the last trajectory waits until this file exists (at most 120 s), so that a test can
// crash the service while every writer is still running, however the writers are scheduled.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>

#include "replay/client.h"

using namespace odyssey;

int main(int argc, char** argv) {
  if (argc < 6 || argc > 8) {
    std::fprintf(stderr, "usage: %s ENDPOINT WRITER COUNT SEGMENTS TOKENS [PACE_MS [GATE_FILE]]\n", argv[0]);
    return 2;
  }
  const std::string endpoint = argv[1];
  const uint64_t writer = std::strtoull(argv[2], nullptr, 10);
  const uint64_t count = std::strtoull(argv[3], nullptr, 10);
  const uint32_t segments = static_cast<uint32_t>(std::strtoul(argv[4], nullptr, 10));
  const uint32_t tokens = static_cast<uint32_t>(std::strtoul(argv[5], nullptr, 10));
  const int pace_ms = argc >= 7 ? std::atoi(argv[6]) : 0;
  const std::string gate = argc == 8 ? argv[7] : "";
  replay::ClientOptions o;
  o.endpoint = endpoint;
  o.name = "writer-" + std::to_string(writer);
  o.ack_timeout_ms = 300;
  o.give_up_after_ms = 60000;
  auto w = replay::TrajectoryWriter::connect(o);
  if (!w.ok()) {
    std::fprintf(stderr, "connect: %s\n", w.status().to_string().c_str());
    return 1;
  }
  for (uint64_t i = 0; i < count; ++i) {
    if (pace_ms) std::this_thread::sleep_for(std::chrono::milliseconds(pace_ms));
    if (!gate.empty() && i + 1 == count) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
      while (!std::filesystem::exists(gate)) {
        if (std::chrono::steady_clock::now() > deadline) {
          std::fprintf(stderr, "gate %s never opened\n", gate.c_str());
          return 1;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
    replay::TrajectoryMeta meta;
    meta.id = ((writer + 1) << 32) | (i + 1);
    meta.job = "crash-test";
    meta.environment = "synthetic";
    meta.task = "task-" + std::to_string(i);
    meta.seed = i;
    auto id = (*w)->begin(meta);
    if (!id.ok()) {
      std::fprintf(stderr, "begin: %s\n", id.status().to_string().c_str());
      return 1;
    }
    for (uint32_t s = 0; s < segments; ++s) {
      SegmentData d;
      for (uint32_t t = 0; t < tokens; ++t) {
        d.tokens.push_back(static_cast<uint32_t>((i * 31 + s * 7 + t) % 256));
        d.logprobs.push_back(-0.5f);
        d.policy_versions.push_back(1);
        d.loss_mask.push_back(1);
      }
      Status st = (*w)->append(*id, d);
      if (!st.ok()) {
        std::fprintf(stderr, "append: %s\n", st.to_string().c_str());
        return 1;
      }
    }
    Status st = (*w)->end(*id, replay::Reward{static_cast<double>(i % 2), {{"correct", static_cast<double>(i % 2)}}});
    if (!st.ok()) {
      std::fprintf(stderr, "end: %s\n", st.to_string().c_str());
      return 1;
    }
  }
  Status st = (*w)->flush();
  if (!st.ok()) {
    std::fprintf(stderr, "flush: %s\n", st.to_string().c_str());
    return 1;
  }
  std::printf("acknowledged %lu trajectories (%lu segments acked, %lu resends, %lu reconnects)\n", count,
              (*w)->segments_acknowledged(), (*w)->resends(), (*w)->reconnects());
  return 0;
}
