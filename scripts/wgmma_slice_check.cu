// Does wgmma read a 32-column slice of an MN-major B operand where the KDA backward's products with
// the state need it? (kernels/JOURNAL.md, "Thirty-third session": the plan for wgmma in the 64-token
// pass.) The products there are out[i][k] = sum_v A[i][v] S^T[v][k] with A a [64][128] bf16 matrix
// (tokens by v, K-major) and S^T stored [v][k] (k contiguous: an MN-major B); each of four
// warpgroups would take 32 of the 128 columns k with wgmma.m64n32k16. Two layouts of S^T:
//   sw128: two 128-byte-swizzled matrices of 64 columns; the odd warpgroups' slices start 64 bytes
//          into a swizzle atom, which the descriptor may or may not allow;
//   sw64:  four 64-byte-swizzled matrices of 32 columns: each slice is an atom of its own.
// A is K-major with the 128-byte swizzle, as in moe_experts_sm90.cu. Each layout's product is
// compared with a host fp64 sum (bf16 products are exact in fp32, so only the order of the sums
// differs: a right layout is within ~1e-6 of the largest value, a wrong one off by O(1)).
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I. scripts/wgmma_slice_check.cu -o wgmma_slice_check
//   ./wgmma_slice_check        (prints each layout's largest error; exit status 1 if sw64 is wrong)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/mma.cuh"
#include "kernels/wgmma.cuh"

namespace wgmma_slice_check {
using namespace odyssey::kernels;

using bf16 = __nv_bfloat16;
constexpr int kRows = 64, kDepth = 128, kCols = 128;  // A [kRows][kDepth], S^T [kDepth][kCols]

// The 64-byte swizzle: rows of 32 bf16 (64 bytes), row r's 16-byte piece c at piece c ^ ((r / 2) % 4),
// in 512-byte blocks of 8 rows (Swizzle<2, 4, 3> on the byte address).
__device__ __forceinline__ uint32_t swizzled64(int r, int c) {
  return static_cast<uint32_t>(r * 64 + ((c ^ ((r >> 1) & 3)) << 4));
}
// An MN-major descriptor with the 64-byte swizzle: rows of 32 elements along n, one row per k,
// groups of 8 k 512 bytes apart (the stride byte offset); `atoms` bytes between blocks of 32 n.
__device__ __forceinline__ uint64_t descriptor_mn64(uint32_t address, uint32_t atoms) {
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) | (static_cast<uint64_t>(atoms >> 4) << 16) |
         (uint64_t{512 >> 4} << 32) | (uint64_t{2} << 62);
}

// d (64 x 32 fp32: d[4 j + e] is n8 tile j, rows 16 (warp % 4) + g (e < 2) and + 8, columns
// 8 j + 2 t + e % 2) += A (64 x 16, K-major) B (16 x 32; kTransB = 1: N-major).
template <int kTransB>
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[16], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "%16, %17, 1, 1, 1, 0, %18;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b), "n"(kTransB));
}

struct alignas(1024) Shared {
  unsigned char a[2][kRows * 128];        // A: two K-major 128-byte-swizzled matrices of 64 v
  unsigned char b128[2][kDepth * 128];    // S^T: two MN-major 128-byte-swizzled matrices of 64 k
  unsigned char b64[4][kDepth * 64];      // S^T: four MN-major 64-byte-swizzled matrices of 32 k
};

// out[layout][i][k]: layout 0 sw128, 1 sw64. One CTA of four warpgroups; warpgroup w takes columns
// 32 w .. 32 w + 31.
__global__ void __launch_bounds__(512, 1) slice_products(const bf16* a, const bf16* s_t, float* out) {
#if defined(ODYSSEY_NO_WGMMA)
  __trap();  // built without sm_90a's instructions
#else
  extern __shared__ __align__(1024) unsigned char raw[];
  // The swizzle atoms must be 1024-aligned in the shared window (the launch adds 1 KB for this).
  Shared& sh = *reinterpret_cast<Shared*>(raw + ((1024 - (shared_address(raw) & 1023)) & 1023));
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, warpgroup = warp / 4;
  for (int e = tid; e < kRows * kDepth / 8; e += 512) {  // 16-byte pieces of A
    const int r = e / (kDepth / 8), c = e % (kDepth / 8);
    *reinterpret_cast<uint4*>(&sh.a[c / 8][swizzled(r, c % 8)]) = *reinterpret_cast<const uint4*>(a + r * kDepth + 8 * c);
  }
  for (int e = tid; e < kDepth * kCols / 8; e += 512) {  // 16-byte pieces of S^T
    const int r = e / (kCols / 8), c = e % (kCols / 8);
    const uint4 piece = *reinterpret_cast<const uint4*>(s_t + r * kCols + 8 * c);
    *reinterpret_cast<uint4*>(&sh.b128[c / 8][swizzled(r, c % 8)]) = piece;
    *reinterpret_cast<uint4*>(&sh.b64[c / 4][swizzled64(r, c % 4)]) = piece;
  }
  fence_proxy_async();  // the generic-proxy stores before wgmma reads them
  __syncthreads();
  const uint32_t a_base = shared_address(sh.a);
  for (int layout = 0; layout < 2; ++layout) {
    float d[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) d[i] = 0.0f;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kDepth / 16; ++kk) {
      const uint64_t a_desc = descriptor(a_base + (kk / 4) * (kRows * 128) + (kk % 4) * 32);
      uint64_t b_desc;
      if (layout == 0) {
        b_desc = descriptor_mn(shared_address(sh.b128[warpgroup / 2]) + (warpgroup % 2) * 64 + kk * 16 * 128, kDepth * 128);
      } else {
        b_desc = descriptor_mn64(shared_address(sh.b64[warpgroup]) + kk * 16 * 64, kDepth * 64);
      }
      wgmma_m64n32k16<1>(d, a_desc, b_desc);
    }
    wgmma_commit();
    wgmma_wait<0>();
    const int g = lane / 4, t = lane % 4, row0 = 16 * (warp % 4);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = row0 + g + 8 * (e / 2), k = 32 * warpgroup + 8 * j + 2 * t + e % 2;
        out[(layout * kRows + i) * kCols + k] = d[4 * j + e];
      }
    }
  }
#endif
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::printf("%s: %s\n", what, cudaGetErrorString(e));
    std::exit(2);
  }
}

}  // namespace wgmma_slice_check

int main() {
  using namespace wgmma_slice_check;
  std::vector<bf16> a(kRows * kDepth), s_t(kDepth * kCols);
  uint32_t state = 12345;
  auto next = [&] {  // uniform in [-1, 1), rounded to bf16
    state = state * 1664525u + 1013904223u;
    return __float2bfloat16(static_cast<float>(state >> 8) / 8388608.0f - 1.0f);
  };
  for (bf16& x : a) x = next();
  for (bf16& x : s_t) x = next();
  std::vector<double> want(kRows * kCols, 0.0);
  double largest = 0.0;
  for (int i = 0; i < kRows; ++i) {
    for (int k = 0; k < kCols; ++k) {
      double sum = 0.0;
      for (int v = 0; v < kDepth; ++v) sum += double(__bfloat162float(a[i * kDepth + v])) * __bfloat162float(s_t[v * kCols + k]);
      want[i * kCols + k] = sum;
      largest = std::fmax(largest, std::fabs(sum));
    }
  }
  bf16 *d_a, *d_s;
  float* d_out;
  check(cudaMalloc(&d_a, a.size() * 2), "malloc"), check(cudaMalloc(&d_s, s_t.size() * 2), "malloc");
  check(cudaMalloc(&d_out, 2 * kRows * kCols * 4), "malloc");
  check(cudaMemcpy(d_a, a.data(), a.size() * 2, cudaMemcpyHostToDevice), "copy");
  check(cudaMemcpy(d_s, s_t.data(), s_t.size() * 2, cudaMemcpyHostToDevice), "copy");
  const size_t shared = sizeof(Shared) + 1024;
  check(cudaFuncSetAttribute(slice_products, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)),
        "shared memory");
  slice_products<<<1, 512, shared>>>(d_a, d_s, d_out);
  check(cudaGetLastError(), "launch"), check(cudaDeviceSynchronize(), "run");
  std::vector<float> got(2 * kRows * kCols);
  check(cudaMemcpy(got.data(), d_out, got.size() * 4, cudaMemcpyDeviceToHost), "copy back");
  const char* names[2] = {"sw128, slices 64 bytes into an atom", "sw64, a slice an atom"};
  bool sw64_right = false;
  for (int layout = 0; layout < 2; ++layout) {
    double worst = 0.0;
    int worst_at = 0;
    for (int e = 0; e < kRows * kCols; ++e) {
      const double error = std::fabs(got[layout * kRows * kCols + e] - want[e]);
      if (error > worst) worst = error, worst_at = e;
    }
    const bool right = worst <= 1e-5 * largest;
    if (layout == 1) sw64_right = right;
    std::printf("%-38s largest error %.3e of %.3e (at row %d, column %d): %s\n", names[layout], worst, largest,
                worst_at / kCols, worst_at % kCols, right ? "RIGHT" : "WRONG");
  }
  return sw64_right ? 0 : 1;
}
