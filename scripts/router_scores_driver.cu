// A prototype, not part of the CMake build and not yet run on a GPU (written in the eleventh
// session, which had no device time left): the router's scores s = sigmoid(x W_r^T) in one wgmma
// kernel, fp32-faithful as router_logits_autograd (kernels/moe_autograd.h) is: W_r (fp32) split
// into three bf16 parts (hi, mid, lo: all 24 bits of its mantissa), x bf16, every product exact and
// the three parts' products summed into one fp32 accumulator, the sigmoid in the epilogue. Where the
// layer now runs three split GEMMs (one `mm` and two `addmm` into an fp32 [m, n], each reading and
// writing it) and a separate sigmoid: 0.18 ms in the layer's bench at 8K tokens, 0.084 of it the
// GEMMs. What it is to show, before it moves into kernels/ (behind MoeImpl::route's scores computed
// without a tape):
//   1. s against fp64 on sampled elements, to the fp32 GEMM's accuracy;
//   2. s against the current path (cuBLAS: the three bf16 GEMMs with fp32 results accumulated, as
//      at::mm / at::addmm run them, then 1 / (1 + exp(-l))), every element;
//   3. its time against that path's.
// Last line `router_scores_check: ok` when 1 and 2 hold.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -I. scripts/router_scores_driver.cu \
//        -lcublas -o /tmp/router_scores
//   /tmp/router_scores [tokens experts hidden]      (defaults: 8192 896 1024, the small config)
//
// The kernel: jobs are 128 tokens x 128 experts (the 7 expert tiles of a token tile consecutive, so
// the CTAs side by side share its rows in L2), K in chunks of 64. A stage is the chunk's x (128 x
// 64, K-major, as the experts' forward's X) and the three parts' W_r rows (128 experts x 64 each,
// K-major): 64 KB, three stages, one CTA an SM. Warps 0-7 are two consumer warpgroups (tokens 0-63,
// 64-127 of the tile: 12 wgmma.m64n128k16 a chunk, all three parts into one accumulator); warp 8
// loads x and part hi, warp 9 parts mid and lo; mbarriers as in kernels/moe_experts_sm90.cu (whose
// helpers this file uses: it includes it). Tokens past m and experts past n are zero-filled and not
// stored.
#include "kernels/moe_experts_sm90.cu"
#include "kernels/situ.cuh"
#include "scripts/driver_timing.cuh"

#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace odyssey::kernels {
namespace {

constexpr int kRouterStages = 3;
constexpr int kRouterStageBytes = 4 * kMatrixBytes;  // x, then W_r's three parts
constexpr size_t kRouterSharedBytes = size_t{kRouterStages} * kRouterStageBytes + 1024;

struct RouterArgs {
  const bf16* tokens;  // [m, k]
  const bf16* parts;   // [3, n, k]: W_r's hi, mid, lo
  float* scores;       // [m, n]
  int m, n, k;
  int expert_tiles, jobs;
};

// Loads rows r0 .. r0 + 127 (those < limit; the rest zero-filled) of a row-major [*, k] bf16 matrix,
// columns k0 .. k0 + 63, into one swizzled 128 x 64 matrix: lane l takes piece l % 8 of rows l / 8 + 4 i.
__device__ __forceinline__ void load_rows(uint32_t dst, const bf16* matrix, int r0, int limit, int k, int k0,
                                          int lane) {
  const bf16* column = matrix + k0 + (lane & 7) * 8;
#pragma unroll 8
  for (int i = 0; i < 32; ++i) {
    const int r = (lane >> 3) + 4 * i;
    const bool valid = r0 + r < limit;
    const bf16* src = column + static_cast<int64_t>(valid ? r0 + r : 0) * k;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst + swizzled(r, lane & 7)), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
  }
}

__global__ void __launch_bounds__(kAllThreads, 1) router_scores_wgmma_kernel(RouterArgs a) {
#if defined(ODYSSEY_NO_WGMMA)
  __trap();
#else
  extern __shared__ unsigned char shared_bytes[];
  __shared__ __align__(8) uint64_t barriers[2 * kRouterStages];
  const uint32_t stages = (shared_address(shared_bytes) + 1023u) & ~1023u;
  const uint32_t full = shared_address(&barriers[0]), empty = shared_address(&barriers[kRouterStages]);
  init_ring<kRouterStages>(full, empty);
  __syncthreads();
  const int chunks = a.k / 64;
  const int warp_id = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 5), 0), lane = threadIdx.x & 31;
  const int64_t part_stride = static_cast<int64_t>(a.n) * a.k;

  if (warp_id == kWeightWarp || warp_id == kRowsWarp) {
    int position = 0;
    for (int j = blockIdx.x; j < a.jobs; j += gridDim.x) {
      const int m0 = (j / a.expert_tiles) * 128, n0 = (j % a.expert_tiles) * 128;
      for (int c = 0; c < chunks; ++c, ++position) {
        const int slot = position % kRouterStages;
        mbarrier_wait(empty + 8 * slot, ((position / kRouterStages) & 1) ^ 1);
        const uint32_t stage = stages + slot * kRouterStageBytes;
        if (warp_id == kWeightWarp) {
          load_rows(stage, a.tokens, m0, a.m, a.k, c * 64, lane);
          load_rows(stage + kMatrixBytes, a.parts, n0, a.n, a.k, c * 64, lane);
        } else {
          load_rows(stage + 2 * kMatrixBytes, a.parts + part_stride, n0, a.n, a.k, c * 64, lane);
          load_rows(stage + 3 * kMatrixBytes, a.parts + 2 * part_stride, n0, a.n, a.k, c * 64, lane);
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
  for (int j = blockIdx.x; j < a.jobs; j += gridDim.x) {
    const int m0 = (j / a.expert_tiles) * 128, n0 = (j % a.expert_tiles) * 128;
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    auto issue = [&](uint32_t stage, int) {
#pragma unroll
      for (int part = 0; part < 3; ++part) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          wgmma_m64n128k16(acc, descriptor(stage + warpgroup * 64 * kRowBytes + kk * 32),
                           descriptor(stage + (1 + part) * kMatrixBytes + kk * 32));
        }
      }
    };
    consume_chunks<kRouterStages, kRouterStageBytes>(stages, full, empty, chunks, position, lane, issue);
    // s = 1 / (1 + exp(-l)), fp32, two adjacent experts a store (8 bytes; a quad covers 32).
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int m = m0 + warpgroup * 64 + warp * 16 + gq + half * 8;
      if (m >= a.m) continue;
      float* row = a.scores + static_cast<int64_t>(m) * a.n;
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        const int n = n0 + nt * 8 + 2 * tq;
        if (n < a.n) {
          *reinterpret_cast<float2*>(row + n) =
              make_float2(sigmoid_f32(acc[4 * nt + 2 * half]), sigmoid_f32(acc[4 * nt + 2 * half + 1]));
        }
      }
    }
  }
#endif
}

cudaError_t router_scores_wgmma(const bf16* tokens, const bf16* parts, float* scores, int m, int n, int k) {
  if (m < 1 || n < 2 || n % 2 != 0 || k < 64 || k % 64 != 0) return cudaErrorInvalidValue;
  int sms = 0;
  const cudaError_t error = prepare_launch(router_scores_wgmma_kernel, kRouterSharedBytes, sms);
  if (error != cudaSuccess) return error;
  RouterArgs a;
  a.tokens = tokens, a.parts = parts, a.scores = scores, a.m = m, a.n = n, a.k = k;
  a.expert_tiles = (n + 127) / 128;
  a.jobs = ((m + 127) / 128) * a.expert_tiles;
  router_scores_wgmma_kernel<<<a.jobs < sms ? a.jobs : sms, kAllThreads, kRouterSharedBytes>>>(a);
  return cudaGetLastError();
}

// The current path's sigmoid after the GEMMs.
__global__ void sigmoid_kernel(const float* logits, float* scores, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    scores[i] = sigmoid_f32(logits[i]);
  }
}

}  // namespace
}  // namespace odyssey::kernels

using namespace odyssey::kernels;

int main(int argc, char** argv) {
  const int m = argc > 1 ? atoi(argv[1]) : 8192, n = argc > 2 ? atoi(argv[2]) : 896;
  const int k = argc > 3 ? atoi(argv[3]) : 1024;
  if (m < 1 || n < 2 || n % 2 != 0 || k < 64 || k % 64 != 0) {
    std::fprintf(stderr, "tokens >= 1, experts even, hidden a multiple of 64\n");
    return 2;
  }
  std::mt19937 rng(5);
  const HostDevice x = random_bf16(static_cast<size_t>(m) * k, 1.f, rng);
  // W_r fp32 (uniform in +-1/sqrt(k), as model/moe.cpp initializes it), split on the host into hi,
  // mid, lo: hi = bf16(w), mid = bf16(w - hi), lo = bf16(w - hi - mid) (exact: w = hi + mid + lo).
  std::vector<float> w(static_cast<size_t>(n) * k);
  std::uniform_real_distribution<float> uniform(-1.f / std::sqrt(float(k)), 1.f / std::sqrt(float(k)));
  for (float& v : w) v = uniform(rng);
  std::vector<__nv_bfloat16> parts(3 * w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    const __nv_bfloat16 hi = __float2bfloat16(w[i]);
    const __nv_bfloat16 mid = __float2bfloat16(w[i] - __bfloat162float(hi));
    const __nv_bfloat16 lo = __float2bfloat16(w[i] - __bfloat162float(hi) - __bfloat162float(mid));
    parts[i] = hi, parts[w.size() + i] = mid, parts[2 * w.size() + i] = lo;
  }
  void *parts_d = nullptr, *scores = nullptr, *logits = nullptr, *reference = nullptr;
  cudaMalloc(&parts_d, parts.size() * 2);
  cudaMemcpy(parts_d, parts.data(), parts.size() * 2, cudaMemcpyHostToDevice);
  const size_t out = static_cast<size_t>(m) * n;
  cudaMalloc(&scores, out * 4), cudaMalloc(&logits, out * 4), cudaMalloc(&reference, out * 4);
  cudaMemset(scores, 0xFF, out * 4);  // NaN: an element left unwritten shows
  const bf16* tokens = static_cast<const bf16*>(x.device);
  const bf16* w_parts = static_cast<const bf16*>(parts_d);

  cublasHandle_t handle;
  cublasCreate(&handle);
  // The current path: l = x hi^T; l += x mid^T; l += x lo^T (fp32 results); s = sigmoid(l).
  auto current = [&] {
    const float one = 1.f, zero = 0.f;
    for (int p = 0; p < 3; ++p) {
      cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w_parts + static_cast<size_t>(p) * n * k,
                   CUDA_R_16BF, k, tokens, CUDA_R_16BF, k, p == 0 ? &zero : &one, logits, CUDA_R_32F, n,
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    }
    sigmoid_kernel<<<132 * 8, 256>>>(static_cast<const float*>(logits), static_cast<float*>(reference),
                                     static_cast<int64_t>(out));
  };
  current();
  cudaError_t error = router_scores_wgmma(tokens, w_parts, static_cast<float*>(scores), m, n, k);
  if (error == cudaSuccess) error = cudaDeviceSynchronize();
  std::vector<float> got(out), ref(out);
  cudaMemcpy(got.data(), scores, out * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(ref.data(), reference, out * 4, cudaMemcpyDeviceToHost);
  // 1. Against fp64 on 4096 sampled elements: |s - s64| over sigma'-scaled sum |terms| (the fp32
  // GEMM's own error is ~sqrt(k) 2^-24 of that), for both paths.
  double worst = 0.0, worst_current = 0.0;
  std::uniform_int_distribution<int> pick_m(0, m - 1), pick_n(0, n - 1);
  for (int s = 0; s < 4096; ++s) {
    const int i = pick_m(rng), e = pick_n(rng);
    double l = 0.0, scale = 1e-30;
    for (int c = 0; c < k; ++c) {
      const double t = static_cast<double>(__bfloat162float(x.host[static_cast<size_t>(i) * k + c])) *
                       static_cast<double>(w[static_cast<size_t>(e) * k + c]);
      l += t, scale += std::fabs(t);
    }
    const double s64 = 1.0 / (1.0 + std::exp(-l));
    const double slope = s64 * (1.0 - s64) * scale + 1e-30;
    worst = std::max(worst, std::fabs(got[static_cast<size_t>(i) * n + e] - s64) / slope);
    worst_current = std::max(worst_current, std::fabs(ref[static_cast<size_t>(i) * n + e] - s64) / slope);
  }
  // 2. Against the current path, every element.
  int64_t unwritten = 0;
  double most = 0.0;
  for (size_t i = 0; i < out; ++i) {
    if (std::isnan(got[i])) {
      ++unwritten;
      continue;
    }
    most = std::max(most, static_cast<double>(std::fabs(got[i] - ref[i])));
  }
  // 3. Times.
  const double flops = 3.0 * 2.0 * m * n * k;
  const std::vector<float> current_ms = time_launches(current);
  const std::vector<float> fused_ms =
      time_launches([&] { router_scores_wgmma(tokens, w_parts, static_cast<float*>(scores), m, n, k); });
  const cudaError_t sync = cudaDeviceSynchronize();
  std::printf("router scores: %d tokens x %d experts, hidden %d, W_r in three bf16 parts: %.1f GFLOP\n", m, n, k,
              flops / 1e9);
  std::printf("  current (3 cuBLAS GEMMs + sigmoid)  best %.3f ms  median %.3f ms  %6.1f TFLOP/s\n", current_ms[0],
              current_ms[10], flops / (current_ms[0] * 1e-3) / 1e12);
  std::printf("  wgmma, one kernel                   best %.3f ms  median %.3f ms  %6.1f TFLOP/s  (%.2f of current)\n",
              fused_ms[0], fused_ms[10], flops / (fused_ms[0] * 1e-3) / 1e12, fused_ms[0] / current_ms[0]);
  std::printf("  vs fp64: max |err| / (sigma' sum |terms|) %.2e (current path %.2e); vs current: max |diff| %.2e; "
              "unwritten %ld; %s\n",
              worst, worst_current, most, static_cast<long>(unwritten),
              cudaGetErrorName(error != cudaSuccess ? error : sync));
  // Both paths are fp32 GEMMs of exact products, so they differ by the order of the fp32 sums: ~1e-7
  // of sigma' sum |terms| each against fp64, a few 1e-6 in s between them. A layout or indexing
  // error is orders of magnitude above these bounds.
  const bool ok = error == cudaSuccess && sync == cudaSuccess && unwritten == 0 && worst < 1e-5 && most < 5e-5;
  std::printf("router_scores_check: %s\n", ok ? "ok" : "FAILED");
  cublasDestroy(handle);
  return ok ? 0 : 1;
}
