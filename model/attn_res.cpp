#include "model/attn_res.h"

#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#ifdef ODYSSEY_WITH_CUDA_KERNELS
#include "kernels/norm_autograd.h"
#endif

namespace odyssey::model {

namespace {

void check_sources(const std::vector<at::Tensor>& sources, const at::Tensor& w) {
  TORCH_CHECK(!sources.empty(), "attn_res_mix: no sources");
  const at::Tensor& first = sources.front();
  TORCH_CHECK(first.defined() && first.dim() >= 1 && at::isFloatingType(first.scalar_type()),
              "attn_res_mix: sources must be floating tensors [..., d]");
  for (const at::Tensor& source : sources) {
    TORCH_CHECK(source.defined() && source.sizes() == first.sizes() && source.scalar_type() == first.scalar_type(),
                "attn_res_mix: every source must have the shape and dtype of the first (", first.sizes(), " ",
                first.scalar_type(), ")");
  }
  TORCH_CHECK(w.defined() && w.dim() == 1 && w.size(0) == first.size(-1), "attn_res_mix: w ",
              w.defined() ? w.sizes() : at::IntArrayRef{}, " must be [d] with d = ", first.size(-1));
}

at::ScalarType compute_dtype(const at::Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// [S, ..., d] in the compute dtype, and the softmax weights [S, ...].
std::pair<at::Tensor, at::Tensor> stacked_and_weights(const std::vector<at::Tensor>& sources, const at::Tensor& w,
                                                      double eps) {
  check_sources(sources, w);
  const at::ScalarType compute = compute_dtype(sources.front());
  const at::Tensor stacked = at::stack(sources).to(compute);
  const at::Tensor normed = stacked * at::rsqrt(stacked.pow(2).mean({-1}, /*keepdim=*/true) + eps);
  const at::Tensor logits = at::matmul(normed, w.to(compute));  // [S, ...]
  return {stacked, at::softmax(logits, /*dim=*/0)};
}

}  // namespace

at::Tensor attn_res_weights(const std::vector<at::Tensor>& sources, const at::Tensor& w, double eps) {
  return stacked_and_weights(sources, w, eps).second;
}

at::Tensor attn_res_mix(const std::vector<at::Tensor>& sources, const at::Tensor& w, double eps) {
#ifdef ODYSSEY_WITH_CUDA_KERNELS
  if (kernels::attn_res_mix_supported(sources, w)) return kernels::attn_res_mix_autograd(sources, w, eps);
#endif
  return attn_res_mix_reference(sources, w, eps);
}

at::Tensor attn_res_mix_reference(const std::vector<at::Tensor>& sources, const at::Tensor& w, double eps) {
  if (sources.size() == 1) {
    check_sources(sources, w);
    return sources.front();
  }
  const auto [stacked, weights] = stacked_and_weights(sources, w, eps);
  return (weights.unsqueeze(-1) * stacked).sum(0).to(sources.front().scalar_type());
}

// ---------------------------------------------------------------------------------------------
// AttnResStream

AttnResStream::AttnResStream(at::Tensor embedding, int64_t block_size, double eps)
    : embedding_(std::move(embedding)), block_size_(block_size), eps_(eps) {
  TORCH_CHECK(embedding_.defined() && embedding_.dim() >= 1 && at::isFloatingType(embedding_.scalar_type()),
              "AttnResStream: the embedding must be a floating tensor [..., d]");
  TORCH_CHECK(block_size_ >= 1, "AttnResStream: block_size must be at least 1, got ", block_size_);
}

void AttnResStream::begin_layer(int64_t layer) {
  TORCH_CHECK(layer == layer_ + 1, "AttnResStream: layers must be entered in order: expected layer ", layer_ + 1,
              ", got ", layer);
  layer_ = layer;
  if (attn_res_block_start(layer, block_size_) && running_.defined()) {
    completed_.push_back(std::move(running_));
    running_ = at::Tensor();
  }
}

at::Tensor AttnResStream::mix(const at::Tensor& w) const { return attn_res_mix(sources(), w, eps_); }

void AttnResStream::add(const at::Tensor& output) {
  TORCH_CHECK(output.defined() && output.sizes() == embedding_.sizes(), "AttnResStream::add: output ",
              output.defined() ? output.sizes() : at::IntArrayRef{}, " must have the embedding's shape ",
              embedding_.sizes());
  TORCH_CHECK(layer_ >= 0, "AttnResStream::add: call begin_layer(0) first");
  running_ = running_.defined() ? running_ + output : output.to(embedding_.scalar_type());
}

std::vector<at::Tensor> AttnResStream::sources() const {
  std::vector<at::Tensor> out;
  out.reserve(completed_.size() + 2);
  out.push_back(embedding_);
  out.insert(out.end(), completed_.begin(), completed_.end());
  if (running_.defined()) out.push_back(running_);
  return out;
}

int64_t AttnResStream::num_sources() const {
  return 1 + static_cast<int64_t>(completed_.size()) + (running_.defined() ? 1 : 0);
}

// ---------------------------------------------------------------------------------------------
// Modules

AttnResLayerMixImpl::AttnResLayerMixImpl(int64_t hidden) {
  TORCH_CHECK(hidden > 0, "AttnResLayerMix: hidden must be positive, got ", hidden);
  attn_mix = register_parameter("attn_mix", at::zeros({hidden}));
  ffn_mix = register_parameter("ffn_mix", at::zeros({hidden}));
}

AttentionResidualsImpl::AttentionResidualsImpl(const AttentionResidualsOptions& options) : options_(options) {
  TORCH_CHECK(options.hidden > 0 && options.num_layers > 0 && options.block_size > 0,
              "AttentionResiduals: hidden (", options.hidden, "), num_layers (", options.num_layers,
              ") and block_size (", options.block_size, ") must be positive");
  TORCH_CHECK(options.eps > 0, "AttentionResiduals: eps must be positive, got ", options.eps);
  layers_ = register_module("layers", torch::nn::ModuleList());
  layer_mixes_.reserve(static_cast<size_t>(options.num_layers));
  for (int64_t i = 0; i < options.num_layers; ++i) {
    layer_mixes_.emplace_back(options.hidden);
    layers_->push_back(layer_mixes_.back());
  }
  out_mix_ = register_parameter("out_mix", at::zeros({options.hidden}));
}

const AttnResLayerMixImpl& AttentionResidualsImpl::layer(int64_t layer) const {
  TORCH_CHECK(layer >= 0 && layer < options_.num_layers, "AttentionResiduals: layer ", layer, " is outside [0, ",
              options_.num_layers, ")");
  return *layer_mixes_[static_cast<size_t>(layer)];
}

const at::Tensor& AttentionResidualsImpl::attn_mix(int64_t layer_index) const { return layer(layer_index).attn_mix; }
const at::Tensor& AttentionResidualsImpl::ffn_mix(int64_t layer_index) const { return layer(layer_index).ffn_mix; }

AttnResStream AttentionResidualsImpl::stream(const at::Tensor& embedding) const {
  return AttnResStream(embedding, options_.block_size, options_.eps);
}

}  // namespace odyssey::model
