// The policy: the whole language model of ../../shared/design/MODEL.md built from a ModelConfig
// (model/config.h), out of the layer modules of this folder.
//
//   x = embed(tokens)                         (untied; optionally image patch embeddings replace
//                                              the rows of image-patch positions)
//   for layer i = 0 .. L-1 (block attention residuals, model/attn_res.h):
//     stream.begin_layer(i)
//     stream.add(attn_i(attn_norm_i(stream.mix(attn_mix_i))))   attn: KDA or MLA per
//     stream.add(ffn_i(ffn_norm_i(stream.mix(ffn_mix_i))))      config.attention_kind(i); ffn:
//                                                               dense or MoE per config.ffn_kind(i)
//   logits = lm_head(norm(stream.mix(out_mix)))
//
// Three forms that agree (the tests check it in fp64):
//   forward(tokens [B, T])                  the whole sequence in parallel -> logits [B, T, V]
//   forward_chunk(tokens [B, t], state)     a chunk continuing `state` (KDA states and MLA caches
//                                           carried) -> logits [B, t, V]
//   step(tokens [B], state)                 one token per sequence -> logits [B, V] (no autograd)
// forward and forward_chunk are differentiable (forward_chunk: see kda.h / mla.h for what the
// carried state keeps).
//
// Parameter names are exactly model_tensors(config) (model/config.h), every mix vector inside
// its trunk layer (layers.{i}.attn_mix, layers.{i}.ffn_mix) rather than in an
// AttentionResiduals module (whose own `layers.{i}` list would collide with the trunk's):
//   embed.weight, layers.{i}.{attn_mix, attn_norm.weight, attn.*, ffn_mix, ffn_norm.weight,
//   ffn.* | moe.*}, out_mix, norm.weight, lm_head.weight, vision.* (when vision is enabled).
// The MoE balancing biases layers.{i}.moe.router.bias are buffers. Tied embeddings and MTP
// layers are not built (the constructor rejects them).
//
// Routing: every forward form records, per MoE layer, the routing of its last call (detached:
// scores, selected experts, mixing weights, tokens in row-major order of the call's input), so
// that actors can store the selected experts and balancers can read the scores.
//
// Thread-safety: the forms only read the parameters but write the recorded routing, so one
// Policy runs one forward at a time; a PolicyState belongs to one caller.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "model/config.h"
#include "model/ffn.h"
#include "model/kda.h"
#include "model/mla.h"
#include "model/moe.h"
#include "model/rms_norm.h"
#include "model/vision.h"

namespace odyssey::model {

// One trunk layer: mix vectors, pre-norms, attention (one of kda / mla) and FFN (one of ffn /
// moe). Registered names: attn_mix, attn_norm, attn, ffn_mix, ffn_norm, ffn | moe.
class PolicyLayerImpl : public torch::nn::Module {
 public:
  PolicyLayerImpl(const ModelConfig& config, int64_t layer);

  AttentionKind attention_kind() const { return attention_kind_; }
  FfnKind ffn_kind() const { return ffn_kind_; }

  at::Tensor attn_mix;
  at::Tensor ffn_mix;
  RmsNorm attn_norm{nullptr};
  RmsNorm ffn_norm{nullptr};
  IncrementalAttention kda{nullptr};  // registered as "attn" when the layer is KDA
  GatedMla mla{nullptr};              // registered as "attn" when the layer is MLA
  DenseFfn ffn{nullptr};              // registered as "ffn" when the layer is dense
  Moe moe{nullptr};                   // registered as "moe" when the layer is MoE

 private:
  AttentionKind attention_kind_;
  FfnKind ffn_kind_;
};
TORCH_MODULE(PolicyLayer);

// What the policy carries between forward_chunk / step calls, for a batch of sequences that
// advance in lockstep. Indexed by zero-based layer: kda[i] is defined for KDA layers, mla[i] for
// MLA layers (the other entry of a layer stays empty).
struct PolicyState {
  std::vector<KdaState> kda;
  std::vector<MlaCache> mla;
  int64_t batch = 0;
  int64_t tokens = 0;  // tokens consumed so far
};

// Each layer kind's options as the policy builds them from a model config (also what
// `odyssey bench model` measures, so the bench runs exactly the policy's layers).
IncrementalAttentionOptions kda_options(const ModelConfig& config);
GatedMlaOptions mla_options(const ModelConfig& config);
DenseFfnOptions dense_options(const ModelConfig& config);
MoeOptions moe_options(const ModelConfig& config);

class PolicyImpl : public torch::nn::Module {
 public:
  // Checks the config (validate()); throws c10::Error on an invalid config, on
  // tie_embeddings or on mtp_layers > 0 (not built yet).
  explicit PolicyImpl(const ModelConfig& config);

  // tokens int64 [B, T] -> logits [B, T, V] in the parameters' dtype.
  // Optional vision input: image_mask bool [B, T] marks the image-patch positions and
  // image_embeddings [N, d] (N = image_mask.sum(), row-major order of the mask; e.g. the
  // vision encoder's output flattened) replaces the token embeddings there. Pass both or
  // neither.
  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& image_embeddings = {},
                     const at::Tensor& image_mask = {});
  // tokens [B, t] (t >= 1) continuing `state` -> logits [B, t, V]; `state` advances by t.
  at::Tensor forward_chunk(const at::Tensor& tokens, PolicyState& state, const at::Tensor& image_embeddings = {},
                           const at::Tensor& image_mask = {});
  // tokens [B] -> logits [B, V]; `state` advances by one. Runs without autograd. Vision: mask
  // bool [B], image_embeddings [N, d] as above.
  at::Tensor step(const at::Tensor& tokens, PolicyState& state, const at::Tensor& image_embeddings = {},
                  const at::Tensor& image_mask = {});

  // A fresh state (sequence start) for `batch` sequences, MLA caches with room for
  // `reserve_tokens` tokens.
  PolicyState initial_state(int64_t batch, int64_t reserve_tokens = 0) const;

  // Token embeddings [..., d] of tokens [...], with image embeddings placed as in forward.
  at::Tensor embed_tokens(const at::Tensor& tokens, const at::Tensor& image_embeddings = {},
                          const at::Tensor& image_mask = {});

  // ---- MoE routing and balancing ----
  // Zero-based indices of the MoE layers, ascending.
  const std::vector<int64_t>& moe_layers() const { return moe_layers_; }
  // The routing of the last forward / forward_chunk / step, indexed by zero-based layer (dense
  // layers: undefined tensors; before any call: all undefined). Detached. For an input of m
  // tokens (B·T in row-major order) selected is int64 [m, top_k].
  const std::vector<MoeRouting>& last_routing() const { return last_routing_; }
  // Just the selected experts of each MoE layer (in moe_layers() order), [m, top_k] each.
  std::vector<at::Tensor> last_selected_experts() const;
  // Sets the balancing bias [E] of MoE layer `layer` (zero-based trunk index).
  void set_expert_bias(int64_t layer, const at::Tensor& bias);
  // One bias per MoE layer, in moe_layers() order.
  void set_expert_biases(const std::vector<at::Tensor>& biases);

  const ModelConfig& config() const { return config_; }
  int64_t num_layers() const { return config_.num_layers; }
  PolicyLayer& layer(int64_t i) { return layer_list_.at(static_cast<size_t>(i)); }

  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList layers{nullptr};  // of PolicyLayer
  at::Tensor out_mix;
  RmsNorm norm{nullptr};
  torch::nn::Linear lm_head{nullptr};
  VisionEncoder vision{nullptr};  // null when vision is disabled

 private:
  enum class Mode { kParallel, kChunk, kStep };
  at::Tensor run(const at::Tensor& embedded, PolicyState* state, Mode mode);

  ModelConfig config_;
  std::vector<PolicyLayer> layer_list_;
  std::vector<int64_t> moe_layers_;
  std::vector<MoeRouting> last_routing_;
};
TORCH_MODULE(Policy);

}  // namespace odyssey::model
