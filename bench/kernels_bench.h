// `odyssey bench kernels` (GPU build, -DODYSSEY_CUDA=ON): the CUDA kernels of kernels/ against
// their plain LibTorch references, measured in the same run with CUDA events (warm-up, then
// best and median of N). Rows:
//   copy        device-to-device copy bandwidth (the memory floor's yardstick)
//   kda gate    the layer's decay gate g = g_min sigmoid(exp(A) (z + dt_bias)) at B=2, T=16K, H=64,
//               K=128, fp32 z: fused (kernels/kda_gate.h) vs the LibTorch formula, forward and
//               forward + backward, and the fused passes' bytes as a fraction of the copy rate
//   kda conv    the short convolution of q (W=4) with SiLU and the per-head L2 norm, same shape,
//               fp32: fused (kernels/kda_conv.h) vs the layer's LibTorch chain, forward + backward
//   kda layer   one IncrementalAttention layer (hidden 1024, 8 heads of 128) forward + backward in
//               fp32 at B=2, T=16K, and its attention core (kda::chunked) alone: the core's share
//   kda forward B=2, T=16K, H=64, K=V=128 bf16 and B=1, T=64K, H=4: kernel vs
//               kda::chunked_reference (ratio), TFLOP/s, fraction of the memory floor (bytes of
//               q, k, v, g, beta in and o out at the measured copy bandwidth); B=1, T=64K, H=4
//               twice: the serial walk and the automatic (context-parallel) path; the main shape
//               also without the L2 prefetch of the next group's inputs
//   kda backward B=2, T=16K, H=64, K=V=128 bf16: the backward kernel (preallocated outputs and
//               workspace) as a multiple of the forward's time (goal <= 3x), and its design's
//               memory floor (the bytes its three passes must move at the copy rate, also as a
//               multiple of the forward: recomputing V' and dV', and from kept states); with
//               references, a training step (forward + backward) of the kernels vs autograd of
//               kda::chunked_reference
//   kda decode  batch 256, H=64, K=V=128: kernel vs kda::step_reference, state GB/s
//   moe         (suite moe) the MoE layer at configs/model/small.toml's expert shapes (hidden
//               1024, 896 routed experts, top-16, latent 384, expert_ffn 192, 2 shared experts
//               of width 512), 8K tokens, bf16: forward and forward + backward through the
//               kernels (fused top-k, permutation, grouped GEMMs with fused SiTU-GLU) in ms and
//               TFLOP/s, against a dense bf16 at::matmul of the same FLOPs measured in the same
//               run (the ratio; goal >= 0.7) and against MoeImpl::forward_reference; plus the
//               routing kernels alone (top-k, quantile histogram, permutation) vs their
//               references. FLOPs counted: the matmuls only, 2 * m * (d E [router] + d L
//               [latent down] + k 3 L F [routed experts] + L d [latent up] + S 3 d Fs [shared]);
//               forward + backward = 3x the forward; the elementwise work, top-k and
//               permutation are not counted.
//   moe breakdown (suite moe, before the final lines) where the layer's time goes, on the same
//               inputs in the same run: the forward's stages (router, top-k, latent down,
//               permutation, gather, the experts' gate / up / down GEMMs and SiTU-GLU, un-permute,
//               RMSNorm, latent up, shared experts; the balancer's histogram as an extra), each
//               timed alone without autograd; the backward's stages, each the autograd backward of
//               that stage's recorded forward (the routed experts' also step by step: dH, the
//               SiTU-GLU backward with H recomputed in its pass and the two-pass form it replaced,
//               dX, dW); per row ms, share of the layer's time, TFLOP/s (matmuls) and GB/s
//               (bytes the stage must move), then the sum of the stages against the layer's time
//               (the gap: launches, allocations, host and autograd overhead). Then each expert
//               GEMM on its exact grouped shape (rows per expert as routed, and spread evenly)
//               against one dense at::mm of the same shape and FLOPs, and the router's fp32
//               matmul against the same product in bf16. A part that fails prints why and the
//               bench goes on.
//   attn res mix (suite kda, or attn_res alone) the block attention residuals' mix, 4 fp32 sources
//               of [tokens, 1024] at 2048 tokens (a learner chunk) and 16K: forward + backward
//               through autograd, fused (kernels/attn_res.h) against model::attn_res_mix_reference
//               in the same run; ends with `attn_res_mix_speedup: X` (the 2048-token ratio).
// Suites (--suite): kda, moe, attn_res or all (default). Each suite ends with `name: value` lines: kda
// with `kda_backward_ms: Y (Rx the forward)` then `kda_forward_ms: X` (the kernel's best time at
// B=2, T=16K, H=64); moe with `moe_forward_ms`, `moe_train_ms` and `moe_vs_dense: X` (the
// forward + backward TFLOP/s over the dense matmul's). With all, moe runs first, so
// `kda_forward_ms: X` stays the very last line.
// On a CPU build the command fails with kFailedPrecondition (it needs the CUDA build).
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"

namespace odyssey::bench {

struct KernelsBenchOptions {
  int warmup = 3;
  int repeats = 20;           // kernel timings: best and median of this many
  int reference_repeats = 3;  // LibTorch reference timings (slow): best of this many
  bool reference = true;      // time the references (the ratio column)
  std::string suite = "all";  // kda, moe, attn_res or all
  int64_t moe_tokens = 8192;  // tokens of the MoE layer rows
};

struct KernelsBenchResult {
  double copy_gb_per_s = 0;
  double kda_forward_ms = 0;            // B=2, T=16K, H=64, K=V=128, bf16, best
  double kda_forward_reference_ms = 0;  // kda::chunked_reference on the same inputs, best
  double kda_forward_column_tiles_ms = 0;  // with 64-column CTAs instead of the head walk, best
  double kda_forward_long_ms = 0;       // B=1, T=64K, H=4 (automatic: context parallel)
  double kda_forward_long_serial_ms = 0;  // the same, serial walk (8 CTAs)
  double kda_backward_ms = 0;           // B=2, T=16K, H=64, K=V=128, bf16, best
  double kda_decode_ms = 0;             // batch 256, H=64
  // The layer's decay gate (model::kda::gate) at B=2, T=16K, H=64, K=128, fp32 z (training's
  // dtype): fused forward + backward, and the LibTorch formula's autograd on the same tensors, best.
  double kda_gate_train_ms = 0;
  double kda_gate_reference_train_ms = 0;
  // MoE layer, small config's expert shapes, moe_tokens tokens, bf16 (0 when not run).
  double moe_forward_ms = 0;            // forward through the kernels, best
  double moe_train_ms = 0;              // forward + backward, best
  double moe_forward_tflops = 0;
  double moe_train_tflops = 0;
  double moe_dense_tflops = 0;          // bf16 at::matmul of the forward + backward's FLOPs
  double moe_vs_dense = 0;              // moe_train_tflops / moe_dense_tflops
  double moe_reference_forward_ms = 0;  // MoeImpl::forward_reference, best
  double moe_reference_train_ms = 0;
  // The breakdown (0 when not run): sums of the stages timed alone, and the layer's backward alone
  // (autograd's backward of one recorded forward, retained), best.
  double moe_forward_stages_ms = 0;
  double moe_backward_stages_ms = 0;
  double moe_backward_ms = 0;
};

Result<KernelsBenchResult> run_kernels_bench(const KernelsBenchOptions& options);

}  // namespace odyssey::bench
