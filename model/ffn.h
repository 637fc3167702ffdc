// SiTU-GLU and the dense feed-forward block (MODEL.md "Stable latent MoE").
//
// SiTU-GLU is SwiGLU with soft caps: for gate g and up u,
//     h = [β1·tanh(g/β1)·σ(g)] ⊙ [β2·tanh(u/β2)],   β1 = 4, β2 = 25,
// so |h| < β1·β2 = 100 whatever the inputs (the sigmoid takes the uncapped g). Near 0,
// tanh(x/β)·β = x + O(x³/β²), so h equals SwiGLU's silu(g)·u to first order.
//
// DenseFfn is the dense FFN of the first layers (model.dense_layers); the MoE's shared experts
// compute the same function from stacked weights (moe.h):
//     out = W_down · situ_glu(W_gate x, W_up x)            (no biases)
// Parameter names (stable: they go into checkpoints):
//     gate_proj.weight [ffn, hidden]   up_proj.weight [ffn, hidden]   down_proj.weight [hidden, ffn]
//
// Shapes: x [..., hidden] → [..., hidden], any floating dtype; everything is differentiable.
// Thread-safety: forward only reads the weights; concurrent forwards are safe while nobody
// changes the parameters.
#pragma once

#include <cstdint>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

namespace odyssey::model {

inline constexpr double kSituGateCap = 4.0;  // β1
inline constexpr double kSituUpCap = 25.0;   // β2

// The SiTU-GLU activation, elementwise: gate and up have the same shape (and dtype); the result
// has that shape. Differentiable in both arguments. The caps come from the model config
// (situ_beta1, situ_beta2); MODEL.md fixes them at 4 and 25.
torch::Tensor situ_glu(const torch::Tensor& gate, const torch::Tensor& up, double beta1 = kSituGateCap,
                       double beta2 = kSituUpCap);

struct DenseFfnOptions {
  int64_t hidden = 0;  // input and output width
  int64_t ffn = 0;     // inner width of the gate and up projections
  double beta1 = kSituGateCap;
  double beta2 = kSituUpCap;
};

class DenseFfnImpl : public torch::nn::Module {
 public:
  explicit DenseFfnImpl(const DenseFfnOptions& options);

  // x [..., hidden] → [..., hidden].
  torch::Tensor forward(const torch::Tensor& x);

  const DenseFfnOptions& options() const { return options_; }

  torch::nn::Linear gate_proj{nullptr};
  torch::nn::Linear up_proj{nullptr};
  torch::nn::Linear down_proj{nullptr};

 private:
  DenseFfnOptions options_;
};
TORCH_MODULE(DenseFfn);

}  // namespace odyssey::model
