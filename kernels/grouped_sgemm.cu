// Exact-fp32 grouped GEMMs on CUDA cores (contract: kernels/grouped_sgemm.h).
//
// One CTA makes a 64 x 64 output tile with one fp32 accumulator an element, in one of two forms
// (GroupedSgemmThreads): 64 threads of 8 x 8 outputs (rows 4 ty ... 4 ty + 3 and 32 + 4 ty ...,
// columns likewise from tx), or 256 threads of 4 x 4 (rows 4 ty ..., columns 4 tx ...). The
// operands go through shared memory in stages of 16 k, two stages alternating: while the threads
// multiply one, each holds its share of the next in registers (loaded before the products, stored
// after them), so there is one barrier a stage. Per k an 8 x 8 thread reads 8 a and 8 b values as
// four 16-byte shared loads (a warp's loads of b are 128 consecutive bytes, of a a broadcast) and
// makes 64 FMAs; a 4 x 4 thread reads two for 16. Padding (rows past a tile's count, columns past N,
// k past the depth) is loaded as zeros, so every stage runs all 16 k and the real terms keep their
// increasing order: both forms give the same bits.
#include "kernels/grouped_sgemm.h"

#include <algorithm>
#include <climits>

namespace odyssey::kernels {
namespace {

constexpr int kTile = 64;        // output rows x columns a CTA
constexpr int kDepth = 16;       // k a stage
constexpr int kRow = kTile + 4;  // a shared row: 16-byte aligned

struct Stage {
  float a[kDepth][kRow];  // a[k][i]: output row i's operand at depth k
  float b[kDepth][kRow];  // b[k][j]: output column j's operand at depth k
};

// One thread's share of a kDepth x kTile operand tile (1024 / kThreads values): element (k, j) is
// src[k * stride_k + j * stride_j], zero outside k < k_count, j < j_count. kContigJ: stride_j == 1,
// and the thread takes 4 consecutive j of the rows k = t / 16 + (kThreads / 16) s; otherwise
// stride_k == 1, and thread t takes kPer consecutive k of j = t % 64 (a warp then covers 32
// consecutive j, so the transposing shared stores hit 32 banks). `vector`: 16-byte loads are
// aligned wherever the four values are all inside.
template <bool kContigJ, int kThreads>
struct OperandTile {
  static constexpr int kPer = kDepth * kTile / kThreads;  // 4 or 16
  float r[kPer];

  __device__ __forceinline__ void load(const float* src, int64_t stride_k, int64_t stride_j, int k_count,
                                       int j_count, bool vector, int t) {
    if (kContigJ) {
      const int j = (t & 15) * 4;
#pragma unroll
      for (int s = 0; s < kPer / 4; ++s) {
        const int k = (t >> 4) + (kThreads / 16) * s;
        const float* p = src + k * stride_k + j;
        if (vector && k < k_count && j + 3 < j_count) {
          const float4 v = __ldg(reinterpret_cast<const float4*>(p));
          r[4 * s] = v.x, r[4 * s + 1] = v.y, r[4 * s + 2] = v.z, r[4 * s + 3] = v.w;
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) r[4 * s + i] = k < k_count && j + i < j_count ? __ldg(p + i) : 0.f;
        }
      }
    } else {
      const int j = t & 63, k0 = (t >> 6) * kPer;
      const float* p = src + j * stride_j + k0;
#pragma unroll
      for (int s = 0; s < kPer / 4; ++s) {
        const int k = 4 * s;
        if (vector && j < j_count && k0 + k + 3 < k_count) {
          const float4 v = __ldg(reinterpret_cast<const float4*>(p + k));
          r[k] = v.x, r[k + 1] = v.y, r[k + 2] = v.z, r[k + 3] = v.w;
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) r[k + i] = j < j_count && k0 + k + i < k_count ? __ldg(p + k + i) : 0.f;
        }
      }
    }
  }

  __device__ __forceinline__ void store(float (*s)[kRow], int t) const {
    if (kContigJ) {
      const int j = (t & 15) * 4;
#pragma unroll
      for (int q = 0; q < kPer / 4; ++q) {
        const int k = (t >> 4) + (kThreads / 16) * q;
        *reinterpret_cast<float4*>(&s[k][j]) = make_float4(r[4 * q], r[4 * q + 1], r[4 * q + 2], r[4 * q + 3]);
      }
    } else {
      const int j = t & 63, k0 = (t >> 6) * kPer;
#pragma unroll
      for (int k = 0; k < kPer; ++k) s[k0 + k][j] = r[k];
    }
  }
};

// Operand A's rows i (the output's rows) and B's columns j over `depth` k: acc[i][j] += sum_k
// A(k, row i) B(k, column j) for this thread's rows and columns (block_index below).
struct Operand {
  const float* src;
  int64_t stride_k, stride_j;
  int count;  // rows (A) or columns (B) inside the tile
  bool vector;
};

// The tile row (or column) of a thread's i-th row (column) for its ty (tx): 4 ty + i for i < 4, and
// 32 + 4 ty + (i - 4) for the 8 x 8 form's second four.
__device__ __forceinline__ int block_index(int thread_coordinate, int i) {
  return (i < 4 ? 0 : 32) + 4 * thread_coordinate + (i & 3);
}

// CTAs an SM each form's registers are held to: 4 x 4 at 64 (256 threads), 8 x 8 at 168 (64 threads).
template <int kT>
constexpr int kCtasPerSm = kT == 4 ? 4 : 6;

// kT x kT outputs a thread, (64 / kT)^2 threads.
template <int kT>
struct Threads {
  static constexpr int kCount = (kTile / kT) * (kTile / kT);
  static constexpr int kSide = kTile / kT;  // threads along a side: tx = t % kSide, ty = t / kSide
};

template <int kT, bool kAContig, bool kBContig>
__device__ __forceinline__ void tile_product(Stage (&stage)[2], const Operand& a, const Operand& b, int depth,
                                             float (&acc)[kT][kT]) {
  constexpr int kThreads = Threads<kT>::kCount, kSide = Threads<kT>::kSide;
  const int t = threadIdx.x, tx = t & (kSide - 1), ty = t >> (kSide == 16 ? 4 : 3);
  const int stages = (depth + kDepth - 1) / kDepth;
  if (stages == 0) return;  // uniform across the CTA
  OperandTile<kAContig, kThreads> ra;
  OperandTile<kBContig, kThreads> rb;
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
      float av[kT], bv[kT];
#pragma unroll
      for (int h = 0; h < kT / 4; ++h) {
        const float4 a4 = *reinterpret_cast<const float4*>(&cur.a[k][block_index(ty, 4 * h)]);
        const float4 b4 = *reinterpret_cast<const float4*>(&cur.b[k][block_index(tx, 4 * h)]);
        av[4 * h] = a4.x, av[4 * h + 1] = a4.y, av[4 * h + 2] = a4.z, av[4 * h + 3] = a4.w;
        bv[4 * h] = b4.x, bv[4 * h + 1] = b4.y, bv[4 * h + 2] = b4.z, bv[4 * h + 3] = b4.w;
      }
#pragma unroll
      for (int i = 0; i < kT; ++i)
#pragma unroll
        for (int j = 0; j < kT; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
    if (more) {
      ra.store(stage[(s + 1) & 1].a, t);
      rb.store(stage[(s + 1) & 1].b, t);
    }
    __syncthreads();
  }
}

// Writes this thread's kT x kT block at out[row * ld + column] for rows < rows, columns < columns
// (counted from the tile's corner, which `out` points at).
template <int kT>
__device__ __forceinline__ void store_block(float* out, int64_t ld, int rows, int columns, bool vector,
                                            const float (&acc)[kT][kT]) {
  constexpr int kSide = Threads<kT>::kSide;
  const int tx = threadIdx.x % kSide, ty = threadIdx.x / kSide;
#pragma unroll
  for (int i = 0; i < kT; ++i) {
    const int row = block_index(ty, i);
    if (row >= rows) break;  // a thread's rows increase with i
#pragma unroll
    for (int h = 0; h < kT / 4; ++h) {
      const int c0 = block_index(tx, 4 * h);
      float* o = out + row * ld + c0;
      if (vector && c0 + 3 < columns) {
        const float* v = &acc[i][4 * h];
        *reinterpret_cast<float4*>(o) = make_float4(v[0], v[1], v[2], v[3]);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (c0 + j < columns) o[j] = acc[i][4 * h + j];
      }
    }
  }
}

// out rows of one tile times w_e: A(k, i) = x[(first_row + i) * K + k] (contiguous along k), B(k, j)
// = w_e(k, n0 + j).
template <int kT, bool kWContigN>
__global__ void __launch_bounds__(Threads<kT>::kCount, kCtasPerSm<kT>)
    rows_times_kernel(const float* x, const float* w, int64_t w_stride_e, int64_t w_stride_k, int64_t w_stride_n,
                      const GroupedSgemmRowTile* tiles, float* out, int K, int N, bool x_vector, bool w_vector,
                      bool out_vector) {
  __shared__ __align__(16) Stage stage[2];
  const GroupedSgemmRowTile tile = tiles[blockIdx.x];
  const int n0 = blockIdx.y * kTile, columns = min(kTile, N - n0);
  const Operand a{x + static_cast<int64_t>(tile.first_row) * K, 1, K, tile.rows, x_vector};
  const float* w_e = w + tile.expert * w_stride_e;
  const Operand b = kWContigN ? Operand{w_e + n0, w_stride_k, 1, columns, w_vector}
                              : Operand{w_e + n0 * w_stride_n, 1, w_stride_n, columns, w_vector};
  float acc[kT][kT] = {};
  tile_product<kT, false, kWContigN>(stage, a, b, K, acc);
  store_block<kT>(out + static_cast<int64_t>(tile.first_row) * N + n0, N, tile.rows, columns, out_vector, acc);
}

// out_e's tile (m0, n0): A(k, i) = a[(first + k) * M + m0 + i], B(k, j) = b[(first + k) * N + n0 + j],
// over the expert's rows k (both contiguous along i / j).
template <int kT>
__global__ void __launch_bounds__(Threads<kT>::kCount, kCtasPerSm<kT>)
    weight_grad_kernel(const float* a, const float* b, const int32_t* block_starts, float* out, int M, int N,
                       int m_tiles, bool a_vector, bool b_vector, bool out_vector) {
  __shared__ __align__(16) Stage stage[2];
  const int e = blockIdx.x / m_tiles, m0 = (blockIdx.x % m_tiles) * kTile, n0 = blockIdx.y * kTile;
  const int first = block_starts[e], rows = block_starts[e + 1] - first;
  const int tile_rows = min(kTile, M - m0), columns = min(kTile, N - n0);
  const Operand ao{a + static_cast<int64_t>(first) * M + m0, M, 1, tile_rows, a_vector};
  const Operand bo{b + static_cast<int64_t>(first) * N + n0, N, 1, columns, b_vector};
  float acc[kT][kT] = {};
  tile_product<kT, true, true>(stage, ao, bo, rows, acc);
  store_block<kT>(out + static_cast<int64_t>(e) * M * N + static_cast<int64_t>(m0) * N + n0, N, tile_rows, columns,
              out_vector, acc);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
bool fits_int(int64_t v) { return v >= 1 && v <= INT_MAX; }

}  // namespace

namespace {

template <int kT>
void launch_rows_times(const float* x, const float* w, int64_t w_stride_e, int64_t w_stride_k, int64_t w_stride_n,
                       const GroupedSgemmRowTile* tiles, int64_t tile_count, float* out, int64_t K, int64_t N,
                       cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(tile_count), static_cast<unsigned>((N + kTile - 1) / kTile));
  const bool x_vector = aligned16(x) && K % 4 == 0, out_vector = aligned16(out) && N % 4 == 0;
  if (w_stride_n == 1) {
    const bool w_vector = aligned16(w) && w_stride_e % 4 == 0 && w_stride_k % 4 == 0;
    rows_times_kernel<kT, true><<<grid, Threads<kT>::kCount, 0, stream>>>(
        x, w, w_stride_e, w_stride_k, 1, tiles, out, static_cast<int>(K), static_cast<int>(N), x_vector, w_vector,
        out_vector);
  } else {
    const bool w_vector = aligned16(w) && w_stride_e % 4 == 0 && w_stride_n % 4 == 0;
    rows_times_kernel<kT, false><<<grid, Threads<kT>::kCount, 0, stream>>>(
        x, w, w_stride_e, 1, w_stride_n, tiles, out, static_cast<int>(K), static_cast<int>(N), x_vector, w_vector,
        out_vector);
  }
}

template <int kT>
void launch_weight_grad(const float* a, const float* b, const int32_t* block_starts, int64_t experts, float* out,
                        int64_t M, int64_t N, int64_t m_tiles, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(experts * m_tiles), static_cast<unsigned>((N + kTile - 1) / kTile));
  weight_grad_kernel<kT><<<grid, Threads<kT>::kCount, 0, stream>>>(
      a, b, block_starts, out, static_cast<int>(M), static_cast<int>(N), static_cast<int>(m_tiles),
      aligned16(a) && M % 4 == 0, aligned16(b) && N % 4 == 0, aligned16(out) && N % 4 == 0);
}

}  // namespace

cudaError_t grouped_sgemm_rows_times(const float* x, const float* w, int64_t w_stride_e, int64_t w_stride_k,
                                     int64_t w_stride_n, const GroupedSgemmRowTile* tiles, int64_t tile_count,
                                     float* out, int64_t K, int64_t N, cudaStream_t stream,
                                     GroupedSgemmThreads threads) {
  if (tile_count < 0 || tile_count > INT_MAX || !fits_int(K) || !fits_int(N) || w_stride_e < 0 || w_stride_k < 1 ||
      w_stride_n < 1 || (w_stride_n != 1 && w_stride_k != 1)) {
    return cudaErrorInvalidValue;
  }
  if (tile_count == 0) return cudaSuccess;
  if (x == nullptr || w == nullptr || tiles == nullptr || out == nullptr) return cudaErrorInvalidValue;
  if (threads == GroupedSgemmThreads::k64Of8x8) {
    launch_rows_times<8>(x, w, w_stride_e, w_stride_k, w_stride_n, tiles, tile_count, out, K, N, stream);
  } else {
    launch_rows_times<4>(x, w, w_stride_e, w_stride_k, w_stride_n, tiles, tile_count, out, K, N, stream);
  }
  return cudaGetLastError();
}

cudaError_t grouped_sgemm_weight_grad(const float* a, const float* b, const int32_t* block_starts, int64_t experts,
                                      float* out, int64_t M, int64_t N, cudaStream_t stream,
                                      GroupedSgemmThreads threads) {
  if (experts < 0 || !fits_int(M) || !fits_int(N)) return cudaErrorInvalidValue;
  const int64_t m_tiles = (M + kTile - 1) / kTile;
  if (experts * m_tiles > INT_MAX) return cudaErrorInvalidValue;
  if (experts == 0) return cudaSuccess;
  // a and b may be null when no expert has rows (an empty [0, M] tensor): no row is then read.
  if (block_starts == nullptr || out == nullptr) return cudaErrorInvalidValue;
  if (threads == GroupedSgemmThreads::k64Of8x8) {
    launch_weight_grad<8>(a, b, block_starts, experts, out, M, N, m_tiles, stream);
  } else {
    launch_weight_grad<4>(a, b, block_starts, experts, out, M, N, m_tiles, stream);
  }
  return cudaGetLastError();
}

}  // namespace odyssey::kernels
