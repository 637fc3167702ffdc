// The patch embedding and vision encoder (../../shared/design/MODEL.md, "Vision"): images enter
// the token stream as patch embeddings, one per <|image_patch|> token between <|image|> and
// <|/image|> (core/tokenizer.h), at the position where the prompt or the environment put them.
//
// For images [B, C, H, W] (floats in [0, 1]; not checked), patch size P, encoder width Wd,
// `depth` layers, LM hidden width d:
//   1. pad:        H and W are padded at the bottom and the right with zeros (black) up to
//                  multiples of P; the padded pixels are part of the last row/column of patches.
//   2. patchify:   patches in row-major order (left to right, then top to bottom), each
//                  flattened channel-major: feature c·P·P + i·P + j is pixel (c, i, j) of the
//                  patch (the layout of a Conv2d weight [Wd, C, P, P] flattened).
//   3. embed:      x = W_pe · patch + b_pe                                    [B, N, Wd]
//   4. `depth` pre-norm blocks, bidirectional (every patch sees every patch of its image):
//                  x += W_o · MHA(RMSNorm(x));  x += SiTU-GLU FFN(RMSNorm(x))
//                  heads of width Wd / heads, scale 1/sqrt(Wd / heads), no position embeddings
//                  (NoPE, as everywhere: patch order reaches the trunk through the order of the
//                  image patch tokens).
//   5. output:     y = W_proj · RMSNorm(x)                                    [B, N, d]
// N = num_patches(H, W) = ceil(H / P) · ceil(W / P). Images of one batch share H and W; encode
// images of different sizes in separate calls.
//
// Parameter names (stable: under the model's `vision.` prefix they are the checkpoint's tensor
// names, model_tensors() in model/config.h). No biases except the patch embedding's:
//   patch_embed.weight [Wd, C·P·P]   patch_embed.bias [Wd]
//   layers.{j}.attn_norm.weight [Wd]
//   layers.{j}.attn.{q_proj,k_proj,v_proj,o_proj}.weight [Wd, Wd]   (head-major rows)
//   layers.{j}.ffn_norm.weight [Wd]
//   layers.{j}.ffn.{gate_proj,up_proj}.weight [F, Wd], layers.{j}.ffn.down_proj.weight [Wd, F]
//   norm.weight [Wd]
//   proj.weight [d, Wd]
//
// Numerics: images are cast to the parameters' dtype; attention is model/attention.h's
// blockwise_attention with full visibility (fp32 statistics, O(N) memory, recomputing
// backward); RMSNorm statistics in fp32 (fp64 for fp64). Everything is differentiable in the
// parameters and the images; the output is a deterministic function of them.
//
// Thread-safety: encode only reads the weights.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "model/attention.h"
#include "model/config.h"
#include "model/ffn.h"
#include "model/rms_norm.h"

namespace odyssey::model {

struct VisionEncoderOptions {
  int64_t patch_size = 0;  // P
  int64_t channels = 0;    // C
  int64_t width = 0;       // Wd, the encoder's width
  int64_t depth = 0;       // encoder layers
  int64_t heads = 0;       // must divide width
  int64_t ffn_width = 0;   // F, SiTU-GLU width
  int64_t hidden = 0;      // d, the LM's hidden width (output)
  double rms_eps = 1e-5;
  double beta1 = kSituGateCap;
  double beta2 = kSituUpCap;
  int64_t attention_block = kAttentionBlock;  // tile of the blockwise attention
};

// The options of config.vision, with the LM's hidden width, eps and SiTU-GLU caps.
VisionEncoderOptions vision_encoder_options(const ModelConfig& config);

// ceil(height / patch_size) · ceil(width / patch_size): the patches (and <|image_patch|> tokens)
// of one image of height × width pixels. height, width ≥ 1.
int64_t vision_num_patches(int64_t patch_size, int64_t height, int64_t width);

// Bidirectional multi-head self-attention over the patches of each image.
// Parameters q_proj, k_proj, v_proj, o_proj (.weight [Wd, Wd], no biases).
class VisionAttentionImpl : public torch::nn::Module {
 public:
  VisionAttentionImpl(int64_t width, int64_t heads, int64_t attention_block);

  // x [B, N, Wd] -> [B, N, Wd].
  at::Tensor forward(const at::Tensor& x);

  torch::nn::Linear q_proj{nullptr};
  torch::nn::Linear k_proj{nullptr};
  torch::nn::Linear v_proj{nullptr};
  torch::nn::Linear o_proj{nullptr};

 private:
  int64_t width_;
  int64_t heads_;
  int64_t attention_block_;
};
TORCH_MODULE(VisionAttention);

// One pre-norm block: attn_norm, attn, ffn_norm, ffn.
class VisionLayerImpl : public torch::nn::Module {
 public:
  explicit VisionLayerImpl(const VisionEncoderOptions& options);

  // x [B, N, Wd] -> [B, N, Wd].
  at::Tensor forward(const at::Tensor& x);

  RmsNorm attn_norm{nullptr};
  VisionAttention attn{nullptr};
  RmsNorm ffn_norm{nullptr};
  DenseFfn ffn{nullptr};
};
TORCH_MODULE(VisionLayer);

class VisionEncoderImpl : public torch::nn::Module {
 public:
  explicit VisionEncoderImpl(const VisionEncoderOptions& options);

  // images [B, C, H, W] -> patch embeddings [B, num_patches(H, W), d] in the parameters' dtype.
  at::Tensor encode(const at::Tensor& images);
  at::Tensor forward(const at::Tensor& images) { return encode(images); }

  // Steps 1-2 alone: images [B, C, H, W] -> padded, flattened patches [B, N, C·P·P] (images'
  // dtype).
  at::Tensor patchify(const at::Tensor& images) const;

  int64_t num_patches(int64_t height, int64_t width) const {
    return vision_num_patches(options_.patch_size, height, width);
  }

  const VisionEncoderOptions& options() const { return options_; }

  torch::nn::Linear patch_embed{nullptr};
  torch::nn::ModuleList layers{nullptr};  // of VisionLayer
  RmsNorm norm{nullptr};
  torch::nn::Linear proj{nullptr};

 private:
  VisionEncoderOptions options_;
  std::vector<VisionLayer> layer_list_;
};
TORCH_MODULE(VisionEncoder);

}  // namespace odyssey::model
