// Device helpers for the kernels that take one warp per row of a [rows, width] tensor (rms_norm.cu,
// attn_res.cu): fp32 loads and stores of bf16 / fp32 elements, the warp's sum, and the second pass
// of a deterministic column sum (partial rows, one per CTA, added in CTA order: no atomics).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "kernels/rms_norm.h"

namespace odyssey::kernels::warp_rows {

__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// This CTA's partial row of a column sum: each warp's per-lane sums (acc, columns lane + 32 i) go
// to its slice of `slices` (shared memory, [kWarps][width]), and the slices are added in warp order
// into row blockIdx.x of `partial`. Every thread of the CTA calls it.
template <int kWarps, int kPerLane>
__device__ __forceinline__ void write_partial_row(const float (&acc)[kPerLane], float* slices, float* partial,
                                                  int width) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int c = lane + 32 * i;
    if (c < width) slices[warp * width + c] = acc[i];
  }
  __syncthreads();
  for (int c = threadIdx.x; c < width; c += blockDim.x) {
    float sum = 0.0f;
#pragma unroll
    for (int s = 0; s < kWarps; ++s) sum += slices[s * width + c];
    partial[static_cast<int64_t>(blockIdx.x) * width + c] = sum;
  }
}

// out[c] = sum over the CTAs' partial rows (partial [ctas, width] fp32), in CTA order.
template <typename W>
__global__ void sum_partial_rows_kernel(const float* __restrict__ partial, int ctas, W* __restrict__ out, int width) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= width) return;
  float sum = 0.0f;
  for (int b = 0; b < ctas; ++b) sum += partial[static_cast<int64_t>(b) * width + c];
  store(out, c, sum);
}

// f(T{}, W{}, std::integral_constant<int, kPerLane>{}) for the call's element types and a row of
// `width` <= 1024 values held 32 to a lane at most.
template <typename F>
cudaError_t dispatch(RmsDtype t_dtype, RmsDtype w_dtype, int64_t width, F&& f) {
  auto with_w = [&](auto t) -> cudaError_t {
    auto with_lanes = [&](auto wt) -> cudaError_t {
      if (width <= 32) return f(t, wt, std::integral_constant<int, 1>{});
      if (width <= 128) return f(t, wt, std::integral_constant<int, 4>{});
      if (width <= 256) return f(t, wt, std::integral_constant<int, 8>{});
      if (width <= 512) return f(t, wt, std::integral_constant<int, 16>{});
      return f(t, wt, std::integral_constant<int, 32>{});
    };
    return w_dtype == RmsDtype::kBFloat16 ? with_lanes(__nv_bfloat16{}) : with_lanes(float{});
  };
  return t_dtype == RmsDtype::kBFloat16 ? with_w(__nv_bfloat16{}) : with_w(float{});
}

}  // namespace odyssey::kernels::warp_rows
