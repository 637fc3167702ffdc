// Stable latent Mixture-of-Experts layer (MODEL.md "Stable latent MoE").
//
//     s = σ(W_r x)                  router on the full-width x, fp32, n independent scores
//     T = top-k of (s + b)          b: the balancing bias (a buffer); it changes selection only
//     p_i = s_i / Σ_{j∈T} s_j       mixing weights from the UNBIASED scores
//     z = W_down x                  hidden → latent
//     u = Σ_{i∈T} p_i · Expert_i(z) each routed expert a SiTU-GLU MLP latent → expert_ffn → latent
//     y = Σ_shared SharedExpert(x) + W_up · RMSNorm(u)
// Shared experts are SiTU-GLU MLPs hidden → shared_ffn → hidden on the full-width x, summed
// unweighted. The bias b comes from a balancer (balancing.h) through set_expert_bias().
//
// Token dispatch is permute → per-expert GEMM → un-permute: the token copies (token, slot) are
// sorted by expert (stably, so each expert's tokens keep their order), each expert runs on its
// contiguous slice of the permuted latents, and the outputs are scatter-added back onto their
// tokens weighted by p. StackedExpertsImpl::forward is the middle step, where a grouped GEMM
// replaces the loop over experts.
//
// Parameter and buffer names (stable: they go into checkpoints; model/config.h lists them for
// the whole model), E = num_experts, S = num_shared, d = hidden, L = latent, F = expert_ffn,
// Fs = shared_ffn:
//     router.weight                      [E, d]      W_r (no bias)
//     router.bias                        [E]         buffer, fp32: the balancing bias b
//     latent_down.weight                 [L, d]      W_down
//     experts.gate_proj, experts.up_proj [E, F, L]   stacked, expert e = row e, the layout of
//     experts.down_proj                  [E, L, F]   grouped GEMMs and of expert parallelism
//     latent_norm.weight                 [L]         RMSNorm gain (eps = MoeOptions::eps)
//     latent_up.weight                   [d, L]      W_up
//     shared_experts.gate_proj, .up_proj [S, Fs, d]  absent when S = 0
//     shared_experts.down_proj           [S, d, Fs]
//
// Shapes: x [..., d] → y [..., d] in x's dtype; the routing covers the m = x.numel()/d tokens in
// row-major order. The router computes in fp32 (fp64 when x is fp64, for reference tests)
// whatever the parameter dtype; Module::to(dtype) converts router.weight and router.bias too, so
// a bf16 model converts its router back (router->to(torch::kFloat)) to keep W_r and b in fp32.
// Differentiable: y with respect to x and every parameter; the
// router learns through p (selection has no gradient); the bias has none.
// Kernels: in the GPU build (ODYSSEY_WITH_CUDA_KERNELS), forward() and route() run CUDA bf16 /
// fp32 inputs on kernels/ (fused top-k with the bias, permutation, gather / weighted un-permute
// without atomics, grouped expert GEMMs with fused SiTU-GLU, each recorded for autograd with the
// reference's gradients; kernels/moe_autograd.h). forward_reference() / route_reference() are the
// plain LibTorch path on any device: the CPU path, fp64, and what the kernels are tested against.
// Thread-safety: forward only reads; concurrent forwards are safe while nobody changes the
// parameters or the bias.
#pragma once

#include <cstdint>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include "model/ffn.h"
#include "model/precision.h"
#include "model/rms_norm.h"

namespace odyssey::kernels {
struct MoePermutation;  // kernels/torch_bindings.h (GPU build)
}  // namespace odyssey::kernels

namespace odyssey::model {

struct MoeOptions {
  int64_t hidden = 0;       // d
  int64_t latent = 0;       // L: the width routed experts work in
  int64_t expert_ffn = 0;   // F: inner width of each routed expert
  int64_t num_experts = 0;  // n routed experts
  int64_t top_k = 0;        // experts per token, 1 ≤ k ≤ n
  int64_t num_shared = 0;   // S shared experts (0 allowed)
  int64_t shared_ffn = 0;   // Fs: inner width of each shared expert (needed when S > 0)
  double eps = 1e-5;        // RMSNorm eps on the latent sum
  double situ_beta1 = kSituGateCap;
  double situ_beta2 = kSituUpCap;
};

// The layout of one step's token copies, sorted by expert. With m tokens and k slots per token,
// row r of the permuted order is copy source[r] of the flattened [m·k] (token, slot) list.
struct TokenPermutation {
  torch::Tensor source;             // int64 [m·k]: token·k + slot of each permuted row
  torch::Tensor token;              // int64 [m·k]: the token of each permuted row (source / k)
  torch::Tensor tokens_per_expert;  // int64 [n]: rows of each expert, contiguous in expert order
};

// Sorts the copies of selected [m, k] (int64 expert ids in [0, n)) by expert.
TokenPermutation permute_tokens(const torch::Tensor& selected, int64_t num_experts);
// Token rows [m, ...] → permuted copies [m·k, ...]: row r is tokens[permutation.token[r]].
torch::Tensor permute(const torch::Tensor& tokens, const TokenPermutation& permutation);
// Permuted copies [m·k, ...], each weighted by its (token, slot) entry of weights [m, k], summed
// back onto their m tokens: [m, ...] in the copies' dtype. Differentiable in copies and weights.
torch::Tensor unpermute(const torch::Tensor& copies, const TokenPermutation& permutation,
                        const torch::Tensor& weights);

// A stack of `count` SiTU-GLU MLPs width → ffn → width, weights stacked along dim 0:
//     gate_proj, up_proj [count, ffn, width], down_proj [count, width, ffn].
class StackedExpertsImpl : public torch::nn::Module {
 public:
  StackedExpertsImpl(int64_t count, int64_t width, int64_t ffn, double beta1, double beta2);

  // Grouped: rows [Σ tokens_per_expert, width], expert e's rows contiguous and in expert order
  // (tokens_per_expert: int64 [count]) → [rows, width], each row through its own expert.
  torch::Tensor forward(const torch::Tensor& rows, const torch::Tensor& tokens_per_expert);
  // Every expert on every row, summed: x [..., width] → [..., width] (the shared experts).
  torch::Tensor sum_all(const torch::Tensor& x);

  int64_t count() const { return count_; }

  torch::Tensor gate_proj;
  torch::Tensor up_proj;
  torch::Tensor down_proj;

 private:
  int64_t count_;
  double beta1_;
  double beta2_;
};
TORCH_MODULE(StackedExperts);

// The sigmoid router: weight [E, d] and the balancing bias buffer [E] (fp32, selection only).
class RouterImpl : public torch::nn::Module {
 public:
  RouterImpl(int64_t hidden, int64_t num_experts);

  // s = σ(W_r x) for tokens [m, d]: [m, E] in fp32 (fp64 for fp64 tokens).
  torch::Tensor forward(const torch::Tensor& tokens);

  torch::Tensor weight;
  torch::Tensor bias;
};
TORCH_MODULE(Router);

struct MoeRouting {
  torch::Tensor scores;    // [m, n] fp32 (fp64 for fp64 x): unbiased σ(W_r x); differentiable
  torch::Tensor selected;  // [m, k] int64 expert ids, in no particular order within a row
  torch::Tensor weights;   // [m, k] p, aligned with selected; differentiable
};

struct MoeOutput {
  torch::Tensor y;  // [..., d]
  MoeRouting routing;
};

class MoeImpl : public torch::nn::Module {
 public:
  explicit MoeImpl(const MoeOptions& options);

  // The kernels where they apply (see above), else forward_reference.
  MoeOutput forward(const torch::Tensor& x);
  // The plain LibTorch path (permute_tokens, a loop over experts, unpermute), on any device.
  MoeOutput forward_reference(const torch::Tensor& x);

  // Routing alone: scores, selection and mixing weights of x [..., d]. route() takes the fused
  // top-k kernel for CUDA scores where it applies (ties at the k-th place: the lower expert ids;
  // select_experts leaves that order to at::topk); route_reference() is select_experts.
  MoeRouting route(const torch::Tensor& x);
  MoeRouting route_reference(const torch::Tensor& x);

  // Whether forward() takes the kernels for x (always false in the CPU build).
  bool uses_kernels(const torch::Tensor& x) const;

  // Copies a balancer's bias [n] into router.bias (no gradient; it stays fp32).
  void set_expert_bias(const torch::Tensor& bias);

  const MoeOptions& options() const { return options_; }

  Router router{nullptr};
  torch::nn::Linear latent_down{nullptr};
  StackedExperts experts{nullptr};
  RmsNorm latent_norm{nullptr};
  torch::nn::Linear latent_up{nullptr};
  StackedExperts shared_experts{nullptr};  // null when num_shared = 0

 private:
  // route() for the GPU build's kernels; permutation (non-null): also the token permutation of the
  // selection, made before p so that p's recorded backward (the router's sparse d W_r) shares it.
  MoeRouting route(const torch::Tensor& x, kernels::MoePermutation* permutation);

  MoeOptions options_;
  // The expert weights' bf16 copies at the medium float32 matmul precision (model/precision.h).
  Bf16Shadow expert_weights_bf16_[3];
};
TORCH_MODULE(Moe);

}  // namespace odyssey::model
