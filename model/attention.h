// Causal softmax attention that never materializes a Tq×Tk score matrix: the online softmax of
// flash attention (running max and running sum per query row, rescaled accumulator) written in
// plain LibTorch, over tiles of up to `block` query rows × max(block, block²/rows) keys (about
// block² scores per tile, so a decode token's few rows take long key tiles). Gated MLA uses it for its
// parallel, chunked and absorbed-decode forms (model/mla.h); naive_attention is the obviously
// correct reference the tests compare it against.
//
// Shapes (B batch, Hq query heads, Hk key/value heads, D key width, Dv value width):
//   q [B, Hq, Tq, D]    k [B, Hk, Tk, D]    v [B, Hk, Tk, Dv]    ->  o [B, Hq, Tq, Dv]
// Hk must divide Hq; query head h reads key/value head h / (Hq / Hk) (grouped queries). Hk = 1
// is the shared-KV case of MLA's absorbed decode: the query heads are folded into the rows of a
// single matrix product, so the keys and values are never copied per head. q, k, v may be
// non-contiguous views (e.g. a slice of a cache).
//
// Causality: query row i sits at position causal_offset + i relative to k[0], and sees key j iff
// j <= causal_offset + i. causal_offset = Tk - Tq is a chunk (or one decode token) continuing a
// cache; causal_offset = 0 with Tq = Tk is plain self-attention; causal_offset >= Tk - 1 sees
// every key (no mask). A row that sees no key at all (only possible for causal_offset < 0)
// outputs zeros. Tiles of keys wholly in a tile's future are skipped, so the causal case costs
// about half the full product.
//
// Dtypes: the computation (scores, softmax statistics, accumulator) is fp64 when q is fp64 and
// fp32 otherwise (bf16/fp16 inputs are upcast tile by tile). The output is in q's dtype, or in
// that compute dtype when keep_compute_dtype is true (MLA keeps its attention output in fp32).
//
// Memory: besides the inputs and the output, the forward holds O(block² + block·(D + Dv)) per
// (batch, head) at a time and keeps one log-sum-exp per query row (compute dtype) for the
// backward, which saves q, k, v and the compute-dtype output; nothing O(Tq·Tk) is ever held.
//
// Differentiability: blockwise_attention is an autograd function with a flash-attention
// backward that recomputes the scores tile by tile (gradients for q, k and v; none for scale),
// so training memory is also O(T) rather than O(T²). It is differentiable once (no double
// backward). naive_attention is plain autograd.
//
// On the GPU (CUDA tensors in bf16/fp16, as many key/value heads as query heads, head widths <=
// 256) LibTorch's fused kernels run instead, unless allow_fused is false: O(T) memory too, their
// statistics fp32 inside the kernel, the output rounded to q's dtype before the keep_compute_dtype
// cast. They take every causal_offset >= 0 with causal_offset + Tq <= Tk (keys after the last row's
// position are never read), and any causal_offset >= Tk - 1 (rows that see every key, e.g. one
// decode token):
//   - plain self-attention and rows that see every key: scaled_dot_product_attention (flash or
//     memory-efficient; LibTorch >= 2.1);
//   - a chunk continuing a cache (0 < causal_offset): the memory-efficient kernel with its causal
//     mask aligned to the bottom-right (`_efficient_attention_forward`, LibTorch >= 2.4).
// fused_attention_applies() says whether a bf16/fp16 call takes that path; a negative
// causal_offset, or causal_offset + Tq > Tk below Tk - 1, stays blockwise. fp32 CUDA tensors take
// the same kernels by the process's float32 matmul precision (model/precision.h,
// learner.float32_matmul_precision): at medium on bf16 copies with the output back in fp32; at high
// and highest (LibTorch >= 2.4) the memory-efficient kernel on the fp32 operands, whose products
// are 3xTF32 (within ~1e-6 of the fp32 blockwise path). LibTorch's fused backwards may add dq's
// parts in an order that differs between calls.
//
// Errors: shape mismatches throw c10::Error (programming errors, not outside input).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace odyssey::model {

inline constexpr int64_t kAttentionBlock = 256;

at::Tensor blockwise_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               double scale, int64_t causal_offset,
                               int64_t block = kAttentionBlock, bool keep_compute_dtype = false,
                               bool allow_fused = true);

// Threads the CPU forward of blockwise_attention splits its row tiles over (the rows are
// independent, so the result is the same for any count). Separate from LibTorch's intra-op
// threads: with one intra-op thread (what an actor sharing a machine wants: two OpenMP threads
// on two busy cores run the small ops of a decode step several times slower) the attention over
// a long MLA cache, nearly all of the work at a million tokens, can still use more cores.
// Default 1, or the environment variable ODYSSEY_ATTENTION_THREADS (read at the first call; a
// value that is not a whole number from 1 to kMaxCpuAttentionThreads throws a c10::Error naming
// it); process-wide; set_cpu_attention_threads clamps to [1, kMaxCpuAttentionThreads]. The
// backward (training) stays on the calling thread.
inline constexpr int kMaxCpuAttentionThreads = 256;
void set_cpu_attention_threads(int threads);
int cpu_attention_threads();
// ODYSSEY_ATTENTION_THREADS' value as cpu_attention_threads reads it (nullptr or empty: 1).
int parse_cpu_attention_threads(const char* value);

// Whether blockwise_attention(q, k, v, ..., causal_offset) runs LibTorch's fused kernel.
bool fused_attention_applies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             int64_t causal_offset);

// The same contract, by materializing the [B, Hq, Tq, Tk] score matrix. For tests only.
at::Tensor naive_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           double scale, int64_t causal_offset, bool keep_compute_dtype = false);

}  // namespace odyssey::model
