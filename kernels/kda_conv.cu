// The KDA layer's short convolution, SiLU and per-head L2 norm, fused (contract: kernels/kda_conv.h;
// reference: model::kda::short_conv_reference).
//
// A thread takes four adjacent channels (one 16-byte piece); the head's pieces are adjacent lanes
// of one warp (head / 4 of them, a power of two), so the norm's sums are shuffles. D is a multiple
// of 128, so a warp's 32 pieces are all in range or all out.
// Forward: one thread a (run of 8 tokens of one sequence, piece) (runs along the grid's x, pieces
// along y); it slides the W window rows it needs (the window being the conv_inputs rows, then x's)
// along its tokens, one new row a token, and reads the weight's 4 W values once.
// Backward: one thread a (batch, part of the window positions, piece), walking the positions in
// order. Window position i feeds a[t] for t = i - j (j < W), so
//   d window[i] = sum_j weight[j] da[i - j]       (i < W - 1: d_conv_inputs; else dx[i - W + 1])
// and the walk keeps da of the last W tokens and the window rows of the current one in registers
// (one new row a step), recomputing each token's a, SiLU and norm from x (W - 1 tokens of warm-up
// at a part's start). The weight's gradient, sum over the tokens of
// window[t + j] da[t], is kept per thread over its part and written to the workspace; one pass then
// adds the parts in order.
#include "kernels/kda_conv.h"
#include "kernels/walk_parts.h"

#include <algorithm>
#include <cstdint>

namespace odyssey::kernels {
namespace {

constexpr int kThreads = 128;
constexpr int64_t kPositionsPerPart = 64;    // window positions a backward part walks (walk_parts.h) ...
constexpr int64_t kMinPositionsPerPart = 8;  // ... and at least, where more parts fill the GPU
constexpr int64_t kMaxParts = 1024;          // parts a sequence's positions are cut into, at most

// Each part recomputes W - 1 tokens before its first; each sequence walks apart.
int64_t parts_for(int64_t batch, int64_t positions, int64_t channels) {
  return walk_parts(positions, batch * (channels / 4), kPositionsPerPart, kMinPositionsPerPart, kMaxParts);
}

__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float get(const float4& v, int e) { return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w; }

// Row `pos` of the window [conv_inputs | x] of sequence b, channels c .. c + 3.
template <int W>
__device__ __forceinline__ float4 window_piece(const float* x, const float* conv_inputs, int64_t b, int64_t pos,
                                               int64_t length, int64_t channels, int c) {
  if (pos < 0 || pos >= length + W - 1) return make_float4(0.f, 0.f, 0.f, 0.f);
  if (pos < W - 1) {
    if (conv_inputs == nullptr) return make_float4(0.f, 0.f, 0.f, 0.f);
    return load4(conv_inputs + (b * (W - 1) + pos) * channels + c);
  }
  return load4(x + (b * length + pos - (W - 1)) * channels + c);
}

// The convolution of channel e's window values: the reference's order, each product rounded, no FMA.
template <int W>
__device__ __forceinline__ float convolve(const float (&w)[4][W], const float4 (&in)[W], int e) {
  float a = __fmul_rn(get(in[0], e), w[e][0]);
#pragma unroll
  for (int j = 1; j < W; ++j) a = __fadd_rn(a, __fmul_rn(get(in[j], e), w[e][j]));
  return a;
}

// The sum over the head's `lanes` pieces (a power of two up to 32), the same order in every lane.
__device__ __forceinline__ float head_sum(float v, int lanes) {
  for (int offset = lanes / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float silu(float a) { return a / (1.0f + expf(-a)); }

template <int W>
__device__ __forceinline__ void load_weights(const float* weight, int c, float (&w)[4][W]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
#pragma unroll
    for (int j = 0; j < W; ++j) w[e][j] = weight[static_cast<int64_t>(c + e) * W + j];
  }
}

constexpr int kTokensPerThread = 8;  // forward: consecutive tokens a thread, its window rows slid along

template <int W>
__global__ void __launch_bounds__(kThreads)
    conv_forward_kernel(const float* __restrict__ x, const float* __restrict__ conv_inputs,
                        const float* __restrict__ weight, float* __restrict__ y, int64_t length, int64_t channels,
                        int head_lanes, float eps) {
  const int c = 4 * (blockIdx.y * kThreads + threadIdx.x);
  if (c >= channels) return;  // whole warps (channels is a multiple of 128)
  const int64_t spans = (length + kTokensPerThread - 1) / kTokensPerThread;
  const int64_t b = blockIdx.x / spans, first = (blockIdx.x - b * spans) * kTokensPerThread;
  const int64_t last = std::min(length, first + kTokensPerThread);
  float w[4][W];
  load_weights<W>(weight, c, w);
  float4 in[W];  // in[j] = window row t + j at token t's step
#pragma unroll
  for (int j = 1; j < W; ++j) in[j] = window_piece<W>(x, conv_inputs, b, first + j - 1, length, channels, c);
  for (int64_t t = first; t < last; ++t) {
#pragma unroll
    for (int j = 0; j < W - 1; ++j) in[j] = in[j + 1];
    in[W - 1] = window_piece<W>(x, conv_inputs, b, t + W - 1, length, channels, c);
    float out[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) out[e] = silu(convolve<W>(w, in, e));
    if (head_lanes > 0) {
      const float squares = out[0] * out[0] + out[1] * out[1] + out[2] * out[2] + out[3] * out[3];
      const float r = rsqrtf(head_sum(squares, head_lanes) + eps);
#pragma unroll
      for (int e = 0; e < 4; ++e) out[e] *= r;
    }
    *reinterpret_cast<float4*>(y + (b * length + t) * channels + c) = make_float4(out[0], out[1], out[2], out[3]);
  }
}

// da[t] for this thread's four channels (zero outside [0, length)), from `in`: the window rows
// t .. t + W - 1.
template <int W>
__device__ __forceinline__ float4 gradient_of_conv(const float (&w)[4][W], const float* dy, int64_t b, int64_t t,
                                                   int64_t length, int64_t channels, int c, int head_lanes, float eps,
                                                   const float4 (&in)[W]) {
  // Every lane of a head walks the same t, so the shuffles below see the whole head.
  if (t < 0 || t >= length) return make_float4(0.f, 0.f, 0.f, 0.f);
  const float4 g = load4(dy + (b * length + t) * channels + c);
  float a[4], sig[4], act[4], dact[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    a[e] = convolve<W>(w, in, e);
    sig[e] = 1.0f / (1.0f + expf(-a[e]));
    act[e] = silu(a[e]);
    dact[e] = get(g, e);
  }
  if (head_lanes > 0) {
    const float squares = act[0] * act[0] + act[1] * act[1] + act[2] * act[2] + act[3] * act[3];
    const float r = rsqrtf(head_sum(squares, head_lanes) + eps);
    float yv[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) yv[e] = act[e] * r;
    const float dot = head_sum(dact[0] * yv[0] + dact[1] * yv[1] + dact[2] * yv[2] + dact[3] * yv[3], head_lanes);
#pragma unroll
    for (int e = 0; e < 4; ++e) dact[e] = r * (dact[e] - yv[e] * dot);
  }
  float da[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) da[e] = dact[e] * sig[e] * (1.0f + a[e] * (1.0f - sig[e]));
  return make_float4(da[0], da[1], da[2], da[3]);
}

template <int W>
__global__ void __launch_bounds__(kThreads)
    conv_backward_kernel(const float* __restrict__ x, const float* __restrict__ conv_inputs,
                         const float* __restrict__ weight, const float* __restrict__ dy, float* __restrict__ dx,
                         float* __restrict__ d_conv_inputs, float* __restrict__ weight_parts, int64_t length,
                         int64_t channels, int head_lanes, float eps, int64_t positions_per_part) {
  const int c = 4 * (blockIdx.x * kThreads + threadIdx.x);
  if (c >= channels) return;  // whole warps
  const int64_t b = blockIdx.z, part = blockIdx.y, parts = gridDim.y;
  const int64_t positions = length + W - 1;
  const int64_t first = part * positions_per_part, last = std::min(positions, first + positions_per_part);
  float w[4][W];
  load_weights<W>(weight, c, w);
  float4 history[W];  // history[j] = da[i - j] after position i's step
  float4 in[W];       // in[j] = window row t + j at token t's step, slid along
  const int64_t start = first - (W - 1);
#pragma unroll
  for (int j = 0; j < W; ++j) history[j] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int j = 1; j < W; ++j) in[j] = window_piece<W>(x, conv_inputs, b, start + j - 1, length, channels, c);
  auto slide = [&](int64_t t) {
#pragma unroll
    for (int j = 0; j < W - 1; ++j) in[j] = in[j + 1];
    in[W - 1] = window_piece<W>(x, conv_inputs, b, t + W - 1, length, channels, c);
  };
  for (int64_t t = start; t < first; ++t) {  // warm-up: da of the W - 1 tokens before
    slide(t);
#pragma unroll
    for (int j = W - 1; j > 0; --j) history[j] = history[j - 1];
    history[0] = gradient_of_conv<W>(w, dy, b, t, length, channels, c, head_lanes, eps, in);
  }
  float dw[4][W] = {};
  for (int64_t i = first; i < last; ++i) {
    slide(i);
#pragma unroll
    for (int j = W - 1; j > 0; --j) history[j] = history[j - 1];
    history[0] = gradient_of_conv<W>(w, dy, b, i, length, channels, c, head_lanes, eps, in);
    if (i < length) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
#pragma unroll
        for (int j = 0; j < W; ++j) dw[e][j] += get(in[j], e) * get(history[0], e);
      }
    }
    float dwin[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < W; ++j) sum += w[e][j] * get(history[j], e);
      dwin[e] = sum;
    }
    const float4 out = make_float4(dwin[0], dwin[1], dwin[2], dwin[3]);
    if (i < W - 1) {
      if (d_conv_inputs != nullptr) *reinterpret_cast<float4*>(d_conv_inputs + (b * (W - 1) + i) * channels + c) = out;
    } else if (dx != nullptr) {
      *reinterpret_cast<float4*>(dx + (b * length + i - (W - 1)) * channels + c) = out;
    }
  }
  if (weight_parts != nullptr) {
    float* row = weight_parts + (b * parts + part) * channels * W + static_cast<int64_t>(c) * W;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
#pragma unroll
      for (int j = 0; j < W; ++j) row[e * W + j] = dw[e][j];
    }
  }
}

// d_weight[k] = sum of the rows' k-th values, rows in order (k = d W + j).
__global__ void conv_weight_kernel(const float* __restrict__ parts, int64_t rows, int64_t size,
                                   float* __restrict__ d_weight) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  if (k >= size) return;
  float sum = 0.0f;
  for (int64_t r = 0; r < rows; ++r) sum += parts[r * size + k];
  d_weight[k] = sum;
}

bool aligned(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

bool sizes_supported(int64_t batch, int64_t length, int64_t channels, int width, int head) {
  const bool head_ok = head == 0 || (head >= 4 && head <= 128 && head % 4 == 0 && ((head / 4) & (head / 4 - 1)) == 0 &&
                                     channels % head == 0);
  return batch >= 1 && batch <= 65535 && length >= 0 && channels >= 128 && channels % 128 == 0 && width >= 1 &&
         width <= kKdaConvMaxWidth && head_ok && batch * length <= 0x7fffffff;
}

template <typename F>
cudaError_t with_width(int width, F&& f) {
  switch (width) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

}  // namespace

cudaError_t kda_short_conv_forward(const float* x, const float* conv_inputs, const float* weight, float* y,
                                   int64_t batch, int64_t length, int64_t channels, int width, int head, float eps,
                                   cudaStream_t stream) {
  if (!sizes_supported(batch, length, channels, width, head)) return cudaErrorInvalidValue;
  if (length == 0) return cudaSuccess;
  if (x == nullptr || weight == nullptr || y == nullptr) return cudaErrorInvalidValue;
  if (!aligned(x) || !aligned(conv_inputs) || !aligned(y)) return cudaErrorInvalidValue;
  const int64_t spans = batch * ((length + kTokensPerThread - 1) / kTokensPerThread);
  if (spans > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(spans),
                  static_cast<unsigned>(channels / 4 / kThreads + (channels / 4 % kThreads != 0)));
  return with_width(width, [&](auto w) {
    conv_forward_kernel<decltype(w)::value><<<grid, kThreads, 0, stream>>>(x, conv_inputs, weight, y, length, channels,
                                                                           head / 4, eps);
    return cudaGetLastError();
  });
}

size_t kda_short_conv_backward_workspace_bytes(int64_t batch, int64_t length, int64_t channels, int width) {
  if (batch < 1 || length < 0 || channels < 1 || width < 1 || width > kKdaConvMaxWidth) return 0;
  return static_cast<size_t>(batch * parts_for(batch, length + width - 1, channels)) * static_cast<size_t>(channels * width) *
         sizeof(float);
}

cudaError_t kda_short_conv_backward(const float* x, const float* conv_inputs, const float* weight, const float* dy,
                                    float* dx, float* d_conv_inputs, float* d_weight, void* workspace, int64_t batch,
                                    int64_t length, int64_t channels, int width, int head, float eps,
                                    cudaStream_t stream) {
  if (!sizes_supported(batch, length, channels, width, head)) return cudaErrorInvalidValue;
  if (weight == nullptr || (length > 0 && (x == nullptr || dy == nullptr))) return cudaErrorInvalidValue;
  if (d_weight != nullptr && workspace == nullptr) return cudaErrorInvalidValue;
  if (!aligned(x) || !aligned(conv_inputs) || !aligned(dy) || !aligned(dx) || !aligned(d_conv_inputs) ||
      !aligned(workspace)) {
    return cudaErrorInvalidValue;
  }
  if (width == 1) d_conv_inputs = nullptr;  // no such rows
  const int64_t positions = length + width - 1, parts = parts_for(batch, positions, channels);
  const int64_t per_part = (positions + parts - 1) / parts;
  float* weight_parts = d_weight != nullptr ? static_cast<float*>(workspace) : nullptr;
  if (positions > 0 && (dx != nullptr || d_conv_inputs != nullptr || weight_parts != nullptr)) {
    const dim3 grid(static_cast<unsigned>(channels / 4 / kThreads + (channels / 4 % kThreads != 0)),
                    static_cast<unsigned>(parts), static_cast<unsigned>(batch));
    const cudaError_t error = with_width(width, [&](auto w) {
      conv_backward_kernel<decltype(w)::value><<<grid, kThreads, 0, stream>>>(
          x, conv_inputs, weight, dy, dx, d_conv_inputs, weight_parts, length, channels, head / 4, eps, per_part);
      return cudaGetLastError();
    });
    if (error != cudaSuccess) return error;
  } else if (weight_parts != nullptr) {  // no positions: nothing to sum
    return cudaMemsetAsync(d_weight, 0, static_cast<size_t>(channels * width) * sizeof(float), stream);
  }
  if (d_weight == nullptr) return cudaSuccess;
  const int64_t size = channels * width;
  conv_weight_kernel<<<static_cast<unsigned>((size + 255) / 256), 256, 0, stream>>>(weight_parts, batch * parts, size,
                                                                                    d_weight);
  return cudaGetLastError();
}

}  // namespace odyssey::kernels
