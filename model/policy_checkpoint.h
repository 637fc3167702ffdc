// A Policy's weights in and out of checkpoints (model/checkpoint.h): every named parameter and
// buffer of the module (the names model_tensors() documents) as one tensor of the checkpoint.
//
// save_policy writes the module's tensors in `options.dtype` with the caller's config JSON and
// stage metadata. load_policy checks the checkpoint against the module's own names, shapes and
// dtypes — every missing, unexpected or mismatched tensor is named in one error — and only then
// copies the weights in, so a failed load leaves the module untouched. Not thread-safe with a
// concurrent forward of the same module.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "model/checkpoint.h"
#include "model/policy.h"

namespace odyssey::model {

Status save_policy(Policy& policy, const std::string& dir, const nlohmann::json& config_json,
                   const CheckpointMeta& meta, const SaveOptions& options = {});

// Loads into `policy` (weights converted to each tensor's current dtype); returns what the
// checkpoint said about itself (config JSON, stage, provenance).
Result<CheckpointMeta> load_policy(Policy& policy, const std::string& dir, nlohmann::json* config_json = nullptr);

}  // namespace odyssey::model
