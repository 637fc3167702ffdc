// Learner checkpoints: everything a learner needs to continue exactly where it was.
//
//   <root>/step-<8 digits>/
//     policy/                  the weights (model/policy_checkpoint.h; in their own dtype, so the
//                              round trip is bit-exact), with the model config and stage
//     state.safetensors        AdamW moments and per-parameter step counts ("optimizer.*"),
//                              MoE balancer biases ("balancer.<layer>.bias"), the CPU RNG state
//                              ("rng.cpu", uint8)
//     learner.json             step, published version, replay cursor, balancer update counts,
//                              optimizer step count, cumulative trained-trajectory accounting,
//                              and free-form provenance
//     COMPLETE                 written last
//
// Saving writes everything into <root>/.step-<N>.tmp-<pid>, fsyncs every file and the folder,
// renames it to step-<N>, fsyncs <root>, then writes COMPLETE (fsynced). A crash at any point
// leaves either no step-<N>, a step-<N> without COMPLETE (ignored by loading, replaced by the
// next save of that step, removed by pruning), or a complete one. After a successful save the
// newest `keep` complete checkpoints are kept; older ones, incomplete ones older than the newest
// complete one, and stale temporary folders are removed.
//
// Errors: kIo naming the path and system call; loading: kNotFound (no complete checkpoint),
// kCorrupt / kInvalidArgument from the checkpoint readers (naming the file and tensor).
// Thread-safety: one writer per root (rank 0 of a job); readers any time.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include "core/status.h"
#include "model/checkpoint.h"
#include "model/policy.h"

namespace odyssey::learner {

struct LearnerState {
  int64_t step = 0;                 // optimizer steps completed
  uint32_t version = 0;             // last weight version published
  uint64_t replay_cursor = 0;       // every delivery up to this one is trained on (commit it)
  int64_t optimizer_steps = 0;
  std::map<std::string, at::Tensor> optimizer;     // AdamW::state()
  std::vector<at::Tensor> balancer_biases;         // one per MoE layer, moe_layers() order
  std::vector<int64_t> balancer_steps;
  at::Tensor rng_state;                            // CPU generator state (uint8)
  uint64_t trajectories_trained = 0;               // cumulative over the job
  uint64_t trajectory_id_sum = 0;                  // Σ ids trained, mod 2^64 (an exactly-once check)
  uint64_t tokens_trained = 0;
  nlohmann::json provenance;                       // free-form (config, init checkpoint, ...)
};

// "<root>/step-00000042".
std::string checkpoint_dir(const std::string& root, int64_t step);

// Writes the checkpoint of `state.step` (see above) and prunes to `keep`. `config_json` and
// `meta` go into the policy folder (meta.stage: the stage the job started from).
Status save_learner_checkpoint(const std::string& root, model::Policy& policy, const LearnerState& state,
                               const nlohmann::json& config_json, const model::CheckpointMeta& meta, int keep);

// The newest complete checkpoint folder under `root`, or nullopt.
std::optional<std::string> latest_checkpoint(const std::string& root);
// Complete checkpoints under root, oldest first.
std::vector<std::string> list_checkpoints(const std::string& root);

// Loads `dir` into `policy` (names, shapes, dtypes checked first) and returns the rest.
Result<LearnerState> load_learner_checkpoint(const std::string& dir, model::Policy& policy);

}  // namespace odyssey::learner
