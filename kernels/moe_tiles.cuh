// Tiles of rows of one expert, for kernels over rows grouped by expert (moe_experts.cu's forward,
// the dX kernels): an expert with c rows gets ceil(c / 128) tiles (TileSplit says how they share
// the rows). The schedule (an inclusive prefix sum of tiles over experts) is built by every CTA in
// shared memory from group_ends, so nothing is read back to the host. Also the experts sorted by
// rows, most first (the weight-gradient kernels deal their jobs in that order), those kernels'
// jobs, and the launchers' host helpers. Internal (anonymous namespace: each .cu gets its own copy).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

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

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }  // nullptr: yes

// ---- The fused forward launchers' checks (moe_experts.cu's mma.sync kernel, moe_experts_sm90.cu's
// wgmma one; moe_experts_forward's contract, kernels/moe.h): G and U both or neither, positive
// caps, every pointer 16-byte aligned (the kernels store G, U and y as 16-byte pieces).
inline bool forward_arguments_valid(const void* rows, const void* gate_proj, const void* up_proj,
                                    const void* down_proj, const void* y, const void* gate, const void* up,
                                    int64_t total_rows, float beta1, float beta2) {
  if (total_rows < 0 || total_rows >= (int64_t{1} << 31) || (gate == nullptr) != (up == nullptr) ||
      !(beta1 > 0.f) || !(beta2 > 0.f)) {
    return false;
  }
  for (const void* p : {rows, gate_proj, up_proj, down_proj, y, gate, up}) {
    if (!aligned16(p)) return false;
  }
  return true;
}

// The fused forward's arguments, as both kernels take them (moe.h, moe_experts_forward).
struct ForwardArgs {
  const __nv_bfloat16* rows;
  const __nv_bfloat16* gate_proj;
  const __nv_bfloat16* up_proj;
  const __nv_bfloat16* down_proj;
  const int32_t* group_ends;
  __nv_bfloat16* y;
  __nv_bfloat16* gate;  // or nullptr
  __nv_bfloat16* up;    // or nullptr
  int experts;
  float beta1, beta2;
};

inline ForwardArgs forward_args(const void* rows, const void* gate_proj, const void* up_proj, const void* down_proj,
                                const int32_t* group_ends, void* y, void* gate, void* up, int64_t experts,
                                float beta1, float beta2) {
  using bf16 = __nv_bfloat16;
  ForwardArgs a;
  a.rows = static_cast<const bf16*>(rows);
  a.gate_proj = static_cast<const bf16*>(gate_proj);
  a.up_proj = static_cast<const bf16*>(up_proj);
  a.down_proj = static_cast<const bf16*>(down_proj);
  a.group_ends = group_ends;
  a.y = static_cast<bf16*>(y);
  a.gate = static_cast<bf16*>(gate);
  a.up = static_cast<bf16*>(up);
  a.experts = static_cast<int>(experts);
  a.beta1 = beta1;
  a.beta2 = beta2;
  return a;
}

// ---- The weight-gradient kernels' jobs (moe_experts_backward.cu's mma.sync kernel and
// moe_experts_sm90.cu's wgmma one): 128 x 128 tiles of the outputs, a fixed number per expert,
// experts in the order of `order` (sort_experts).
struct GradArgs {
  const __nv_bfloat16* rows;  // X [R, L]
  const __nv_bfloat16* d_gate;
  const __nv_bfloat16* d_up;  // dG, dU [R, F]
  const __nv_bfloat16* dy;    // [R, L]
  const __nv_bfloat16* h;     // [R, F]
  const int32_t* group_ends;
  void* d_gate_proj;
  void* d_up_proj;    // [E, F, L] (both or neither)
  void* d_down_proj;  // [E, L, F] (or nullptr); bf16, or fp32 where the wgmma kernel writes fp32
  int experts, latent, ffn;
  int gate_up_jobs, down_jobs;  // per expert (0 for a part not wanted)
  int jobs;                     // all experts'
};

struct GradJob {
  int expert;
  int first_row, rows;  // the expert's rows
  bool down;            // dW_down's tile, else gate / up's
  int m0, n0;
};

// Job j: the (j / per_expert)-th expert of `order`; gate / up tiles first (m over the 2F columns of
// [dG | dU], n over L), then down's (m over L, n over F, the last tile half filled when F % 128 == 64).
__device__ __forceinline__ GradJob grad_job(int j, const GradArgs& a, const int* order) {
  const int per_expert = a.gate_up_jobs + a.down_jobs;
  const int i = j / per_expert;
  int s = j - i * per_expert;
  const int e = order[i];
  GradJob job;
  job.expert = e;
  job.first_row = e > 0 ? a.group_ends[e - 1] : 0;
  job.rows = a.group_ends[e] - job.first_row;
  job.down = s >= a.gate_up_jobs;
  if (job.down) s -= a.gate_up_jobs;
  const int n_tiles = job.down ? (a.ffn + kTileRows - 1) / kTileRows : a.latent / kTileRows;
  job.m0 = (s / n_tiles) * kTileRows;
  job.n0 = (s - (s / n_tiles) * n_tiles) * kTileRows;
  return job;
}

// The weight-gradient launchers' checks of their pointers and row count (moe_experts_weight_grads'
// contract, kernels/moe.h): d_gate_proj and d_up_proj both or neither; with rows, the inputs of
// the parts wanted given; every pointer 16-byte aligned.
inline bool grad_arguments_valid(const void* rows, const void* d_gate, const void* d_up, const void* dy,
                                 const void* h, const int32_t* group_ends, const void* d_gate_proj,
                                 const void* d_up_proj, const void* d_down_proj, int64_t total_rows) {
  const bool gate_up = d_gate_proj != nullptr, down = d_down_proj != nullptr, rows_read = total_rows > 0;
  if (total_rows < 0 || total_rows >= (int64_t{1} << 31) || (d_up_proj != nullptr) != gate_up ||
      group_ends == nullptr) {
    return false;
  }
  // Without rows (an empty batch: LibTorch's empty tensors have null data) the inputs are never
  // read and every gradient is zero.
  if (gate_up && rows_read && (rows == nullptr || d_gate == nullptr || d_up == nullptr)) return false;
  if (down && rows_read && (dy == nullptr || h == nullptr)) return false;
  for (const void* p : {rows, d_gate, d_up, dy, h, d_gate_proj, d_up_proj, d_down_proj}) {
    if (!aligned16(p)) return false;
  }
  return true;
}

// Fills a GradArgs from a launcher's arguments (gate / up wanted when d_gate_proj is given, down
// when d_down_proj is).
inline GradArgs grad_args(const void* rows, const void* d_gate, const void* d_up, const void* dy, const void* h,
                          const int32_t* group_ends, void* d_gate_proj, void* d_up_proj, void* d_down_proj,
                          int64_t experts, int64_t latent, int64_t ffn) {
  GradArgs a;
  a.rows = static_cast<const __nv_bfloat16*>(rows);
  a.d_gate = static_cast<const __nv_bfloat16*>(d_gate);
  a.d_up = static_cast<const __nv_bfloat16*>(d_up);
  a.dy = static_cast<const __nv_bfloat16*>(dy);
  a.h = static_cast<const __nv_bfloat16*>(h);
  a.group_ends = group_ends;
  a.d_gate_proj = d_gate_proj;
  a.d_up_proj = d_up_proj;
  a.d_down_proj = d_down_proj;
  a.experts = static_cast<int>(experts);
  a.latent = static_cast<int>(latent);
  a.ffn = static_cast<int>(ffn);
  a.gate_up_jobs = d_gate_proj != nullptr ? static_cast<int>((2 * ffn / kTileRows) * (latent / kTileRows)) : 0;
  a.down_jobs =
      d_down_proj != nullptr ? static_cast<int>((latent / kTileRows) * ((ffn + kTileRows - 1) / kTileRows)) : 0;
  a.jobs = static_cast<int>(experts) * (a.gate_up_jobs + a.down_jobs);
  return a;
}

// ---- The dX kernels' arguments (moe_experts_backward.cu's mma.sync kernel, moe_experts_sm90.cu's
// wgmma one): dx[r] = d_gate[r] W_gate[e] + d_up[r] W_up[e]; jobs (tile of rows) x (slice of 128
// columns of L).
struct DxArgs {
  const __nv_bfloat16* d_gate;
  const __nv_bfloat16* d_up;  // [R, F]
  const __nv_bfloat16* gate_proj;
  const __nv_bfloat16* up_proj;  // [E, F, L]
  const int32_t* group_ends;
  __nv_bfloat16* dx;  // [R, L]
  int experts, latent, ffn;
  int slices;  // L / 128
};

// moe_experts_dx's checks of its pointers and row count (kernels/moe.h): the weights and
// group_ends given, every pointer 16-byte aligned, and with rows the rows' pointers given.
inline bool dx_arguments_valid(const void* d_gate, const void* d_up, const void* gate_proj, const void* up_proj,
                               const int32_t* group_ends, const void* dx, int64_t total_rows) {
  if (total_rows < 0 || total_rows >= (int64_t{1} << 31) || group_ends == nullptr || gate_proj == nullptr ||
      up_proj == nullptr) {
    return false;
  }
  for (const void* p : {d_gate, d_up, gate_proj, up_proj, dx}) {
    if (!aligned16(p)) return false;
  }
  // An empty batch reads and writes nothing (LibTorch's empty tensors have null data).
  return total_rows == 0 || (d_gate != nullptr && d_up != nullptr && dx != nullptr);
}

inline DxArgs dx_args(const void* d_gate, const void* d_up, const void* gate_proj, const void* up_proj,
                      const int32_t* group_ends, void* dx, int64_t experts, int64_t latent, int64_t ffn) {
  DxArgs a;
  a.d_gate = static_cast<const __nv_bfloat16*>(d_gate);
  a.d_up = static_cast<const __nv_bfloat16*>(d_up);
  a.gate_proj = static_cast<const __nv_bfloat16*>(gate_proj);
  a.up_proj = static_cast<const __nv_bfloat16*>(up_proj);
  a.group_ends = group_ends;
  a.dx = static_cast<__nv_bfloat16*>(dx);
  a.experts = static_cast<int>(experts);
  a.latent = static_cast<int>(latent);
  a.ffn = static_cast<int>(ffn);
  a.slices = static_cast<int>(latent / kTileRows);
  return a;
}

// ---- Launch helpers (host) -----------------------------------------------------------------------
// Which devices a kernel runs on: sm_80 and newer (mma.sync), or sm_90 alone (wgmma, built for
// sm_90a: not sm_100 and later, whose arch-specific sets differ).
enum class DeviceNeed { kSm80OrNewer, kSm90 };

// Whether the current device is one `need` allows and gives a block `shared` bytes of shared memory.
inline bool device_fits(size_t shared, DeviceNeed need) {
  int device = 0, major = 0, minor = 0, optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    return false;
  }
  const bool arch = need == DeviceNeed::kSm90 ? (major == 9 && minor == 0) : major >= 8;
  return arch && shared <= static_cast<size_t>(optin);
}

// The current device's SM count, with `kernel`'s dynamic shared memory raised to `shared` bytes.
template <typename Kernel>
cudaError_t prepare_launch(Kernel kernel, size_t shared, int& sms) {
  int device = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error == cudaSuccess) error = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (error == cudaSuccess) {
    error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
  }
  return error;
}

}  // namespace
}  // namespace odyssey::kernels
