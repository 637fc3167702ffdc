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
//      forward's matmuls saw). Context parallel where the forward would be.
//   2. state gradients (kda_state_gradient_kernel): the forward's structure run backwards. One
//      CTA of 4 warps per (sequence, head, 64 value columns), or of 2 warps per 32 columns when K
//      or V is 32 (the forward's Walk tile); warp w holds 16 rows of dS^T in fp32 mma
//      accumulators. Chunks in groups of one per warp, prepared in parallel with the forward's
//      own prepare_chunk (Q^, W, K_, Aqk, e^gamma) plus this CTA's dO columns, then walked last to
//      first: store dS' (bf16, transposed, [N, H, chunks, V, K]), then
//        dV'^T = dS'^T K_^T + dO^T Aqk,   dS^T = dS'^T Diag(e^gamma) + dO^T Q^ - dV'^T W
//      (mma.sync m16n8k16, bf16 operands, fp32 accumulators). The last dS is d initial_state.
//   3. chunk gradients (kda_chunk_gradient_kernel): every chunk independent, one CTA of 16 warps
//      per (chunk, head, sequence) with S and dS' of that chunk in shared memory: recompute the
//      chunk in fp32, the five products with the K x V matrices (W S, K_ dS', dO S^T, V' dS'^T,
//      dV' S^T) as mma.sync with bf16 operands, everything 16 x 16 x {16, K, V} in fp32 on CUDA
//      cores, then dq, dk, dv, dbeta, dg as above.
// Workspace: two bf16 [N, H, chunks, K, V] (S and dS' per chunk) plus one fp32 state.
#include "kernels/kda.h"

#include <cuda_bf16.h>

#include <cstdint>

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
  bf16* chunk_d_states;          // [N, H, chunks, V, K]: dS' of every chunk (written)
};

// One chunk walked backwards by one warp on its 16 rows of dS^T (d_state[K / 8][4]: n-tile j
// holds dS^T[v_row + g (+8)][8j + 2t (+1)], the forward's state layout). slot.v holds this CTA's
// dO columns; v_local is the warp's first column within them.
template <int K, int kTile>
__device__ void reverse_walk_chunk(const ChunkSlot<K, kTile>& slot, float (&d_state)[K / 8][4],
                                   int v_local, int lane) {
  const FragmentOffsets f(lane);
  const int t = lane & 3;

  // dV'^T = dS'^T K_^T + dO^T Aqk   [16 value rows x 16 tokens]
  float x[2][4] = {};
#pragma unroll
  for (int k0 = 0; k0 < K; k0 += 16) {
    const int j = k0 / 8;
    const uint32_t s[4] = {pack_bf16(d_state[j][0], d_state[j][1]),
                           pack_bf16(d_state[j][2], d_state[j][3]),
                           pack_bf16(d_state[j + 1][0], d_state[j + 1][1]),
                           pack_bf16(d_state[j + 1][2], d_state[j + 1][3])};
    uint32_t b[4];
    ldmatrix_x4(b, &slot.k_bar[f.b_row][k0 + f.b_col]);
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

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int h = blockIdx.y, seq = blockIdx.z;
  const int H = a.heads, V = a.value_dim;
  const int v0 = blockIdx.x * kTile, v_col = v0 + warp * 16;
  const int g = lane >> 2, t = lane & 3;
  const int64_t length = a.length, row0 = static_cast<int64_t>(seq) * length;
  const int64_t num_chunks = (length + kChunk - 1) / kChunk;
  const int64_t state_offset = (static_cast<int64_t>(seq) * H + h) * K * V;

  float d_state[K / 8][4];
#pragma unroll
  for (int j = 0; j < K / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = 8 * j + 2 * t + (e & 1), vr = v_col + g + (e >> 1) * 8;
      d_state[j][e] = b.d_final_state ? b.d_final_state[state_offset + c * V + vr] : 0.0f;
    }
  }

  bf16* d_states = b.chunk_d_states + (static_cast<int64_t>(seq) * H + h) * num_chunks * V * K;
  for (int64_t group = (num_chunks - 1) / kWarps * kWarps; group >= 0; group -= kWarps) {
    const int64_t mine = group + warp;
    if (mine < num_chunks) {
      const int valid = static_cast<int>(min64(kChunk, length - mine * kChunk));
      prepare_chunk<T, K, kTile, /*kOutputs=*/true>(a, slots[warp], row0 + mine * kChunk, valid,
                                                    h, v0, /*with_values=*/false, lane);
      load_value_rows<T, kTile>(static_cast<const T*>(b.d_o), slots[warp].v, row0 + mine * kChunk,
                                valid, h, H, V, v0, lane);
    }
    __syncthreads();
    const int count = static_cast<int>(min64(kWarps, num_chunks - group));
    for (int s = count - 1; s >= 0; --s) {
      // dS' of this chunk (the gradient of the state leaving it), as pass 3 reads it.
      bf16* out = d_states + (group + s) * V * K;
#pragma unroll
      for (int j = 0; j < K / 8; ++j) {
        const int c = 8 * j + 2 * t;
        *reinterpret_cast<uint32_t*>(out + static_cast<int64_t>(v_col + g) * K + c) =
            pack_bf16(d_state[j][0], d_state[j][1]);
        *reinterpret_cast<uint32_t*>(out + static_cast<int64_t>(v_col + g + 8) * K + c) =
            pack_bf16(d_state[j][2], d_state[j][3]);
      }
      reverse_walk_chunk<K, kTile>(slots[s], d_state, v_col - v0, lane);
    }
    __syncthreads();
  }

  if (b.d_initial_state == nullptr) return;
#pragma unroll
  for (int j = 0; j < K / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = 8 * j + 2 * t + (e & 1), vr = v_col + g + (e >> 1) * 8;
      b.d_initial_state[state_offset + c * V + vr] = d_state[j][e];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Pass 3: the gradients of every chunk's inputs, chunks independent.

constexpr int kGradientWarps = 16;
constexpr int kGradientThreads = kGradientWarps * 32;  // = 2 x 16 x 16: two threads per C x C entry

struct ChunkGradientArgs {
  const void *q, *k, *v, *beta, *d_o;
  const float* g;
  const bf16* chunk_states;    // [N, H, chunks, V, K] S entering each chunk
  const bf16* chunk_d_states;  // [N, H, chunks, V, K] dS' leaving each chunk
  float *dq, *dk, *dv, *dg, *dbeta;
  int64_t length;
  int heads;
  float scale;
};

// Shared memory of one chunk (K = V = 128: 198 KB, one CTA per SM). bf16 rows padded by 8
// elements, fp32 rows by 4 (ldmatrix rows in distinct bank groups; strided columns spread).
template <int K, int V>
struct alignas(16) GradientShared {
  static constexpr int kRowK = K + 8, kRowV = V + 8, kPadK = K + 4, kPadV = V + 4;
  static constexpr int kPadC = kChunk + 1;
  bf16 s_t[V][kRowK];          // S^T of the chunk's entering state
  bf16 ds_t[V][kRowK];         // dS'^T
  bf16 a_w[kChunk][kRowK];     // W           (mma A operands, bf16)
  bf16 a_kbar[kChunk][kRowK];  // K_
  bf16 a_do[kChunk][kRowV];    // dO
  bf16 a_vn[kChunk][kRowV];    // V'
  bf16 a_dvn[kChunk][kRowV];   // dV'
  float gamma[kChunk][kPadK];  // Gamma; dGamma after the elementwise phase
  float q_hat[kChunk][kPadK], k_hat[kChunk][kPadK], k_check[kChunk][kPadK], k_bar[kChunk][kPadK];
  float d_qhat[kChunk][kPadK];  // dO S^T (the state part of dQ^)
  float d_kbar[kChunk][kPadK];  // V' dS'^T
  float d_w[kChunk][kPadK];     // -dV' S^T
  float v[kChunk][kPadV], d_o[kChunk][kPadV];
  float vn[kChunk][kPadV];   // U, then V' = U - W S
  float dvn[kChunk][kPadV];  // dV'
  float p[kChunk][kPadC];      // strictly_lower(K^ K~^T)
  float a_qk[kChunk][kPadC];   // lower_incl_diag(Q^ K~^T)
  float m[kChunk][kPadC];      // (I + Diag(beta) P)^-1
  float d_aqk[kChunk][kPadC];  // lower_incl_diag(dO V'^T)
  float d_m[kChunk][kPadC];    // G = dV' V^T, then dM
  float t1[kChunk][kPadC];     // dM M^T
  float d_l[kChunk][kPadC];    // dL (strictly lower)
  float x_beta[kChunk][kPadC]; // M (.) (G + H): column sums are dbeta's U and W terms
  float beta[kChunk];
  float decay[K];              // e^gamma
  float d_decay[K];            // e^gamma * sum_v dS' (.) S  (dgamma's direct term)
};

template <int K, int V>
constexpr size_t gradient_shared_bytes() {
  static_assert(sizeof(GradientShared<K, V>) <= 227 * 1024, "more than an SM's shared memory");
  return sizeof(GradientShared<K, V>);
}

// out[16][N] (+)= A[16][kdim] B, by the warps of the CTA, 16 output columns per warp at a time.
// A: bf16 rows (stride lda). B: bf16, stored as rows = n (stride ldb, k contiguous) when
// !kTransB, as rows = k (n contiguous) when kTransB. The result is handed to `store(i, col, x)`.
template <int kN, int kKdim, bool kTransB, typename Store>
__device__ __forceinline__ void mma_rows16(const bf16* a, int lda, const bf16* b, int ldb,
                                           int warp, int lane, Store store) {
  const FragmentOffsets f(lane);
  const int g = lane >> 2, t = lane & 3;
  for (int n0 = warp * 16; n0 < kN; n0 += kGradientWarps * 16) {
    float acc[2][4] = {};
#pragma unroll 4
    for (int k0 = 0; k0 < kKdim; k0 += 16) {
      uint32_t af[4], bf[4];
      ldmatrix_x4(af, a + f.a_row * lda + k0 + f.a_col);
      if constexpr (kTransB) {
        ldmatrix_x4_trans(bf, b + (k0 + f.t_row) * ldb + n0 + f.t_col);
      } else {
        ldmatrix_x4(bf, b + (n0 + f.b_row) * ldb + k0 + f.b_col);
      }
      mma(acc[0], af, bf[0], bf[1]);
      mma(acc[1], af, bf[2], bf[3]);
    }
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) store(g + (e >> 1) * 8, n0 + n * 8 + 2 * t + (e & 1), acc[n][e]);
    }
  }
}

// Grid (chunks, H, N); 512 threads (the tensor-core phases use 8 warps at most; the fp32 phases
// all of them, to hide shared-memory latency with one CTA per SM).
template <typename T, int K, int V>
__global__ void __launch_bounds__(kGradientThreads, 1)
    kda_chunk_gradient_kernel(const ChunkGradientArgs a) {
  extern __shared__ __align__(16) unsigned char shared_raw[];
  GradientShared<K, V>& sh = *reinterpret_cast<GradientShared<K, V>*>(shared_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t chunk = blockIdx.x;
  const int h = blockIdx.y, seq = blockIdx.z, H = a.heads;
  const int64_t num_chunks = (a.length + kChunk - 1) / kChunk;
  const int64_t row0 = static_cast<int64_t>(seq) * a.length + chunk * kChunk;
  const int valid = static_cast<int>(min64(kChunk, a.length - chunk * kChunk));
  auto token = [&](int i) { return (row0 + i) * H + h; };  // [B, L, H] index of row i
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  const T* d_o = static_cast<const T*>(a.d_o);
  const T* beta = static_cast<const T*>(a.beta);

  // Phase 0: Gamma (cumulative over the chunk's rows), e^gamma, beta; S^T and dS'^T; V, dO.
  for (int kk = tid; kk < K; kk += kGradientThreads) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      if (i < valid) acc += a.g[token(i) * K + kk];
      sh.gamma[i][kk] = acc;
    }
    sh.decay[kk] = expf(acc);
  }
  if (tid < kChunk) sh.beta[tid] = tid < valid ? to_float(beta[token(tid)]) : 0.0f;
  {
    const int64_t offset = ((static_cast<int64_t>(seq) * H + h) * num_chunks + chunk) * V * K;
    const uint4* s = reinterpret_cast<const uint4*>(a.chunk_states + offset);
    const uint4* ds = reinterpret_cast<const uint4*>(a.chunk_d_states + offset);
    for (int e = tid; e < V * K / 8; e += kGradientThreads) {
      const int vr = e / (K / 8), col = (e % (K / 8)) * 8;
      *reinterpret_cast<uint4*>(&sh.s_t[vr][col]) = s[e];
      *reinterpret_cast<uint4*>(&sh.ds_t[vr][col]) = ds[e];
    }
  }
  for (int e = tid; e < kChunk * V; e += kGradientThreads) {
    const int i = e / V, c = e % V;
    const float x = i < valid ? to_float(v[token(i) * V + c]) : 0.0f;
    const float y = i < valid ? to_float(d_o[token(i) * V + c]) : 0.0f;
    sh.v[i][c] = x;
    sh.d_o[i][c] = y;
    sh.a_do[i][c] = __float2bfloat16_rn(y);
  }
  __syncthreads();

  // Q^, K^, K~, K_ in fp32 (and K_ as a bf16 operand).
  for (int e = tid; e < kChunk * K; e += kGradientThreads) {
    const int i = e / K, c = e % K;
    const float qv = i < valid ? to_float(q[token(i) * K + c]) : 0.0f;
    const float kv = i < valid ? to_float(k[token(i) * K + c]) : 0.0f;
    const float up = expf(sh.gamma[i][c]), down = expf(-sh.gamma[i][c]);
    sh.q_hat[i][c] = a.scale * qv * up;
    sh.k_hat[i][c] = kv * up;
    sh.k_check[i][c] = kv * down;
    const float kb = kv * (sh.decay[c] * down);
    sh.k_bar[i][c] = kb;
    sh.a_kbar[i][c] = __float2bfloat16_rn(kb);
  }
  __syncthreads();

  // Phase 1: P and Aqk. C x C entries: two neighbouring lanes per entry (ri, rj), each summing
  // half of a long dot product; `both` adds the pair's halves (every lane gets the sum).
  const int half = tid & 1, ri = (tid >> 1) / kChunk, rj = (tid >> 1) % kChunk;
  auto both = [](float x) { return x + __shfl_xor_sync(0xffffffffu, x, 1); };
  {
    float pp = 0.0f, aq = 0.0f;
#pragma unroll 8
    for (int c = half * (K / 2); c < (half + 1) * (K / 2); ++c) {
      pp += sh.k_hat[ri][c] * sh.k_check[rj][c];
      aq += sh.q_hat[ri][c] * sh.k_check[rj][c];
    }
    pp = both(pp), aq = both(aq);
    if (half == 0) {
      sh.p[ri][rj] = rj < ri ? pp : 0.0f;
      sh.a_qk[ri][rj] = rj <= ri ? aq : 0.0f;
    }
  }
  __syncthreads();

  // Phase 2: M = (I + Diag(beta) P)^-1 by forward substitution in fp32, thread c owns column c.
  if (tid < kChunk) {
    const int c = tid;
    float col[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      float s = i == c ? 1.0f : 0.0f;
#pragma unroll
      for (int j = 0; j < i; ++j) s -= sh.beta[i] * sh.p[i][j] * col[j];
      col[i] = s;
      sh.m[i][c] = s;
    }
  }
  __syncthreads();

  // Phase 3: W = M Diag(beta) K^ (bf16 operand only), U = M Diag(beta) V (into vn).
  for (int e = tid; e < kChunk * K; e += kGradientThreads) {
    const int i = e / K, c = e % K;
    float acc = 0.0f;
    for (int l = 0; l <= i; ++l) acc += sh.m[i][l] * sh.beta[l] * sh.k_hat[l][c];
    sh.a_w[i][c] = __float2bfloat16_rn(acc);
  }
  for (int e = tid; e < kChunk * V; e += kGradientThreads) {
    const int i = e / V, c = e % V;
    float acc = 0.0f;
    for (int l = 0; l <= i; ++l) acc += sh.m[i][l] * sh.beta[l] * sh.v[l][c];
    sh.vn[i][c] = acc;
  }
  __syncthreads();

  // Phase 4 (tensor cores): V' = U - W S and dV' = K_ dS' (+ Aqk^T dO in phase 5).
  // B(k = kk, n = v) = S[kk][v] = S^T[v][kk]: stored rows = n.
  mma_rows16<V, K, false>(&sh.a_w[0][0], sh.kRowK, &sh.s_t[0][0], sh.kRowK, warp, lane,
                          [&](int i, int c, float x) { sh.vn[i][c] -= x; });
  mma_rows16<V, K, false>(&sh.a_kbar[0][0], sh.kRowK, &sh.ds_t[0][0], sh.kRowK, warp, lane,
                          [&](int i, int c, float x) { sh.dvn[i][c] = x; });
  __syncthreads();

  // Phase 5: dV' += Aqk^T dO; dAqk = lower_incl_diag(dO V'^T); e^gamma sum_v dS' S.
  for (int e = tid; e < kChunk * V; e += kGradientThreads) {
    const int i = e / V, c = e % V;
    float acc = sh.dvn[i][c];
    for (int r = i; r < kChunk; ++r) acc += sh.a_qk[r][i] * sh.d_o[r][c];
    sh.dvn[i][c] = acc;
    sh.a_dvn[i][c] = __float2bfloat16_rn(acc);
    sh.a_vn[i][c] = __float2bfloat16_rn(sh.vn[i][c]);
  }
  {
    float acc = 0.0f;
    if (rj <= ri) {
#pragma unroll 8
      for (int c = half * (V / 2); c < (half + 1) * (V / 2); ++c) acc += sh.d_o[ri][c] * sh.vn[rj][c];
    }
    acc = both(acc);
    if (half == 0) sh.d_aqk[ri][rj] = acc;
  }
  for (int c = tid; c < K; c += kGradientThreads) {
    float acc = 0.0f;
    for (int r = 0; r < V; ++r) {
      acc += __bfloat162float(sh.ds_t[r][c]) * __bfloat162float(sh.s_t[r][c]);
    }
    sh.d_decay[c] = sh.decay[c] * acc;
  }
  __syncthreads();

  // Phase 6 (tensor cores): dO S^T, V' dS'^T, -dV' S^T  [16 x K]; B(k = v, n = kk) = S^T[v][kk]:
  // stored rows = k. Beside them: dv = Diag(beta) M^T dV' and G = dV' V^T.
  mma_rows16<K, V, true>(&sh.a_do[0][0], sh.kRowV, &sh.s_t[0][0], sh.kRowK, warp, lane,
                         [&](int i, int c, float x) { sh.d_qhat[i][c] = x; });
  mma_rows16<K, V, true>(&sh.a_vn[0][0], sh.kRowV, &sh.ds_t[0][0], sh.kRowK, warp, lane,
                         [&](int i, int c, float x) { sh.d_kbar[i][c] = x; });
  mma_rows16<K, V, true>(&sh.a_dvn[0][0], sh.kRowV, &sh.s_t[0][0], sh.kRowK, warp, lane,
                         [&](int i, int c, float x) { sh.d_w[i][c] = -x; });
  for (int e = tid; e < kChunk * V; e += kGradientThreads) {
    const int i = e / V, c = e % V;
    float acc = 0.0f;
    for (int r = i; r < kChunk; ++r) acc += sh.m[r][i] * sh.dvn[r][c];
    if (i < valid) a.dv[token(i) * V + c] = sh.beta[i] * acc;
  }
  {
    float acc = 0.0f;
#pragma unroll 8
    for (int c = half * (V / 2); c < (half + 1) * (V / 2); ++c) acc += sh.dvn[ri][c] * sh.v[rj][c];
    acc = both(acc);
    if (half == 0) sh.d_m[ri][rj] = acc;  // G[t = ri][i = rj]
  }
  __syncthreads();

  // Phase 7: H = dW K^^T; dM = (G + H) Diag(beta); M (.) (G + H) for dbeta.
  {
    float hh = 0.0f;
#pragma unroll 8
    for (int c = half * (K / 2); c < (half + 1) * (K / 2); ++c) hh += sh.d_w[ri][c] * sh.k_hat[rj][c];
    hh = both(hh);
    if (half == 0) {
      const float gh = sh.d_m[ri][rj] + hh;
      sh.d_m[ri][rj] = sh.beta[rj] * gh;
      sh.x_beta[ri][rj] = sh.m[ri][rj] * gh;
    }
  }
  __syncthreads();
  // Phase 8: dL = -M^T dM M^T, strictly lower.
  {
    float acc = 0.0f;
#pragma unroll
    for (int c = half * 8; c < half * 8 + 8; ++c) acc += sh.d_m[ri][c] * sh.m[rj][c];
    acc = both(acc);
    if (half == 0) sh.t1[ri][rj] = acc;
  }
  __syncthreads();
  {
    float acc = 0.0f;
#pragma unroll
    for (int c = half * 8; c < half * 8 + 8; ++c) acc -= sh.m[c][ri] * sh.t1[c][rj];
    acc = both(acc);
    if (half == 0) sh.d_l[ri][rj] = rj < ri ? acc : 0.0f;
  }
  __syncthreads();

  // Phase 9: dbeta.
  if (tid < kChunk && tid < valid) {
    const int i = tid;
    float acc = 0.0f;
#pragma unroll
    for (int r = 0; r < kChunk; ++r) acc += sh.x_beta[r][i] + sh.d_l[i][r] * sh.p[i][r];
    a.dbeta[token(i)] = acc;
  }
  // Phase 10: dQ^, dK^, dK~, dK_ per element; dq, dk; dGamma (over Gamma, by its owner).
  for (int e = tid; e < kChunk * K; e += kGradientThreads) {
    const int i = e / K, c = e % K;
    float d_qhat = sh.d_qhat[i][c], d_kb = 0.0f, d_khat = 0.0f, d_kcheck = 0.0f;
    for (int j = 0; j <= i; ++j) d_qhat += sh.d_aqk[i][j] * sh.k_check[j][c];
    for (int r = i; r < kChunk; ++r) d_kb += sh.m[r][i] * sh.d_w[r][c];  // (M^T dW)[i]
    for (int j = 0; j < i; ++j) d_khat += sh.d_l[i][j] * sh.k_check[j][c];
    d_khat = sh.beta[i] * (d_kb + d_khat);
    for (int r = i + 1; r < kChunk; ++r) d_kcheck += sh.beta[r] * sh.d_l[r][i] * sh.k_hat[r][c];
    for (int r = i; r < kChunk; ++r) d_kcheck += sh.d_aqk[r][i] * sh.q_hat[r][c];
    const float d_kbar = sh.d_kbar[i][c];
    const float up = expf(sh.gamma[i][c]), down = expf(-sh.gamma[i][c]);
    if (i < valid) {
      a.dq[token(i) * K + c] = a.scale * d_qhat * up;
      a.dk[token(i) * K + c] = d_khat * up + d_kcheck * down + d_kbar * (sh.decay[c] * down);
    }
    sh.gamma[i][c] = d_qhat * sh.q_hat[i][c] + d_khat * sh.k_hat[i][c] -
                     d_kcheck * sh.k_check[i][c] - d_kbar * sh.k_bar[i][c];
  }
  __syncthreads();

  // Phase 11: dg = reverse cumulative sum of dGamma + dgamma.
  for (int c = tid; c < K; c += kGradientThreads) {
    float acc = sh.d_decay[c];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) acc += sh.d_kbar[i][c] * sh.k_bar[i][c];
#pragma unroll
    for (int i = kChunk - 1; i >= 0; --i) {
      acc += sh.gamma[i][c];
      if (i < valid) a.dg[token(i) * K + c] = acc;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launch.

struct BackwardLayout {
  size_t states = 0, d_states = 0, final_state = 0, bytes = 0;
  BackwardLayout(int64_t batch, int64_t length, int64_t heads, int64_t key, int64_t value) {
    auto aligned = [](size_t n) { return (n + 255) / 256 * 256; };
    const size_t chunks = static_cast<size_t>((length + kChunk - 1) / kChunk);
    const size_t per_chunk = static_cast<size_t>(batch * heads) * chunks * key * value * sizeof(bf16);
    d_states = aligned(per_chunk);
    final_state = d_states + aligned(per_chunk);
    bytes = final_state + aligned(static_cast<size_t>(batch * heads * key * value) * sizeof(float));
  }
};

template <typename T, int K, int V>
cudaError_t launch_chunk_gradients(const ChunkGradientArgs& a, int64_t batch, int64_t chunks,
                                   cudaStream_t stream) {
  constexpr size_t shared = gradient_shared_bytes<K, V>();
  const cudaError_t configured = cudaFuncSetAttribute(
      kda_chunk_gradient_kernel<T, K, V>, cudaFuncAttributeMaxDynamicSharedMemorySize,
      static_cast<int>(shared));
  if (configured != cudaSuccess) return configured;
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(a.heads),
                  static_cast<unsigned>(batch));
  kda_chunk_gradient_kernel<T, K, V><<<grid, kGradientThreads, shared, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, int K, int kTile>
cudaError_t run_backward(const StateGradientArgs& sa, const ChunkGradientArgs& ca, int64_t batch,
                         int64_t chunks, int64_t value_dim, cudaStream_t stream) {
  constexpr size_t shared = chunked_shared_bytes<K, kTile>();
  cudaError_t error = cudaFuncSetAttribute(kda_state_gradient_kernel<T, K, kTile>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(shared));
  if (error != cudaSuccess) return error;
  error = cudaFuncSetAttribute(kda_state_gradient_kernel<T, K, kTile>,
                               cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
  if (error != cudaSuccess) return error;
  const dim3 grid(static_cast<unsigned>(value_dim / kTile), static_cast<unsigned>(ca.heads),
                  static_cast<unsigned>(batch));
  kda_state_gradient_kernel<T, K, kTile><<<grid, Walk<kTile>::kThreads, shared, stream>>>(sa);
  error = cudaGetLastError();
  if (error != cudaSuccess) return error;
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

}  // namespace

size_t kda_chunked_backward_workspace_bytes(int64_t batch, int64_t length, int64_t heads,
                                            int64_t key_dim, int64_t value_dim) {
  if (!backward_sizes_supported(batch, length, heads, key_dim, value_dim) || batch == 0 ||
      length == 0) {
    return 0;
  }
  return BackwardLayout(batch, length, heads, key_dim, value_dim).bytes;
}

cudaError_t kda_chunked_backward(KdaDtype dtype, const void* q, const void* k, const void* v,
                                 const float* g, const void* beta, const float* initial_state,
                                 const void* d_o, const float* d_final_state, float* dq,
                                 float* dk, float* dv, float* dg, float* dbeta,
                                 float* d_initial_state, int64_t batch, int64_t length,
                                 int64_t heads, int64_t key_dim, int64_t value_dim, float scale,
                                 void* workspace, size_t workspace_bytes, cudaStream_t stream) {
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
  const BackwardLayout layout(batch, length, heads, key_dim, value_dim);
  unsigned char* scratch = static_cast<unsigned char*>(workspace);
  bool allocated = false;
  if (scratch == nullptr) {
    const cudaError_t error = cudaMallocAsync(reinterpret_cast<void**>(&scratch), layout.bytes, stream);
    if (error != cudaSuccess) return error;
    allocated = true;
  } else if (workspace_bytes < layout.bytes || reinterpret_cast<uintptr_t>(scratch) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  bf16* states = reinterpret_cast<bf16*>(scratch + layout.states);
  bf16* d_states = reinterpret_cast<bf16*>(scratch + layout.d_states);
  float* final_state = reinterpret_cast<float*>(scratch + layout.final_state);
  const int64_t chunks = (length + kChunk - 1) / kChunk;

  // Pass 1: the state entering every chunk (no outputs).
  KdaChunkedOptions forward_options;
  forward_options.chunk_states = states;
  cudaError_t error = kda_chunked_forward(dtype, q, k, v, g, beta, initial_state, /*o=*/nullptr,
                                          final_state, /*cu_seqlens=*/nullptr, batch, length,
                                          heads, key_dim, value_dim, scale, forward_options, stream);
  if (error == cudaSuccess) {
    StateGradientArgs sa{};
    sa.forward.q = q, sa.forward.k = k, sa.forward.v = v, sa.forward.beta = beta;
    sa.forward.g = g, sa.forward.length = length, sa.forward.heads = static_cast<int>(heads);
    sa.forward.value_dim = static_cast<int>(value_dim), sa.forward.scale = scale;
    sa.forward.segment_length = length, sa.forward.segments = 1;
    sa.d_o = d_o, sa.d_final_state = d_final_state, sa.d_initial_state = d_initial_state;
    sa.chunk_d_states = d_states;
    ChunkGradientArgs ca{};
    ca.q = q, ca.k = k, ca.v = v, ca.beta = beta, ca.d_o = d_o, ca.g = g;
    ca.chunk_states = states, ca.chunk_d_states = d_states;
    ca.dq = dq, ca.dk = dk, ca.dv = dv, ca.dg = dg, ca.dbeta = dbeta;
    ca.length = length, ca.heads = static_cast<int>(heads), ca.scale = scale;
    error = with_walk_types(dtype, key_dim, value_dim, [&](auto type, auto key, auto tile) {
      return run_backward<typename decltype(type)::type, key(), tile()>(sa, ca, batch, chunks,
                                                                        value_dim, stream);
    });
  }
  if (allocated) {
    const cudaError_t freed = cudaFreeAsync(scratch, stream);
    if (error == cudaSuccess) error = freed;
  }
  return error;
}

}  // namespace odyssey::kernels
