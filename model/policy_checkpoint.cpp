#include "model/policy_checkpoint.h"

#include <torch/types.h>

namespace odyssey::model {

namespace {

// Every parameter and buffer by its dotted name.
std::map<std::string, at::Tensor> named_tensors(Policy& policy) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : policy->named_parameters(/*recurse=*/true)) out[p.key()] = p.value();
  for (const auto& b : policy->named_buffers(/*recurse=*/true)) out[b.key()] = b.value();
  return out;
}

}  // namespace

Status save_policy(Policy& policy, const std::string& dir, const nlohmann::json& config_json,
                   const CheckpointMeta& meta, const SaveOptions& options) {
  torch::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> tensors;
  for (const auto& [name, t] : named_tensors(policy)) tensors[name] = t.detach();
  return save_checkpoint(dir, tensors, config_json, meta, options);
}

Result<CheckpointMeta> load_policy(Policy& policy, const std::string& dir, nlohmann::json* config_json) {
  auto targets = named_tensors(policy);
  std::map<std::string, TensorSpec> expected;
  for (const auto& [name, t] : targets) {
    expected[name] = TensorSpec{std::vector<int64_t>(t.sizes().begin(), t.sizes().end()), t.scalar_type()};
  }
  ODY_ASSIGN_OR_RETURN(auto loaded, load_checkpoint(dir, expected));
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : targets) t.copy_(loaded.tensors.at(name));
  if (config_json) *config_json = loaded.config;
  return loaded.meta;
}

}  // namespace odyssey::model
