// The routed experts' backward kernels (contracts: kernels/moe.h, "Routed experts' weight
// gradients" and "Routed experts' dX"; design and measurements: kernels/JOURNAL.md, "Routed
// experts' backward"): the three weight gradients in one kernel (here), and dX (further down,
// "dX = dG W_gate + dU W_up"). Both stage their output tiles for whole-row stores.
//
// Weight gradients. For expert e with rows [r0, r1) (group_ends), three sums over its rows of outer products:
//   dW_gate[e] = dG_e^T X_e  [F, L]     dW_up[e] = dU_e^T X_e  [F, L]     dW_down[e] = dY_e^T H_e  [L, F]
// each out[m][n] = sum_r A[r][m] B[r][n] with A and B row-major over the rows: both operands are
// k-major tiles, read as mma fragments by ldmatrix.trans.
//
// Jobs are 128 x 128 tiles of the outputs, a fixed number per expert, so job j belongs to expert
// j / jobs_per_expert and no schedule has to be built:
//   gate / up: m over [dG | dU] (2F columns: whole tiles, F % 64 == 0; a tile may hold the last
//              64 columns of dG and the first 64 of dU), n over L: (2F / 128) (L / 128) jobs;
//   down:      m over L, n over F (the last tile half filled when F % 128 == 64):
//              (L / 128) ceil(F / 128) jobs.
// Persistent CTAs (two per SM). Every CTA sorts the experts by rows (most first) in shared memory,
// and the jobs in that order are dealt out in rounds of gridDim.x, snaking (CTA b takes the b-th
// of even rounds, the b-th from the end of odd ones): the few experts that routing gives many
// rows no longer decide the kernel's end. A job's rows stream in
// chunks of 32 (A and B: 32 x 128 bf16 each) through a ring of kStages buffers filled by
// cp.async, one barrier a chunk, and the stream runs on from one job into the next, so the
// pipeline never drains between jobs. Rows past the expert's end are zero-filled in both
// operands; the second k16 step of a chunk is skipped when all its rows are past the end. 8
// warps: warp w takes the n quarter w % 4 (its SM sub-partition) and the m half w / 4: 64 x 32,
// 4 x 4 mma tiles, 64 fp32 accumulators; a quarter wholly past F (the half-filled down tile)
// skips its products and stores. The fp32 sums are rounded once to bf16; an expert without rows
// gets zeros (its jobs have no chunks).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/mma.cuh"
#include "kernels/moe.h"
#include "kernels/moe_experts_sm90.h"
#include "kernels/moe_tiles.cuh"

namespace odyssey::kernels {
namespace {

using bf16 = __nv_bfloat16;
using bf162 = __nv_bfloat162;

constexpr int kThreads = 256;                        // 8 warps: 4 n quarters x 2 m halves
constexpr int kTile = 128;                           // a job: 128 x 128 of one output
constexpr int kChunk = 32;                           // rows a chunk
constexpr int kStride = kTile + 8;                   // bf16 a shared row (ldmatrix: 8 rows in
                                                     // distinct banks)
constexpr int kOperandElements = kChunk * kStride;   // one operand of one chunk
constexpr int kStageElements = 2 * kOperandElements; // A then B
constexpr int kStages = 4;
constexpr int kStagingElements = kTile * kStride;   // the output tile, for whole-row stores
constexpr size_t kSharedBytes =
    (size_t{kStages} * kStageElements + kStagingElements) * sizeof(bf16);  // 104 KB: two CTAs an SM

// The CTA's k-th job, in the order of `order` (experts by rows, most first): rounds of gridDim.x
// jobs, CTA b taking the b-th of even rounds and the b-th from the end of odd ones (a snake, so
// that no CTA takes the largest job of every round); -1 past the last job.
__device__ int job_at(int k, int jobs) {
  const int b = (k & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int j = k * gridDim.x + b;
  return j < jobs ? j : -1;
}

// The loading side of the chunk stream, per thread: its four 16-byte pieces of a chunk are rows
// rho and rho + 16, columns col .. col + 7, of A and of B.
struct Feed {
  int k = 0;  // the CTA's job (job_at) whose chunk is issued next (>= rounds: the stream has ended)
  int chunk = 0, chunks = 0;
  int first_row = 0, rows = 0;
  const bf16* a = nullptr;  // this thread's column of A at row 0, and the row stride
  const bf16* b = nullptr;
  int a_stride = 0, b_stride = 0;
  bool b_valid = false;  // its B column is inside the output (false past F in a down tile)
};

__device__ void start_job(Feed& f, const GradArgs& a, const int* order, int j, int col) {
  const GradJob job = grad_job(j, a, order);
  f.chunk = 0;
  f.chunks = (job.rows + kChunk - 1) / kChunk;
  f.first_row = job.first_row;
  f.rows = job.rows;
  const int m = job.m0 + col, n = job.n0 + col;
  if (job.down) {
    f.a = a.dy + m, f.a_stride = a.latent;
    f.b_valid = n < a.ffn;
    f.b = a.h + (f.b_valid ? n : 0), f.b_stride = a.ffn;
  } else {
    f.a = m < a.ffn ? a.d_gate + m : a.d_up + (m - a.ffn), f.a_stride = a.ffn;
    f.b = a.rows + n, f.b_stride = a.latent, f.b_valid = true;
  }
}

// Moves f to its next chunk, past jobs without rows.
__device__ void seek(Feed& f, const GradArgs& a, const int* order, int rounds, int col) {
  while (f.chunk >= f.chunks) {
    if (++f.k >= rounds) return;
    const int j = job_at(f.k, a.jobs);
    if (j >= 0) start_job(f, a, order, j, col);
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

// A warp's 64 x 32 of accumulators (its first `blocks` m16 blocks; rows 64 wr .., columns
// 32 wq ..), rounded once to bf16, into the 128 x 128 staging tile.
__device__ __forceinline__ void stage_accumulators(bf16* staging, const float (&acc)[4][4][4], int blocks,
                                                   int lane, int wq, int wr) {
  const int gq = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
    if (mi >= blocks) break;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      bf16* row = staging + (wr * 64 + mi * 16 + gq + half * 8) * kStride + wq * 32 + 2 * tq;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        *reinterpret_cast<bf162*>(row + nt * 8) =
            __floats2bfloat162_rn(acc[mi][nt][2 * half], acc[mi][nt][2 * half + 1]);
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads, 2) moe_experts_weight_grads_kernel(GradArgs a) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  bf16* ring = reinterpret_cast<bf16*>(shared_bytes);
  bf16* staging = ring + kStages * kStageElements;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wq = warp & 3, wr = warp >> 2;
  // This lane's ldmatrix.trans addresses in ring slot 0, k step 0. A (rows = k, cols = m): the
  // four 8 x 8 matrices (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15) of the
  // warp's m block 0 (blocks mi are 16 columns = 32 bytes apart). B (rows = k, cols = n): {b0, b1}
  // of n-tile 0, then of n-tile 1, for the pair q of the warp's n quarter (q: 32 bytes apart).
  const int r8 = lane & 7, matrix = lane >> 3;
  const uint32_t ring_address = shared_address(ring);
  const uint32_t a_frag =
      ring_address + ((r8 + (matrix >> 1) * 8) * kStride + wr * 64 + (matrix & 1) * 8) * 2;
  const uint32_t b_frag = ring_address +
                          (kOperandElements + (r8 + (matrix & 1) * 8) * kStride + wq * 32 + (matrix >> 1) * 8) * 2;
  constexpr uint32_t kSlotBytes = kStageElements * sizeof(bf16);
  constexpr uint32_t kK16Bytes = 16 * kStride * sizeof(bf16);
  // This thread's pieces of every chunk.
  const int rho = threadIdx.x >> 4, col = (threadIdx.x & 15) * 8;

  __shared__ int order[kMaxExperts];
  sort_experts<kThreads>(a.group_ends, a.experts, reinterpret_cast<uint64_t*>(ring), order);  // ring: not yet in use
  const int rounds = (a.jobs + gridDim.x - 1) / gridDim.x;
  Feed feed;
  feed.k = -1;
  seek(feed, a, order, rounds, col);
  int issued = 0;
  auto issue = [&] {
    if (feed.k < rounds) {
      bf16* dst = ring + (issued % kStages) * kStageElements + rho * kStride + col;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = feed.chunk * kChunk + rho + half * 16;
        const bool valid = r < feed.rows;
        const int64_t row = feed.first_row + (valid ? r : 0);
        cp_async16_or_zero(dst + half * 16 * kStride, feed.a + row * feed.a_stride, valid);
        cp_async16_or_zero(dst + kOperandElements + half * 16 * kStride, feed.b + row * feed.b_stride,
                           valid && feed.b_valid);
      }
      ++issued;
      ++feed.chunk;
      seek(feed, a, order, rounds, col);
    }
    cp_async_commit();  // possibly empty: keeps the wait counts uniform
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue();

  float acc[4][4][4];
  int consumed = 0;
  for (int k = 0; k < rounds; ++k) {
    const int j = job_at(k, a.jobs);
    if (j < 0) continue;
    const GradJob job = grad_job(j, a, order);
    const bool live = !job.down || job.n0 + wq * 32 < a.ffn;  // warp-uniform
    const int chunks = (job.rows + kChunk - 1) / kChunk;
    zero(acc);
    for (int c = 0; c < chunks; ++c) {
      cp_async_wait<kStages - 2>();
      __syncthreads();
      issue();
      const uint32_t slot = (consumed % kStages) * kSlotBytes;
      ++consumed;
      if (!live) continue;
      const int k_steps = c * kChunk + 16 < job.rows ? 2 : 1;
      for (int kk = 0; kk < k_steps; ++kk) {
        uint32_t af[4][4], bfr[2][4];
#pragma unroll
        for (int q = 0; q < 2; ++q) ldmatrix_x4_trans_at(bfr[q], b_frag + slot + kk * kK16Bytes + q * 32);
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) ldmatrix_x4_trans_at(af[mi], a_frag + slot + kk * kK16Bytes + mi * 32);
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            mma(acc[mi][2 * q], af[mi], bfr[q][0], bfr[q][1]);
            mma(acc[mi][2 * q + 1], af[mi], bfr[q][2], bfr[q][3]);
          }
        }
      }
    }
    // Round once into the staging tile, then store it in whole rows of 16-byte pieces (the
    // accumulators' own layout would write 4 bytes a lane, half of every 32-byte sector). A job
    // with chunks passed a barrier since the last job's stores read the staging tile; one without
    // (an expert without rows) waits here.
    if (chunks == 0) __syncthreads();
    if (live) stage_accumulators(staging, acc, 4, lane, wq, wr);
    __syncthreads();
    // Row m of the tile is a row of dW_gate / dW_up (m < F / m >= F) or of dW_down; its columns
    // past F (a half-filled down tile) are not stored. The staging tile is written again only
    // after the next job's first barrier.
    const int width = job.down ? a.ffn : a.latent;
    if (job.n0 + col < width) {
#pragma unroll
      for (int i = 0; i < kTile * kTile / 8 / kThreads; ++i) {
        const int r = rho + i * (kThreads / 16), m = job.m0 + r;
        void* out;
        int64_t out_row;
        if (job.down) {
          out = a.d_down_proj, out_row = int64_t{job.expert} * a.latent + m;
        } else if (m < a.ffn) {
          out = a.d_gate_proj, out_row = int64_t{job.expert} * a.ffn + m;
        } else {
          out = a.d_up_proj, out_row = int64_t{job.expert} * a.ffn + m - a.ffn;
        }
        *reinterpret_cast<uint4*>(static_cast<bf16*>(out) + out_row * width + job.n0 + col) =
            *reinterpret_cast<const uint4*>(staging + r * kStride + col);
      }
    }
  }
  cp_async_wait<0>();
}

// ---- dX = dG W_gate + dU W_up ---------------------------------------------------------------------
// Jobs: (tile of at most 128 rows of one expert, moe_tiles.cuh) x (slice of 128 columns of L); the
// slices of a tile are consecutive jobs, so CTAs running side by side share its rows in L2. A
// job's K = 2F ([dG | dU] against [W_gate; W_up]) streams in chunks of 32: A = 128 rows x 32 of
// dG or dU (k-contiguous rows: ldmatrix), B = 32 rows of W_gate[e] or W_up[e] x the slice's 128
// columns (n-contiguous: ldmatrix.trans), through a ring of kStages, one barrier a chunk, the
// stream running on from one job into the next. Warps as above (n quarter w % 4, rows 64 (w / 4)
// .. + 64, m16 blocks past the tile's rows skipped). The fp32 sums are rounded once to bf16 and
// staged for whole-row stores.
constexpr int kDxK = 32;                              // k of a chunk
constexpr int kDxAStride = kDxK + 8;                  // A: 128 rows x 32 (+8: ldmatrix banks)
constexpr int kDxAElements = kTileRows * kDxAStride;
constexpr int kDxBElements = kDxK * kStride;          // B: 32 rows x 128 (+8)
constexpr int kDxStageElements = kDxAElements + kDxBElements;
constexpr size_t kDxSharedBytes =
    (size_t{kStages} * kDxStageElements + kStagingElements) * sizeof(bf16);  // 110.6 KB


struct DxFeed {
  int j = 0;  // the job whose chunk is issued next (>= jobs: the stream has ended)
  int chunk = 0;
  Tile tile{0, 0, 0};
  int n0 = 0;
};

__global__ void __launch_bounds__(kThreads, 2) moe_experts_dx_kernel(DxArgs a) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  __shared__ int tile_ends[kMaxExperts];
  bf16* ring = reinterpret_cast<bf16*>(shared_bytes);
  bf16* staging = ring + kStages * kDxStageElements;
  const int tiles = build_tile_schedule<kThreads>(a.group_ends, a.experts, tile_ends);
  const int jobs = tiles * a.slices, chunks = 2 * a.ffn / kDxK;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wq = warp & 3, wr = warp >> 2;
  const FragmentOffsets f(lane);
  const uint32_t ring_address = shared_address(ring);
  const uint32_t a_frag = ring_address + ((wr * 64 + f.a_row) * kDxAStride + f.a_col) * 2;
  const uint32_t b_frag = ring_address + (kDxAElements + f.t_row * kStride + wq * 32 + f.t_col) * 2;
  constexpr uint32_t kSlotBytes = kDxStageElements * sizeof(bf16);
  // This thread's pieces of a chunk: A rows ar, ar + 64 at column ac; B rows br, br + 16 at bc.
  const int ar = threadIdx.x >> 2, ac = (threadIdx.x & 3) * 8;
  const int br = threadIdx.x >> 4, bc = (threadIdx.x & 15) * 8;

  DxFeed feed;
  auto start = [&](int j) {
    feed.j = j;
    feed.chunk = 0;
    if (j < jobs) {
      const int t = j / a.slices;
      feed.tile = find_tile(t, tile_ends, a.group_ends, a.experts);
      feed.n0 = (j - t * a.slices) * kTile;
    }
  };
  start(blockIdx.x);
  int issued = 0;
  auto issue = [&] {
    if (feed.j < jobs) {
      bf16* slot = ring + (issued % kStages) * kDxStageElements;
      const int k = feed.chunk * kDxK;
      const bool gate = k < a.ffn;  // F % 64 == 0: a chunk is all dG or all dU
      const bf16* rows = gate ? a.d_gate : a.d_up;
      const int kf = gate ? k : k - a.ffn;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = ar + i * 64;
        const bool valid = r < feed.tile.rows;
        cp_async16_or_zero(slot + r * kDxAStride + ac,
                           rows + int64_t{feed.tile.first_row + (valid ? r : 0)} * a.ffn + kf + ac, valid);
      }
      const bf16* w = (gate ? a.gate_proj : a.up_proj) +
                      (int64_t{feed.tile.expert} * a.ffn + kf) * a.latent + feed.n0 + bc;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = br + i * 16;
        cp_async16(slot + kDxAElements + r * kStride + bc, w + int64_t{r} * a.latent);
      }
      ++issued;
      if (++feed.chunk == chunks) start(feed.j + gridDim.x);
    }
    cp_async_commit();  // possibly empty: keeps the wait counts uniform
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue();

  float acc[4][4][4];
  int consumed = 0;
  for (int j = blockIdx.x; j < jobs; j += gridDim.x) {
    const int t = j / a.slices;
    const Tile tile = find_tile(t, tile_ends, a.group_ends, a.experts);
    const int n0 = (j - t * a.slices) * kTile;
    const int blocks = min(4, max(0, (tile.rows - wr * 64 + 15) / 16));  // warp-uniform
    zero(acc);
    for (int c = 0; c < chunks; ++c) {
      cp_async_wait<kStages - 2>();
      __syncthreads();
      issue();
      const uint32_t slot = (consumed % kStages) * kSlotBytes;
      ++consumed;
#pragma unroll
      for (int kk = 0; kk < kDxK / 16; ++kk) {
        uint32_t af[4][4], bfr[2][4];
#pragma unroll
        for (int q = 0; q < 2; ++q) ldmatrix_x4_trans_at(bfr[q], b_frag + slot + kk * 16 * kStride * 2 + q * 32);
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) ldmatrix_x4_at(af[mi], a_frag + slot + (mi * 16 * kDxAStride + kk * 16) * 2);
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) {
          if (mi < blocks) {
#pragma unroll
            for (int q = 0; q < 2; ++q) {
              mma(acc[mi][2 * q], af[mi], bfr[q][0], bfr[q][1]);
              mma(acc[mi][2 * q + 1], af[mi], bfr[q][2], bfr[q][3]);
            }
          }
        }
      }
    }
    stage_accumulators(staging, acc, blocks, lane, wq, wr);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kTile * kTile / 8 / kThreads; ++i) {
      const int r = br + i * (kThreads / 16);
      if (r < tile.rows) {
        *reinterpret_cast<uint4*>(a.dx + int64_t{tile.first_row + r} * a.latent + n0 + bc) =
            *reinterpret_cast<const uint4*>(staging + r * kStride + bc);
      }
    }
  }
  cp_async_wait<0>();
}

// The widths and expert counts both kernels take: L a multiple of 128, F of 64, 1 to 1024 experts
// (the schedules in shared memory), E L F < 2^31 (int offsets into the weights).
bool widths_supported(int64_t latent, int64_t ffn, int64_t experts) {
  return latent >= kTile && latent % kTile == 0 && ffn >= 64 && ffn % 64 == 0 && experts >= 1 &&
         experts <= kMaxExperts && experts * latent * ffn < (int64_t{1} << 31);
}

}  // namespace

bool moe_experts_weight_grads_supported(int64_t latent, int64_t ffn, int64_t experts) {
  if (!widths_supported(latent, ffn, experts)) return false;
  const int64_t per_expert = (2 * ffn / kTile) * (latent / kTile) + (latent / kTile) * ((ffn + kTile - 1) / kTile);
  if (experts * per_expert >= (int64_t{1} << 31)) return false;
  return device_fits(kSharedBytes + kMaxExperts * sizeof(int), DeviceNeed::kSm80OrNewer);  // + the sorted experts
}

cudaError_t moe_experts_weight_grads(const void* rows, const void* d_gate, const void* d_up,
                                     const void* dy, const void* h, const int32_t* group_ends,
                                     void* d_gate_proj, void* d_up_proj, void* d_down_proj,
                                     int64_t total_rows, int64_t experts, int64_t latent,
                                     int64_t ffn, cudaStream_t stream, MoeExpertsKernel kernel,
                                     bool fp32_outputs) {
  const bool wgmma = moe_experts_weight_grads_wgmma_supported(latent, ffn, experts);
  if (kernel == MoeExpertsKernel::kWgmma || (kernel == MoeExpertsKernel::kAuto && wgmma)) {
    return moe_experts_weight_grads_wgmma(rows, d_gate, d_up, dy, h, group_ends, d_gate_proj, d_up_proj,
                                          d_down_proj, total_rows, experts, latent, ffn, stream, fp32_outputs);
  }
  if (fp32_outputs) return cudaErrorInvalidValue;  // the wgmma kernel's alone
  if (!moe_experts_weight_grads_supported(latent, ffn, experts) ||
      !grad_arguments_valid(rows, d_gate, d_up, dy, h, group_ends, d_gate_proj, d_up_proj, d_down_proj, total_rows)) {
    return cudaErrorInvalidValue;
  }
  if (d_gate_proj == nullptr && d_down_proj == nullptr) return cudaSuccess;
  const GradArgs a = grad_args(rows, d_gate, d_up, dy, h, group_ends, d_gate_proj, d_up_proj, d_down_proj, experts,
                               latent, ffn);
  int sms = 0;
  const cudaError_t error = prepare_launch(moe_experts_weight_grads_kernel, kSharedBytes, sms);
  if (error != cudaSuccess) return error;
  const int grid = a.jobs < 2 * sms ? a.jobs : 2 * sms;
  moe_experts_weight_grads_kernel<<<grid, kThreads, kSharedBytes, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace odyssey::kernels

namespace odyssey::kernels {

bool moe_experts_dx_supported(int64_t latent, int64_t ffn, int64_t experts) {
  constexpr size_t kSchedule = (kMaxExperts + kThreads / 32) * sizeof(int);  // the tile schedule
  return widths_supported(latent, ffn, experts) && device_fits(kDxSharedBytes + kSchedule, DeviceNeed::kSm80OrNewer);
}

cudaError_t moe_experts_dx(const void* d_gate, const void* d_up, const void* gate_proj,
                           const void* up_proj, const int32_t* group_ends, void* dx,
                           int64_t total_rows, int64_t experts, int64_t latent, int64_t ffn,
                           cudaStream_t stream, MoeExpertsKernel kernel) {
  const bool wgmma = moe_experts_dx_wgmma_supported(latent, ffn, experts);
  if (kernel == MoeExpertsKernel::kWgmma || (kernel == MoeExpertsKernel::kAuto && wgmma)) {
    return moe_experts_dx_wgmma(d_gate, d_up, gate_proj, up_proj, group_ends, dx, total_rows, experts, latent,
                                ffn, stream);
  }
  if (!moe_experts_dx_supported(latent, ffn, experts) ||
      !dx_arguments_valid(d_gate, d_up, gate_proj, up_proj, group_ends, dx, total_rows)) {
    return cudaErrorInvalidValue;
  }
  if (total_rows == 0) return cudaSuccess;  // an empty batch: nothing to read or write
  const DxArgs a = dx_args(d_gate, d_up, gate_proj, up_proj, group_ends, dx, experts, latent, ffn);
  int sms = 0;
  const cudaError_t error = prepare_launch(moe_experts_dx_kernel, kDxSharedBytes, sms);
  if (error != cudaSuccess) return error;
  // At most one tile per 128 rows plus one partial tile per expert.
  const int64_t max_jobs = (total_rows / kTileRows + experts) * a.slices;
  const int grid = static_cast<int>(max_jobs < 2 * sms ? max_jobs : 2 * sms);
  moe_experts_dx_kernel<<<grid, kThreads, kDxSharedBytes, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace odyssey::kernels
