#include "model/ffn.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace odyssey::model {

torch::Tensor situ_glu(const torch::Tensor& gate, const torch::Tensor& up, double beta1, double beta2) {
  TORCH_CHECK(gate.sizes() == up.sizes(), "situ_glu: gate ", gate.sizes(), " and up ", up.sizes(),
              " must have the same shape");
  TORCH_CHECK(beta1 > 0 && beta2 > 0, "situ_glu: caps must be positive, got ", beta1, " and ", beta2);
  const torch::Tensor capped_gate = at::tanh(gate / beta1) * beta1;
  const torch::Tensor capped_up = at::tanh(up / beta2) * beta2;
  return capped_gate * at::sigmoid(gate) * capped_up;
}

DenseFfnImpl::DenseFfnImpl(const DenseFfnOptions& options) : options_(options) {
  TORCH_CHECK(options.hidden > 0 && options.ffn > 0, "DenseFfn: hidden (", options.hidden,
              ") and ffn (", options.ffn, ") must be positive");
  gate_proj = register_module(
      "gate_proj", torch::nn::Linear(torch::nn::LinearOptions(options.hidden, options.ffn).bias(false)));
  up_proj = register_module(
      "up_proj", torch::nn::Linear(torch::nn::LinearOptions(options.hidden, options.ffn).bias(false)));
  down_proj = register_module(
      "down_proj", torch::nn::Linear(torch::nn::LinearOptions(options.ffn, options.hidden).bias(false)));
}

torch::Tensor DenseFfnImpl::forward(const torch::Tensor& x) {
  return down_proj(situ_glu(gate_proj(x), up_proj(x), options_.beta1, options_.beta2));
}

}  // namespace odyssey::model
