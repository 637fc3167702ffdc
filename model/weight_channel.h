// Versioned policy weights from the learner to actors (ARCHITECTURE.md: "weights, versioned").
//
// The learner publishes version N as a policy checkpoint (model/policy_checkpoint.h) in
//   <dir>/v<N, 8 digits>/          written by save_checkpoint: temp folder, fsync, COMPLETE, rename
//   <dir>/LATEST                   "<N>\n", replaced atomically after the folder is complete
// and removes versions older than the newest `keep`. Actors poll LATEST (cheap: one small read,
// at most every poll interval) and load a newer version between tokens. Versions only grow: a
// restarted learner publishes from its checkpointed version on, and an actor never goes back.
// A shared folder works on one machine or a shared filesystem; a GPU cluster would broadcast
// over NCCL instead (issue 6), behind the same two classes.
//
// Errors: publish returns kIo/kInvalidArgument from the checkpoint writer; latest() returns
// nullopt while nothing is published; load() of a version that was removed meanwhile (the
// actor fell `keep` versions behind) is kNotFound, and the caller polls again.
//
// Thread-safety: one publisher per folder; any number of subscribers, each used by one thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "model/checkpoint.h"
#include "model/policy.h"

namespace odyssey::model {

class WeightPublisher {
 public:
  // `config_json` is stored with every version (what load_model_config produced, as JSON).
  WeightPublisher(std::string dir, nlohmann::json config_json, at::ScalarType dtype = at::kFloat, int keep = 3);
  // Writes `policy`'s weights as `version` (must be greater than the last one published by
  // anyone into this folder) and makes it the latest.
  Status publish(Policy& policy, uint32_t version, const nlohmann::json& provenance = nullptr);
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  nlohmann::json config_json_;
  at::ScalarType dtype_;
  int keep_;
};

class WeightSubscriber {
 public:
  explicit WeightSubscriber(std::string dir, std::chrono::milliseconds poll_interval = std::chrono::milliseconds(200));
  // The newest published version, read from LATEST at most once per poll interval (force:
  // read now); nullopt before the first publication.
  std::optional<uint32_t> latest(bool force = false);
  // Loads `version` into `policy` (shapes and names checked first; the policy is untouched on
  // error).
  Status load(Policy& policy, uint32_t version);
  // If a version newer than `current` is published, loads it and returns it; else returns
  // `current` unchanged. Errors of a load are returned (the policy keeps its weights).
  Result<uint32_t> refresh(Policy& policy, uint32_t current, bool force = false);
  std::string version_dir(uint32_t version) const;

 private:
  std::string dir_;
  std::chrono::milliseconds poll_interval_;
  bool polled_ = false;  // whether LATEST was read yet (last_poll_ is meaningless before)
  std::chrono::steady_clock::time_point last_poll_{};
  std::optional<uint32_t> latest_;
};

// "<dir>/v00000012".
std::string weight_version_dir(const std::string& dir, uint32_t version);

}  // namespace odyssey::model
