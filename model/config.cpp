#include "model/config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <functional>
#include <utility>

#include <fmt/format.h>

namespace odyssey::model {

const char* attention_kind_name(AttentionKind kind) { return kind == AttentionKind::kKda ? "kda" : "mla"; }
const char* ffn_kind_name(FfnKind kind) { return kind == FfnKind::kDense ? "dense" : "moe"; }
const char* balancing_method_name(BalancingMethod method) {
  return method == BalancingMethod::kQuantile ? "quantile" : "sign";
}

const char* component_name(Component component) {
  switch (component) {
    case Component::kEmbedding: return "embedding";
    case Component::kLmHead: return "lm_head";
    case Component::kFinalNorm: return "final norm";
    case Component::kAttnResMix: return "attn-res mix vectors";
    case Component::kLayerNorms: return "layer norms";
    case Component::kKda: return "KDA attention";
    case Component::kMla: return "MLA attention";
    case Component::kDenseFfn: return "dense FFN";
    case Component::kRouter: return "routers";
    case Component::kRoutedExperts: return "routed experts";
    case Component::kSharedExperts: return "shared experts";
    case Component::kLatentProjections: return "latent down/up + norm";
    case Component::kVision: return "vision encoder";
    case Component::kMtp: return "MTP layers";
  }
  return "unknown";
}

AttentionKind ModelConfig::attention_kind(int64_t layer) const {
  return std::binary_search(mla_layers.begin(), mla_layers.end(), layer + 1) ? AttentionKind::kMla
                                                                             : AttentionKind::kKda;
}

FfnKind ModelConfig::ffn_kind(int64_t layer) const { return layer < dense_layers ? FfnKind::kDense : FfnKind::kMoe; }

int64_t ModelConfig::attn_res_max_sources() const {
  const int64_t blocks = (num_layers + attn_res_block_size - 1) / attn_res_block_size;
  return 1 + blocks;  // the embedding, blocks − 1 completed blocks, the running block
}

// ---- Configuration ----

namespace {

// MODEL.md's full-size MLA layers: every fourth layer and the last, one-based.
constexpr const char* kFullMlaLayers =
    "4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 68, 72, 76, 80, 84, 88, 92, 93";

// "4, 8, 93" -> {4, 8, 93}; the items as written, unchecked beyond being integers.
Result<std::vector<int64_t>> parse_layer_list(const std::string& text) {
  std::vector<int64_t> layers;
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find(',', begin);
    if (end == std::string::npos) end = text.size();
    std::string_view item(text.data() + begin, end - begin);
    while (!item.empty() && (item.front() == ' ' || item.front() == '\t')) item.remove_prefix(1);
    while (!item.empty() && (item.back() == ' ' || item.back() == '\t')) item.remove_suffix(1);
    if (item.empty()) {
      if (end == text.size() && layers.empty() && begin == 0) break;  // "" = no MLA layers
      return invalid_argument("key 'model.mla_layers' has an empty item; write layer numbers separated by commas, "
                              "such as \"4, 8, 12\"");
    }
    int64_t value = 0;
    const auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), value);
    if (ec != std::errc() || ptr != item.data() + item.size()) {
      return invalid_argument("key 'model.mla_layers' must list one-based layer numbers such as \"4, 8, 12\", "
                              "got item '{}'", item);
    }
    layers.push_back(value);
    begin = end + 1;
  }
  return layers;
}

// Every check that spans keys, or that the schema's limits cannot say. `where(key)` says where
// the key's value came from, as the start of an error line.
std::vector<std::string> check(const ModelConfig& c, const std::function<std::string(std::string_view)>& where) {
  std::vector<std::string> errors;
  auto fail = [&](std::string_view key, const std::string& what) {
    errors.push_back(fmt::format("{}: key '{}' {}", where(key), key, what));
  };
  auto positive = [&](std::string_view key, int64_t value) {
    if (value < 1) fail(key, fmt::format("must be at least 1, got {}", value));
  };
  positive("model.hidden_size", c.hidden_size);
  positive("model.vocab_size", c.vocab_size);
  positive("model.num_layers", c.num_layers);
  positive("model.dense_ffn_width", c.dense_ffn_width);
  positive("model.attn_res.block_size", c.attn_res_block_size);
  positive("model.kda.heads", c.kda.heads);
  positive("model.kda.head_k_dim", c.kda.head_k_dim);
  positive("model.kda.head_v_dim", c.kda.head_v_dim);
  positive("model.kda.decay_rank", c.kda.decay_rank);
  positive("model.kda.conv_width", c.kda.conv_width);
  positive("model.kda.chunk_size", c.kda.chunk_size);
  positive("model.mla.heads", c.mla.heads);
  positive("model.mla.q_latent", c.mla.q_latent);
  positive("model.mla.kv_latent", c.mla.kv_latent);
  positive("model.mla.qk_nope_dim", c.mla.qk_nope_dim);
  positive("model.mla.v_head_dim", c.mla.v_head_dim);
  positive("model.moe.routed_experts", c.moe.routed_experts);
  positive("model.moe.top_k", c.moe.top_k);
  positive("model.moe.latent_width", c.moe.latent_width);
  positive("model.moe.expert_ffn_width", c.moe.expert_ffn_width);
  positive("model.moe.shared_ffn_width", c.moe.shared_ffn_width);
  positive("model.moe.balancing.histogram_bins", c.moe.balancing.histogram_bins);
  if (c.mla.shared_key_dim < 0) fail("model.mla.shared_key_dim", fmt::format("must be at least 0, got {}", c.mla.shared_key_dim));
  if (c.moe.shared_experts < 0) fail("model.moe.shared_experts", fmt::format("must be at least 0, got {}", c.moe.shared_experts));
  if (c.mtp_layers < 0) fail("model.mtp_layers", fmt::format("must be at least 0, got {}", c.mtp_layers));

  // MLA layers: one-based, inside the model, strictly increasing.
  std::string outside;
  int64_t outside_count = 0;
  for (size_t i = 0; i < c.mla_layers.size(); ++i) {
    const int64_t layer = c.mla_layers[i];
    if (layer < 1 || layer > c.num_layers) {
      outside += fmt::format("{}{}", outside.empty() ? "" : ", ", layer);
      ++outside_count;
    } else if (i > 0 && layer <= c.mla_layers[i - 1]) {
      fail("model.mla_layers", fmt::format("must be strictly increasing, but {} follows {}", layer, c.mla_layers[i - 1]));
    }
  }
  if (outside_count > 0) {
    fail("model.mla_layers", fmt::format("names layer{} {}, but layers are numbered 1 to {} (model.num_layers = {}; "
                                         "the list is one-based)",
                                         outside_count > 1 ? "s" : "", outside, c.num_layers, c.num_layers));
  }
  if (c.dense_layers < 0 || c.dense_layers > c.num_layers) {
    fail("model.dense_layers", fmt::format("is {}, but must be between 0 and model.num_layers ({})",
                                           c.dense_layers, c.num_layers));
  }

  // KDA: the point of the lower bound is that e^{C·|g_min|} stays inside the exponent range.
  if (!(c.kda.g_min < 0)) {
    fail("model.kda.g_min", fmt::format("must be negative (it multiplies a sigmoid to give the log decay), got {}",
                                        c.kda.g_min));
  } else if (c.kda.chunk_size >= 1) {
    const double bits = static_cast<double>(c.kda.chunk_size) * -c.kda.g_min / std::log(2.0);
    if (bits >= 126) {
      fail("model.kda.chunk_size",
           fmt::format("is {}: chunk_size·|g_min|/ln 2 = {:.1f} leaves the fp32/bf16 exponent range (must stay "
                       "below 126); use a smaller chunk or a smaller |model.kda.g_min| ({})",
                       c.kda.chunk_size, bits, c.kda.g_min));
    }
  }
  if (!(c.kda.l2norm_eps > 0)) fail("model.kda.l2norm_eps", fmt::format("must be positive, got {}", c.kda.l2norm_eps));

  // MoE: quantile balancing takes the (k+1)-th largest score, so it needs k < n.
  if (c.moe.top_k > c.moe.routed_experts) {
    fail("model.moe.top_k", fmt::format("is {}, more than model.moe.routed_experts ({})", c.moe.top_k,
                                        c.moe.routed_experts));
  } else if (c.moe.balancing.method == BalancingMethod::kQuantile && c.moe.top_k == c.moe.routed_experts &&
             c.num_moe_layers() > 0) {
    fail("model.moe.top_k", fmt::format("is {}, every routed expert: quantile balancing needs top_k below "
                                        "model.moe.routed_experts (it reads the (k+1)-th largest score)",
                                        c.moe.top_k));
  }
  if (!(c.moe.balancing.ema >= 0 && c.moe.balancing.ema < 1)) {
    fail("model.moe.balancing.ema", fmt::format("must be in [0, 1), got {}", c.moe.balancing.ema));
  }
  if (!(c.moe.balancing.sign_gamma >= 0)) {
    fail("model.moe.balancing.sign_gamma", fmt::format("must be at least 0, got {}", c.moe.balancing.sign_gamma));
  }

  if (!(c.situ_beta1 > 0)) fail("model.situ_glu.beta1", fmt::format("must be positive, got {}", c.situ_beta1));
  if (!(c.situ_beta2 > 0)) fail("model.situ_glu.beta2", fmt::format("must be positive, got {}", c.situ_beta2));
  if (!(c.rms_norm_eps > 0)) fail("model.rms_norm_eps", fmt::format("must be positive, got {}", c.rms_norm_eps));

  if (c.vision.enabled) {
    positive("model.vision.patch_size", c.vision.patch_size);
    positive("model.vision.channels", c.vision.channels);
    positive("model.vision.width", c.vision.width);
    positive("model.vision.depth", c.vision.depth);
    positive("model.vision.heads", c.vision.heads);
    positive("model.vision.ffn_width", c.vision.ffn_width);
    if (c.vision.heads >= 1 && c.vision.width % c.vision.heads != 0) {
      fail("model.vision.width", fmt::format("is {}, not a multiple of model.vision.heads ({}): every head needs the "
                                             "same width", c.vision.width, c.vision.heads));
    }
  }
  return errors;
}

std::string join_lines(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& line : lines) out += (out.empty() ? "" : "\n") + line;
  return out;
}

}  // namespace

void add_model_keys(ConfigSchema& s) {
  s.add_string("model.name", "full-2p8t", "label of the model config, shown by tools and stored in checkpoints");
  s.add_int("model.hidden_size", 7168, "d: width of the residual stream", at_least(1));
  s.add_int("model.vocab_size", 163840, "rows of the token embedding and the LM head", at_least(1));
  s.add_int("model.num_layers", 93, "layers of the trunk", at_least(1));
  s.add_string("model.mla_layers", kFullMlaLayers,
               "one-based numbers of the gated MLA layers, comma-separated; every other layer is KDA");
  s.add_int("model.dense_layers", 1, "the first this many layers have the dense FFN, the rest the latent MoE",
            at_least(0));
  s.add_int("model.dense_ffn_width", 33792, "SiTU-GLU width of the dense FFN", at_least(1));
  s.add_double("model.rms_norm_eps", 1e-5, "epsilon of every RMSNorm", between(1e-12, 0.1));
  s.add_bool("model.tie_embeddings", false, "share one table between the token embedding and the LM head");
  s.add_int("model.mtp_layers", 0, "multi-token prediction layers (training only; counted in total, not active)",
            at_least(0));

  s.add_double("model.situ_glu.beta1", 4.0, "SiTU-GLU gate cap: beta1*tanh(g/beta1)*sigmoid(g)", between(1e-3, 1e6));
  s.add_double("model.situ_glu.beta2", 25.0, "SiTU-GLU up cap: beta2*tanh(u/beta2)", between(1e-3, 1e6));

  s.add_int("model.attn_res.block_size", 12, "layers per block of the block attention residuals", at_least(1));

  s.add_int("model.kda.heads", 96, "incremental-attention heads", at_least(1));
  s.add_int("model.kda.head_k_dim", 128, "key width per head (rows of the state)", at_least(1));
  s.add_int("model.kda.head_v_dim", 128, "value width per head (columns of the state)", at_least(1));
  s.add_int("model.kda.decay_rank", 128, "rank of the decay projection W_fb*W_fa, shared by heads", at_least(1));
  s.add_double("model.kda.g_min", -5.0, "lower bound of the log decay: g = g_min*sigmoid(...)", between(-80, -1e-6));
  s.add_int("model.kda.conv_width", 4, "taps of the causal depthwise conv on q, k and v", at_least(1));
  s.add_int("model.kda.chunk_size", 16, "tokens per chunk of the chunked form", at_least(1));
  s.add_double("model.kda.l2norm_eps", 1e-6, "added to the sum of squares when q and k are L2-normalized",
               between(1e-12, 1));

  s.add_int("model.mla.heads", 96, "gated MLA heads", at_least(1));
  s.add_int("model.mla.q_latent", 1536, "width of the query latent c_q", at_least(1));
  s.add_int("model.mla.kv_latent", 512, "width of the key/value latent c_kv", at_least(1));
  s.add_int("model.mla.qk_nope_dim", 128, "per-head width of q and k, before the shared slot", at_least(1));
  s.add_int("model.mla.shared_key_dim", 64, "width of the key slot shared by all heads", at_least(0));
  s.add_int("model.mla.v_head_dim", 128, "value width per head", at_least(1));

  s.add_int("model.moe.routed_experts", 896, "routed experts per MoE layer", at_least(1));
  s.add_int("model.moe.top_k", 16, "routed experts each token uses", at_least(1));
  s.add_int("model.moe.shared_experts", 2, "shared experts on the full-width input, unweighted", at_least(0));
  s.add_int("model.moe.latent_width", 3584, "width the routed experts work in (W_down: d -> latent)", at_least(1));
  s.add_int("model.moe.expert_ffn_width", 3072, "SiTU-GLU width of each routed expert", at_least(1));
  s.add_int("model.moe.shared_ffn_width", 3072, "SiTU-GLU width of each shared expert", at_least(1));
  s.add_string("model.moe.balancing.method", "quantile", "how the balancing bias is updated after each step",
               {"quantile", "sign"});
  s.add_double("model.moe.balancing.sign_gamma", 0.001, "sign rule step: b_j += gamma*sign(mean_load - load_j)",
               at_least(0));
  s.add_int("model.moe.balancing.histogram_bins", 1000, "bins per expert of the distributed quantile histogram",
            at_least(2));
  s.add_double("model.moe.balancing.ema", 0.0, "EMA factor on the bias: b = ema*b_old + (1-ema)*b_new; 0 = none",
               between(0, 0.999999));

  s.add_bool("model.vision.enabled", true, "the patch embedding and vision encoder (images in the token stream)");
  s.add_int("model.vision.patch_size", 14, "pixels per side of a square patch", at_least(1));
  s.add_int("model.vision.channels", 3, "color channels of an image", at_least(1));
  s.add_int("model.vision.width", 1152, "width of the vision encoder", at_least(1));
  s.add_int("model.vision.depth", 27, "layers of the vision encoder", at_least(1));
  s.add_int("model.vision.heads", 16, "attention heads of the vision encoder (must divide its width)", at_least(1));
  s.add_int("model.vision.ffn_width", 3072, "SiTU-GLU width inside the vision encoder", at_least(1));
}

const ConfigSchema& model_config_schema() {
  static const ConfigSchema schema = [] {
    ConfigSchema s;
    add_model_keys(s);
    return s;
  }();
  return schema;
}

Result<ModelConfig> model_config_from(const Config& config) {
  auto where = [&config](std::string_view key) {
    const std::string& source = config.source(key);
    if (source == "default") return std::string("config (default)");
    return "config " + source;
  };
  ModelConfig c;
  c.name = config.get_string("model.name");
  c.hidden_size = config.get_int("model.hidden_size");
  c.vocab_size = config.get_int("model.vocab_size");
  c.num_layers = config.get_int("model.num_layers");
  auto mla_layers = parse_layer_list(config.get_string("model.mla_layers"));
  if (!mla_layers.ok()) {
    return invalid_argument("{}: {}", where("model.mla_layers"), mla_layers.status().message());
  }
  c.mla_layers = std::move(mla_layers).value();
  c.dense_layers = config.get_int("model.dense_layers");
  c.dense_ffn_width = config.get_int("model.dense_ffn_width");
  c.rms_norm_eps = config.get_double("model.rms_norm_eps");
  c.tie_embeddings = config.get_bool("model.tie_embeddings");
  c.mtp_layers = config.get_int("model.mtp_layers");
  c.situ_beta1 = config.get_double("model.situ_glu.beta1");
  c.situ_beta2 = config.get_double("model.situ_glu.beta2");
  c.attn_res_block_size = config.get_int("model.attn_res.block_size");

  c.kda.heads = config.get_int("model.kda.heads");
  c.kda.head_k_dim = config.get_int("model.kda.head_k_dim");
  c.kda.head_v_dim = config.get_int("model.kda.head_v_dim");
  c.kda.decay_rank = config.get_int("model.kda.decay_rank");
  c.kda.g_min = config.get_double("model.kda.g_min");
  c.kda.conv_width = config.get_int("model.kda.conv_width");
  c.kda.chunk_size = config.get_int("model.kda.chunk_size");
  c.kda.l2norm_eps = config.get_double("model.kda.l2norm_eps");

  c.mla.heads = config.get_int("model.mla.heads");
  c.mla.q_latent = config.get_int("model.mla.q_latent");
  c.mla.kv_latent = config.get_int("model.mla.kv_latent");
  c.mla.qk_nope_dim = config.get_int("model.mla.qk_nope_dim");
  c.mla.shared_key_dim = config.get_int("model.mla.shared_key_dim");
  c.mla.v_head_dim = config.get_int("model.mla.v_head_dim");

  c.moe.routed_experts = config.get_int("model.moe.routed_experts");
  c.moe.top_k = config.get_int("model.moe.top_k");
  c.moe.shared_experts = config.get_int("model.moe.shared_experts");
  c.moe.latent_width = config.get_int("model.moe.latent_width");
  c.moe.expert_ffn_width = config.get_int("model.moe.expert_ffn_width");
  c.moe.shared_ffn_width = config.get_int("model.moe.shared_ffn_width");
  c.moe.balancing.method = config.get_string("model.moe.balancing.method") == "sign" ? BalancingMethod::kSign
                                                                                     : BalancingMethod::kQuantile;
  c.moe.balancing.sign_gamma = config.get_double("model.moe.balancing.sign_gamma");
  c.moe.balancing.histogram_bins = config.get_int("model.moe.balancing.histogram_bins");
  c.moe.balancing.ema = config.get_double("model.moe.balancing.ema");

  c.vision.enabled = config.get_bool("model.vision.enabled");
  c.vision.patch_size = config.get_int("model.vision.patch_size");
  c.vision.channels = config.get_int("model.vision.channels");
  c.vision.width = config.get_int("model.vision.width");
  c.vision.depth = config.get_int("model.vision.depth");
  c.vision.heads = config.get_int("model.vision.heads");
  c.vision.ffn_width = config.get_int("model.vision.ffn_width");

  if (auto errors = check(c, where); !errors.empty()) {
    return Status(StatusCode::kInvalidArgument, join_lines(errors));
  }
  return c;
}

Result<ModelConfig> load_model_config(const std::vector<std::string>& files,
                                      const std::vector<std::string>& overrides) {
  ODY_ASSIGN_OR_RETURN(Config config, load_config(files, overrides, model_config_schema()));
  return model_config_from(config);
}

Status validate(const ModelConfig& config) {
  auto errors = check(config, [](std::string_view) { return std::string("model config"); });
  if (errors.empty()) return Status::Ok();
  return Status(StatusCode::kInvalidArgument, join_lines(errors));
}

// ---- Tensors ----

int64_t ModelTensor::numel() const {
  int64_t n = 1;
  for (int64_t size : shape) n *= size;
  return n;
}

namespace {

class TensorList {
 public:
  explicit TensorList(std::vector<ModelTensor>& out) : out_(out) {}
  void add(std::string name, std::vector<int64_t> shape, Component component, bool buffer = false) {
    out_.push_back({std::move(name), std::move(shape), component, buffer});
  }

 private:
  std::vector<ModelTensor>& out_;
};

void add_kda(TensorList& t, const ModelConfig& c, const std::string& p) {
  const KdaConfig& k = c.kda;
  const int64_t d = c.hidden_size;
  const int64_t qk = k.heads * k.head_k_dim;
  const int64_t v = k.heads * k.head_v_dim;
  const Component kda = Component::kKda;
  t.add(p + "A_log", {k.heads}, kda);
  t.add(p + "dt_bias", {qk}, kda);
  t.add(p + "q_proj.weight", {qk, d}, kda);
  t.add(p + "k_proj.weight", {qk, d}, kda);
  t.add(p + "v_proj.weight", {v, d}, kda);
  t.add(p + "q_conv1d.weight", {qk, 1, k.conv_width}, kda);
  t.add(p + "k_conv1d.weight", {qk, 1, k.conv_width}, kda);
  t.add(p + "v_conv1d.weight", {v, 1, k.conv_width}, kda);
  t.add(p + "b_proj.weight", {k.heads, d}, kda);
  t.add(p + "f_a_proj.weight", {k.decay_rank, d}, kda);
  t.add(p + "f_b_proj.weight", {qk, k.decay_rank}, kda);
  t.add(p + "g_proj.weight", {v, d}, kda);
  t.add(p + "o_proj.weight", {d, v}, kda);
  t.add(p + "o_norm.weight", {k.head_v_dim}, kda);
}

void add_mla(TensorList& t, const ModelConfig& c, const std::string& p) {
  const MlaConfig& m = c.mla;
  const int64_t d = c.hidden_size;
  const Component mla = Component::kMla;
  t.add(p + "q_down_proj.weight", {m.q_latent, d}, mla);
  t.add(p + "q_up_proj.weight", {m.heads * m.qk_head_dim(), m.q_latent}, mla);
  t.add(p + "kv_down_proj.weight", {m.cache_width(), d}, mla);
  t.add(p + "k_up_proj.weight", {m.heads * m.qk_nope_dim, m.kv_latent}, mla);
  t.add(p + "v_up_proj.weight", {m.heads * m.v_head_dim, m.kv_latent}, mla);
  t.add(p + "g_proj.weight", {m.heads * m.v_head_dim, d}, mla);
  t.add(p + "o_proj.weight", {d, m.heads * m.v_head_dim}, mla);
  t.add(p + "q_norm.weight", {m.q_latent}, mla);
  t.add(p + "kv_norm.weight", {m.kv_latent}, mla);
}

// A SiTU-GLU MLP in → width → in, optionally stacked `stack` times along a leading dim.
void add_glu(TensorList& t, const std::string& p, std::vector<int64_t> stack, int64_t in, int64_t width,
             Component component, const std::string& suffix) {
  auto shape = [&](int64_t rows, int64_t cols) {
    std::vector<int64_t> s = stack;
    s.push_back(rows);
    s.push_back(cols);
    return s;
  };
  t.add(p + "gate_proj" + suffix, shape(width, in), component);
  t.add(p + "up_proj" + suffix, shape(width, in), component);
  t.add(p + "down_proj" + suffix, shape(in, width), component);
}

void add_moe(TensorList& t, const ModelConfig& c, const std::string& p) {
  const MoeConfig& m = c.moe;
  const int64_t d = c.hidden_size;
  t.add(p + "router.weight", {m.routed_experts, d}, Component::kRouter);
  t.add(p + "router.bias", {m.routed_experts}, Component::kRouter, /*buffer=*/true);
  t.add(p + "latent_down.weight", {m.latent_width, d}, Component::kLatentProjections);
  t.add(p + "latent_up.weight", {d, m.latent_width}, Component::kLatentProjections);
  t.add(p + "latent_norm.weight", {m.latent_width}, Component::kLatentProjections);
  add_glu(t, p + "experts.", {m.routed_experts}, m.latent_width, m.expert_ffn_width, Component::kRoutedExperts, "");
  if (m.shared_experts > 0) {
    add_glu(t, p + "shared_experts.", {m.shared_experts}, d, m.shared_ffn_width, Component::kSharedExperts, "");
  }
}

void add_layer(TensorList& t, const ModelConfig& c, AttentionKind attention, FfnKind ffn, const std::string& p) {
  const int64_t d = c.hidden_size;
  t.add(p + "attn_mix", {d}, Component::kAttnResMix);
  t.add(p + "attn_norm.weight", {d}, Component::kLayerNorms);
  if (attention == AttentionKind::kKda) {
    add_kda(t, c, p + "attn.");
  } else {
    add_mla(t, c, p + "attn.");
  }
  t.add(p + "ffn_mix", {d}, Component::kAttnResMix);
  t.add(p + "ffn_norm.weight", {d}, Component::kLayerNorms);
  if (ffn == FfnKind::kDense) {
    add_glu(t, p + "ffn.", {}, d, c.dense_ffn_width, Component::kDenseFfn, ".weight");
  } else {
    add_moe(t, c, p + "moe.");
  }
}

void add_vision(TensorList& t, const ModelConfig& c) {
  const VisionConfig& v = c.vision;
  const int64_t w = v.width;
  const Component vision = Component::kVision;
  t.add("vision.patch_embed.weight", {w, v.channels * v.patch_size * v.patch_size}, vision);
  t.add("vision.patch_embed.bias", {w}, vision);
  for (int64_t j = 0; j < v.depth; ++j) {
    const std::string p = fmt::format("vision.layers.{}.", j);
    t.add(p + "attn_norm.weight", {w}, vision);
    for (const char* proj : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
      t.add(p + "attn." + proj + ".weight", {w, w}, vision);
    }
    t.add(p + "ffn_norm.weight", {w}, vision);
    add_glu(t, p + "ffn.", {}, w, v.ffn_width, vision, ".weight");
  }
  t.add("vision.norm.weight", {w}, vision);
  t.add("vision.proj.weight", {c.hidden_size, w}, vision);
}

}  // namespace

std::vector<ModelTensor> layer_tensors(const ModelConfig& config, int64_t layer, const std::string& prefix) {
  std::vector<ModelTensor> out;
  TensorList t(out);
  add_layer(t, config, config.attention_kind(layer), config.ffn_kind(layer), prefix);
  return out;
}

std::vector<ModelTensor> model_tensors(const ModelConfig& config) {
  const int64_t d = config.hidden_size;
  std::vector<ModelTensor> out;
  TensorList t(out);
  t.add("embed.weight", {config.vocab_size, d}, Component::kEmbedding);
  for (int64_t i = 0; i < config.num_layers; ++i) {
    add_layer(t, config, config.attention_kind(i), config.ffn_kind(i), fmt::format("layers.{}.", i));
  }
  t.add("out_mix", {d}, Component::kAttnResMix);
  t.add("norm.weight", {d}, Component::kFinalNorm);
  if (!config.tie_embeddings) t.add("lm_head.weight", {config.vocab_size, d}, Component::kLmHead);
  if (config.vision.enabled) add_vision(t, config);
  // An MTP layer has the kinds of the last trunk layer (MLA + MoE at full size).
  const int64_t last = config.num_layers - 1;
  for (int64_t j = 0; j < config.mtp_layers; ++j) {
    const std::string p = fmt::format("mtp.{}.", j);
    const size_t first = out.size();
    t.add(p + "embed_norm.weight", {d}, Component::kMtp);
    t.add(p + "hidden_norm.weight", {d}, Component::kMtp);
    t.add(p + "eh_proj.weight", {d, 2 * d}, Component::kMtp);
    add_layer(t, config, config.attention_kind(last), config.ffn_kind(last), p + "layer.");
    t.add(p + "norm.weight", {d}, Component::kMtp);
    for (size_t n = first; n < out.size(); ++n) out[n].component = Component::kMtp;
  }
  return out;
}

// ---- Counts ----

namespace {

// Parameters of `tensor` a token uses (MODEL.md's "active").
int64_t active_numel(const ModelConfig& config, const ModelTensor& tensor) {
  switch (tensor.component) {
    case Component::kEmbedding: return config.tie_embeddings ? tensor.numel() : 0;
    case Component::kVision:
    case Component::kMtp: return 0;
    case Component::kRoutedExperts: return tensor.numel() / config.moe.routed_experts * config.moe.top_k;
    default: return tensor.numel();
  }
}

}  // namespace

ParameterCounts count_parameters(const ModelConfig& config) {
  ParameterCounts counts;
  for (const ModelTensor& tensor : model_tensors(config)) {
    if (tensor.buffer) {
      counts.buffer_numel += tensor.numel();
      continue;
    }
    const auto c = static_cast<size_t>(tensor.component);
    counts.total_by_component[c] += tensor.numel();
    counts.active_by_component[c] += active_numel(config, tensor);
  }
  for (size_t c = 0; c < counts.total_by_component.size(); ++c) {
    counts.total_params += counts.total_by_component[c];
    counts.active_params += counts.active_by_component[c];
  }
  for (int64_t i = 0; i < config.num_layers; ++i) {
    const AttentionKind attention = config.attention_kind(i);
    const FfnKind ffn = config.ffn_kind(i);
    auto it = std::find_if(counts.layer_kinds.begin(), counts.layer_kinds.end(),
                           [&](const LayerKindCount& k) { return k.attention == attention && k.ffn == ffn; });
    if (it == counts.layer_kinds.end()) {
      LayerKindCount kind{attention, ffn};
      for (const ModelTensor& tensor : layer_tensors(config, i, "")) {
        if (tensor.buffer) continue;
        kind.params_per_layer += tensor.numel();
        kind.active_per_layer += active_numel(config, tensor);
      }
      it = counts.layer_kinds.insert(counts.layer_kinds.end(), kind);
    }
    ++it->layers;
  }
  return counts;
}

MemoryPlan plan_memory(const ModelConfig& config, const ParameterCounts& counts) {
  MemoryPlan plan;
  plan.weights_bf16_bytes = 2 * counts.total_params;
  plan.weights_fp32_bytes = 4 * counts.total_params;
  plan.adamw_state_bytes = 12 * counts.total_params;
  plan.mla_cache_bytes_per_token = config.num_mla_layers() * config.mla.cache_width() * 2;
  const KdaConfig& k = config.kda;
  const int64_t state = k.heads * k.head_k_dim * k.head_v_dim;
  const int64_t conv_tails = (k.conv_width - 1) * k.heads * (2 * k.head_k_dim + k.head_v_dim);
  plan.kda_state_bytes = config.num_kda_layers() * (state + conv_tails) * 4;
  return plan;
}

}  // namespace odyssey::model
