// The fused RMSNorm (kernels/rms_norm.h) recorded for autograd (GPU build only). model::rms_norm
// (model/rms_norm.cpp) takes it for CUDA bf16 / fp32 inputs of width <= 1024 that need a
// gradient or not; the LibTorch formula stays the reference the tests compare against
// (tests/kernels/norm_kernel_test.cpp). First order only: the backward's own ops are not recorded.
#pragma once

#include <ATen/ATen.h>

#include "kernels/torch_bindings.h"

namespace odyssey::kernels {

// y = x / sqrt(mean(x^2, -1) + eps) * weight, in x's dtype (fp32 arithmetic). Saves x and the
// rows' inverse RMS; the backward gives dx (x's dtype) and dweight (weight's dtype, summed over
// the rows in a fixed order: deterministic). Conditions: rms_norm_supported(x, weight).
at::Tensor rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps);

}  // namespace odyssey::kernels
