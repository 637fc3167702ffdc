// odyssey model info CONFIG: what a model config describes, counted without building it.
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "model/config.h"

namespace odyssey::cli {

namespace {

// 2779483053152 -> "2,779,483,053,152".
std::string grouped(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

// 2779483053152 -> "2.779T", 104188189792 -> "104.19B".
std::string short_count(int64_t n) {
  const double x = static_cast<double>(n);
  if (x >= 1e12) return fmt::format("{:.3f}T", x / 1e12);
  if (x >= 1e9) return fmt::format("{:.2f}B", x / 1e9);
  if (x >= 1e6) return fmt::format("{:.2f}M", x / 1e6);
  if (x >= 1e3) return fmt::format("{:.1f}K", x / 1e3);
  return fmt::format("{}", n);
}

// Binary units, as GPU memory is quoted: "5.06 TiB", "27.0 KiB".
std::string bytes_text(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double x = static_cast<double>(bytes);
  int unit = 0;
  while (x >= 1024 && unit < 5) {
    x /= 1024;
    ++unit;
  }
  return unit == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.2f} {}", x, units[unit]);
}

std::string layer_list(const std::vector<int64_t>& layers) {
  std::string out;
  for (int64_t layer : layers) out += (out.empty() ? "" : ", ") + std::to_string(layer);
  return out.empty() ? "none" : out;
}

// A path as given, else configs/model/NAME.toml for a bare name ("tiny").
std::string resolve_model_path(const std::string& config) {
  std::error_code ec;
  if (std::filesystem::exists(config, ec)) return config;
  const std::string named = "configs/model/" + config + ".toml";
  if (config.find('/') == std::string::npos && std::filesystem::exists(named, ec)) return named;
  return config;
}

void print_info(const model::ModelConfig& c, const std::string& path) {
  using model::Component;
  const model::ParameterCounts counts = model::count_parameters(c);
  const model::MemoryPlan memory = model::plan_memory(c, counts);

  fmt::print("model {} ({})\n", c.name, path);
  fmt::print("  hidden {}, vocab {} ({}), {} layers: {} KDA + {} MLA (one-based MLA layers: {})\n", c.hidden_size,
             c.vocab_size, c.tie_embeddings ? "tied" : "untied embedding and head", c.num_layers, c.num_kda_layers(),
             c.num_mla_layers(), layer_list(c.mla_layers));
  fmt::print("  KDA: {} heads, k {} v {}, decay rank {}, g_min {}, conv {}, chunk {}\n", c.kda.heads, c.kda.head_k_dim,
             c.kda.head_v_dim, c.kda.decay_rank, c.kda.g_min, c.kda.conv_width, c.kda.chunk_size);
  fmt::print("  MLA: {} heads, q latent {}, kv latent {}, q/k {} = {} + {} shared, v {}\n", c.mla.heads,
             c.mla.q_latent, c.mla.kv_latent, c.mla.qk_head_dim(), c.mla.qk_nope_dim, c.mla.shared_key_dim,
             c.mla.v_head_dim);
  fmt::print("  FFN: {} dense (SiTU-GLU width {}) + {} MoE: {} routed experts, top-{}, {} shared (width {}), "
             "latent {}, expert width {}, {} balancing\n",
             c.dense_layers, c.dense_ffn_width, c.num_moe_layers(), c.moe.routed_experts, c.moe.top_k,
             c.moe.shared_experts, c.moe.shared_ffn_width, c.moe.latent_width, c.moe.expert_ffn_width,
             model::balancing_method_name(c.moe.balancing.method));
  fmt::print("  attention residuals: blocks of {} layers, at most {} sources; MTP layers: {}\n",
             c.attn_res_block_size, c.attn_res_max_sources(), c.mtp_layers);
  if (c.vision.enabled) {
    fmt::print("  vision: {}x{} patches of {} channels, encoder width {}, depth {}, {} heads, FFN {}\n",
               c.vision.patch_size, c.vision.patch_size, c.vision.channels, c.vision.width, c.vision.depth,
               c.vision.heads, c.vision.ffn_width);
  } else {
    fmt::print("  vision: off\n");
  }

  fmt::print("\nparameters by component {:>27} {:>9} {:>19} {:>9}\n", "total", "", "active", "");
  for (int i = 0; i < model::kNumComponents; ++i) {
    const auto component = static_cast<Component>(i);
    if (counts.total(component) == 0) continue;
    fmt::print("  {:<24} {:>24} {:>9} {:>19} {:>9}\n", model::component_name(component),
               grouped(counts.total(component)), short_count(counts.total(component)),
               grouped(counts.active(component)), short_count(counts.active(component)));
  }
  fmt::print("  {:<24} {:>24} {:>9} {:>19} {:>9}\n", "all", grouped(counts.total_params),
             short_count(counts.total_params), grouped(counts.active_params), short_count(counts.active_params));
  if (counts.buffer_numel > 0) {
    fmt::print("  (plus {} balancing-bias numbers: buffers, not parameters)\n", grouped(counts.buffer_numel));
  }

  fmt::print("\nlayers by type {:>10} {:>19} {:>19} {:>24}\n", "layers", "params/layer", "active/layer",
             "params, all of them");
  for (const model::LayerKindCount& kind : counts.layer_kinds) {
    const std::string name = fmt::format("{} + {}", model::attention_kind_name(kind.attention),
                                         model::ffn_kind_name(kind.ffn));
    fmt::print("  {:<12} {:>10} {:>19} {:>19} {:>24}\n", name, kind.layers, grouped(kind.params_per_layer),
               grouped(kind.active_per_layer), grouped(kind.layers * kind.params_per_layer));
  }

  constexpr int64_t kMillion = int64_t{1} << 20;
  fmt::print("\nmemory\n");
  fmt::print("  {:<44} {:>12}\n", "weights, bf16", bytes_text(memory.weights_bf16_bytes));
  fmt::print("  {:<44} {:>12}\n", "weights, fp32", bytes_text(memory.weights_fp32_bytes));
  fmt::print("  {:<44} {:>12}\n", "AdamW state (fp32 m, v, master weights)", bytes_text(memory.adamw_state_bytes));
  fmt::print("  {:<44} {:>12}\n", "training state (bf16 weights + AdamW state)",
             bytes_text(memory.weights_bf16_bytes + memory.adamw_state_bytes));
  fmt::print("  {:<44} {:>12}  ({} MLA layers x {} bf16)\n", "decode cache per token (MLA latent)",
             bytes_text(memory.mla_cache_bytes_per_token), c.num_mla_layers(), c.mla.cache_width());
  fmt::print("  {:<44} {:>12}  ({} KDA layers, fp32 state + conv tails)\n", "decode state per sequence (KDA)",
             bytes_text(memory.kda_state_bytes), c.num_kda_layers());
  fmt::print("  {:<44} {:>12}\n", "decode cache for 1M (1,048,576) tokens", bytes_text(memory.decode_cache_bytes(kMillion)));

  fmt::print("\ntotal_params: {}\n", counts.total_params);
  fmt::print("active_params: {}\n", counts.active_params);
}

}  // namespace

void add_model_commands(CLI::App& app, Action& action) {
  auto* model_app = app.add_subcommand("model", "inspect model configs");
  model_app->require_subcommand(1);

  auto* info = model_app->add_subcommand(
      "info", "parameter counts by component and layer type, memory and decode-cache sizes of a model config");
  static std::string config;
  static std::vector<std::string> sets;
  info->add_option("config", config, "model config file, or the name of one in configs/model/ (tiny, small, full-2p8t)")
      ->required();
  info->add_option("--set", sets, "override one key: --set model.num_layers=12 (repeatable)");
  info->callback([&action] {
    action = [] {
      const std::string path = resolve_model_path(config);
      auto model_config = model::load_model_config({path}, sets);
      if (!model_config.ok()) {
        std::fprintf(stderr, "%s\n", model_config.status().message().c_str());
        return 2;
      }
      print_info(*model_config, path);
      return 0;
    };
  });
}

}  // namespace odyssey::cli
