// Fused RMSNorm on the GPU (model::rms_norm, model/rms_norm.h): y = x / sqrt(mean(x^2) + eps) * w
// over the last dimension. Framework-free launchers: raw device pointers, sizes and a stream; each
// returns the launch's cudaError_t (cudaErrorInvalidValue for sizes outside the supported set,
// checked before anything is launched). kernels/norm_autograd.h records them for autograd.
//
// Layouts: x, y, dy, dx [rows, width] dense row-major; w and dw [width]. "T" (x, y, dy, dx) and
// "W" (w) are each bf16 or fp32 (RmsDtype); arithmetic is fp32, as the reference computes it for
// bf16 and fp32 inputs (one rounding of y or dx to T at the end).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace odyssey::kernels {

enum class RmsDtype { kFloat32, kBFloat16 };

constexpr int64_t kRmsNormMaxWidth = 1024;

// Forward, one warp per row: inv_rms[r] = 1 / sqrt(mean(x[r]^2) + eps) (fp32, kept for the
// backward), y[r] = x[r] * inv_rms[r] * w. Supported: rows >= 0, 1 <= width <= kRmsNormMaxWidth
// (the row's values stay in registers: 32 a lane), eps >= 0.
cudaError_t rms_norm_forward(RmsDtype x_dtype, const void* x, RmsDtype w_dtype, const void* w,
                             double eps, void* y, float* inv_rms, int64_t rows, int64_t width,
                             cudaStream_t stream);

// Backward from dy and the forward's inv_rms. With xhat = x inv_rms and dxhat = dy w:
//   dx[r] = inv_rms[r] (dxhat - xhat mean(dxhat xhat))     (one warp per row, written as T)
//   dw    = sum over rows of dy xhat                        (fp32, written as W; or dw == nullptr)
// dw is summed without atomics: each CTA sums its rows into a partial row of `workspace`, then one
// pass adds the partials in CTA order (deterministic). workspace: rms_norm_backward_workspace_bytes
// bytes, 16-byte aligned, used only in the stream order of the call.
size_t rms_norm_backward_workspace_bytes(int64_t rows, int64_t width);
cudaError_t rms_norm_backward(RmsDtype x_dtype, const void* x, RmsDtype w_dtype, const void* w,
                              const float* inv_rms, const void* dy, void* dx, void* dw,
                              void* workspace, int64_t rows, int64_t width, cudaStream_t stream);

}  // namespace odyssey::kernels
