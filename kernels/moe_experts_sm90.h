// The routed experts' kernels on Hopper's wgmma (kernels/moe_experts_sm90.cu, built for sm_90a
// only): the fused forward, dX and the three weight gradients. Each has the contract of its
// mma.sync counterpart in kernels/moe.h (moe_experts_forward, moe_experts_dx,
// moe_experts_weight_grads: the same arguments, outputs and preconditions), which calls it where
// it is supported unless told otherwise (MoeExpertsKernel). dX and the weight gradients equal the
// mma.sync kernels' bit for bit in every run of scripts/moe_weight_grads_driver.cu.
//
// The forward:
// Results: G and U are the same products as the mma.sync kernel's, summed in another order (equal
// to within fp32 rounding before their bf16 rounding), H and y follow from them.
// Supported: an sm_90 device (H100 / H200), L in {128, 256, 384, 512} and F a multiple of 64 with
// L + F <= 576 (X, H and a ring of four 16 KB weight chunks in 227 KB; L = 384, F = 192: 209 KB),
// 1 <= E <= 1024, R < 2^31, 16-byte aligned pointers.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace odyssey::kernels {

bool moe_experts_forward_wgmma_supported(int64_t latent, int64_t ffn, int64_t experts);
cudaError_t moe_experts_forward_wgmma(const void* rows, const void* gate_proj, const void* up_proj,
                                      const void* down_proj, const int32_t* group_ends, void* y,
                                      void* gate, void* up, int64_t total_rows, int64_t experts,
                                      int64_t latent, int64_t ffn, float beta1, float beta2,
                                      cudaStream_t stream);

// dX = dG W_gate + dU W_up of the routed experts (moe_experts_dx's contract, kernels/moe.h) on
// wgmma: one fp32 sum over the 2F products a row, rounded once. Supported: an sm_90 device, L a
// multiple of 128, F of 64, 1 <= E <= 1024.
bool moe_experts_dx_wgmma_supported(int64_t latent, int64_t ffn, int64_t experts);
cudaError_t moe_experts_dx_wgmma(const void* d_gate, const void* d_up, const void* gate_proj,
                                 const void* up_proj, const int32_t* group_ends, void* dx,
                                 int64_t total_rows, int64_t experts, int64_t latent, int64_t ffn,
                                 cudaStream_t stream);

// The routed experts' three weight gradients (moe_experts_weight_grads' contract, kernels/moe.h)
// on wgmma: the same jobs as the mma.sync kernel, sums over each expert's rows in 64-row chunks.
// Supported: an sm_90 device, L a multiple of 128, F of 64, 1 <= E <= 1024. fp32_outputs: the
// three outputs are fp32, the sums themselves (the bf16 outputs are these rounded once).
bool moe_experts_weight_grads_wgmma_supported(int64_t latent, int64_t ffn, int64_t experts);
cudaError_t moe_experts_weight_grads_wgmma(const void* rows, const void* d_gate, const void* d_up,
                                           const void* dy, const void* h, const int32_t* group_ends,
                                           void* d_gate_proj, void* d_up_proj, void* d_down_proj,
                                           int64_t total_rows, int64_t experts, int64_t latent,
                                           int64_t ffn, cudaStream_t stream, bool fp32_outputs = false);

}  // namespace odyssey::kernels
