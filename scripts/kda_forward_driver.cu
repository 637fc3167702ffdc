// A standalone timing driver for kernels/kda.cu (not part of the CMake build): includes the kernel
// source, so a variant of it can be timed without LibTorch or a project build (~20 s to compile):
//   nvcc -O3 -std=c++17 -arch=sm_90 [-Ivariant] -I. scripts/kda_forward_driver.cu -o /tmp/kda_driver
//   /tmp/kda_driver B T H [segment_length [prefetch 0/1 [head_walk 0/1]]]   (defaults 2 16384 64 0 0 1)
// -Ivariant first: a folder holding a modified kernels/kda.cu (and kda_chunk.cuh) is used instead.
// Random bf16 inputs; prints the best and median of 20 launches (CUDA events). Correctness is the
// parity tests' job (kernels_tests), not this driver's.
#include "kernels/kda.cu"
#include "scripts/kda_driver_inputs.cuh"
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <vector>
using namespace odyssey::kernels;

int main(int argc, char** argv) {
  const int64_t B = argc > 1 ? atoll(argv[1]) : 2, T = argc > 2 ? atoll(argv[2]) : 16384,
                H = argc > 3 ? atoll(argv[3]) : 64, K = 128, V = 128;
  const int64_t seg = argc > 4 ? atoll(argv[4]) : 0;
  bf16 *q, *k, *v, *beta, *o; float *g, *fs;
  const int64_t n = B * T * H;
  cudaMalloc(&q, n * K * 2); cudaMalloc(&k, n * K * 2); cudaMalloc(&v, n * V * 2);
  cudaMalloc(&o, n * V * 2); cudaMalloc(&beta, n * 2); cudaMalloc(&g, n * K * 4);
  cudaMalloc(&fs, B * H * K * V * 4);
  fill_bf16<<<1024, 256>>>(q, n * K, 1, 0.09f); fill_bf16<<<1024, 256>>>(k, n * K, 2, 0.09f);
  fill_bf16<<<1024, 256>>>(v, n * V, 3, 1.0f); fill_bf16<<<1024, 256>>>(beta, n, 4, 0.5f);
  fill_f32<<<1024, 256>>>(g, n * K, 5, -0.3f, 0.0f);
  KdaChunkedOptions opt; opt.segment_length = seg; opt.prefetch = argc > 5 && atoi(argv[5]) != 0;
  opt.head_walk = argc <= 6 || atoi(argv[6]) != 0;  // K = V = 128 bf16: one 8-warp CTA per head
  auto run = [&] { return kda_chunked_forward(KdaDtype::kBFloat16, q, k, v, g, beta, nullptr, o, fs, nullptr, B, T, H, K, V, 0.088f, opt, 0); };
  cudaError_t e = run(); cudaDeviceSynchronize();
  if (e != cudaSuccess || cudaGetLastError() != cudaSuccess) { printf("error %s\n", cudaGetErrorString(e)); return 1; }
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  std::vector<float> ms;
  for (int r = 0; r < 20; ++r) { cudaEventRecord(a); run(); cudaEventRecord(b); cudaEventSynchronize(b); float t; cudaEventElapsedTime(&t, a, b); ms.push_back(t); }
  std::sort(ms.begin(), ms.end());
  printf("prefetch %d head_walk %d B=%ld T=%ld H=%ld seg=%ld: best %.3f ms median %.3f ms\n", (int)opt.prefetch, (int)opt.head_walk, (long)B, (long)T, (long)H, (long)seg, ms[0], ms[10]);
  return 0;
}
