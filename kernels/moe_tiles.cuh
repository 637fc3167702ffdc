// Tiles of rows of one expert, for kernels over rows grouped by expert (moe_experts.cu's forward,
// the dX kernels): an expert with c rows gets ceil(c / 128) tiles (TileSplit says how they share
// the rows). The schedule (an inclusive prefix sum of tiles over experts) is built by every CTA in
// shared memory from group_ends, so nothing is read back to the host. Also the experts sorted by
// rows, most first (the weight-gradient kernels deal their jobs in that order). Internal
// (anonymous namespace: each .cu gets its own copy).
#pragma once

#include <cstdint>

namespace odyssey::kernels {
namespace {

constexpr int kTileRows = 128;     // rows of one expert a CTA takes at a time
constexpr int kMaxExperts = 1024;  // experts a schedule holds

// The tiles of every expert as an inclusive prefix sum over experts, in shared memory; returns the
// number of tiles. Expert e owns rows [group_ends[e - 1], group_ends[e]).
template <int kThreads>
__device__ int build_tile_schedule(const int32_t* __restrict__ group_ends, int experts,
                                   int* tile_ends) {
  __shared__ int warp_sums[kThreads / 32];
  constexpr unsigned kFullMask = 0xffffffffu;
  constexpr int kPerThread = (kMaxExperts + kThreads - 1) / kThreads;
  const int first = threadIdx.x * kPerThread;
  int counts[kPerThread];
  int local = 0;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int e = first + i;
    int tiles = 0;
    if (e < experts) {
      const int rows = group_ends[e] - (e > 0 ? group_ends[e - 1] : 0);
      tiles = (rows + kTileRows - 1) / kTileRows;
    }
    counts[i] = tiles;
    local += tiles;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int inclusive = local;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int other = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  int running = inclusive - local, total = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) {
    if (w < warp) running += warp_sums[w];
    total += warp_sums[w];
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    running += counts[i];
    if (first + i < experts) tile_ends[first + i] = running;
  }
  __syncthreads();
  return total;
}

struct Tile {
  int expert;
  int first_row;  // absolute row of the tile's row 0
  int rows;       // <= kTileRows; <= 0: nothing to do
};

// How an expert's ceil(c / 128) tiles share its c rows: kEven, ceil(c / tiles) rows each (146 rows:
// two of 73, for the mma.sync kernels whose m16 blocks waste at most 15 rows a tile); kFull, 128
// rows each and the rest in the last (146 rows: 128 and 18, for the WGMMA kernels whose warpgroups
// take 64-row blocks: 3 blocks instead of 4).
enum class TileSplit { kEven, kFull };

template <TileSplit kSplit = TileSplit::kEven>
__device__ Tile find_tile(int t, const int* tile_ends, const int32_t* __restrict__ group_ends,
                          int experts) {
  int lo = 0, hi = experts - 1;  // the first expert whose tiles end after t
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (tile_ends[mid] > t) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  const int begin = lo > 0 ? group_ends[lo - 1] : 0;
  const int rows = group_ends[lo] - begin;
  const int tiles = tile_ends[lo] - (lo > 0 ? tile_ends[lo - 1] : 0);
  const int j = t - (tile_ends[lo] - tiles);
  const int per_tile = kSplit == TileSplit::kFull ? kTileRows : (rows + tiles - 1) / tiles;
  const int start = j * per_tile;
  return Tile{lo, begin + start, min(per_tile, rows - start)};
}

// order[0 .. experts) = the experts by rows, most first (ties: lower index first), sorted in
// shared memory by every CTA (a bitonic sort of 1024 keys; `keys`: 8 KB of scratch).
template <int kThreads>
__device__ void sort_experts(const int32_t* __restrict__ group_ends, int experts, uint64_t* keys,
                             int* order) {
  for (int i = threadIdx.x; i < kMaxExperts; i += kThreads) {
    uint64_t key = 0;  // past the experts: last
    if (i < experts) {
      const uint32_t rows = static_cast<uint32_t>(group_ends[i] - (i > 0 ? group_ends[i - 1] : 0));
      key = (uint64_t{rows} << 32) | (0xffffffffu - static_cast<uint32_t>(i));
    }
    keys[i] = key;
  }
  __syncthreads();
  for (int size = 2; size <= kMaxExperts; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < kMaxExperts; i += kThreads) {
        const int partner = i ^ stride;
        if (partner > i) {
          const uint64_t x = keys[i], y = keys[partner];
          // Descending where (i & size) == 0, ascending elsewhere: descending in the end.
          if (((i & size) == 0) == (x < y)) keys[i] = y, keys[partner] = x;
        }
      }
      __syncthreads();
    }
  }
  for (int i = threadIdx.x; i < experts; i += kThreads) {
    order[i] = static_cast<int>(0xffffffffu - static_cast<uint32_t>(keys[i]));
  }
  __syncthreads();
}

}  // namespace
}  // namespace odyssey::kernels
