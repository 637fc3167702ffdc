// Helpers for learner tests: a real replay service on loopback (in this process, on its own
// thread, with a real RocksDB store), synthetic GRPO groups made of tokens sampled from the tiny
// policy (with their true sampling log-probs), and small trainer options.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/status.h"
#include "learner/trainer.h"
#include "model/policy.h"
#include "replay/service.h"

namespace odyssey::testing {

std::string tiny_model_config();

// The replay service with the group_complete sampler, listening on a free loopback port.
class InProcessReplay {
 public:
  explicit InProcessReplay(const std::string& dir);
  ~InProcessReplay();
  const std::string& endpoint() const { return endpoint_; }

 private:
  std::unique_ptr<replay::ReplayService> service_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::string endpoint_;
};

struct SyntheticTrajectory {
  uint64_t id = 0;
  std::vector<uint32_t> tokens;
  std::vector<float> logprobs;
  std::vector<uint8_t> loss_mask;
  double reward = 0;
};

struct SyntheticGroup {
  uint64_t group_id = 0;
  std::vector<SyntheticTrajectory> members;
};

// `groups` groups of `size` trajectories: a prompt of `prompt` random tokens (loss mask 0) shared
// by the group, then `generated` tokens sampled from `policy` at temperature 1 (loss mask 1, their
// log-probs recorded). Reward = the fraction of generated tokens below 128, with a "correct" part
// 1 when that fraction is above one half. Ids are (id_base + g) << 8 | member + 1.
std::vector<SyntheticGroup> sample_groups_from(model::Policy& policy, int groups, int size, int prompt, int generated,
                                               uint64_t seed, uint64_t id_base = 1);

// Writes the groups (segments of `segment_tokens` tokens, policy version 1) and waits for every
// acknowledgement.
Status write_groups(const std::string& endpoint, const std::vector<SyntheticGroup>& groups, uint32_t segment_tokens = 16);

// A tiny policy's random weights saved as a stage checkpoint under `dir` (the job's policy.init).
std::string save_init_checkpoint(const std::string& dir, uint64_t seed);

// Options of a small CPU learner: groups_per_step 2, chunk_tokens 64, lr 1e-3, one thread.
learner::TrainerOptions small_trainer_options(const std::string& out_dir, const std::string& endpoint,
                                              const std::string& init);

}  // namespace odyssey::testing
