// Block attention residuals (../../shared/design/MODEL.md, "Block attention residuals"). The
// residual stream is replaced by softmax attention over depth: each mix point has one learned
// vector w [d] (no projections, no temperature), and per token
//
//     h = Σ_s softmax_s(⟨RMSNorm(src_s), w⟩) · src_s
//
// over the sources [token embedding, sum of each completed block, running sum of the current
// block]. The RMSNorm here has no weight (a weight would fold into w; model/config.h), eps from
// the model config. With blocks of B layers (layer i starts a block iff i % B == 0), a layer is
//
//     at block start: push the running sum as a completed block; start a new (empty) running sum
//     h = mix(sources, w_attn)             (the identity while the embedding is the only source)
//     a = attention(RMSNorm(h));  running += a
//     h = mix(sources, w_ffn)
//     f = ffn(RMSNorm(h));        running += f
//   and after the last layer: h = mix(sources, w_out); RMSNorm; LM head.
// An empty running sum is not a source (a zero vector would take probability mass), so layer 0's
// attention input is the embedding itself, a block's first attention mixes only the embedding
// and the completed blocks, and the last mix sees 1 + ceil(layers / B) sources (9 at full size:
// ModelConfig::attn_res_max_sources()).
//
// Every source is per token, so the mixes are per-token math: a whole sequence [B, T, d], a
// chunk [B, Tc, d] and one decode token [B, 1, d] go through the same AttnResStream calls and
// give the same numbers per token (the layers' own state, KV caches and recurrent states, is
// theirs, not the stream's). The stream is the bookkeeping of one forward pass over one set of
// tokens; it keeps the block sums only while that pass runs (nothing carries over to the next
// chunk or token).
//
// Numerics: mixing logits, the softmax and the weighted sum are computed in fp32 (fp64 when the
// sources are fp64) and the result is cast back to the sources' dtype. Everything is
// differentiable in the sources and in w (one source: the identity, no graph to w).
//
// Parameter names of AttentionResiduals (stable: they are the checkpoint's tensor names,
// model_tensors() in model/config.h, when the module sits at the root of the model):
//   layers.{i}.attn_mix [d]   w_attn of zero-based layer i
//   layers.{i}.ffn_mix  [d]   w_ffn of layer i
//   out_mix             [d]   w_out, before the final norm
// (named_parameters() lists out_mix first: LibTorch puts a module's own parameters before its
// children's; model_tensors() lists it after the layers.)
// All are initialised to zero: every mix starts as the uniform average of its sources.
// layers.0.attn_mix exists (the tensor list names it) but gets no gradient: layer 0's attention
// has a single source.
//
// Thread-safety: attn_res_mix is a pure function; an AttnResStream belongs to one caller; the
// module's forward-side accessors only read.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

namespace odyssey::model {

// True iff zero-based `layer` starts a block of `block_size` layers.
inline bool attn_res_block_start(int64_t layer, int64_t block_size) { return layer % block_size == 0; }

// softmax_s(⟨RMSNorm(src_s), w⟩) as a tensor [S, ...] (the sources' leading shape), in the
// compute dtype (fp32, or fp64 for fp64 sources). sources: S ≥ 1 tensors of one shape [..., d]
// and one floating dtype; w [d].
at::Tensor attn_res_weights(const std::vector<at::Tensor>& sources, const at::Tensor& w, double eps);

// h = Σ_s softmax_s(⟨RMSNorm(src_s), w⟩) · src_s, [..., d] in the sources' dtype. One source is
// returned as it is. On the GPU build, 2 to 32 CUDA bf16 / fp32 sources of width <= 1024 take the
// fused kernels (kernels/norm_autograd.h: one kernel forward, two backward, recorded for
// autograd); everything else, and what the tests compare against, is attn_res_mix_reference
// (LibTorch ops).
at::Tensor attn_res_mix(const std::vector<at::Tensor>& sources, const at::Tensor& w, double eps);
at::Tensor attn_res_mix_reference(const std::vector<at::Tensor>& sources, const at::Tensor& w, double eps);

// The sources of one forward pass. Call begin_layer(0), (mix, add, mix, add), begin_layer(1), ...
// in layer order, then mix(w_out) for the final mix:
//
//   AttnResStream stream(embedded, block_size, eps);            // embedded [..., d]
//   for (int64_t i = 0; i < layers; ++i) {
//     stream.begin_layer(i);
//     stream.add(attention[i](attn_norm[i](stream.mix(attn_res->attn_mix(i)))));
//     stream.add(ffn[i](ffn_norm[i](stream.mix(attn_res->ffn_mix(i)))));
//   }
//   logits = lm_head(norm(stream.mix(attn_res->out_mix())));
class AttnResStream {
 public:
  // embedding [..., d]: the token embeddings, the first source. block_size ≥ 1.
  AttnResStream(at::Tensor embedding, int64_t block_size, double eps);

  // Enters zero-based `layer`, which must be the next one (0 first). At a block start the running
  // sum, if any, becomes a completed block and the running sum restarts empty.
  void begin_layer(int64_t layer);

  // The mix of the current sources with w [d] (attn_res_mix).
  at::Tensor mix(const at::Tensor& w) const;

  // running += output (output [..., d], the shape of the embedding). Out of place: tensors
  // handed out before (sources(), running()) keep their values.
  void add(const at::Tensor& output);

  // [embedding, completed blocks in order, running sum if not empty].
  std::vector<at::Tensor> sources() const;
  int64_t num_sources() const;

  int64_t layer() const { return layer_; }  // the current layer; -1 before begin_layer(0)
  int64_t block_size() const { return block_size_; }
  const at::Tensor& embedding() const { return embedding_; }
  const std::vector<at::Tensor>& completed_blocks() const { return completed_; }
  const at::Tensor& running() const { return running_; }  // undefined while empty

 private:
  at::Tensor embedding_;
  std::vector<at::Tensor> completed_;
  at::Tensor running_;
  int64_t block_size_;
  double eps_;
  int64_t layer_ = -1;
};

struct AttentionResidualsOptions {
  int64_t hidden = 0;      // d
  int64_t num_layers = 0;  // layers of the trunk
  int64_t block_size = 0;  // layers per block (model.attn_res.block_size)
  double eps = 1e-5;       // of the source RMSNorm (model.rms_norm_eps)
};

// The two mix vectors of one layer: parameters attn_mix [d] and ffn_mix [d].
class AttnResLayerMixImpl : public torch::nn::Module {
 public:
  explicit AttnResLayerMixImpl(int64_t hidden);

  at::Tensor attn_mix;
  at::Tensor ffn_mix;
};
TORCH_MODULE(AttnResLayerMix);

// Every learned vector of the block attention residuals: layers.{i}.{attn_mix,ffn_mix}, out_mix.
class AttentionResidualsImpl : public torch::nn::Module {
 public:
  explicit AttentionResidualsImpl(const AttentionResidualsOptions& options);

  const at::Tensor& attn_mix(int64_t layer) const;
  const at::Tensor& ffn_mix(int64_t layer) const;
  const at::Tensor& out_mix() const { return out_mix_; }

  // A stream over `embedding` [..., d] with this module's block size and eps.
  AttnResStream stream(const at::Tensor& embedding) const;

  const AttentionResidualsOptions& options() const { return options_; }

 private:
  const AttnResLayerMixImpl& layer(int64_t layer) const;

  AttentionResidualsOptions options_;
  torch::nn::ModuleList layers_{nullptr};
  std::vector<AttnResLayerMix> layer_mixes_;
  at::Tensor out_mix_;
};
TORCH_MODULE(AttentionResiduals);

}  // namespace odyssey::model
