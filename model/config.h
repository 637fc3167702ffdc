// The policy's shape: every size of ../shared/design/MODEL.md as one ModelConfig, read from a
// TOML model config (configs/model/*.toml), checked, and counted without building anything.
// Plain C++ (no LibTorch), so `full-2p8t` (2.78T parameters) is planned here and never
// instantiated.
//
// Model configs are their own files, under a [model] table, with their own key registry
// (model_config_schema(), built here from add_model_keys). A model config is a property of a
// checkpoint, not of a job: `odyssey model info` reads one alone, a checkpoint carries one,
// and a job names the file it uses. A process that wants the model keys inside its job config
// instead (inline [model] tables, or `extends` of a model file) builds its schema as a copy of
// config_schema() plus add_model_keys(): the same keys, defaults and errors either way.
// Unknown keys, wrong types and out-of-range values are reported by load_config with file,
// line and a suggestion; the checks that span keys (model_config_from) name the file and line
// of the key at fault the same way:
//   config configs/model/bad.toml:31: key 'model.moe.top_k' is 20, more than model.moe.routed_experts (16)
//
// Layers. `layers.{i}` is zero-based everywhere in code and in tensor names; MODEL.md and the
// `model.mla_layers` key count MLA layers one-based ("4, 8, ..., 92, 93" are layers.3 ...
// layers.92). Every layer not listed is incremental attention (KDA). The first
// `model.dense_layers` layers have the dense SiTU-GLU FFN, every other layer the latent MoE.
// Block attention residuals start a block at every layer i with i % attn_res.block_size == 0.
//
// Tensor names. model_tensors() lists every tensor a checkpoint holds, (name, shape), module
// by module in the order the LibTorch modules register them; parameter counts are sums over
// this one list, so the counts and the checkpoints cannot disagree. Shapes are PyTorch's: a
// linear map from width n to width m is `*.weight [m, n]` (no biases in the language model).
// Names:
//   embed.weight [V, d]                      token embedding (absent when tied)
//   layers.{i}.attn_mix [d]                  AttnRes mix vector before attention (w_attn)
//   layers.{i}.attn_norm.weight [d]          RMSNorm before attention
//   layers.{i}.attn.*                        KDA (flash-linear-attention's names): A_log [H]
//                                            (A_h), dt_bias [H·dk], q_proj k_proj v_proj
//                                            [H·dk|H·dv, d], q_conv1d k_conv1d v_conv1d
//                                            [channels, 1, conv_width] (depthwise causal
//                                            Conv1d), b_proj [H, d] (β), f_a_proj [rank, d],
//                                            f_b_proj [H·dk, rank], g_proj [H·dv, d], o_proj
//                                            [d, H·dv], o_norm [dv] (shared by heads)
//                                            MLA (model/mla.h): q_down_proj [q_latent, d]
//                                            (W_dq), q_up_proj [H·(nope+shared), q_latent]
//                                            (W_uq), kv_down_proj [kv_latent+shared, d]
//                                            (W_dkv), k_up_proj [H·nope, kv_latent] (W_uk),
//                                            v_up_proj [H·dv, kv_latent] (W_uv), g_proj
//                                            [H·dv, d], o_proj [d, H·dv], q_norm [q_latent],
//                                            kv_norm [kv_latent]
//   layers.{i}.ffn_mix [d], layers.{i}.ffn_norm.weight [d]
//   layers.{i}.ffn.{gate,up,down}_proj.weight   dense SiTU-GLU [F, d], [F, d], [d, F]
//   layers.{i}.moe.router.weight [E, d]      scores s = σ(W_r x)
//   layers.{i}.moe.router.bias [E]           balancing bias b: a buffer, set by balancing,
//                                            saved in checkpoints, not a parameter
//   layers.{i}.moe.latent_down.weight [L, d], latent_up.weight [d, L], latent_norm.weight [L]
//   layers.{i}.moe.experts.{gate,up}_proj [E, F, L], experts.down_proj [E, L, F]
//   layers.{i}.moe.shared_experts.{gate,up}_proj [S, Fs, d], shared_experts.down_proj [S, d, Fs]
//   out_mix [d], norm.weight [d], lm_head.weight [V, d]
//   vision.patch_embed.weight [W, C·P·P], vision.patch_embed.bias [W],
//   vision.layers.{j}.{attn_norm,ffn_norm}.weight [W], vision.layers.{j}.attn.{q,k,v,o}_proj
//   .weight [W, W], vision.layers.{j}.ffn.{gate,up,down}_proj.weight, vision.norm.weight [W],
//   vision.proj.weight [d, W]
//   mtp.{j}.{embed_norm,hidden_norm}.weight [d], mtp.{j}.eh_proj.weight [d, 2d],
//   mtp.{j}.layer.* (a layer of the last layer's kinds: MLA + MoE at full size),
//   mtp.{j}.norm.weight [d]
// Experts are stacked per layer ([E, out, in] tensors, expert e = row e), not one tensor per
// expert: the grouped expert GEMMs (torch._grouped_mm) take exactly this layout, expert
// parallelism shards it along dim 0, and a full-size layer has 6 expert tensors, not 2694. The
// AttnRes RMSNorm of each source has no weight (⟨RMSNorm(src), w⟩ would fold one into w).
// The vision encoder is a pre-norm transformer over patches, bidirectional, without position
// embeddings (NoPE, as everywhere in MODEL.md): patch order reaches the trunk through the
// order of the image patch tokens.
//
// Counts (MODEL.md): total = every parameter, incl. the untied embedding, LM head, vision
// encoder and any MTP layers. Active per token = the trunk (attention, dense FFN, shared
// experts, latent projections, routers, norms, mix vectors) + top_k routed experts per MoE
// layer + the LM head; not the embedding table (a lookup), the vision encoder (image tokens
// only) or MTP layers (training-time only). When tied, the one table counts once, as active.
//
// Thread-safety: everything here is a pure function of its arguments.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/config.h"
#include "core/status.h"

namespace odyssey::model {

enum class AttentionKind { kKda, kMla };
enum class FfnKind { kDense, kMoe };
enum class BalancingMethod { kQuantile, kSign };

// "kda", "mla"; "dense", "moe"; "quantile", "sign".
const char* attention_kind_name(AttentionKind kind);
const char* ffn_kind_name(FfnKind kind);
const char* balancing_method_name(BalancingMethod method);

// Incremental attention (KDA, MODEL.md "Incremental attention").
struct KdaConfig {
  int64_t heads = 0;
  int64_t head_k_dim = 0;   // d_k: rows of the state
  int64_t head_v_dim = 0;   // d_v: columns of the state
  int64_t decay_rank = 0;   // rank of W_fb·W_fa, shared by heads
  double g_min = 0;         // g = g_min·σ(...): the log-decay lower bound (negative)
  int64_t conv_width = 0;   // causal depthwise conv on q, k, v
  int64_t chunk_size = 0;   // C of the chunked form; C·|g_min|/ln 2 must stay below 126
  double l2norm_eps = 0;    // added to the sum of squares of q and k
};

// Gated multi-head latent attention, NoPE (MODEL.md "Gated multi-head latent attention").
struct MlaConfig {
  int64_t heads = 0;
  int64_t q_latent = 0;        // width of c_q
  int64_t kv_latent = 0;       // width of c_kv
  int64_t qk_nope_dim = 0;     // per-head part of q and k
  int64_t shared_key_dim = 0;  // the key slot shared by all heads
  int64_t v_head_dim = 0;

  int64_t qk_head_dim() const { return qk_nope_dim + shared_key_dim; }  // 192 at full size
  int64_t cache_width() const { return kv_latent + shared_key_dim; }    // 576 numbers per token
};

// Balancing of the routed experts (MODEL.md "Quantile balancing").
struct BalancingConfig {
  BalancingMethod method = BalancingMethod::kQuantile;
  double sign_gamma = 0;       // sign rule: b_j += γ·sign(mean_load − load_j)
  int64_t histogram_bins = 0;  // distributed quantile form: bins of r per expert
  double ema = 0;              // b ← ema·b_old + (1 − ema)·b_new; 0 = no EMA
};

// Stable latent MoE (MODEL.md "Stable latent MoE").
struct MoeConfig {
  int64_t routed_experts = 0;
  int64_t top_k = 0;
  int64_t shared_experts = 0;
  int64_t latent_width = 0;      // L: experts run on W_down x
  int64_t expert_ffn_width = 0;  // F of each routed expert, L → F → L
  int64_t shared_ffn_width = 0;  // Fs of each shared expert, d → Fs → d
  BalancingConfig balancing;
};

// The patch embedding and vision encoder (MODEL.md "Vision").
struct VisionConfig {
  bool enabled = false;
  int64_t patch_size = 0;  // P: square patches of P×P pixels
  int64_t channels = 0;    // C
  int64_t width = 0;       // W
  int64_t depth = 0;       // encoder layers
  int64_t heads = 0;       // W must be a multiple of heads
  int64_t ffn_width = 0;   // SiTU-GLU width inside the encoder
};

struct ModelConfig {
  std::string name;  // label: "tiny", "full-2p8t"
  int64_t hidden_size = 0;  // d
  int64_t vocab_size = 0;
  int64_t num_layers = 0;
  std::vector<int64_t> mla_layers;  // one-based, strictly increasing
  int64_t dense_layers = 0;         // the first this many layers have the dense FFN
  int64_t dense_ffn_width = 0;
  KdaConfig kda;
  MlaConfig mla;
  MoeConfig moe;
  int64_t attn_res_block_size = 0;
  double situ_beta1 = 0;  // gate cap: β1·tanh(g/β1)·σ(g)
  double situ_beta2 = 0;  // up cap: β2·tanh(u/β2)
  double rms_norm_eps = 0;
  bool tie_embeddings = false;
  int64_t mtp_layers = 0;
  VisionConfig vision;

  // For zero-based `layer`.
  AttentionKind attention_kind(int64_t layer) const;
  FfnKind ffn_kind(int64_t layer) const;
  int64_t num_mla_layers() const { return static_cast<int64_t>(mla_layers.size()); }
  int64_t num_kda_layers() const { return num_layers - num_mla_layers(); }
  int64_t num_moe_layers() const { return num_layers - dense_layers; }
  // Sources of the last AttnRes mix: the embedding, every completed block, the running block.
  int64_t attn_res_max_sources() const;
};

// ---- Configuration ----

// Registers every model.* key (type, default, doc, limits) on `schema`. Defaults are the
// full-size reference of MODEL.md, except the vision encoder, which MODEL.md leaves to config.
void add_model_keys(ConfigSchema& schema);

// A registry holding only the model.* keys; lives for the process.
const ConfigSchema& model_config_schema();

// Reads the model.* keys of `config` (loaded with a schema that has them) and checks what
// spans keys: MLA layer numbers in range and strictly increasing, top_k ≤ routed experts,
// dense layers < layers, vision width divisible by its heads, the KDA chunk inside the
// exponent range, and so on. kInvalidArgument, one line per problem, each naming the source
// (file:line, --set or default) and key at fault.
Result<ModelConfig> model_config_from(const Config& config);

// load_config(files, overrides, model_config_schema()), then model_config_from.
Result<ModelConfig> load_model_config(const std::vector<std::string>& files,
                                      const std::vector<std::string>& overrides = {});

// The checks of model_config_from for a config built in code (errors name keys, not files).
Status validate(const ModelConfig& config);

// ---- Tensors ----

// What a tensor belongs to, for the counts by component.
enum class Component {
  kEmbedding,
  kLmHead,
  kFinalNorm,        // norm.weight
  kAttnResMix,       // attn_mix, ffn_mix, out_mix
  kLayerNorms,       // attn_norm, ffn_norm
  kKda,
  kMla,
  kDenseFfn,
  kRouter,
  kRoutedExperts,
  kSharedExperts,
  kLatentProjections,  // latent_down, latent_up, latent_norm
  kVision,
  kMtp,
};
inline constexpr int kNumComponents = 14;
// "embedding", "lm_head", ..., readable in a table.
const char* component_name(Component component);

struct ModelTensor {
  std::string name;
  std::vector<int64_t> shape;
  Component component;
  bool buffer = false;  // saved in checkpoints, not trained, not counted as a parameter

  int64_t numel() const;
};

// The tensors of zero-based layer `layer`, named under `prefix` ("layers.3." or, for an MTP
// layer, "mtp.0.layer.").
std::vector<ModelTensor> layer_tensors(const ModelConfig& config, int64_t layer, const std::string& prefix);

// Every tensor of the model, in registration order: embed, layers 0..n-1, out_mix, norm,
// lm_head, vision, mtp.
std::vector<ModelTensor> model_tensors(const ModelConfig& config);

// ---- Counts ----

// Layers that share an (attention, FFN) kind have the same tensors and counts.
struct LayerKindCount {
  AttentionKind attention;
  FfnKind ffn;
  int64_t layers = 0;            // how many
  int64_t params_per_layer = 0;  // every parameter of one layer
  int64_t active_per_layer = 0;  // with top_k of the routed experts
};

struct ParameterCounts {
  std::array<int64_t, kNumComponents> total_by_component{};   // every parameter
  std::array<int64_t, kNumComponents> active_by_component{};  // per token
  std::vector<LayerKindCount> layer_kinds;  // in order of first appearance
  int64_t total_params = 0;
  int64_t active_params = 0;
  int64_t buffer_numel = 0;  // balancing biases

  int64_t total(Component c) const { return total_by_component[static_cast<int>(c)]; }
  int64_t active(Component c) const { return active_by_component[static_cast<int>(c)]; }
};

ParameterCounts count_parameters(const ModelConfig& config);

// Bytes of weights, optimizer state and decode caches. Decode cache: the MLA latent
// [c_kv; k_shared] in bf16 per token per MLA layer; the KDA recurrent state in fp32, constant
// in the sequence length: per layer heads × dk × dv plus the last conv_width − 1 pre-conv
// inputs of q, k and v.
struct MemoryPlan {
  int64_t weights_bf16_bytes = 0;
  int64_t weights_fp32_bytes = 0;
  int64_t adamw_state_bytes = 0;         // fp32 m, v and master weights: 12 bytes per parameter
  int64_t mla_cache_bytes_per_token = 0; // over all MLA layers
  int64_t kda_state_bytes = 0;           // per sequence, over all KDA layers

  // Decode cache of one sequence of `tokens` tokens.
  int64_t decode_cache_bytes(int64_t tokens) const { return kda_state_bytes + tokens * mla_cache_bytes_per_token; }
};

MemoryPlan plan_memory(const ModelConfig& config, const ParameterCounts& counts);

}  // namespace odyssey::model
