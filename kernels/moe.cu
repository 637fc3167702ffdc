// MoE kernels (contracts: kernels/moe.h; design and numerics: kernels/JOURNAL.md, "MoE kernels").
#include "kernels/moe.h"
#include "kernels/situ.cuh"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace odyssey::kernels {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;

// ---- element access -----------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ float load_f32(const T* p, int64_t i);
template <>
__device__ __forceinline__ float load_f32<float>(const float* p, int64_t i) {
  return p[i];
}
template <>
__device__ __forceinline__ float load_f32<__nv_bfloat16>(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}

// 8 bf16 as one 16-byte piece (uint4 in memory).
struct Bf16x8 {
  __nv_bfloat162 pair[4];
};
static_assert(sizeof(Bf16x8) == 16, "16-byte pieces");

// acc[j] = fmaf(v, piece[j], acc[j]) for the 8 elements of a 16-byte bf16 piece.
__device__ __forceinline__ void add_scaled8(float (&acc)[8], float v, const uint4& raw) {
  const Bf16x8& x = reinterpret_cast<const Bf16x8&>(raw);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = __bfloat1622float2(x.pair[q]);
    acc[2 * q] = fmaf(v, f.x, acc[2 * q]);
    acc[2 * q + 1] = fmaf(v, f.y, acc[2 * q + 1]);
  }
}

// 8 floats rounded to bf16 as one 16-byte piece.
__device__ __forceinline__ uint4 pack8(const float (&x)[8]) {
  Bf16x8 out;
#pragma unroll
  for (int q = 0; q < 4; ++q) out.pair[q] = __floats2bfloat162_rn(x[2 * q], x[2 * q + 1]);
  return reinterpret_cast<const uint4&>(out);
}

template <typename T>
__device__ __forceinline__ void store_f32(T* p, int64_t i, float v);
template <>
__device__ __forceinline__ void store_f32<float>(float* p, int64_t i, float v) {
  p[i] = v;
}
template <>
__device__ __forceinline__ void store_f32<__nv_bfloat16>(__nv_bfloat16* p, int64_t i, float v) {
  p[i] = __float2bfloat16_rn(v);
}

int64_t blocks_for(int64_t work, int64_t threads, int64_t cap = 65535LL * 32) {
  const int64_t blocks = (work + threads - 1) / threads;
  return blocks < 1 ? 1 : (blocks > cap ? cap : blocks);
}

// The elementwise kernels' loop: body(i) for every i in [0, count), the grid striding over the
// range (a grid of blocks_for(count, ...) blocks, possibly capped).
template <typename Body>
__device__ __forceinline__ void for_each_index(int64_t count, const Body& body) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    body(i);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Threads of a CTA that walks one row of `width` columns: one column each where the row fits in
// 1024 (a whole number of warps), else 1024 striding over the row.
int row_threads(int64_t width) {
  return width >= 1024 ? 1024 : static_cast<int>((width + 31) / 32 * 32);
}

// ---- warp top-k over one row ----------------------------------------------------------------------
// Lane l holds the row's experts l, l + 32, l + 64, ... (VPL of them: coalesced loads). Order:
// larger value first, then lower expert id: a strict total order, so every lane of the xor
// butterfly ends with the same winner. Each lane keeps a short list of its own next kList
// values in that order; a round reduces the lanes' list heads to the row's best, and the winning
// lane pops its head. A lane's values are taken in rank order, so "taken" is "ranks before or
// equals the last value taken from this lane" (no mask), and a lane whose list runs dry refills
// it from the values ranking after that one: a rare, divergent scan of VPL values (a lane's
// 1 + kList-th win) instead of one per round. (Before: the winner rescanned its VPL values every
// round: 0.124 ms for 8192 rows of 896 experts, k = 16, against 0.046 ms; the same ids, weights and
// histograms bit for bit.)

__device__ __forceinline__ bool ranks_before(float a, int ia, float b, int ib) {
  return a > b || (a == b && ia < ib);
}

template <int VPL>
struct WarpRow {
  // 4: the top-k of 8192 rows of 896 experts (k = 16) 0.046 ms, against 0.071 with 2, 0.058 with
  // 3 and 0.070 with 6 (the refill's insertion grows with the list; fewer refills past 4).
  static constexpr int kList = 4;
  float s[VPL];  // unbiased scores
  float v[VPL];  // scores + bias
  int n = 0;
  float last_v = INFINITY;  // the last value taken from this lane (nothing taken: +inf, id -1)
  int last_i = -1;
  float list_v[kList], list_s[kList];  // this lane's next values in rank order, their scores
  int list_i[kList];                   // and experts (INT_MAX: none left)

  __device__ void load(const float* scores_row, const float* bias, int width, int lane) {
    n = width;
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      const int e = lane + 32 * j;
      if (e < n) {
        s[j] = scores_row[e];
        v[j] = __fadd_rn(s[j], bias[e]);
      } else {
        s[j] = 0.f;
        v[j] = -INFINITY;
      }
    }
    refill(lane);
  }

  // Whether slot j (expert e) is still to be taken.
  __device__ __forceinline__ bool remaining(int j, int e) const {
    return e < n && ranks_before(last_v, last_i, v[j], e);
  }

  // The list from the lane's remaining values: insertion into kList sorted entries.
  __device__ void refill(int lane) {
#pragma unroll
    for (int t = 0; t < kList; ++t) list_v[t] = -INFINITY, list_s[t] = 0.f, list_i[t] = INT_MAX;
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      const int e = lane + 32 * j;
      if (!remaining(j, e) || !ranks_before(v[j], e, list_v[kList - 1], list_i[kList - 1])) continue;
      list_v[kList - 1] = v[j], list_s[kList - 1] = s[j], list_i[kList - 1] = e;
#pragma unroll
      for (int t = kList - 1; t > 0; --t) {
        if (ranks_before(list_v[t], list_i[t], list_v[t - 1], list_i[t - 1])) {
          const float xv = list_v[t], xs = list_s[t];
          const int xi = list_i[t];
          list_v[t] = list_v[t - 1], list_s[t] = list_s[t - 1], list_i[t] = list_i[t - 1];
          list_v[t - 1] = xv, list_s[t - 1] = xs, list_i[t - 1] = xi;
        }
      }
    }
  }

  // One round: the row's best remaining (value, expert) on every lane, and the winner's
  // unbiased score; the winner pops it from its list.
  __device__ void take_best(int lane, float& value, int& expert, float& score) {
    float bv = list_v[0];
    int bi = list_i[0];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float ov = __shfl_xor_sync(kFullMask, bv, offset);
      const int oi = __shfl_xor_sync(kFullMask, bi, offset);
      if (ranks_before(ov, oi, bv, bi)) {
        bv = ov;
        bi = oi;
      }
    }
    float my_score = 0.f;
    if (bi != INT_MAX && (bi & 31) == lane && bi == list_i[0]) {
      my_score = list_s[0];
      last_v = list_v[0];
      last_i = list_i[0];
#pragma unroll
      for (int t = 0; t + 1 < kList; ++t) list_v[t] = list_v[t + 1], list_s[t] = list_s[t + 1], list_i[t] = list_i[t + 1];
      list_v[kList - 1] = -INFINITY, list_s[kList - 1] = 0.f, list_i[kList - 1] = INT_MAX;
      if (list_i[0] == INT_MAX) refill(lane);
    }
    value = bv;
    expert = bi;
    score = __shfl_sync(kFullMask, my_score, bi & 31);
  }

  // Bit j: slot j's expert has been taken (slots past the row's end count as taken).
  __device__ uint32_t taken_mask(int lane) const {
    uint32_t mask = 0;
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      if (!remaining(j, lane + 32 * j)) mask |= 1u << j;
    }
    return mask;
  }
};

template <int VPL>
__global__ void router_topk_kernel(const float* __restrict__ scores, const float* __restrict__ bias,
                                   int64_t* __restrict__ ids, float* __restrict__ weights,
                                   int64_t m, int n, int top_k) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= m) return;  // whole warps exit together
  WarpRow<VPL> w;
  w.load(scores + row * n, bias, n, lane);
  int my_id = 0;
  float my_score = 0.f, sum = 0.f;
  for (int r = 0; r < top_k; ++r) {
    float value, score;
    int expert;
    w.take_best(lane, value, expert, score);
    sum += score;  // selection order, the same on every lane
    if (lane == r) {
      my_id = expert;
      my_score = score;
    }
  }
  if (lane < top_k) {
    ids[row * top_k + lane] = my_id;
    if (weights != nullptr) weights[row * top_k + lane] = my_score / sum;
  }
}

// One warp per token row: lane j < top_k takes selected expert j's score and d_p, the row's sum of
// scores and sum of d_p p come from two xor reductions, and lane j writes d_logits[row, j].
__global__ void router_logit_gradient_kernel(const float* __restrict__ scores,
                                             const int64_t* __restrict__ ids,
                                             const float* __restrict__ d_p,
                                             float* __restrict__ d_logits, int64_t m, int n,
                                             int top_k) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= m) return;  // whole warps exit together
  float s = 0.0f, dp = 0.0f;
  if (lane < top_k) {
    s = scores[row * n + ids[row * top_k + lane]];
    dp = d_p[row * top_k + lane];
  }
  float total = s;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
  float dot = lane < top_k ? dp * (s / total) : 0.0f;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  if (lane < top_k) d_logits[row * top_k + lane] = (dp - dot) / total * (s * (1.0f - s));
}

__global__ void split_bf16_kernel(const float* __restrict__ x, int64_t count, int parts,
                                  __nv_bfloat16* __restrict__ out0, __nv_bfloat16* __restrict__ out1,
                                  __nv_bfloat16* __restrict__ out2) {
  for_each_index(count, [&](int64_t i) {
    float rest = x[i];
    const __nv_bfloat16 a = __float2bfloat16_rn(rest);
    out0[i] = a;
    if (parts < 2) return;
    rest -= __bfloat162float(a);  // exact: x minus its nearest bf16
    const __nv_bfloat16 b = __float2bfloat16_rn(rest);
    out1[i] = b;
    if (parts < 3) return;
    out2[i] = __float2bfloat16_rn(rest - __bfloat162float(b));
  });
}

// Router dx: CTA (blockIdx.x, blockIdx.y) owns columns [32 x, 32 x + 32) and tokens
// [y tokens_per_cta, ...). W_r's 32 columns of all n experts go to shared memory as fp32 (row e:
// 32 floats, 128 bytes). Then each warp takes 4 tokens at a time, 8 lanes a token and 4 columns a
// lane: lane q of a token's 8 holds the token's slots q, q + 8, ... (expert and d_logit, loaded
// with the next step's so that two round trips to L2 overlap) and hands each out by a shuffle
// inside the 8; every lane adds slot j's W_r row piece (one 16-byte shared load) in slot order.
constexpr int kRouterDxColumns = 32;
constexpr int kRouterDxWarps = 16;
constexpr int kRouterDxTokensPerWarp = 4;  // 8 lanes a token
template <typename TW>
__global__ void __launch_bounds__(kRouterDxWarps * 32)
    router_dx_kernel(const float* __restrict__ d_logits, const int64_t* __restrict__ ids,
                     const TW* __restrict__ weight, __nv_bfloat16* __restrict__ dx, int64_t m,
                     int n, int d, int top_k, int64_t tokens_per_cta) {
  extern __shared__ float4 w_cols4[];  // [n][8]: 32 columns as 8 float4
  float* w_cols = reinterpret_cast<float*>(w_cols4);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c0 = blockIdx.x * kRouterDxColumns;
#pragma unroll 8
  for (int e = warp; e < n; e += kRouterDxWarps) {
    w_cols[e * kRouterDxColumns + lane] = load_f32(weight, static_cast<int64_t>(e) * d + c0 + lane);
  }
  __syncthreads();
  const int64_t t_begin = blockIdx.y * tokens_per_cta;
  const int64_t t_end = t_begin + tokens_per_cta < m ? t_begin + tokens_per_cta : m;
  const int sub = lane >> 3, q = lane & 7, group = lane & ~7;
  constexpr int kStep = kRouterDxWarps * kRouterDxTokensPerWarp;
  // Slots q, q + 8, q + 16, q + 24 of token t (zeros past top_k or m).
  auto load = [&](int64_t t, int (&expert)[4], float (&value)[4]) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int j = q + 8 * r;
      const bool live = j < top_k && t < t_end;
      expert[r] = live ? static_cast<int>(__ldg(ids + t * top_k + j)) : 0;
      value[r] = live ? __ldg(d_logits + t * top_k + j) : 0.0f;
    }
  };
  int64_t t = t_begin + warp * kRouterDxTokensPerWarp + sub;
  int expert[4], next_expert[4];
  float value[4], next_value[4];
  load(t, expert, value);
  for (; t - sub < t_end; t += kStep) {
    load(t + kStep, next_expert, next_value);
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      if (8 * r >= top_k) break;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (8 * r + i >= top_k) break;
        const int e = __shfl_sync(0xffffffffu, expert[r], group + i);
        const float v = __shfl_sync(0xffffffffu, value[r], group + i);
        const float4 w = w_cols4[e * (kRouterDxColumns / 4) + q];
        acc.x = fmaf(v, w.x, acc.x);
        acc.y = fmaf(v, w.y, acc.y);
        acc.z = fmaf(v, w.z, acc.z);
        acc.w = fmaf(v, w.w, acc.w);
      }
    }
    if (t < t_end) {
      __nv_bfloat162 lo = __floats2bfloat162_rn(acc.x, acc.y), hi = __floats2bfloat162_rn(acc.z, acc.w);
      uint2 packed;
      packed.x = *reinterpret_cast<uint32_t*>(&lo);
      packed.y = *reinterpret_cast<uint32_t*>(&hi);
      *reinterpret_cast<uint2*>(dx + t * d + c0 + 4 * q) = packed;
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) expert[r] = next_expert[r], value[r] = next_value[r];
  }
}

// Router dW, part (blockIdx.x = expert e, blockIdx.y = split s): rows [lo + len s / S,
// lo + len (s + 1) / S) of e in the permuted order, 128 at a time: each thread stages one row's
// token and d_logit in shared memory, then every thread adds those rows' 8 columns (one 16-byte
// load of x each) in row order. The part's sums go to partial[s][e][:], every column written
// (zeros for an empty part).
constexpr int kRouterDwThreads = 128;
__global__ void __launch_bounds__(kRouterDwThreads)
    router_dw_part_kernel(const float* __restrict__ d_logits, const __nv_bfloat16* __restrict__ x,
                          const int64_t* __restrict__ source, const int64_t* __restrict__ offsets,
                          float* __restrict__ partial, int n, int d, int top_k) {
  __shared__ int64_t row_token[kRouterDwThreads];
  __shared__ float row_value[kRouterDwThreads];
  const int e = blockIdx.x, split = blockIdx.y;
  const int64_t lo = offsets[e], len = offsets[e + 1] - lo;
  const int64_t r_begin = lo + len * split / kMoeRouterDwSplits;
  const int64_t r_end = lo + len * (split + 1) / kMoeRouterDwSplits;
  float* out = partial + (static_cast<int64_t>(split) * n + e) * d;
  for (int block0 = 0; block0 < d; block0 += kRouterDwThreads * 8) {  // uniform: barriers inside
    const int col = block0 + threadIdx.x * 8;
    const bool active = col < d;
    float acc[8] = {};
    for (int64_t r0 = r_begin; r0 < r_end; r0 += kRouterDwThreads) {
      const int rows = r_end - r0 < kRouterDwThreads ? static_cast<int>(r_end - r0) : kRouterDwThreads;
      __syncthreads();  // the previous batch's rows are read
      if (threadIdx.x < rows) {
        const int64_t c = source[r0 + threadIdx.x];
        row_token[threadIdx.x] = c / top_k;
        row_value[threadIdx.x] = d_logits[c];
      }
      __syncthreads();
      int i = 0;
      if (!active) i = rows;
      for (; i + 4 <= rows; i += 4) {
        uint4 raw[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) raw[u] = __ldg(reinterpret_cast<const uint4*>(x + row_token[i + u] * d + col));
#pragma unroll
        for (int u = 0; u < 4; ++u) add_scaled8(acc, row_value[i + u], raw[u]);
      }
      for (; i < rows; ++i) {
        add_scaled8(acc, row_value[i], __ldg(reinterpret_cast<const uint4*>(x + row_token[i] * d + col)));
      }
    }
    if (active) {
      reinterpret_cast<float4*>(out + col)[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      reinterpret_cast<float4*>(out + col)[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
  }
}

// Router dW, the parts added in order: dw[i] = ((p_0 + p_1) + p_2) + ... over the n d elements.
template <typename TW>
__global__ void router_dw_sum_kernel(const float* __restrict__ partial, TW* __restrict__ dw,
                                     int64_t count) {
  for_each_index(count, [&](int64_t i) {
    float sum = partial[i];
#pragma unroll
    for (int s = 1; s < kMoeRouterDwSplits; ++s) sum += partial[s * count + i];
    store_f32(dw, i, sum);
  });
}

template <int VPL>
__global__ void quantile_histogram_kernel(const float* __restrict__ scores,
                                          const float* __restrict__ bias,
                                          unsigned long long* __restrict__ counts, int64_t m,
                                          int n, int top_k, int64_t bins, double lo,
                                          double scale, bool literal_alpha) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= m) return;
  WarpRow<VPL> w;
  w.load(scores + row * n, bias, n, lane);
  float kth = 0.f, alpha = 0.f;
  uint32_t chosen = 0;
  for (int r = 0; r <= top_k; ++r) {
    float value, score;
    int expert;
    if (r == top_k) chosen = w.taken_mask(lane);  // the top_k selected (and the slots past n)
    w.take_best(lane, value, expert, score);
    if (r == top_k - 1) kth = value;
    if (r == top_k) alpha = value;
  }
  const double top_bin = static_cast<double>(bins - 1);
#pragma unroll
  for (int j = 0; j < VPL; ++j) {
    const int e = lane + 32 * j;
    if (e >= n) continue;
    const bool is_chosen = (chosen >> j) & 1u;
    const float r = __fsub_rn(literal_alpha || is_chosen ? alpha : kth, w.s[j]);
    double b = floor(__dmul_rn(__dsub_rn(static_cast<double>(r), lo), scale));
    b = fmin(fmax(b, 0.0), top_bin);
    atomicAdd(counts + static_cast<int64_t>(e) * bins + static_cast<int64_t>(b), 1ull);
  }
}

// Values per lane: the smallest power of two with 32 * VPL >= n.
int values_per_lane(int64_t n) {
  int vpl = 1;
  while (32 * vpl < n) vpl *= 2;
  return vpl;
}

// ---- permutation ------------------------------------------------------------------------------------

constexpr int64_t kPermuteBlock = 1024;  // copies per block of the count / place kernels

int64_t permute_blocks(int64_t copies) { return (copies + kPermuteBlock - 1) / kPermuteBlock; }

// The copies [begin, end) of this CTA's block: kPermuteBlock of them, fewer in the last block.
struct BlockCopies {
  int64_t begin, end;
};
__device__ __forceinline__ BlockCopies block_copies(int64_t copies) {
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kPermuteBlock;
  return {begin, begin + kPermuteBlock < copies ? begin + kPermuteBlock : copies};
}

__global__ void permute_count_kernel(const int64_t* __restrict__ ids, int64_t copies, int n,
                                     int32_t* __restrict__ block_counts) {
  extern __shared__ int32_t shared_counts[];
  for (int e = threadIdx.x; e < n; e += blockDim.x) shared_counts[e] = 0;
  __syncthreads();
  const BlockCopies block = block_copies(copies);
  for (int64_t c = block.begin + threadIdx.x; c < block.end; c += blockDim.x) {
    const int64_t e = ids[c];
    if (e >= 0 && e < n) atomicAdd(shared_counts + e, 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < n; e += blockDim.x) {
    block_counts[static_cast<int64_t>(blockIdx.x) * n + e] = shared_counts[e];
  }
}

// One CTA of kScanThreads: per expert, the exclusive sum over blocks (in place, becoming each
// (block, expert)'s first row once the expert's offset is added); then the exclusive sum over
// experts.
constexpr int kScanThreads = 1024;

// A scan thread walks its expert's column of block_base ([blocks, n]: entry b at column[b * n])
// alone, in order. It loads kScanBatch entries before storing any, so it waits for one memory
// round trip per batch instead of one per block (128 blocks at 8K tokens x top-16).
constexpr int kScanBatch = 8;

// exclusive: replaces each entry by the sum of the entries before it; else adds base to each.
// Returns the column's total (of the entries as they were).
__device__ int32_t walk_column(int32_t* column, int64_t blocks, int n, bool exclusive,
                               int32_t base) {
  int32_t running = 0;
  for (int64_t b0 = 0; b0 < blocks; b0 += kScanBatch) {
    int32_t c[kScanBatch];
#pragma unroll
    for (int j = 0; j < kScanBatch; ++j) c[j] = b0 + j < blocks ? column[(b0 + j) * n] : 0;
#pragma unroll
    for (int j = 0; j < kScanBatch; ++j) {
      if (b0 + j < blocks) column[(b0 + j) * n] = exclusive ? running : c[j] + base;
      running += c[j];
    }
  }
  return running;
}

__global__ void permute_scan_kernel(int32_t* __restrict__ block_base, int64_t blocks, int n,
                                    int64_t* __restrict__ counts, int64_t* __restrict__ offsets,
                                    int32_t* __restrict__ group_ends) {
  extern __shared__ int32_t expert_sum[];  // n entries, then kScanThreads partial sums
  int32_t* partial = expert_sum + n;
  for (int e = threadIdx.x; e < n; e += blockDim.x) {
    const int32_t total = walk_column(block_base + e, blocks, n, /*exclusive=*/true, 0);
    expert_sum[e] = total;
    counts[e] = total;
  }
  __syncthreads();
  // Thread t owns experts [t * per, (t + 1) * per).
  const int per = (n + kScanThreads - 1) / kScanThreads;
  const int first = threadIdx.x * per;
  int32_t own = 0;
  for (int e = first; e < first + per && e < n; ++e) own += expert_sum[e];
  partial[threadIdx.x] = own;
  __syncthreads();
  for (int stride = 1; stride < kScanThreads; stride *= 2) {  // inclusive Hillis-Steele
    const int32_t add = threadIdx.x >= stride ? partial[threadIdx.x - stride] : 0;
    __syncthreads();
    partial[threadIdx.x] += add;
    __syncthreads();
  }
  int32_t offset = partial[threadIdx.x] - own;  // exclusive
  for (int e = first; e < first + per && e < n; ++e) {
    const int32_t c = expert_sum[e];
    expert_sum[e] = offset;  // now the expert's first row
    offsets[e] = offset;
    if (group_ends != nullptr) group_ends[e] = offset + c;
    offset += c;
  }
  if (threadIdx.x == kScanThreads - 1) offsets[n] = partial[kScanThreads - 1];
  __syncthreads();
  for (int e = threadIdx.x; e < n; e += blockDim.x) {
    walk_column(block_base + e, blocks, n, /*exclusive=*/false, expert_sum[e]);
  }
}

// One warp per block of copies, 32 at a time in order: lanes with the same expert find each other
// (__match_any_sync), rank among themselves by lane (popcount of the lower peers), take rows from
// the expert's running counter in shared memory, and the lowest peer advances it. Stable: a copy's
// row is its expert's first row + the number of that expert's copies before it. A lane loads all
// of its kPermuteBlock / 32 ids before the walk (independent loads in flight together), so the
// ordered walk does not wait for memory at every step.
constexpr int kPlaceSteps = static_cast<int>(kPermuteBlock / 32);

__global__ void permute_place_kernel(const int64_t* __restrict__ ids, int64_t copies, int n,
                                     int64_t top_k, const int32_t* __restrict__ block_base,
                                     int64_t* __restrict__ source, int64_t* __restrict__ token,
                                     int64_t* __restrict__ inverse) {
  extern __shared__ int32_t running[];
  const int lane = threadIdx.x;
  for (int e = lane; e < n; e += 32) running[e] = block_base[static_cast<int64_t>(blockIdx.x) * n + e];
  const BlockCopies block = block_copies(copies);
  int64_t lane_ids[kPlaceSteps];
#pragma unroll
  for (int step = 0; step < kPlaceSteps; ++step) {
    const int64_t c = block.begin + 32 * step + lane;
    lane_ids[step] = c < block.end ? ids[c] : -1;
  }
  __syncwarp();
#pragma unroll
  for (int step = 0; step < kPlaceSteps; ++step) {
    const int64_t c = block.begin + 32 * step + lane;
    const bool in_range = c < block.end;
    const int64_t e = lane_ids[step];
    const bool valid = in_range && e >= 0 && e < n;
    const int key = valid ? static_cast<int>(e) : -1;
    const unsigned peers = __match_any_sync(kFullMask, key);
    const int rank = __popc(peers & ((1u << lane) - 1u));
    const int32_t base = valid ? running[key] : 0;
    __syncwarp();
    if (valid && (__ffs(peers) - 1) == lane) running[key] = base + __popc(peers);
    __syncwarp();
    if (valid) {
      const int64_t row = static_cast<int64_t>(base) + rank;
      source[row] = c;
      token[row] = c / top_k;
      inverse[c] = row;
    } else if (in_range) {
      inverse[c] = -1;
    }
  }
}

// ---- gather / un-permute -----------------------------------------------------------------------------

template <typename V>
__global__ void gather_rows_kernel(const V* __restrict__ in, const int64_t* __restrict__ index,
                                   V* __restrict__ out, int64_t rows, int64_t vectors_per_row) {
  for_each_index(rows * vectors_per_row, [&](int64_t i) {
    const int64_t r = i / vectors_per_row, c = i - r * vectors_per_row;
    out[i] = in[index[r] * vectors_per_row + c];
  });
}

template <typename V>
cudaError_t launch_gather(const void* in, const int64_t* index, void* out, int64_t rows,
                          int64_t row_bytes, cudaStream_t stream) {
  const int64_t vectors = row_bytes / static_cast<int64_t>(sizeof(V));
  const int threads = 256;
  gather_rows_kernel<V><<<blocks_for(rows * vectors, threads), threads, 0, stream>>>(
      static_cast<const V*>(in), index, static_cast<V*>(out), rows, vectors);
  return cudaGetLastError();
}

// One CTA per token, threads over the columns; each token sums its top_k copies in slot order.
template <typename T, typename O>
__global__ void unpermute_kernel(const T* __restrict__ copies, const float* __restrict__ weights,
                                 const int64_t* __restrict__ inverse, O* __restrict__ out,
                                 int64_t m, int top_k, int64_t width) {
  const int64_t t = blockIdx.x;
  if (t >= m) return;
  for (int64_t col = threadIdx.x; col < width; col += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < top_k; ++s) {
      const int64_t c = t * top_k + s;
      const int64_t row = inverse[c];
      if (row < 0) continue;
      const float w = weights != nullptr ? weights[c] : 1.f;
      acc = fmaf(w, load_f32(copies, row * width + col), acc);
    }
    store_f32(out, t * width + col, acc);
  }
}

// The same sums for bf16 copies of a width divisible by 8, 8 columns a thread: thread i takes
// piece i % pieces of token i / pieces, loads the token's slots' rows and weights first (8 slots
// at a time, 16-byte loads) and then adds them in slot order with the same fmaf as
// unpermute_kernel: bit for bit its result, in a sixteenth of the load instructions.
template <typename O>
__global__ void unpermute_vectors_kernel(const __nv_bfloat16* __restrict__ copies,
                                         const float* __restrict__ weights,
                                         const int64_t* __restrict__ inverse, O* __restrict__ out,
                                         int64_t m, int top_k, int64_t width) {
  const int64_t pieces = width / 8;
  for_each_index(m * pieces, [&](int64_t i) {
    const int64_t t = i / pieces, col = (i - t * pieces) * 8;
    float acc[8] = {};
    for (int s0 = 0; s0 < top_k; s0 += 8) {
      uint4 raw[8];
      float w[8];
      bool live[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int s = s0 + u;
        const int64_t c = t * top_k + s;
        const int64_t row = s < top_k ? inverse[c] : -1;
        live[u] = row >= 0;
        w[u] = live[u] ? (weights != nullptr ? weights[c] : 1.f) : 0.f;
        raw[u] = live[u] ? __ldg(reinterpret_cast<const uint4*>(copies + row * width + col)) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        if (live[u]) add_scaled8(acc, w[u], raw[u]);
      }
    }
    if constexpr (std::is_same_v<O, float>) {
      reinterpret_cast<float4*>(out + t * width + col)[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      reinterpret_cast<float4*>(out + t * width + col)[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    } else {
      *reinterpret_cast<uint4*>(out + t * width + col) = pack8(acc);
    }
  });
}

// One warp per copy c (its permuted row inverse[c], its token c / top_k), both gradients in one
// pass over the token's d_out row: d_copies[row] = weights[c] d_out[token] (one rounding to T) and
// d_weights[c] = <d_out[token], copies[row]> in fp32 (either output may be nullptr). The warps of a
// token's k copies are neighbours, so its d_out row is read from memory about once.
template <typename T>
__global__ void unpermute_backward_kernel(const T* __restrict__ copies,
                                          const float* __restrict__ weights,
                                          const int64_t* __restrict__ inverse,
                                          const float* __restrict__ d_out, T* __restrict__ d_copies,
                                          float* __restrict__ d_weights, int64_t n_copies,
                                          int64_t top_k, int64_t width) {
  const int lane = threadIdx.x & 31;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (c >= n_copies) return;
  const int64_t row = inverse[c];
  float acc = 0.f;
  if (row >= 0) {
    const float w = weights != nullptr ? weights[c] : 1.f;
    const float* d = d_out + (c / top_k) * width;
    for (int64_t col = lane; col < width; col += 32) {
      const float grad = d[col];
      if (d_copies != nullptr) store_f32(d_copies, row * width + col, w * grad);
      if (d_weights != nullptr) acc = fmaf(grad, load_f32(copies, row * width + col), acc);
    }
  }
  if (d_weights == nullptr) return;  // uniform across the warp
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(kFullMask, acc, offset);
  if (lane == 0) d_weights[c] = acc;
}

// ---- SiTU-GLU ------------------------------------------------------------------------------------------

// h for results of type T (situ.cuh): bf16 on the special-function unit, as the fused experts'
// epilogue computes it (so a forward, fused or not, and the backward's recomputation give the same
// bits); fp32 from the accurate terms.
template <typename T>
__device__ __forceinline__ float situ_h_for(float g, float u, const SituCaps& caps) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return situ_h_fast(g, u, caps);
  } else {
    return situ_h(situ_terms(g, u, caps));
  }
}

template <typename T>
__global__ void situ_forward_kernel(const T* __restrict__ gate, const T* __restrict__ up,
                                    T* __restrict__ h, int64_t count, SituCaps caps) {
  for_each_index(count, [&](int64_t i) { store_f32(h, i, situ_h_for<T>(load_f32(gate, i), load_f32(up, i), caps)); });
}

// h (may be nullptr): the forward's output recomputed in the same pass, for a caller that did not
// keep it (situ_h_for: situ_glu_forward's bits). The gradients from the accurate terms.
template <typename T>
__global__ void situ_backward_kernel(const T* __restrict__ gate, const T* __restrict__ up,
                                     const T* __restrict__ dh, T* __restrict__ d_gate,
                                     T* __restrict__ d_up, T* __restrict__ h, int64_t count,
                                     SituCaps caps) {
  for_each_index(count, [&](int64_t i) {
    const float d = load_f32(dh, i), g = load_f32(gate, i), u = load_f32(up, i);
    const SituTerms s = situ_terms(g, u, caps);
    store_f32(d_gate, i, situ_d_gate(s, d));
    store_f32(d_up, i, situ_d_up(s, d));
    if (h != nullptr) store_f32(h, i, situ_h_for<T>(g, u, caps));
  });
}

// bf16 in pieces of 8 elements (Bf16x8, above; the launchers take these where the count is a
// multiple of 8 and every pointer 16-byte aligned): each element's value is the scalar kernel's,
// the same terms and one rounding.

__global__ void situ_forward_x8_kernel(const uint4* __restrict__ gate, const uint4* __restrict__ up,
                                       uint4* __restrict__ h, int64_t pieces, SituCaps caps) {
  for_each_index(pieces, [&](int64_t i) {
    const uint4 g_raw = gate[i], u_raw = up[i];
    const Bf16x8& g = reinterpret_cast<const Bf16x8&>(g_raw);
    const Bf16x8& u = reinterpret_cast<const Bf16x8&>(u_raw);
    Bf16x8 out;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 gf = __bfloat1622float2(g.pair[j]), uf = __bfloat1622float2(u.pair[j]);
      out.pair[j] = __floats2bfloat162_rn(situ_h_fast(gf.x, uf.x, caps), situ_h_fast(gf.y, uf.y, caps));
    }
    h[i] = reinterpret_cast<const uint4&>(out);
  });
}

__global__ void situ_backward_x8_kernel(const uint4* __restrict__ gate, const uint4* __restrict__ up,
                                        const uint4* __restrict__ dh, uint4* __restrict__ d_gate,
                                        uint4* __restrict__ d_up, uint4* __restrict__ h, int64_t pieces,
                                        SituCaps caps) {
  for_each_index(pieces, [&](int64_t i) {
    const uint4 g_raw = gate[i], u_raw = up[i], d_raw = dh[i];
    const Bf16x8& g = reinterpret_cast<const Bf16x8&>(g_raw);
    const Bf16x8& u = reinterpret_cast<const Bf16x8&>(u_raw);
    const Bf16x8& d = reinterpret_cast<const Bf16x8&>(d_raw);
    Bf16x8 dg, du, hh;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 gf = __bfloat1622float2(g.pair[j]), uf = __bfloat1622float2(u.pair[j]);
      const float2 df = __bfloat1622float2(d.pair[j]);
      const SituTerms a = situ_terms(gf.x, uf.x, caps);
      const SituTerms b = situ_terms(gf.y, uf.y, caps);
      dg.pair[j] = __floats2bfloat162_rn(situ_d_gate(a, df.x), situ_d_gate(b, df.y));
      du.pair[j] = __floats2bfloat162_rn(situ_d_up(a, df.x), situ_d_up(b, df.y));
      if (h != nullptr) {
        hh.pair[j] = __floats2bfloat162_rn(situ_h_fast(gf.x, uf.x, caps), situ_h_fast(gf.y, uf.y, caps));
      }
    }
    d_gate[i] = reinterpret_cast<const uint4&>(dg);
    d_up[i] = reinterpret_cast<const uint4&>(du);
    if (h != nullptr) h[i] = reinterpret_cast<const uint4&>(hh);
  });
}

template <typename V>
__global__ void zero_empty_groups_kernel(V* __restrict__ data, const int64_t* __restrict__ counts,
                                         int64_t vectors_per_group) {
  const int64_t g = blockIdx.y;
  if (counts[g] != 0) return;
  V* row = data + g * vectors_per_group;
  for_each_index(vectors_per_group, [&](int64_t i) { row[i] = V{}; });
}

bool valid_dtype(MoeDtype d) { return d == MoeDtype::kBFloat16 || d == MoeDtype::kFloat32; }

// launch(T{}) with T the element type of a valid dtype: __nv_bfloat16 or float.
template <typename Launch>
void with_element_type(MoeDtype dtype, const Launch& launch) {
  if (dtype == MoeDtype::kBFloat16) {
    launch(__nv_bfloat16{});
  } else {
    launch(float{});
  }
}

// The elementwise SiTU-GLU launches: their checks and their grid.
bool situ_arguments_valid(MoeDtype dtype, int64_t count, float beta1, float beta2) {
  return valid_dtype(dtype) && count >= 0 && beta1 > 0.f && beta2 > 0.f;
}
constexpr int kSituThreads = 256;
int64_t situ_blocks(int64_t count) { return blocks_for(count, kSituThreads, 132 * 32); }
SituCaps situ_caps(float beta1, float beta2) { return {beta1, beta2, 1.f / beta1, 1.f / beta2}; }
// bf16 with a count of whole 16-byte pieces and every pointer (nullptr allowed) 16-byte aligned.
bool situ_in_pieces(MoeDtype dtype, int64_t count, std::initializer_list<const void*> pointers) {
  if (dtype != MoeDtype::kBFloat16 || count % 8 != 0) return false;
  for (const void* p : pointers) {
    if (!aligned16(p)) return false;
  }
  return true;
}

}  // namespace

// ---- launchers ---------------------------------------------------------------------------------------

cudaError_t moe_router_topk(const float* scores, const float* bias, int64_t* ids, float* weights,
                            int64_t m, int64_t n, int64_t top_k, cudaStream_t stream) {
  if (m < 0 || n < 1 || n > kMoeTopkMaxExperts || top_k < 1 || top_k > kMoeTopkMaxK ||
      top_k > n) {
    return cudaErrorInvalidValue;
  }
  if (m == 0) return cudaSuccess;
  const int warps = 8;
  const dim3 grid(static_cast<unsigned>((m + warps - 1) / warps)), block(32 * warps);
  const int ni = static_cast<int>(n), ki = static_cast<int>(top_k);
  switch (values_per_lane(n)) {
    case 1: router_topk_kernel<1><<<grid, block, 0, stream>>>(scores, bias, ids, weights, m, ni, ki); break;
    case 2: router_topk_kernel<2><<<grid, block, 0, stream>>>(scores, bias, ids, weights, m, ni, ki); break;
    case 4: router_topk_kernel<4><<<grid, block, 0, stream>>>(scores, bias, ids, weights, m, ni, ki); break;
    case 8: router_topk_kernel<8><<<grid, block, 0, stream>>>(scores, bias, ids, weights, m, ni, ki); break;
    case 16: router_topk_kernel<16><<<grid, block, 0, stream>>>(scores, bias, ids, weights, m, ni, ki); break;
    default: router_topk_kernel<32><<<grid, block, 0, stream>>>(scores, bias, ids, weights, m, ni, ki); break;
  }
  return cudaGetLastError();
}

cudaError_t moe_router_logit_gradient(const float* scores, const int64_t* ids, const float* d_p,
                                      float* d_logits, int64_t m, int64_t n, int64_t top_k,
                                      cudaStream_t stream) {
  if (m < 0 || top_k < 1 || top_k > kMoeTopkMaxK || top_k > n || n > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  if (m == 0) return cudaSuccess;
  const int warps = 8;
  const dim3 grid(static_cast<unsigned>((m + warps - 1) / warps)), block(32 * warps);
  router_logit_gradient_kernel<<<grid, block, 0, stream>>>(scores, ids, d_p, d_logits, m,
                                                           static_cast<int>(n), static_cast<int>(top_k));
  return cudaGetLastError();
}

cudaError_t moe_split_bf16(const float* x, int64_t count, int parts, void* out0, void* out1, void* out2,
                           cudaStream_t stream) {
  if (count < 0 || parts < 1 || parts > 3 || (parts >= 2 && out1 == nullptr) || (parts >= 3 && out2 == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (count == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(blocks_for(count, 256));
  split_bf16_kernel<<<blocks, 256, 0, stream>>>(x, count, parts, static_cast<__nv_bfloat16*>(out0),
                                                static_cast<__nv_bfloat16*>(out1), static_cast<__nv_bfloat16*>(out2));
  return cudaGetLastError();
}

cudaError_t moe_router_dx(const float* d_logits, const int64_t* ids, MoeDtype weight_dtype,
                          const void* weight, void* dx, int64_t m, int64_t n, int64_t d, int64_t top_k,
                          cudaStream_t stream) {
  if (m < 0 || top_k < 1 || top_k > kMoeTopkMaxK || n < 1 || n > kMoeRouterMaxExperts || d < 1 ||
      d % kRouterDxColumns != 0 || d > INT_MAX) {
    return cudaErrorInvalidValue;
  }
  if (m == 0) return cudaSuccess;
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  // About two CTAs an SM (each holds n x 32 fp32 of W_r: 112 KB at n = 896) over the column slices,
  // the tokens split evenly among a slice's CTAs.
  const int64_t slices = d / kRouterDxColumns;
  const int64_t wanted_blocks = std::max<int64_t>(1, 2 * static_cast<int64_t>(sms) / slices);
  constexpr int64_t kStep = kRouterDxWarps * kRouterDxTokensPerWarp;
  const int64_t token_blocks = std::min<int64_t>(wanted_blocks, (m + kStep - 1) / kStep);
  const int64_t per_cta = (m + token_blocks - 1) / token_blocks;
  const size_t shared = static_cast<size_t>(n) * kRouterDxColumns * sizeof(float);
  const dim3 grid(static_cast<unsigned>(slices), static_cast<unsigned>(token_blocks)), block(kRouterDxWarps * 32);
  auto launch = [&](auto kernel, auto* w) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
    if (e != cudaSuccess) return e;
    kernel<<<grid, block, shared, stream>>>(d_logits, ids, w, static_cast<__nv_bfloat16*>(dx), m,
                                            static_cast<int>(n), static_cast<int>(d), static_cast<int>(top_k),
                                            per_cta);
    return cudaGetLastError();
  };
  if (weight_dtype == MoeDtype::kFloat32) return launch(router_dx_kernel<float>, static_cast<const float*>(weight));
  return launch(router_dx_kernel<__nv_bfloat16>, static_cast<const __nv_bfloat16*>(weight));
}

size_t moe_router_dw_workspace_bytes(int64_t n, int64_t d) {
  return static_cast<size_t>(kMoeRouterDwSplits) * static_cast<size_t>(n < 0 ? 0 : n) *
         static_cast<size_t>(d < 0 ? 0 : d) * sizeof(float);
}

cudaError_t moe_router_dw(const float* d_logits, const void* x, const int64_t* source,
                          const int64_t* offsets, MoeDtype weight_dtype, void* dw, void* workspace,
                          int64_t m, int64_t n, int64_t d, int64_t top_k, cudaStream_t stream) {
  if (m < 0 || top_k < 1 || top_k > kMoeTopkMaxK || n < 1 || n > kMoeRouterMaxExperts || d < 1 || d % 8 != 0 ||
      d > INT_MAX) {
    return cudaErrorInvalidValue;
  }
  float* partial = static_cast<float*>(workspace);
  router_dw_part_kernel<<<dim3(static_cast<unsigned>(n), kMoeRouterDwSplits), kRouterDwThreads, 0, stream>>>(
      d_logits, static_cast<const __nv_bfloat16*>(x), source, offsets, partial, static_cast<int>(n),
      static_cast<int>(d), static_cast<int>(top_k));
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int64_t count = n * d;
  const unsigned blocks = static_cast<unsigned>(blocks_for(count, 256));
  if (weight_dtype == MoeDtype::kFloat32) {
    router_dw_sum_kernel<<<blocks, 256, 0, stream>>>(partial, static_cast<float*>(dw), count);
  } else {
    router_dw_sum_kernel<<<blocks, 256, 0, stream>>>(partial, static_cast<__nv_bfloat16*>(dw), count);
  }
  return cudaGetLastError();
}

cudaError_t moe_quantile_histogram(const float* scores, const float* bias, int64_t* counts,
                                   int64_t m, int64_t n, int64_t top_k, int64_t bins, double lo,
                                   double scale, bool literal_alpha, cudaStream_t stream) {
  if (m < 0 || top_k < 1 || top_k + 1 > n || n > kMoeTopkMaxExperts || top_k + 1 > kMoeTopkMaxK ||
      bins < 1 || !(scale > 0.0) || !std::isfinite(lo)) {
    return cudaErrorInvalidValue;
  }
  if (m == 0) return cudaSuccess;
  const int warps = 8;
  const dim3 grid(static_cast<unsigned>((m + warps - 1) / warps)), block(32 * warps);
  const int ni = static_cast<int>(n), ki = static_cast<int>(top_k);
  auto* out = reinterpret_cast<unsigned long long*>(counts);
  switch (values_per_lane(n)) {
    case 1: quantile_histogram_kernel<1><<<grid, block, 0, stream>>>(scores, bias, out, m, ni, ki, bins, lo, scale, literal_alpha); break;
    case 2: quantile_histogram_kernel<2><<<grid, block, 0, stream>>>(scores, bias, out, m, ni, ki, bins, lo, scale, literal_alpha); break;
    case 4: quantile_histogram_kernel<4><<<grid, block, 0, stream>>>(scores, bias, out, m, ni, ki, bins, lo, scale, literal_alpha); break;
    case 8: quantile_histogram_kernel<8><<<grid, block, 0, stream>>>(scores, bias, out, m, ni, ki, bins, lo, scale, literal_alpha); break;
    case 16: quantile_histogram_kernel<16><<<grid, block, 0, stream>>>(scores, bias, out, m, ni, ki, bins, lo, scale, literal_alpha); break;
    default: quantile_histogram_kernel<32><<<grid, block, 0, stream>>>(scores, bias, out, m, ni, ki, bins, lo, scale, literal_alpha); break;
  }
  return cudaGetLastError();
}

size_t moe_permutation_workspace_bytes(int64_t copies, int64_t n) {
  const int64_t blocks = permute_blocks(copies < 1 ? 1 : copies);
  return static_cast<size_t>(blocks * n) * sizeof(int32_t);
}

cudaError_t moe_permutation(const int64_t* ids, int64_t copies, int64_t n, int64_t top_k,
                            int64_t* counts, int64_t* offsets, int32_t* group_ends,
                            int64_t* source, int64_t* token, int64_t* inverse, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream) {
  if (n < 1 || n > kMoePermutationMaxExperts || copies < 0 || copies >= (int64_t{1} << 31) ||
      top_k < 1) {
    return cudaErrorInvalidValue;
  }
  const size_t needed = moe_permutation_workspace_bytes(copies, n);
  if (workspace == nullptr || workspace_bytes < needed) return cudaErrorInvalidValue;
  const int ni = static_cast<int>(n);
  auto* block_base = static_cast<int32_t*>(workspace);
  const int64_t blocks = permute_blocks(copies);
  const size_t expert_bytes = static_cast<size_t>(n) * sizeof(int32_t);
  if (copies > 0) {
    permute_count_kernel<<<static_cast<unsigned>(blocks), 256, expert_bytes, stream>>>(
        ids, copies, ni, block_base);
  }
  const size_t scan_bytes = expert_bytes + kScanThreads * sizeof(int32_t);
  if (scan_bytes > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(
        permute_scan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(scan_bytes));
    if (e != cudaSuccess) return e;
  }
  // With no copies there are no blocks: the scan writes zero counts and offsets.
  permute_scan_kernel<<<1, kScanThreads, scan_bytes, stream>>>(block_base, copies > 0 ? blocks : 0,
                                                               ni, counts, offsets, group_ends);
  if (copies > 0) {
    permute_place_kernel<<<static_cast<unsigned>(blocks), 32, expert_bytes, stream>>>(
        ids, copies, ni, top_k, block_base, source, token, inverse);
  }
  return cudaGetLastError();
}

cudaError_t moe_gather_rows(const void* in, const int64_t* index, void* out, int64_t rows,
                            int64_t width, int64_t element_size, cudaStream_t stream) {
  if (rows < 0 || width < 0 || (element_size != 2 && element_size != 4)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0 || width == 0) return cudaSuccess;
  const int64_t row_bytes = width * element_size;
  if (row_bytes % 16 == 0) return launch_gather<uint4>(in, index, out, rows, row_bytes, stream);
  if (row_bytes % 8 == 0) return launch_gather<uint2>(in, index, out, rows, row_bytes, stream);
  if (row_bytes % 4 == 0) return launch_gather<uint32_t>(in, index, out, rows, row_bytes, stream);
  return launch_gather<uint16_t>(in, index, out, rows, row_bytes, stream);
}

cudaError_t moe_unpermute(MoeDtype dtype, const void* copies, const float* weights,
                          const int64_t* inverse, MoeDtype out_dtype, void* out, int64_t m,
                          int64_t top_k, int64_t width, cudaStream_t stream, bool vectors) {
  if (!valid_dtype(dtype) || !valid_dtype(out_dtype) || m < 0 || top_k < 1 || top_k > INT_MAX ||
      width < 0 || m > INT_MAX) {
    return cudaErrorInvalidValue;
  }
  if (m == 0 || width == 0) return cudaSuccess;
  if (vectors && dtype == MoeDtype::kBFloat16 && width % 8 == 0 && aligned16(copies) && aligned16(out)) {
    const int threads = 256;
    const unsigned blocks = static_cast<unsigned>(blocks_for(m * (width / 8), threads));
    if (out_dtype == MoeDtype::kFloat32) {
      unpermute_vectors_kernel<float><<<blocks, threads, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(copies), weights, inverse, static_cast<float*>(out), m,
          static_cast<int>(top_k), width);
    } else {
      unpermute_vectors_kernel<__nv_bfloat16><<<blocks, threads, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(copies), weights, inverse, static_cast<__nv_bfloat16*>(out), m,
          static_cast<int>(top_k), width);
    }
    return cudaGetLastError();
  }
  const int threads = row_threads(width);
  const dim3 grid(static_cast<unsigned>(m));
  const int k = static_cast<int>(top_k);
  with_element_type(dtype, [&](auto copy_zero) {
    using T = decltype(copy_zero);
    with_element_type(out_dtype, [&](auto out_zero) {
      using O = decltype(out_zero);
      unpermute_kernel<T, O><<<grid, threads, 0, stream>>>(
          static_cast<const T*>(copies), weights, inverse, static_cast<O*>(out), m, k, width);
    });
  });
  return cudaGetLastError();
}

cudaError_t moe_unpermute_backward(MoeDtype dtype, const void* copies, const float* weights,
                                   const int64_t* source, const int64_t* inverse,
                                   const float* d_out, void* d_copies, float* d_weights,
                                   int64_t m, int64_t top_k, int64_t width, cudaStream_t stream) {
  (void)source;  // the copies are walked through inverse (see moe.h)
  if (!valid_dtype(dtype) || m < 0 || top_k < 1 || width < 0) return cudaErrorInvalidValue;
  const int64_t rows = m * top_k;
  if (rows == 0 || (d_copies == nullptr && d_weights == nullptr)) return cudaSuccess;
  const int threads = 256, warps = threads / 32;
  const int64_t grid = (rows + warps - 1) / warps;
  if (grid > INT_MAX) return cudaErrorInvalidValue;
  with_element_type(dtype, [&](auto zero) {
    using T = decltype(zero);
    unpermute_backward_kernel<T><<<static_cast<unsigned>(grid), threads, 0, stream>>>(
        static_cast<const T*>(copies), weights, inverse, d_out, static_cast<T*>(d_copies),
        d_weights, rows, top_k, width);
  });
  return cudaGetLastError();
}

cudaError_t situ_glu_forward(MoeDtype dtype, const void* gate, const void* up, void* h,
                             int64_t count, float beta1, float beta2, cudaStream_t stream) {
  if (!situ_arguments_valid(dtype, count, beta1, beta2)) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  const SituCaps caps = situ_caps(beta1, beta2);
  if (situ_in_pieces(dtype, count, {gate, up, h})) {
    situ_forward_x8_kernel<<<situ_blocks(count / 8), kSituThreads, 0, stream>>>(
        static_cast<const uint4*>(gate), static_cast<const uint4*>(up), static_cast<uint4*>(h), count / 8, caps);
    return cudaGetLastError();
  }
  with_element_type(dtype, [&](auto zero) {
    using T = decltype(zero);
    situ_forward_kernel<T><<<situ_blocks(count), kSituThreads, 0, stream>>>(
        static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(h), count, caps);
  });
  return cudaGetLastError();
}

cudaError_t situ_glu_backward_with_h(MoeDtype dtype, const void* gate, const void* up,
                                     const void* dh, void* d_gate, void* d_up, void* h,
                                     int64_t count, float beta1, float beta2,
                                     cudaStream_t stream) {
  if (!situ_arguments_valid(dtype, count, beta1, beta2)) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  const SituCaps caps = situ_caps(beta1, beta2);
  if (situ_in_pieces(dtype, count, {gate, up, dh, d_gate, d_up, h})) {
    situ_backward_x8_kernel<<<situ_blocks(count / 8), kSituThreads, 0, stream>>>(
        static_cast<const uint4*>(gate), static_cast<const uint4*>(up), static_cast<const uint4*>(dh),
        static_cast<uint4*>(d_gate), static_cast<uint4*>(d_up), static_cast<uint4*>(h), count / 8, caps);
    return cudaGetLastError();
  }
  with_element_type(dtype, [&](auto zero) {
    using T = decltype(zero);
    situ_backward_kernel<T><<<situ_blocks(count), kSituThreads, 0, stream>>>(
        static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<const T*>(dh),
        static_cast<T*>(d_gate), static_cast<T*>(d_up), static_cast<T*>(h), count, caps);
  });
  return cudaGetLastError();
}

cudaError_t situ_glu_backward(MoeDtype dtype, const void* gate, const void* up, const void* dh,
                              void* d_gate, void* d_up, int64_t count, float beta1, float beta2,
                              cudaStream_t stream) {
  return situ_glu_backward_with_h(dtype, gate, up, dh, d_gate, d_up, /*h=*/nullptr, count, beta1,
                                  beta2, stream);
}

cudaError_t moe_zero_empty_groups(MoeDtype dtype, void* data, const int64_t* counts,
                                  int64_t groups, int64_t row_elements, cudaStream_t stream) {
  if (!valid_dtype(dtype) || groups < 0 || groups > 65535 || row_elements < 0) {
    return cudaErrorInvalidValue;
  }
  if (groups == 0 || row_elements == 0) return cudaSuccess;
  const int64_t row_bytes = row_elements * (dtype == MoeDtype::kBFloat16 ? 2 : 4);
  const int threads = 256;
  if (row_bytes % 16 == 0) {
    const int64_t vectors = row_bytes / 16;
    const dim3 grid(static_cast<unsigned>(blocks_for(vectors, threads, 64)), static_cast<unsigned>(groups));
    zero_empty_groups_kernel<uint4><<<grid, threads, 0, stream>>>(static_cast<uint4*>(data), counts, vectors);
  } else {
    const int64_t vectors = row_bytes / 2;
    const dim3 grid(static_cast<unsigned>(blocks_for(vectors, threads, 64)), static_cast<unsigned>(groups));
    zero_empty_groups_kernel<uint16_t><<<grid, threads, 0, stream>>>(static_cast<uint16_t*>(data), counts, vectors);
  }
  return cudaGetLastError();
}

}  // namespace odyssey::kernels
