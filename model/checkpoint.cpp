#include "model/checkpoint.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include <fmt/format.h>

#include "model/durable_file.h"

namespace odyssey::model {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string dtype_string(at::ScalarType dtype) {
  std::optional<std::string> name = safetensors_dtype_name(dtype);
  return name ? *name : std::string(c10::toString(dtype));
}

std::string shape_string(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// The folder itself, without a trailing slash ("ckpt/" and "ckpt" name the same folder).
fs::path folder_path(const std::string& dir) {
  fs::path path(dir);
  return path.filename().empty() ? path.parent_path() : path;
}

std::string shard_file_name(size_t index, size_t count) {
  return fmt::format("model-{:05d}-of-{:05d}.safetensors", index + 1, count);
}

// A shard name from the index must be a plain file name inside the folder.
bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

Result<json> read_json_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return make_status(StatusCode::kCorrupt, "checkpoint file {} is missing or unreadable: {}", path.string(),
                       std::strerror(errno));
  }
  std::stringstream text;
  text << in.rdbuf();
  try {
    return json::parse(text.str());
  } catch (const json::exception& e) {
    return make_status(StatusCode::kCorrupt, "checkpoint file {} is not valid JSON: {}", path.string(), e.what());
  }
}

std::string dump_json(const json& value) { return value.dump(2) + "\n"; }

// Splits names (in order) into shards of at most `max_bytes`, transformers' rule: a new shard
// starts when the next tensor would overflow the current one; an oversized tensor stands alone.
std::vector<std::vector<std::string>> plan_shards(const std::map<std::string, uint64_t>& stored_bytes,
                                                  uint64_t max_bytes) {
  std::vector<std::vector<std::string>> shards;
  uint64_t current = 0;
  for (const auto& [name, bytes] : stored_bytes) {
    if (shards.empty() || (!shards.back().empty() && current + bytes > max_bytes)) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(name);
    current += bytes;
  }
  return shards;
}

Status save_impl(const std::string& dir, const std::map<std::string, at::Tensor>& tensors, const json& config_json,
                 const CheckpointMeta& meta, const SaveOptions& options) {
  auto bad = [&](const std::string& what) { return invalid_argument("saving checkpoint {}: {}", dir, what); };
  if (options.dtype != at::kBFloat16 && options.dtype != at::kHalf && options.dtype != at::kFloat) {
    return bad(fmt::format("SaveOptions::dtype is {}; use BF16, F16 or F32", dtype_string(options.dtype)));
  }
  if (options.max_shard_bytes == 0) return bad("SaveOptions::max_shard_bytes is 0");
  ODY_RETURN_IF_ERROR(validate_stage(meta.stage));
  if (!config_json.is_object()) return bad(fmt::format("the config is {}, not a JSON object", config_json.type_name()));
  if (tensors.empty()) return bad("no tensors to save");

  std::map<std::string, at::ScalarType> stored_dtype;
  std::map<std::string, uint64_t> stored_bytes;
  uint64_t total_size = 0;
  for (const auto& [name, tensor] : tensors) {
    if (!tensor.defined()) return bad(fmt::format("tensor '{}' is undefined", name));
    at::ScalarType dtype = at::isFloatingType(tensor.scalar_type()) ? options.dtype : tensor.scalar_type();
    if (!safetensors_dtype_name(dtype)) {
      return bad(fmt::format("tensor '{}' has dtype {}, which checkpoints cannot hold", name, dtype_string(dtype)));
    }
    stored_dtype[name] = dtype;
    stored_bytes[name] = static_cast<uint64_t>(tensor.numel()) * c10::elementSize(dtype);
    total_size += stored_bytes[name];
  }

  const fs::path target = folder_path(dir);
  std::error_code ec;
  if (fs::exists(target, ec) && !options.overwrite) {
    return make_status(StatusCode::kAlreadyExists,
                       "saving checkpoint {}: the folder already exists; save under a new name or set "
                       "SaveOptions::overwrite",
                       target.string());
  }
  const fs::path staging = target.string() + fmt::format(".tmp-{}", ::getpid());
  fs::remove_all(staging, ec);  // left by an earlier process with our pid
  if (fs::create_directories(staging, ec); ec) {
    return make_status(StatusCode::kIo, "saving checkpoint {}: creating {}: {}", dir, staging.string(), ec.message());
  }

  auto write_all = [&]() -> Status {
    std::vector<std::vector<std::string>> shards = plan_shards(stored_bytes, options.max_shard_bytes);
    const std::map<std::string, std::string> shard_metadata = {{"format", "pt"}, {"stage", meta.stage}};
    json weight_map = json::object();
    for (size_t i = 0; i < shards.size(); ++i) {
      const std::string file_name = shard_file_name(i, shards.size());
      std::map<std::string, at::Tensor> shard;
      for (const std::string& name : shards[i]) {
        // Converted on the tensor's device, so only stored-dtype bytes cross to the host.
        shard.emplace(name, tensors.at(name).detach().to(stored_dtype.at(name)));
        weight_map[name] = file_name;
      }
      ODY_RETURN_IF_ERROR(write_safetensors((staging / file_name).string(), shard, shard_metadata));
    }
    json index = {{"metadata", {{"total_size", total_size}, {"stage", meta.stage}, {"provenance", meta.provenance}}},
                  {"weight_map", weight_map}};
    json stage = {{"stage", meta.stage}, {"provenance", meta.provenance}};
    ODY_RETURN_IF_ERROR(write_file_durably((staging / kCheckpointIndexFile).string(), dump_json(index)));
    ODY_RETURN_IF_ERROR(write_file_durably((staging / kCheckpointConfigFile).string(), dump_json(config_json)));
    ODY_RETURN_IF_ERROR(write_file_durably((staging / kCheckpointStageFile).string(), dump_json(stage)));
    ODY_RETURN_IF_ERROR(write_file_durably(
        (staging / kCheckpointCompleteFile).string(),
        fmt::format("complete: {} tensors, {} shards, {} bytes\n", tensors.size(), shards.size(), total_size)));
    ODY_RETURN_IF_ERROR(sync_directory(staging.string()));

    if (fs::exists(target, ec)) {  // overwrite: move the old folder aside, then drop it
      const fs::path old = target.string() + fmt::format(".old-{}", ::getpid());
      fs::remove_all(old, ec);
      if (std::rename(target.c_str(), old.c_str()) != 0) {
        return make_status(StatusCode::kIo, "saving checkpoint {}: moving the old folder aside: {}", dir,
                           std::strerror(errno));
      }
      fs::remove_all(old, ec);
    }
    if (std::rename(staging.c_str(), target.c_str()) != 0) {
      return make_status(StatusCode::kIo, "saving checkpoint {}: renaming {} to it: {}", dir, staging.string(),
                         std::strerror(errno));
    }
    fs::path parent = target.parent_path();
    return sync_directory(parent.empty() ? "." : parent.string());
  };
  Status status;
  try {
    status = write_all();
  } catch (const json::exception& e) {
    status = bad(fmt::format("the config or provenance cannot be written as JSON (not UTF-8?): {}", e.what()));
  }
  if (!status.ok()) fs::remove_all(staging, ec);
  return status;
}

Result<CheckpointInfo> inspect_impl(const std::string& dir) {
  const fs::path folder = folder_path(dir);
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) {
    return make_status(StatusCode::kNotFound, "checkpoint {} does not exist or is not a folder", dir);
  }
  if (!fs::exists(folder / kCheckpointCompleteFile, ec)) {
    return make_status(StatusCode::kFailedPrecondition,
                       "checkpoint {} has no {} marker: the save that wrote it did not finish (crashed, or still "
                       "running); refusing to load it. Load an earlier checkpoint, or delete this folder",
                       dir, kCheckpointCompleteFile);
  }
  auto corrupt = [&](const std::string& what) {
    return make_status(StatusCode::kCorrupt, "checkpoint {}: {}", dir, what);
  };

  CheckpointInfo info;
  ODY_ASSIGN_OR_RETURN(json index, read_json_file(folder / kCheckpointIndexFile));
  ODY_ASSIGN_OR_RETURN(info.config, read_json_file(folder / kCheckpointConfigFile));
  ODY_ASSIGN_OR_RETURN(json stage, read_json_file(folder / kCheckpointStageFile));

  if (!stage.is_object() || !stage.contains("stage") || !stage["stage"].is_string()) {
    return corrupt(fmt::format("{} has no \"stage\" string", kCheckpointStageFile));
  }
  info.meta.stage = stage["stage"].get<std::string>();
  if (Status valid = validate_stage(info.meta.stage); !valid.ok()) {
    return corrupt(fmt::format("{}: {}", kCheckpointStageFile, valid.message()));
  }
  info.meta.provenance = stage.value("provenance", json());

  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object() ||
      !index.contains("metadata") || !index["metadata"].is_object()) {
    return corrupt(fmt::format("{} lacks a \"metadata\" or \"weight_map\" object", kCheckpointIndexFile));
  }
  const json& index_meta = index["metadata"];
  if (!index_meta.contains("total_size") || !index_meta["total_size"].is_number_unsigned()) {
    return corrupt(fmt::format("{}: \"metadata.total_size\" is missing or not a non-negative integer",
                               kCheckpointIndexFile));
  }
  if (index_meta.value("stage", json()) != json(info.meta.stage)) {
    return corrupt(fmt::format("{} says stage {} but {} says \"{}\"", kCheckpointIndexFile,
                               index_meta.value("stage", json()).dump(), kCheckpointStageFile, info.meta.stage));
  }

  std::map<std::string, std::set<std::string>> names_by_shard;
  for (const auto& [name, shard] : index["weight_map"].items()) {
    if (!shard.is_string() || !is_plain_file_name(shard.get<std::string>())) {
      return corrupt(fmt::format("{}: tensor '{}' maps to {}, not a file name in the folder", kCheckpointIndexFile,
                                 name, shard.dump()));
    }
    names_by_shard[shard.get<std::string>()].insert(name);
  }
  for (const auto& [shard, names] : names_by_shard) {
    info.shards.push_back(shard);
    ODY_ASSIGN_OR_RETURN(auto header, read_safetensors_header((folder / shard).string()));
    for (const auto& [name, tensor] : header) {
      if (!names.count(name)) {
        return corrupt(fmt::format("shard {} holds tensor '{}', which {} does not map to it", shard, name,
                                   kCheckpointIndexFile));
      }
      info.total_size += tensor.byte_size;
      info.tensors[name] = {shard, tensor};
    }
    for (const std::string& name : names) {
      if (!header.count(name)) {
        return corrupt(fmt::format("{} maps tensor '{}' to shard {}, which does not hold it", kCheckpointIndexFile,
                                   name, shard));
      }
    }
  }
  if (info.total_size != index_meta["total_size"].get<uint64_t>()) {
    return corrupt(fmt::format("{} says total_size {} but the shards hold {} tensor bytes", kCheckpointIndexFile,
                               index_meta["total_size"].get<uint64_t>(), info.total_size));
  }
  return info;
}

Result<LoadedCheckpoint> load_impl(const std::string& dir, const std::map<std::string, TensorSpec>& expected,
                                   const LoadOptions& options) {
  if (options.dtype && !at::isFloatingType(*options.dtype)) {
    return invalid_argument("loading checkpoint {}: LoadOptions::dtype is {}, not a floating dtype", dir,
                            dtype_string(*options.dtype));
  }
  ODY_ASSIGN_OR_RETURN(CheckpointInfo info, inspect_impl(dir));

  std::vector<std::string> problems;
  for (const auto& [name, spec] : expected) {
    if (!info.tensors.count(name)) {
      problems.push_back(fmt::format("missing tensor '{}' (the model expects {} {})", name, shape_string(spec.shape),
                                     dtype_string(spec.dtype)));
    }
  }
  for (const auto& [name, entry] : info.tensors) {
    auto spec = expected.find(name);
    if (spec == expected.end()) {
      problems.push_back(fmt::format("unexpected tensor '{}' ({} {}, in {})", name, shape_string(entry.info.shape),
                                     dtype_string(entry.info.dtype), entry.shard));
      continue;
    }
    if (entry.info.shape != spec->second.shape) {
      problems.push_back(fmt::format("tensor '{}': shape {} in the checkpoint, the model expects {}", name,
                                     shape_string(entry.info.shape), shape_string(spec->second.shape)));
    }
    bool convertible = at::isFloatingType(spec->second.dtype) ? at::isFloatingType(entry.info.dtype)
                                                              : entry.info.dtype == spec->second.dtype;
    if (!convertible) {
      problems.push_back(fmt::format("tensor '{}': stored as {}, the model expects {} (floating tensors convert "
                                     "among F64 F32 F16 BF16; integer and bool tensors must match exactly)",
                                     name, dtype_string(entry.info.dtype), dtype_string(spec->second.dtype)));
    }
  }
  if (!problems.empty()) {
    return invalid_argument("checkpoint {} does not match the model ({} problem{}):\n  {}", dir, problems.size(),
                            problems.size() == 1 ? "" : "s", fmt::join(problems, "\n  "));
  }

  LoadedCheckpoint loaded;
  loaded.config = std::move(info.config);
  loaded.meta = std::move(info.meta);
  const fs::path folder = folder_path(dir);
  for (const std::string& shard : info.shards) {
    ODY_ASSIGN_OR_RETURN(SafetensorsFile file, read_safetensors((folder / shard).string()));
    for (auto& [name, tensor] : file.tensors) {
      auto entry = info.tensors.find(name);
      if (entry == info.tensors.end() || entry->second.shard != shard ||
          tensor.sizes().vec() != entry->second.info.shape) {
        return make_status(StatusCode::kCorrupt, "checkpoint {}: shard {} changed while loading (tensor '{}')", dir,
                           shard, name);
      }
      const TensorSpec& spec = expected.at(name);
      at::ScalarType dtype = at::isFloatingType(spec.dtype) ? options.dtype.value_or(spec.dtype) : spec.dtype;
      loaded.tensors.emplace(name, tensor.to(dtype));
    }
  }
  return loaded;
}

}  // namespace

Status validate_stage(const std::string& stage) {
  bool valid = stage.size() >= 2 && (stage.back() == 'K' || stage.back() == 'M') && stage[0] >= '1' &&
               stage[0] <= '9' && stage.size() <= 8;
  for (size_t i = 1; valid && i + 1 < stage.size(); ++i) valid = stage[i] >= '0' && stage[i] <= '9';
  if (!valid) {
    return invalid_argument("checkpoint stage '{}' is not a context length like 8K, 64K, 256K or 1M", stage);
  }
  return Status::Ok();
}

Status save_checkpoint(const std::string& dir, const std::map<std::string, at::Tensor>& tensors,
                       const nlohmann::json& config_json, const CheckpointMeta& meta, const SaveOptions& options) {
  try {
    return save_impl(dir, tensors, config_json, meta, options);
  } catch (const std::exception& e) {  // a device copy, cast or allocation failed
    return make_status(StatusCode::kInternal, "saving checkpoint {}: {}", dir, e.what());
  }
}

Result<CheckpointInfo> inspect_checkpoint(const std::string& dir) {
  try {
    return inspect_impl(dir);
  } catch (const std::exception& e) {
    return make_status(StatusCode::kInternal, "inspecting checkpoint {}: {}", dir, e.what());
  }
}

Result<LoadedCheckpoint> load_checkpoint(const std::string& dir, const std::map<std::string, TensorSpec>& expected,
                                         const LoadOptions& options) {
  try {
    return load_impl(dir, expected, options);
  } catch (const std::exception& e) {  // allocation or cast failed
    return make_status(StatusCode::kInternal, "loading checkpoint {}: {}", dir, e.what());
  }
}

}  // namespace odyssey::model
