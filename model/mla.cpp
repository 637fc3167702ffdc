#include "model/mla.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

namespace odyssey::model {
namespace {

int64_t round_up(int64_t n, int64_t block) { return (n + block - 1) / block * block; }

torch::nn::Linear projection(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// MlaCache

at::Tensor MlaCache::tokens() const {
  TORCH_CHECK(latent.defined(), "MlaCache: used before initialisation (initial_cache)");
  return latent.narrow(1, 0, length);
}

void MlaCache::reserve(int64_t tokens) {
  TORCH_CHECK(latent.defined(), "MlaCache: used before initialisation (initial_cache)");
  if (tokens <= capacity()) return;
  at::Tensor grown = at::empty({batch(), round_up(tokens, std::max<int64_t>(capacity_block, 1)),
                                width()},
                               latent.options());
  grown.narrow(1, 0, length).copy_(this->tokens());
  latent = grown;
}

void MlaCache::append(const at::Tensor& rows) {
  TORCH_CHECK(latent.defined(), "MlaCache: used before initialisation (initial_cache)");
  TORCH_CHECK(rows.dim() == 3 && rows.size(0) == batch() && rows.size(2) == width(),
              "MlaCache::append: rows ", rows.sizes(), " do not fit a cache of batch ", batch(),
              " and width ", width());
  const int64_t n = rows.size(1);
  if (length + n > capacity()) reserve(std::max(length + n, capacity() + capacity() / 2));
  torch::NoGradGuard no_grad;
  latent.narrow(1, length, n).copy_(rows.detach());
  length += n;
}

std::map<std::string, at::Tensor> MlaCache::to_tensors() const {
  const at::Tensor filled = tokens();
  at::Tensor snapshot = at::empty(filled.sizes(), filled.options().device(at::kCPU));
  snapshot.copy_(filled.detach());
  return {{"latent", snapshot}};
}

Result<MlaCache> MlaCache::from_tensors(const std::map<std::string, at::Tensor>& tensors,
                                        const at::Device& device) {
  for (const auto& [name, tensor] : tensors) {
    if (name != "latent") {
      return invalid_argument("MLA cache: unexpected tensor '{}' (only 'latent' belongs)", name);
    }
  }
  const auto it = tensors.find("latent");
  if (it == tensors.end()) return invalid_argument("MLA cache: tensor 'latent' is missing");
  const at::Tensor& saved = it->second;
  if (!saved.defined() || saved.dim() != 3 || !at::isFloatingType(saved.scalar_type())) {
    return invalid_argument(
        "MLA cache: 'latent' must be a floating [batch, tokens, width] tensor, got {}",
        saved.defined() ? std::to_string(saved.dim()) + "-d " +
                              std::string(c10::toString(saved.scalar_type()))
                        : std::string("an undefined tensor"));
  }
  MlaCache cache;
  cache.latent = at::empty({saved.size(0), round_up(saved.size(1), cache.capacity_block),
                            saved.size(2)},
                           saved.options().device(device));
  cache.latent.narrow(1, 0, saved.size(1)).copy_(saved.detach());
  cache.length = saved.size(1);
  return cache;
}

// ---------------------------------------------------------------------------------------------
// GatedMlaImpl

GatedMlaImpl::GatedMlaImpl(const GatedMlaOptions& options) : options_(options) {
  const GatedMlaOptions& o = options_;
  TORCH_CHECK(o.hidden > 0 && o.heads > 0 && o.q_latent > 0 && o.kv_latent > 0 &&
                  o.head_dim > 0 && o.shared_dim >= 0 && o.v_dim > 0 && o.attention_block > 0,
              "GatedMla: sizes must be positive (hidden ", o.hidden, ", heads ", o.heads,
              ", q_latent ", o.q_latent, ", kv_latent ", o.kv_latent, ", head_dim ", o.head_dim,
              ", shared_dim ", o.shared_dim, ", v_dim ", o.v_dim, ", attention_block ",
              o.attention_block, ")");
  const int64_t qk = o.head_dim + o.shared_dim;
  q_down_proj = register_module("q_down_proj", projection(o.hidden, o.q_latent));
  q_up_proj = register_module("q_up_proj", projection(o.q_latent, o.heads * qk));
  kv_down_proj = register_module("kv_down_proj", projection(o.hidden, o.kv_latent + o.shared_dim));
  k_up_proj = register_module("k_up_proj", projection(o.kv_latent, o.heads * o.head_dim));
  v_up_proj = register_module("v_up_proj", projection(o.kv_latent, o.heads * o.v_dim));
  g_proj = register_module("g_proj", projection(o.hidden, o.heads * o.v_dim));
  o_proj = register_module("o_proj", projection(o.heads * o.v_dim, o.hidden));
  q_norm = register_module("q_norm", RmsNorm(o.q_latent, o.rms_eps));
  kv_norm = register_module("kv_norm", RmsNorm(o.kv_latent, o.rms_eps));
}

double GatedMlaImpl::attention_scale() const {
  return 1.0 / std::sqrt(double(options_.head_dim + options_.shared_dim));
}

GatedMlaImpl::Latents GatedMlaImpl::latents(const at::Tensor& x) {
  const GatedMlaOptions& o = options_;
  TORCH_CHECK(x.dim() == 3 && x.size(2) == o.hidden, "GatedMla: x must be [B, T, ", o.hidden,
              "], got ", x.sizes());
  const at::Tensor c_q = q_norm(q_down_proj(x));
  const at::Tensor q =
      q_up_proj(c_q).view({x.size(0), x.size(1), o.heads, o.head_dim + o.shared_dim});
  const at::Tensor down = kv_down_proj(x);
  const at::Tensor c_kv = kv_norm(down.narrow(-1, 0, o.kv_latent));
  return {q, at::cat({c_kv, down.narrow(-1, o.kv_latent, o.shared_dim)}, -1)};
}

std::pair<at::Tensor, at::Tensor> GatedMlaImpl::keys_values(const at::Tensor& kv_latent) {
  const GatedMlaOptions& o = options_;
  const int64_t B = kv_latent.size(0), T = kv_latent.size(1);
  const at::Tensor c_kv = kv_latent.narrow(-1, 0, o.kv_latent);
  const at::Tensor k_shared =
      kv_latent.narrow(-1, o.kv_latent, o.shared_dim).unsqueeze(2).expand({B, T, o.heads, o.shared_dim});
  const at::Tensor k_nope = k_up_proj(c_kv).view({B, T, o.heads, o.head_dim});
  const at::Tensor k = at::cat({k_nope, k_shared}, -1).transpose(1, 2).contiguous();
  const at::Tensor v = v_up_proj(c_kv).view({B, T, o.heads, o.v_dim}).transpose(1, 2).contiguous();
  return {k, v};
}

at::Tensor GatedMlaImpl::gated_output(const at::Tensor& x, const at::Tensor& o) {
  const at::Tensor gate = at::sigmoid(g_proj(x).to(o.scalar_type()));
  return o_proj((gate * o).to(x.scalar_type()));
}

void GatedMlaImpl::check_cache(const MlaCache& cache, const at::Tensor& x, const char* where) const {
  const int64_t width = options_.kv_latent + options_.shared_dim;
  TORCH_CHECK(cache.latent.defined(), "GatedMla::", where,
              ": the cache is not initialised (use initial_cache or MlaCache::from_tensors)");
  TORCH_CHECK(cache.width() == width && cache.batch() == x.size(0), "GatedMla::", where,
              ": cache [batch ", cache.batch(), ", width ", cache.width(),
              "] does not fit this layer and input (batch ", x.size(0), ", width ", width, ")");
  TORCH_CHECK(cache.latent.scalar_type() == q_norm->weight.scalar_type() &&
                  cache.latent.device() == q_norm->weight.device(),
              "GatedMla::", where, ": cache is ", cache.latent.scalar_type(), " on ",
              cache.latent.device(), " but the layer is ", q_norm->weight.scalar_type(), " on ",
              q_norm->weight.device());
}

at::Tensor GatedMlaImpl::forward(const at::Tensor& x) {
  const Latents lat = latents(x);
  const auto [k, v] = keys_values(lat.kv_latent);
  const at::Tensor q = lat.q.transpose(1, 2).contiguous();
  const at::Tensor o = blockwise_attention(q, k, v, attention_scale(), /*causal_offset=*/0,
                                           options_.attention_block, /*keep_compute_dtype=*/true);
  return gated_output(x, o.transpose(1, 2).reshape({x.size(0), x.size(1), -1}));
}

namespace {

// Whether a no-grad chunk of `chunk_tokens` queries costs less in the absorbed form.
bool absorbed_chunk_pays(const GatedMlaOptions& o, int64_t chunk_tokens) {
  // Multiply-adds per (query, cached key) pair and head. Absorbed: a score over Lkv + S and a
  // value sum over Lkv. Rebuilt keys: K + S and V, plus W_uk/W_uv applied to every cached token
  // once per chunk, (K + V)·Lkv per key shared by the chunk's queries.
  const double absorbed = double(o.kv_latent + o.shared_dim + o.kv_latent);
  const double rebuilt = double(o.head_dim + o.shared_dim + o.v_dim) +
                         double(o.head_dim + o.v_dim) * double(o.kv_latent) / double(chunk_tokens);
  return absorbed <= rebuilt;
}

// The absorbed form for queries q [B, T, H, K + S] that are the last T tokens of `cache`: the
// per-head attention output [B, T, H*V] before the gate, in the attention's compute dtype.
at::Tensor absorbed_attention(GatedMlaImpl& layer, const at::Tensor& q, const MlaCache& cache) {
  const GatedMlaOptions& o = layer.options();
  const int64_t B = q.size(0), T = q.size(1), H = o.heads;
  // Fold W_uk into the query: q_abs_h = W_uk_hᵀ q_nope_h, with W_uk_h = k_up_proj rows of head h.
  const at::Tensor w_uk = layer.k_up_proj->weight.view({H, o.head_dim, o.kv_latent});
  const at::Tensor q_nope = q.narrow(-1, 0, o.head_dim).permute({2, 0, 1, 3}).reshape({H, B * T, o.head_dim});
  const at::Tensor q_abs = at::matmul(q_nope, w_uk).view({H, B, T, o.kv_latent}).permute({1, 0, 2, 3});
  const at::Tensor q_full =
      at::cat({q_abs, q.narrow(-1, o.head_dim, o.shared_dim).transpose(1, 2)}, -1);  // [B,H,T,Lkv+S]

  // One key [c_kv ; k_shared] and one value c_kv per token, shared by every head.
  const at::Tensor keys = cache.tokens().unsqueeze(1);                   // [B, 1, L, Lkv + S]
  const at::Tensor values = keys.narrow(-1, 0, o.kv_latent);             // [B, 1, L, Lkv]
  const at::Tensor attended =
      blockwise_attention(q_full, keys, values, layer.attention_scale(),
                          /*causal_offset=*/cache.length - T, o.attention_block,
                          /*keep_compute_dtype=*/true);                  // [B, H, T, Lkv]

  // W_uv after attention, in the parameters' dtype: o_h = W_uv_h · attended_h.
  const at::Tensor w_uv = layer.v_up_proj->weight.view({H, o.v_dim, o.kv_latent});
  const at::Tensor per_head = attended.to(w_uv.scalar_type()).transpose(0, 1).reshape({H, B * T, o.kv_latent});
  const at::Tensor o_heads = at::matmul(per_head, w_uv.transpose(1, 2))    // [H, B*T, V]
                                 .view({H, B, T, o.v_dim})
                                 .permute({1, 2, 0, 3})
                                 .reshape({B, T, H * o.v_dim});
  return o_heads.to(attended.scalar_type());
}

}  // namespace

at::Tensor GatedMlaImpl::forward_chunk(const at::Tensor& x, MlaCache& cache) {
  check_cache(cache, x, "forward_chunk");
  const Latents lat = latents(x);
  if (!at::GradMode::is_enabled() && absorbed_chunk_pays(options_, x.size(1))) {
    cache.append(lat.kv_latent);
    return gated_output(x, absorbed_attention(*this, lat.q, cache));
  }
  const int64_t past = cache.length;
  // The chunk's own latents keep their graph; the cached ones are constants.
  const at::Tensor all =
      past == 0 ? lat.kv_latent : at::cat({cache.tokens().detach(), lat.kv_latent}, 1);
  cache.append(lat.kv_latent);
  const auto [k, v] = keys_values(all);
  const at::Tensor q = lat.q.transpose(1, 2).contiguous();
  const at::Tensor o = blockwise_attention(q, k, v, attention_scale(), /*causal_offset=*/past,
                                           options_.attention_block, /*keep_compute_dtype=*/true);
  return gated_output(x, o.transpose(1, 2).reshape({x.size(0), x.size(1), -1}));
}

at::Tensor GatedMlaImpl::step(const at::Tensor& x_t, MlaCache& cache) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(x_t.dim() == 2, "GatedMla::step: x_t must be [B, hidden], got ", x_t.sizes());
  const at::Tensor x = x_t.unsqueeze(1);
  check_cache(cache, x, "step");
  const Latents lat = latents(x);
  cache.append(lat.kv_latent);
  return gated_output(x, absorbed_attention(*this, lat.q, cache)).squeeze(1);
}

MlaCache GatedMlaImpl::initial_cache(int64_t batch, int64_t reserve_tokens) const {
  MlaCache cache;
  cache.latent = at::empty({batch, 0, options_.kv_latent + options_.shared_dim},
                           q_norm->weight.options());
  cache.reserve(reserve_tokens);
  return cache;
}

}  // namespace odyssey::model
