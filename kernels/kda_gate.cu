// The KDA decay gate, fused (contract: kernels/kda_gate.h; reference: model::kda::gate_reference).
//
// A thread takes four adjacent channels (one 16-byte fp32 piece, 8 bytes of bf16): width is a
// multiple of 4, so the four share a head. The forward is one thread per piece of every row. The
// backward's threads each walk one part of the tokens down their piece's column, writing dz and
// keeping the two column sums (dz for dt_bias, dg g_min s (1 - s) u for A_log) in registers; each
// part's sums go to the workspace, and one CTA per head then adds the parts in order (dt_bias's
// gradient per column, A_log's over the head's columns in a fixed tree).
#include "kernels/kda_gate.h"
#include "kernels/walk_parts.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

namespace odyssey::kernels {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;             // forward: pieces a CTA
constexpr int kBackwardThreads = 128;     // backward: columns of pieces a CTA
constexpr int kFinishThreads = 128;       // the parts' sum: one CTA a head
constexpr int64_t kRowsPerPart = 128;     // tokens a part (walk_parts.h) ...
constexpr int64_t kMinRowsPerPart = 8;    // ... and at least, where more parts fill the GPU
constexpr int64_t kMaxParts = 256;

int64_t parts_for(int64_t tokens, int64_t columns) {
  return walk_parts(tokens, columns / 4, kRowsPerPart, kMinRowsPerPart, kMaxParts);
}

__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load4(const bf16* p) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}
__device__ __forceinline__ void store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ void store4(bf16* p, float4 v) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
  uint2 raw;
  raw.x = *reinterpret_cast<const uint32_t*>(&lo);
  raw.y = *reinterpret_cast<const uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(p) = raw;
}

// LibTorch's sigmoid for fp32 (1 / (1 + e^-x), accurate expf and division).
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// One element of the forward, in the reference's order: u = z + b, then a u, then the sigmoid,
// then g_min times it.
__device__ __forceinline__ float gate(float z, float b, float a, float g_min) { return g_min * sigmoid(a * (z + b)); }

template <typename Z>
__global__ void __launch_bounds__(kThreads) gate_forward_kernel(const Z* __restrict__ z, const float* __restrict__ a_log,
                                                                 const float* __restrict__ dt_bias, float g_min,
                                                                 float* __restrict__ g, int64_t pieces, int row_pieces,
                                                                 int width) {
  const int64_t piece = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (piece >= pieces) return;
  const int column = static_cast<int>(piece % row_pieces) * 4;
  const float a = expf(a_log[column / width]);
  const float4 zv = load4(z + piece * 4), b = load4(dt_bias + column);
  store4(g + piece * 4, make_float4(gate(zv.x, b.x, a, g_min), gate(zv.y, b.y, a, g_min), gate(zv.z, b.z, a, g_min),
                                    gate(zv.w, b.w, a, g_min)));
}

// Part blockIdx.y of the tokens, pieces blockIdx.x * kBackwardThreads + threadIdx.x of a row.
// Per element, autograd's chain of the reference: d s = dg g_min; d(a u) = d s (1 - s) s;
// d u = d(a u) a (= dz, dt_bias's term); a's term d(a u) u.
template <typename Z>
__global__ void __launch_bounds__(kBackwardThreads)
    gate_backward_kernel(const Z* __restrict__ z, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                         float g_min, const float* __restrict__ dg, Z* __restrict__ dz, float* __restrict__ bias_parts,
                         float* __restrict__ scale_parts, int64_t tokens, int64_t rows_per_part, int row_pieces,
                         int width) {
  const int p = blockIdx.x * kBackwardThreads + threadIdx.x;
  if (p >= row_pieces) return;
  const int column = 4 * p;
  const int64_t columns = 4 * static_cast<int64_t>(row_pieces);
  const float a = expf(a_log[column / width]);
  const float4 b = load4(dt_bias + column);
  const int64_t first = blockIdx.y * rows_per_part, last = std::min(tokens, first + rows_per_part);
  float4 bias_sum = make_float4(0.f, 0.f, 0.f, 0.f), scale_sum = bias_sum;
  for (int64_t n = first; n < last; ++n) {
    const int64_t at = n * columns + column;
    const float4 zv = load4(z + at), d = load4(dg + at);
    float4 out;
    {
      const float u = zv.x + b.x, s = sigmoid(a * u), d_au = d.x * g_min * (1.0f - s) * s;
      out.x = d_au * a, bias_sum.x += out.x, scale_sum.x += d_au * u;
    }
    {
      const float u = zv.y + b.y, s = sigmoid(a * u), d_au = d.y * g_min * (1.0f - s) * s;
      out.y = d_au * a, bias_sum.y += out.y, scale_sum.y += d_au * u;
    }
    {
      const float u = zv.z + b.z, s = sigmoid(a * u), d_au = d.z * g_min * (1.0f - s) * s;
      out.z = d_au * a, bias_sum.z += out.z, scale_sum.z += d_au * u;
    }
    {
      const float u = zv.w + b.w, s = sigmoid(a * u), d_au = d.w * g_min * (1.0f - s) * s;
      out.w = d_au * a, bias_sum.w += out.w, scale_sum.w += d_au * u;
    }
    if (dz != nullptr) store4(dz + at, out);
  }
  if (bias_parts != nullptr) {
    store4(bias_parts + blockIdx.y * columns + column, bias_sum);
    store4(scale_parts + blockIdx.y * columns + column, scale_sum);
  }
}

// One CTA per head: d_dt_bias[h, c] = sum of the parts (in order); d_A_log[h] = exp(A_log[h]) times
// the sum over the head's channels of the parts' scale sums (each thread its channels in order,
// then the threads in a fixed tree).
__global__ void __launch_bounds__(kFinishThreads)
    gate_parameters_kernel(const float* __restrict__ bias_parts, const float* __restrict__ scale_parts, int64_t parts,
                           const float* __restrict__ a_log, float* __restrict__ d_a_log, float* __restrict__ d_dt_bias,
                           int64_t columns, int width) {
  __shared__ float partial[kFinishThreads];
  const int h = blockIdx.x;
  float scale_total = 0.0f;
  for (int c = threadIdx.x; c < width; c += kFinishThreads) {
    const int64_t column = static_cast<int64_t>(h) * width + c;
    float bias = 0.0f, scale = 0.0f;
    for (int64_t p = 0; p < parts; ++p) {
      bias += bias_parts[p * columns + column];
      scale += scale_parts[p * columns + column];
    }
    if (d_dt_bias != nullptr) d_dt_bias[column] = bias;
    scale_total += scale;
  }
  partial[threadIdx.x] = scale_total;
  __syncthreads();
  for (int stride = kFinishThreads / 2; stride > 0; stride /= 2) {
    if (static_cast<int>(threadIdx.x) < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0 && d_a_log != nullptr) d_a_log[h] = partial[0] * expf(a_log[h]);
}

bool aligned(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

bool sizes_supported(int64_t tokens, int64_t heads, int64_t width) {
  return tokens >= 0 && heads >= 1 && width >= 4 && width % 4 == 0 && heads * width / 4 <= (int64_t{1} << 30);
}

}  // namespace

cudaError_t kda_gate_forward(KdaDtype z_dtype, const void* z, const float* a_log, const float* dt_bias,
                             float g_min, float* g, int64_t tokens, int64_t heads, int64_t width,
                             cudaStream_t stream) {
  if (!sizes_supported(tokens, heads, width)) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  if (z == nullptr || a_log == nullptr || dt_bias == nullptr || g == nullptr) return cudaErrorInvalidValue;
  if (!aligned(z) || !aligned(dt_bias) || !aligned(g)) return cudaErrorInvalidValue;
  const int row_pieces = static_cast<int>(heads * width / 4);
  const int64_t pieces = tokens * row_pieces;
  const int64_t blocks = (pieces + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks));
  if (z_dtype == KdaDtype::kBFloat16) {
    gate_forward_kernel<bf16><<<grid, kThreads, 0, stream>>>(static_cast<const bf16*>(z), a_log, dt_bias, g_min, g,
                                                             pieces, row_pieces, static_cast<int>(width));
  } else {
    gate_forward_kernel<float><<<grid, kThreads, 0, stream>>>(static_cast<const float*>(z), a_log, dt_bias, g_min, g,
                                                              pieces, row_pieces, static_cast<int>(width));
  }
  return cudaGetLastError();
}

size_t kda_gate_backward_workspace_bytes(int64_t tokens, int64_t heads, int64_t width) {
  if (!sizes_supported(tokens, heads, width)) return 0;
  return 2 * static_cast<size_t>(parts_for(tokens, heads * width)) * static_cast<size_t>(heads * width) * sizeof(float);
}

cudaError_t kda_gate_backward(KdaDtype z_dtype, const void* z, const float* a_log, const float* dt_bias,
                              float g_min, const float* dg, void* dz, float* d_a_log, float* d_dt_bias,
                              void* workspace, int64_t tokens, int64_t heads, int64_t width,
                              cudaStream_t stream) {
  if (!sizes_supported(tokens, heads, width)) return cudaErrorInvalidValue;
  const bool parameters = d_a_log != nullptr || d_dt_bias != nullptr;
  if (parameters && (workspace == nullptr || a_log == nullptr)) return cudaErrorInvalidValue;
  if (tokens > 0 && (z == nullptr || a_log == nullptr || dt_bias == nullptr || dg == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (!aligned(z) || !aligned(dt_bias) || !aligned(dg) || !aligned(dz) || !aligned(workspace)) {
    return cudaErrorInvalidValue;
  }
  if (!parameters && dz == nullptr) return cudaSuccess;
  const int row_pieces = static_cast<int>(heads * width / 4);
  const int64_t columns = heads * width, parts = parts_for(tokens, columns);
  float* bias_parts = parameters ? static_cast<float*>(workspace) : nullptr;
  float* scale_parts = parameters ? bias_parts + parts * columns : nullptr;
  if (tokens > 0) {
    const int64_t rows_per_part = (tokens + parts - 1) / parts;
    const dim3 grid(static_cast<unsigned>((row_pieces + kBackwardThreads - 1) / kBackwardThreads),
                    static_cast<unsigned>(parts));
    if (z_dtype == KdaDtype::kBFloat16) {
      gate_backward_kernel<bf16><<<grid, kBackwardThreads, 0, stream>>>(
          static_cast<const bf16*>(z), a_log, dt_bias, g_min, dg, static_cast<bf16*>(dz), bias_parts, scale_parts,
          tokens, rows_per_part, row_pieces, static_cast<int>(width));
    } else {
      gate_backward_kernel<float><<<grid, kBackwardThreads, 0, stream>>>(
          static_cast<const float*>(z), a_log, dt_bias, g_min, dg, static_cast<float*>(dz), bias_parts, scale_parts,
          tokens, rows_per_part, row_pieces, static_cast<int>(width));
    }
    const cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess || !parameters) return error;
  } else if (parameters) {  // no tokens: every sum is zero
    const cudaError_t error = cudaMemsetAsync(workspace, 0, kda_gate_backward_workspace_bytes(tokens, heads, width), stream);
    if (error != cudaSuccess) return error;
  }
  gate_parameters_kernel<<<static_cast<unsigned>(heads), kFinishThreads, 0, stream>>>(
      bias_parts, scale_parts, parts, a_log, d_a_log, d_dt_bias, columns, static_cast<int>(width));
  return cudaGetLastError();
}

}  // namespace odyssey::kernels
