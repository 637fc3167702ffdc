// A standalone timing of the fused routed experts (kernels/moe_experts.cu) on the small config's
// expert shapes, 8K tokens x top-16 (not part of the CMake build):
//   nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr [-Ivariant] -I. scripts/moe_experts_driver.cu \
//        kernels/moe_experts_sm90.cu -o /tmp/moe_experts
//   /tmp/moe_experts [tokens top_k experts L F]
// Rows per expert: every token picks top_k distinct experts uniformly at random (fixed seed), and
// the same rows spread evenly. Both kernels (mma.sync, and wgmma on sm_90). Prints the best and median of 20 launches, TFLOP/s of the three
// products, and the bytes a launch must move at least (rows in, weights once, y, G and U out).
// -Ivariant first: a folder holding a modified kernels/moe_experts.cu is used instead (timing
// experiments); the parity is kernels_tests' job.
#include "kernels/moe_experts.cu"
#include "scripts/driver_timing.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

using namespace odyssey::kernels;

int main(int argc, char** argv) {
  const int64_t tokens = argc > 1 ? atoll(argv[1]) : 8192, top_k = argc > 2 ? atoll(argv[2]) : 16;
  const int64_t experts = argc > 3 ? atoll(argv[3]) : 896, L = argc > 4 ? atoll(argv[4]) : 384;
  const int64_t F = argc > 5 ? atoll(argv[5]) : 192;
  const int64_t rows = tokens * top_k;
  std::mt19937 rng(7);
  const std::vector<int64_t> counts = uniform_routing_counts(tokens, top_k, experts, rng);
  std::vector<int32_t> routed(experts), even(experts);
  int64_t sum = 0, most = 0;
  for (int64_t e = 0; e < experts; ++e) {
    sum += counts[e];
    most = std::max(most, counts[e]);
    routed[e] = static_cast<int32_t>(sum);
    even[e] = static_cast<int32_t>((e + 1) * rows / experts);
  }
  void* x = random_bf16(rows * L, 1.f, rng).device;
  void* wg = random_bf16(experts * F * L, 0.05f, rng).device;
  void* wu = random_bf16(experts * F * L, 0.05f, rng).device;
  void* wd = random_bf16(experts * L * F, 0.07f, rng).device;
  void *y = nullptr, *g = nullptr, *u = nullptr;
  int32_t* ends = nullptr;
  cudaMalloc(&y, rows * L * 2);
  cudaMalloc(&g, rows * F * 2);
  cudaMalloc(&u, rows * F * 2);
  cudaMalloc(&ends, experts * 4);
  const double flops = 3.0 * 2 * rows * L * F;
  const double bytes = 2.0 * (rows * L * 2 + 3.0 * experts * F * L + 2.0 * rows * F);
  std::printf("moe experts fused: %ld rows (%ld tokens x %ld), %ld experts (most rows %ld), L=%ld F=%ld: "
              "%.1f GFLOP, at least %.0f MB\n",
              static_cast<long>(rows), static_cast<long>(tokens), static_cast<long>(top_k),
              static_cast<long>(experts), static_cast<long>(most), static_cast<long>(L),
              static_cast<long>(F), flops / 1e9, bytes / 1e6);
  for (const auto& [name, host_ends] : {std::make_pair("routed", &routed), std::make_pair("even", &even)}) {
    cudaMemcpy(ends, host_ends->data(), experts * 4, cudaMemcpyHostToDevice);
    for (const MoeExpertsKernel kernel : {MoeExpertsKernel::kMmaSync, MoeExpertsKernel::kWgmma}) {
      for (const bool store_gu : {true, false}) {
        cudaError_t error = cudaSuccess;
        const std::vector<float> ms = time_launches([&] {
          error = moe_experts_forward(x, wg, wu, wd, ends, y, store_gu ? g : nullptr, store_gu ? u : nullptr, rows,
                                      experts, L, F, 4.f, 25.f, nullptr, kernel);
        });
        const cudaError_t sync = cudaDeviceSynchronize();
        std::printf("  %-6s %-8s %-14s best %.3f ms  median %.3f ms  %6.1f TFLOP/s  %5.0f GB/s of the least bytes  %s\n",
                    name, kernel == MoeExpertsKernel::kWgmma ? "wgmma" : "mma.sync",
                    store_gu ? "(G, U stored)" : "(y only)", ms[0], ms[10], flops / (ms[0] * 1e-3) / 1e12,
                    bytes / (ms[0] * 1e-3) / 1e9, cudaGetErrorName(error != cudaSuccess ? error : sync));
      }
    }
  }
  return 0;
}
