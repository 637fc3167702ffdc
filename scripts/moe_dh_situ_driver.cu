// A prototype, not part of the CMake build and not yet run on a GPU (written in the eleventh
// session, which had no device time left): the routed experts' dH = dY W_down on wgmma with the
// SiTU-GLU backward in its epilogue, writing dG, dU and H (the forward's h, recomputed) where the
// backward now runs a grouped GEMM for dH (0.126 ms in the layer's bench) and then
// situ_glu_backward_with_h (0.122 ms). What it is to show, before it moves into
// kernels/moe_experts_sm90.cu behind moe_experts_autograd:
//   1. dH (the kernel storing dH alone) against fp64 sums on sampled elements;
//   2. the fused kernel's dG, dU, H bit for bit equal to situ_glu_backward_with_h (kernels/moe.cu)
//      run on that dH (the same bf16 dH, the same situ.cuh terms);
//   3. its time against the chain's (dH kernel + elementwise pass) at the small config's shapes.
// Last line `dh_situ_check: ok` when 1 and 2 hold.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -I. scripts/moe_dh_situ_driver.cu \
//        kernels/moe.cu -o /tmp/moe_dh_situ
//   /tmp/moe_dh_situ [tokens top_k experts L F]
//
// The kernel is moe_experts_dx_wgmma_kernel's structure (kernels/moe_experts_sm90.cu, whose
// helpers it uses: this file includes it) with A = dY (K = L) and B = W_down[e] ([L, F]: k rows, n
// contiguous, N-major), jobs (tile of rows) x (slice of 128 columns of F; the last slice half
// filled when F % 128 == 64: its B columns past F zero-filled, its stores skipped). The epilogue
// rounds each dH piece to bf16 (as the grouped GEMM's output is), then per element the accurate
// situ_terms / situ_d_gate / situ_d_up / situ_h on the tile's G and U, 16-byte loads and stores.
// Two CTAs an SM as dX, so one CTA's epilogue (~80 instructions an element) runs beside the
// other's products. The kernel body repeats moe_experts_dx_wgmma_kernel's but for its loaders and
// epilogue: when it lands, the two become one kernel templated on the problem (where A and B come
// from, what a finished tile becomes). That was tried in the eleventh session and left for then,
// since it changes dX's machine code (register allocation and predicates; scripts/sass_stats.py
// --dump), which then needs a GPU run the session did not have.
#include "kernels/moe.h"
#include "kernels/moe_experts_sm90.cu"
#include "kernels/situ.cuh"
#include "scripts/driver_timing.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace odyssey::kernels {
namespace {

struct DhArgs {
  const bf16* dy;         // [R, L]
  const bf16* down_proj;  // [E, L, F]
  const bf16* gate;
  const bf16* up;  // G, U [R, F] (the forward's)
  const int32_t* group_ends;
  bf16* dh;  // [R, F], the kernel storing dH alone
  bf16* d_gate;
  bf16* d_up;
  bf16* h;  // [R, F], the fused kernel
  int experts, latent, ffn, slices;
  float beta1, beta2;
};

template <bool kFused>
__global__ void __launch_bounds__(kAllThreads, 2) dh_situ_wgmma_kernel(DhArgs a) {
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
  const int jobs = tiles * a.slices, chunks = a.latent / 64;
  const int warp_id = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 5), 0), lane = threadIdx.x & 31;
  auto job_of = [&](int j, Tile& tile, int& n0) {
    const int t = j / a.slices;
    tile = find_tile<TileSplit::kFull>(t, tile_ends, a.group_ends, a.experts);
    n0 = (j - t * a.slices) * 128;
  };

  if (warp_id == kWeightWarp || warp_id == kRowsWarp) {
    const bool loads_a = warp_id == kWeightWarp;  // warp 8: A (dY rows); warp 9: B (W_down[e])
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
        if (loads_a) {
          // Lane l: piece l % 8 of rows l / 8 + 4 i; rows past the tile zero-filled.
          const bf16* rows = a.dy + k + (lane & 7) * 8;
#pragma unroll 8
          for (int i = 0; i < 32; ++i) {
            const int r = (lane >> 3) + 4 * i;
            const bool valid = r < tile.rows;
            const bf16* src = rows + static_cast<int64_t>(tile.first_row + (valid ? r : 0)) * a.latent;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(stage + swizzled(r, lane & 7)),
                         "l"(src), "r"(valid ? 16 : 0)
                         : "memory");
          }
        } else {
          // Lane l: piece l % 16 of W_down[e]'s rows k + l / 16 + 2 i; columns past F zero-filled.
          const int p = lane & 15;
          const bool valid = n0 + p * 8 < a.ffn;
          const bf16* w = a.down_proj + (static_cast<int64_t>(tile.expert) * a.latent + k) * a.ffn +
                          (valid ? n0 + p * 8 : 0);
          const uint32_t b = stage + kMatrixBytes + (p >> 3) * (kMatrixBytes / 2);
#pragma unroll 8
          for (int i = 0; i < 32; ++i) {
            const int kr = (lane >> 4) + 2 * i;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(b + swizzled(kr, p & 7)),
                         "l"(w + static_cast<int64_t>(kr) * a.ffn), "r"(valid ? 16 : 0)
                         : "memory");
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
        const uint4 piece = accumulator_piece(acc, half, q, tq);  // 8 columns of dH, bf16
        const int n = n0 + q * 32 + tq * 8;
        if (r >= tile.rows || n >= a.ffn) continue;
        const int64_t at = static_cast<int64_t>(tile.first_row + r) * a.ffn + n;
        if (!kFused) {
          *reinterpret_cast<uint4*>(a.dh + at) = piece;
          continue;
        }
        const uint4 g4 = *reinterpret_cast<const uint4*>(a.gate + at);
        const uint4 u4 = *reinterpret_cast<const uint4*>(a.up + at);
        const uint32_t dh_pairs[4] = {piece.x, piece.y, piece.z, piece.w};
        const uint32_t g_pairs[4] = {g4.x, g4.y, g4.z, g4.w};
        const uint32_t u_pairs[4] = {u4.x, u4.y, u4.z, u4.w};
        uint32_t dg_pairs[4], du_pairs[4], h_pairs[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 d = __bfloat1622float2(*reinterpret_cast<const bf162*>(&dh_pairs[i]));
          const float2 g = __bfloat1622float2(*reinterpret_cast<const bf162*>(&g_pairs[i]));
          const float2 u = __bfloat1622float2(*reinterpret_cast<const bf162*>(&u_pairs[i]));
          const SituTerms s0 = situ_terms(g.x, u.x, a.beta1, a.beta2);
          const SituTerms s1 = situ_terms(g.y, u.y, a.beta1, a.beta2);
          dg_pairs[i] = pack_bf16(situ_d_gate(s0, d.x), situ_d_gate(s1, d.y));
          du_pairs[i] = pack_bf16(situ_d_up(s0, d.x), situ_d_up(s1, d.y));
          h_pairs[i] = pack_bf16(situ_h(s0), situ_h(s1));
        }
        *reinterpret_cast<uint4*>(a.d_gate + at) = make_uint4(dg_pairs[0], dg_pairs[1], dg_pairs[2], dg_pairs[3]);
        *reinterpret_cast<uint4*>(a.d_up + at) = make_uint4(du_pairs[0], du_pairs[1], du_pairs[2], du_pairs[3]);
        *reinterpret_cast<uint4*>(a.h + at) = make_uint4(h_pairs[0], h_pairs[1], h_pairs[2], h_pairs[3]);
      }
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  }
#endif
}

template <bool kFused>
cudaError_t launch_dh(const DhArgs& a, int64_t total_rows) {
  int sms = 0;
  const cudaError_t error = prepare_launch(dh_situ_wgmma_kernel<kFused>, kDxSharedBytes, sms);
  if (error != cudaSuccess) return error;
  const int64_t max_jobs = (total_rows / kTileRows + a.experts) * a.slices;
  const int grid = static_cast<int>(max_jobs < 2 * sms ? max_jobs : 2 * sms);
  dh_situ_wgmma_kernel<kFused><<<grid, kAllThreads, kDxSharedBytes>>>(a);
  return cudaGetLastError();
}

double f(const __nv_bfloat16& x) { return static_cast<double>(__bfloat162float(x)); }

}  // namespace
}  // namespace odyssey::kernels

using namespace odyssey::kernels;

int main(int argc, char** argv) {
  const int64_t tokens = argc > 1 ? atoll(argv[1]) : 8192, top_k = argc > 2 ? atoll(argv[2]) : 16;
  const int64_t experts = argc > 3 ? atoll(argv[3]) : 896, L = argc > 4 ? atoll(argv[4]) : 384;
  const int64_t F = argc > 5 ? atoll(argv[5]) : 192;
  if (L % 128 != 0 || F % 64 != 0 || experts < 1 || experts > kMaxExperts) {
    std::fprintf(stderr, "L must be a multiple of 128, F of 64, experts 1 to %d\n", kMaxExperts);
    return 2;
  }
  const int64_t rows = tokens * top_k;
  std::mt19937 rng(11);
  const std::vector<int64_t> counts = uniform_routing_counts(tokens, top_k, experts, rng);
  std::vector<int32_t> routed(experts);
  int64_t sum = 0;
  for (int64_t e = 0; e < experts; ++e) routed[e] = static_cast<int32_t>(sum += counts[e]);
  const HostDevice dy = random_bf16(rows * L, 0.1f, rng), wd = random_bf16(experts * L * F, 0.07f, rng);
  const HostDevice gate = random_bf16(rows * F, 3.f, rng), up = random_bf16(rows * F, 3.f, rng);
  int32_t* ends = nullptr;
  cudaMalloc(&ends, experts * 4);
  cudaMemcpy(ends, routed.data(), experts * 4, cudaMemcpyHostToDevice);
  void *dh = nullptr, *dg = nullptr, *du = nullptr, *h = nullptr, *dg_ref = nullptr, *du_ref = nullptr,
       *h_ref = nullptr;
  for (void** p : {&dh, &dg, &du, &h, &dg_ref, &du_ref, &h_ref}) {
    cudaMalloc(p, rows * F * 2);
    cudaMemset(*p, 0xFF, rows * F * 2);  // NaN: an element left unwritten shows
  }
  DhArgs a{};
  a.dy = static_cast<const bf16*>(dy.device);
  a.down_proj = static_cast<const bf16*>(wd.device);
  a.gate = static_cast<const bf16*>(gate.device);
  a.up = static_cast<const bf16*>(up.device);
  a.group_ends = ends;
  a.dh = static_cast<bf16*>(dh);
  a.d_gate = static_cast<bf16*>(dg);
  a.d_up = static_cast<bf16*>(du);
  a.h = static_cast<bf16*>(h);
  a.experts = static_cast<int>(experts);
  a.latent = static_cast<int>(L);
  a.ffn = static_cast<int>(F);
  a.slices = static_cast<int>((F + 127) / 128);
  a.beta1 = 4.f;
  a.beta2 = 25.f;
  if (!moe_experts_dx_wgmma_supported(L, F, experts)) {  // the same device and shared memory needs
    std::printf("needs an sm_90 device\ndh_situ_check: FAILED\n");
    return 1;
  }
  cudaError_t error = launch_dh<false>(a, rows);
  if (error == cudaSuccess) {
    error = situ_glu_backward_with_h(MoeDtype::kBFloat16, gate.device, up.device, dh, dg_ref, du_ref, h_ref, rows * F,
                                     a.beta1, a.beta2, nullptr);
  }
  if (error == cudaSuccess) error = launch_dh<true>(a, rows);
  if (error == cudaSuccess) error = cudaDeviceSynchronize();
  std::vector<__nv_bfloat16> got_dh(rows * F), got[3], ref[3];
  cudaMemcpy(got_dh.data(), dh, rows * F * 2, cudaMemcpyDeviceToHost);
  void* outs[3] = {dg, du, h};
  void* refs[3] = {dg_ref, du_ref, h_ref};
  for (int i = 0; i < 3; ++i) {
    got[i].resize(rows * F), ref[i].resize(rows * F);
    cudaMemcpy(got[i].data(), outs[i], rows * F * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(ref[i].data(), refs[i], rows * F * 2, cudaMemcpyDeviceToHost);
  }
  // 1. dH against fp64 sums on 1024 sampled elements; no element unwritten.
  const int64_t covered = static_cast<int64_t>(routed.back()) * F;
  int64_t unwritten = 0;
  for (int64_t i = 0; i < covered; ++i) {
    unwritten += std::isnan(__bfloat162float(got_dh[i])) ? 1 : 0;
    for (int k = 0; k < 3; ++k) unwritten += std::isnan(__bfloat162float(got[k][i])) ? 1 : 0;
  }
  double worst = 0.0;
  std::uniform_int_distribution<int64_t> pick_r(0, rows - 1), pick_f(0, F - 1);
  for (int s = 0; s < 1024; ++s) {
    const int64_t r = pick_r(rng), fi = pick_f(rng);
    const int64_t e = std::upper_bound(routed.begin(), routed.end(), static_cast<int32_t>(r)) - routed.begin();
    if (e >= experts) continue;
    double total = 0, scale = 1e-30;
    for (int64_t l = 0; l < L; ++l) {
      const double t = f(dy.host[r * L + l]) * f(wd.host[(e * L + l) * F + fi]);
      total += t, scale += std::fabs(t);
    }
    worst = std::max(worst, std::fabs(f(got_dh[r * F + fi]) - total) / scale);
  }
  // 2. The fused outputs against the chain's, every element.
  int64_t differ[3] = {0, 0, 0};
  for (int k = 0; k < 3; ++k) {
    for (int64_t i = 0; i < covered; ++i) {
      differ[k] += __bfloat16_as_ushort(got[k][i]) != __bfloat16_as_ushort(ref[k][i]) ? 1 : 0;
    }
  }
  // 3. Times: dH alone, the elementwise pass, the fused kernel.
  const double flops = 2.0 * rows * L * F;
  const std::vector<float> dh_ms = time_launches([&] { launch_dh<false>(a, rows); });
  const std::vector<float> situ_ms = time_launches([&] {
    situ_glu_backward_with_h(MoeDtype::kBFloat16, gate.device, up.device, dh, dg_ref, du_ref, h_ref, rows * F,
                             a.beta1, a.beta2, nullptr);
  });
  const std::vector<float> fused_ms = time_launches([&] { launch_dh<true>(a, rows); });
  const cudaError_t sync = cudaDeviceSynchronize();
  std::printf("moe dH + SiTU-GLU backward: %ld rows (%ld tokens x %ld), %ld experts, L=%ld F=%ld\n",
              static_cast<long>(rows), static_cast<long>(tokens), static_cast<long>(top_k),
              static_cast<long>(experts), static_cast<long>(L), static_cast<long>(F));
  std::printf("  dH alone        best %.3f ms  median %.3f ms  %6.1f TFLOP/s\n", dh_ms[0], dh_ms[10],
              flops / (dh_ms[0] * 1e-3) / 1e12);
  std::printf("  elementwise     best %.3f ms  median %.3f ms  (situ_glu_backward_with_h)\n", situ_ms[0],
              situ_ms[10]);
  std::printf("  chain           best %.3f ms\n", dh_ms[0] + situ_ms[0]);
  std::printf("  fused           best %.3f ms  median %.3f ms  (%.2f of the chain)\n", fused_ms[0], fused_ms[10],
              fused_ms[0] / (dh_ms[0] + situ_ms[0]));
  std::printf("  dH vs fp64: max |err| / sum |terms| %.2e; unwritten %ld; fused vs chain: dG %ld, dU %ld, H %ld "
              "elements differ; %s\n",
              worst, static_cast<long>(unwritten), static_cast<long>(differ[0]), static_cast<long>(differ[1]),
              static_cast<long>(differ[2]), cudaGetErrorName(error != cudaSuccess ? error : sync));
  const bool ok = error == cudaSuccess && sync == cudaSuccess && unwritten == 0 && worst < 1e-2 &&
                  differ[0] == 0 && differ[1] == 0 && differ[2] == 0;
  std::printf("dh_situ_check: %s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
