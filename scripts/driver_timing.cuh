// Timing and inputs shared by the standalone kernel drivers in scripts/ (not part of the CMake
// build).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace {

// 20 launches of `launch`, each timed by CUDA events, sorted: [0] is the best, [10] the median.
template <typename F>
std::vector<float> time_launches(F&& launch) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start), cudaEventCreate(&stop);
  std::vector<float> ms;
  for (int r = 0; r < 20; ++r) {
    cudaEventRecord(start);
    launch();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float t = 0.0f;
    cudaEventElapsedTime(&t, start, stop);
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  cudaEventDestroy(start), cudaEventDestroy(stop);
  return ms;
}

// count normal(0, scale) values rounded to bf16, on the host and copied to the device.
struct HostDevice {
  std::vector<__nv_bfloat16> host;
  void* device = nullptr;
};
inline HostDevice random_bf16(size_t count, float scale, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, scale);
  HostDevice m;
  m.host.resize(count);
  for (auto& x : m.host) x = __float2bfloat16(normal(rng));
  cudaMalloc(&m.device, count * 2);
  cudaMemcpy(m.device, m.host.data(), count * 2, cudaMemcpyHostToDevice);
  return m;
}

// Rows per expert when each of `tokens` tokens picks `top_k` distinct experts uniformly (a partial
// Fisher-Yates shuffle a token): the MoE drivers' "routed" rows.
inline std::vector<int64_t> uniform_routing_counts(int64_t tokens, int64_t top_k, int64_t experts,
                                                   std::mt19937& rng) {
  std::vector<int64_t> counts(experts, 0);
  std::vector<int> ids(experts);
  for (int64_t e = 0; e < experts; ++e) ids[e] = static_cast<int>(e);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < top_k; ++j) {
      std::uniform_int_distribution<int64_t> pick(j, experts - 1);
      std::swap(ids[j], ids[pick(rng)]);
      ++counts[ids[j]];
    }
  }
  return counts;
}

}  // namespace
