// Exact-fp32 grouped GEMMs on CUDA cores for the routed experts' row blocks (kernels/grouped_sgemm.cu).
//
// At the `highest` float32 matmul precision (model/precision.h) the routed experts' products are
// fp32 in fp32. cuBLAS's grouped GEMM (kernels/grouped_gemm.h) runs them with its SIMT kernels,
// whose tiles are sized for large problems: on the small model's learner chunk (2048 tokens x top-16
// over 896 experts, ~37 rows an expert) they reached ~9-12 TFLOP/s of the H200's ~67 TFLOP/s of
// fp32 FMA, and a third of the step's kernel time. These kernels tile each expert's block by 64
// rows x 64 columns, which suits blocks of tens to hundreds of rows.
//
// Results: every output element is one fp32 FMA chain over k in increasing order (no split sums),
// so the results are an fp32 GEMM's: equal to cuBLAS's within fp32 rounding of the order of the
// sums, and the same bits every run.
//
// Layouts: row-major, the pointers 4-byte aligned (16-byte aligned rows take vector loads and
// stores). Sizes: every count < 2^31. Launchers return cudaErrorInvalidValue for sizes or strides
// they do not take, and the launch's error otherwise; they never synchronize.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace odyssey::kernels {

// How a 64 x 64 output tile is shared out: 64 threads of 8 x 8 outputs (fewer shared-memory reads
// a product, 161-167 registers) or 256 threads of 4 x 4 (53-64 registers). Either gives the same bits.
enum class GroupedSgemmThreads { k64Of8x8, k256Of4x4 };

// A tile of at most 64 rows of one expert's block: out rows [first_row, first_row + rows).
struct GroupedSgemmRowTile {
  int32_t expert;
  int32_t first_row;
  int32_t rows;  // 1 ... 64
};

// out [R, N] = block e of x [R, K] times w_e, for the tiles `tiles` (device memory, `tile_count`
// of them, covering the rows to write). w_e(k, n) is at w + e * w_stride_e + k * w_stride_k +
// n * w_stride_n, with w_stride_n == 1 (w_e row-major [K, N]) or w_stride_k == 1 (the transposed
// view of a row-major [N, K]).
cudaError_t grouped_sgemm_rows_times(const float* x, const float* w, int64_t w_stride_e, int64_t w_stride_k,
                                     int64_t w_stride_n, const GroupedSgemmRowTile* tiles, int64_t tile_count,
                                     float* out, int64_t K, int64_t N, cudaStream_t stream,
                                     GroupedSgemmThreads threads = GroupedSgemmThreads::k64Of8x8);

// out [E, M, N] = a_e^T b_e for a [R, M] and b [R, N] in blocks: expert e's rows are
// [block_starts[e], block_starts[e + 1]) (device memory, E + 1 non-decreasing values). Experts
// without rows get exact zeros.
cudaError_t grouped_sgemm_weight_grad(const float* a, const float* b, const int32_t* block_starts, int64_t experts,
                                      float* out, int64_t M, int64_t N, cudaStream_t stream,
                                      GroupedSgemmThreads threads = GroupedSgemmThreads::k64Of8x8);

}  // namespace odyssey::kernels
