#include "model/weight_channel.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include <fmt/format.h>

#include "model/durable_file.h"
#include "model/policy_checkpoint.h"

namespace odyssey::model {

namespace fs = std::filesystem;

namespace {

std::optional<uint32_t> read_latest(const std::string& dir) {
  std::ifstream in(dir + "/LATEST");
  if (!in) return std::nullopt;
  uint64_t v = 0;
  if (!(in >> v) || v > UINT32_MAX) return std::nullopt;
  return static_cast<uint32_t>(v);
}

// Versions present in `dir` (complete or not), ascending.
std::set<uint32_t> versions_in(const std::string& dir) {
  std::set<uint32_t> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() == 9 && name[0] == 'v' && name.find_first_not_of("0123456789", 1) == std::string::npos) {
      out.insert(static_cast<uint32_t>(std::stoul(name.substr(1))));
    }
  }
  return out;
}

}  // namespace

std::string weight_version_dir(const std::string& dir, uint32_t version) {
  return fmt::format("{}/v{:08d}", dir, version);
}

WeightPublisher::WeightPublisher(std::string dir, nlohmann::json config_json, at::ScalarType dtype, int keep)
    : dir_(std::move(dir)), config_json_(std::move(config_json)), dtype_(dtype), keep_(std::max(1, keep)) {}

Status WeightPublisher::publish(Policy& policy, uint32_t version, const nlohmann::json& provenance) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) return make_status(StatusCode::kIo, "weights: cannot create {}: {}", dir_, ec.message());
  if (const auto latest = read_latest(dir_); latest && *latest >= version) {
    return invalid_argument("weights: version {} is not newer than the published {} in {}", version, *latest, dir_);
  }
  const std::string target = weight_version_dir(dir_, version);
  if (fs::exists(target, ec)) fs::remove_all(target, ec);  // a half-published leftover of a crash
  SaveOptions options;
  options.dtype = dtype_;
  CheckpointMeta meta;
  meta.stage = "1K";  // weights in flight carry no stage; the format needs a valid one
  meta.provenance = {{"version", version}, {"published", provenance}};
  ODY_RETURN_IF_ERROR(save_policy(policy, target, config_json_, meta, options));
  ODY_RETURN_IF_ERROR(write_file_durably(dir_ + "/LATEST", fmt::format("{}\n", version)));
  const std::set<uint32_t> present = versions_in(dir_);
  int to_remove = static_cast<int>(present.size()) - keep_;
  for (uint32_t v : present) {
    if (to_remove-- <= 0) break;
    if (v != version) fs::remove_all(weight_version_dir(dir_, v), ec);
  }
  return Status::Ok();
}

WeightSubscriber::WeightSubscriber(std::string dir, std::chrono::milliseconds poll_interval)
    : dir_(std::move(dir)), poll_interval_(poll_interval) {}

std::string WeightSubscriber::version_dir(uint32_t version) const { return weight_version_dir(dir_, version); }

std::optional<uint32_t> WeightSubscriber::latest(bool force) {
  const auto now = std::chrono::steady_clock::now();
  // The first call always reads: steady_clock counts from an arbitrary point (often the boot), so
  // a default last poll could look recent on a machine up for less than one interval.
  if (force || !polled_ || now - last_poll_ >= poll_interval_) {
    polled_ = true;
    last_poll_ = now;
    if (auto v = read_latest(dir_)) latest_ = v;
  }
  return latest_;
}

Status WeightSubscriber::load(Policy& policy, uint32_t version) {
  const std::string path = version_dir(version);
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    return make_status(StatusCode::kNotFound, "weights: version {} is gone from {} (fell behind; poll again)",
                       version, dir_);
  }
  auto meta = load_policy(policy, path);
  if (!meta.ok()) return meta.status().with_context(fmt::format("weights: loading version {}", version));
  return Status::Ok();
}

Result<uint32_t> WeightSubscriber::refresh(Policy& policy, uint32_t current, bool force) {
  const auto newest = latest(force);
  if (!newest || *newest <= current) return current;
  ODY_RETURN_IF_ERROR(load(policy, *newest));
  return *newest;
}

}  // namespace odyssey::model
