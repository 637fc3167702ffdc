// wgmma building blocks (sm_90a): the 128-byte swizzled shared-memory layout, the operand
// descriptors, the async-proxy fence, wgmma's fence / commit / wait, and the m64n128k16 product
// with bf16 operands and fp32 accumulators. Used by the routed experts' kernels
// (moe_experts_sm90.cu); meant for every kernel that multiplies tiles held in shared memory with
// wgmma (kernels/JOURNAL.md, "Thirty-third session": the KDA backward's products with the state).
// Internal (anonymous namespace: each .cu gets its own copy).
//
// A file that includes it is built for sm_90a (CMake: odyssey_kernels_sm90a). nvcc also compiles
// it for the plain architecture, where these instructions do not exist: the including kernels test
// ODYSSEY_NO_WGMMA and trap there, so that a build that left sm_90a out fails loudly.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ODYSSEY_NO_WGMMA 1
#pragma nv_diag_suppress 177  // the helpers below, unused in that pass
#endif

namespace odyssey::kernels {
namespace {

// The 128-byte swizzle: a matrix of rows of 64 bf16 (128 bytes) in 1024-byte blocks of 8 rows,
// where row r's 16-byte piece c sits at piece c ^ (r % 8). Every 8-row block starts 1024 bytes
// after the last (the descriptors' stride); the blocks must be 1024-aligned, since the hardware
// applies the swizzle to the address it forms.
constexpr int kSwizzledRowBytes = 128;

// Byte offset of row r's 16-byte piece c in a swizzled matrix.
__device__ __forceinline__ uint32_t swizzled(int r, int c) {
  return static_cast<uint32_t>(r * kSwizzledRowBytes + ((c ^ (r & 7)) << 4));
}

// A wgmma shared-memory descriptor: K-major, 128-byte swizzle, 8-row blocks 1024 bytes apart.
__device__ __forceinline__ uint64_t descriptor(uint32_t address) {
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) | (uint64_t{1} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}
// The same for an MN-major operand with the 128-byte swizzle: rows of 64 elements along n (or m),
// one row per k, 8 k-rows a 1024-byte block; `atoms` bytes between the blocks of 64 n (the
// leading byte offset), 1024 bytes between groups of 8 k (the stride byte offset).
__device__ __forceinline__ uint64_t descriptor_mn(uint32_t address, uint32_t atoms) {
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) | (static_cast<uint64_t>(atoms >> 4) << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// d (64 x 128 fp32, the m64n128 accumulator layout) += A (64 x 16 at a) B (16 x 128 at b); A is
// K-major (kTransA = 0: stored 64 rows of m, 16 of k each) or M-major (kTransA = 1), B K-major
// (kTransB = 0: stored 128 rows of n, 16 of k each) or N-major (kTransB = 1).
template <int kTransB = 0, int kTransA = 0>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, 1, 1, 1, %67, %66;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "n"(kTransB), "n"(kTransA));
}

}  // namespace
}  // namespace odyssey::kernels
