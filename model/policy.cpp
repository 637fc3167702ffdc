#include "model/policy.h"

#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "model/attn_res.h"

namespace odyssey::model {

namespace {

MoeRouting detached(const MoeRouting& r) {
  return {r.scores.detach(), r.selected.detach(), r.weights.detach()};
}

}  // namespace

IncrementalAttentionOptions kda_options(const ModelConfig& c) {
  IncrementalAttentionOptions o;
  o.hidden = c.hidden_size;
  o.heads = c.kda.heads;
  o.head_k_dim = c.kda.head_k_dim;
  o.head_v_dim = c.kda.head_v_dim;
  o.decay_rank = c.kda.decay_rank;
  o.g_min = c.kda.g_min;
  o.conv_width = c.kda.conv_width;
  o.chunk = c.kda.chunk_size;
  return o;
}

GatedMlaOptions mla_options(const ModelConfig& c) {
  GatedMlaOptions o;
  o.hidden = c.hidden_size;
  o.heads = c.mla.heads;
  o.q_latent = c.mla.q_latent;
  o.kv_latent = c.mla.kv_latent;
  o.head_dim = c.mla.qk_nope_dim;
  o.shared_dim = c.mla.shared_key_dim;
  o.v_dim = c.mla.v_head_dim;
  o.rms_eps = c.rms_norm_eps;
  return o;
}

DenseFfnOptions dense_options(const ModelConfig& c) {
  DenseFfnOptions o;
  o.hidden = c.hidden_size;
  o.ffn = c.dense_ffn_width;
  o.beta1 = c.situ_beta1;
  o.beta2 = c.situ_beta2;
  return o;
}

MoeOptions moe_options(const ModelConfig& c) {
  MoeOptions o;
  o.hidden = c.hidden_size;
  o.latent = c.moe.latent_width;
  o.expert_ffn = c.moe.expert_ffn_width;
  o.num_experts = c.moe.routed_experts;
  o.top_k = c.moe.top_k;
  o.num_shared = c.moe.shared_experts;
  o.shared_ffn = c.moe.shared_ffn_width;
  o.eps = c.rms_norm_eps;
  o.situ_beta1 = c.situ_beta1;
  o.situ_beta2 = c.situ_beta2;
  return o;
}

PolicyLayerImpl::PolicyLayerImpl(const ModelConfig& config, int64_t layer)
    : attention_kind_(config.attention_kind(layer)), ffn_kind_(config.ffn_kind(layer)) {
  const int64_t d = config.hidden_size;
  attn_mix = register_parameter("attn_mix", at::zeros({d}));
  attn_norm = register_module("attn_norm", RmsNorm(d, config.rms_norm_eps));
  if (attention_kind_ == AttentionKind::kKda) {
    kda = register_module("attn", IncrementalAttention(kda_options(config)));
  } else {
    mla = register_module("attn", GatedMla(mla_options(config)));
  }
  ffn_mix = register_parameter("ffn_mix", at::zeros({d}));
  ffn_norm = register_module("ffn_norm", RmsNorm(d, config.rms_norm_eps));
  if (ffn_kind_ == FfnKind::kDense) {
    ffn = register_module("ffn", DenseFfn(dense_options(config)));
  } else {
    moe = register_module("moe", Moe(moe_options(config)));
  }
}

PolicyImpl::PolicyImpl(const ModelConfig& config) : config_(config) {
  const Status status = validate(config);
  TORCH_CHECK(status.ok(), "Policy: invalid model config: ", status.message());
  TORCH_CHECK(!config.tie_embeddings, "Policy: tie_embeddings is not supported yet");
  TORCH_CHECK(config.mtp_layers == 0, "Policy: MTP layers are not built yet (model.mtp_layers = ",
              config.mtp_layers, ")");
  const int64_t d = config.hidden_size;
  embed = register_module("embed", torch::nn::Embedding(torch::nn::EmbeddingOptions(config.vocab_size, d)));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.num_layers; ++i) {
    PolicyLayer layer(config, i);
    layers->push_back(layer);
    layer_list_.push_back(layer);
    if (layer->ffn_kind() == FfnKind::kMoe) moe_layers_.push_back(i);
  }
  out_mix = register_parameter("out_mix", at::zeros({d}));
  norm = register_module("norm", RmsNorm(d, config.rms_norm_eps));
  lm_head = register_module("lm_head",
                            torch::nn::Linear(torch::nn::LinearOptions(d, config.vocab_size).bias(false)));
  if (config.vision.enabled) {
    vision = register_module("vision", VisionEncoder(vision_encoder_options(config)));
  }
  last_routing_.resize(static_cast<size_t>(config.num_layers));
}

at::Tensor PolicyImpl::embed_tokens(const at::Tensor& tokens, const at::Tensor& image_embeddings,
                                    const at::Tensor& image_mask) {
  at::Tensor x = embed->forward(tokens);
  TORCH_CHECK(image_embeddings.defined() == image_mask.defined(),
              "Policy: pass image_embeddings and image_mask together");
  if (!image_mask.defined()) return x;
  TORCH_CHECK(image_mask.sizes() == tokens.sizes(), "Policy: image_mask ", image_mask.sizes(),
              " must have the tokens' shape ", tokens.sizes());
  const at::Tensor mask = image_mask.to(at::kBool);
  const int64_t n = mask.sum().item<int64_t>();
  TORCH_CHECK(image_embeddings.dim() == 2 && image_embeddings.size(0) == n &&
                  image_embeddings.size(1) == config_.hidden_size,
              "Policy: image_embeddings must be [", n, ", ", config_.hidden_size, "] (one row per masked position), got ",
              image_embeddings.sizes());
  return x.masked_scatter(mask.unsqueeze(-1), image_embeddings.to(x.scalar_type()));
}

at::Tensor PolicyImpl::run(const at::Tensor& embedded, PolicyState* state, Mode mode) {
  AttnResStream stream(embedded, config_.attn_res_block_size, config_.rms_norm_eps);
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    PolicyLayerImpl& layer = *layer_list_[static_cast<size_t>(i)];
    stream.begin_layer(i);
    const at::Tensor a_in = layer.attn_norm->forward(stream.mix(layer.attn_mix));
    at::Tensor a;
    if (layer.attention_kind() == AttentionKind::kKda) {
      switch (mode) {
        case Mode::kParallel: a = layer.kda->forward(a_in); break;
        case Mode::kChunk: a = layer.kda->forward_chunk(a_in, state->kda[static_cast<size_t>(i)]); break;
        case Mode::kStep: a = layer.kda->step(a_in, state->kda[static_cast<size_t>(i)]); break;
      }
    } else {
      switch (mode) {
        case Mode::kParallel: a = layer.mla->forward(a_in); break;
        case Mode::kChunk: a = layer.mla->forward_chunk(a_in, state->mla[static_cast<size_t>(i)]); break;
        case Mode::kStep: a = layer.mla->step(a_in, state->mla[static_cast<size_t>(i)]); break;
      }
    }
    stream.add(a);
    const at::Tensor f_in = layer.ffn_norm->forward(stream.mix(layer.ffn_mix));
    if (layer.ffn_kind() == FfnKind::kDense) {
      stream.add(layer.ffn->forward(f_in));
    } else {
      MoeOutput out = layer.moe->forward(f_in);
      last_routing_[static_cast<size_t>(i)] = detached(out.routing);
      stream.add(out.y);
    }
  }
  return lm_head->forward(norm->forward(stream.mix(out_mix)));
}

at::Tensor PolicyImpl::forward(const at::Tensor& tokens, const at::Tensor& image_embeddings,
                               const at::Tensor& image_mask) {
  TORCH_CHECK(tokens.dim() == 2, "Policy::forward: tokens must be [B, T], got ", tokens.sizes());
  return run(embed_tokens(tokens, image_embeddings, image_mask), nullptr, Mode::kParallel);
}

at::Tensor PolicyImpl::forward_chunk(const at::Tensor& tokens, PolicyState& state,
                                     const at::Tensor& image_embeddings, const at::Tensor& image_mask) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) >= 1, "Policy::forward_chunk: tokens must be [B, t], t >= 1, got ",
              tokens.sizes());
  TORCH_CHECK(tokens.size(0) == state.batch, "Policy::forward_chunk: batch ", tokens.size(0),
              " does not match the state's batch ", state.batch);
  at::Tensor logits = run(embed_tokens(tokens, image_embeddings, image_mask), &state, Mode::kChunk);
  state.tokens += tokens.size(1);
  return logits;
}

at::Tensor PolicyImpl::step(const at::Tensor& tokens, PolicyState& state, const at::Tensor& image_embeddings,
                            const at::Tensor& image_mask) {
  TORCH_CHECK(tokens.dim() == 1, "Policy::step: tokens must be [B], got ", tokens.sizes());
  TORCH_CHECK(tokens.size(0) == state.batch, "Policy::step: batch ", tokens.size(0),
              " does not match the state's batch ", state.batch);
  c10::NoGradGuard no_grad;
  at::Tensor logits = run(embed_tokens(tokens, image_embeddings, image_mask), &state, Mode::kStep);
  state.tokens += 1;
  return logits;
}

PolicyState PolicyImpl::initial_state(int64_t batch, int64_t reserve_tokens) const {
  PolicyState state;
  state.batch = batch;
  state.kda.resize(static_cast<size_t>(config_.num_layers));
  state.mla.resize(static_cast<size_t>(config_.num_layers));
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    const PolicyLayerImpl& layer = *layer_list_[static_cast<size_t>(i)];
    if (layer.attention_kind() == AttentionKind::kKda) {
      state.kda[static_cast<size_t>(i)] = layer.kda->initial_state(batch);
    } else {
      state.mla[static_cast<size_t>(i)] = layer.mla->initial_cache(batch, reserve_tokens);
    }
  }
  return state;
}

std::vector<at::Tensor> PolicyImpl::last_selected_experts() const {
  std::vector<at::Tensor> out;
  out.reserve(moe_layers_.size());
  for (int64_t i : moe_layers_) out.push_back(last_routing_[static_cast<size_t>(i)].selected);
  return out;
}

void PolicyImpl::set_expert_bias(int64_t layer, const at::Tensor& bias) {
  TORCH_CHECK(layer >= 0 && layer < config_.num_layers, "Policy::set_expert_bias: layer ", layer,
              " out of range [0, ", config_.num_layers, ")");
  PolicyLayerImpl& l = *layer_list_[static_cast<size_t>(layer)];
  TORCH_CHECK(l.ffn_kind() == FfnKind::kMoe, "Policy::set_expert_bias: layer ", layer, " is not a MoE layer");
  l.moe->set_expert_bias(bias);
}

void PolicyImpl::set_expert_biases(const std::vector<at::Tensor>& biases) {
  TORCH_CHECK(biases.size() == moe_layers_.size(), "Policy::set_expert_biases: got ", biases.size(),
              " biases for ", moe_layers_.size(), " MoE layers");
  for (size_t j = 0; j < biases.size(); ++j) set_expert_bias(moe_layers_[j], biases[j]);
}

}  // namespace odyssey::model
