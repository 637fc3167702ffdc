// KDA chunked backward (contract: kernels/kda.h, kda_chunked_backward; math: MODEL.md,
// "Incremental attention"; design and numbers: kernels/README.md). Nothing of the forward is
// kept but its inputs: the chunk-entry states are recomputed, every per-chunk quantity
// (Gamma, Q^, K^, K~, K_, M, W, U, V') is recomputed where it is needed.
//
// =============================================================================================
// Derivation. One chunk of C = 16 tokens of one head (rows i, t, a = tokens, kk = key channel,
// v = value column), S = state entering the chunk, S' = state leaving it. Forward (MODEL.md):
//
//   Gamma = cumsum_rows(g)   gamma = Gamma[C-1]   E = e^Gamma
//   Q^ = scale Q (.) E       K^ = K (.) E         K~ = K (.) E^-1      K_ = K (.) e^gamma E^-1
//   P   = strictly_lower(K^ K~^T)     L = Diag(beta) P       M = (I + L)^-1
//   Aqk = lower_incl_diag(Q^ K~^T)
//   W = M Diag(beta) K^      U = M Diag(beta) V
//   V' = U - W S             O = Q^ S + Aqk V'         S' = Diag(e^gamma) S + K_^T V'
//
// Given dO (C x V) and dS' (K x V), reverse mode through each line, last first:
//
//   S'  = Diag(e^gamma) S + K_^T V':
//         dS   += Diag(e^gamma) dS'            d(e^gamma)[kk] = sum_v dS'[kk][v] S[kk][v]
//         dK_   = V' dS'^T                     dV'  += K_ dS'
//   O   = Q^ S + Aqk V':
//         dQ^  += dO S^T                       dS   += Q^^T dO
//         dAqk  = lower_incl_diag(dO V'^T)     dV'  += Aqk^T dO
//   V'  = U - W S:
//         dU    = dV'                          dW    = -dV' S^T          dS += -W^T dV'
//   Aqk = lower_incl_diag(Q^ K~^T):
//         dQ^  += dAqk K~                      dK~  += dAqk^T Q^
//   U = M Diag(beta) V, W = M Diag(beta) K^ (write Vb = Diag(beta) V, Kb = Diag(beta) K^):
//         dVb = M^T dU      dv = Diag(beta) dVb        dbeta_i += sum_v dVb[i][v] V[i][v]
//         dKb = M^T dW      dK^ += Diag(beta) dKb      dbeta_i += sum_kk dKb[i][kk] K^[i][kk]
//         dM  = dU Vb^T + dW Kb^T
//     With G = dU V^T and H = dW K^^T (C x C):  dM[t][i] = beta_i (G + H)[t][i] and the two dbeta
//     terms are sum_t M[t][i] (G + H)[t][i]: no reduction over v or kk of a C x V or C x K
//     product is needed beyond G and H.
//   M = (I + L)^-1:     dL = -M^T dM M^T, kept strictly lower (L's only free entries)
//     The chain collapses (model::kda::BackwardForm::kInnovations, twenty-ninth session): U = M Vb
//     and W = M Kb, so -M^T dM M^T = -dVb U^T - dKb W^T, and dKb = M^T dW = -dVb S^T; with
//     U - W S = V' that is
//         dKb = -dVb S^T,   dL = -dVb V'^T (strictly lower),   dbeta_i = dVb_i . (V_i) - (dVb S^T)_i . K^_i + ...
//     no dW, dM, G or H. And dVb, the gradient of the input Diag(beta) V, is the same whatever the
//     chunking: a block's is M_aa^T dV'_a for each of its 16-token sub-chunks a, from the dV' pass 2
//     keeps. Pass 3 by blocks with dV' given computes this form.
//   L = Diag(beta) P:   dP = Diag(beta) dL           dbeta_i += sum_j dL[i][j] P[i][j]
//   P = strictly_lower(K^ K~^T):  dK^ += dP K~       dK~ += dP^T K^
//   Back to the inputs, elementwise (E = e^Gamma):
//         dq  = scale dQ^ (.) E
//         dk  = dK^ (.) E + dK~ (.) E^-1 + dK_ (.) e^gamma E^-1
//         dGamma = dQ^ (.) Q^ + dK^ (.) K^ - dK~ (.) K~ - dK_ (.) K_
//         dgamma = sum_rows(dK_ (.) K_) + e^gamma (.) d(e^gamma)
//         dg[s] = sum_{t >= s} dGamma[t] + dgamma           (reverse cumulative sum)
//   The gradient carried to the previous chunk:
//         dS = Q^^T dO + Diag(e^gamma) dS' - W^T dV',   dV' = Aqk^T dO + K_ dS'.
//
// A partly filled last chunk is zero-padded (q = k = v = beta = 0, g = 0) as in the forward: the
// padded rows of Q^, K^, K~, K_ are zero, so they add nothing to dGamma, and padding g with 0
// makes gamma = Gamma[C-1] the last real row's, as the forward has it; dgamma reaches exactly the
// real rows through the reverse cumulative sum. The gate parameters behind g (A_log, dt_bias,
// W_fa, W_fb) get their gradients from autograd through the LibTorch ops that make g.
//
// =============================================================================================
// Passes (all on the caller's stream):
//   1. states: kda_chunked_forward with KdaChunkedOptions::chunk_states, no outputs: the state
//      entering every chunk, bf16, transposed [N, H, chunks, V, K] (exactly the bf16 operand the
//      forward's matmuls saw). Context parallel where the forward would be. Skipped when the
//      caller gives them (a training step's forward kept them: kda.h, chunk_states). Where pass 3
//      goes by 32-token blocks (below) only every second chunk's: chunk_state_interval = 2, and
//      with KdaBackwardOptions::keep_values (the default) every token's V' as well.
//   2. state gradients (kda_state_gradient_kernel): the forward's structure run backwards. One
//      CTA of 4 warps per (sequence, head, 64 value columns), or of 2 warps per 32 columns when K
//      or V is 32 (the forward's Walk tile); warp w holds 16 rows of dS^T in fp32 mma
//      accumulators. Chunks in groups of one per warp, prepared in parallel with the forward's
//      own prepare_chunk (Q^, W, K_, Aqk, e^gamma) plus this CTA's dO columns, then walked last to
//      first: store dS' (bf16, transposed, [N, H, chunks, V, K]; every second chunk's, the
//      gradient of the state leaving each 32-token block, where pass 3 goes by blocks), then
//        dV'^T = dS'^T K_^T + dO^T Aqk,   dS^T = dS'^T Diag(e^gamma) + dO^T Q^ - dV'^T W
//      (mma.sync m16n8k16, bf16 operands, fp32 accumulators). The last dS is d initial_state.
//      With keep_values it also stores every chunk's dVb = M^T dV' (bf16 [N, L, H, V]).
//      bf16 with K = V = 128: kda_head_state_gradient_kernel, one CTA of 16 warps per (sequence,
//      head) with the forward's specialized warps: 8 walk while 4 pairs prepare (head_pipeline);
//      with few heads and a long sequence, context parallel (ReversePlan): segment transitions
//      walked in parallel, the forward's segment scan from d_final_state, then every segment's
//      reverse walk from its dS.
//   3. chunk gradients (kda_chunk_gradient_kernel): every chunk independent, one CTA of 16 warps
//      per chunk at a time (persistent: as many CTAs as fit, each taking every gridDim.x-th
//      chunk and loading the next one's S, dS' and inputs while it finishes the current one),
//      with S and dS' of that chunk in shared memory: recompute the chunk in fp32, then every
//      product on tensor cores - the five with the K x V matrices (W S, K_ dS', dO S^T, V' dS'^T,
//      dV' S^T) and the 16 x 16 x {16, K, V} ones, all with bf16 operands and fp32 accumulators
//      (dGamma's factors the bf16 operands: below) - then dq, dk, dv, dbeta, dg as above.
//      bf16 with K = V = 128 (KdaBackwardOptions::pass3_blocks, the default): by blocks of 32
//      tokens instead (kda_block_gradient_kernel, kda_block_gradient.cuh), reading S entering each
//      block and dS' leaving it, and with keep_values V' and dVb instead of recomputing them.
// Workspace: two bf16 [N, H, chunks, K, V] (S and dS' per chunk; per block with pass 3 by blocks)
// plus one fp32 state, and with keep_values two bf16 [N, L, H, V] (V' and dVb).
#include "kernels/kda.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/kda_chunk.cuh"

namespace odyssey::kernels {
namespace {

// ---------------------------------------------------------------------------------------------
// Pass 2: gradients of the chunk states, walked from the last chunk to the first.

struct StateGradientArgs {
  ChunkedArgs forward;  // q, k, g, beta, heads, value_dim, scale, length (as prepare_chunk reads)
  const void* d_o;               // T [N, L, H, V]
  const float* d_final_state;    // [N, H, K, V] or nullptr (zeros)
  float* d_initial_state;        // [N, H, K, V] or nullptr (not written)
  bf16* chunk_d_states;          // [N, H, ceil(chunks / i), V, K]: dS' leaving chunks i - 1, 2i - 1, ...
                                 // and the last (i = forward.state_interval; written)
  // bf16 [N, L, H, V]: every chunk's dVb = M^T dV' (dV' = K_ dS' + Aqk^T dO, the gradient of V'
  // within its chunk of 16), the gradient of the input Diag(beta) V: the same whatever the chunking
  // (written; nullptr: not kept). Pass 3 by blocks reads it and needs no M.
  bf16* d_new_values;
};

// Chunks of one head's stored states (or state gradients) at one in every `interval`.
__device__ __forceinline__ int64_t stored_chunks(int64_t num_chunks, int interval) {
  return (num_chunks + interval - 1) / interval;
}

// dS' leaving chunk `chunk` (the warp's 16 rows of dS'^T, v_col its first) into its head's
// [ceil(chunks / i), V, K] at chunk / i, when the chunk ends a group of i = interval or is the last:
// the gradient of the state leaving each of pass 3's items. A warp-uniform skip otherwise.
template <int K>
__device__ __forceinline__ void store_d_state(bf16* head_d_states, int interval, int64_t chunk, int64_t num_chunks,
                                              int value_dim, int v_col, const float (&d_state)[K / 8][4], int lane) {
  if ((chunk + 1) % interval != 0 && chunk != num_chunks - 1) return;
  bf16* out = head_d_states + (chunk / interval) * value_dim * K;
  store_state_rows<K>(out + static_cast<int64_t>(v_col) * K, d_state, lane);
}

// One chunk walked backwards by one warp on its 16 rows of dS^T (d_state[K / 8][4]: n-tile j
// holds dS^T[v_row + g (+8)][8j + 2t (+1)], the forward's state layout). slot.v holds this CTA's
// dO columns; v_local is the warp's first column within them. d_new_values (nullptr: not kept):
// where this warp's 16 columns of the chunk's dVb = M^T dV' go (token 0's, rows `stride` apart,
// `valid` of them), bf16; slot.m holds the chunk's M.
template <int K, int kTile, typename Slot = ChunkSlot<K, kTile>>
__device__ void reverse_walk_chunk(const Slot& slot, float (&d_state)[K / 8][4],
                                   int v_local, int lane, bf16* d_new_values = nullptr, int64_t stride = 0,
                                   int valid = 0) {
  const FragmentOffsets f(lane);
  const int t = lane & 3;

  // dV'^T = dS'^T K_^T + dO^T Aqk   [16 value rows x 16 tokens] (slot.k_walk: K_ here)
  float x[2][4] = {};
#pragma unroll
  for (int k0 = 0; k0 < K; k0 += 16) {
    const int j = k0 / 8;
    const uint32_t s[4] = {pack_bf16(d_state[j][0], d_state[j][1]),
                           pack_bf16(d_state[j][2], d_state[j][3]),
                           pack_bf16(d_state[j + 1][0], d_state[j + 1][1]),
                           pack_bf16(d_state[j + 1][2], d_state[j + 1][3])};
    uint32_t b[4];
    ldmatrix_x4(b, &slot.k_walk[f.b_row][k0 + f.b_col]);
    mma(x[0], s, b[0], b[1]);
    mma(x[1], s, b[2], b[3]);
  }
  // dO^T as an A operand: dO is stored [token][value] = [k][m], hence ldmatrix .trans with
  // matrices (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15).
  uint32_t a_do[4];
  {
    const int r = lane & 7, m = lane >> 3;
    ldmatrix_x4_trans(a_do, &slot.v[(m >> 1) * 8 + r][v_local + (m & 1) * 8]);
    uint32_t b[4];
    ldmatrix_x4_trans(b, &slot.a_qk[f.t_row][f.t_col]);
    mma(x[0], a_do, b[0], b[1]);
    mma(x[1], a_do, b[2], b[3]);
  }
  // -dV'^T as an A operand (an accumulator pair is an m16k16 A fragment).
  const uint32_t neg_dv[4] = {pack_bf16(-x[0][0], -x[0][1]), pack_bf16(-x[0][2], -x[0][3]),
                              pack_bf16(-x[1][0], -x[1][1]), pack_bf16(-x[1][2], -x[1][3])};
  if (d_new_values != nullptr) {  // dVb^T = dV'^T M, with dV'^T the sign bits flipped back (exact)
    const uint32_t dv[4] = {neg_dv[0] ^ 0x80008000u, neg_dv[1] ^ 0x80008000u, neg_dv[2] ^ 0x80008000u,
                            neg_dv[3] ^ 0x80008000u};
    uint32_t b[4];
    ldmatrix_x4_trans(b, &slot.m[f.t_row][f.t_col]);  // M[t][i]: k = t, n = i
    float y[2][4] = {};
    mma(y[0], dv, b[0], b[1]);
    mma(y[1], dv, b[2], b[3]);
    const uint32_t d_vb[4] = {pack_bf16(y[0][0], y[0][1]), pack_bf16(y[0][2], y[0][3]), pack_bf16(y[1][0], y[1][1]),
                              pack_bf16(y[1][2], y[1][3])};
    store_transposed_tile(d_new_values, stride, d_vb, valid, lane);
  }

  // dS^T = dS'^T Diag(e^gamma) + dO^T Q^ - dV'^T W.
#pragma unroll
  for (int n0 = 0; n0 < K; n0 += 16) {
    uint32_t bq[4], bw[4];
    ldmatrix_x4_trans(bq, &slot.q_hat[f.t_row][n0 + f.t_col]);
    ldmatrix_x4_trans(bw, &slot.w[f.t_row][n0 + f.t_col]);
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int j = n0 / 8 + n;
      const float2 d = *reinterpret_cast<const float2*>(&slot.decay_last[8 * j + 2 * t]);
      d_state[j][0] *= d.x, d_state[j][1] *= d.y, d_state[j][2] *= d.x, d_state[j][3] *= d.y;
    }
    mma(d_state[n0 / 8], a_do, bq[0], bq[1]);
    mma(d_state[n0 / 8 + 1], a_do, bq[2], bq[3]);
    mma(d_state[n0 / 8], neg_dv, bw[0], bw[1]);
    mma(d_state[n0 / 8 + 1], neg_dv, bw[2], bw[3]);
  }
}

// Grid (V / kTile, H, N), kTile / 16 warps (Walk). Same shared memory as the forward (a chunk
// slot per warp): two CTAs of 4 warps per SM at K = 128.
template <typename T, int K, int kTile>
__global__ void __launch_bounds__(Walk<kTile>::kThreads, 2)
    kda_state_gradient_kernel(const StateGradientArgs b) {
  constexpr int kWarps = Walk<kTile>::kWarps;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  ChunkSlot<K, kTile>* slots = reinterpret_cast<ChunkSlot<K, kTile>*>(shared_raw);
  const ChunkedArgs& a = b.forward;

  const int lane = threadIdx.x & 31, warp = warp_index();
  const int h = blockIdx.y, seq = blockIdx.z;
  const int H = a.heads, V = a.value_dim;
  const int v0 = blockIdx.x * kTile, v_col = v0 + warp * 16;
  const int64_t length = a.length, row0 = static_cast<int64_t>(seq) * length;
  const int64_t num_chunks = (length + kChunk - 1) / kChunk;
  const int64_t state_offset = (static_cast<int64_t>(seq) * H + h) * K * V;

  float d_state[K / 8][4];
  load_state_tile<K>(d_state, b.d_final_state, state_offset, V, v_col, lane);

  const int interval = a.state_interval;
  bf16* d_states =
      b.chunk_d_states + (static_cast<int64_t>(seq) * H + h) * stored_chunks(num_chunks, interval) * V * K;
  for (int64_t group = (num_chunks - 1) / kWarps * kWarps; group >= 0; group -= kWarps) {
    const int64_t mine = group + warp;
    if (mine < num_chunks) {
      const int valid = static_cast<int>(min64(kChunk, length - mine * kChunk));
      prepare_chunk<T, K, kTile, /*kOutputs=*/true, /*kGradients=*/true>(a, slots[warp], row0 + mine * kChunk, valid,
                                                    h, v0, /*with_values=*/false, lane);
      load_value_rows<T, kTile>(static_cast<const T*>(b.d_o), slots[warp].v, row0 + mine * kChunk,
                                valid, h, H, V, v0, lane);
    }
    __syncthreads();
    const int count = static_cast<int>(min64(kWarps, num_chunks - group));
    for (int s = count - 1; s >= 0; --s) {
      // dS' of this chunk (the gradient of the state leaving it), as pass 3 reads it.
      store_d_state<K>(d_states, interval, group + s, num_chunks, V, v_col, d_state, lane);
      const int64_t chunk_row = row0 + (group + s) * kChunk;
      reverse_walk_chunk<K, kTile>(
          slots[s], d_state, v_col - v0, lane,
          b.d_new_values ? b.d_new_values + (chunk_row * H + h) * static_cast<int64_t>(V) + v_col : nullptr,
          static_cast<int64_t>(H) * V, static_cast<int>(min64(kChunk, length - (group + s) * kChunk)));
    }
    __syncthreads();
  }

  if (b.d_initial_state == nullptr) return;
  store_state_tile<K>(b.d_initial_state, state_offset, d_state, V, v_col, lane);
}

// The reverse walk of a whole head (bf16, K = V = 128), with the forward's specialized warps
// (head_pipeline, kda_chunk.cuh; kda.cu, kda_head_kernel): one CTA of 16 warps per (sequence,
// head) instead of two of 4 on 64 value columns each, so each chunk is prepared once (by a pair
// of warps, prepare_chunk_pair, while the walkers walk the chunks after it), last chunk first.
// The same operations in the same order as kda_state_gradient_kernel: the same dS' and
// d initial state, bit for bit.
//
// Context parallelism (few heads, long sequences; reverse_plan): the reverse step is affine in
// dS', dS = (Diag(e^gamma) - W^T K_) dS' + (Q^^T - W^T Aqk^T) dO, so a segment's
// dS_enter = A'_p dS_leave + B'_p, as the forward's transitions, transposed:
//   kTransition  grid (2, H, N (P - 1)), segments p = 1..P-1: x = 0 walks A'_p's K columns from I
//                with dO = 0, x = 1 B'_p's from 0; both stored at pair slot P - 1 - p (A'^T, as
//                the forward's A_seg), so that kda.cu's segment scan, started from d_final_state,
//                gives dS leaving segment P - 1 - r at states[r];
//   kForward     grid (1, H, N P): every segment's reverse walk from its dS_leave, storing dS' for
//                its chunks; segment 0 writes d initial_state.
// P = 1 (forward.segments) is the serial walk: one segment of every chunk from d_final_state.
template <int K, int V, Pass kPass>
__global__ void __launch_bounds__(kHeadThreads, 1) kda_head_state_gradient_kernel(const StateGradientArgs b) {
  static_assert(kPass != Pass::kStates, "the reverse walk or its transitions");
  constexpr bool kTransition = kPass == Pass::kTransition;
  using Shared = HeadShared<K, V, /*kGradients=*/true>;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  Shared& sh = *reinterpret_cast<Shared*>(shared_raw);
  const ChunkedArgs& a = b.forward;
  const bf16* d_o = static_cast<const bf16*>(b.d_o);

  const int lane = threadIdx.x & 31, warp = warp_index();
  const int h = blockIdx.y, P = a.segments;
  const int per_sequence = kTransition ? P - 1 : P;
  const int seq = blockIdx.z / per_sequence;
  const int segment = (kTransition ? 1 : 0) + static_cast<int>(blockIdx.z % per_sequence);
  const bool a_columns = kTransition && blockIdx.x == 0;  // A'_p: from I, dO = 0
  const int H = a.heads;
  const int64_t length = a.length, row0 = static_cast<int64_t>(seq) * length;
  const int64_t num_chunks = (length + kChunk - 1) / kChunk;
  // Chunks a segment (P > 1: segment_length is whole chunks; P = 1: every chunk, a partial last one too).
  const int64_t segment_chunks = (a.segment_length + kChunk - 1) / kChunk;
  const int64_t chunk_end = min64(num_chunks, (segment + 1) * segment_chunks);
  const int64_t count = chunk_end - min64(num_chunks, segment * segment_chunks);
  const int64_t state_offset = (static_cast<int64_t>(seq) * H + h) * K * V;
  auto valid_rows = [&](int64_t chunk) { return static_cast<int>(min64(kChunk, length - chunk * kChunk)); };

  // Walking warps: 16 rows of dS^T.
  const bool walker = warp < kHeadWalkWarps;
  const int v_col = warp * 16;
  float d_state[K / 8][4];
  if (walker) {
    if constexpr (kTransition) {
      transition_start_tile<K>(d_state, v_col, a_columns, lane);
    } else if (P > 1) {
      const int64_t r = P - 1 - segment;  // the scan's order: from the last segment
      load_state_tile<K>(d_state, a.segment_states, ((static_cast<int64_t>(seq) * P + r) * H + h) * K * V, V, v_col,
                         lane);
    } else {
      load_state_tile<K>(d_state, b.d_final_state, state_offset, V, v_col, lane);
    }
  }
  const int interval = a.state_interval;
  bf16* d_states =
      b.chunk_d_states + (static_cast<int64_t>(seq) * H + h) * stored_chunks(num_chunks, interval) * V * K;
  // Preparing pairs.
  const int pair = (warp - kHeadWalkWarps) >> 1, member = warp & 1;
  float beta = 0.0f;  // the staged chunk's beta (member 0, lanes 0-15)

  // Walk order i = 0, 1, ...: chunk chunk_end - 1 - i.
  head_pipeline(
      count, warp,
      [&](int slot, int64_t i) {
        const int64_t chunk = chunk_end - 1 - i;
        bf16* d_new_values = nullptr;  // this chunk's dVb rows, where kept
        if constexpr (!kTransition) {
          // dS' of this chunk (the gradient of the state leaving it), as pass 3 reads it.
          store_d_state<K>(d_states, interval, chunk, num_chunks, V, v_col, d_state, lane);
          if (b.d_new_values != nullptr) {
            d_new_values = b.d_new_values + ((row0 + chunk * kChunk) * H + h) * static_cast<int64_t>(V) + v_col;
          }
        }
        reverse_walk_chunk<K, V>(sh.slot[slot], d_state, v_col, lane, d_new_values, static_cast<int64_t>(H) * V,
                                 valid_rows(chunk));
      },
      [&](int64_t i) {
        const int64_t chunk = chunk_end - 1 - i;
        for (int part = 0; part < 4; ++part) {
          issue_head_loads<K, V, /*kOutputs=*/true>(a, d_o, sh.staging[pair], row0 + chunk * kChunk,
                                                    valid_rows(chunk), h, member, lane, part, beta, !a_columns);
        }
      },
      [&](int slot, int64_t) {
        prepare_chunk_pair<K, V, /*kOutputs=*/true, /*kGradients=*/true>(
            a, sh.slot[slot], sh.scratch[pair], sh.staging[pair], preparing_pair_barrier(pair), member, beta, lane,
            !a_columns);
      });

  if (!walker) return;
  if constexpr (kTransition) {
    // A'_p (transposed) or B'_p at pair slot P - 1 - p: the scan's order, from the last segment.
    store_transition_tile<K>(a, d_state, (static_cast<int64_t>(seq) * (P - 1) + (P - 1 - segment)) * H + h, V, v_col,
                             a_columns, lane);
  } else {
    if (segment != 0 || b.d_initial_state == nullptr) return;
    store_state_tile<K>(b.d_initial_state, state_offset, d_state, V, v_col, lane);
  }
}

// ---------------------------------------------------------------------------------------------
// Pass 3: the gradients of every chunk's inputs, chunks independent.
//
// Every product is an m16n8k16 tensor-core product with bf16 operands and fp32 accumulation,
// handed out to the CTA's 16 warps as tasks (a task: one 16-column tile of one product; several
// independent products share a phase): the five with a K x V matrix (W S, K_ dS', dO S^T,
// V' dS'^T, dV' S^T) and the 16 x 16 x {16, K, V} ones (P, Aqk, dAqk, G, H, W, U, dv, dM M^T,
// M^T (.), the dQ^ / dK^ / dK~ terms). Until the fifteenth session the latter were fp32-grade
// (each operand split into bf16 hi + lo, three mma a product), for dg's sake at g = -5. The
// emulation in model::kda::chunked_backward_reference (kernels/JOURNAL.md, "Fifteenth session")
// showed that the operands' rounding was never the problem: dGamma's elementwise factors were.
// Each pair (i, j) of P or Aqk adds dA_ij x_i k_j to dGamma_i and takes it from dGamma_j, and dg's
// reverse cumulative sum cancels the two; multiplying dGamma's terms by the bf16 values the
// products saw (Q^, K^, K~ as stored here) keeps the two equal, and every gradient stays close to
// the fp32-grade kernel's error (emulated: 3.4-4.5e-3 of the largest magnitude against 2.8-3.4e-3).
// K_ enters only products with the state, and dGamma and dgamma both take its fp32 value.
// All operands reach the tensor cores by ldmatrix, except the 16 x 16 fp32 matrices read once a
// task and packed in registers (M Diag(beta), dM, dM M^T).

constexpr int kGradientWarps = 16;
constexpr int kGradientThreads = kGradientWarps * 32;

struct ChunkGradientArgs {
  const void *q, *k, *v, *beta, *d_o;
  const float* g;
  // S entering chunks 0, i, 2i, ... and dS' leaving chunks i - 1, 2i - 1, ... and the last, at
  // [N, H, ceil(chunks / i), V, K] with their own intervals i (1 for the 16-token pass).
  const bf16* chunk_states;
  const bf16* chunk_d_states;
  int states_interval, d_states_interval;
  // Pass 3 by blocks, where passes 1 and 2 kept them (bf16 [N, L, H, V]; nullptr: recomputed): V'
  // of every token (the forward walk's) and dVb = M^T dV' of every 16-token chunk (the reverse
  // walk's).
  const bf16* new_values;
  const bf16* d_new_values;
  void *dq, *dk, *dv;          // T, as q, k, v
  float *dg, *dbeta;
  int64_t length;
  int64_t items;  // chunks x heads x sequences
  int heads;
  float scale;
};

// dg of one key channel over an item's kRows rows: acc plus the reverse cumulative sum of the
// channel's column (column[i * ld], i = kRows - 1 .. 0), stored down dg's rows (out: the item's
// first, stride apart; rows < valid). The sums first, then the stores down one pointer: with each
// row's address from its token (64-bit products) between the adds, the 16-token pass's phase 9
// took ~1K cycles.
template <int kRows>
__device__ __forceinline__ void store_reverse_column_sum(float* out, int64_t stride, const float* column, int ld,
                                                         float acc, int valid) {
  float sum[kRows];
#pragma unroll
  for (int i = kRows - 1; i >= 0; --i) {
    acc += column[i * ld];
    sum[i] = acc;
  }
#pragma unroll
  for (int i = 0; i < kRows; ++i, out += stride) {
    if (i < valid) *out = sum[i];
  }
}

// A pass-3 item: `tokens` consecutive rows of one (sequence, head) - a chunk, or a block of
// kda_block_gradient.cuh - with items numbered (sequence H + head) per_head + index.
struct GradientItem {
  int64_t index, row0;  // index: the item's place in its head; row0: its first row in [B * L]
  int h, seq, valid;    // valid: its rows before the sequence's end
  __device__ static GradientItem at(int64_t w, int64_t per_head, int tokens, int heads, int64_t length) {
    GradientItem it;
    it.index = w % per_head;
    const int64_t head_seq = w / per_head;
    it.h = static_cast<int>(head_seq % heads), it.seq = static_cast<int>(head_seq / heads);
    it.row0 = static_cast<int64_t>(it.seq) * length + it.index * tokens;
    it.valid = static_cast<int>(min64(tokens, length - it.index * tokens));
    return it;
  }
};

// A 16 x 16 matrix as a bf16 mma operand, written once by the warp that makes it and read as A
// fragments by ldmatrix (.trans for its transpose) by every task that multiplies by it. Rows of 24:
// ldmatrix rows in distinct banks.
struct Small16 {
  static constexpr int kRow = kChunk + 8;
  bf16 x[kChunk][kRow];
  __device__ __forceinline__ void store(int i, int c, float y) { x[i][c] = __float2bfloat16_rn(y); }
};

// Shared memory of one chunk (K = V = 128: 197 KB; one CTA per SM). bf16 rows padded by 8
// elements (ldmatrix rows in distinct bank groups), the [16][K] and [16][V] fp32 arrays by 8 (the
// 8-byte stores and loads of a 16-column tile without conflicts), the 16 x 16 fp32 ones by 4 (the
// accumulator layout's (g, 2t) and (2t, g) reads: 2-way and none).
template <int K, int V>
struct alignas(16) GradientShared {
  static constexpr int kRowK = K + 8, kRowV = V + 8;
  static constexpr int kPadK = K + 8, kPadV = V + 8, kPadC = kChunk + 4;
  static constexpr int kDecaySlices = kGradientThreads / 2 / (K / 2);  // of the V rows (d_decay)
  bf16 s_t[V][kRowK];          // S^T of the chunk's entering state
  bf16 ds_t[V][kRowK];         // dS'^T
  bf16 a_kbar[kChunk][kRowK];  // K_
  // Phases 1-5 only (dead in phases 6-9, not written in phase 0): their space holds the next
  // chunk's inputs, staged by cp.async during phases 6-9 and read by phase 0.
  struct Live {
    bf16 a_w[kChunk][kRowK];     // W    (A operand of W S)
    bf16 vn_b[kChunk][kRowV];    // V'   (A of V' dS'^T, B of dO V'^T)
    bf16 dvn_b[kChunk][kRowV];   // dV'  (A of dV' S^T and dV' V^T, B of M^T dV')
    float vn[kChunk][kPadV];     // U = M Diag(beta) V
    float dvn[kChunk][kPadV];    // K_ dS' (then + Aqk^T dO = dV', kept as dvn_b)
  };
  struct Staged {                // bf16 inputs of the next chunk, rows past its end zero (its v
    bf16 q[kChunk][K], k[kChunk][K];  // and dO go straight to v and d_o, dead after phase 5)
    float g[kChunk][K];
  };
  union alignas(16) {
    Live live;
    Staged next;
  };
  bf16 q_hat[kChunk][kRowK], k_hat[kChunk][kRowK], k_check[kChunk][kRowK];  // Q^, K^, K~
  bf16 d_w[kChunk][kRowK];     // -dV' S^T = dW
  bf16 d_o[kChunk][kRowV], v[kChunk][kRowV];
  float gamma[kChunk][kPadK];  // Gamma; dGamma after the elementwise phase
  float k_bar[kChunk][kPadK];  // K_ in fp32
  float d_qhat[kChunk][kPadK];    // dO S^T, then + dAqk K~ = dQ^
  float d_kbar[kChunk][kPadK];    // V' dS'^T = dK_
  float d_khat[kChunk][kPadK];    // M^T dW, then dK^ = Diag(beta) (M^T dW + dL K~)
  float d_kcheck[kChunk][kPadK];  // dAqk^T Q^, then + (Diag(beta) dL)^T K^ = dK~
  float p[kChunk][kPadC];      // strictly_lower(K^ K~^T)
  float m[kChunk][kPadC];      // (I + Diag(beta) P)^-1
  float d_m[kChunk][kPadC];    // G = dV' V^T, then dM
  union alignas(16) {
    float t1[kChunk][kPadC];   // dM M^T (phase 6)
    float l_t[kChunk][kChunk]; // (Diag(beta) P)^T, rows 16-byte aligned (phase 1, for M)
  };
  float d_l[kChunk][kPadC];    // dL (strictly lower)
  float x_beta[kChunk][kPadC]; // M (.) (G + H): column sums are dbeta's U and W terms
  float beta[kChunk];
  float decay[K];              // e^gamma
  Small16 a_qk;                // lower_incl_diag(Q^ K~^T)     (phase 1; A^T of Aqk^T dO)
  Small16 m_b;                 // M      (phase 4: phases 5, 6)
  Small16 d_aqk;               // dAqk   (phase 5: phase 6)
  Small16 d_l_b, beta_d_l;     // dL, Diag(beta) dL   (phase 6: phase 7)
  float d_decay[kDecaySlices][K];  // sum_v dS' (.) S over slices of the V rows
  float d_gamma[K];            // dgamma = sum_rows(dK_ (.) K_) + e^gamma (.) d(e^gamma) (phase 7)
};

template <int K, int V>
constexpr size_t gradient_shared_bytes() {
  static_assert(sizeof(GradientShared<K, V>) <= 227 * 1024, "more than an SM's shared memory");
  return sizeof(GradientShared<K, V>);
}

// B fragments of two n-tiles (columns n0 .. n0 + 15) at k-step k0 by ldmatrix: stored rows = n
// (k contiguous) when !kTransB, rows = k (n contiguous) when kTransB.
template <bool kTransB>
__device__ __forceinline__ void load_b16(uint32_t (&b)[4], const bf16* base, int ldb, int k0, int n0,
                                         const FragmentOffsets& f) {
  if constexpr (kTransB) {
    ldmatrix_x4_trans(b, base + (k0 + f.t_row) * ldb + n0 + f.t_col);
  } else {
    ldmatrix_x4(b, base + (n0 + f.b_row) * ldb + k0 + f.b_col);
  }
}

// Hands a 16 x 16 result tile (two m16n8 accumulators) to `store(i, col, x)`, or with kPairs to
// `store(i, col, x, y)` a pair of adjacent columns at a time (col even: stores of two elements).
template <bool kPairs = false, typename Store>
__device__ __forceinline__ void store_tile16(const float (&acc)[2][4], int n0, int lane, Store store) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    if constexpr (kPairs) {
      store(g, n0 + n * 8 + 2 * t, acc[n][0], acc[n][1]);
      store(g + 8, n0 + n * 8 + 2 * t, acc[n][2], acc[n][3]);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) store(g + (e >> 1) * 8, n0 + n * 8 + 2 * t + (e & 1), acc[n][e]);
    }
  }
}

// kTiles 16 x 16 tiles (columns n0 .. n0 + 16 kTiles - 1) of out = A[16][kKdim] B, A rows of
// stride lda, its fragments loaded once a k-step for all the tiles.
template <int kKdim, bool kTransB, int kTiles = 1, typename Store>
__device__ __forceinline__ void mma_tile16(const bf16* a, int lda, const bf16* b, int ldb, int n0,
                                           int lane, Store store) {
  const FragmentOffsets f(lane);
  float acc[kTiles][2][4] = {};
#pragma unroll 4
  for (int k0 = 0; k0 < kKdim; k0 += 16) {
    uint32_t af[4];
    ldmatrix_x4(af, a + f.a_row * lda + k0 + f.a_col);
#pragma unroll
    for (int x = 0; x < kTiles; ++x) {
      uint32_t bf[4];
      load_b16<kTransB>(bf, b, ldb, k0, n0 + 16 * x, f);
      mma(acc[x][0], af, bf[0], bf[1]);
      mma(acc[x][1], af, bf[2], bf[3]);
    }
  }
#pragma unroll
  for (int x = 0; x < kTiles; ++x) store_tile16(acc[x], n0 + 16 * x, lane, store);
}

// The n8 tile `half` (columns n0 + 8 half .. + 7) of mma_tile16's product, for two warps to share
// one product on the critical path (H in phase 6): two chains of 8 k-steps each instead of one of 16.
template <int kKdim, bool kTransB, typename Store>
__device__ __forceinline__ void mma_half16(const bf16* a, int lda, const bf16* b, int ldb, int n0, int half,
                                           int lane, Store store) {
  const FragmentOffsets f(lane);
  float acc[2][4] = {};
#pragma unroll
  for (int k0 = 0; k0 < kKdim; k0 += 16) {
    uint32_t af[4], bf[4];
    ldmatrix_x4(af, a + f.a_row * lda + k0 + f.a_col);
    load_b16<kTransB>(bf, b, ldb, k0, n0, f);
    mma(acc[(k0 / 16) & 1], af, half ? bf[2] : bf[0], half ? bf[3] : bf[1]);
  }
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int e = 0; e < 4; ++e) store(g + (e >> 1) * 8, n0 + half * 8 + 2 * t + (e & 1), acc[0][e] + acc[1][e]);
}

// Sources of the A fragment of a 16 x 16 matrix: a Small16 (kTrans: of its transpose), or fp32
// reads a(i, k) packed in registers.
template <bool kTrans>
struct SmallA {
  const Small16& s;
  __device__ __forceinline__ void operator()(int lane, uint32_t (&a)[4]) const {
    const FragmentOffsets f(lane);
    // A[i][k] = X[k][i]: matrices X(0-7, 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15) transposed.
    if constexpr (kTrans) ldmatrix_x4_trans(a, &s.x[f.b_row][f.b_col]);
    else ldmatrix_x4(a, &s.x[f.a_row][f.a_col]);
  }
};
template <typename A>
struct RegisterA {
  A a;
  __device__ __forceinline__ void operator()(int lane, uint32_t (&r)[4]) const {
    const int g = lane >> 2, c0 = 2 * (lane & 3), c1 = c0 + 8;
    r[0] = pack_bf16(a(g, c0), a(g, c0 + 1));
    r[1] = pack_bf16(a(g + 8, c0), a(g + 8, c0 + 1));
    r[2] = pack_bf16(a(g, c1), a(g, c1 + 1));
    r[3] = pack_bf16(a(g + 8, c1), a(g + 8, c1 + 1));
  }
};
template <typename A>
__device__ __forceinline__ RegisterA<A> in_registers(const A& a) { return {a}; }

// One 16 x 16 tile of out = A[16][16] B[16][*]: A's fragment from a_source (above), B rows = k
// (n contiguous, ldmatrix .trans). kPairs: as store_tile16's.
template <bool kPairs = false, typename ASource, typename Store>
__device__ __forceinline__ void mma_small_a_tile16(const ASource& a_source, const bf16* b, int ldb, int n0,
                                                   int lane, Store store) {
  const FragmentOffsets f(lane);
  uint32_t af[4], bf[4];
  a_source(lane, af);
  load_b16<true>(bf, b, ldb, 0, n0, f);
  float acc[2][4] = {};
  mma(acc[0], af, bf[0], bf[1]);
  mma(acc[1], af, bf[2], bf[3]);
  store_tile16<kPairs>(acc, n0, lane, store);
}

// Sources of the B fragment of one n8 tile (columns n0 .. n0 + 7) of a 16 x 16 B: fp32 reads
// b(k, n) packed in registers, or a Small16 X with B(k, n) = X[n][k] (rows = n: ldmatrix).
template <typename B>
struct RegisterB {
  B b;
  __device__ __forceinline__ void operator()(int n0, int lane, uint32_t (&r)[2]) const {
    const int g = lane >> 2, c0 = 2 * (lane & 3), c1 = c0 + 8;
    r[0] = pack_bf16(b(c0, n0 + g), b(c0 + 1, n0 + g));
    r[1] = pack_bf16(b(c1, n0 + g), b(c1 + 1, n0 + g));
  }
};
template <typename B>
__device__ __forceinline__ RegisterB<B> b_in_registers(const B& b) { return {b}; }
struct SmallRowsB {
  const Small16& s;
  __device__ __forceinline__ void operator()(int n0, int lane, uint32_t (&r)[2]) const {
    // lanes 0-7: rows n0 .. n0 + 7, k 0-7; lanes 8-15: k 8-15 (lanes 16-31 repeat them).
    const int row = lane & 7, m = (lane >> 3) & 1;
    uint32_t x[4];
    ldmatrix_x4(x, &s.x[n0 + row][m * 8]);
    r[0] = x[0], r[1] = x[1];
  }
};

// One 16 x 8 tile (columns n0 .. n0 + 7) of out = A[16][16] B[16][*], fragments from a_source and
// b_source (above) (dM M^T, M^T (dM M^T)).
template <typename ASource, typename BSource, typename Store>
__device__ __forceinline__ void mma_small_tile8(const ASource& a_source, const BSource& b_source, int n0, int lane,
                                                Store store) {
  const int g = lane >> 2, t = lane & 3;
  uint32_t af[4], bf[2];
  a_source(lane, af);
  b_source(n0, lane, bf);
  float acc[4] = {};
  mma(acc, af, bf[0], bf[1]);
  store(g, n0 + 2 * t, acc[0]);
  store(g, n0 + 2 * t + 1, acc[1]);
  store(g + 8, n0 + 2 * t, acc[2]);
  store(g + 8, n0 + 2 * t + 1, acc[3]);
}

// Two adjacent bf16 of shared memory as a float2, and a float2 as two adjacent bf16.
__device__ __forceinline__ float2 load_bf16x2(const bf16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
__device__ __forceinline__ void store_bf16x2(bf16* p, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}

// A pair of warps (0 and 1) waits for each other (named barrier 1; barrier 0 is __syncthreads).
__device__ __forceinline__ void warp_pair_barrier() { asm volatile("bar.sync 1, 64;\n" ::: "memory"); }

// Column c of M = (I + L)^-1 for a strictly lower L given as its transpose l_t[j][i] = L[i][j]
// (rows 16-byte aligned): unit_lower_inverse_column's right-looking substitution, the same terms in
// the same order (bit for bit), with row j of L^T (column j of L) read as four 16-byte broadcasts.
__device__ __forceinline__ void unit_lower_inverse_column_t(const float (&l_t)[kChunk][kChunk], int c,
                                                            float (&m)[kChunk]) {
#pragma unroll
  for (int i = 0; i < kChunk; ++i) m[i] = i == c ? 1.0f : 0.0f;
#pragma unroll
  for (int j = 0; j < kChunk - 1; ++j) {
    float l[kChunk];
#pragma unroll
    for (int q = (j + 1) / 4; q < kChunk / 4; ++q) {
      const float4 v = *reinterpret_cast<const float4*>(&l_t[j][4 * q]);
      l[4 * q] = v.x, l[4 * q + 1] = v.y, l[4 * q + 2] = v.z, l[4 * q + 3] = v.w;
    }
#pragma unroll
    for (int i = j + 1; i < kChunk; ++i) m[i] -= l[i] * m[j];
  }
}

// Two CTAs per SM at K = V = 32 (57-63 KB of shared memory; 64 registers a thread).
template <int K, int V>
constexpr int gradient_ctas_per_sm() { return K == 32 && V == 32 ? 2 : 1; }

// Persistent: grid = the CTAs that fit on the GPU at once; CTA b takes the chunks (items
// chunk + chunks (h + H seq)) b, b + gridDim.x, ... 512 threads, one CTA per SM at K = V = 128.
// Phases separated by barriers; within a phase warps take the phase's tasks (the long products,
// 16 x 16 x K or V, each on a warp of its own). After phase 5 S^T and dS'^T are dead: the next
// chunk's are loaded into them (cp.async) and its inputs into registers while phases 6-9 run.
template <typename T, int K, int V>
__global__ void __launch_bounds__(kGradientThreads, gradient_ctas_per_sm<K, V>())
    kda_chunk_gradient_kernel(const ChunkGradientArgs a) {
  constexpr bool kExact = std::is_same_v<T, bf16>;  // bf16 inputs: staged by cp.async
  using Shared = GradientShared<K, V>;
  constexpr int kRowK = Shared::kRowK, kRowV = Shared::kRowV;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  Shared& sh = *reinterpret_cast<Shared*>(shared_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = warp_index();
  const int H = a.heads;
  const int64_t num_chunks = (a.length + kChunk - 1) / kChunk;
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  const T* d_o = static_cast<const T*>(a.d_o);

  using Item = GradientItem;
  auto item_at = [&](int64_t w) { return GradientItem::at(w, num_chunks, kChunk, H, a.length); };
  int64_t w = blockIdx.x;
  if (w >= a.items) return;
  Item cur = item_at(w);
  auto token = [&](int i) { return (cur.row0 + i) * H + cur.h; };  // [B, L, H] index of row i

  // A thread's elements of the key-side [16][K] and value-side [16][V] arrays in phase 0 (and of
  // the key side in phase 8): column tid % K, rows tid / K + stride r.
  constexpr int kKeyStride = kGradientThreads / K;
  constexpr int kKeyItems = kChunk / kKeyStride;
  constexpr int kValueStride = kGradientThreads / V;
  constexpr int kValueItems = kChunk / kValueStride;
  const int kc = tid % K, kr = tid / K, vc = tid % V, vr = tid / V;
  // Column pairs (bf16 phase 0 and phase 8): kPairRows consecutive rows of two adjacent key
  // columns a thread, on the first kPairThreads threads (all 512 at K = 128, 256 at K = 32).
  constexpr int kPairRows = (kChunk * K / 2 + kGradientThreads - 1) / kGradientThreads;
  constexpr int kPairThreads = kChunk * K / 2 / kPairRows;

  // An item's loads, all in flight at once. S^T and dS'^T by cp.async. bf16 inputs: the chunk's
  // rows of q, k, v, dO and g by cp.async too, into sh.next (rows past its end zero-filled; the
  // space of phases 1-5's arrays, so the next chunk's are issued after phase 5), and beta
  // (threads 0-15) into a register. fp32 inputs: the whole column of g this thread needs for
  // Gamma and its elements of q, k, v, dO into registers (rows past the end read the last real
  // row; phase 0 zeroes them). With 33 register loads a thread, issuing the next chunk's loads
  // stalled the warps ~4K cycles per chunk (phase 6); staged, it is 3 cp.async a thread.
  float g_col[kExact ? 1 : kChunk], q_in[kKeyItems], k_in[kKeyItems], v_in[kValueItems],
      do_in[kValueItems];
  T beta_in{};  // raw: converted where phase 0 uses it, so the load is waited for there, not here
  // bf16: warps 0 and 1, whose phase 6 is the longest chain (H, then dM M^T and dL), issue none
  // of the next chunk's loads; the other 14 warps issue them all.
  constexpr int kSkip = kExact ? 64 : 0;
  // Warps 10-15 stage g and sum it (gamma_prefix): phase 9's dg and dbeta take threads below
  // K + 16 <= 144, and in phase 6 warps 10-15 have one task where warps 2-9 have two.
  constexpr int kGammaThread0 = 10 * 32, kGammaBarrier = 2;
  static_assert(K + kChunk <= kGammaThread0 && kGammaThread0 + K / 2 <= kGradientThreads, "gamma_prefix's threads");
  constexpr int kIssuers = kGradientThreads - kSkip;
  const int me = tid - kSkip;
  auto issue = [&](const Item& it) {
    const int64_t offset = ((static_cast<int64_t>(it.seq) * H + it.h) * num_chunks + it.index) * V * K;
    const bf16* s = a.chunk_states + offset;
    const bf16* ds = a.chunk_d_states + offset;
    auto real = [&](int i) { return (it.row0 + (i < it.valid ? i : it.valid - 1)) * H + it.h; };
    if (me >= 0) {
      for (int e = me; e < V * K / 8; e += kIssuers) {
        const int row = e / (K / 8), col = (e % (K / 8)) * 8;
        cp_async16(&sh.s_t[row][col], s + static_cast<int64_t>(e) * 8);
        cp_async16(&sh.ds_t[row][col], ds + static_cast<int64_t>(e) * 8);
      }
      if constexpr (kExact) {
        // 16-byte pieces: a row of K (V) bf16 is K / 8 (V / 8) of them, a row of K fp32 K / 4.
        for (int e = me; e < kChunk * K / 8; e += kIssuers) {
          const int i = e / (K / 8), col = (e % (K / 8)) * 8;
          const int64_t at = real(i) * K + col;
          cp_async16_or_zero(&sh.next.q[i][col], q + at, i < it.valid);
          cp_async16_or_zero(&sh.next.k[i][col], k + at, i < it.valid);
        }
        for (int e = me; e < kChunk * V / 8; e += kIssuers) {
          const int i = e / (V / 8), col = (e % (V / 8)) * 8;
          const int64_t at = real(i) * V + col;
          // Straight into V and dO's arrays: their last reads are in phase 5.
          cp_async16_or_zero(&sh.v[i][col], v + at, i < it.valid);
          cp_async16_or_zero(&sh.d_o[i][col], d_o + at, i < it.valid);
        }
        // g by warps 10-15 alone: they wait for it in phase 9 and sum it (gamma_prefix below).
        for (int e = tid - kGammaThread0; e >= 0 && e < kChunk * K / 4; e += kGradientThreads - kGammaThread0) {
          const int i = e / (K / 4), col = (e % (K / 4)) * 4;
          cp_async16_or_zero(&sh.next.g[i][col], a.g + real(i) * K + col, i < it.valid);
        }
      }
    }
    if constexpr (!kExact) {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) g_col[i] = a.g[real(i) * K + kc];
#pragma unroll
      for (int r = 0; r < kKeyItems; ++r) {
        const int i = kr + kKeyStride * r;
        q_in[r] = to_float(q[real(i) * K + kc]);
        k_in[r] = to_float(k[real(i) * K + kc]);
      }
#pragma unroll
      for (int r = 0; r < kValueItems; ++r) {
        const int i = vr + kValueStride * r;
        v_in[r] = to_float(v[real(i) * V + vc]);
        do_in[r] = to_float(d_o[real(i) * V + vc]);
      }
    }
    cp_async_commit();
    if (me >= 0 && me < kChunk) beta_in = static_cast<const T*>(a.beta)[real(me)];
  };
  // bf16: Gamma, the cumulative sums of the staged g down its rows, in place in sh.next.g (rows
  // past the chunk's end are zero, so the last row is the chunk's sum), by warps 10-15 in phase 9
  // for the next chunk (before the loop for the first): the warps that staged g wait for it and
  // meet at a barrier of their own, K / 2 threads sum a column pair each. Phase 9 keeps warps 0-4
  // busy and these idle; in phase 0 every thread summed the 16 rows of its columns itself (8 row
  // groups: 8x the loads and adds, ~1K of phase 0's 3.9K instructions a chunk).
  auto gamma_prefix = [&]() {
    if constexpr (kExact) {
      if (tid >= kGammaThread0) {
        cp_async_wait<0>();
        named_barrier_sync(kGammaBarrier, kGradientThreads - kGammaThread0);
        if (tid < kGammaThread0 + K / 2) {
          const int c0 = 2 * (tid - kGammaThread0);
          float2 run = make_float2(0.0f, 0.0f);
#pragma unroll
          for (int i = 0; i < kChunk; ++i) {
            float2& gi = *reinterpret_cast<float2*>(&sh.next.g[i][c0]);
            const float2 x = gi;
            run.x += x.x;
            run.y += x.y;
            gi = run;
          }
        }
      }
    }
  };
  issue(cur);
  gamma_prefix();

  for (;;) {
  const int valid = cur.valid;

  // Phase 0: from what issue() loaded: Gamma (bf16: summed already, gamma_prefix; fp32: each
  // thread from its whole column of g), Q^, K^, K~, K_, V, dO, beta.
  if (me >= 0 && me < kChunk) sh.beta[me] = me < valid ? to_float(beta_in) : 0.0f;
  if constexpr (kExact) {
    cp_async_wait<0>();  // sh.next, S^T and dS'^T
    __syncthreads();
    // Staged rows past the chunk's end are zero (q, k, v, dO and g), so no row needs a guard.
    // A thread owns two adjacent columns of kPairRows consecutive rows (pairwise loads and
    // stores); sh.next.g holds Gamma (gamma_prefix), its last row the chunk's sum.
    if (tid < kPairThreads) {
      const int c0 = 2 * (tid % (K / 2)), group = tid / (K / 2), i0 = group * kPairRows;
      const float2 run = *reinterpret_cast<const float2*>(&sh.next.g[kChunk - 1][c0]);  // Gamma's last row
      const float2 decay = make_float2(exp_ftz(run.x), exp_ftz(run.y));
      if (group == 0) *reinterpret_cast<float2*>(&sh.decay[c0]) = decay;
#pragma unroll
      for (int j = 0; j < kPairRows; ++j) {
        const int i = i0 + j;
        const float2 gam = *reinterpret_cast<const float2*>(&sh.next.g[i][c0]);
        const float2 qv = load_bf16x2(&sh.next.q[i][c0]), kv = load_bf16x2(&sh.next.k[i][c0]);
        float2 up, down;
        exp_both(gam.x, up.x, down.x);
        exp_both(gam.y, up.y, down.y);
        *reinterpret_cast<float2*>(&sh.gamma[i][c0]) = gam;
        store_bf16x2(&sh.q_hat[i][c0], a.scale * qv.x * up.x, a.scale * qv.y * up.y);
        store_bf16x2(&sh.k_hat[i][c0], kv.x * up.x, kv.y * up.y);
        store_bf16x2(&sh.k_check[i][c0], kv.x * down.x, kv.y * down.y);
        const float2 kb = make_float2(kv.x * (decay.x * down.x), kv.y * (decay.y * down.y));
        *reinterpret_cast<float2*>(&sh.k_bar[i][c0]) = kb;
        store_bf16x2(&sh.a_kbar[i][c0], kb.x, kb.y);
      }
    }
    // v and dO were staged in place by issue().
  } else {
    float cum = 0.0f, gam[kKeyItems] = {};
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      cum += i < valid ? g_col[i] : 0.0f;
#pragma unroll
      for (int r = 0; r < kKeyItems; ++r) gam[r] = i == kr + kKeyStride * r ? cum : gam[r];
    }
    const float decay = exp_ftz(cum);
    if (kr == 0) sh.decay[kc] = decay;
#pragma unroll
    for (int r = 0; r < kKeyItems; ++r) {
      const int i = kr + kKeyStride * r;
      const float qv = i < valid ? q_in[r] : 0.0f, kv = i < valid ? k_in[r] : 0.0f;
      float up, down;
      exp_both(gam[r], up, down);
      sh.gamma[i][kc] = gam[r];
      sh.q_hat[i][kc] = __float2bfloat16_rn(a.scale * qv * up);
      sh.k_hat[i][kc] = __float2bfloat16_rn(kv * up);
      sh.k_check[i][kc] = __float2bfloat16_rn(kv * down);
      const float kb = kv * (decay * down);
      sh.k_bar[i][kc] = kb;
      sh.a_kbar[i][kc] = __float2bfloat16_rn(kb);
    }
#pragma unroll
    for (int r = 0; r < kValueItems; ++r) {
      const int i = vr + kValueStride * r;
      sh.v[i][vc] = __float2bfloat16_rn(i < valid ? v_in[r] : 0.0f);
      sh.d_o[i][vc] = __float2bfloat16_rn(i < valid ? do_in[r] : 0.0f);
    }
    cp_async_wait<0>();
  }
  __syncthreads();

  // Phase 1: warp 0: P = strictly_lower(K^ K~^T) (B(k = c, n = j) = K~[j][c]: rows = n), stored
  // with L^T = (Diag(beta) P)^T, then on its first 16 lanes M = (I + L)^-1 in fp32 (lane c owns
  // column c). Warp 1: Aqk = lower_incl_diag(Q^ K~^T). Warps 2-15: the state products that need
  // nothing else, dV' = K_ dS' (Aqk^T dO added in phase 4; B(k = kk, n = v) = dS'^T[v][kk]: rows =
  // n) and dQ^ = dO S^T (dAqk K~ added in phase 6; B(k = v, n = kk) = S^T[v][kk]: rows = k), then
  // (warps 8-15) e^gamma's direct gradient, sum_v dS' (.) S, in slices of V rows. (Phase 2, M
  // after a barrier, was merged into this one in the eighth session; the later phases keep their
  // numbers.)
  if (warp == 0) {
    mma_tile16<K, false>(&sh.k_hat[0][0], kRowK, &sh.k_check[0][0], kRowK, 0, lane, [&](int i, int j, float y) {
      const float p = j < i ? y : 0.0f;
      sh.p[i][j] = p;
      sh.l_t[j][i] = sh.beta[i] * p;
    });
    __syncwarp();
    if (lane < kChunk) {
      float m[kChunk];
      unit_lower_inverse_column_t(sh.l_t, lane, m);
#pragma unroll
      for (int i = 0; i < kChunk; ++i) sh.m[i][lane] = m[i];
    }
  } else if (warp == 1) {
    mma_tile16<K, false>(&sh.q_hat[0][0], kRowK, &sh.k_check[0][0], kRowK, 0, lane,
                         [&](int i, int j, float y) { sh.a_qk.store(i, j, j <= i ? y : 0.0f); });
  } else {
    constexpr int kDv = V / 16, kTasks = kDv + K / 16;
    for (int task = warp - 2; task < kTasks; task += kGradientWarps - 2) {
      if (task < kDv) {
        mma_tile16<K, false>(&sh.a_kbar[0][0], kRowK, &sh.ds_t[0][0], kRowK, task * 16, lane,
                             [&](int i, int c, float y) { sh.live.dvn[i][c] = y; });
      } else {
        mma_tile16<V, true>(&sh.d_o[0][0], kRowV, &sh.s_t[0][0], kRowK, (task - kDv) * 16, lane,
                            [&](int i, int c, float y) { sh.d_qhat[i][c] = y; });
      }
    }
    if (tid >= kGradientThreads / 2) {
      constexpr int kPairs = K / 2, kRows = V / Shared::kDecaySlices;
      const int x = tid - kGradientThreads / 2, pair = x % kPairs, slice = x / kPairs;
      float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll 8
      for (int r = slice * kRows; r < (slice + 1) * kRows; ++r) {
        const float2 sv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&sh.s_t[r][2 * pair]));
        const float2 dv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&sh.ds_t[r][2 * pair]));
        acc0 += dv.x * sv.x;
        acc1 += dv.y * sv.y;
      }
      sh.d_decay[slice][2 * pair] = acc0;
      sh.d_decay[slice][2 * pair + 1] = acc1;
    }
  }
  __syncthreads();

  // Phase 3: W = M Diag(beta) K^ (as the bf16 operand) and U = M Diag(beta) V (into vn).
  {
    auto m_beta = [&](int i, int l) { return sh.m[i][l] * sh.beta[l]; };
    constexpr int kW = K / 16, kTasks = kW + V / 16;
    for (int task = warp; task < kTasks; task += kGradientWarps) {
      if (task < kW) {
        mma_small_a_tile16</*kPairs=*/true>(in_registers(m_beta), &sh.k_hat[0][0], kRowK, task * 16, lane,
                                            [&](int i, int c, float x, float y) { store_bf16x2(&sh.live.a_w[i][c], x, y); });
      } else {
        mma_small_a_tile16(in_registers(m_beta), &sh.v[0][0], kRowV, (task - kW) * 16, lane,
                           [&](int i, int c, float y) { sh.live.vn[i][c] = y; });
      }
    }
  }
  __syncthreads();

  // Phase 4: V' = U - W S (B(k = kk, n = v) = S^T[v][kk]: rows = n) and dV' = K_ dS' + Aqk^T dO,
  // both as bf16 operands.
  {
    constexpr int kVn = V / 16, kTasks = 2 * kVn;
    for (int task = warp; task < kTasks; task += kGradientWarps) {
      if (task < kVn) {
        mma_tile16<K, false>(&sh.live.a_w[0][0], kRowK, &sh.s_t[0][0], kRowK, task * 16, lane,
                             [&](int i, int c, float y) { sh.live.vn_b[i][c] = __float2bfloat16_rn(sh.live.vn[i][c] - y); });
      } else {
        mma_small_a_tile16(SmallA<true>{sh.a_qk}, &sh.d_o[0][0], kRowV, (task - kVn) * 16, lane,
                           [&](int i, int c, float y) { sh.live.dvn_b[i][c] = __float2bfloat16_rn(sh.live.dvn[i][c] + y); });
      }
    }
    // M as a bf16 operand for phases 5 and 6 (one element a thread of warps 8-15, which have one
    // task here where warps 0-7 have the longer W S).
    if (warp >= kGradientWarps / 2) {
      const int e = tid - kGradientThreads / 2, i = e / kChunk, c = e % kChunk;
      sh.m_b.store(i, c, sh.m[i][c]);
    }
  }
  __syncthreads();

  // Phase 5: dAqk = lower_incl_diag(dO V'^T) and G = dV' V^T (into d_m) on warps 0 and 1
  // (B(k = c, n = j) = V'[j][c], V[i][c]: rows = n); on the others dK_ = V' dS'^T and
  // dW = -dV' S^T (B(k = v, n = kk): rows = k), dv = Diag(beta) M^T dV' (written out).
  if (warp == 0) {
    mma_tile16<V, false>(&sh.d_o[0][0], kRowV, &sh.live.vn_b[0][0], kRowV, 0, lane,
                         [&](int i, int j, float y) { sh.d_aqk.store(i, j, j <= i ? y : 0.0f); });
  } else if (warp == 1) {
    mma_tile16<V, false>(&sh.live.dvn_b[0][0], kRowV, &sh.v[0][0], kRowV, 0, lane,
                         [&](int t, int i, float y) { sh.d_m[t][i] = y; });
  } else {
    // dK_ and dW 32 columns a task (A read once for two tiles), one a warp on warps 2 ..; the
    // light dv tasks on the warps after them. (Tiles of 16 columns handed out in turn gave two
    // warps two heavy tasks each, and two others two dv tasks.)
    constexpr int kKb = K / 32, kHeavy = 2 * kKb, kDv = V / 16, kDvWarps = kGradientWarps - 2 - kHeavy;
    static_assert(kDvWarps > 0, "warps for the dv tasks");
    const int task = warp - 2;
    if (task < kKb) {
      mma_tile16<V, true, 2>(&sh.live.vn_b[0][0], kRowV, &sh.ds_t[0][0], kRowK, task * 32, lane,
                             [&](int i, int c, float y) { sh.d_kbar[i][c] = y; });
    } else if (task < kHeavy) {
      mma_tile16<V, true, 2>(&sh.live.dvn_b[0][0], kRowV, &sh.s_t[0][0], kRowK, (task - kKb) * 32, lane,
                             [&](int i, int c, float y) { sh.d_w[i][c] = __float2bfloat16_rn(-y); });
    } else {
      for (int d = task - kHeavy; d < kDv; d += kDvWarps) {
        mma_small_a_tile16</*kPairs=*/true>(
            SmallA<true>{sh.m_b}, &sh.live.dvn_b[0][0], kRowV, d * 16, lane, [&](int i, int c, float x, float y) {
              if (i < valid) store_pair(static_cast<T*>(a.dv) + token(i) * V + c, sh.beta[i] * x, sh.beta[i] * y);
            });
      }
    }
  }
  __syncthreads();

  // The next item: its loads go out in phase 6 (S^T and dS'^T are dead; phases 6-9 do not read them).
  const int64_t next_w = w + gridDim.x;
  const bool more = next_w < a.items;
  Item next{};
  if (more) {
    next = item_at(next_w);
    if constexpr (!kExact) issue(next);  // bf16: at the end of phase 6's tasks (below)
  }

  // Phase 6: warps 0-1 (8 columns each): H = dW K^^T (B(k = c, n = i) = K^[i][c]: rows = n) ->
  // dM = (G + H) Diag(beta), M (.) (G + H); then dM M^T -> dL = -M^T dM M^T (strictly lower).
  // Warps 2-15: the dq / dk terms that need no dL: dQ^ += dAqk K~, M^T dW (into d_khat),
  // dAqk^T Q^ (into d_kcheck) (B rows = k).
  if (warp < 2) {
    mma_half16<K, false>(&sh.d_w[0][0], kRowK, &sh.k_hat[0][0], kRowK, 0, warp, lane, [&](int t, int i, float y) {
      const float gh = sh.d_m[t][i] + y;
      sh.d_m[t][i] = sh.beta[i] * gh;
      sh.x_beta[t][i] = sh.m[t][i] * gh;
    });
    warp_pair_barrier();
    const int n0 = warp * 8;
    mma_small_tile8(in_registers([&](int i, int c) { return sh.d_m[i][c]; }), SmallRowsB{sh.m_b}, n0, lane,
                    [&](int i, int j, float y) { sh.t1[i][j] = y; });
    warp_pair_barrier();
    mma_small_tile8(SmallA<true>{sh.m_b}, b_in_registers([&](int c, int j) { return sh.t1[c][j]; }), n0, lane,
                    [&](int i, int j, float y) {
                      const float x = j < i ? -y : 0.0f;
                      sh.d_l[i][j] = x;
                      sh.d_l_b.store(i, j, x);
                      sh.beta_d_l.store(i, j, sh.beta[i] * x);
                    });
  } else {
    constexpr int kPer = K / 16, kTasks = 3 * kPer;
    for (int task = warp - 2; task < kTasks; task += kGradientWarps - 2) {
      const int n0 = (task % kPer) * 16;
      if (task < kPer) {
        mma_small_a_tile16(SmallA<false>{sh.d_aqk}, &sh.k_check[0][0], kRowK, n0, lane,
                           [&](int i, int c, float y) { sh.d_qhat[i][c] += y; });
      } else if (task < 2 * kPer) {
        mma_small_a_tile16(SmallA<true>{sh.m_b}, &sh.d_w[0][0], kRowK, n0, lane,
                           [&](int i, int c, float y) { sh.d_khat[i][c] = y; });
      } else {
        mma_small_a_tile16(SmallA<true>{sh.d_aqk}, &sh.q_hat[0][0], kRowK, n0, lane,
                           [&](int i, int c, float y) { sh.d_kcheck[i][c] = y; });
      }
    }
    // bf16: the next chunk's cp.async after this phase's tasks, so that their shared-memory
    // queue is not full of copies while warps 0-1 run H (backward 11.79 -> 11.72 ms).
    if constexpr (kExact) {
      if (more) issue(next);
    }
  }
  __syncthreads();

  // Phase 7: dK^ = Diag(beta) (M^T dW + dL K~), dK~ += (Diag(beta) dL)^T K^.
  {
    constexpr int kPer = K / 16;
    for (int task = warp; task < 2 * kPer; task += kGradientWarps) {
      const int n0 = (task % kPer) * 16;
      if (task < kPer) {
        mma_small_a_tile16(SmallA<false>{sh.d_l_b}, &sh.k_check[0][0], kRowK, n0, lane,
                           [&](int i, int c, float y) { sh.d_khat[i][c] = sh.beta[i] * (sh.d_khat[i][c] + y); });
      } else {
        mma_small_a_tile16(SmallA<true>{sh.beta_d_l}, &sh.k_hat[0][0], kRowK, n0, lane,
                           [&](int i, int c, float y) { sh.d_kcheck[i][c] += y; });
      }
    }
    // dgamma on threads kGradientThreads / 2 .. + K - 1 (warps 8-11 at K = 128, whose tasks here
    // are the shorter), from arrays final since phase 5, so that phase 9 is the reverse sum alone.
    if (tid >= kGradientThreads / 2 && tid < kGradientThreads / 2 + K) {
      const int c = tid - kGradientThreads / 2;
      float acc = 0.0f;
#pragma unroll
      for (int s = 0; s < Shared::kDecaySlices; ++s) acc += sh.d_decay[s][c];
      acc *= sh.decay[c];
#pragma unroll
      for (int i = 0; i < kChunk; ++i) acc += sh.d_kbar[i][c] * sh.k_bar[i][c];
      sh.d_gamma[c] = acc;
    }
  }
  __syncthreads();

  // Phase 8: dq, dk per element; dGamma (over Gamma, by its owner), its factors Q^, K^, K~ the
  // bf16 values the products saw (so that each intra pair's two terms cancel in dg's sum).
  // Two adjacent columns a thread (8-byte loads and stores), kPairRows consecutive rows.
  if (tid < kPairThreads) {
    const int c0 = 2 * (tid % (K / 2)), i0 = tid / (K / 2) * kPairRows;
    const float2 decay = *reinterpret_cast<const float2*>(&sh.decay[c0]);
    const int64_t first = token(i0) * K + c0, stride = static_cast<int64_t>(H) * K;  // row i0, a token's step
#pragma unroll
    for (int j = 0; j < kPairRows; ++j) {
      const int i = i0 + j;
      auto pair = [&](const float (&x)[kChunk][Shared::kPadK]) { return *reinterpret_cast<const float2*>(&x[i][c0]); };
      const float2 d_qhat = pair(sh.d_qhat), d_khat = pair(sh.d_khat), d_kcheck = pair(sh.d_kcheck);
      const float2 d_kbar = pair(sh.d_kbar), gam = pair(sh.gamma), k_bar = pair(sh.k_bar);
      const float2 q_hat = load_bf16x2(&sh.q_hat[i][c0]), k_hat = load_bf16x2(&sh.k_hat[i][c0]);
      const float2 k_check = load_bf16x2(&sh.k_check[i][c0]);
      float2 up, down;
      exp_both(gam.x, up.x, down.x);
      exp_both(gam.y, up.y, down.y);
      if (i < valid) {
        store_pair(static_cast<T*>(a.dq) + first + j * stride, a.scale * d_qhat.x * up.x, a.scale * d_qhat.y * up.y);
        store_pair(static_cast<T*>(a.dk) + first + j * stride,
                   d_khat.x * up.x + d_kcheck.x * down.x + d_kbar.x * (decay.x * down.x),
                   d_khat.y * up.y + d_kcheck.y * down.y + d_kbar.y * (decay.y * down.y));
      }
      *reinterpret_cast<float2*>(&sh.gamma[i][c0]) =
          make_float2(d_qhat.x * q_hat.x + d_khat.x * k_hat.x - d_kcheck.x * k_check.x - d_kbar.x * k_bar.x,
                      d_qhat.y * q_hat.y + d_khat.y * k_hat.y - d_kcheck.y * k_check.y - d_kbar.y * k_bar.y);
    }
  }
  __syncthreads();

  // Phase 9: dg = reverse cumulative sum of dGamma + dgamma (threads 0 .. K - 1; dgamma made in
  // phase 7); beside it dbeta
  // (threads K .. K + 15; it was phase 7's, where its dependent chain of 16 delayed the barrier).
  if (tid >= K && tid < K + kChunk && tid - K < valid) {
    const int i = tid - K;
    float acc = 0.0f;
#pragma unroll
    for (int r = 0; r < kChunk; ++r) acc += sh.x_beta[r][i] + sh.d_l[i][r] * sh.p[i][r];
    a.dbeta[token(i)] = acc;
  }
  // The sums first, then the stores down one pointer at a token's stride: with each row's address
  // from token(i) (64-bit products) between the adds, phase 9 took ~1K cycles.
  for (int c = tid; c < K; c += kGradientThreads) {
    store_reverse_column_sum<kChunk>(a.dg + token(0) * K + c, static_cast<int64_t>(H) * K, &sh.gamma[0][c],
                                     Shared::kPadK, sh.d_gamma[c], valid);
  }
  if (!more) break;
  gamma_prefix();   // the next chunk's, beside the dg and dbeta sums
  __syncthreads();  // phase 9's reads before the next phase 0's writes
  w = next_w;
  cur = next;
  }
}

}  // namespace
}  // namespace odyssey::kernels

// Pass 3 by blocks of 32 tokens (bf16, K = V = 128): kda_block_gradient_kernel, built on the pieces
// above (ChunkGradientArgs, the fragment helpers, the 16 x 16 substitution).
// Pass 3's persistent grid, for either of its kernels: sets the kernel's dynamic shared memory and
// gives as many CTAs of `threads` as fit on the GPU at once (each taking every gridDim.x-th item),
// at most `items`.
template <typename Kernel>
cudaError_t persistent_ctas(Kernel kernel, int threads, size_t shared, int64_t items, int64_t& ctas) {
  cudaError_t error =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
  if (error != cudaSuccess) return error;
  int device = 0, sms = 0, per_sm = 0;
  if ((error = cudaGetDevice(&device)) != cudaSuccess ||
      (error = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess ||
      (error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, shared)) != cudaSuccess) {
    return error;
  }
  ctas = std::min<int64_t>(items, static_cast<int64_t>(sms) * (per_sm > 0 ? per_sm : 1));
  return cudaSuccess;
}

#include "kernels/kda_block_gradient.cuh"
#include "kernels/kda_block64_gradient.cuh"

namespace odyssey::kernels {
namespace {

// ---------------------------------------------------------------------------------------------
// Launch.

// Context parallelism of the reverse walk (whole heads only: bf16, K = V = 128, where the device
// gives a CTA the shared memory): with few (sequence, head) chains and a long sequence the serial
// reverse walk leaves most SMs idle (B=1 T=64K H=4: 4 CTAs walking 4096 chunks each, 7.3 ms).
// Then P segments of whole chunks: about one wave of segment walks (SMs / chains), at least 16
// chunks each, only from 4096 tokens and 4 segments (as the forward's context parallelism).
struct ReversePlan {
  int64_t segment_length = 0;  // tokens (a multiple of 16); the last segment may be shorter
  int segments = 1;            // P; 1 = the serial walk
};

ReversePlan reverse_plan(int64_t batch, int64_t length, int64_t heads, int64_t key, int64_t value) {
  ReversePlan plan{length, 1};
  if (key != 128 || value != 128 || length < 4096 || batch < 1 || !head_walk_fits<128, 128>()) return plan;
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return plan;
  }
  const int64_t wanted = sms / (batch * heads);
  if (wanted < 4) return plan;
  const int64_t chunks = (length + kChunk - 1) / kChunk;
  const int64_t segment_chunks = std::max<int64_t>(16, (chunks + wanted - 1) / wanted);
  const int64_t segments = (chunks + segment_chunks - 1) / segment_chunks;
  if (segments < 4 || batch * segments > 65535) return plan;
  return {segment_chunks * kChunk, static_cast<int>(segments)};
}

struct BackwardLayout {
  size_t states = 0, d_states = 0, final_state = 0, bytes = 0;
  // The reverse walk's context parallelism (ReversePlan; none when P = 1): the dS leaving every
  // segment [N, P, H, K, V], then A'^T [N, P - 1, H, K, K] and B' [N, P - 1, H, K, V], fp32.
  ReversePlan reverse;
  size_t segment_states = 0, transition_a = 0, transition_b = 0;
  // Pass 3 by blocks reading V' and dV' (values): bf16 [N, L, H, V] each, V' only when pass 1 runs.
  size_t new_values = 0, d_new_values = 0;
  // states_given: the forward kept the chunk states (no room for them, nor for pass 1's final state).
  // state_interval, d_state_interval: pass 1 stores the state entering one chunk in every
  // state_interval, pass 2 the state gradient leaving one in every d_state_interval.
  // values: passes 1 and 2 keep V' and dV' for pass 3 by blocks (pass 1 only without states_given).
  BackwardLayout(int64_t batch, int64_t length, int64_t heads, int64_t key, int64_t value,
                 bool states_given = false, int state_interval = 1, int d_state_interval = 1, bool values = false)
      : reverse(reverse_plan(batch, length, heads, key, value)) {
    auto aligned = [](size_t n) { return (n + 255) / 256 * 256; };
    auto stored_bytes = [&](int interval) {
      const size_t chunks = static_cast<size_t>(((length + kChunk - 1) / kChunk + interval - 1) / interval);
      return aligned(static_cast<size_t>(batch * heads) * chunks * key * value * sizeof(bf16));
    };
    d_states = states_given ? 0 : stored_bytes(state_interval);
    final_state = d_states + stored_bytes(d_state_interval);
    bytes = final_state +
            (states_given ? 0 : aligned(static_cast<size_t>(batch * heads * key * value) * sizeof(float)));
    if (values) {
      const size_t rows = aligned(static_cast<size_t>(batch * length * heads * value) * sizeof(bf16));
      d_new_values = bytes;
      new_values = d_new_values + rows;
      bytes = new_values + (states_given ? 0 : rows);
    }
    if (reverse.segments > 1) {
      const size_t pairs = static_cast<size_t>(batch * heads), p = static_cast<size_t>(reverse.segments);
      segment_states = bytes;
      transition_a = segment_states + aligned(pairs * p * key * value * sizeof(float));
      transition_b = transition_a + aligned(pairs * (p - 1) * key * key * sizeof(float));
      bytes = transition_b + aligned(pairs * (p - 1) * key * value * sizeof(float));
    }
  }
};

template <typename T, int K, int V>
cudaError_t launch_chunk_gradients(ChunkGradientArgs a, int64_t batch, int64_t chunks,
                                   cudaStream_t stream) {
  constexpr size_t shared = gradient_shared_bytes<K, V>();
  const auto kernel = kda_chunk_gradient_kernel<T, K, V>;
  a.items = chunks * a.heads * batch;
  int64_t ctas = 0;
  const cudaError_t error = persistent_ctas(kernel, kGradientThreads, shared, a.items, ctas);
  if (error != cudaSuccess) return error;
  kernel<<<static_cast<unsigned>(ctas), kGradientThreads, shared, stream>>>(a);
  return cudaGetLastError();
}

// Pass 2 (grid: one CTA per (sequence, head) for whole heads, else per 64 or 32 value columns).
template <typename T, int K, int kTile>
cudaError_t launch_state_gradients(const StateGradientArgs& sa, int64_t batch, int64_t value_dim,
                                   cudaStream_t stream) {
  const unsigned heads = static_cast<unsigned>(sa.forward.heads), n = static_cast<unsigned>(batch);
  if constexpr (std::is_same_v<T, bf16> && K == 128 && kTile == 64) {
    if (value_dim == 128 && head_walk_fits<K, 128>()) {  // whole heads (kda_head_state_gradient_kernel)
      constexpr size_t shared = sizeof(HeadShared<K, 128, /*kGradients=*/true>);
      auto launch = [&](auto pass, dim3 grid) {
        auto* kernel = kda_head_state_gradient_kernel<K, 128, decltype(pass)::value>;
        const cudaError_t error =
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
        if (error != cudaSuccess) return error;
        kernel<<<grid, kHeadThreads, shared, stream>>>(sa);
        return cudaGetLastError();
      };
      using Walk = std::integral_constant<Pass, Pass::kForward>;
      using Transition = std::integral_constant<Pass, Pass::kTransition>;
      const unsigned p = static_cast<unsigned>(sa.forward.segments);
      if (p > 1) {  // context parallel (ReversePlan): transitions, the scan from d_final_state, segments
        cudaError_t error = launch(Transition{}, dim3(2, heads, n * (p - 1)));
        if (error != cudaSuccess) return error;
        error = launch_kda_segment_scan(K, sa.d_final_state, sa.forward.transition_a, sa.forward.transition_b,
                                        const_cast<float*>(sa.forward.segment_states), batch, sa.forward.heads,
                                        static_cast<int>(value_dim), static_cast<int>(p), stream);
        if (error != cudaSuccess) return error;
      }
      return launch(Walk{}, dim3(1, heads, n * p));
    }
  }
  if (sa.forward.segments != 1) return cudaErrorInvalidValue;  // planned for whole heads only
  constexpr size_t shared = chunked_shared_bytes<K, kTile>();
  cudaError_t error = cudaFuncSetAttribute(kda_state_gradient_kernel<T, K, kTile>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(shared));
  if (error != cudaSuccess) return error;
  error = cudaFuncSetAttribute(kda_state_gradient_kernel<T, K, kTile>,
                               cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
  if (error != cudaSuccess) return error;
  const dim3 grid(static_cast<unsigned>(value_dim / kTile), heads, n);
  kda_state_gradient_kernel<T, K, kTile><<<grid, Walk<kTile>::kThreads, shared, stream>>>(sa);
  return cudaGetLastError();
}

template <typename T, int K, int kTile>
cudaError_t run_backward(const StateGradientArgs& sa, const ChunkGradientArgs& ca, int64_t batch,
                         int64_t chunks, int64_t value_dim, const KdaBackwardOptions& options,
                         cudaStream_t stream) {
  const cudaError_t error = launch_state_gradients<T, K, kTile>(sa, batch, value_dim, stream);
  if (error != cudaSuccess) return error;
  if constexpr (std::is_same_v<T, bf16> && K == 128) {
    if (value_dim == 128 && options.pass3_blocks) {
      // By fused 64-token blocks where V' and dVb are at hand, unless 32 is asked for (blocked_pass3_64).
      if (ca.new_values != nullptr && options.pass3_block_tokens != 32) {
        return options.pass3_block_producer ? launch_block64_gradients<128, 128, true>(ca, batch, stream)
                                            : launch_block64_gradients<128, 128>(ca, batch, stream);
      }
      // The loads by a producer warp: faster than at the top of each block or by the tensor-memory
      // accelerator (BlockLoads; the same gradients bit for bit; kernels/JOURNAL.md, "Seventeenth
      // session"). With V' and dV' from passes 1 and 2 where they kept them.
      if (ca.new_values != nullptr) return launch_block_gradients<128, 128, BlockLoads::kProducer, true, true>(ca, batch, stream);
      return launch_block_gradients<128, 128, BlockLoads::kProducer>(ca, batch, stream);
    }
  }
  if (ca.states_interval != 1 || ca.d_states_interval != 1 || ca.new_values != nullptr) return cudaErrorInvalidValue;
  return with_head_width(value_dim, [&](auto value) {
    return launch_chunk_gradients<T, K, value()>(ca, batch, chunks, stream);
  });
}

bool backward_sizes_supported(int64_t batch, int64_t length, int64_t heads, int64_t key_dim,
                              int64_t value_dim) {
  return head_width_supported(key_dim) && head_width_supported(value_dim) && batch >= 0 &&
         length >= 0 && heads >= 1 && batch <= 65535 && heads <= 65535 &&
         (length + kChunk - 1) / kChunk <= 0x7fffffff;
}

// Pass 3 by 32-token blocks: what KdaBackwardOptions::pass3_blocks asks for, where it applies.
bool blocked_pass3(KdaDtype dtype, int64_t key_dim, int64_t value_dim, const KdaBackwardOptions& options) {
  return options.pass3_blocks && dtype == KdaDtype::kBFloat16 && key_dim == 128 && value_dim == 128;
}

// Whether pass 3 by blocks reads V' and dVb = M^T dV' kept by passes 1 and 2 (KdaBackwardOptions::keep_values;
// with states the forward kept, where it kept V' too: KdaBackwardOptions::new_values).
bool blocked_pass3_values(KdaDtype dtype, int64_t key_dim, int64_t value_dim, bool states_given,
                          const KdaBackwardOptions& options) {
  return blocked_pass3(dtype, key_dim, value_dim, options) &&
         (states_given ? options.new_values != nullptr : options.keep_values);
}

// Pass 3 by fused 64-token blocks: where blocks apply with V' and dVb at hand, unless
// KdaBackwardOptions::pass3_block_tokens asks for 32 (0, the default, and 64 take them).
bool blocked_pass3_64(KdaDtype dtype, int64_t key_dim, int64_t value_dim, bool states_given,
                      const KdaBackwardOptions& options) {
  return blocked_pass3_values(dtype, key_dim, value_dim, states_given, options) && options.pass3_block_tokens != 32;
}

// The intervals of the states pass 3 reads and of the state gradients pass 2 stores. Pass 3 by
// 32-token blocks reads the gradient leaving every block (every second chunk's); with V' kept it
// makes the state entering every second block itself, from the one before (blocks in pairs,
// kda_block_gradient.cuh), so pass 1 stores every fourth chunk's state; without V', every second.
// 16-token chunks read every chunk's. Pass 3 by 64-token blocks reads the gradient leaving every
// fourth chunk (and, with V', the state entering every fourth).
int backward_d_state_interval(KdaDtype dtype, int64_t key_dim, int64_t value_dim, bool states_given,
                              const KdaBackwardOptions& options) {
  if (blocked_pass3_64(dtype, key_dim, value_dim, states_given, options)) return 4;
  return blocked_pass3(dtype, key_dim, value_dim, options) ? 2 : 1;
}
int recomputed_state_interval(KdaDtype dtype, int64_t key_dim, int64_t value_dim, const KdaBackwardOptions& options) {
  if (!blocked_pass3(dtype, key_dim, value_dim, options)) return 1;
  return blocked_pass3_values(dtype, key_dim, value_dim, /*states_given=*/false, options) ? 4 : 2;
}

}  // namespace

size_t kda_chunked_backward_workspace_bytes(KdaDtype dtype, int64_t batch, int64_t length, int64_t heads,
                                            int64_t key_dim, int64_t value_dim, bool states_given,
                                            const KdaBackwardOptions& options) {
  if (!backward_sizes_supported(batch, length, heads, key_dim, value_dim) || batch == 0 ||
      length == 0) {
    return 0;
  }
  const int state_interval = states_given ? options.chunk_states_interval
                                         : recomputed_state_interval(dtype, key_dim, value_dim, options);
  return BackwardLayout(batch, length, heads, key_dim, value_dim, states_given, state_interval,
                        backward_d_state_interval(dtype, key_dim, value_dim, states_given, options),
                        blocked_pass3_values(dtype, key_dim, value_dim, states_given, options))
      .bytes;
}

int kda_backward_state_interval(KdaDtype dtype, int64_t key_dim, int64_t value_dim,
                                const KdaBackwardOptions& options) {
  return recomputed_state_interval(dtype, key_dim, value_dim, options);
}

size_t kda_chunked_backward_workspace_bytes(int64_t batch, int64_t length, int64_t heads,
                                            int64_t key_dim, int64_t value_dim, bool states_given) {
  // Enough for either dtype: fp32 stores every chunk's states.
  return kda_chunked_backward_workspace_bytes(KdaDtype::kFloat32, batch, length, heads, key_dim, value_dim,
                                              states_given, KdaBackwardOptions{});
}

cudaError_t kda_chunked_backward(KdaDtype dtype, const void* q, const void* k, const void* v,
                                 const float* g, const void* beta, const float* initial_state,
                                 const void* d_o, const float* d_final_state, void* dq,
                                 void* dk, void* dv, float* dg, float* dbeta,
                                 float* d_initial_state, int64_t batch, int64_t length,
                                 int64_t heads, int64_t key_dim, int64_t value_dim, float scale,
                                 const void* chunk_states, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream, const KdaBackwardOptions& options) {
  if (!backward_sizes_supported(batch, length, heads, key_dim, value_dim)) {
    return cudaErrorInvalidValue;
  }
  if (batch == 0) return cudaSuccess;
  if (length == 0) {
    // No tokens: the state passes through, so does its gradient.
    if (d_initial_state == nullptr) return cudaSuccess;
    const size_t bytes = static_cast<size_t>(batch) * static_cast<size_t>(heads) *
                         static_cast<size_t>(key_dim) * static_cast<size_t>(value_dim) * sizeof(float);
    if (d_final_state == nullptr) return cudaMemsetAsync(d_initial_state, 0, bytes, stream);
    return cudaMemcpyAsync(d_initial_state, d_final_state, bytes, cudaMemcpyDeviceToDevice, stream);
  }
  if (q == nullptr || k == nullptr || v == nullptr || g == nullptr || beta == nullptr ||
      d_o == nullptr || dq == nullptr || dk == nullptr || dv == nullptr || dg == nullptr ||
      dbeta == nullptr) {
    return cudaErrorInvalidValue;
  }
  const bool states_given = chunk_states != nullptr;
  if (states_given && reinterpret_cast<uintptr_t>(chunk_states) % 16 != 0) return cudaErrorInvalidValue;
  const int tokens = options.pass3_block_tokens;
  if (tokens != 0 && tokens != 32 && tokens != 64) return cudaErrorInvalidValue;
  if (tokens == 64 && blocked_pass3(dtype, key_dim, value_dim, options) &&
      !blocked_pass3_values(dtype, key_dim, value_dim, states_given, options)) {
    return cudaErrorInvalidValue;  // 64-token blocks asked for: they read V' and dVb
  }
  // Passes 1 and 2 store what pass 3 reads: with 64-token blocks the state entering and the gradient
  // of the state leaving every block (every fourth chunk's); with 32-token blocks the gradient of
  // the state leaving every block (every second chunk's) and the state entering every block (with V'
  // kept, every second block's: every fourth chunk's); else every chunk's.
  const bool blocks = blocked_pass3(dtype, key_dim, value_dim, options);
  const bool values = blocked_pass3_values(dtype, key_dim, value_dim, states_given, options);
  const int interval = backward_d_state_interval(dtype, key_dim, value_dim, states_given, options);
  const int state_interval =
      states_given ? options.chunk_states_interval : recomputed_state_interval(dtype, key_dim, value_dim, options);
  // Given states: every chunk's; every second one's for blocks; every fourth one's for blocks with V'.
  if (state_interval != 1 && !(blocks && (state_interval == 2 || (state_interval == 4 && values)))) {
    return cudaErrorInvalidValue;
  }
  if (options.new_values != nullptr &&
      (!states_given || reinterpret_cast<uintptr_t>(options.new_values) % 16 != 0)) {
    return cudaErrorInvalidValue;
  }
  const BackwardLayout layout(batch, length, heads, key_dim, value_dim, states_given, state_interval, interval,
                              values);
  unsigned char* scratch = static_cast<unsigned char*>(workspace);
  bool allocated = false;
  if (scratch == nullptr) {
    const cudaError_t error = cudaMallocAsync(reinterpret_cast<void**>(&scratch), layout.bytes, stream);
    if (error != cudaSuccess) return error;
    allocated = true;
  } else if (workspace_bytes < layout.bytes || reinterpret_cast<uintptr_t>(scratch) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  bf16* d_states = reinterpret_cast<bf16*>(scratch + layout.d_states);
  const int64_t chunks = (length + kChunk - 1) / kChunk;

  // Pass 1: the state entering every chunk (no outputs), unless the forward kept them.
  const bf16* states = static_cast<const bf16*>(chunk_states);
  cudaError_t error = cudaSuccess;
  if (!states_given) {
    bf16* recomputed = reinterpret_cast<bf16*>(scratch + layout.states);
    KdaChunkedOptions forward_options;
    forward_options.chunk_states = recomputed;
    forward_options.chunk_state_interval = state_interval;
    if (values) forward_options.new_values = scratch + layout.new_values;
    error = kda_chunked_forward(dtype, q, k, v, g, beta, initial_state, /*o=*/nullptr,
                                reinterpret_cast<float*>(scratch + layout.final_state), /*cu_seqlens=*/nullptr,
                                batch, length, heads, key_dim, value_dim, scale, forward_options, stream);
    states = recomputed;
  }
  if (error == cudaSuccess) {
    StateGradientArgs sa{};
    sa.forward.q = q, sa.forward.k = k, sa.forward.v = v, sa.forward.beta = beta;
    sa.forward.g = g, sa.forward.length = length, sa.forward.heads = static_cast<int>(heads);
    sa.forward.value_dim = static_cast<int>(value_dim), sa.forward.scale = scale;
    sa.forward.segment_length = length, sa.forward.first_segment_length = length, sa.forward.segments = 1;
    if (dtype == KdaDtype::kBFloat16 && layout.reverse.segments > 1) {  // the whole-head reverse walk's plan
      sa.forward.segment_length = layout.reverse.segment_length;
      sa.forward.segments = layout.reverse.segments;
      sa.forward.segment_states = reinterpret_cast<float*>(scratch + layout.segment_states);
      sa.forward.transition_a = reinterpret_cast<float*>(scratch + layout.transition_a);
      sa.forward.transition_b = reinterpret_cast<float*>(scratch + layout.transition_b);
    }
    sa.d_o = d_o, sa.d_final_state = d_final_state, sa.d_initial_state = d_initial_state;
    sa.chunk_d_states = d_states;
    sa.forward.state_interval = interval;
    ChunkGradientArgs ca{};
    ca.q = q, ca.k = k, ca.v = v, ca.beta = beta, ca.d_o = d_o, ca.g = g;
    ca.chunk_states = states, ca.chunk_d_states = d_states;
    ca.states_interval = state_interval, ca.d_states_interval = interval;
    if (values) {
      sa.d_new_values = reinterpret_cast<bf16*>(scratch + layout.d_new_values);
      ca.d_new_values = sa.d_new_values;
      ca.new_values = states_given ? static_cast<const bf16*>(options.new_values)
                                   : reinterpret_cast<const bf16*>(scratch + layout.new_values);
    }
    ca.dq = dq, ca.dk = dk, ca.dv = dv, ca.dg = dg, ca.dbeta = dbeta;
    ca.length = length, ca.heads = static_cast<int>(heads), ca.scale = scale;
    error = with_walk_types(dtype, key_dim, value_dim, [&](auto type, auto key, auto tile) {
      return run_backward<typename decltype(type)::type, key(), tile()>(sa, ca, batch, chunks,
                                                                        value_dim, options, stream);
    });
  }
  if (allocated) {
    const cudaError_t freed = cudaFreeAsync(scratch, stream);
    if (error == cudaSuccess) error = freed;
  }
  return error;
}

}  // namespace odyssey::kernels
