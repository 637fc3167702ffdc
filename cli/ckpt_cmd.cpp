// odyssey ckpt info DIR | ckpt convert SRC DST --dtype D: look into a policy checkpoint
// (model/checkpoint.h) without loading a model, and rewrite one in another dtype or shard size.
#include <cstdio>
#include <map>
#include <string>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "cli/commands.h"
#include "model/checkpoint.h"

namespace odyssey::cli {

namespace {

std::string mib(uint64_t bytes) { return fmt::format("{:.2f} MiB", static_cast<double>(bytes) / (1024.0 * 1024.0)); }

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::optional<at::ScalarType> dtype_from_flag(const std::string& name) {
  if (name == "bf16") return at::kBFloat16;
  if (name == "fp16") return at::kHalf;
  if (name == "fp32") return at::kFloat;
  return std::nullopt;
}

int run_info(const std::string& dir, bool list_tensors) {
  auto info = model::inspect_checkpoint(dir);
  if (!info.ok()) {
    spdlog::error("ckpt info: {}", info.status().to_string());
    return 1;
  }
  std::map<std::string, std::pair<int64_t, uint64_t>> by_dtype;  // name -> (tensors, bytes)
  int64_t elements = 0;
  for (const auto& [name, entry] : info->tensors) {
    auto& slot = by_dtype[model::safetensors_dtype_name(entry.info.dtype).value_or("?")];
    slot.first += 1;
    slot.second += entry.info.byte_size;
    int64_t n = 1;
    for (int64_t s : entry.info.shape) n *= s;
    elements += n;
  }
  std::printf("checkpoint: %s\n", dir.c_str());
  std::printf("stage: %s\n", info->meta.stage.c_str());
  std::printf("provenance: %s\n", info->meta.provenance.is_null() ? "none" : info->meta.provenance.dump().c_str());
  std::printf("shards: %zu\n", info->shards.size());
  std::printf("tensors: %zu\n", info->tensors.size());
  for (const auto& [dtype, count] : by_dtype) {
    std::printf("  %-4s %6ld tensors  %s\n", dtype.c_str(), static_cast<long>(count.first), mib(count.second).c_str());
  }
  std::printf("elements: %ld\n", static_cast<long>(elements));
  std::printf("total_size: %lu\n", static_cast<unsigned long>(info->total_size));
  if (list_tensors) {
    for (const auto& [name, entry] : info->tensors) {
      std::printf("%-48s %-4s %-20s %s\n", name.c_str(),
                  model::safetensors_dtype_name(entry.info.dtype).value_or("?").c_str(),
                  shape_text(entry.info.shape).c_str(), entry.shard.c_str());
    }
  }
  return 0;
}

int run_convert(const std::string& src, const std::string& dst, const std::string& dtype_flag,
                uint64_t max_shard_bytes) {
  const auto dtype = dtype_from_flag(dtype_flag);
  if (!dtype) {
    spdlog::error("ckpt convert: --dtype must be bf16, fp16 or fp32, got '{}'", dtype_flag);
    return 2;
  }
  auto info = model::inspect_checkpoint(src);
  if (!info.ok()) {
    spdlog::error("ckpt convert: {}", info.status().to_string());
    return 1;
  }
  std::map<std::string, model::TensorSpec> expected;
  for (const auto& [name, entry] : info->tensors) expected[name] = {entry.info.shape, entry.info.dtype};
  model::LoadOptions load_options;
  load_options.dtype = *dtype;
  auto loaded = model::load_checkpoint(src, expected, load_options);
  if (!loaded.ok()) {
    spdlog::error("ckpt convert: {}", loaded.status().to_string());
    return 1;
  }
  model::CheckpointMeta meta = loaded->meta;
  nlohmann::json provenance = meta.provenance.is_object() ? meta.provenance : nlohmann::json::object();
  if (!meta.provenance.is_null() && !meta.provenance.is_object()) provenance["original"] = meta.provenance;
  provenance["converted_from"] = src;
  provenance["converted_to_dtype"] = dtype_flag;
  meta.provenance = provenance;
  model::SaveOptions save_options;
  save_options.dtype = *dtype;
  save_options.max_shard_bytes = max_shard_bytes;
  const Status saved = model::save_checkpoint(dst, loaded->tensors, loaded->config, meta, save_options);
  if (!saved.ok()) {
    spdlog::error("ckpt convert: {}", saved.to_string());
    return 1;
  }
  std::printf("converted %zu tensors: %s -> %s (%s)\n", loaded->tensors.size(), src.c_str(), dst.c_str(),
              dtype_flag.c_str());
  return 0;
}

}  // namespace

void add_ckpt_commands(CLI::App& app, Action& action) {
  auto* ckpt = app.add_subcommand("ckpt", "look into and convert policy checkpoints (sharded safetensors)");
  ckpt->require_subcommand(1);

  static std::string info_dir;
  static bool list_tensors = false;
  auto* info = ckpt->add_subcommand("info", "stage, provenance, shards, tensor counts and sizes by dtype");
  info->add_option("dir", info_dir, "checkpoint folder")->required();
  info->add_flag("--tensors", list_tensors, "also list every tensor: name, dtype, shape, shard");
  info->callback([&action] { action = [] { return run_info(info_dir, list_tensors); }; });

  static std::string src, dst, dtype = "bf16";
  static uint64_t max_shard_bytes = 5'000'000'000;
  auto* convert = ckpt->add_subcommand("convert", "rewrite a checkpoint with floating tensors in another dtype");
  convert->add_option("src", src, "checkpoint folder to read")->required();
  convert->add_option("dst", dst, "new checkpoint folder (must not exist)")->required();
  convert->add_option("--dtype", dtype, "bf16, fp16 or fp32")->capture_default_str();
  convert->add_option("--max-shard-bytes", max_shard_bytes, "start a new shard past this size")->capture_default_str();
  convert->callback([&action] { action = [] { return run_convert(src, dst, dtype, max_shard_bytes); }; });
}

}  // namespace odyssey::cli
