#include "learner/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "model/durable_file.h"
#include "model/policy_checkpoint.h"
#include "model/safetensors.h"

namespace odyssey::learner {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr char kPrefix[] = "step-";
constexpr char kPolicyDir[] = "policy";
constexpr char kStateFile[] = "state.safetensors";
constexpr char kJsonFile[] = "learner.json";

// The step of a folder named step-<8+ digits>, or -1.
int64_t step_of(const std::string& name) {
  if (name.rfind(kPrefix, 0) != 0) return -1;
  const std::string digits = name.substr(sizeof(kPrefix) - 1);
  if (digits.size() < 8 || digits.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoll(digits);
}

bool is_complete(const fs::path& dir) {
  std::error_code ec;
  return fs::exists(dir / model::kCheckpointCompleteFile, ec);
}

Status fs_error(const std::string& what, const fs::path& path, const std::error_code& ec) {
  return make_status(StatusCode::kIo, "learner checkpoint: {} {}: {}", what, path.string(), ec.message());
}

// Checkpoint folders under root, by step: (step, path, complete).
struct Entry {
  int64_t step;
  fs::path path;
  bool complete;
};
std::vector<Entry> scan(const std::string& root) {
  std::vector<Entry> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const int64_t step = step_of(e.path().filename().string());
    if (step >= 0 && e.is_directory(ec)) out.push_back({step, e.path(), is_complete(e.path())});
  }
  std::sort(out.begin(), out.end(), [](const Entry& a, const Entry& b) { return a.step < b.step; });
  return out;
}

void prune(const std::string& root, int keep) {
  std::vector<Entry> entries = scan(root);
  int64_t newest_complete = -1;
  int complete = 0;
  for (const Entry& e : entries) {
    if (e.complete) {
      newest_complete = std::max(newest_complete, e.step);
      ++complete;
    }
  }
  std::error_code ec;
  int to_remove = complete - std::max(1, keep);
  for (const Entry& e : entries) {
    if (e.complete && to_remove > 0) {
      fs::remove_all(e.path, ec);
      --to_remove;
    } else if (!e.complete && e.step < newest_complete) {
      fs::remove_all(e.path, ec);  // a crashed save that a later one superseded
    }
  }
  // Stale temporary folders of crashed saves (any pid: only one learner writes here).
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(".step-", 0) == 0 && name.find(".tmp-") != std::string::npos) fs::remove_all(e.path(), ec);
  }
}

}  // namespace

std::string checkpoint_dir(const std::string& root, int64_t step) {
  return fmt::format("{}/{}{:08d}", root, kPrefix, step);
}

Status save_learner_checkpoint(const std::string& root, model::Policy& policy, const LearnerState& state,
                               const json& config_json, const model::CheckpointMeta& meta, int keep) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return fs_error("cannot create", root, ec);
  const fs::path final_dir = checkpoint_dir(root, state.step);
  if (fs::exists(final_dir, ec)) {
    if (is_complete(final_dir)) return Status::Ok();  // this step is already saved
    fs::remove_all(final_dir, ec);                   // a crashed save of this step
    if (ec) return fs_error("cannot remove the incomplete", final_dir, ec);
  }
  const fs::path tmp = fs::path(root) / fmt::format(".{}{:08d}.tmp-{}", kPrefix, state.step, ::getpid());
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) return fs_error("cannot create", tmp, ec);

  // Weights, in their own dtype (bit-exact).
  model::SaveOptions so;
  so.dtype = policy->parameters().front().scalar_type();
  if (so.dtype != at::kFloat && so.dtype != at::kBFloat16 && so.dtype != at::kHalf)
    return invalid_argument("learner checkpoint: weights in {} cannot be saved (fp32, bf16 or fp16)",
                            c10::toString(so.dtype));
  ODY_RETURN_IF_ERROR(model::save_policy(policy, (tmp / kPolicyDir).string(), config_json, meta, so));

  // Optimizer, balancers, RNG.
  std::map<std::string, at::Tensor> tensors;
  for (const auto& [name, t] : state.optimizer) tensors["optimizer." + name] = t;
  for (size_t i = 0; i < state.balancer_biases.size(); ++i)
    tensors[fmt::format("balancer.{}.bias", i)] = state.balancer_biases[i];
  if (state.rng_state.defined()) tensors["rng.cpu"] = state.rng_state;
  ODY_RETURN_IF_ERROR(model::write_safetensors((tmp / kStateFile).string(), tensors, {{"format", "odyssey.learner/1"}}));

  json j;
  j["format"] = "odyssey.learner/1";
  j["step"] = state.step;
  j["version"] = state.version;
  j["replay_cursor"] = state.replay_cursor;
  j["optimizer_steps"] = state.optimizer_steps;
  j["balancer_steps"] = state.balancer_steps;
  j["trajectories_trained"] = state.trajectories_trained;
  j["trajectory_id_sum"] = state.trajectory_id_sum;
  j["tokens_trained"] = state.tokens_trained;
  j["provenance"] = state.provenance;
  ODY_RETURN_IF_ERROR(model::write_file_durably((tmp / kJsonFile).string(), j.dump(2) + "\n"));
  ODY_RETURN_IF_ERROR(model::sync_directory(tmp.string()));

  fs::rename(tmp, final_dir, ec);
  if (ec) return fs_error("cannot rename " + tmp.string() + " to", final_dir, ec);
  ODY_RETURN_IF_ERROR(model::sync_directory(root));
  ODY_RETURN_IF_ERROR(model::write_file_durably((final_dir / model::kCheckpointCompleteFile).string(), ""));
  prune(root, keep);
  return Status::Ok();
}

std::vector<std::string> list_checkpoints(const std::string& root) {
  std::vector<std::string> out;
  for (const Entry& e : scan(root))
    if (e.complete) out.push_back(e.path.string());
  return out;
}

std::optional<std::string> latest_checkpoint(const std::string& root) {
  auto all = list_checkpoints(root);
  if (all.empty()) return std::nullopt;
  return all.back();
}

Result<LearnerState> load_learner_checkpoint(const std::string& dir, model::Policy& policy) {
  const fs::path path(dir);
  if (!is_complete(path))
    return make_status(StatusCode::kNotFound, "learner checkpoint {} is missing or incomplete (no COMPLETE)", dir);
  std::ifstream in(path / kJsonFile);
  if (!in) return make_status(StatusCode::kCorrupt, "learner checkpoint {}: cannot read {}", dir, kJsonFile);
  std::stringstream text;
  text << in.rdbuf();
  LearnerState s;
  try {
    const json j = json::parse(text.str());
    s.step = j.at("step").get<int64_t>();
    s.version = j.at("version").get<uint32_t>();
    s.replay_cursor = j.at("replay_cursor").get<uint64_t>();
    s.optimizer_steps = j.at("optimizer_steps").get<int64_t>();
    s.balancer_steps = j.at("balancer_steps").get<std::vector<int64_t>>();
    s.trajectories_trained = j.at("trajectories_trained").get<uint64_t>();
    s.trajectory_id_sum = j.at("trajectory_id_sum").get<uint64_t>();
    s.tokens_trained = j.at("tokens_trained").get<uint64_t>();
    s.provenance = j.value("provenance", json());
  } catch (const json::exception& e) {
    return make_status(StatusCode::kCorrupt, "learner checkpoint {}/{}: {}", dir, kJsonFile, e.what());
  }
  ODY_ASSIGN_OR_RETURN(auto file, model::read_safetensors((path / kStateFile).string()));
  for (auto& [name, t] : file.tensors) {
    if (name.rfind("optimizer.", 0) == 0) {
      s.optimizer[name.substr(10)] = t;
    } else if (name == "rng.cpu") {
      s.rng_state = t;
    }
  }
  for (size_t i = 0; i < s.balancer_steps.size(); ++i) {
    auto it = file.tensors.find(fmt::format("balancer.{}.bias", i));
    if (it == file.tensors.end())
      return make_status(StatusCode::kCorrupt, "learner checkpoint {}/{}: missing balancer.{}.bias", dir, kStateFile, i);
    s.balancer_biases.push_back(it->second);
  }
  auto meta = model::load_policy(policy, (path / kPolicyDir).string());
  if (!meta.ok()) return meta.status().with_context(fmt::format("learner checkpoint {}", dir));
  return s;
}

}  // namespace odyssey::learner
