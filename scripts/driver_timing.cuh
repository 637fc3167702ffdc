// Timing shared by the standalone kernel drivers in scripts/ (not part of the CMake build).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
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

}  // namespace
