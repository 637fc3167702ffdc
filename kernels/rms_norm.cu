// Fused RMSNorm (contract: kernels/rms_norm.h; reference: model/rms_norm.cpp).
#include "kernels/rms_norm.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/warp_rows.cuh"

namespace odyssey::kernels {
namespace {

constexpr int kWarps = 8;           // rows in flight per CTA
constexpr int kMaxWidth = static_cast<int>(kRmsNormMaxWidth);  // 32 values a lane in registers
constexpr int kBackwardCtas = 264;  // partial rows of dw (2 per SM on the H200), each a strided set of rows
static_assert(kWarps * kMaxWidth * sizeof(float) <= 48 * 1024, "the backward's dw slices fit the default shared memory");

using warp_rows::load;
using warp_rows::store;
using warp_rows::warp_sum;

// One warp per row; lane l takes columns l, l + 32, ... (coalesced), values in registers.
template <typename T, typename W, int kPerLane>
__global__ void rms_forward_kernel(const T* __restrict__ x, const W* __restrict__ w, float eps, T* __restrict__ y,
                                   float* __restrict__ inv_rms, int64_t rows, int width) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int64_t base = row * width;
  float v[kPerLane];
  float squares = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int c = lane + 32 * i;
    v[i] = c < width ? load(x, base + c) : 0.0f;
    squares += v[i] * v[i];
  }
  const float r = rsqrtf(warp_sum(squares) / static_cast<float>(width) + eps);
  if (lane == 0) inv_rms[row] = r;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int c = lane + 32 * i;
    if (c < width) store(y, base + c, v[i] * r * load(w, c));
  }
}

// Rows row0, row0 + stride, ... of this CTA's warps; dx per row, and this CTA's partial of dw in
// shared memory (each warp adds its rows' dy xhat to its own slice, then the slices are summed
// in warp order into the CTA's partial row).
template <typename T, typename W, int kPerLane>
__global__ void rms_backward_kernel(const T* __restrict__ x, const W* __restrict__ w,
                                    const float* __restrict__ inv_rms, const T* __restrict__ dy,
                                    T* __restrict__ dx, float* __restrict__ partial, int64_t rows, int width) {
  extern __shared__ float dw_slices[];  // [kWarps][width], or nothing without dw
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  float dw_acc[kPerLane] = {};
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t base = row * width;
    const float r = inv_rms[row];
    float xhat[kPerLane], dxhat[kPerLane];
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = lane + 32 * i;
      const bool in = c < width;
      const float g = in ? load(dy, base + c) : 0.0f;
      xhat[i] = in ? load(x, base + c) * r : 0.0f;
      dxhat[i] = in ? g * load(w, c) : 0.0f;
      dot += dxhat[i] * xhat[i];
      dw_acc[i] += g * xhat[i];
    }
    const float mean = warp_sum(dot) / static_cast<float>(width);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = lane + 32 * i;
      if (c < width) store(dx, base + c, r * (dxhat[i] - xhat[i] * mean));
    }
  }
  if (partial != nullptr) warp_rows::write_partial_row<kWarps>(dw_acc, dw_slices, partial, width);
}

int backward_ctas(int64_t rows) {
  return static_cast<int>(std::min<int64_t>(kBackwardCtas, (rows + kWarps - 1) / kWarps));
}

}  // namespace

cudaError_t rms_norm_forward(RmsDtype x_dtype, const void* x, RmsDtype w_dtype, const void* w,
                             double eps, void* y, float* inv_rms, int64_t rows, int64_t width,
                             cudaStream_t stream) {
  if (rows < 0 || width < 1 || width > kMaxWidth || !(eps >= 0.0)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((rows + kWarps - 1) / kWarps)), block(32 * kWarps);
  return warp_rows::dispatch(x_dtype, w_dtype, width, [&](auto t, auto wt, auto lanes) {
    using T = decltype(t);
    using W = decltype(wt);
    rms_forward_kernel<T, W, lanes()><<<grid, block, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const W*>(w), static_cast<float>(eps), static_cast<T*>(y),
        inv_rms, rows, static_cast<int>(width));
    return cudaGetLastError();
  });
}

size_t rms_norm_backward_workspace_bytes(int64_t rows, int64_t width) {
  if (rows <= 0 || width < 1) return 0;
  return static_cast<size_t>(backward_ctas(rows)) * static_cast<size_t>(width) * sizeof(float);
}

cudaError_t rms_norm_backward(RmsDtype x_dtype, const void* x, RmsDtype w_dtype, const void* w,
                              const float* inv_rms, const void* dy, void* dx, void* dw,
                              void* workspace, int64_t rows, int64_t width, cudaStream_t stream) {
  if (rows < 0 || width < 1 || width > kMaxWidth || (dw != nullptr && rows > 0 && workspace == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) {  // no rows: dw is zero
    if (dw == nullptr) return cudaSuccess;
    return cudaMemsetAsync(dw, 0, static_cast<size_t>(width) * (w_dtype == RmsDtype::kBFloat16 ? 2 : 4), stream);
  }
  const int ctas = backward_ctas(rows);
  float* partial = dw != nullptr ? static_cast<float*>(workspace) : nullptr;
  const size_t shared = dw != nullptr ? static_cast<size_t>(kWarps) * static_cast<size_t>(width) * sizeof(float) : 0;
  return warp_rows::dispatch(x_dtype, w_dtype, width, [&](auto t, auto wt, auto lanes) {
    using T = decltype(t);
    using W = decltype(wt);
    const auto kernel = rms_backward_kernel<T, W, lanes()>;
    // At most 8 x 1024 fp32 (32 KB): within the 48 KB a launch may take without opting in.
    cudaError_t error = cudaSuccess;
    kernel<<<ctas, 32 * kWarps, shared, stream>>>(static_cast<const T*>(x), static_cast<const W*>(w), inv_rms,
                                                 static_cast<const T*>(dy), static_cast<T*>(dx), partial, rows,
                                                 static_cast<int>(width));
    if ((error = cudaGetLastError()) != cudaSuccess || dw == nullptr) return error;
    warp_rows::sum_partial_rows_kernel<W><<<static_cast<unsigned>((width + 255) / 256), 256, 0, stream>>>(
        partial, ctas, static_cast<W*>(dw), static_cast<int>(width));
    return cudaGetLastError();
  });
}

}  // namespace odyssey::kernels
