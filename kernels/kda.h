// CUDA kernels of incremental attention (KDA, the gated delta rule with per-channel decay;
// ../../shared/design/MODEL.md, "Incremental attention"). Framework-free launchers: raw device
// pointers, sizes and a stream; each returns the launch's cudaError_t (cudaErrorInvalidValue for
// sizes outside the supported set, checked before anything is launched). The plain LibTorch
// reference they are tested against is model/kda.h (kda::recurrent, kda::chunked_reference,
// kda::step_reference); kernels/torch_bindings.h adapts at::Tensor to these calls.
//
// Semantics, per (sequence, head), token by token:
//   S~ = Diag(exp(g_t)) S;  r = S~^T k_t;  S = S~ + beta_t k_t (v_t - r)^T;  o_t = S^T (scale q_t)
//
// Layouts: every tensor is dense row-major (contiguous) in the shape given; "T" below is an
// element type chosen by `dtype` (bf16 or fp32). g and states are always fp32. Pointers must be
// 16-byte aligned (what the caching allocators return for whole tensors).
//
// Numerics: the state is kept and accumulated in fp32. The chunked forward feeds tensor cores
// with bf16 operands (fp32 accumulate), also for fp32 inputs: the state and the intra-chunk
// products are rounded to bf16 as matmul operands (relative error ~ 2^-9 per product, as in
// published KDA/GDN kernels). The inverse (I + L)^-1 is exact forward substitution in fp32.
// The decode step is fp32 throughout. g must lie in [-5, 0] (the layer's gate guarantees it):
// the chunk of 16 tokens is sized for that exponent budget.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace odyssey::kernels {

enum class KdaDtype : int32_t { kBFloat16 = 0, kFloat32 = 1 };

// Chunked forward (prefill / forward-only), chunks of 16 tokens.
//   q, k       T   [B, L, H, K]
//   v          T   [B, L, H, V]
//   g          f32 [B, L, H, K]    log-decay, in [-5, 0]
//   beta       T   [B, L, H]
//   initial_state f32 [N, H, K, V] or nullptr (zeros)
//   o          T   [B, L, H, V]    written (every position)
//   final_state f32 [N, H, K, V]   written; may alias initial_state (each element is read once
//                                  before it is written, by the same thread)
// Without cu_seqlens: N = batch sequences of `length` tokens each (L = length).
// With cu_seqlens (int32 device array of N + 1 ascending offsets, cu_seqlens[0] = 0): B = 1, the
// N sequences are packed along L = cu_seqlens[N] (= total_tokens), sequence n occupying tokens
// [cu_seqlens[n], cu_seqlens[n + 1]); `batch` is then N and `length` is total_tokens.
// Supported: K in {32, 64, 128}, V in {32, 64, 128}; any length >= 0 (a partly filled last chunk
// is handled exactly); heads >= 1.
//
// Context parallelism (without cu_seqlens only). One CTA walks a (sequence, head, 64 value
// columns; 32 when K or V is 32) chain chunk after chunk; with few such chains and long sequences
// most SMs would idle (B=1, T=64K, H=4: 8 CTAs walking 4096 chunks each). The launcher then
// splits every sequence into P segments of `segment_length` tokens (a multiple of 16, so the
// chunks are the serial ones) and runs three passes on the stream:
//   1. transitions (parallel over segments 0..P-2): each segment from a zero state, giving
//      S_end = A_seg S_start + B_seg (A_seg = product of the chunks' Diag(e^gamma) - K_^T W,
//      B_seg = the end state from zero; both walked as one state [A | B] of K + V columns
//      starting at [I | 0], the A columns with zero values);
//   2. scan (serial over segments, fp32 CUDA cores): S_start[p + 1] = A_p S_start[p] + B_p;
//   3. the ordinary forward of every segment from its S_start (outputs; the last segment writes
//      final_state).
// About 2-3 forward passes of work, all of it parallel. The numerics are those of the serial
// walk (bf16 matmul operands, fp32 accumulation; the scan is fp32), not bitwise equal to it.
// The lead: segment 0 starts from the known initial state, so it needs no transition. With a
// lead, pass 1 walks segment 0 forward (outputs, and its end state as segment 1's start) in the
// same launch as the other segments' transitions, the scan starts at segment 1 and pass 3 walks
// segments 1..P-1. Pass 1 takes two waves of CTAs where pass 3 takes one, so the lead can be
// about twice as long as the other segments for free: every segment is shorter.
struct KdaChunkedOptions {
  // 0: automatic (context parallel when the serial walk's CTAs, batch * heads * V/64 of 4 warps
  // or batch * heads * V/32 of 2 warps, leave the SMs mostly idle and the sequence is long);
  // < 0: never; > 0: segments of this many tokens (a multiple of 16; context parallel whenever
  // that makes more than one segment; ignored with cu_seqlens).
  int64_t segment_length = 0;
  // Tokens of the lead (segment 0 walked forward during pass 1, above): 0 automatic (with
  // whole-head walks, `head_walk` below, and an automatic segment_length: as long as pass 1's
  // waves take, and P - 1 = SMs / (batch * heads) segments after it); < 0 none (segment 0 is an
  // ordinary segment); > 0 this many tokens (a multiple of 16; the other segments then have
  // segment_length tokens, or the automatic length). A lead of the whole sequence is the
  // serial walk.
  int64_t lead_length = 0;
  // Scratch for the context-parallel path, kda_chunked_forward_workspace_bytes() bytes, 16-byte
  // aligned, used only within the call's stream order. nullptr: taken from the stream-ordered
  // allocator (cudaMallocAsync / cudaFreeAsync) when the path is taken.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // While one group of 4 chunks is walked, prefetch the next group's input rows into L2 (a
  // hint: the results are bit for bit the same either way). On by default: B=2, T=16K, H=64:
  // 3.33 ms with it, 3.47 ms without; T=64K, H=4: 1.17 / 1.20 ms. (While the compiler kept two
  // copies of the prepare phase, it was the other way round: kernels/JOURNAL.md, "Performance ladder".)
  bool prefetch = true;
  // bf16 with K = V = 128 (the model's heads): the forward (and the backward's state passes)
  // walks each head with one CTA of 16 warps instead of two CTAs of 4 on 64 value columns each:
  // 8 warps walk the state while 4 pairs prepare the next chunks, each chunk once instead of
  // twice (kernels/JOURNAL.md, "Whole-head walk"). Bit for bit the same results; false: the
  // 64-column CTAs (what the tests and the bench compare against). Devices that cannot give a
  // CTA its 191 KB of shared memory take the 64-column CTAs either way.
  bool head_walk = true;
  // For the backward (kda_chunked_backward): when set, bf16 [N, H, ceil(length / 16), V, K]
  // receives the state entering every chunk of 16 tokens, transposed (row = value column), as
  // the forward rounds it for its matmuls. With o as well, both are written in one walk (a
  // training step's forward keeping the states, so that its backward need not recompute them:
  // kda_chunked_backward's chunk_states; o is the same bit for bit); o nullptr: the states alone.
  // Not with cu_seqlens (cudaErrorInvalidValue).
  void* chunk_states = nullptr;
  // Keep the state entering one chunk in every `chunk_state_interval` (1, 2 or 4; else
  // cudaErrorInvalidValue): chunks 0, i, 2i, ... into [N, H, ceil(ceil(length / 16) / i), V, K],
  // the same values bit for bit. What pass 3 by blocks reads (KdaBackwardOptions::pass3_blocks):
  // 2, or 4 with V' kept (new_values: 64-token blocks read the state entering each, 32-token blocks
  // make every second block's entering state themselves); kda_backward_state_interval says which.
  int chunk_state_interval = 1;
  // With chunk_states: bf16 [B, L, H, V] receives every token's V' = U - W S, the value the walk
  // adds to the state (FLA's v_new), as the walk rounds it for its products; 16-byte aligned (else
  // cudaErrorInvalidValue, as without chunk_states). What pass 3 by blocks reads instead
  // of recomputing it (KdaBackwardOptions::new_values): 2 B L H V bytes more, beside the states'
  // B H L K V / 16 at interval 2.
  void* new_values = nullptr;
};

// Bytes of workspace kda_chunked_forward needs with these options on the current device (0 when
// it will walk serially). `packed`: cu_seqlens is given.
size_t kda_chunked_forward_workspace_bytes(KdaDtype dtype, bool packed, int64_t batch, int64_t length,
                                           int64_t heads, int64_t key_dim, int64_t value_dim,
                                           const KdaChunkedOptions& options);

cudaError_t kda_chunked_forward(KdaDtype dtype, const void* q, const void* k, const void* v,
                                const float* g, const void* beta, const float* initial_state,
                                void* o, float* final_state, const int32_t* cu_seqlens,
                                int64_t batch, int64_t length, int64_t heads, int64_t key_dim,
                                int64_t value_dim, float scale, const KdaChunkedOptions& options,
                                cudaStream_t stream);

// The same with default options (automatic context parallelism, workspace from cudaMallocAsync).
cudaError_t kda_chunked_forward(KdaDtype dtype, const void* q, const void* k, const void* v,
                                const float* g, const void* beta, const float* initial_state,
                                void* o, float* final_state, const int32_t* cu_seqlens,
                                int64_t batch, int64_t length, int64_t heads, int64_t key_dim,
                                int64_t value_dim, float scale, cudaStream_t stream);

// Chunked backward (training): the gradients of kda_chunked_forward's outputs o and final_state
// with respect to every input. Nothing from the forward is needed but its inputs: the state
// entering every chunk is recomputed (a forward pass with KdaChunkedOptions::chunk_states, no
// outputs), then a reverse walk carries dS from the last chunk to the first, then every chunk's
// input gradients are computed independently (design and derivation: kda_backward.cu). bf16
// with K = V = 128: the first two passes walk whole heads (KdaChunkedOptions::head_walk), and
// with few (sequence, head) pairs and 4096 tokens or more both are context parallel (the
// reverse walk as segment transitions, a scan from d_final_state and the segments' walks).
//   q, k, v, g, beta, initial_state, scale: exactly as given to kda_chunked_forward
//   d_o            T   [B, L, H, V]   gradient of o
//   d_final_state  f32 [B, H, K, V]   gradient of final_state, or nullptr (zeros)
//   dq, dk         T   [B, L, H, K]   written (every position), in q's dtype (rounded once)
//   dg             f32 [B, L, H, K]   written; dg is per key channel
//   dv             T   [B, L, H, V]   written
//   dbeta          f32 [B, L, H]      written
//   d_initial_state f32 [B, H, K, V]  written, or nullptr (not wanted); written also when
//                                     initial_state is nullptr (the gradient of a zero state)
// Outputs must not alias inputs. Supported: K, V in {32, 64, 128}, any length >= 0, no cu_seqlens
// (one sequence of `length` tokens per batch entry). Numerics: the forward's (bf16 matmul
// operands, fp32 accumulation); the chunk states and their gradients are kept in bf16 between
// passes, which is how the forward's matmuls saw them. g must lie in [-5, 0].
// chunk_states: nullptr (the states are recomputed, as above), or the states the forward kept:
// KdaChunkedOptions::chunk_states of a kda_chunked_forward on these inputs and initial_state
// (bf16 [N, H, ceil(L / 16), V, K], 16-byte aligned; or every second one, with
// KdaBackwardOptions::chunk_states_interval = 2); the first pass (their recompute) is then
// skipped, with the same gradients bit for bit.
// Workspace: kda_chunked_backward_workspace_bytes() bytes (states_given: chunk_states will be
// passed, and there is no room for them: about half), 16-byte aligned, used only within the stream
// order of the call (two bf16 [B, H, ceil(L / 16), K, V], one of them when the states are given,
// and one fp32 state; with pass3_blocks two of [B, H, ceil(ceil(L / 16) / 2), K, V]);
// nullptr: taken from cudaMallocAsync / cudaFreeAsync on the stream.

// Choices of kda_chunked_backward that change how, not what, it computes (within bf16 rounding).
struct KdaBackwardOptions {
  // Pass 3 by blocks of 32 tokens, two exponent-anchored 16-token sub-chunks each
  // (kda_block_gradient.cuh; bf16 with K = V = 128, ignored otherwise), reading the state entering
  // every block and the gradient of the state leaving it, so that passes 1 and 2 store every second
  // chunk's (kernels/JOURNAL.md, "Seventeenth session"). On by default: at B=2 T=16K H=64 on an H100
  // the backward takes 10.94 ms against 11.57 with 16-token chunks, in half the workspace (4.3
  // against 8.6 GB). false: pass 3 by 16-token chunks (the same gradients within bf16 rounding).
  bool pass3_blocks = true;
  // The interval of the chunk_states given (KdaChunkedOptions::chunk_state_interval of the forward
  // that kept them): 1; 2 with pass3_blocks (which reads only the states entering its blocks); 4
  // with pass3_blocks and new_values (pass 3 then takes its blocks in pairs of one head and makes
  // the state entering each pair's second block from the first's: S_32 = Diag(e^{Gamma_31}) S_0 +
  // K_^T V', in fp32, rounded to bf16 once). Anything else is cudaErrorInvalidValue. Without
  // chunk_states the backward chooses: pass 3 by blocks has pass 2 store every second state
  // gradient, and pass 1 every fourth state with keep_values (every second without).
  int chunk_states_interval = 1;
  // Pass 3 by blocks reading V' and dV' instead of recomputing them (kernels/JOURNAL.md, "Eighteenth
  // session"): pass 1 keeps every token's V' (KdaChunkedOptions::new_values) and pass 2 every
  // chunk's dV', bf16 [B, L, H, V] each in the workspace. Pass 3 then makes three of its five
  // products with the state instead of five, and passes 1 and 2, bound by memory traffic, write
  // 537 MB more each at B=2 T=16K H=64. On by default, the fastest form on both cards measured:
  // on the H200 10.63 ms against 11.05 without it and 10.75 with 16-token chunks; on an H100
  // 10.72-10.74 against 10.82-10.84; workspace 5.38 GB against 4.30. Since the twentieth session
  // V' also lets pass 3 make every second block's entering state from the one before, so that pass
  // 1 stores every fourth chunk's state (kda_backward_state_interval 4): on an H100 pass 1 1.73 ->
  // 1.38 ms, the backward 10.23-10.26 -> 10.01-10.03 ms, workspace 4.30 GB. Ignored where pass 3
  // goes by 16-token chunks.
  bool keep_values = true;
  // With chunk_states and pass 3 by blocks: the V' the same forward kept
  // (KdaChunkedOptions::new_values, bf16 [B, L, H, V], 16-byte aligned; given without chunk_states:
  // cudaErrorInvalidValue); pass 2 then keeps dVb = M^T dV' and pass 3 reads both, as with keep_values.
  // nullptr with chunk_states: pass 3 recomputes them.
  const void* new_values = nullptr;
  // Pass 3's block where it goes by blocks: 64 tokens (kda_block64_gradient.cuh: one item a
  // 64-token block reading the state entering it and the state gradient leaving it once, so that
  // passes 1 and 2 both store every fourth chunk's; no pairs, no state made in pass 3), which needs
  // V' and dVb (keep_values, or new_values with the states given), or 32 (kda_block_gradient.cuh).
  // 0 (the default): 64 where V' and dVb are at hand, else 32. 64 is the faster (H100, B=2 T=16K
  // H=64: the backward 8.55 against 8.89 ms, 7.22 against 7.48 from kept states; workspace 3.23
  // against 4.30 GB; kernels/JOURNAL.md, "Thirty-second session"). Anything but 0, 32 and 64, or 64
  // without V' and dVb, is cudaErrorInvalidValue.
  int pass3_block_tokens = 0;
  // Where pass 3 goes by 64-token blocks: its copies issued by a 17th warp (kda_block64_gradient.cuh's
  // kProducer) instead of by the compute warps: the same bits, slower (8.68-8.72 against
  // 8.52-8.66 ms at the bench's shape, H100).
  bool pass3_block_producer = false;
};

// Enough for any dtype and options (every chunk's states):
size_t kda_chunked_backward_workspace_bytes(int64_t batch, int64_t length, int64_t heads,
                                            int64_t key_dim, int64_t value_dim, bool states_given = false);
// Exactly what the call with this dtype and these options needs (pass 3 by blocks: half the states).
size_t kda_chunked_backward_workspace_bytes(KdaDtype dtype, int64_t batch, int64_t length, int64_t heads,
                                            int64_t key_dim, int64_t value_dim, bool states_given,
                                            const KdaBackwardOptions& options);

// The interval at which the backward with these options reads chunk states (1: every chunk's; 2:
// every second one's, pass 3 by blocks; 4: every fourth one's, pass 3 by blocks reading V', the
// default): what a training step's forward should keep (KdaChunkedOptions::chunk_state_interval)
// for kda_chunked_backward's chunk_states, with V' (KdaChunkedOptions::new_values) at 4.
int kda_backward_state_interval(KdaDtype dtype, int64_t key_dim, int64_t value_dim,
                                const KdaBackwardOptions& options = {});

cudaError_t kda_chunked_backward(KdaDtype dtype, const void* q, const void* k, const void* v,
                                 const float* g, const void* beta, const float* initial_state,
                                 const void* d_o, const float* d_final_state, void* dq,
                                 void* dk, void* dv, float* dg, float* dbeta,
                                 float* d_initial_state, int64_t batch, int64_t length,
                                 int64_t heads, int64_t key_dim, int64_t value_dim, float scale,
                                 const void* chunk_states, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream, const KdaBackwardOptions& options = {});

// One decode token for a batch of sequences; the state is updated in place.
//   q, k  T [B, H, K]    v T [B, H, V]    g f32 [B, H, K]    beta T [B, H]
//   state f32 [B, H, K, V] (read and written)     o T [B, H, V] (written)
// Supported: K in {32, 64, 128}, V a multiple of 32 up to 256.
cudaError_t kda_decode_step(KdaDtype dtype, const void* q, const void* k, const void* v,
                            const float* g, const void* beta, float* state, void* o,
                            int64_t batch, int64_t heads, int64_t key_dim, int64_t value_dim,
                            float scale, cudaStream_t stream);

}  // namespace odyssey::kernels
