// The routed experts' fused forward on Hopper's warpgroup tensor-core instructions (wgmma); the
// contract is moe_experts_forward's (kernels/moe.h), this file's own entry points are in
// kernels/moe_experts_sm90.h. The backward's dX and weight gradients on wgmma follow the forward
// (from "The backward kernels' ring" on), with the design notes above each. Built for sm_90a only (wgmma is an arch-specific feature); the
// mma.sync kernel in moe_experts.cu is the path everywhere else and this kernel's parity reference.
//
// A CTA of two warpgroups takes a tile of at most 128 rows of one expert (TileSplit::kFull: 128
// rows a tile and the rest in the last, so an expert's rows cost ceil(c / 64) blocks of 64);
// warpgroup g owns rows 64 g .. 64 g + 63 (on a tile of 64 rows or fewer the second warpgroup
// issues no products; its epilogue runs on rows that are never stored):
//   stage A, per slice s of 64 columns of F: [G | U] (64 x 128 a warpgroup, fp32 in registers)
//            = X (the tile's rows, in shared memory) times 128 x 64 chunks of [W_gate; W_up]
//            (rows 0-63: W_gate's 64 columns of the slice, 64-127: W_up's) streamed along L; then
//            G, U are rounded to bf16 (and stored, when wanted) and H = situ_glu(G, U)
//            (situ_h_fast, on the bf16 G and U) goes to shared memory as bf16;
//   stage B, per slice of 128 columns of L: Y = H times 128 x 64 chunks of W_down along F.
// Every weight chunk is 128 rows of 64 bf16 (16 KB) through one ring of kStages slots filled by
// cp.async two chunks ahead; the stream runs on into the next tile (whose rows are loaded as soon
// as stage B starts). A chunk's four k16 steps are four wgmma.m64n128k16 a warpgroup, left in flight
// while the next chunk's loads are issued (wgmma.wait_group 1), and waited for at a slice's end.
//
// Shared operands are in wgmma's K-major layout with the 128-byte swizzle: a matrix of rows of 64
// bf16 (128 bytes) in 1024-byte blocks of 8 rows, where row r's 16-byte piece c sits at piece
// c ^ (r % 8); X and H are stored as L / 64 (F / 64) such matrices of 128 rows. Every 8-row block
// starts 1024 bytes after the last (the descriptors' stride); a k16 step is 32 bytes further in
// the row (the hardware applies the swizzle to the address it forms, the blocks being 1024-aligned).
#include "kernels/moe_experts_sm90.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/mma.cuh"
#include "kernels/moe_tiles.cuh"
#include "kernels/situ.cuh"
#include "kernels/wgmma.cuh"

namespace odyssey::kernels {
namespace {

using bf16 = __nv_bfloat16;
using bf162 = __nv_bfloat162;

constexpr int kStages = 4;         // ring slots: loads two chunks ahead, one chunk's wgmma in flight
constexpr int kRowBytes = kSwizzledRowBytes;  // a swizzled row: 64 bf16
constexpr int kMatrixBytes = kTileRows * kRowBytes;  // 128 rows of 64 bf16: 16 KB

// Built for sm_90a only (CMake: odyssey_kernels_sm90a). nvcc also preprocesses the file for the
// plain architecture; the kernel's body exists only where the wgmma instructions do
// (ODYSSEY_NO_WGMMA, kernels/wgmma.cuh), and traps anywhere else (a build that left sm_90a out
// fails loudly instead of returning garbage).

template <int L, int F>
struct Shape {
  static_assert(L % 128 == 0 && F % 64 == 0, "L a multiple of 128, F of 64");
  static constexpr int kKChunksA = L / 64, kChunksA = (F / 64) * kKChunksA;
  static constexpr int kKChunksB = F / 64, kChunks = kChunksA + (L / 128) * kKChunksB;
  // X (L / 64 matrices), H (F / 64), the ring, and 1 KB to align the start to 1024 bytes.
  static constexpr size_t kSharedBytes =
      size_t{L / 64 + F / 64 + kStages} * kMatrixBytes + 1024;
};

__device__ __forceinline__ void cp_async16_at(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

// mbarriers (PTX ISA, "Parallel synchronization and communication: mbarrier").
__device__ __forceinline__ void mbarrier_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// One arrival from the lane that has `lane` 0, as a predicated instruction (no branch: a branch
// here puts the consumers' wgmma on a divergent path for ptxas, which then serializes them).
__device__ __forceinline__ void mbarrier_arrive_lane0(uint32_t bar, int lane) {
  asm volatile(
      "{\n"
      ".reg .pred first;\n"
      "setp.eq.s32 first, %1, 0;\n"
      "@first mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n"
      "}\n" ::"r"(bar),
      "r"(lane)
      : "memory");
}
// Blocks until the phase of parity `parity` has completed (a fresh barrier counts its phase of
// parity 1 as completed, so a producer's first wait for an empty slot passes at once).
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// One arrival on bar when this thread's cp.async so far have landed (counted in the init count).
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// The CTA's tile of round r: tiles are dealt in rounds of gridDim.x, snaking (CTA b takes the b-th
// of even rounds and the b-th from the end of odd ones). An expert's tiles are a full one of 128
// rows and a short last one, side by side: dealt straight, an even grid would give every full
// tile to the even CTAs and every short one to the odd.
__device__ __forceinline__ int snake_tile(int round) {
  const int g = static_cast<int>(gridDim.x), b = static_cast<int>(blockIdx.x);
  return (round & 1) == 0 ? round * g + b : (round + 1) * g - 1 - b;
}

// Piece q (columns 32 q + 8 tq .. + 7) of row gq + 8 half of a warp's 16 rows of an m64n128
// accumulator, rounded to bf16: the quad's lanes exchange their pairs so that each stores 16 bytes.
__device__ __forceinline__ uint4 accumulator_piece(const float (&acc)[64], int half, int q, int tq) {
  uint32_t four[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int nt = 4 * q + i;
    four[i] = pack_bf16(acc[4 * nt + 2 * half], acc[4 * nt + 2 * half + 1]);
  }
  quad_transpose(four, tq);
  return make_uint4(four[0], four[1], four[2], four[3]);
}

// Roles: warps 0-7 the two consumer warpgroups (products and epilogues), warp 8 streams the
// weight chunks, warp 9 the tiles' rows. Nothing waits on a CTA-wide barrier after the schedule
// is built: every hand-over is an mbarrier, so a warpgroup's epilogue overlaps the other's
// products and the loads run ahead as far as the ring allows.
constexpr int kConsumerThreads = 256;
constexpr int kWeightWarp = 8, kRowsWarp = 9;
constexpr int kAllThreads = 320;

template <int L, int F>
__global__ void __launch_bounds__(kAllThreads, 1) moe_experts_forward_wgmma_kernel(ForwardArgs a) {
#if defined(ODYSSEY_NO_WGMMA)
  __trap();
#else
  using S = Shape<L, F>;
  extern __shared__ unsigned char shared_bytes[];
  __shared__ int tile_ends[kMaxExperts];
  __shared__ __align__(8) uint64_t barriers[2 * kStages + 2];
  const uint32_t base_address = (shared_address(shared_bytes) + 1023u) & ~1023u;
  unsigned char* base = shared_bytes + (base_address - shared_address(shared_bytes));
  const uint32_t xs = base_address;
  const uint32_t hs = xs + (L / 64) * kMatrixBytes;
  const uint32_t ring = hs + (F / 64) * kMatrixBytes;
  unsigned char* hs_bytes = base + (L / 64) * kMatrixBytes;
  // full[i]: slot i's chunk landed (32 arrivals: the weight warp's lanes); empty[i]: the 8
  // consumer warps are done with it; rows_full / rows_empty: the same for the tile's rows in xs.
  const uint32_t full = shared_address(&barriers[0]), empty = shared_address(&barriers[kStages]);
  const uint32_t rows_full = shared_address(&barriers[2 * kStages]), rows_empty = rows_full + 8;
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbarrier_init(full + 8 * i, 32);
      mbarrier_init(empty + 8 * i, kConsumerThreads / 32);
    }
    mbarrier_init(rows_full, 32);
    mbarrier_init(rows_empty, kConsumerThreads / 32);
  }
  const int tiles = build_tile_schedule<kAllThreads>(a.group_ends, a.experts, tile_ends);  // ends in __syncthreads
  // Role and warpgroup by a shuffle from lane 0: ptxas then knows they are warp-uniform, and does
  // not serialize the wgmma instructions behind the branches on them (C7518 / C7520).
  const int warp_id = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 5), 0), lane = threadIdx.x & 31;

  if (warp_id == kWeightWarp) {
    // Chunk p of the CTA's stream goes to slot p % kStages, once the consumers freed it.
    // Lane l copies piece l % 8 of rows l / 8 + 4 i (i < 32), each to its row's swizzled place.
    const int piece_row = lane >> 3, piece_col = lane & 7;
    int position = 0;
    for (int round = 0; round * static_cast<int>(gridDim.x) < tiles; ++round) {
      const int t = snake_tile(round);
      if (t >= tiles) continue;
      const Tile tile = find_tile<TileSplit::kFull>(t, tile_ends, a.group_ends, a.experts);
      if (tile.rows <= 0) continue;
      const int64_t e = tile.expert;
      for (int c = 0; c < S::kChunks; ++c, ++position) {
        const int slot = position % kStages;
        mbarrier_wait(empty + 8 * slot, ((position / kStages) & 1) ^ 1);
        const uint32_t slot_address = ring + slot * kMatrixBytes;
        auto dst = [&](int row) { return slot_address + swizzled(row, piece_col); };
        if (c < S::kChunksA) {
          const int s = c / S::kKChunksA, kc = c - s * S::kKChunksA;
          const int64_t at = (e * F + s * 64 + piece_row) * L + kc * 64 + piece_col * 8;
#pragma unroll
          for (int i = 0; i < 16; ++i) cp_async16_at(dst(piece_row + 4 * i), a.gate_proj + at + i * 4 * L);
#pragma unroll
          for (int i = 0; i < 16; ++i) cp_async16_at(dst(piece_row + 64 + 4 * i), a.up_proj + at + i * 4 * L);
        } else {
          const int cb = c - S::kChunksA;
          const int s = cb / S::kKChunksB, kc = cb - s * S::kKChunksB;
          const bf16* src = a.down_proj + (e * L + s * 128 + piece_row) * F + kc * 64 + piece_col * 8;
#pragma unroll
          for (int i = 0; i < 32; ++i) cp_async16_at(dst(piece_row + 4 * i), src + i * 4 * F);
        }
        cp_async_arrive(full + 8 * slot);
      }
    }
    cp_async_wait<0>();
    return;
  }
  if (warp_id == kRowsWarp) {
    // Tile k's rows into xs once the consumers are done with tile k - 1's stage A; rows up to the
    // next multiple of 64, those past the tile zero-filled.
    int k = 0;
    for (int round = 0; round * static_cast<int>(gridDim.x) < tiles; ++round) {
      const int t = snake_tile(round);
      if (t >= tiles) continue;
      const Tile tile = find_tile<TileSplit::kFull>(t, tile_ends, a.group_ends, a.experts);
      if (tile.rows <= 0) continue;
      mbarrier_wait(rows_empty, (k & 1) ^ 1);
      constexpr int kPieces = L / 8;
      const int padded_rows = (tile.rows + 63) & ~63;
      for (int p = lane; p < padded_rows * kPieces; p += 32) {
        const int r = p / kPieces, c = p - r * kPieces;
        const bool valid = r < tile.rows;
        const bf16* src = a.rows + static_cast<int64_t>(tile.first_row + (valid ? r : 0)) * L + c * 8;
        const uint32_t dst = xs + (c >> 3) * kMatrixBytes + swizzled(r, c & 7);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                     : "memory");
      }
      cp_async_arrive(rows_full);
      ++k;
    }
    cp_async_wait<0>();
    return;
  }

  // The consumers.
  const int warpgroup = warp_id >> 2, warp = warp_id & 3;
  const int gq = lane >> 2, tq = lane & 3;
  const SituCaps caps{a.beta1, a.beta2, 1.f / a.beta1, 1.f / a.beta2};
  const uint32_t x_rows = xs + warpgroup * 64 * kRowBytes, h_rows = hs + warpgroup * 64 * kRowBytes;
  // This warp is done with stream position q's slot: one arrival of the warp on its empty barrier.
  auto release = [&](int q) {
    __syncwarp();
    mbarrier_arrive_lane0(empty + 8 * (q % kStages), lane);
  };
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  int position = 0, k = 0;
  for (int round = 0; round * static_cast<int>(gridDim.x) < tiles; ++round) {
    const int t = snake_tile(round);
    if (t >= tiles) continue;
    const Tile tile = find_tile<TileSplit::kFull>(t, tile_ends, a.group_ends, a.experts);
    if (tile.rows <= 0) continue;
    // Whether this warpgroup has rows in the tile (uniform in it). Only the wgmma instructions go
    // behind it, their fence, commit and waits run either way, and the shuffle shows ptxas the
    // value is warp-uniform: otherwise it serializes every wgmma of the kernel (C7511, C7520).
    const bool active = __shfl_sync(0xffffffffu, tile.rows > warpgroup * 64, 0);
    mbarrier_wait(rows_full, k & 1);
    int pending = -1;  // the stream position whose slot is still to be released
    for (int c = 0; c < S::kChunks; ++c, ++position) {
      const int slot = position % kStages;
      mbarrier_wait(full + 8 * slot, (position / kStages) & 1);
      fence_proxy_async();  // the chunk's generic-proxy writes (cp.async) before wgmma reads them
      const bool stage_a = c < S::kChunksA;
      int s, kc;
      if (stage_a) {
        s = c / S::kKChunksA, kc = c - s * S::kKChunksA;
      } else {
        s = (c - S::kChunksA) / S::kKChunksB, kc = c - S::kChunksA - s * S::kKChunksB;
      }
      const bool slice_end = kc == (stage_a ? S::kKChunksA : S::kKChunksB) - 1;
      const uint32_t a_rows = (stage_a ? x_rows : h_rows) + kc * kMatrixBytes;
      const uint32_t slot_address = ring + slot * kMatrixBytes;
      wgmma_fence();
      if (active) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          wgmma_m64n128k16(acc, descriptor(a_rows + kk * 32), descriptor(slot_address + kk * 32));
        }
      }
      wgmma_commit();
      if (!slice_end) {
        wgmma_wait<1>();
        if (pending >= 0) release(pending);
        pending = position;
        continue;
      }
      wgmma_wait<0>();
      if (pending >= 0) release(pending);
      release(position);
      pending = -1;
      if (c == S::kChunksA - 1) {
        // Stage A's last products are done: xs may take the next tile's rows.
        __syncwarp();
        mbarrier_arrive_lane0(rows_empty, lane);
      }
      // acc[4 j + e]: n8 tile j, rows 16 warp + gq (e < 2) and + 8 (e >= 2), columns 8 j + 2 tq + (e & 1).
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = warpgroup * 64 + warp * 16 + gq + half * 8;  // row in the tile
        if (stage_a) {
          // G: tiles 0-7 (64 columns of the slice), U: tiles 8-15; a thread holds both of a column.
          uint32_t packed[16];
#pragma unroll
          for (int j = 0; j < 16; ++j) packed[j] = pack_bf16(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const float2 gf = __bfloat1622float2(*reinterpret_cast<const bf162*>(&packed[j]));
            const float2 uf = __bfloat1622float2(*reinterpret_cast<const bf162*>(&packed[j + 8]));
            const bf162 h = __floats2bfloat162_rn(situ_h_fast(gf.x, uf.x, caps), situ_h_fast(gf.y, uf.y, caps));
            *reinterpret_cast<bf162*>(hs_bytes + s * kMatrixBytes + swizzled(r, j) + 4 * tq) = h;
          }
          if (a.gate != nullptr) {
#pragma unroll
            for (int q = 0; q < 4; ++q) {  // G's tiles 0-3, 4-7, then U's 8-11, 12-15
              uint32_t four[4] = {packed[4 * q], packed[4 * q + 1], packed[4 * q + 2], packed[4 * q + 3]};
              quad_transpose(four, tq);
              if (r < tile.rows) {
                bf16* out = (q < 2 ? a.gate : a.up) + static_cast<int64_t>(tile.first_row + r) * F + s * 64 +
                            (q & 1) * 32 + tq * 8;
                *reinterpret_cast<uint4*>(out) = make_uint4(four[0], four[1], four[2], four[3]);
              }
            }
          }
        } else {
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const uint4 piece = accumulator_piece(acc, half, q, tq);
            if (r < tile.rows) {
              bf16* out = a.y + static_cast<int64_t>(tile.first_row + r) * L + s * 128 + q * 32 + tq * 8;
              *reinterpret_cast<uint4*>(out) = piece;
            }
          }
        }
      }
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = 0.f;
      if (c == S::kChunksA - 1) {
        // H complete: made visible to the async proxy, then to the warpgroup's other warps (each
        // warp wrote its own 16 rows; stage B's products read all 64).
        fence_proxy_async();
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + warpgroup) : "memory");
      }
    }
    ++k;
  }
#endif
}

// ---- The backward kernels' ring (dX, weight gradients) --------------------------------------------
// kRing slots of kStageBytes at `stages`, `full` / `empty` mbarriers 8 bytes apart: full counts the
// two loading warps' lanes (cp.async arrivals), empty the consumer warps.
template <int kRing>
__device__ __forceinline__ void init_ring(uint32_t full, uint32_t empty) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < kRing; ++i) {
      mbarrier_init(full + 8 * i, 64);  // the two loading warps' lanes
      mbarrier_init(empty + 8 * i, kConsumerThreads / 32);
    }
  }
}

// A consumer warp's side of one job's `chunks` chunks, from stream position `position` on:
// `issue(stage, c)` issues chunk c's wgmma between the fence and the commit; a chunk's products
// stay in flight while the next chunk is awaited (wgmma.wait_group 1), and its slot is released
// once they are done (the last chunk's at once: the epilogue follows).
template <int kRing, int kStageBytes, typename Issue>
__device__ __forceinline__ void consume_chunks(uint32_t stages, uint32_t full, uint32_t empty, int chunks,
                                               int& position, int lane, Issue&& issue) {
  auto release = [&](int q) {
    __syncwarp();
    mbarrier_arrive_lane0(empty + 8 * (q % kRing), lane);
  };
  int pending = -1;
  for (int c = 0; c < chunks; ++c, ++position) {
    const int slot = position % kRing;
    mbarrier_wait(full + 8 * slot, (position / kRing) & 1);
    fence_proxy_async();
    wgmma_fence();
    issue(stages + slot * kStageBytes, c);
    wgmma_commit();
    if (c < chunks - 1) {
      wgmma_wait<1>();
      if (pending >= 0) release(pending);
      pending = position;
      continue;
    }
    wgmma_wait<0>();
    if (pending >= 0) release(pending);
    release(position);
  }
}

// ---- dX = dG W_gate + dU W_up (moe_experts_dx's contract) ----------------------------------------
// Jobs: (tile of at most 128 rows of one expert, TileSplit::kFull) x (slice of 128 columns of L),
// dealt snaking; K = 2F ([dG | dU] against [W_gate; W_up]) streams in chunks of 64. A stage is the
// chunk's A (128 rows x 64 of dG or dU, K-major, as the forward's X) and B (64 rows of W_gate[e] or
// W_up[e] x the slice's 128 columns: N-major, two blocks of 64 columns 8 KB apart, each row of 64
// columns swizzled as a K-major row is). Warps 0-7 are the two consumer warpgroups (rows 0-63,
// 64-127), warp 8 loads A, warp 9 loads B; kDxStages stages, mbarriers as in the forward. The
// fp32 sums over the 2F products are rounded once to bf16 and stored as 16-byte pieces of rows.
// Two CTAs an SM (3 stages of 32 KB each): one's epilogue and pipeline refill overlap the
// other's products; 6 stages and one CTA took 0.224 ms where this takes 0.169 (the small config's
// dX at 8K tokens, scripts/moe_weight_grads_driver.cu).
constexpr int kDxStages = 3;
constexpr int kDxStageBytes = 2 * kMatrixBytes;  // A then B
constexpr size_t kDxSharedBytes = size_t{kDxStages} * kDxStageBytes + 1024;


__global__ void __launch_bounds__(kAllThreads, 2) moe_experts_dx_wgmma_kernel(DxArgs a) {
#if defined(ODYSSEY_NO_WGMMA)
  __trap();
#else
  extern __shared__ unsigned char shared_bytes[];
  __shared__ int tile_ends[kMaxExperts];
  __shared__ __align__(8) uint64_t barriers[2 * kDxStages];
  const uint32_t stages = (shared_address(shared_bytes) + 1023u) & ~1023u;
  const uint32_t full = shared_address(&barriers[0]), empty = shared_address(&barriers[kDxStages]);
  init_ring<kDxStages>(full, empty);
  const int tiles = build_tile_schedule<kAllThreads>(a.group_ends, a.experts, tile_ends);  // ends in __syncthreads
  const int jobs = tiles * a.slices, chunks = 2 * a.ffn / 64;
  const int warp_id = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 5), 0), lane = threadIdx.x & 31;
  // The job of round r: its tile, and the slice's first column.
  auto job_of = [&](int j, Tile& tile, int& n0) {
    const int t = j / a.slices;
    tile = find_tile<TileSplit::kFull>(t, tile_ends, a.group_ends, a.experts);
    n0 = (j - t * a.slices) * 128;
  };

  if (warp_id == kWeightWarp || warp_id == kRowsWarp) {
    const bool loads_a = warp_id == kWeightWarp;  // warp 8: A (dG / dU rows); warp 9: B (weights)
    int position = 0;
    for (int round = 0; round * static_cast<int>(gridDim.x) < jobs; ++round) {
      const int j = snake_tile(round);
      if (j >= jobs) continue;
      Tile tile;
      int n0;
      job_of(j, tile, n0);
      if (tile.rows <= 0) continue;
      for (int c = 0; c < chunks; ++c, ++position) {
        const int slot = position % kDxStages;
        mbarrier_wait(empty + 8 * slot, ((position / kDxStages) & 1) ^ 1);
        const uint32_t stage = stages + slot * kDxStageBytes;
        const int k = c * 64;
        const bool gate = k < a.ffn;  // F % 64 == 0: a chunk is all dG or all dU
        const int kf = gate ? k : k - a.ffn;
        if (loads_a) {
          // Lane l: piece l % 8 of rows l / 8 + 4 i; rows past the tile zero-filled.
          const bf16* rows = (gate ? a.d_gate : a.d_up) + kf + (lane & 7) * 8;
#pragma unroll 8
          for (int i = 0; i < 32; ++i) {
            const int r = (lane >> 3) + 4 * i;
            const bool valid = r < tile.rows;
            const bf16* src = rows + static_cast<int64_t>(tile.first_row + (valid ? r : 0)) * a.ffn;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(stage + swizzled(r, lane & 7)),
                         "l"(src), "r"(valid ? 16 : 0)
                         : "memory");
          }
        } else {
          // Lane l: piece l % 16 (block (l % 16) / 8 of 64 columns) of weight rows l / 16 + 2 i.
          const int p = lane & 15;
          const bf16* w = (gate ? a.gate_proj : a.up_proj) +
                          (static_cast<int64_t>(tile.expert) * a.ffn + kf) * a.latent + n0 + p * 8;
          const uint32_t b = stage + kMatrixBytes + (p >> 3) * (kMatrixBytes / 2);
#pragma unroll 8
          for (int i = 0; i < 32; ++i) {
            const int kr = (lane >> 4) + 2 * i;
            cp_async16_at(b + swizzled(kr, p & 7), w + static_cast<int64_t>(kr) * a.latent);
          }
        }
        cp_async_arrive(full + 8 * slot);
      }
    }
    cp_async_wait<0>();
    return;
  }

  const int warpgroup = warp_id >> 2, warp = warp_id & 3;
  const int gq = lane >> 2, tq = lane & 3;
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  int position = 0;
  for (int round = 0; round * static_cast<int>(gridDim.x) < jobs; ++round) {
    const int j = snake_tile(round);
    if (j >= jobs) continue;
    Tile tile;
    int n0;
    job_of(j, tile, n0);
    if (tile.rows <= 0) continue;
    const bool active = __shfl_sync(0xffffffffu, tile.rows > warpgroup * 64, 0);  // see the forward
    auto issue = [&](uint32_t stage, int) {
      if (active) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          wgmma_m64n128k16<1>(acc, descriptor(stage + warpgroup * 64 * kRowBytes + kk * 32),
                              descriptor_mn(stage + kMatrixBytes + kk * 16 * kRowBytes, kMatrixBytes / 2));
        }
      }
    };
    consume_chunks<kDxStages, kDxStageBytes>(stages, full, empty, chunks, position, lane, issue);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warpgroup * 64 + warp * 16 + gq + half * 8;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint4 piece = accumulator_piece(acc, half, q, tq);
        if (r < tile.rows) {
          bf16* out = a.dx + static_cast<int64_t>(tile.first_row + r) * a.latent + n0 + q * 32 + tq * 8;
          *reinterpret_cast<uint4*>(out) = piece;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  }
#endif
}

// ---- Weight gradients: dW_gate = dG^T X, dW_up = dU^T X, dW_down = dY^T H ----------------------
// moe_experts_weight_grads' contract, with the mma.sync kernel's jobs (moe_experts_backward.cu):
// 128 x 128 tiles of the outputs, a fixed number per expert, the experts sorted by rows (most
// first) and the jobs dealt snaking. out[m][n] = sum_r A[r][m] B[r][n] over the expert's rows:
// both operands are row-major over the rows, i.e. M-major A and N-major B for wgmma. A job's rows
// stream in chunks of 64 (k); a stage is A (64 rows x the tile's 128 m: two blocks of 64 columns
// 8 KB apart, each row of 64 swizzled as in dX's B) then B (the same for the 128 n), 32 KB.
// Warp 8 loads A, warp 9 B (rows past the expert's end, and B columns past F in a half-filled
// dW_down tile, zero-filled); warpgroup g takes m 64 g .. 64 g + 63 against all 128 n. A last
// chunk issues only the k16 steps that hold rows. Experts without rows get zeros. Two CTAs an SM,
// as dX's: a job is ~3 chunks, so its epilogue is a large share of its time; with one CTA of 6
// stages the kernel took 0.369 ms (slower than the mma.sync one's 0.359), with two 0.279.
constexpr int kGradStages = 3;
constexpr int kGradStageBytes = 2 * kMatrixBytes;  // A then B
constexpr size_t kGradSharedBytes = size_t{kGradStages} * kGradStageBytes + 1024;

// kFp32Outputs: the outputs are the fp32 sums (moe_experts_weight_grads' fp32_outputs), a template argument so
// that the bf16 kernel's registers stay as they were (with a run-time branch ptxas spilled).
template <bool kFp32Outputs>
__global__ void __launch_bounds__(kAllThreads, 2) moe_experts_weight_grads_wgmma_kernel(GradArgs a) {
#if defined(ODYSSEY_NO_WGMMA)
  __trap();
#else
  extern __shared__ unsigned char shared_bytes[];
  __shared__ int order[kMaxExperts];
  __shared__ __align__(8) uint64_t barriers[2 * kGradStages];
  const uint32_t stages = (shared_address(shared_bytes) + 1023u) & ~1023u;
  const uint32_t full = shared_address(&barriers[0]), empty = shared_address(&barriers[kGradStages]);
  init_ring<kGradStages>(full, empty);
  // The ring is scratch for the sort (8 KB) until the sort's last barrier.
  unsigned char* ring = shared_bytes + (stages - shared_address(shared_bytes));
  sort_experts<kAllThreads>(a.group_ends, a.experts, reinterpret_cast<uint64_t*>(ring), order);
  const int warp_id = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 5), 0), lane = threadIdx.x & 31;

  if (warp_id == kWeightWarp || warp_id == kRowsWarp) {
    const bool loads_a = warp_id == kWeightWarp;  // warp 8: A; warp 9: B
    const int p = lane & 15;                      // this lane's 16-byte piece of a row of 128 columns
    int position = 0;
    for (int round = 0; round * static_cast<int>(gridDim.x) < a.jobs; ++round) {
      const int j = snake_tile(round);
      if (j >= a.jobs) continue;
      const GradJob job = grad_job(j, a, order);
      const int chunks = (job.rows + 63) / 64;
      if (chunks == 0) continue;
      // This lane's column (m or n) of its operand at row 0, the row stride, and whether the column
      // is inside the output (false past F in a half-filled dW_down tile).
      const bf16* column;
      int stride;
      bool column_valid = true;
      const int c0 = (loads_a ? job.m0 : job.n0) + p * 8;
      if (job.down) {
        if (loads_a) {
          column = a.dy + c0, stride = a.latent;
        } else {
          column_valid = c0 < a.ffn;
          column = a.h + (column_valid ? c0 : 0), stride = a.ffn;
        }
      } else if (loads_a) {
        column = c0 < a.ffn ? a.d_gate + c0 : a.d_up + (c0 - a.ffn), stride = a.ffn;
      } else {
        column = a.rows + c0, stride = a.latent;
      }
      const uint32_t piece_base = (p >> 3) * (kMatrixBytes / 2);
      for (int c = 0; c < chunks; ++c, ++position) {
        const int slot = position % kGradStages;
        mbarrier_wait(empty + 8 * slot, ((position / kGradStages) & 1) ^ 1);
        const uint32_t dst = stages + slot * kGradStageBytes + (loads_a ? 0 : kMatrixBytes) + piece_base;
#pragma unroll 8
        for (int i = 0; i < 32; ++i) {
          const int kr = (lane >> 4) + 2 * i, r = c * 64 + kr;
          const bool valid = column_valid && r < job.rows;
          const bf16* src = column + static_cast<int64_t>(job.first_row + (valid ? r : 0)) * stride;
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst + swizzled(kr, p & 7)),
                       "l"(src), "r"(valid ? 16 : 0)
                       : "memory");
        }
        cp_async_arrive(full + 8 * slot);
      }
    }
    cp_async_wait<0>();
    return;
  }

  const int warpgroup = warp_id >> 2, warp = warp_id & 3;
  const int gq = lane >> 2, tq = lane & 3;
  float acc[64];
  int position = 0;
  for (int round = 0; round * static_cast<int>(gridDim.x) < a.jobs; ++round) {
    const int j = snake_tile(round);
    if (j >= a.jobs) continue;
    const GradJob job = grad_job(j, a, order);
    const int rows = __shfl_sync(0xffffffffu, job.rows, 0);  // warp-uniform for ptxas (see the forward)
    const int chunks = (rows + 63) / 64;
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    auto issue = [&](uint32_t stage, int c) {
      const int steps = min(4, (rows - c * 64 + 15) / 16);  // k16 steps holding rows
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        if (kk < steps) {
          const uint32_t a_rows = stage + warpgroup * (kMatrixBytes / 2) + kk * 16 * kRowBytes;
          const uint32_t b_rows = stage + kMatrixBytes + kk * 16 * kRowBytes;
          wgmma_m64n128k16<1, 1>(acc, descriptor_mn(a_rows, kMatrixBytes / 2), descriptor_mn(b_rows, kMatrixBytes / 2));
        }
      }
    };
    consume_chunks<kGradStages, kGradStageBytes>(stages, full, empty, chunks, position, lane, issue);
    // Row m of the tile is a row of dW_gate / dW_up (m < F / m >= F) or of dW_down; its columns past
    // F (a half-filled dW_down tile) are not stored. With fp32 outputs the sums themselves are
    // stored: lane tq's pair of columns 8 nt + 2 tq of every 8-column block (the accumulators' own
    // layout), each quad writing 32 whole bytes.
    const int width = job.down ? a.ffn : a.latent;
    using Out = std::conditional_t<kFp32Outputs, float, bf16>;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int m = job.m0 + warpgroup * 64 + warp * 16 + gq + half * 8;
      Out* out;
      if (job.down) {
        out = static_cast<Out*>(a.d_down_proj) + (static_cast<int64_t>(job.expert) * a.latent + m) * a.ffn;
      } else if (m < a.ffn) {
        out = static_cast<Out*>(a.d_gate_proj) + (static_cast<int64_t>(job.expert) * a.ffn + m) * a.latent;
      } else {
        out = static_cast<Out*>(a.d_up_proj) + (static_cast<int64_t>(job.expert) * a.ffn + m - a.ffn) * a.latent;
      }
      if constexpr (kFp32Outputs) {
#pragma unroll
        for (int nt = 0; nt < 16; ++nt) {
          const int n = job.n0 + nt * 8 + tq * 2;
          if (n < width) *reinterpret_cast<float2*>(out + n) = make_float2(acc[4 * nt + 2 * half], acc[4 * nt + 2 * half + 1]);
        }
      } else {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const uint4 piece = accumulator_piece(acc, half, q, tq);
          const int n = job.n0 + q * 32 + tq * 8;
          if (n < width) *reinterpret_cast<uint4*>(out + n) = piece;
        }
      }
    }
  }
#endif
}

struct KernelInfo {
  void (*kernel)(ForwardArgs) = nullptr;
  size_t shared = 0;
};
template <int L, int... Fs>
void find_for_latent(int64_t latent, int64_t ffn, KernelInfo& info) {
  ((latent == L && ffn == Fs ? (info = KernelInfo{&moe_experts_forward_wgmma_kernel<L, Fs>,
                                                  Shape<L, Fs>::kSharedBytes},
                                0)
                             : 0),
   ...);
}
// The (L, F) pairs compiled: those whose X, H and ring fit 227 KB with the schedule (L + F <= 576).
KernelInfo find_kernel(int64_t latent, int64_t ffn) {
  KernelInfo info;
  find_for_latent<128, 64, 128, 192, 256, 320, 384, 448>(latent, ffn, info);
  find_for_latent<256, 64, 128, 192, 256, 320>(latent, ffn, info);
  find_for_latent<384, 64, 128, 192>(latent, ffn, info);
  find_for_latent<512, 64>(latent, ffn, info);
  return info;
}

}  // namespace

bool moe_experts_forward_wgmma_supported(int64_t latent, int64_t ffn, int64_t experts) {
  if (experts < 1 || experts > kMaxExperts) return false;
  const KernelInfo info = find_kernel(latent, ffn);
  if (info.kernel == nullptr) return false;
  constexpr size_t kStatic = (kMaxExperts + kAllThreads / 32) * sizeof(int) + (2 * kStages + 2) * 8;
  return device_fits(info.shared + kStatic, DeviceNeed::kSm90);
}

cudaError_t moe_experts_forward_wgmma(const void* rows, const void* gate_proj, const void* up_proj,
                                      const void* down_proj, const int32_t* group_ends, void* y,
                                      void* gate, void* up, int64_t total_rows, int64_t experts,
                                      int64_t latent, int64_t ffn, float beta1, float beta2,
                                      cudaStream_t stream) {
  if (!moe_experts_forward_wgmma_supported(latent, ffn, experts) ||
      !forward_arguments_valid(rows, gate_proj, up_proj, down_proj, y, gate, up, total_rows, beta1, beta2)) {
    return cudaErrorInvalidValue;
  }
  if (total_rows == 0) return cudaSuccess;
  const KernelInfo info = find_kernel(latent, ffn);
  int sms = 0;
  const cudaError_t error = prepare_launch(info.kernel, info.shared, sms);
  if (error != cudaSuccess) return error;
  const ForwardArgs a =
      forward_args(rows, gate_proj, up_proj, down_proj, group_ends, y, gate, up, experts, beta1, beta2);
  const int64_t max_tiles = total_rows / kTileRows + experts;
  const int grid = static_cast<int>(max_tiles < sms ? max_tiles : sms);
  info.kernel<<<grid, kAllThreads, info.shared, stream>>>(a);
  return cudaGetLastError();
}

bool moe_experts_dx_wgmma_supported(int64_t latent, int64_t ffn, int64_t experts) {
  if (latent < 128 || latent % 128 != 0 || ffn < 64 || ffn % 64 != 0 || experts < 1 || experts > kMaxExperts ||
      experts * ffn * latent >= (int64_t{1} << 40)) {
    return false;
  }
  constexpr size_t kStatic = (kMaxExperts + kAllThreads / 32) * sizeof(int) + 2 * kDxStages * 8;
  return device_fits(kDxSharedBytes + kStatic, DeviceNeed::kSm90);
}

cudaError_t moe_experts_dx_wgmma(const void* d_gate, const void* d_up, const void* gate_proj,
                                 const void* up_proj, const int32_t* group_ends, void* dx,
                                 int64_t total_rows, int64_t experts, int64_t latent, int64_t ffn,
                                 cudaStream_t stream) {
  if (!moe_experts_dx_wgmma_supported(latent, ffn, experts) ||
      !dx_arguments_valid(d_gate, d_up, gate_proj, up_proj, group_ends, dx, total_rows)) {
    return cudaErrorInvalidValue;
  }
  if (total_rows == 0) return cudaSuccess;  // an empty batch: nothing to read or write
  int sms = 0;
  const cudaError_t error = prepare_launch(moe_experts_dx_wgmma_kernel, kDxSharedBytes, sms);
  if (error != cudaSuccess) return error;
  const DxArgs a = dx_args(d_gate, d_up, gate_proj, up_proj, group_ends, dx, experts, latent, ffn);
  const int64_t max_jobs = (total_rows / kTileRows + experts) * a.slices;
  const int grid = static_cast<int>(max_jobs < 2 * sms ? max_jobs : 2 * sms);
  moe_experts_dx_wgmma_kernel<<<grid, kAllThreads, kDxSharedBytes, stream>>>(a);
  return cudaGetLastError();
}

bool moe_experts_weight_grads_wgmma_supported(int64_t latent, int64_t ffn, int64_t experts) {
  if (latent < 128 || latent % 128 != 0 || ffn < 64 || ffn % 64 != 0 || experts < 1 || experts > kMaxExperts) {
    return false;
  }
  const int64_t per_expert = (2 * ffn / 128) * (latent / 128) + (latent / 128) * ((ffn + 127) / 128);
  if (experts * per_expert >= (int64_t{1} << 31) || experts * ffn * latent >= (int64_t{1} << 40)) return false;
  constexpr size_t kStatic = kMaxExperts * sizeof(int) + 2 * kGradStages * 8;
  return device_fits(kGradSharedBytes + kStatic, DeviceNeed::kSm90);
}

cudaError_t moe_experts_weight_grads_wgmma(const void* rows, const void* d_gate, const void* d_up,
                                           const void* dy, const void* h, const int32_t* group_ends,
                                           void* d_gate_proj, void* d_up_proj, void* d_down_proj,
                                           int64_t total_rows, int64_t experts, int64_t latent,
                                           int64_t ffn, cudaStream_t stream, bool fp32_outputs) {
  if (!moe_experts_weight_grads_wgmma_supported(latent, ffn, experts) ||
      !grad_arguments_valid(rows, d_gate, d_up, dy, h, group_ends, d_gate_proj, d_up_proj, d_down_proj, total_rows)) {
    return cudaErrorInvalidValue;
  }
  if (d_gate_proj == nullptr && d_down_proj == nullptr) return cudaSuccess;
  int sms = 0;
  void (*kernel)(GradArgs) =
      fp32_outputs ? moe_experts_weight_grads_wgmma_kernel<true> : moe_experts_weight_grads_wgmma_kernel<false>;
  const cudaError_t error = prepare_launch(kernel, kGradSharedBytes, sms);
  if (error != cudaSuccess) return error;
  const GradArgs a = grad_args(rows, d_gate, d_up, dy, h, group_ends, d_gate_proj, d_up_proj, d_down_proj, experts,
                               latent, ffn);
  const int grid = a.jobs < 2 * sms ? a.jobs : 2 * sms;
  kernel<<<grid, kAllThreads, kGradSharedBytes, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace odyssey::kernels
