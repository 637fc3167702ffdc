// Grouped GEMMs over row blocks: the routed experts' products in one launch.
//
// After the token permutation, expert e's rows are the block [start_e, start_e + counts[e]) of
// one [R, K] tensor (start_e the sum of the counts before e). The products over all experts,
// block e times expert e's weight, are one launch: where a loop of at::mm makes one launch and one
// LibTorch dispatch per expert (896 experts: ~900 launches a product, ~8K a layer's forward and
// backward), which bound the fp32 training step at LibTorch's highest float32 matmul precision.
//
// Backends (GroupedGemmBackend):
//   kSimt8x8 fp32 only: our grouped GEMMs on CUDA cores (kernels/grouped_sgemm.h), tiled for blocks
//            of tens to hundreds of rows, 64 threads of 8 x 8 outputs a tile; what kAuto takes for
//            fp32;
//   kSimt4x4 the same kernels with 256 threads of 4 x 4 outputs a tile (the same bits);
//   kCublas  cuBLAS's grouped batched GEMM (cuBLAS >= 12.5, one problem a non-empty expert); what
//            kAuto takes for bf16.
//
// Precision: fp32 in fp32 at every float32 matmul precision (TF32, which `high` allows, made
// cuBLAS's grouped GEMM slower on an H200, not faster), bf16 with fp32 accumulation rounded once.
// Sums run in the backend's order, so results equal a loop of at::mm to fp32 rounding, not bit for
// bit; kSimt8x8's and kSimt4x4's are the same bits, every run.
//
// The counts are on the host (the caller brought them over once: the group sizes are the GEMMs'
// shapes). What the launch needs on the device (cuBLAS's problem pointers, the CUDA-core kernels'
// tiles and block starts) goes there through a pinned buffer, asynchronously on the current stream;
// nothing here synchronizes.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

namespace odyssey::kernels {

// Whether this build has cuBLAS's grouped GEMM (compiled against cuBLAS >= 12.5).
bool cublas_grouped_gemm_compiled();

// Whether grouped_rows_times / grouped_weight_grad take these operands: CUDA tensors of one
// device and one dtype, fp32 or bf16, and a build with cuBLAS's grouped GEMM.
bool cublas_grouped_gemm_applies(const at::Tensor& a, const at::Tensor& b);

enum class GroupedGemmBackend { kAuto, kSimt8x8, kSimt4x4, kCublas };

// x [R, K] (rows in blocks of `counts`, which sum to R), w [E, K, N] with E = counts.size() and
// any strides -> [R, N]: block e times w[e]. Blocks of zero rows are skipped.
// kSimt8x8 / kSimt4x4 for bf16 operands is an error naming the dtype.
at::Tensor grouped_rows_times(const at::Tensor& x, const at::Tensor& w, const std::vector<int64_t>& counts,
                              GroupedGemmBackend backend = GroupedGemmBackend::kAuto);

// a [R, M], b [R, N] in blocks of `counts` -> [E, M, N]: a_e^T b_e, exactly zero for empty blocks
// (the weight gradient of grouped_rows_times: a the output's gradient, b its input, or the
// reverse for the transposed weight).
at::Tensor grouped_weight_grad(const at::Tensor& a, const at::Tensor& b, const std::vector<int64_t>& counts,
                               GroupedGemmBackend backend = GroupedGemmBackend::kAuto);

}  // namespace odyssey::kernels
