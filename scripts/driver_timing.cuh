// Timing and inputs shared by the standalone kernel drivers in scripts/ (not part of the CMake
// build).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
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

}  // namespace
