#include "kernels/norm_autograd.h"

#include <torch/autograd.h>

#include "kernels/rms_norm.h"

namespace odyssey::kernels {
namespace {

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps) {
    RmsNormForward out = rms_norm_forward(x, weight, eps);
    ctx->save_for_backward({x, weight, out.inv_rms});
    return out.y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const RmsNormBackward g = rms_norm_backward(saved[0], saved[1], saved[2], grads[0], ctx->needs_input_grad(1));
    return {ctx->needs_input_grad(0) ? g.dx : at::Tensor(), g.dw, at::Tensor()};
  }
};

}  // namespace

at::Tensor rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(rms_norm_supported(x, weight), "rms_norm_autograd: needs CUDA bf16 / fp32 x [..., width <= ",
              kRmsNormMaxWidth, "] and weight [width] on its device, got x ", x.sizes(), " ", x.scalar_type(),
              " and weight ", weight.sizes(), " ", weight.scalar_type());
  return RmsNormFunction::apply(x, weight, eps);
}

}  // namespace odyssey::kernels
