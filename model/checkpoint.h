// Policy checkpoints: sharded safetensors in the Hugging Face layout, plus the model config and
// the context stage the weights were trained to.
//
// A checkpoint is a folder:
//   model.safetensors.index.json   {"metadata": {"total_size": <sum of tensor bytes>,
//                                    "stage": "64K", "provenance": {...}},
//                                   "weight_map": {tensor name: shard file name}}
//   model-00001-of-0000K.safetensors ...   the shards; each shard's __metadata__ holds
//                                   {"format": "pt", "stage": <stage>} (what transformers expects)
//   config.json                    the model config, as given
//   stage.json                     {"stage": "64K", "provenance": {...}}
//   COMPLETE                       written last; a folder without it is refused
//
// Saving shards tensors in name order, starting a new shard when the next tensor would take the
// current one past `max_shard_bytes` (a tensor larger than that gets a shard of its own), the
// algorithm transformers uses. Floating tensors are stored in `SaveOptions::dtype` (bf16, fp16 or
// fp32); integer and bool tensors are stored as they are. Everything is written to
// `<dir>.tmp-<pid>`, fsynced, COMPLETE last, then the folder is renamed to `dir`: a crash leaves
// either no `dir` or a complete one (plus a stale .tmp-<pid> folder, which nothing loads).
//
// Loading first checks the folder (COMPLETE, index, stage, every shard header) against what the
// model expects, before reading any tensor data. All missing tensors, unexpected tensors and
// shape or dtype mismatches are reported together in one kInvalidArgument error, one line each.
// Dtype rule: a floating tensor converts to the dtype the model asks for (or
// LoadOptions::dtype); an integer or bool tensor must be stored in exactly the expected dtype.
// A damaged shard is a kCorrupt error naming the shard file and the tensor. A tensor saved in
// its own dtype loads bit-exact.
//
// Errors: kNotFound (no such folder), kFailedPrecondition (no COMPLETE marker),
// kAlreadyExists (save to an existing folder without `overwrite`), kInvalidArgument (bad
// options, model mismatch), kCorrupt (index, stage or shard malformed or disagreeing), kIo.
//
// Thread-safety: reentrant. Concurrent saves to the same `dir` are not supported.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "core/status.h"
#include "model/safetensors.h"

namespace odyssey::model {

inline constexpr char kCheckpointIndexFile[] = "model.safetensors.index.json";
inline constexpr char kCheckpointConfigFile[] = "config.json";
inline constexpr char kCheckpointStageFile[] = "stage.json";
inline constexpr char kCheckpointCompleteFile[] = "COMPLETE";

// What a checkpoint records about how it was made.
struct CheckpointMeta {
  // The context stage the weights were trained to: a positive count with a K or M suffix,
  // "8K", "64K", "256K", "1M" (MODEL.md, "Checkpoints and stages").
  std::string stage;
  // Free-form JSON: steps, data, parent checkpoint, git commit...; null when none.
  nlohmann::json provenance;
};

struct SaveOptions {
  at::ScalarType dtype = at::kBFloat16;  // floating tensors: kBFloat16, kHalf or kFloat
  uint64_t max_shard_bytes = 5'000'000'000;  // transformers' default "5GB"
  bool overwrite = false;  // replace an existing `dir` (not atomic: the old one is removed)
};

// What the model holds under one name.
struct TensorSpec {
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
};

struct LoadOptions {
  // When set, floating tensors load in this dtype instead of the one in their TensorSpec
  // (an actor holding bf16 weights loads a checkpoint whose model expects fp32).
  std::optional<at::ScalarType> dtype;
};

struct LoadedCheckpoint {
  std::map<std::string, at::Tensor> tensors;  // CPU, contiguous, in the requested dtypes
  nlohmann::json config;
  CheckpointMeta meta;
};

// A checkpoint's description, from its JSON files and shard headers (no tensor data read).
struct CheckpointInfo {
  struct Entry {
    std::string shard;  // file name inside the folder
    TensorInfo info;    // as stored
  };
  std::map<std::string, Entry> tensors;
  std::vector<std::string> shards;  // file names, in order
  uint64_t total_size = 0;          // sum of stored tensor bytes
  nlohmann::json config;
  CheckpointMeta meta;
};

// kInvalidArgument unless `stage` is a positive count followed by K or M ("64K", "1M").
Status validate_stage(const std::string& stage);

Status save_checkpoint(const std::string& dir, const std::map<std::string, at::Tensor>& tensors,
                       const nlohmann::json& config_json, const CheckpointMeta& meta,
                       const SaveOptions& options = {});

// Reads a complete checkpoint's index, config, stage and shard headers, and checks they agree.
Result<CheckpointInfo> inspect_checkpoint(const std::string& dir);

Result<LoadedCheckpoint> load_checkpoint(const std::string& dir, const std::map<std::string, TensorSpec>& expected,
                                         const LoadOptions& options = {});

}  // namespace odyssey::model
