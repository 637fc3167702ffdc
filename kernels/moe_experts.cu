// The routed experts fused (contracts: kernels/moe.h, "Routed experts, fused"; design and
// measurements: kernels/JOURNAL.md, "Routed experts, fused").
//
// A CTA takes a tile of at most 128 rows of one expert and runs the expert's whole MLP on it:
//   stage A, per slice of 64 columns of F: [G | U] (128 x 128, fp32 in mma accumulators)
//            = X (128 x L, in shared memory) times 128 x 64 chunks of [W_gate; W_up] streamed
//            along L; then G and U are rounded to bf16 (and stored, when wanted), and
//            H = situ_glu(G, U) (situ_h_fast) goes to shared memory as bf16;
//   stage B, per slice of 128 columns of L: Y = H (128 x F, in shared memory) times 128 x 64
//            chunks of W_down streamed along F; rounded to bf16 and stored.
// Every weight chunk is 128 rows of 64 bf16 (16 KB), so the two stages are one stream of chunks
// through a ring of kStages buffers filled by cp.async, one barrier a chunk; the stream runs on
// from one tile into the next (the next tile's rows are loaded while stage B runs). 8 warps: warp
// w owns a quarter of the chunk's columns (w % 4: the SM sub-partition it runs on, so every
// tensor core gets the same share whatever the tile's rows) and rows 64 (w / 4) .. + 64 of the
// tile (four m16 blocks, those past the tile's rows skipped). Tiles: an expert with c rows gets ceil(c / 128) tiles of
// ceil(c / tiles) rows; the schedule (a prefix sum of tiles over experts) is built by every
// CTA in shared memory from group_ends, so nothing is read back to the host; persistent CTAs
// (one per SM) take tiles blockIdx.x, + gridDim.x, ...
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/mma.cuh"
#include "kernels/moe.h"
#include "kernels/moe_experts_sm90.h"
#include "kernels/moe_tiles.cuh"
#include "kernels/situ.cuh"

namespace odyssey::kernels {
namespace {

using bf16 = __nv_bfloat16;
using bf162 = __nv_bfloat162;

constexpr int kThreads = 256;                       // 8 warps: 4 column quarters x 2 row halves
constexpr int kChunkRows = 128;                     // a streamed weight chunk: 128 rows ...
constexpr int kChunkCols = 64;                      // ... of 64 bf16
constexpr int kPad = 8;                             // bf16 of padding a shared row: ldmatrix's
                                                    // 8 row addresses fall in distinct banks
constexpr int kChunkStride = kChunkCols + kPad;
constexpr int kStages = 3;                          // chunks in flight

// The tile's rows of a [R, width] bf16 matrix into shared rows of `stride`, the rows past
// tile.rows up to the next multiple of 16 zero-filled (read by the m16 blocks, never stored).
__device__ void load_tile_rows(bf16* shared, int stride, const bf16* __restrict__ matrix,
                               int width, const Tile& tile) {
  const int pieces_per_row = width / 8;
  const int padded_rows = (tile.rows + 15) & ~15;
  for (int p = threadIdx.x; p < padded_rows * pieces_per_row; p += kThreads) {
    const int r = p / pieces_per_row, col = (p - r * pieces_per_row) * 8;
    const bool valid = r < tile.rows;
    cp_async16_or_zero(shared + r * stride + col,
                       matrix + static_cast<int64_t>(tile.first_row + (valid ? r : 0)) * width + col,
                       valid);
  }
}

// A warp's products with one weight chunk: acc[mi][2q + h] += A[rows 16 mi ..][k 0..63] times the
// chunk's rows b_row[q] + 8 h .. + 8 (as n) over its 64 columns (as k), for the warp's first
// `blocks` m16 blocks (warp-uniform). a: this lane's ldmatrix address for block 0 at the chunk's
// first k (rows a_stride_bytes apart); b[q]: its address for the chunk's rows b_row[q]. Every
// fragment is loaded (rows past the tile hold zeros or stale values, never stored) and only the
// products are predicated, so the accumulators stay in the same registers whatever `blocks` is.
template <int kAStrideBytes>
__device__ __forceinline__ void chunk_products(float (&acc)[4][4][4], int blocks, uint32_t a,
                                               const uint32_t (&b)[2]) {
#pragma unroll
  for (int kk = 0; kk < kChunkCols / 16; ++kk) {
    uint32_t bf[2][4], af[4][4];
#pragma unroll
    for (int q = 0; q < 2; ++q) ldmatrix_x4_at(bf[q], b[q] + kk * 32);
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) ldmatrix_x4_at(af[mi], a + mi * 16 * kAStrideBytes + kk * 32);
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
      if (mi < blocks) {
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          mma(acc[mi][2 * q], af[mi], bf[q][0], bf[q][1]);
          mma(acc[mi][2 * q + 1], af[mi], bf[q][2], bf[q][3]);
        }
      }
    }
  }
}

__device__ __forceinline__ void zero(float (&acc)[4][4][4]) {
#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][nt][e] = 0.f;
    }
  }
}

// This CTA's next tile with rows from tile index t on (stride gridDim.x); rows = 0 when none.
__device__ Tile next_tile(int& t, int tiles, const int* tile_ends, const ForwardArgs& a) {
  for (; t < tiles; t += gridDim.x) {
    const Tile tile = find_tile(t, tile_ends, a.group_ends, a.experts);
    if (tile.rows > 0) return tile;
  }
  return Tile{0, 0, 0};
}

// One m16 block's accumulators (four n8 tiles) for the rows of one half (g, or g + 8) as packed
// bf16 pairs: packed[nt] = tile nt's columns 2t, 2t + 1 (quad_transpose's input layout).
__device__ __forceinline__ void pack_row_half(const float (&acc)[4][4], int half, uint32_t (&packed)[4]) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) packed[nt] = pack_bf16(acc[nt][2 * half], acc[nt][2 * half + 1]);
}

// The widths as template arguments (L, F): every index into the chunk stream is a division by a
// constant, and the strides are immediates.
template <int L, int F>
struct ExpertShape {
  static_assert(L % 128 == 0 && F % 64 == 0, "L a multiple of 128, F of 64");
  static constexpr int kXStride = L + kPad, kHStride = F + kPad;  // bf16 elements
  static constexpr int kKChunksA = L / kChunkCols, kChunksA = (F / 64) * kKChunksA;
  static constexpr int kKChunksB = F / kChunkCols, kChunks = kChunksA + (L / 128) * kKChunksB;
  static constexpr size_t kSharedBytes =
      (size_t{kTileRows} * kXStride + size_t{kTileRows} * kHStride + size_t{kStages} * kChunkRows * kChunkStride) *
      sizeof(bf16);
};

template <int L, int F>
__global__ void __launch_bounds__(kThreads, 1) moe_experts_forward_kernel(ForwardArgs a) {
  using S = ExpertShape<L, F>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  __shared__ int tile_ends[kMaxExperts];
  bf16* xs = reinterpret_cast<bf16*>(shared_bytes);
  bf16* hs = xs + kTileRows * S::kXStride;
  bf16* ws = hs + kTileRows * S::kHStride;

  const int tiles = build_tile_schedule<kThreads>(a.group_ends, a.experts, tile_ends);
  // Warp w runs on the SM's sub-partition w % 4, so the column quarter is w % 4 (every
  // sub-partition's tensor core gets the same share of any tile) and the row half w / 4.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wq = warp & 3, wr = warp >> 2;
  const int gq = lane >> 2, tq = lane & 3;
  const FragmentOffsets f(lane);
  const SituCaps caps{a.beta1, a.beta2, 1.f / a.beta1, 1.f / a.beta2};
  // This lane's ldmatrix addresses: A in xs / hs (block 0 of the warp's rows, k = 0), B in ring
  // slot 0 (stage A: chunk rows 0-63 are W_gate's, 64-127 W_up's, for 64 columns of F, and
  // quarter wq takes 16 of each; stage B: 128 rows of W_down, 128 columns of L, wq takes 32).
  const uint32_t x_frag = shared_address(xs + (wr * 64 + f.a_row) * S::kXStride + f.a_col);
  const uint32_t h_frag = shared_address(hs + (wr * 64 + f.a_row) * S::kHStride + f.a_col);
  const uint32_t ring = shared_address(ws);
  constexpr uint32_t kSlotBytes = kChunkRows * kChunkStride * sizeof(bf16);
  const uint32_t b_frag_a[2] = {ring + ((wq * 16 + f.b_row) * kChunkStride + f.b_col) * 2,
                                ring + ((64 + wq * 16 + f.b_row) * kChunkStride + f.b_col) * 2};
  const uint32_t b_frag_b[2] = {ring + ((wq * 32 + f.b_row) * kChunkStride + f.b_col) * 2,
                                ring + ((wq * 32 + 16 + f.b_row) * kChunkStride + f.b_col) * 2};
  // This thread's 4 pieces of 16 bytes of every chunk: rows p / 8, columns (p % 8) * 8.
  const int piece_row = threadIdx.x >> 3, piece_col = (threadIdx.x & 7) * 8;

  // Chunk c of a tile goes to ring slot (its position in the CTA's stream of chunks) % kStages.
  // The stream runs on from one tile into the next, and the next tile's rows are loaded into xs
  // as soon as stage B starts (xs is dead then), so the pipeline never drains between tiles.
  auto issue_chunk = [&](const Tile& tile, int c, int position) {
    bf16* dst = ws + (position % kStages) * kChunkRows * kChunkStride + piece_row * kChunkStride + piece_col;
    const int64_t e = tile.expert;
    // Rows piece_row + 32 i of the chunk (i = 0..3). Stage A: rows 0-63 of W_gate's slice s, then
    // the same rows of W_up's; stage B: rows s * 128 .. + 128 of W_down.
    if (c < S::kChunksA) {
      const int s = c / S::kKChunksA, kc = c - s * S::kKChunksA;
      const int64_t at = (e * F + s * 64 + piece_row) * L + kc * kChunkCols + piece_col;
      cp_async16(dst, a.gate_proj + at);
      cp_async16(dst + 32 * kChunkStride, a.gate_proj + at + 32 * L);
      cp_async16(dst + 64 * kChunkStride, a.up_proj + at);
      cp_async16(dst + 96 * kChunkStride, a.up_proj + at + 32 * L);
    } else {
      const int cb = c - S::kChunksA;
      const int s = cb / S::kKChunksB, kc = cb - s * S::kKChunksB;
      const bf16* src = a.down_proj + (e * L + s * 128 + piece_row) * F + kc * kChunkCols + piece_col;
#pragma unroll
      for (int i = 0; i < kChunkRows / 32; ++i) cp_async16(dst + i * 32 * kChunkStride, src + i * 32 * F);
    }
  };

  int t = blockIdx.x;
  Tile tile = next_tile(t, tiles, tile_ends, a);
  if (tile.rows == 0) return;
  int t_next = t + gridDim.x;
  Tile next = next_tile(t_next, tiles, tile_ends, a);
  load_tile_rows(xs, S::kXStride, a.rows, L, tile);  // joins chunk 0's group
  int base = 0;  // stream position of the current tile's chunk 0, modulo kStages
#pragma unroll
  for (int c = 0; c < kStages - 1; ++c) {
    if (c < S::kChunks) {
      issue_chunk(tile, c, c);
    } else if (next.rows > 0) {
      issue_chunk(next, c - S::kChunks, c);
    }
    cp_async_commit();
  }

  float acc[4][4][4];
  while (true) {
    const int blocks = min(4, max(0, (tile.rows - wr * 64 + 15) / 16));
    zero(acc);
    for (int c = 0; c < S::kChunks; ++c) {
      cp_async_wait<kStages - 2>();
      __syncthreads();
      if (c == S::kChunksA && next.rows > 0) load_tile_rows(xs, S::kXStride, a.rows, L, next);
      const int ahead = c + kStages - 1;
      if (ahead < S::kChunks) {
        issue_chunk(tile, ahead, base + ahead);
      } else if (next.rows > 0) {
        issue_chunk(next, ahead - S::kChunks, base + ahead);
      }
      cp_async_commit();  // possibly empty: keeps the wait counts uniform
      const uint32_t slot = ((base + c) % kStages) * kSlotBytes;
      if (c < S::kChunksA) {
        const int s = c / S::kKChunksA, kc = c - s * S::kKChunksA;
        const uint32_t b[2] = {b_frag_a[0] + slot, b_frag_a[1] + slot};
        chunk_products<S::kXStride * 2>(acc, blocks, x_frag + kc * kChunkCols * 2, b);
        if (kc == S::kKChunksA - 1) {
          // G = acc[.][0..1], U = acc[.][2..3]: round, store, H = situ_glu(G, U) into hs.
#pragma unroll
          for (int mi = 0; mi < 4; ++mi) {
            if (mi >= blocks) break;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int r = wr * 64 + mi * 16 + gq + half * 8;
              const int64_t row = static_cast<int64_t>(tile.first_row + r) * F;
              // G's two n8 tiles, then U's, packed: after quad_transpose (mma.cuh) lanes 0-1 hold 8
              // consecutive columns of G each, lanes 2-3 of U, one 16-byte store a lane.
              uint32_t packed[4];
              pack_row_half(acc[mi], half, packed);
#pragma unroll
              for (int nt = 0; nt < 2; ++nt) {
                const int col = s * 64 + wq * 16 + nt * 8 + 2 * tq;
                const float2 gf = __bfloat1622float2(*reinterpret_cast<const bf162*>(&packed[nt]));
                const float2 uf = __bfloat1622float2(*reinterpret_cast<const bf162*>(&packed[nt + 2]));
                *reinterpret_cast<bf162*>(hs + r * S::kHStride + col) = __floats2bfloat162_rn(
                    situ_h_fast(gf.x, uf.x, caps), situ_h_fast(gf.y, uf.y, caps));
              }
              if (a.gate != nullptr) {
                quad_transpose(packed, tq);
                if (r < tile.rows) {
                  bf16* out = (tq < 2 ? a.gate : a.up) + row + s * 64 + wq * 16 + (tq & 1) * 8;
                  *reinterpret_cast<uint4*>(out) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
                }
              }
            }
          }
          zero(acc);
        }
      } else {
        const int cb = c - S::kChunksA;
        const int s = cb / S::kKChunksB, kc = cb - s * S::kKChunksB;
        const uint32_t b[2] = {b_frag_b[0] + slot, b_frag_b[1] + slot};
        chunk_products<S::kHStride * 2>(acc, blocks, h_frag + kc * kChunkCols * 2, b);
        if (kc == S::kKChunksB - 1) {
#pragma unroll
          for (int mi = 0; mi < 4; ++mi) {
            if (mi >= blocks) break;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int r = wr * 64 + mi * 16 + gq + half * 8;
              // Four n8 tiles packed, then transposed in the quad: lane tq holds columns
              // 8 tq .. 8 tq + 7 of the warp's 32, one 16-byte store.
              uint32_t packed[4];
              pack_row_half(acc[mi], half, packed);
              quad_transpose(packed, tq);
              if (r >= tile.rows) continue;
              bf16* out = a.y + static_cast<int64_t>(tile.first_row + r) * L + s * 128 + wq * 32 + 8 * tq;
              *reinterpret_cast<uint4*>(out) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
            }
          }
          zero(acc);
        }
      }
    }
    if (next.rows == 0) break;
    tile = next;
    base = (base + S::kChunks) % kStages;
    t_next += gridDim.x;
    next = next_tile(t_next, tiles, tile_ends, a);
    // The new tile's rows went out with the group of chunk kChunksA + kStages - 1; with fewer than
    // two chunks in stage B (L = 128, F = 64) the waits above have not covered that group yet.
    if (S::kChunks - S::kChunksA < kStages - 1) cp_async_wait<0>();
  }
  cp_async_wait<0>();
}

// The (L, F) pairs compiled: L in {128, 256, 384, 512}, F a multiple of 64, L + F <= 640 (the
// tiles that fit an sm_90 CTA's 227 KB of shared memory): the kernel for (L, F), or nullptr.
struct ForwardKernelInfo {
  void (*kernel)(ForwardArgs) = nullptr;
  size_t shared = 0;
};
template <int L, int... Fs>
void find_for_latent(int64_t latent, int64_t ffn, ForwardKernelInfo& info) {
  ((latent == L && ffn == Fs ? (info = ForwardKernelInfo{&moe_experts_forward_kernel<L, Fs>,
                                                         ExpertShape<L, Fs>::kSharedBytes},
                                0)
                             : 0),
   ...);
}
ForwardKernelInfo forward_kernel(int64_t latent, int64_t ffn) {
  ForwardKernelInfo info;
  find_for_latent<128, 64, 128, 192, 256, 320, 384, 448, 512>(latent, ffn, info);
  find_for_latent<256, 64, 128, 192, 256, 320, 384>(latent, ffn, info);
  find_for_latent<384, 64, 128, 192, 256>(latent, ffn, info);
  find_for_latent<512, 64, 128>(latent, ffn, info);
  return info;
}

}  // namespace

bool moe_experts_fused_supported(int64_t latent, int64_t ffn, int64_t experts) {
  if (experts < 1 || experts > kMaxExperts) return false;
  const ForwardKernelInfo info = forward_kernel(latent, ffn);
  if (info.kernel == nullptr) return false;
  constexpr size_t kStatic = (kMaxExperts + kThreads / 32) * sizeof(int);
  return device_fits(info.shared + kStatic, DeviceNeed::kSm80OrNewer);
}

cudaError_t moe_experts_forward(const void* rows, const void* gate_proj, const void* up_proj,
                                const void* down_proj, const int32_t* group_ends, void* y,
                                void* gate, void* up, int64_t total_rows, int64_t experts,
                                int64_t latent, int64_t ffn, float beta1, float beta2,
                                cudaStream_t stream, MoeExpertsKernel kernel) {
  const bool wgmma = moe_experts_forward_wgmma_supported(latent, ffn, experts);
  if (kernel == MoeExpertsKernel::kWgmma || (kernel == MoeExpertsKernel::kAuto && wgmma)) {
    return moe_experts_forward_wgmma(rows, gate_proj, up_proj, down_proj, group_ends, y, gate, up,
                                     total_rows, experts, latent, ffn, beta1, beta2, stream);
  }
  if (!moe_experts_fused_supported(latent, ffn, experts) ||
      !forward_arguments_valid(rows, gate_proj, up_proj, down_proj, y, gate, up, total_rows, beta1, beta2)) {
    return cudaErrorInvalidValue;
  }
  if (total_rows == 0) return cudaSuccess;
  const ForwardKernelInfo info = forward_kernel(latent, ffn);
  int sms = 0;
  const cudaError_t error = prepare_launch(info.kernel, info.shared, sms);
  if (error != cudaSuccess) return error;
  const ForwardArgs a =
      forward_args(rows, gate_proj, up_proj, down_proj, group_ends, y, gate, up, experts, beta1, beta2);
  // At most one tile per 128 rows plus one partial tile per expert.
  const int64_t max_tiles = total_rows / kTileRows + experts;
  const int grid = static_cast<int>(max_tiles < sms ? max_tiles : sms);
  info.kernel<<<grid, kThreads, info.shared, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace odyssey::kernels
