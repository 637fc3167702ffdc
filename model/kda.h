// Incremental attention (KDA): the gated delta rule with a per-channel, lower-bounded decay
// (../../shared/design/MODEL.md, "Incremental attention"). Plain LibTorch; this is the reference
// the CUDA kernels are checked against.
//
// Two parts:
//   * namespace kda: the functional core on per-head tensors, in three forms that agree —
//     recurrent (token by token), chunked (the chunked parallel form), step (one decode token).
//   * IncrementalAttention: the layer (projections, short convolutions, gates, output norm),
//     run over a whole sequence, chunk by chunk with a carried KdaState, or one token at a time.
//
// Shapes of the functional core (B batch, T tokens, H heads, K key width, V value width):
//   q, k  [B, T, H, K]   query and key (the layer L2-normalises them; the core does not)
//   v     [B, T, H, V]
//   g     [B, T, H, K]   log-decay per key channel, g <= 0 (alpha = exp(g))
//   beta  [B, T, H]      write strength
//   state [B, H, K, V]   S per head; row i belongs to key channel i
//   scale                multiplies q inside (the layer passes K^-1/2)
// Per token, per head, in this order:
//   S~ = Diag(exp(g_t)) S;  r = S~^T k_t;  S = S~ + beta_t k_t (v_t - r)^T;  o_t = S^T (scale q_t)
//
// Dtypes: the core computes in fp64 when q is fp64 and in fp32 otherwise (bf16/fp16 inputs are
// upcast). The state is kept and returned in that compute dtype (fp32, or fp64 in tests);
// outputs o are returned in q's dtype. An undefined initial_state means zeros.
//
// Differentiability: recurrent and chunked_reference are plain autograd graphs with respect to
// every input, the initial state included (the test checks chunked's gradients against autograd
// through recurrent); chunked is differentiable too, on CUDA through the backward kernel. step updates its state in place and is for
// decode only: its state must not require grad.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include "core/status.h"
#include "model/rms_norm.h"

namespace odyssey::model {

namespace kda {

// Output o [B, T, H, V] and the state after the last token [B, H, K, V].
struct Output {
  at::Tensor o;
  at::Tensor final_state;
};

// Token by token, exactly in the order above. The slow, obviously-correct reference.
Output recurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& g, const at::Tensor& beta, const at::Tensor& initial_state,
                 double scale);

// The chunked parallel form of MODEL.md over chunks of `chunk` tokens (any chunk >= 1; 16 is
// what the fp32 exponent budget is sized for). Per chunk, Gamma is the inclusive cumulative sum
// of g from the chunk's first token, so exp(-Gamma) grows up to exp(chunk * max|g|): for fp32
// keep chunk * max|g| below ~80 (g >= -5 at chunk 16 fits; the layer's gate guarantees it).
// All intra-chunk work is batched over chunks with matmuls; only the state hand-off runs
// chunk after chunk. A partly filled last chunk is padded with zeros (k = v = q = beta = 0,
// g = 0), which leaves every real output and the final state unchanged. Passing final_state
// back as initial_state continues the sequence exactly, so any length runs in bounded memory.
//
// Built with the CUDA kernels (-DODYSSEY_CUDA=ON), chunked runs kernels/kda.h's chunked forward
// when the inputs are CUDA tensors the kernel supports (q, k, v bf16 or fp32, K and V in
// {32, 64, 128}, chunk 16, fp32/fp64 initial state); the kernel assumes g in [-5, 0]. When a
// gradient is needed (grad mode on and an input requires grad) it is recorded for autograd with
// the backward kernel (kda_chunked_backward) as its backward, saving only the inputs; the
// gradients of the gate parameters behind g come from autograd through what made g (the layer's
// kda::gate: a kernel of its own on CUDA, below).
// Otherwise, and always on the CPU, it is chunked_reference. The kernels round matmul operands
// to bf16 (kernels/kda.h, "Numerics"); the backward is first order only. With fp32 inputs and
// the process's float32 matmul precision at medium (model/precision.h, the learner's
// learner.float32_matmul_precision), the kernels run on bf16 copies of q, k, v and beta (o is
// returned in fp32, the gradients reach the fp32 inputs through the casts): their bf16 paths,
// several times faster at the model's heads of 128 (bench kernels, `kda layer`).
Output chunked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& g, const at::Tensor& beta, const at::Tensor& initial_state,
               double scale, int64_t chunk = 16);

// Within its scope, on this thread, the kernels that chunked records for autograd keep the state
// entering every chunk for the backward (kernels/kda_autograd.h, keep_chunk_states): the backward
// skips their recompute, one of its three passes, with the same gradients bit for bit (B=2 T=16K
// H=64 K=V=128: a training step 16.7 -> 15.5 ms), for B T H K V / 8 bytes held from each call's
// forward to its backward (/ 32 for bf16 heads of K = V = 128, whose backward reads every fourth
// chunk's state and makes the others it needs: kernels/kda.h, kda_backward_state_interval; those
// heads also keep every token's V', B T H V 2 bytes, which that backward reads:
// KdaBackwardOptions::keep_values). For a forward whose backward follows soon, over a bounded number of
// tokens: the learner's chunk-by-chunk recompute (learner.kda_keep_chunk_states), where that is
// one chunk of tokens (learner.chunk_tokens). No effect on the CPU or the reference path. Nests;
// the previous setting is restored on exit.
class KeepChunkStatesGuard {
 public:
  explicit KeepChunkStatesGuard(bool keep = true);
  ~KeepChunkStatesGuard();
  KeepChunkStatesGuard(const KeepChunkStatesGuard&) = delete;
  KeepChunkStatesGuard& operator=(const KeepChunkStatesGuard&) = delete;

 private:
  bool previous_;
};
// This thread's setting (false unless inside a KeepChunkStatesGuard(true)).
bool keep_chunk_states();

// The plain LibTorch chunked form above, whatever the build and device (what training
// differentiates through on the CPU, and what the kernel tests compare against).
// `anchor` (0: the chunk) is the number of tokens between exponent anchors inside a chunk, and
// must divide it: the intra-chunk products of row i's sub-chunk of `anchor` tokens are formed
// with exponents relative to that sub-chunk's start (FLA's sub-chunking), so that only e^{anchor
// |g|} has to stay in range, whatever the chunk. With anchor 16 a chunk of 64 tokens is safe at
// g = -5 (one anchor a chunk would need e^{320}); the state hand-off, the only sequential part,
// then runs once every 64 tokens. The form a backward over chunks of 64 is checked against.
Output chunked_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& g, const at::Tensor& beta,
                         const at::Tensor& initial_state, double scale, int64_t chunk = 16,
                         int64_t anchor = 0);

// The backward of chunked_reference(..., chunk, anchor) written out as the kernels compute it
// (kernels/kda_backward.cu's derivation; the anchored intra-chunk products' terms block by block):
// the states entering every chunk (pass 1), dS' leaving every chunk walked backwards (pass 2), and
// every chunk's gradients from its S and dS' (pass 3). Given d_o [B, T, H, V] and d_final_state
// [B, H, K, V] (undefined: zeros), returns the gradients of q, k, v, g, beta and the initial state,
// equal to autograd of chunked_reference (tests: 1e-13 in fp64). `rounding` rounds chosen operands
// to bf16 as a kernel would feed them to tensor cores, by class, to measure which need more:
//   states           S and dS' as pass 3 reads them (stored in bf16)
//   state_products   the other operands of the products with a K x V state (W S, K_ dS', dO S^T,
//                    V' dS'^T, dV' S^T)
//   diagonal_blocks  the operands of the anchored intra-chunk products' diagonal blocks, forward and
//                    backward (exponents up to e^{anchor |g|})
//   off_diagonal_blocks  the same for the blocks below the diagonal (every factor <= 1)
//   small_products   the C x C and C x {K, V} products around M (Aqk^T dO, dO V'^T, M^T dU, G, H,
//                    M^T dM M^T)
// dgamma_from_unrounded multiplies dGamma's terms by the anchored products' unrounded operands (as
// a kernel rounding its mma operands but not its elementwise factors would): that, not the bf16
// operands, is what costs dg its precision (kernels/JOURNAL.md, "Fifteenth session"). The design
// tool for the kernels' numerics, and the plain reference of a blocked backward. fp64 or fp32 as q.
struct Gradients {
  at::Tensor dq, dk, dv, dg, dbeta, d_initial_state;
};
struct BackwardRounding {
  bool states = false, state_products = false, diagonal_blocks = false, off_diagonal_blocks = false,
       small_products = false;
  // dGamma's terms from the anchored products' unrounded operands (their bf16 roundings otherwise)
  bool dgamma_from_unrounded = false;
  // M made by anchor-sized blocks with bf16 operands in the off-diagonal blocks' products (the
  // diagonal blocks' inverses exact, as the kernels' fp32 substitution)
  bool inverse_blocks = false;
  // V' as pass 1's walk makes it (from the exact running state) and stores it (bf16), instead of
  // recomputed in pass 3 as U - W S from the stored S: the kernels' default (keep_values)
  bool values_from_walk = false;
};
// How pass 3 reaches dL (the gradient of the strictly lower L = Diag(beta) P) and dK^'s term through
// W = M Diag(beta) K^, given dV' (write Vb = Diag(beta) V, Kb = Diag(beta) K^, U = M Vb, W = M Kb):
//   kInverseChain   dW = -dV' S^T, dVb = M^T dV', dKb = M^T dW, dM = dV' Vb^T + dW Kb^T and
//                   dL = -M^T dM M^T: kda_backward.cu's derivation, line by line.
//   kInnovations    dVb = M^T dV', dKb = -dVb S^T, dL = -dVb V'^T (strictly lower): the chain collapses,
//                   since -M^T dM M^T = -dVb (M Vb)^T - dKb (M Kb)^T = -dVb U^T + dVb S^T W^T =
//                   -dVb (U - W S)^T. No W, dW, dM nor the two products with M around it.
//   kSubChunkInnovations  the same, with dVb made per sub-chunk of `anchor` tokens, M_aa^T dV'_a, from
//                   the dV' that a reverse walk over those sub-chunks gives (pass 2 walks 16 tokens at a
//                   time and keeps it). dVb = dv / beta is the gradient of an input, the same whatever the
//                   chunking, so only M's diagonal blocks are needed, and the sub-chunk's dV' needs no
//                   correction to the chunk's: what the kernels' pass 3 by blocks computes.
//   kKeptInnovationGradients  the same, with dVb made by the sub-chunk walk itself and stored (rounded
//                   as `states` are) instead of dV': what pass 3 would read if pass 2 kept dVb, so that
//                   it needs no M at all (dv = Diag(beta) dVb from the stored dVb).
enum class BackwardForm { kInverseChain, kInnovations, kSubChunkInnovations, kKeptInnovationGradients };
Gradients chunked_backward_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& g, const at::Tensor& beta,
                                     const at::Tensor& initial_state, double scale, const at::Tensor& d_o,
                                     const at::Tensor& d_final_state, int64_t chunk = 16, int64_t anchor = 0,
                                     const BackwardRounding& rounding = {},
                                     BackwardForm form = BackwardForm::kInverseChain);

// One decode token for a batch: q, k, g [B, H, K], v [B, H, V], beta [B, H]; state
// [B, H, K, V] (fp32 or fp64, contiguous or not) is updated in place. Inputs are cast to the
// state's dtype. Returns o [B, H, V] in q's dtype. Built with the CUDA kernels, a contiguous
// fp32 CUDA state with q, k, v bf16 or fp32, K in {32, 64, 128} and V a multiple of 32 up to 256
// runs kernels/kda.h's decode step (fp32 throughout); otherwise step_reference.
at::Tensor step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& g, const at::Tensor& beta, at::Tensor& state, double scale);

// The plain LibTorch step, whatever the build and device.
at::Tensor step_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& g, const at::Tensor& beta, at::Tensor& state,
                          double scale);

// The layer's decay gate (MODEL.md): g = g_min * sigmoid(exp(A_log[h]) * (z + dt_bias[h, c])) for
// z [..., H, K] (the low-rank projection W_fb W_fa x per head and key channel), A_log [H],
// dt_bias [H K] (or [H, K]); g has z's shape, in the dtype LibTorch's promotion gives (fp32 for a
// bf16 z with fp32 parameters), and lies in [g_min, 0]. Built with the CUDA kernels, CUDA inputs
// with fp32 parameters and K a multiple of 4 run kernels/kda_gate.h (one pass forward, one
// backward, recorded for autograd: dz, dA_log and d dt_bias from one kernel, without the
// reference's two fp32 intermediates of z's size held for the backward); otherwise
// gate_reference.
at::Tensor gate(const at::Tensor& z, const at::Tensor& a_log, const at::Tensor& dt_bias, double g_min);

// The layer's short convolution on q, k or v (MODEL.md: q, k = L2Norm(SiLU(CausalDepthwiseConv4(W x)))
// per head, v = SiLU(Conv4(W_v x))) as plain LibTorch ops, whatever the build and device: SiLU of
// the causal depthwise convolution of the window [conv_inputs | x] with weight (each output the
// products and sums in tap order), then with head > 0 each head's channels times
// rsqrt(sum of their squares + eps). x [B, T, D], conv_inputs [B, W - 1, D] (the inputs before x,
// oldest first; zeros at a sequence's start), weight [D, 1, W]; returns [B, T, D]. The layer takes
// kernels/kda_conv.h instead where it applies (IncrementalAttention, fp32 CUDA tensors).
at::Tensor short_conv_reference(const at::Tensor& x, const at::Tensor& conv_inputs, const at::Tensor& weight,
                                int64_t head, double eps);

// The plain LibTorch gate, whatever the build and device: exp(A) (z + dt_bias), not
// exp(A) z + dt_bias; g_min scales the sigmoid (it is not a clamp).
at::Tensor gate_reference(const at::Tensor& z, const at::Tensor& a_log, const at::Tensor& dt_bias, double g_min);

}  // namespace kda

// Sizes of one incremental-attention layer. Defaults are the full-size per-head values;
// hidden and heads come from the model config.
struct IncrementalAttentionOptions {
  int64_t hidden = 0;
  int64_t heads = 0;
  int64_t head_k_dim = 128;
  int64_t head_v_dim = 128;
  int64_t decay_rank = 128;  // rank of W_fa (shared by heads)
  double g_min = -5.0;       // lower bound of the log-decay: g = g_min * sigmoid(...)
  int64_t conv_width = 4;    // causal depthwise short convolution on q, k, v
  int64_t chunk = 16;        // chunk length of the chunked form
};

// What a layer carries between calls of forward_chunk / step (the decode cache), for a batch.
//   recurrent     [B, H, K, V]           S per head, fp32 (fp64 when the layer is fp64)
//   q_conv_inputs [B, conv_width-1, H*K] the last pre-convolution inputs (W_q x), oldest first
//   k_conv_inputs [B, conv_width-1, H*K] the same for W_k x
//   v_conv_inputs [B, conv_width-1, H*V] the same for W_v x
// A fresh state is all zeros (IncrementalAttentionImpl::initial_state): a sequence start.
struct KdaState {
  at::Tensor recurrent;
  at::Tensor q_conv_inputs;
  at::Tensor k_conv_inputs;
  at::Tensor v_conv_inputs;

  // The same state on `device` (a restored snapshot is on the CPU).
  KdaState to(const at::Device& device) const;

  // A snapshot under the names above: detached, contiguous copies on the CPU, so later
  // in-place decode steps do not change it.
  std::map<std::string, at::Tensor> to_tensors() const;
  // Rebuilds from to_tensors()'s map. kInvalidArgument names a missing, extra or inconsistent
  // tensor (rank, batch, or conv length that does not agree between the four).
  static Result<KdaState> from_tensors(const std::map<std::string, at::Tensor>& tensors);

  // The snapshot as self-describing little-endian bytes (format in kda.cpp); the round trip
  // is bit-exact. from_bytes never crashes on bad input: truncated or malformed bytes are
  // kCorrupt, inconsistent tensors kInvalidArgument.
  std::string to_bytes() const;
  static Result<KdaState> from_bytes(const std::string& bytes);
};

// The layer. Input x [B, T, hidden] (any float dtype the parameters have; .to(kDouble) makes
// the whole layer fp64 for tests), output [B, T, hidden] in the same dtype.
//
//   q = L2Norm_head(SiLU(conv(W_q x))) * K^-1/2      k = L2Norm_head(SiLU(conv(W_k x)))
//   v = SiLU(conv(W_v x))                            beta = sigmoid(W_b x)      per head
//   g = g_min * sigmoid(exp(A_h) * (W_fb W_fa x + dt_bias))                   per head, channel
//   y = W_o(sigmoid(W_g x) * RMSNorm_head(o))        RMSNorm weight shared by heads, eps 1e-5
// L2Norm adds 1e-6 to the sum of squares. conv is causal and depthwise, width conv_width, no
// bias; before the first token of a sequence its inputs are zeros.
//
// Parameter names (stable: they are the checkpoint's tensor names under the layer's prefix).
// D = hidden, H = heads, K = head_k_dim, V = head_v_dim, R = decay_rank, W = conv_width; all
// per-head layouts are head-major (index h*K + i):
//   q_proj.weight  [H*K, D]   W_q            (no bias on any projection)
//   k_proj.weight  [H*K, D]   W_k
//   v_proj.weight  [H*V, D]   W_v
//   q_conv1d.weight [H*K, 1, W]  depthwise conv on W_q x (torch Conv1d layout; tap W-1 meets
//   k_conv1d.weight [H*K, 1, W]  the current token, tap 0 the oldest)
//   v_conv1d.weight [H*V, 1, W]
//   b_proj.weight  [H, D]     W_b (beta)
//   f_a_proj.weight [R, D]    W_fa (decay, shared by heads)
//   f_b_proj.weight [H*K, R]  W_fb
//   A_log          [H]        A_h (the gate uses exp(A_log))
//   dt_bias        [H*K]      dt_bias per (head, channel)
//   g_proj.weight  [H*V, D]   W_g (output gate, full rank)
//   o_norm.weight  [V]        RMSNorm weight shared by heads
//   o_proj.weight  [D, H*V]   W_o
//
// forward, forward_chunk and step agree: forward(x) equals forward_chunk over any split of x
// from a fresh state, which equals step over each token. forward and forward_chunk are
// differentiable (the carried state keeps its graph across forward_chunk calls); step is
// decode only (run it under torch::NoGradGuard). Thread-safety: the three forms only read the
// parameters; a KdaState belongs to one caller at a time.
class IncrementalAttentionImpl : public torch::nn::Module {
 public:
  explicit IncrementalAttentionImpl(const IncrementalAttentionOptions& options);

  // The whole sequence from a fresh state, in chunked form.
  at::Tensor forward(const at::Tensor& x);
  // x [B, T, hidden] (any T >= 1) continuing from `state`, which is replaced by the state after
  // the last token.
  at::Tensor forward_chunk(const at::Tensor& x, KdaState& state);
  // One token x_t [B, hidden] -> [B, hidden]; `state` is updated (the recurrent part in place).
  at::Tensor step(const at::Tensor& x_t, KdaState& state);

  // A zero state for `batch` sequences, on the parameters' device, in the dtypes above.
  KdaState initial_state(int64_t batch) const;

  const IncrementalAttentionOptions& options() const { return options_; }

 private:
  // Projections, convolutions (reading and replacing the conv inputs in `state`), gates and
  // the output side shared by all three forms. x [B, T, hidden].
  struct Features {
    at::Tensor q, k, v, g, beta;  // [B, T, H, K|V], [B, T, H]
  };
  Features features(const at::Tensor& x, KdaState& state);
  at::Tensor output(const at::Tensor& x, const at::Tensor& o);
  // kda::short_conv_reference's result for this layer's projection, and conv_inputs replaced by
  // the last W - 1 inputs of the window (the next call's). Built with the CUDA kernels, fp32 CUDA
  // tensors the fused kernel supports take kernels/kda_conv.h (recorded for autograd).
  at::Tensor conv_features(const at::Tensor& projected, const at::Tensor& weight, at::Tensor& conv_inputs,
                           int64_t head) const;

  IncrementalAttentionOptions options_;
  torch::nn::Linear q_proj_{nullptr}, k_proj_{nullptr}, v_proj_{nullptr};
  torch::nn::Linear b_proj_{nullptr}, f_a_proj_{nullptr}, f_b_proj_{nullptr};
  torch::nn::Linear g_proj_{nullptr}, o_proj_{nullptr};
  // Only their weights are used (the causal left context comes from the state).
  torch::nn::Conv1d q_conv1d_{nullptr}, k_conv1d_{nullptr}, v_conv1d_{nullptr};
  at::Tensor A_log_, dt_bias_;
  RmsNorm o_norm_{nullptr};  // over each head's V values, one weight for all heads
};
TORCH_MODULE(IncrementalAttention);

}  // namespace odyssey::model
