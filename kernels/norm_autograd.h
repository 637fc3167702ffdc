// The fused RMSNorm (kernels/rms_norm.h) and the attention-residual mix (kernels/attn_res.h: a
// softmax over RMS-normed sources) recorded for autograd (GPU build only). model::rms_norm
// (model/rms_norm.cpp) and model::attn_res_mix (model/attn_res.cpp) take them for CUDA bf16 / fp32
// inputs of width <= 1024 that need a gradient or not; the LibTorch formulas stay the references
// the tests compare against (tests/kernels/norm_kernel_test.cpp). First order only: the
// backwards' own ops are not recorded.
#pragma once

#include <vector>

#include <ATen/ATen.h>

#include "kernels/torch_bindings.h"

namespace odyssey::kernels {

// y = x / sqrt(mean(x^2, -1) + eps) * weight, in x's dtype (fp32 arithmetic). Saves x and the
// rows' inverse RMS; the backward gives dx (x's dtype) and dweight (weight's dtype, summed over
// the rows in a fixed order: deterministic). Conditions: rms_norm_supported(x, weight).
at::Tensor rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps);

// h = sum_s softmax_s(<RMSNorm(x_s), w>) x_s over the sources, in their dtype (fp32 arithmetic).
// Saves the sources, w and each row's softmax weights and inverse RMS ([rows, S] fp32); the
// backward gives every source's gradient (their dtype) and dw (w's dtype, summed over the rows in
// a fixed order: deterministic). Conditions: attn_res_mix_supported(sources, w).
at::Tensor attn_res_mix_autograd(const std::vector<at::Tensor>& sources, const at::Tensor& w, double eps);

}  // namespace odyssey::kernels
