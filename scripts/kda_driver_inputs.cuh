// Random inputs for the standalone KDA timing drivers (scripts/kda_*_driver.cu): a hash of the
// element index and a seed, so every run and both drivers see the same values.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

// p[i] uniform in [-scale, scale), rounded to bf16.
__global__ void fill_bf16(__nv_bfloat16* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint32_t x = (uint32_t)i * 2654435761u ^ seed; x ^= x >> 13; x *= 0x5bd1e995; x ^= x >> 15;
    p[i] = __float2bfloat16((x & 0xffff) / 65536.0f * 2.0f * scale - scale);
  }
}

// p[i] uniform in [lo, hi).
__global__ void fill_f32(float* p, int64_t n, uint32_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint32_t x = (uint32_t)i * 2654435761u ^ seed; x ^= x >> 13; x *= 0x5bd1e995; x ^= x >> 15;
    p[i] = lo + (hi - lo) * ((x & 0xffff) / 65536.0f);
  }
}
