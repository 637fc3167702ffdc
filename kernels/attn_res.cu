// The attention-residual mix (contract: kernels/attn_res.h; reference: model/attn_res.cpp).
#include "kernels/attn_res.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/warp_rows.cuh"

namespace odyssey::kernels {
namespace {

using warp_rows::load;
using warp_rows::store;
using warp_rows::warp_sum;

constexpr int kWarps = 8;           // rows in flight per CTA
constexpr int kBackwardCtas = 264;  // partial rows of dw (2 per SM on the H200), each a strided set of rows
static_assert(kWarps * kAttnResMaxWidth * sizeof(float) <= 48 * 1024, "the backward's dw slices fit the default shared memory");

// The sources' pointers, passed by value (kernel parameters).
struct Sources {
  const void* p[kAttnResMaxSources];
};
struct SourceGrads {
  void* p[kAttnResMaxSources];
};

// One warp per row; lane l takes columns l, l + 32, ... (coalesced). The softmax runs online over
// the sources: after source s, acc = sum_{t <= s} e^{l_t - m} x_t and denom = sum e^{l_t - m} for
// the running maximum m, so each source's row is read once. Lane s keeps l_s and r_s.
template <typename T, typename W, int kPerLane>
__global__ void attn_res_forward_kernel(Sources sources, int count, const W* __restrict__ w, float eps,
                                        T* __restrict__ h, float* __restrict__ weights, float* __restrict__ inv_rms,
                                        int64_t rows, int width) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int64_t base = row * width;
  float wv[kPerLane], acc[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int c = lane + 32 * i;
    wv[i] = c < width ? load(w, c) : 0.0f;
    acc[i] = 0.0f;
  }
  float m = -INFINITY, denom = 0.0f, my_l = 0.0f, my_r = 0.0f;
  for (int s = 0; s < count; ++s) {
    const T* x = static_cast<const T*>(sources.p[s]);
    float v[kPerLane];
    float squares = 0.0f, dot = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = lane + 32 * i;
      v[i] = c < width ? load(x, base + c) : 0.0f;
      squares += v[i] * v[i];
      dot += v[i] * wv[i];
    }
    const float r = rsqrtf(warp_sum(squares) / static_cast<float>(width) + eps);
    const float l = r * warp_sum(dot);
    if (lane == s) my_l = l, my_r = r;
    const float m_next = fmaxf(m, l);
    const float scale = expf(m - m_next);  // 0 for the first source (m = -inf)
    const float e = expf(l - m_next);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) acc[i] = acc[i] * scale + e * v[i];
    denom = denom * scale + e;
    m = m_next;
  }
  const float inv_denom = 1.0f / denom;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int c = lane + 32 * i;
    if (c < width) store(h, base + c, acc[i] * inv_denom);
  }
  if (lane < count) {
    weights[row * count + lane] = expf(my_l - m) * inv_denom;
    inv_rms[row * count + lane] = my_r;
  }
}

// Rows row0, row0 + stride, ... of this CTA's warps. Per row two passes over the sources: the
// first makes da_s = <dh, x_s> and q_s = <w, x_s> (lane s keeps them), the second dx_s and this
// warp's part of dw; then this CTA's partial of dw (each warp's slice in shared memory, summed in
// warp order into the CTA's partial row).
template <typename T, typename W, int kPerLane>
__global__ void attn_res_backward_kernel(Sources sources, SourceGrads d_sources, int count, const W* __restrict__ w,
                                         const float* __restrict__ weights, const float* __restrict__ inv_rms,
                                         const T* __restrict__ dh, float* __restrict__ partial, int64_t rows,
                                         int width) {
  extern __shared__ float dw_slices[];  // [kWarps][width], or nothing without dw
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const float inv_width = 1.0f / static_cast<float>(width);
  float dw_acc[kPerLane] = {};
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t base = row * width;
    float g[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = lane + 32 * i;
      g[i] = c < width ? load(dh, base + c) : 0.0f;
    }
    const float my_a = lane < count ? weights[row * count + lane] : 0.0f;
    const float my_r = lane < count ? inv_rms[row * count + lane] : 0.0f;
    float my_da = 0.0f, my_q = 0.0f;
    for (int s = 0; s < count; ++s) {
      const T* x = static_cast<const T*>(sources.p[s]);
      float da = 0.0f, q = 0.0f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int c = lane + 32 * i;
        if (c < width) {
          const float v = load(x, base + c);
          da += g[i] * v;
          q += load(w, c) * v;
        }
      }
      da = warp_sum(da);
      q = warp_sum(q);
      if (lane == s) my_da = da, my_q = q;
    }
    const float my_dl = my_a * (my_da - warp_sum(my_a * my_da));  // lanes past the sources add 0
    for (int s = 0; s < count; ++s) {
      const float a = __shfl_sync(0xffffffffu, my_a, s), dl = __shfl_sync(0xffffffffu, my_dl, s);
      const float r = __shfl_sync(0xffffffffu, my_r, s), q = __shfl_sync(0xffffffffu, my_q, s);
      const float along_w = dl * r, along_x = dl * q * r * r * r * inv_width;
      const T* x = static_cast<const T*>(sources.p[s]);
      T* dx = static_cast<T*>(d_sources.p[s]);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int c = lane + 32 * i;
        if (c < width) {
          const float v = load(x, base + c);
          store(dx, base + c, a * g[i] + along_w * load(w, c) - along_x * v);
          dw_acc[i] += along_w * v;
        }
      }
    }
  }
  if (partial != nullptr) warp_rows::write_partial_row<kWarps>(dw_acc, dw_slices, partial, width);
}

int backward_ctas(int64_t rows) {
  return static_cast<int>(std::min<int64_t>(kBackwardCtas, (rows + kWarps - 1) / kWarps));
}

bool sizes_supported(int count, int64_t rows, int64_t width) {
  return count >= 1 && count <= kAttnResMaxSources && rows >= 0 && width >= 1 && width <= kAttnResMaxWidth &&
         rows * width < (int64_t{1} << 40);
}

}  // namespace

cudaError_t attn_res_mix_forward(RmsDtype t_dtype, const void* const* sources, int sources_count,
                                 RmsDtype w_dtype, const void* w, double eps, void* h, float* weights,
                                 float* inv_rms, int64_t rows, int64_t width, cudaStream_t stream) {
  if (!sizes_supported(sources_count, rows, width) || !(eps > 0.0) || sources == nullptr) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  Sources s{};
  for (int i = 0; i < sources_count; ++i) {
    if (sources[i] == nullptr) return cudaErrorInvalidValue;
    s.p[i] = sources[i];
  }
  if (w == nullptr || h == nullptr || weights == nullptr || inv_rms == nullptr) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((rows + kWarps - 1) / kWarps)), block(32 * kWarps);
  return warp_rows::dispatch(t_dtype, w_dtype, width, [&](auto t, auto wt, auto lanes) {
    using T = decltype(t);
    using W = decltype(wt);
    attn_res_forward_kernel<T, W, lanes()><<<grid, block, 0, stream>>>(
        s, sources_count, static_cast<const W*>(w), static_cast<float>(eps), static_cast<T*>(h), weights, inv_rms,
        rows, static_cast<int>(width));
    return cudaGetLastError();
  });
}

size_t attn_res_mix_backward_workspace_bytes(int64_t rows, int64_t width) {
  if (rows <= 0 || width < 1) return 0;
  return static_cast<size_t>(backward_ctas(rows)) * static_cast<size_t>(width) * sizeof(float);
}

cudaError_t attn_res_mix_backward(RmsDtype t_dtype, const void* const* sources, int sources_count,
                                  RmsDtype w_dtype, const void* w, const float* weights,
                                  const float* inv_rms, const void* dh, void* const* d_sources, void* dw,
                                  void* workspace, int64_t rows, int64_t width, cudaStream_t stream) {
  if (!sizes_supported(sources_count, rows, width) || sources == nullptr || d_sources == nullptr ||
      (dw != nullptr && rows > 0 && workspace == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) {  // no rows: dw is zero
    if (dw == nullptr) return cudaSuccess;
    return cudaMemsetAsync(dw, 0, static_cast<size_t>(width) * (w_dtype == RmsDtype::kBFloat16 ? 2 : 4), stream);
  }
  Sources s{};
  SourceGrads ds{};
  for (int i = 0; i < sources_count; ++i) {
    if (sources[i] == nullptr || d_sources[i] == nullptr) return cudaErrorInvalidValue;
    s.p[i] = sources[i];
    ds.p[i] = d_sources[i];
  }
  if (w == nullptr || weights == nullptr || inv_rms == nullptr || dh == nullptr) return cudaErrorInvalidValue;
  const int ctas = backward_ctas(rows);
  float* partial = dw != nullptr ? static_cast<float*>(workspace) : nullptr;
  const size_t shared = dw != nullptr ? static_cast<size_t>(kWarps) * static_cast<size_t>(width) * sizeof(float) : 0;
  return warp_rows::dispatch(t_dtype, w_dtype, width, [&](auto t, auto wt, auto lanes) {
    using T = decltype(t);
    using W = decltype(wt);
    const auto kernel = attn_res_backward_kernel<T, W, lanes()>;
    // At most 8 x 1024 fp32 (32 KB): within the 48 KB a launch may take without opting in.
    cudaError_t error = cudaSuccess;
    kernel<<<ctas, 32 * kWarps, shared, stream>>>(s, ds, sources_count, static_cast<const W*>(w), weights, inv_rms,
                                                 static_cast<const T*>(dh), partial, rows, static_cast<int>(width));
    if ((error = cudaGetLastError()) != cudaSuccess || dw == nullptr) return error;
    warp_rows::sum_partial_rows_kernel<W><<<static_cast<unsigned>((width + 255) / 256), 256, 0, stream>>>(
        partial, ctas, static_cast<W*>(dw), static_cast<int>(width));
    return cudaGetLastError();
  });
}

}  // namespace odyssey::kernels
