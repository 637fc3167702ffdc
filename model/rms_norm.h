// RMSNorm: y = x / sqrt(mean(x², last dim) + eps) · weight.
//
// Parameter name (stable, in checkpoints): weight [width], initialised to ones.
// Shapes: x [..., width] → [..., width] in x's dtype; the statistics are taken in fp32 (fp64 for
// fp64 x). Differentiable in x and weight. Thread-safety: forward only reads.
#pragma once

#include <cstdint>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

namespace odyssey::model {

// On the GPU build, CUDA bf16 / fp32 x of width <= 1024 takes the fused kernel
// (kernels/norm_autograd.h: one pass forward, one backward, recorded for autograd); everything
// else, and what the tests compare against, is rms_norm_reference (LibTorch ops).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor rms_norm_reference(const torch::Tensor& x, const torch::Tensor& weight, double eps);

class RmsNormImpl : public torch::nn::Module {
 public:
  RmsNormImpl(int64_t width, double eps);

  torch::Tensor forward(const torch::Tensor& x);

  double eps() const { return eps_; }

  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RmsNorm);

}  // namespace odyssey::model
