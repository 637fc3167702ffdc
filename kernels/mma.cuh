// Tensor-core building blocks shared by the kernels that multiply bf16 tiles with mma.sync
// (kda.cu, kda_backward.cu through kda_chunk.cuh; moe_experts.cu): fragment loads by ldmatrix, the
// m16n8k16 product, cp.async copies into shared memory, the per-lane fragment offsets, the quad
// transpose for 16-byte stores of accumulator rows, and movmatrix for storing a fragment's
// transpose (store_transposed_tile). Internal
// (anonymous namespace: each .cu gets its own copy); sm_80 or newer.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace odyssey::kernels {
namespace {

// Tensor-core fragments (mma.sync m16n8k16, bf16 in, fp32 accumulate). Lane l: g = l / 4,
// t = l % 4. Accumulator c[0..1] = (row g, cols 2t, 2t+1), c[2..3] = (row g + 8, same cols).

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p))
               : "memory");
}

// ldmatrix_x4 at a shared-memory address (shared_address of the pointer), for callers that keep
// their fragment addresses as 32-bit offsets.
__device__ __forceinline__ void ldmatrix_x4_at(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans_at(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p))
               : "memory");
}

// d += a * b for one m16n8k16 tile.
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void cp_async16(void* shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(shared)),
               "l"(global)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}
// 16 bytes from global to shared, or 16 zero bytes when !valid (the source is then not read, but
// must still be a valid address).
__device__ __forceinline__ void cp_async16_or_zero(void* shared, const void* global, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(shared)),
               "l"(global), "r"(valid ? 16 : 0)
               : "memory");
}

// Within each quad of lanes (t = lane % 4), element (lane s, register i) goes to (lane i,
// register s): two xor-shuffle stages, bit 0 then bit 1. Applied to the packed bf16 pairs of four
// n8 accumulator tiles (register i = tile i's columns 2s, 2s + 1 of lane s), lane t then holds the
// 8 consecutive columns of tile t: one 16-byte store a lane instead of four of 4 bytes, whose
// 8-row strips half fill every 32-byte sector.
__device__ __forceinline__ void quad_transpose(uint32_t (&r)[4], int t) {
#pragma unroll
  for (int bit = 1; bit <= 2; bit <<= 1) {
    const bool upper = (t & bit) != 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if ((k & bit) != 0) continue;  // k: the register pair (k, k | bit)
      // A lane with the bit clear sends its register k | bit and receives into it; a lane with
      // the bit set sends register k and receives into it.
      const uint32_t send = upper ? r[k] : r[k | bit];
      const uint32_t got = __shfl_xor_sync(0xffffffffu, send, bit);
      if (upper) r[k] = got; else r[k | bit] = got;
    }
  }
}

// The transpose of an 8 x 8 bf16 matrix held as an mma fragment (lane 4r + c: row r, columns 2c
// and 2c + 1): afterwards the lane holds row r, columns 2c and 2c + 1 of the transpose.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// A warp's 16 x 16 tile X^T held as the bf16 A fragment of an mma (a[0]: rows g, columns 2t and
// 2t + 1; a[1]: rows g + 8; a[2], a[3]: columns 8 + 2t), stored as X's 16 rows: row i at
// out + i * row_stride, 16 elements, rows >= valid not written. movmatrix transposes the four
// 8 x 8 blocks and quad_transpose gathers a row's 8 consecutive elements in one lane: one 16-byte
// store a lane (lane t: row g + 8 (t / 2), elements 8 (t % 2) .. + 7).
__device__ __forceinline__ void store_transposed_tile(__nv_bfloat16* out, int64_t row_stride, const uint32_t (&a)[4],
                                                      int valid, int lane) {
  const int g = lane >> 2, t = lane & 3;
  uint32_t r[4] = {movmatrix_trans(a[0]), movmatrix_trans(a[1]), movmatrix_trans(a[2]), movmatrix_trans(a[3])};
  quad_transpose(r, t);
  const int row = g + 8 * (t >> 1);
  if (row < valid) *reinterpret_cast<uint4*>(out + row * row_stride + 8 * (t & 1)) = make_uint4(r[0], r[1], r[2], r[3]);
}

// Per-lane offsets into a row-major 16 x 16 bf16 block for the three ldmatrix uses:
//   A operand (rows = m, cols = k):                     ldmatrix_x4 at [a_row][k0 + a_col]
//   B operands of two n-tiles, stored rows = n, cols = k:  ldmatrix_x4 at [b_row][k0 + b_col]
//     -> {b0, b1} of n-tile rows 0-7, then {b0, b1} of rows 8-15
//   B operands of two n-tiles, stored rows = k, cols = n:  ldmatrix_x4_trans at [t_row][n0 + t_col]
//     -> {b0, b1} of n-tile cols n0..n0+7, then of n0+8..n0+15
struct FragmentOffsets {
  int a_row, a_col, b_row, b_col, t_row, t_col;
  __device__ explicit FragmentOffsets(int lane) {
    const int r = lane & 7, m = lane >> 3;
    a_row = r + (m & 1) * 8, a_col = (m >> 1) * 8;
    b_row = r + (m >> 1) * 8, b_col = (m & 1) * 8;
    t_row = r + (m & 1) * 8, t_col = (m >> 1) * 8;
  }
};

}  // namespace
}  // namespace odyssey::kernels
