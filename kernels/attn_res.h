// The block attention residuals' mix on the GPU (model::attn_res_mix, model/attn_res.h): per row
// (token) of S sources x_s [rows, width],
//
//     r_s = 1 / sqrt(mean(x_s^2) + eps)     l_s = r_s <x_s, w>     a = softmax_s(l)
//     h   = sum_s a_s x_s
//
// in one pass a forward and two kernels a backward, where the LibTorch reference stacks the
// sources and runs about ten kernels forward and twenty backward a mix (25 mixes a forward of the
// small model: the host's launches, not the bytes, were their cost). Framework-free launchers:
// raw device pointers, sizes and a stream; each returns the launch's cudaError_t
// (cudaErrorInvalidValue for sizes outside the supported set, checked before anything runs).
// kernels/norm_autograd.h records them for autograd.
//
// Layouts: every x_s, h, dh, dx_s [rows, width] dense row-major, one dtype "T"; w and dw [width]
// of dtype "W"; each bf16 or fp32 (RmsDtype, kernels/rms_norm.h). Arithmetic is fp32, as the
// reference computes it for bf16 and fp32 sources (h and dx rounded once to T). The softmax runs
// online over the sources (one read of each row); the weights kept for the backward are the exact
// softmax of the logits.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/rms_norm.h"

namespace odyssey::kernels {

constexpr int kAttnResMaxSources = 32;  // a lane of the warp per source
constexpr int64_t kAttnResMaxWidth = 1024;

// Forward, one warp per row: h, and per (row, source) the softmax weight a and r (fp32
// [rows, S] each, kept for the backward). sources: S device pointers (a host array). Supported:
// 1 <= S <= kAttnResMaxSources, rows >= 0, 1 <= width <= kAttnResMaxWidth, eps > 0.
cudaError_t attn_res_mix_forward(RmsDtype t_dtype, const void* const* sources, int sources_count,
                                 RmsDtype w_dtype, const void* w, double eps, void* h, float* weights,
                                 float* inv_rms, int64_t rows, int64_t width, cudaStream_t stream);

// Backward from dh and the forward's weights and inv_rms: with q_s = <x_s, w>, da_s = <dh, x_s>
// and dl_s = a_s (da_s - sum_t a_t da_t),
//   dx_s = a_s dh + dl_s r_s w - dl_s q_s r_s^3 x_s / width      (one warp per row, written as T)
//   dw   = sum over rows and sources of dl_s r_s x_s              (written as W; or dw == nullptr)
// d_sources: S device pointers (a host array), each written whole. dw is summed without atomics:
// each CTA sums its rows into a partial row of `workspace`, then one pass adds the partials in
// CTA order (deterministic). workspace: attn_res_mix_backward_workspace_bytes bytes, 16-byte
// aligned, used only in the stream order of the call.
size_t attn_res_mix_backward_workspace_bytes(int64_t rows, int64_t width);
cudaError_t attn_res_mix_backward(RmsDtype t_dtype, const void* const* sources, int sources_count,
                                  RmsDtype w_dtype, const void* w, const float* weights,
                                  const float* inv_rms, const void* dh, void* const* d_sources, void* dw,
                                  void* workspace, int64_t rows, int64_t width, cudaStream_t stream);

}  // namespace odyssey::kernels
