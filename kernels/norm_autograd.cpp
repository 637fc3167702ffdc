#include "kernels/norm_autograd.h"

#include <cstddef>

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

class AttnResMixFunction : public torch::autograd::Function<AttnResMixFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList sources, const at::Tensor& w,
                            double eps) {
    const std::vector<at::Tensor> list = sources.vec();
    AttnResMixForward out = attn_res_mix_forward(list, w, eps);
    std::vector<at::Tensor> saved = list;
    saved.push_back(w);
    saved.push_back(out.weights);
    saved.push_back(out.inv_rms);
    ctx->save_for_backward(saved);
    return out.h;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const size_t count = saved.size() - 3;
    const std::vector<at::Tensor> sources(saved.begin(), saved.begin() + static_cast<std::ptrdiff_t>(count));
    const bool want_dw = ctx->needs_input_grad(count);
    AttnResMixBackward g = attn_res_mix_backward(sources, saved[count], saved[count + 1], saved[count + 2], grads[0],
                                                 want_dw);
    torch::autograd::variable_list out;
    for (size_t s = 0; s < count; ++s) out.push_back(ctx->needs_input_grad(s) ? g.d_sources[s] : at::Tensor());
    out.push_back(g.dw);
    out.push_back(at::Tensor());  // eps
    return out;
  }
};

}  // namespace

at::Tensor attn_res_mix_autograd(const std::vector<at::Tensor>& sources, const at::Tensor& w, double eps) {
  // Unsupported arguments: attn_res_mix_forward's error names them (count, shape, dtype, device).
  return AttnResMixFunction::apply(at::TensorList(sources), w, eps);
}

at::Tensor rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(rms_norm_supported(x, weight), "rms_norm_autograd: needs CUDA bf16 / fp32 x [..., width <= ",
              kRmsNormMaxWidth, "] and weight [width] on its device, got x ", x.sizes(), " ", x.scalar_type(),
              " and weight ", weight.sizes(), " ", weight.scalar_type());
  return RmsNormFunction::apply(x, weight, eps);
}

}  // namespace odyssey::kernels
