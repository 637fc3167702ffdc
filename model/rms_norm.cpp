#include "model/rms_norm.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#ifdef ODYSSEY_WITH_CUDA_KERNELS
#include "kernels/norm_autograd.h"
#endif

namespace odyssey::model {

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
#ifdef ODYSSEY_WITH_CUDA_KERNELS
  if (kernels::rms_norm_supported(x, weight)) return kernels::rms_norm_autograd(x, weight, eps);
#endif
  return rms_norm_reference(x, weight, eps);
}

torch::Tensor rms_norm_reference(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0), "rms_norm: x ", x.sizes(),
              " and weight ", weight.sizes(), " disagree on the width");
  const at::ScalarType compute = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const torch::Tensor xc = x.to(compute);
  const torch::Tensor inv_rms = at::rsqrt(xc.pow(2).mean(/*dim=*/{-1}, /*keepdim=*/true) + eps);
  return (xc * inv_rms * weight.to(compute)).to(x.scalar_type());
}

RmsNormImpl::RmsNormImpl(int64_t width, double eps) : eps_(eps) {
  TORCH_CHECK(width > 0, "RmsNorm: width must be positive, got ", width);
  weight = register_parameter("weight", at::ones({width}));
}

torch::Tensor RmsNormImpl::forward(const torch::Tensor& x) { return rms_norm(x, weight, eps_); }

}  // namespace odyssey::model
