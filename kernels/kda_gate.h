// The KDA layer's decay gate (../../shared/design/MODEL.md, "Incremental attention"), fused:
//
//   g[n, h, c] = g_min * sigmoid(exp(A_log[h]) * (z[n, h, c] + dt_bias[h, c]))
//
// per token n, head h and key channel c (exp(A) (z + dt_bias), not exp(A) z + dt_bias; g_min
// scales the sigmoid, it is not a clamp). The LibTorch formula (model::kda::gate_reference) runs
// it as four elementwise passes over [tokens, H, K] and its autograd as about six more, keeping
// two fp32 intermediates of that size for the backward; here the forward is one pass (read z,
// write g) and the backward one pass (read z and dg, write dz) plus a small one that adds the
// parameters' per-part sums. Framework-free launchers: raw device pointers, sizes and a stream;
// each returns the launch's cudaError_t (cudaErrorInvalidValue for sizes or pointers outside the
// supported set, checked before anything is launched). kernels/torch_bindings.h adapts tensors,
// kernels/kda_autograd.h records them for autograd.
//
// Layouts: z, g, dg, dz [tokens, heads, width] dense row-major; A_log, d_A_log [heads];
// dt_bias, d_dt_bias [heads, width]. z and dz are bf16 or fp32 (`z_dtype`); everything else is
// fp32. Pointers 16-byte aligned (what the caching allocators return for whole tensors).
// Supported: tokens >= 0, heads >= 1, width a positive multiple of 4.
//
// Numerics: fp32 arithmetic in the reference's order of operations, one rounding of dz to
// z's dtype: per element, g (and dz) are what the LibTorch chain computes up to the last bit of
// the exponential and the division (the tests print how many bits differ). The parameters'
// gradients are fp32 sums over the tokens without atomics: each of a fixed number of parts of
// the tokens (a function of `tokens` alone) sums its rows per column, then one pass adds the
// parts in order: the same bits on every run and every GPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/kda.h"

namespace odyssey::kernels {

// g = g_min * sigmoid(exp(A_log[h]) * (z + dt_bias[h, c])), written fp32.
cudaError_t kda_gate_forward(KdaDtype z_dtype, const void* z, const float* a_log, const float* dt_bias,
                             float g_min, float* g, int64_t tokens, int64_t heads, int64_t width,
                             cudaStream_t stream);

// The backward from dg. With a = exp(A_log[h]), u = z + dt_bias, s = sigmoid(a u):
//   dz          = dg g_min s (1 - s) a                     (written in z's dtype; nullptr: not made)
//   d_dt_bias   = sum over tokens of dz (before rounding)  (nullptr: not made)
//   d_A_log[h]  = a * sum over tokens and channels of dg g_min s (1 - s) u   (nullptr: not made)
// workspace: kda_gate_backward_workspace_bytes bytes, 16-byte aligned, used in the stream order of
// the call; needed only when d_dt_bias or d_A_log is asked for (may be nullptr otherwise).
size_t kda_gate_backward_workspace_bytes(int64_t tokens, int64_t heads, int64_t width);
cudaError_t kda_gate_backward(KdaDtype z_dtype, const void* z, const float* a_log, const float* dt_bias,
                              float g_min, const float* dg, void* dz, float* d_a_log, float* d_dt_bias,
                              void* workspace, int64_t tokens, int64_t heads, int64_t width,
                              cudaStream_t stream);

}  // namespace odyssey::kernels
