// Exact-fp32 grouped GEMMs on CUDA cores (contract: kernels/grouped_sgemm.h).
//
// One CTA of 256 threads makes a 64 x 64 output tile, each thread a 4 x 4 block of it with one fp32
// accumulator an element. The operands go through shared memory in stages of 16 k, two stages
// alternating: while the threads multiply one, each holds its 4 + 4 values of the next in registers
// (loaded before the products, stored after them), so there is one barrier a stage.
// Per k a thread reads 4 a values and 4 b values as two 16-byte shared loads and makes 16 FMAs.
// Padding (rows past a tile's count, columns past N, k past the depth) is loaded as zeros, so
// every stage runs all 16 k and the real terms keep their increasing order.
#include "kernels/grouped_sgemm.h"

#include <algorithm>
#include <climits>

namespace odyssey::kernels {
namespace {

constexpr int kTile = 64;       // output rows x columns a CTA
constexpr int kDepth = 16;      // k a stage
constexpr int kThreads = 256;   // 16 x 16 threads, 4 x 4 outputs each
constexpr int kRow = kTile + 4;  // a shared row: 16-byte aligned

struct Stage {
  float a[kDepth][kRow];  // a[k][i]: output row i's operand at depth k
  float b[kDepth][kRow];  // b[k][j]: output column j's operand at depth k
};

// One thread's 4 values of a kDepth x kTile operand tile: element (k, j) is src[k * stride_k +
// j * stride_j], zero outside k < k_count, j < j_count. kContigJ: stride_j == 1, and the thread
// takes 4 consecutive j of one k; otherwise stride_k == 1, and it takes 4 consecutive k of one j
// (a warp then covers 32 consecutive j, so the transposing shared stores hit 32 banks).
// `vector`: 16-byte loads are aligned wherever the four values are all inside.
template <bool kContigJ>
struct OperandTile {
  float r[4];

  __device__ __forceinline__ void load(const float* src, int64_t stride_k, int64_t stride_j, int k_count,
                                       int j_count, bool vector, int t) {
    if (kContigJ) {
      const int k = t >> 4, j = (t & 15) * 4;
      const float* p = src + k * stride_k + j;
      if (vector && k < k_count && j + 3 < j_count) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(p));
        r[0] = v.x, r[1] = v.y, r[2] = v.z, r[3] = v.w;
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) r[i] = k < k_count && j + i < j_count ? __ldg(p + i) : 0.f;
      }
    } else {
      const int j = t & 63, k = (t >> 6) * 4;
      const float* p = src + j * stride_j + k;
      if (vector && j < j_count && k + 3 < k_count) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(p));
        r[0] = v.x, r[1] = v.y, r[2] = v.z, r[3] = v.w;
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) r[i] = j < j_count && k + i < k_count ? __ldg(p + i) : 0.f;
      }
    }
  }

  __device__ __forceinline__ void store(float (*s)[kRow], int t) const {
    if (kContigJ) {
      const int k = t >> 4, j = (t & 15) * 4;
      *reinterpret_cast<float4*>(&s[k][j]) = make_float4(r[0], r[1], r[2], r[3]);
    } else {
      const int j = t & 63, k = (t >> 6) * 4;
#pragma unroll
      for (int i = 0; i < 4; ++i) s[k + i][j] = r[i];
    }
  }
};

// Operand A's rows i (the output's rows) and B's columns j over `depth` k: acc[i][j] += sum_k
// A(k, i) B(k, j) for this thread's 4 x 4 block (rows 4 ty ..., columns 4 tx ...).
struct Operand {
  const float* src;
  int64_t stride_k, stride_j;
  int count;  // rows (A) or columns (B) inside the tile
  bool vector;
};

template <bool kAContig, bool kBContig>
__device__ __forceinline__ void tile_product(Stage (&stage)[2], const Operand& a, const Operand& b, int depth,
                                             float (&acc)[4][4]) {
  const int t = threadIdx.x, tx = t & 15, ty = t >> 4;
  const int stages = (depth + kDepth - 1) / kDepth;
  if (stages == 0) return;  // uniform across the CTA
  OperandTile<kAContig> ra;
  OperandTile<kBContig> rb;
  ra.load(a.src, a.stride_k, a.stride_j, min(kDepth, depth), a.count, a.vector, t);
  rb.load(b.src, b.stride_k, b.stride_j, min(kDepth, depth), b.count, b.vector, t);
  ra.store(stage[0].a, t);
  rb.store(stage[0].b, t);
  __syncthreads();
  for (int s = 0; s < stages; ++s) {
    const Stage& cur = stage[s & 1];
    const bool more = s + 1 < stages;
    if (more) {
      const int k0 = (s + 1) * kDepth, k_count = min(kDepth, depth - k0);
      ra.load(a.src + k0 * a.stride_k, a.stride_k, a.stride_j, k_count, a.count, a.vector, t);
      rb.load(b.src + k0 * b.stride_k, b.stride_k, b.stride_j, k_count, b.count, b.vector, t);
    }
#pragma unroll
    for (int k = 0; k < kDepth; ++k) {
      const float4 av = *reinterpret_cast<const float4*>(&cur.a[k][ty * 4]);
      const float4 bv = *reinterpret_cast<const float4*>(&cur.b[k][tx * 4]);
      const float a4[4] = {av.x, av.y, av.z, av.w}, b4[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a4[i], b4[j], acc[i][j]);
    }
    if (more) {
      ra.store(stage[(s + 1) & 1].a, t);
      rb.store(stage[(s + 1) & 1].b, t);
    }
    __syncthreads();
  }
}

// Writes this thread's 4 x 4 block at out[row * ld + column] for rows < rows, columns < columns
// (counted from the tile's corner, which `out` points at).
__device__ __forceinline__ void store_block(float* out, int64_t ld, int rows, int columns, bool vector,
                                            const float (&acc)[4][4]) {
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  const int c0 = tx * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = ty * 4 + i;
    if (row >= rows) break;
    float* o = out + row * ld + c0;
    if (vector && c0 + 3 < columns) {
      *reinterpret_cast<float4*>(o) = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (c0 + j < columns) o[j] = acc[i][j];
    }
  }
}

// out rows of one tile times w_e: A(k, i) = x[(first_row + i) * K + k] (contiguous along k), B(k, j)
// = w_e(k, n0 + j).
template <bool kWContigN>
__global__ void __launch_bounds__(kThreads) rows_times_kernel(const float* x, const float* w, int64_t w_stride_e,
                                                              int64_t w_stride_k, int64_t w_stride_n,
                                                              const GroupedSgemmRowTile* tiles, float* out, int K,
                                                              int N, bool x_vector, bool w_vector, bool out_vector) {
  __shared__ __align__(16) Stage stage[2];
  const GroupedSgemmRowTile tile = tiles[blockIdx.x];
  const int n0 = blockIdx.y * kTile, columns = min(kTile, N - n0);
  const Operand a{x + static_cast<int64_t>(tile.first_row) * K, 1, K, tile.rows, x_vector};
  const Operand b = kWContigN ? Operand{w + tile.expert * w_stride_e + n0, w_stride_k, 1, columns, w_vector}
                              : Operand{w + tile.expert * w_stride_e + n0 * w_stride_n, 1, w_stride_n, columns, w_vector};
  float acc[4][4] = {};
  tile_product<false, kWContigN>(stage, a, b, K, acc);
  store_block(out + static_cast<int64_t>(tile.first_row) * N + n0, N, tile.rows, columns, out_vector, acc);
}

// out_e's tile (m0, n0): A(k, i) = a[(first + k) * M + m0 + i], B(k, j) = b[(first + k) * N + n0 + j],
// over the expert's rows k (both contiguous along i / j).
__global__ void __launch_bounds__(kThreads) weight_grad_kernel(const float* a, const float* b,
                                                               const int32_t* block_starts, float* out, int M,
                                                               int N, int m_tiles, bool a_vector, bool b_vector,
                                                               bool out_vector) {
  __shared__ __align__(16) Stage stage[2];
  const int e = blockIdx.x / m_tiles, m0 = (blockIdx.x % m_tiles) * kTile, n0 = blockIdx.y * kTile;
  const int first = block_starts[e], rows = block_starts[e + 1] - first;
  const int tile_rows = min(kTile, M - m0), columns = min(kTile, N - n0);
  const Operand ao{a + static_cast<int64_t>(first) * M + m0, M, 1, tile_rows, a_vector};
  const Operand bo{b + static_cast<int64_t>(first) * N + n0, N, 1, columns, b_vector};
  float acc[4][4] = {};
  tile_product<true, true>(stage, ao, bo, rows, acc);
  store_block(out + static_cast<int64_t>(e) * M * N + static_cast<int64_t>(m0) * N + n0, N, tile_rows, columns,
              out_vector, acc);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
bool fits_int(int64_t v) { return v >= 1 && v <= INT_MAX; }

}  // namespace

cudaError_t grouped_sgemm_rows_times(const float* x, const float* w, int64_t w_stride_e, int64_t w_stride_k,
                                     int64_t w_stride_n, const GroupedSgemmRowTile* tiles, int64_t tile_count,
                                     float* out, int64_t K, int64_t N, cudaStream_t stream) {
  if (tile_count < 0 || tile_count > INT_MAX || !fits_int(K) || !fits_int(N) || w_stride_e < 0 || w_stride_k < 1 ||
      w_stride_n < 1 || (w_stride_n != 1 && w_stride_k != 1)) {
    return cudaErrorInvalidValue;
  }
  if (tile_count == 0) return cudaSuccess;
  if (x == nullptr || w == nullptr || tiles == nullptr || out == nullptr) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(tile_count), static_cast<unsigned>((N + kTile - 1) / kTile));
  const bool x_vector = aligned16(x) && K % 4 == 0, out_vector = aligned16(out) && N % 4 == 0;
  if (w_stride_n == 1) {
    const bool w_vector = aligned16(w) && w_stride_e % 4 == 0 && w_stride_k % 4 == 0;
    rows_times_kernel<true><<<grid, kThreads, 0, stream>>>(x, w, w_stride_e, w_stride_k, 1, tiles, out,
                                                           static_cast<int>(K), static_cast<int>(N), x_vector,
                                                           w_vector, out_vector);
  } else {
    const bool w_vector = aligned16(w) && w_stride_e % 4 == 0 && w_stride_n % 4 == 0;
    rows_times_kernel<false><<<grid, kThreads, 0, stream>>>(x, w, w_stride_e, 1, w_stride_n, tiles, out,
                                                            static_cast<int>(K), static_cast<int>(N), x_vector,
                                                            w_vector, out_vector);
  }
  return cudaGetLastError();
}

cudaError_t grouped_sgemm_weight_grad(const float* a, const float* b, const int32_t* block_starts, int64_t experts,
                                      float* out, int64_t M, int64_t N, cudaStream_t stream) {
  if (experts < 0 || !fits_int(M) || !fits_int(N)) return cudaErrorInvalidValue;
  const int64_t m_tiles = (M + kTile - 1) / kTile;
  if (experts * m_tiles > INT_MAX) return cudaErrorInvalidValue;
  if (experts == 0) return cudaSuccess;
  // a and b may be null when no expert has rows (an empty [0, M] tensor): no row is then read.
  if (block_starts == nullptr || out == nullptr) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(experts * m_tiles), static_cast<unsigned>((N + kTile - 1) / kTile));
  weight_grad_kernel<<<grid, kThreads, 0, stream>>>(a, b, block_starts, out, static_cast<int>(M), static_cast<int>(N),
                                                    static_cast<int>(m_tiles), aligned16(a) && M % 4 == 0,
                                                    aligned16(b) && N % 4 == 0, aligned16(out) && N % 4 == 0);
  return cudaGetLastError();
}

}  // namespace odyssey::kernels
