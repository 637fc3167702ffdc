#include "model/vision.h"

#include <cmath>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace odyssey::model {

namespace {

torch::nn::Linear linear(int64_t in, int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

VisionEncoderOptions vision_encoder_options(const ModelConfig& config) {
  VisionEncoderOptions o;
  o.patch_size = config.vision.patch_size;
  o.channels = config.vision.channels;
  o.width = config.vision.width;
  o.depth = config.vision.depth;
  o.heads = config.vision.heads;
  o.ffn_width = config.vision.ffn_width;
  o.hidden = config.hidden_size;
  o.rms_eps = config.rms_norm_eps;
  o.beta1 = config.situ_beta1;
  o.beta2 = config.situ_beta2;
  return o;
}

int64_t vision_num_patches(int64_t patch_size, int64_t height, int64_t width) {
  TORCH_CHECK(patch_size >= 1 && height >= 1 && width >= 1, "vision_num_patches: patch size (", patch_size,
              "), height (", height, ") and width (", width, ") must be positive");
  return ceil_div(height, patch_size) * ceil_div(width, patch_size);
}

// ---------------------------------------------------------------------------------------------
// VisionAttentionImpl

VisionAttentionImpl::VisionAttentionImpl(int64_t width, int64_t heads, int64_t attention_block)
    : width_(width), heads_(heads), attention_block_(attention_block) {
  TORCH_CHECK(width > 0 && heads > 0 && width % heads == 0 && attention_block > 0, "VisionAttention: width (",
              width, ") must be a positive multiple of heads (", heads, "), attention_block (", attention_block,
              ") positive");
  q_proj = register_module("q_proj", linear(width, width, false));
  k_proj = register_module("k_proj", linear(width, width, false));
  v_proj = register_module("v_proj", linear(width, width, false));
  o_proj = register_module("o_proj", linear(width, width, false));
}

at::Tensor VisionAttentionImpl::forward(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) == width_, "VisionAttention: x ", x.sizes(), " must be [B, N, ", width_,
              "]");
  const int64_t batch = x.size(0);
  const int64_t tokens = x.size(1);
  const int64_t head_dim = width_ / heads_;
  auto heads = [&](const at::Tensor& t) { return t.view({batch, tokens, heads_, head_dim}).transpose(1, 2); };
  const at::Tensor q = heads(q_proj(x));
  const at::Tensor k = heads(k_proj(x));
  const at::Tensor v = heads(v_proj(x));
  // causal_offset = N - 1: every query row sees every key (bidirectional).
  const at::Tensor o = blockwise_attention(q, k, v, 1.0 / std::sqrt(static_cast<double>(head_dim)),
                                           /*causal_offset=*/tokens - 1, attention_block_);
  return o_proj(o.transpose(1, 2).reshape({batch, tokens, width_}));
}

// ---------------------------------------------------------------------------------------------
// VisionLayerImpl

VisionLayerImpl::VisionLayerImpl(const VisionEncoderOptions& o) {
  attn_norm = register_module("attn_norm", RmsNorm(o.width, o.rms_eps));
  attn = register_module("attn", VisionAttention(o.width, o.heads, o.attention_block));
  ffn_norm = register_module("ffn_norm", RmsNorm(o.width, o.rms_eps));
  DenseFfnOptions ffn_options;
  ffn_options.hidden = o.width;
  ffn_options.ffn = o.ffn_width;
  ffn_options.beta1 = o.beta1;
  ffn_options.beta2 = o.beta2;
  ffn = register_module("ffn", DenseFfn(ffn_options));
}

at::Tensor VisionLayerImpl::forward(const at::Tensor& x) {
  const at::Tensor h = x + attn(attn_norm(x));
  return h + ffn(ffn_norm(h));
}

// ---------------------------------------------------------------------------------------------
// VisionEncoderImpl

VisionEncoderImpl::VisionEncoderImpl(const VisionEncoderOptions& options) : options_(options) {
  const VisionEncoderOptions& o = options_;
  TORCH_CHECK(o.patch_size > 0 && o.channels > 0 && o.width > 0 && o.depth > 0 && o.heads > 0 && o.ffn_width > 0 &&
                  o.hidden > 0,
              "VisionEncoder: sizes must be positive (patch_size ", o.patch_size, ", channels ", o.channels,
              ", width ", o.width, ", depth ", o.depth, ", heads ", o.heads, ", ffn_width ", o.ffn_width,
              ", hidden ", o.hidden, ")");
  TORCH_CHECK(o.width % o.heads == 0, "VisionEncoder: width (", o.width, ") must be a multiple of heads (", o.heads,
              ")");
  patch_embed = register_module("patch_embed", linear(o.channels * o.patch_size * o.patch_size, o.width, true));
  layers = register_module("layers", torch::nn::ModuleList());
  layer_list_.reserve(static_cast<size_t>(o.depth));
  for (int64_t j = 0; j < o.depth; ++j) {
    layer_list_.emplace_back(o);
    layers->push_back(layer_list_.back());
  }
  norm = register_module("norm", RmsNorm(o.width, o.rms_eps));
  proj = register_module("proj", linear(o.width, o.hidden, false));
}

at::Tensor VisionEncoderImpl::patchify(const at::Tensor& images) const {
  const int64_t p = options_.patch_size;
  TORCH_CHECK(images.dim() == 4 && images.size(1) == options_.channels && images.size(2) >= 1 &&
                  images.size(3) >= 1 && at::isFloatingType(images.scalar_type()),
              "VisionEncoder: images ", images.sizes(), " ", images.scalar_type(),
              " must be floating [B, ", options_.channels, ", H, W] with H, W >= 1");
  const int64_t batch = images.size(0);
  const int64_t rows = ceil_div(images.size(2), p);
  const int64_t cols = ceil_div(images.size(3), p);
  const int64_t pad_h = rows * p - images.size(2);
  const int64_t pad_w = cols * p - images.size(3);
  const at::Tensor padded =
      pad_h == 0 && pad_w == 0 ? images : at::constant_pad_nd(images, {0, pad_w, 0, pad_h}, 0.0);
  // [B, C, rows, P, cols, P] -> [B, rows, cols, C, P, P] -> [B, rows·cols, C·P·P]
  return padded.reshape({batch, options_.channels, rows, p, cols, p})
      .permute({0, 2, 4, 1, 3, 5})
      .reshape({batch, rows * cols, options_.channels * p * p});
}

at::Tensor VisionEncoderImpl::encode(const at::Tensor& images) {
  at::Tensor x = patch_embed(patchify(images).to(patch_embed->weight.scalar_type()));
  for (VisionLayer& layer : layer_list_) x = layer(x);
  return proj(norm(x));
}

}  // namespace odyssey::model
