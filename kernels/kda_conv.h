// The KDA layer's short convolution on q, k and v (../../shared/design/MODEL.md, "Incremental
// attention": q, k = L2Norm(SiLU(CausalDepthwiseConv4(W x))) per head, v = SiLU(Conv4(W_v x))),
// fused:
//
//   a[b, t, d] = sum_{j < W} weight[d, j] window[b, t + j, d]      (window = [conv_inputs | x])
//   y = SiLU(a) = a / (1 + e^-a),  then, with `head` > 0, y / sqrt(sum over the head's channels of y^2 + eps)
//
// for x [B, T, D] (the projection W x), conv_inputs [B, W - 1, D] (the W - 1 inputs before these
// tokens, oldest first: zeros at a sequence's start), weight [D, W]. The LibTorch formula
// (IncrementalAttention's short_conv, SiLU and l2_normalize, model/kda.cpp) runs it as a copy, W
// products, W - 1 sums, SiLU and the norm's five passes over [B, T, D], and autograd keeps most of
// their results for the backward; here the forward is one pass (read x, write y) and the
// backward one pass (read x and dy, write dx) plus a small one adding the weight's per-part sums.
// Framework-free launchers: raw device pointers, sizes and a stream; each returns the launch's
// cudaError_t (cudaErrorInvalidValue for sizes or pointers outside the supported set, checked
// before anything is launched). kernels/torch_bindings.h adapts tensors, kernels/kda_autograd.h
// records them for autograd.
//
// Layouts: x, y, dy, dx [B, T, D], conv_inputs and d_conv_inputs [B, W - 1, D], weight and
// d_weight [D, W], all fp32, dense row-major, 16-byte aligned. Supported: B >= 1, T >= 0,
// 1 <= W <= 4, D a positive multiple of 128, head 0 (no norm) or a multiple of 4 that divides D
// and is at most 128.
//
// Numerics: fp32; a's products and sums in the reference's order without fused multiply-adds (as
// LibTorch's separate products and sums round them); SiLU as LibTorch's a / (1 + e^-a); the norm's
// sum of squares in a fixed tree over the head's channels (LibTorch's order differs: the tests
// print how many outputs differ in their last bits). The weight's gradient is summed without atomics over fixed parts
// of the positions (a function of the sizes alone), added in order: the same bits every run.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace odyssey::kernels {

constexpr int kKdaConvMaxWidth = 4;

// y from x, conv_inputs (nullptr: zeros) and weight; eps is the norm's (ignored with head = 0).
cudaError_t kda_short_conv_forward(const float* x, const float* conv_inputs, const float* weight, float* y,
                                   int64_t batch, int64_t length, int64_t channels, int width, int head, float eps,
                                   cudaStream_t stream);

// The backward from dy: dx (nullptr: not made), d_conv_inputs (nullptr: not made), d_weight
// (nullptr: not made; else `workspace` of kda_short_conv_backward_workspace_bytes bytes, used in
// the stream order of the call).
size_t kda_short_conv_backward_workspace_bytes(int64_t batch, int64_t length, int64_t channels, int width);
cudaError_t kda_short_conv_backward(const float* x, const float* conv_inputs, const float* weight, const float* dy,
                                    float* dx, float* d_conv_inputs, float* d_weight, void* workspace, int64_t batch,
                                    int64_t length, int64_t channels, int width, int head, float eps,
                                    cudaStream_t stream);

}  // namespace odyssey::kernels
