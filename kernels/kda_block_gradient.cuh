// Pass 3 of the KDA backward by blocks of 32 tokens (bf16, K = V = 128): included by
// kda_backward.cu, whose derivation (the comment block at its top) this follows, with the
// intra-chunk products anchored per 16-token sub-chunk (model::kda::chunked_reference(..., chunk
// = 32, anchor = 16), FLA's sub-chunking); design and numbers: kernels/JOURNAL.md, "Sixteenth session"
// and "Seventeenth session" (the default since then, for bf16 with K = V = 128).
//
// Why blocks: pass 3 by 16-token chunks (kda_chunk_gradient_kernel) pays its fixed costs - the S and
// dS' loads (32 KB each), nine barriers, the elementwise passes - once per 16 tokens, and its
// products are 16 rows tall. A block of 32 reads S entering it and dS' leaving it once (passes 1
// and 2 store only those: every second chunk's), and every product with the K x V state is 32 rows
// tall.
// Within the block the intra products (P, Aqk) are 2 x 2 blocks of 16 x 16, each anchored at its
// row sub-chunk's start B_a (B_0 = 0, B_1 = Gamma[15]) so that no exponent leaves e^{16 |g|}:
//   block (a, b):  X_a = x e^{Gamma - B_a} (rows of sub-chunk a)    Kc_ab = k e^{B_a - Gamma} (rows of b)
// and the (1, 0) block's column operand is made from the (0, 0) one, Kc_10 = bf16(Kc_0 (.) e^{B_1})
// (a bf16 product in registers; e^{B_1} <= 1), the same bf16 values in dGamma's terms, so that each
// pair's two terms cancel in dg's reverse sum (the fifteenth session's finding).
// M = (I + Diag(beta) P)^-1 by 16 x 16 blocks: the diagonal ones by the fp32 substitution, M_10 =
// -(M_11 L_10) M_00 by two bf16 products (model::kda::unit_lower_inverse_by_blocks).
//
// Work split: 16 warps; warp w owns the 16 x 16 tile (rows 16 (w / 8), columns 16 (w % 8)) of every
// [32][128] result - dq, dk and dGamma accumulate in its registers over the phases (no fp32
// [32][128] arrays in shared memory), and it makes that tile of dV', W, U, V', dW, dv. The 32 x 32
// products (P, Aqk, G, H, dAqk, M's blocks, dL's tiles) are tasks of warps 9-15. Nine barriers a
// block after the loads (BlockLoads: how those reach shared memory).
//
// V' and dV' (the default since the eighteenth session, KdaBackwardOptions::keep_values): passes 1
// and 2 keep them and this pass reads them with v and dO (kGivenV, kGivenDV below) instead of making
// W, U, Aqk, V' = U - W S and dV' = K_ dS' + Aqk^T dO. With both given the chain through M collapses
// (twenty-ninth session; model::kda::BackwardForm): dKb = -dVb S^T and dL = -dVb V'^T from dVb =
// M^T dV', which the reverse walk keeps in place of dV' (thirtieth session), so that no M is made
// here and W, dW, G, H, dM and the products around it are gone: seven barriers a block after the
// loads instead of nine.
#pragma once

#include <cuda.h>  // CUtensorMap (BlockLoads::kTma); the encoder comes through the runtime

#include <initializer_list>

namespace odyssey::kernels {
namespace {

constexpr int kBlock = 32;             // tokens a pass-3 item
constexpr int kBlockSubChunks = kBlock / kChunk;
static_assert(kBlockSubChunks == 2, "the (1, 0) block is the only one below the diagonal");

template <int K, int V>
struct alignas(128) BlockShared {
  static constexpr int kRowK = K + 8, kRowV = V + 8, kRowC = kBlock + 8, kPadK = K + 4, kPadC = kBlock + 4;
  static constexpr int kSlices = kGradientThreads / (K / 2);  // of the V rows (d_decay), of Gamma's rows
  // The arrays an item loads (s_t .. gamma) start at multiples of 128 bytes (TMA destinations,
  // BlockLoads::kTma: boxes padded to the rows' widths by the copies' zero fill).
  alignas(128) bf16 s_t[V][kRowK];   // S^T entering the block
  alignas(128) bf16 ds_t[V][kRowK];  // dS'^T leaving it
  struct Inputs {
    bf16 q[kBlock][kRowK], k[kBlock][kRowK];
  };
  struct Middle {
    bf16 w[kBlock][kRowK];    // W = M Diag(beta) K^      (phases 4-5)
    bf16 d_w[kBlock][kRowK];  // dW = -dV' S^T           (phases 4-5)
  };
  union alignas(128) {
    Inputs in;                        // phases 0-3
    Middle mid;                       // phases 4-5 (the next item's q and k land from phase 6 on)
  };
  alignas(128) bf16 v[kBlock][kRowV];
  alignas(128) bf16 d_o[kBlock][kRowV];
  alignas(128) float gamma[kBlock][kPadK];  // g as loaded, then Gamma (from the block's start) unless dV' is given
  bf16 x_q[kBlock][kRowK];     // scale q e^{Gamma - B_a}
  bf16 x_k[kBlock][kRowK];     // k e^{Gamma - B_a}
  bf16 k_c[kBlock][kRowK];     // k e^{B_a - Gamma}
  struct Decayed {
    bf16 k_hat[kBlock][kRowK];  // K^ = k e^Gamma
    bf16 k_bar[kBlock][kRowK];  // K_ = k e^{gamma - Gamma}
  };
  union alignas(16) {
    Decayed decayed;               // phases 1-6 (1-4 where dV' is given)
    float d_gamma[kBlock][kPadK];  // phases 7-8 (5-6 where dV' is given)
  };
  bf16 v_new[kBlock][kRowV];   // V'
  bf16 d_v_new[kBlock][kRowV]; // dV'
  float p[kBlock][kPadC];      // strictly_lower(P)
  // The inverse chain's arrays (dL = -M^T dM M^T: where dV' is not given), or, where it is, Gamma and
  // dbeta's parts: Gamma apart from g's rows as loaded, so that the next item's g can land from phase
  // 1 on, and dGamma in the Decayed operands' space (d_gamma), written by the intra blocks after the
  // pair's next state has last read K_.
  struct InverseChain {
    float gh[kBlock][kPadC];     // G + H (lower, diagonal included)
    float m[kBlock][kPadC];      // M
    bf16 a_qk[kBlock][kRowC];    // Aqk (lower, diagonal included)
    bf16 mb_b[kBlock][kRowC];    // M Diag(beta)
    bf16 t1[kBlock][kRowC];      // dM M^T (the dL chain's)
    bf16 d_m[kBlock][kRowC];     // dM = (G + H) Diag(beta) below the diagonal
  };
  struct Innovations {
    float gamma[kBlock][kPadK];         // Gamma (phases 1-5): g's rows as loaded are free after phase 0
    float dbeta_parts[kBlock][V / 16];  // dVb (.) V - Y (.) K^ over each 16-column tile (phases 3-6)
  };
  union alignas(16) {
    InverseChain chain;
    Innovations given;
  };
  bf16 m_b[kBlock][kRowC];     // M (where dV' is not given)
  bf16 d_aqk[kBlock][kRowC];   // dAqk
  bf16 d_p[kBlock][kRowC];     // dP = Diag(beta) dL
  alignas(16) float l_t[kBlockSubChunks][kChunk][kChunk];  // the diagonal blocks' L^T
  float part[kSlices][K];      // Gamma's partial sums (phase 0)
  float d_decay[kSlices][K];   // sum_v dS' (.) S over slices of the V rows
  float kbar_sum[2][K];        // column sums of dK_ (.) K_ over each row tile
  float beta[kBlock];
  float anchor[K];             // B_1 = Gamma[15]
  float last[K];               // gamma = Gamma[31]
  bf16 c10[K];                 // e^{B_1}: Kc_10 = Kc_0 (.) e^{B_1}
  float dbeta_l[2][kBlock];    // sum_j dL_ij P_ij over the columns of tile 0 and tile 1
  uint64_t loaded[3];          // BlockLoads::kTma: the mbarriers of an item's three load parts
};

// KDA_PHASE_PROFILE: thread 0 adds the cycles between the kernel's barriers to g_phase_cycles[phase]
// (scripts/kda_backward_driver.cu prints them per block), a phase's length at its slowest warp; and
// each compute warp's lane 0 adds its own work in each phase (from leaving one barrier to arriving at
// the next: 0 the top of an item up to its loads' barrier, then phases 0-8) to
// g_warp_phase_cycles[warp][1 + phase]: which warp each barrier waits for.
#ifdef KDA_PHASE_PROFILE
__device__ unsigned long long g_phase_cycles[16];
__device__ unsigned long long g_warp_phase_cycles[kGradientWarps][16];
#define BLOCK_WARP_ARRIVE()                                                                         \
  do {                                                                                              \
    if (lane == 0 && warp_phase < 16) {                                                             \
      atomicAdd(&g_warp_phase_cycles[warp][warp_phase], static_cast<unsigned long long>(clock64() - warp_mark)); \
    }                                                                                               \
  } while (0)
#define BLOCK_WARP_LEAVE() \
  do {                     \
    warp_mark = clock64(); \
    ++warp_phase;          \
  } while (0)
#define BLOCK_PHASE_MARK(id)                                                      \
  do {                                                                            \
    if (tid == 0) {                                                               \
      const long long now = clock64();                                            \
      atomicAdd(&g_phase_cycles[id], static_cast<unsigned long long>(now - mark)); \
      mark = now;                                                                 \
    }                                                                             \
  } while (0)
#else
#define BLOCK_PHASE_MARK(id) \
  do {                       \
  } while (0)
#define BLOCK_WARP_ARRIVE() \
  do {                      \
  } while (0)
#define BLOCK_WARP_LEAVE() \
  do {                     \
  } while (0)
#endif

template <int K, int V>
constexpr size_t block_shared_bytes() {
  static_assert(sizeof(BlockShared<K, V>) <= 227 * 1024, "more than an SM's shared memory");
  return sizeof(BlockShared<K, V>);
}

__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t x, __nv_bfloat162 f) {
  __nv_bfloat162 y = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&x), f);
  return *reinterpret_cast<uint32_t*>(&y);
}

// Fragment sources for one m16n8k16 k-step (FragmentOffsets f, kernels/mma.cuh):
//   A from rows (m, k contiguous)           a_rows(x, ld, m0, k0)
//   A = X^T from X's rows (k, m contiguous) a_trans(x, ld, m0, k0)
//   B of two n8 tiles, stored rows = n       b_rows(x, ld, n0, k0)
//   B of two n8 tiles, stored rows = k       b_trans(x, ld, n0, k0)
__device__ __forceinline__ void a_rows(uint32_t (&r)[4], const bf16* x, int ld, int m0, int k0,
                                       const FragmentOffsets& f) {
  ldmatrix_x4(r, x + (m0 + f.a_row) * ld + k0 + f.a_col);
}
__device__ __forceinline__ void a_trans(uint32_t (&r)[4], const bf16* x, int ld, int m0, int k0,
                                        const FragmentOffsets& f) {
  ldmatrix_x4_trans(r, x + (k0 + f.b_row) * ld + m0 + f.b_col);
}
__device__ __forceinline__ void b_rows(uint32_t (&r)[4], const bf16* x, int ld, int n0, int k0,
                                       const FragmentOffsets& f) {
  ldmatrix_x4(r, x + (n0 + f.b_row) * ld + k0 + f.b_col);
}
__device__ __forceinline__ void b_trans(uint32_t (&r)[4], const bf16* x, int ld, int n0, int k0,
                                        const FragmentOffsets& f) {
  ldmatrix_x4_trans(r, x + (k0 + f.t_row) * ld + n0 + f.t_col);
}
__device__ __forceinline__ void mma2(float (&acc)[2][4], const uint32_t (&a)[4], const uint32_t (&b)[4]) {
  mma(acc[0], a, b[0], b[1]);
  mma(acc[1], a, b[2], b[3]);
}

// acc += A[m0 .. m0 + 15][0 .. kDepth) B[0 .. kDepth)[n0 .. n0 + 15]: A from its rows, B stored
// rows = n (kBTrans false) or rows = k (true).
template <int kDepth, bool kBTrans>
__device__ __forceinline__ void tile_product(float (&acc)[2][4], const bf16* a, int lda, int m0, const bf16* b,
                                             int ldb, int n0, const FragmentOffsets& f) {
#pragma unroll
  for (int k0 = 0; k0 < kDepth; k0 += 16) {
    uint32_t af[4], bf[4];
    a_rows(af, a, lda, m0, k0, f);
    if constexpr (kBTrans) {
      b_trans(bf, b, ldb, n0, k0, f);
    } else {
      b_rows(bf, b, ldb, n0, k0, f);
    }
    mma2(acc, af, bf);
  }
}

// tile_product on two row tiles at once, m0[0] and m0[1], sharing each k step's B fragment: the same
// sums in the same order as two tile_products (the same bits), with three ldmatrix to four mma
// instead of four.
template <int kDepth, bool kBTrans>
__device__ __forceinline__ void tile_product_rows2(float (&acc)[2][2][4], const bf16* a, int lda, const int (&m0)[2],
                                                   const bf16* b, int ldb, int n0, const FragmentOffsets& f) {
#pragma unroll
  for (int k0 = 0; k0 < kDepth; k0 += 16) {
    uint32_t af[2][4], bf[4];
    if constexpr (kBTrans) {
      b_trans(bf, b, ldb, n0, k0, f);
    } else {
      b_rows(bf, b, ldb, n0, k0, f);
    }
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      a_rows(af[s], a, lda, m0[s], k0, f);
      mma2(acc[s], af[s], bf);
    }
  }
}

// The lower 16 x 16 blocks of a 32 x 32 product, (0, 0), (1, 0), (1, 1), by task index 0-2.
struct LowerBlock {
  int ra, cb;  // row block, column block
  __device__ explicit LowerBlock(int index) : ra(index == 0 ? 0 : 1), cb(index == 2 ? 1 : 0) {}
};

// Calls f(n, e, row, col) for the 8 entries a lane holds of a 16 x 16 accumulator tile acc[2][4]
// at (m0, n0): row m0 + g (+8 for e >= 2), column n0 + 8 n + 2 t (+1 for odd e).
template <typename F>
__device__ __forceinline__ void for_tile(int m0, int n0, int lane, F&& f) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) f(n, e, m0 + g + (e >> 1) * 8, n0 + n * 8 + 2 * t + (e & 1));
  }
}

// for_tile by column pairs: f(n, h, i, c) for this lane's elements e = 2 h and 2 h + 1 of n8 half n,
// row i, columns c and c + 1 (c even), so that an epilogue reads its operands as 4- and 8-byte pairs.
template <typename F>
__device__ __forceinline__ void for_tile_pairs(int m0, int n0, int lane, F&& f) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int h = 0; h < 2; ++h) f(n, h, m0 + g + h * 8, n0 + n * 8 + 2 * t);
  }
}

// Pieces of the block passes, used by kda_block64_gradient.cuh. The kernel below still writes them
// out: folded onto these, its two producer-warp forms compile to 8 instructions fewer (ptxas 13.0,
// sm_90a; the other 30 kernels the same bits), a change to time on the GPU first.
//
// Phase 0: Gamma's running sums down kRows rows of column pair cp from `rows` (g as loaded; into
// local, their total into part), and sum_v dS' (.) S over kVRows rows of S^T and dS'^T from row v0
// (into d_decay).
template <int kRows, int kVRows, int kPad, int kRow>
__device__ __forceinline__ void block_partial_sums(const float (*rows)[kPad], const bf16 (*s_t)[kRow],
                                                   const bf16 (*ds_t)[kRow], int cp, int v0, float* part,
                                                   float* d_decay, float2 (&local)[kRows]) {
  float2 acc = make_float2(0.0f, 0.0f);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float2 x = *reinterpret_cast<const float2*>(&rows[r][cp]);
    acc.x += x.x, acc.y += x.y;
    local[r] = acc;
  }
  *reinterpret_cast<float2*>(part) = acc;
  float2 dd = make_float2(0.0f, 0.0f);
#pragma unroll 4
  for (int r = v0; r < v0 + kVRows; ++r) {
    const float2 s = load_bf16x2(&s_t[r][cp]), ds = load_bf16x2(&ds_t[r][cp]);
    dd.x += s.x * ds.x, dd.y += s.y * ds.y;
  }
  *reinterpret_cast<float2*>(d_decay) = dd;
}

// The column sums of a 16 x 16 tile's two n8 halves held as colsum[n][x] (column 8 n + 2 t + x, this
// lane's rows), over the tile's 16 rows (the lanes of the same t), stored by lanes g = 0 at
// out[8 n + 2 t + x].
__device__ __forceinline__ void store_tile_column_sums(const float (&colsum)[2][2], float* out, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      float s = colsum[n][x];
      s += __shfl_xor_sync(0xffffffffu, s, 4);
      s += __shfl_xor_sync(0xffffffffu, s, 8);
      s += __shfl_xor_sync(0xffffffffu, s, 16);
      if (g == 0) out[8 * n + 2 * t + x] = s;
    }
  }
}

// The row sums of a 16 x 16 tile held as rows[r] (row g + 8 r, this lane's columns), over the tile's
// 16 columns (the four lanes t of the same g), stored by lanes t = 0 through store(r, sum).
template <typename F>
__device__ __forceinline__ void store_tile_row_sums(const float (&rows)[2], int lane, F&& store) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float x = rows[r];
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    if ((lane & 3) == 0) store(r, x);
  }
}

// An off-diagonal block's column operand Kc_ab = Kc_bb (.) e^{B_a - B_b} from Kc_bb's B fragments and
// the per-channel factor (bf16, <= 1): a bf16 product in registers, the values dGamma's terms then
// take (__hmul of the same two). Fragments from b_rows (channels k0 + 2t, +1 and k0 + 8 + 2t, +1)
// or from b_trans (channel n0 + g in b0, b1 and n0 + 8 + g in b2, b3).
__device__ __forceinline__ void scale_b_rows(uint32_t (&b)[4], const bf16* factor, int k0, int lane) {
  const int t = lane & 3;
  const __nv_bfloat162 f0 = *reinterpret_cast<const __nv_bfloat162*>(&factor[k0 + 2 * t]);
  const __nv_bfloat162 f1 = *reinterpret_cast<const __nv_bfloat162*>(&factor[k0 + 8 + 2 * t]);
  b[0] = mul_bf16x2(b[0], f0), b[1] = mul_bf16x2(b[1], f1);
  b[2] = mul_bf16x2(b[2], f0), b[3] = mul_bf16x2(b[3], f1);
}
__device__ __forceinline__ void scale_b_trans(uint32_t (&b)[4], const bf16* factor, int n0, int lane) {
  const int g = lane >> 2;
  const bf16 c0 = factor[n0 + g], c1 = factor[n0 + 8 + g];
  const __nv_bfloat162 f0 = __halves2bfloat162(c0, c0), f1 = __halves2bfloat162(c1, c1);
  b[0] = mul_bf16x2(b[0], f0), b[1] = mul_bf16x2(b[1], f0);
  b[2] = mul_bf16x2(b[2], f1), b[3] = mul_bf16x2(b[3], f1);
}

// Persistent, as kda_chunk_gradient_kernel, but by pairs of blocks: CTA b takes a head's blocks 2j
// and 2j + 1 for the pairs b, b + gridDim.x, ... (slots: block + padded blocks (h + H seq)). Inputs
// bf16; S^T entering chunk 2 blk and dS'^T leaving chunk min(2 blk + 1, chunks - 1) from passes 1
// and 2's [N, H, ceil(chunks / i), V, K] (i = 1, 2 or, for S^T with V' kept, 4: ChunkGradientArgs'
// intervals; at 4 a pair's second block's S^T is made by its first, in phase 6).
// How an item's 112 KB of inputs reach shared memory:
//   kTop       cp.async by every thread at the top of the item (nothing overlaps them);
//   kProducer  cp.async by a 17th warp as the previous item frees each array (named barriers);
//   kTma       the tensor-memory accelerator: one thread issues the next item's copies (one box an
//              array: S^T, dS'^T, v, dO, g, q, k) as the previous item frees each array, and the
//              threads wait on an mbarrier a part; no warp issues or waits for copies otherwise, and
//              16 warps keep their 128 registers. The boxes are one column group wider than the
//              arrays (K + 8, V + 8; K + 4 for g), so the copies' zero fill writes the padded rows
//              that keep ldmatrix free of bank conflicts, and rows past a sequence's end are zero.
enum class BlockLoads { kTop, kProducer, kTma };

// Named barriers (0 is __syncthreads): 1 the dL tiles' warps; with kProducer, 2 the 16 compute warps,
// 3-5 and 7 an item's arrays free for the next item's loads, 6 those loads landed. Without dV' given:
// q and k after phase 5; S^T, dS'^T, v and dO after 6; Gamma after 7. With it (thirtieth session):
// g after phase 0 (Gamma lies apart), dS'^T after 2, q, k, v and dO after 3, S^T, V' and dVb after 4.
// (Issuing S^T and v after phase 5, where they are last read, was slower: 7.97 against 7.65-7.81 ms.
// The nineteenth session's two changes, with V' and dV' given, pass 3: q and k after phase 5 -
// dGamma no longer in their space but in K^ and K_'s, dead after phase 6 - rather than after 8,
// 6.75-6.76 against 6.89-6.90 ms on an H100, 6.86-6.90 against 7.14-7.17 on an H200; and dK_ made in
// phases 2-3 with dS'^T loaded after phase 3, 6.63-6.65 ms on that H200.)
constexpr int kBlockComputeBarrier = 2, kValuesFree = 3, kGatesFree = 4, kKeysFree = 5, kLoaded = 6,
              kDStatesFree = 7;
template <BlockLoads kLoads>
constexpr int block_gradient_threads() { return kGradientThreads + (kLoads == BlockLoads::kProducer ? 32 : 0); }

// BlockLoads::kTma's tensor maps (kernel parameters, __grid_constant__): S^T and dS'^T as
// {K, V, N H stored} with boxes {K + 8, V, 1}; v, dO, q, k as {width, H, L, N} with boxes
// {width + 8, 1, 32, 1}; g (fp32) as {K, H, L, N} with boxes {K + 4, 1, 32, 1}.
struct BlockTensorMaps {
  CUtensorMap s, ds, v, d_o, q, k, g;
};

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(shared_address(bar)),
      "r"(parity)
      : "memory");
}
// One box of `map` at coordinates c (innermost first) into dst, completing on bar.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap& map, uint64_t* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];\n" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(shared_address(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap& map, uint64_t* bar, int c0, int c1, int c2,
                                         int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, "
      "%6}], [%2];\n" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(shared_address(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// kGivenV: V' comes from pass 1 (ChunkGradientArgs::new_values) instead of being recomputed here:
// no W, U nor W S (one of the five products with the state). kGivenDV (with kGivenV): dV' too,
// from pass 2 (d_new_values) as dVb = M^T dV': no Aqk, K_ dS' nor Aqk^T dO (a second product with
// the state), and no M. The reverse walk's dV' is the gradient of V' within a chunk of 16, not within
// the block of 32; but dVb, the gradient of the input Diag(beta) V, is the same in either chunking,
// so the walk's chunk of 16 gives the block's, and everything after needs only dVb and V' (the
// comment at phase 3). Until the twenty-ninth session this pass corrected the first sub-chunk's dV'
// to the block's (dV'_0 += Y^T dV'_1, Y = M_11 L_10) and ran the whole chain through M_10; in the
// twenty-ninth it made dVb = M_aa^T dV'_a from its own diagonal inverses.
template <int K, int V, BlockLoads kLoads = BlockLoads::kTop, bool kGivenV = false, bool kGivenDV = false>
__global__ void __launch_bounds__(block_gradient_threads<kLoads>(), 1)
    kda_block_gradient_kernel(const ChunkGradientArgs a, const __grid_constant__ BlockTensorMaps maps) {
  constexpr bool kProducer = kLoads == BlockLoads::kProducer, kTma = kLoads == BlockLoads::kTma;
  static_assert(!(kTma && kGivenV), "the TMA loads carry no V' and dV' (an experiment, not kept)");
  static_assert(kGivenV || !kGivenDV, "dV' is given with V'");
  constexpr int kThreads = block_gradient_threads<kLoads>();
  static_assert(K == 128 && V == 128, "one 16 x 16 tile a warp of every [32][128] result");
  using Shared = BlockShared<K, V>;
  constexpr int kRowK = Shared::kRowK, kRowV = Shared::kRowV, kRowC = Shared::kRowC, kSlices = Shared::kSlices;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  Shared& sh = *reinterpret_cast<Shared*>(shared_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = warp_index();
  const FragmentOffsets f(lane);
  const int g = lane >> 2, t = lane & 3;
  const int H = a.heads;
  const int64_t num_chunks = (a.length + kChunk - 1) / kChunk;
  const int64_t num_blocks = (a.length + kBlock - 1) / kBlock;
  const bf16* q = static_cast<const bf16*>(a.q);
  const bf16* k = static_cast<const bf16*>(a.k);
  const bf16* v = static_cast<const bf16*>(a.v);
  const bf16* d_o = static_cast<const bf16*>(a.d_o);
  const bf16* beta = static_cast<const bf16*>(a.beta);
  // This warp's tile of every [32][128] result.
  const int rt = warp / 8, m0 = 16 * rt, n0 = 16 * (warp % 8);

  // Items in pairs: a head's blocks 2j and 2j + 1 are its slots 2j and 2j + 1 (head_slots: its
  // blocks padded to an even count), and CTA b takes the pairs b, b + gridDim.x, ..., both blocks of
  // a pair in turn (a slot past the head's last block is skipped). With the states stored every 64
  // tokens (a.states_interval == 4, `chained`) the first block of a pair makes the state entering the
  // second in place of its own (phase 6), so that pass 1 stores half as many.
  using Item = GradientItem;
  const int64_t head_slots = num_blocks + (num_blocks & 1);
  const bool chained = a.states_interval == 4;
  auto item_at = [&](int64_t w) { return GradientItem::at(w, head_slots, kBlock, H, a.length); };
  const int64_t first_slot = 2 * static_cast<int64_t>(blockIdx.x), pair_stride = 2 * static_cast<int64_t>(gridDim.x);
  auto next_slot = [&](int64_t w) {
    int64_t n = (w & 1) ? w - 1 + pair_stride : w + 1;
    if (n % head_slots == num_blocks) n += pair_stride - 1;  // the pair has no second block
    return n;
  };
  // An item's loads by cp.async (rows past the sequence's end zero), in three parts (four with dV'
  // given: dS'^T alone). kProducer (what KdaBackwardOptions::pass3_blocks runs): a 17th warp issues
  // them, each part as soon as the previous item frees its arrays (the named barriers above),
  // waits for them and signals kLoaded; the compute warps meet on
  // a barrier of their own, so that none waits for an issuing warp stalled on the SM's outstanding
  // requests (phase 8 issuing them itself took 9.5K cycles instead of 1.3K). Measured (H100): the
  // wait at the top 6.3K -> 2.9K cycles a block, but phase 7 4.0K -> 6.7K with those loads landing
  // during it (and 96 registers a thread with 17 warps, against 128): the same time, 7.9-8.0 ms.
  // Otherwise every part is issued at the top by every thread.
  auto real_row = [&](const Item& it, int i) { return (it.row0 + (i < it.valid ? i : it.valid - 1)) * H + it.h; };
  // The stored state entering item `it` and state gradient leaving it: their [V][K] matrices' indices
  // in passes 1 and 2's [N, H, ceil(chunks / i), V, K].
  auto state_indices = [&](const Item& it, int64_t& s_at, int64_t& ds_at) {
    const int64_t pair = static_cast<int64_t>(it.seq) * H + it.h;
    const int si = a.states_interval, di = a.d_states_interval;
    s_at = pair * stored_chunks(num_chunks, si) + 2 * it.index / si;
    ds_at = pair * stored_chunks(num_chunks, di) + min64(2 * it.index + 1, num_chunks - 1) / di;
  };
  // With dV' given, dS'^T goes as a part of its own (kDStatesFree), when dK_ = V' dS'^T, its last
  // reader, is done.
  constexpr bool kDStatesApart = kProducer && kGivenDV;
  auto issue_d_states = [&](const Item& it, int me, int stride) {
    int64_t s_at, ds_at;
    state_indices(it, s_at, ds_at);
    const bf16* ds = a.chunk_d_states + ds_at * V * K;
    for (int e = me; e < V * K / 8; e += stride) {
      const int row = e / (K / 8), col = (e % (K / 8)) * 8;
      cp_async16(&sh.ds_t[row][col], ds + static_cast<int64_t>(e) * 8);
    }
    cp_async_commit();
  };
  auto issue_states_and_values = [&](const Item& it, int me, int stride) {
    int64_t s_at, ds_at;
    state_indices(it, s_at, ds_at);
    const bf16* s = a.chunk_states + s_at * V * K;
    const bf16* ds = a.chunk_d_states + ds_at * V * K;
    const bool s_made = chained && (it.index & 1);  // by the pair's first block, in place
    for (int e = me; e < V * K / 8; e += stride) {
      const int row = e / (K / 8), col = (e % (K / 8)) * 8;
      if (!s_made) cp_async16(&sh.s_t[row][col], s + static_cast<int64_t>(e) * 8);
      if constexpr (!kDStatesApart) cp_async16(&sh.ds_t[row][col], ds + static_cast<int64_t>(e) * 8);
    }
    for (int e = me; e < kBlock * V / 8; e += stride) {
      const int i = e / (V / 8), col = (e % (V / 8)) * 8;
      const int64_t at = real_row(it, i) * V + col;
      if constexpr (!kDStatesApart) {  // else with the keys
        cp_async16_or_zero(&sh.v[i][col], v + at, i < it.valid);
        cp_async16_or_zero(&sh.d_o[i][col], d_o + at, i < it.valid);
      }
      if constexpr (kGivenV) cp_async16_or_zero(&sh.v_new[i][col], a.new_values + at, i < it.valid);
      if constexpr (kGivenDV) cp_async16_or_zero(&sh.d_v_new[i][col], a.d_new_values + at, i < it.valid);
    }
    cp_async_commit();
  };
  auto issue_gates = [&](const Item& it, int me, int stride) {
    for (int e = me; e < kBlock * K / 4; e += stride) {
      const int i = e / (K / 4), col = (e % (K / 4)) * 4;
      cp_async16_or_zero(&sh.gamma[i][col], a.g + real_row(it, i) * K + col, i < it.valid);
    }
    cp_async_commit();
  };
  auto issue_keys = [&](const Item& it, int me, int stride) {
    for (int e = me; e < kBlock * K / 8; e += stride) {
      const int i = e / (K / 8), col = (e % (K / 8)) * 8;
      const int64_t at = real_row(it, i) * K + col;
      cp_async16_or_zero(&sh.in.q[i][col], q + at, i < it.valid);
      cp_async16_or_zero(&sh.in.k[i][col], k + at, i < it.valid);
    }
    if constexpr (kDStatesApart) {  // v and dO too: last read in phase 3 there, as q and k
      for (int e = me; e < kBlock * V / 8; e += stride) {
        const int i = e / (V / 8), col = (e % (V / 8)) * 8;
        const int64_t at = real_row(it, i) * V + col;
        cp_async16_or_zero(&sh.v[i][col], v + at, i < it.valid);
        cp_async16_or_zero(&sh.d_o[i][col], d_o + at, i < it.valid);
      }
    }
    cp_async_commit();
  };
  // kTma: the same three parts, a box an array, issued by thread 0 (after the barrier that frees
  // the arrays: the fence orders this thread's own earlier accesses before the copies' writes).
  constexpr uint32_t kStateBytes = V * kRowK * sizeof(bf16), kValueRowsBytes = kBlock * kRowV * sizeof(bf16),
                     kKeyRowsBytes = kBlock * kRowK * sizeof(bf16), kGateRowsBytes = kBlock * Shared::kPadK * sizeof(float);
  auto tma_states_and_values = [&](const Item& it) {
    int64_t s_at, ds_at;
    state_indices(it, s_at, ds_at);
    const int row = static_cast<int>(it.index * kBlock);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    mbarrier_expect_bytes(&sh.loaded[0], 2 * kStateBytes + 2 * kValueRowsBytes);
    tma_load(&sh.s_t[0][0], maps.s, &sh.loaded[0], 0, 0, static_cast<int>(s_at));
    tma_load(&sh.ds_t[0][0], maps.ds, &sh.loaded[0], 0, 0, static_cast<int>(ds_at));
    tma_load(&sh.v[0][0], maps.v, &sh.loaded[0], 0, it.h, row, it.seq);
    tma_load(&sh.d_o[0][0], maps.d_o, &sh.loaded[0], 0, it.h, row, it.seq);
  };
  auto tma_gates = [&](const Item& it) {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    mbarrier_expect_bytes(&sh.loaded[1], kGateRowsBytes);
    tma_load(&sh.gamma[0][0], maps.g, &sh.loaded[1], 0, it.h, static_cast<int>(it.index * kBlock), it.seq);
  };
  auto tma_keys = [&](const Item& it) {
    const int row = static_cast<int>(it.index * kBlock);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    mbarrier_expect_bytes(&sh.loaded[2], 2 * kKeyRowsBytes);
    tma_load(&sh.in.q[0][0], maps.q, &sh.loaded[2], 0, it.h, row, it.seq);
    tma_load(&sh.in.k[0][0], maps.k, &sh.loaded[2], 0, it.h, row, it.seq);
  };
  if constexpr (kTma) {
    if (tid == 0) {
      for (int i = 0; i < 3; ++i) mbarrier_init(&sh.loaded[i], 1);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
      const Item first = item_at(first_slot);
      tma_states_and_values(first);
      tma_gates(first);
      tma_keys(first);
    }
    __syncthreads();  // the mbarriers initialized before anyone waits on them
  }

#ifdef KDA_PHASE_PROFILE
  long long mark = clock64(), warp_mark = mark;
  int warp_phase = 0;
#endif
  auto named_sync = [](int id) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory"); };
  auto named_arrive = [](int id) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory"); };
  auto compute_barrier = [&] {
    BLOCK_WARP_ARRIVE();
    if constexpr (kProducer) {
      asm volatile("bar.sync %0, %1;\n" ::"n"(kBlockComputeBarrier), "n"(kGradientThreads) : "memory");
    } else {
      __syncthreads();
    }
    BLOCK_WARP_LEAVE();
  };
  if constexpr (kProducer) {
    if (warp == kGradientWarps) {
      for (int64_t w = first_slot; w < a.items; w = next_slot(w)) {
        const Item it = item_at(w);
        const bool first = w == first_slot;
        if constexpr (kDStatesApart) {  // freed in this order: g after phase 0, dS'^T after phase 2, q, k, v, dO after phase 3, the rest
          if (!first) named_sync(kGatesFree);
          issue_gates(it, lane, 32);
          if (!first) named_sync(kDStatesFree);
          issue_d_states(it, lane, 32);
        }
        if (!first) named_sync(kKeysFree);
        issue_keys(it, lane, 32);
        if (!first) named_sync(kValuesFree);
        issue_states_and_values(it, lane, 32);
        if constexpr (!kDStatesApart) {
          if (!first) named_sync(kGatesFree);
          issue_gates(it, lane, 32);
        }
        cp_async_wait<0>();
        named_arrive(kLoaded);
      }
      return;
    }
  }

  // beta of an item into sh.beta by one warp (lane i row i). Where dV' is given: the first item's
  // here, each next one's by warp 5 in the item before (issued in phase 5, stored in the last). Loaded
  // at the top of each item, its global load's latency held the top barrier (warp 0 ~1.4-2.2K
  // cycles a block more than the others; twenty-ninth session). The chain's form (dV' not given)
  // keeps the load at the top: moved, it ran 3-4% slower (more spills; H100).
  auto load_beta = [&](const Item& it, int i) {
    sh.beta[i] = i < it.valid ? __bfloat162float(beta[(it.row0 + i) * H + it.h]) : 0.0f;
  };
  if constexpr (kGivenDV) {
    if (tid < kBlock && first_slot < a.items) load_beta(item_at(first_slot), tid);
  }
  [[maybe_unused]] uint32_t count = 0;  // this CTA's items so far (kTma: the mbarriers' parity)
  for (int64_t w = first_slot; w < a.items; w = next_slot(w), ++count) {
    const Item cur = item_at(w);
    const int64_t next_w = next_slot(w);
    const bool more = next_w < a.items;
    const int valid = cur.valid;
    // Gamma's rows: over g's as loaded, or where dV' is given apart from them (the next item's g then
    // lands from phase 1 on).
    float(*const gamma_rows)[Shared::kPadK] = kGivenDV ? sh.given.gamma : sh.gamma;
    auto token = [&](int i) { return (cur.row0 + i) * H + cur.h; };  // [B, L, H] index of row i
    [[maybe_unused]] unsigned short next_beta = 0;  // warp 5, where dV' is given: the next item's beta

#ifdef KDA_PHASE_PROFILE
    warp_phase = 0;
#endif
    if constexpr (kProducer) {
      if (!kGivenDV && tid < kBlock) load_beta(cur, tid);
      BLOCK_WARP_ARRIVE();
      named_sync(kLoaded);
      BLOCK_WARP_LEAVE();
    } else if constexpr (kTma) {
      if (!kGivenDV && tid < kBlock) load_beta(cur, tid);
      const uint32_t parity = count & 1u;
      BLOCK_WARP_ARRIVE();
      for (int part = 0; part < 3; ++part) mbarrier_wait(&sh.loaded[part], parity);
      __syncthreads();
      BLOCK_WARP_LEAVE();
    } else {
      issue_states_and_values(cur, tid, kGradientThreads);
      issue_gates(cur, tid, kGradientThreads);
      issue_keys(cur, tid, kGradientThreads);
      if (!kGivenDV && tid < kBlock) load_beta(cur, tid);
      BLOCK_WARP_ARRIVE();
      cp_async_wait<0>();
      __syncthreads();
      BLOCK_WARP_LEAVE();
    }
    BLOCK_PHASE_MARK(0);

    // Phase 0: Gamma's partial sums (column pair cp, rows 4 rg .. 4 rg + 3), and d(e^gamma)'s
    // partial sums sum_v dS' (.) S over 16 V rows a thread.
    const int cp = 2 * (tid % (K / 2)), rg = tid / (K / 2);
    constexpr int kRows = kBlock / kSlices;  // 4
    float2 local[kRows];
    {
      float2 acc = make_float2(0.0f, 0.0f);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float2 x = *reinterpret_cast<const float2*>(&sh.gamma[rg * kRows + r][cp]);
        acc.x += x.x, acc.y += x.y;
        local[r] = acc;
      }
      *reinterpret_cast<float2*>(&sh.part[rg][cp]) = acc;
      constexpr int kVRows = V / kSlices;
      float2 dd = make_float2(0.0f, 0.0f);
#pragma unroll 4
      for (int r = rg * kVRows; r < (rg + 1) * kVRows; ++r) {
        const float2 s = load_bf16x2(&sh.s_t[r][cp]), ds = load_bf16x2(&sh.ds_t[r][cp]);
        dd.x += s.x * ds.x, dd.y += s.y * ds.y;
      }
      *reinterpret_cast<float2*>(&sh.d_decay[rg][cp]) = dd;
    }
    compute_barrier();
    BLOCK_PHASE_MARK(1);
    if constexpr (kProducer && kGivenDV) {
      if (more) named_arrive(kGatesFree);  // g's rows as loaded: last read in phase 0 (Gamma goes apart)
    }

    // Phase 1: Gamma, and the operands of every product, per element (the same thread's rows).
    {
      float2 offset = make_float2(0.0f, 0.0f), b1 = offset, last = offset;
#pragma unroll
      for (int r = 0; r < kSlices; ++r) {
        const float2 x = *reinterpret_cast<const float2*>(&sh.part[r][cp]);
        if (r < rg) offset.x += x.x, offset.y += x.y;
        if (r < kSlices / 2) b1.x += x.x, b1.y += x.y;
        last.x += x.x, last.y += x.y;
      }
      // Per column: e^{B_1} and e^{gamma - B_1}, so that a row needs two exponentials (e^{+-(Gamma -
      // B)}, its own anchor B) instead of four: e^Gamma = e^{Gamma - B_1} e^{B_1} past the first
      // sub-chunk (e^{Gamma - 0} in it), e^{gamma - Gamma} = e^{gamma - B_1} e^{B_1 - Gamma}, with
      // e^{B_1 - Gamma} = e^{B_1} e^{-Gamma} in the first sub-chunk. Every factor lies within
      // e^{+-16 |g_min|}, as the anchors' own (four ex2 a row and column before).
      const float2 e_b1 = make_float2(exp_ftz(b1.x), exp_ftz(b1.y));
      const float2 e_last_b1 = make_float2(exp_ftz(last.x - b1.x), exp_ftz(last.y - b1.y));
      if (rg == 0) {
        *reinterpret_cast<float2*>(&sh.anchor[cp]) = b1;
        *reinterpret_cast<float2*>(&sh.last[cp]) = last;
        store_bf16x2(&sh.c10[cp], e_b1.x, e_b1.y);
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int i = rg * kRows + r;
        const float2 gam = make_float2(local[r].x + offset.x, local[r].y + offset.y);
        *reinterpret_cast<float2*>(&gamma_rows[i][cp]) = gam;
        const bool first = i < kChunk;
        const float2 anchor = first ? make_float2(0.0f, 0.0f) : b1;
        const float2 qi = load_bf16x2(&sh.in.q[i][cp]), ki = load_bf16x2(&sh.in.k[i][cp]);
        float2 up, down;  // e^{Gamma - B}, e^{B - Gamma}
        exp_both(gam.x - anchor.x, up.x, down.x);
        exp_both(gam.y - anchor.y, up.y, down.y);
        store_bf16x2(&sh.x_q[i][cp], a.scale * qi.x * up.x, a.scale * qi.y * up.y);
        store_bf16x2(&sh.x_k[i][cp], ki.x * up.x, ki.y * up.y);
        store_bf16x2(&sh.k_c[i][cp], ki.x * down.x, ki.y * down.y);
        const float2 e_gam = first ? up : make_float2(up.x * e_b1.x, up.y * e_b1.y);
        const float2 e_b1_gam = first ? make_float2(e_b1.x * down.x, e_b1.y * down.y) : down;
        store_bf16x2(&sh.decayed.k_hat[i][cp], ki.x * e_gam.x, ki.y * e_gam.y);
        store_bf16x2(&sh.decayed.k_bar[i][cp], ki.x * (e_last_b1.x * e_b1_gam.x), ki.y * (e_last_b1.y * e_b1_gam.y));
      }
    }
    // Where dVb is given: this warp's tile of Y = dVb S^T, which needs nothing made here (phase 3
    // takes it from registers: dK^ = -Diag(beta) Y and dbeta's Y (.) K^).
    [[maybe_unused]] float y[2][4] = {};
    if constexpr (kGivenDV) tile_product<V, true>(y, &sh.d_v_new[0][0], kRowV, m0, &sh.s_t[0][0], kRowK, n0, f);
    compute_barrier();
    BLOCK_PHASE_MARK(2);

    float dq[2][4] = {}, dk[2][4] = {}, dgam[2][4] = {};
    // dAqk = dO V'^T on the lower 16 x 16 block `ab` ((0, 0), (1, 0), (1, 1)), in phase 6.
    auto d_aqk_block = [&](int ab) {
      const LowerBlock blk(ab);
      const int ra = blk.ra, cb = blk.cb;
      float acc[2][4] = {};
      tile_product<V, false>(acc, &sh.d_o[0][0], kRowV, 16 * ra, &sh.v_new[0][0], kRowV, 16 * cb, f);
      for_tile(16 * ra, 16 * cb, lane, [&](int n, int e, int i, int j) {
        sh.d_aqk[i][j] = __float2bfloat16_rn(ra != cb || j <= i ? acc[n][e] : 0.0f);
        if (ab == 0) sh.d_aqk[i][j + kChunk] = __float2bfloat16_rn(0.0f);
      });
    };
    // dK_ = V' dS'^T on this warp's tile: into dk, dGamma and dgamma's column sums (kbar_sum).
    auto d_k_bar = [&] {
      float acc[2][4] = {};
      tile_product<V, true>(acc, &sh.v_new[0][0], kRowV, m0, &sh.ds_t[0][0], kRowK, n0, f);
      float colsum[2][2] = {};
      for_tile(m0, n0, lane, [&](int n, int e, int i, int c) {
        const float kb = __bfloat162float(sh.decayed.k_bar[i][c]), x = acc[n][e] * kb;
        dk[n][e] += acc[n][e] * exp_ftz(sh.last[c] - gamma_rows[i][c]);
        dgam[n][e] -= x;
        colsum[n][e & 1] += x;
      });
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          float s = colsum[n][x];
          s += __shfl_xor_sync(0xffffffffu, s, 4);
          s += __shfl_xor_sync(0xffffffffu, s, 8);
          s += __shfl_xor_sync(0xffffffffu, s, 16);
          if (g == 0) sh.kbar_sum[rt][n0 + 8 * n + 2 * t + x] = s;
        }
      }
    };
    // Phase 2: dQ^ = dO S^T (into dq and dGamma) on every warp's tile, or where dV' is given dK_ =
    // V' dS'^T instead (warps 10-12's in phase 3, with every warp's dQ^); the intra blocks of P and
    // Aqk (warps 10-15; no Aqk where dV' is given),
    // and the diagonal blocks' inverses M_00, M_11 by the warps that made P_00 and P_11 (10 and 12;
    // a column a lane, from L^T of their own block).
    auto d_q_hat = [&] {
      float acc[2][4] = {};
      tile_product<V, true>(acc, &sh.d_o[0][0], kRowV, m0, &sh.s_t[0][0], kRowK, n0, f);
      for_tile(m0, n0, lane, [&](int n, int e, int i, int c) {
        const float term = a.scale * exp_ftz(gamma_rows[i][c]) * acc[n][e];  // dQ^ (.) scale e^Gamma
        dq[n][e] += term;
        dgam[n][e] += term * __bfloat162float(sh.in.q[i][c]);              // dQ^ (.) Q^
      });
    };
    // With dV' given, phase 2 holds every warp's dK_ (dS'^T's last reader), dAqk (warps 13-15) and
    // P (10-12), and every warp makes its dQ^ in phase 3. History: the eighteenth session moved warps
    // 10-12's dQ^ there (pass 3 6.86-6.87 against 6.91-7.04 ms, H100); the nineteenth added dK_ to
    // phase 2 and then moved the other warps' dQ^ too: pass 3 6.56-6.60 against 6.81-6.88 ms (H100),
    // dGamma's terms in another order (dg within 7.6e-8 of its largest; dq, dk, dv, dbeta the same
    // bits), and no spills; the thirtieth, with no M to make here, gave warps 10-12 their dK_ in
    // phase 2 as well.
    if constexpr (!kGivenDV) d_q_hat();
    if constexpr (kGivenDV) {
      d_k_bar();
      if (warp >= 13) d_aqk_block(warp - 13);
    }
    if (warp >= 10 && !(kGivenDV && warp >= 13)) {
      // Tasks 0-2: P_00, P_10, P_11; 3-5: Aqk_00, Aqk_10, Aqk_11.
      const int task = warp - 10, ab = task % 3;
      const LowerBlock blk(ab);
      const int ra = blk.ra, cb = blk.cb;
      const bool is_p = task < 3;
      const bf16* x = is_p ? &sh.x_k[0][0] : &sh.x_q[0][0];
      float acc[2][4] = {};
#pragma unroll
      for (int k0 = 0; k0 < K; k0 += 16) {
        uint32_t af[4], bf[4];
        a_rows(af, x, kRowK, 16 * ra, k0, f);
        b_rows(bf, &sh.k_c[0][0], kRowK, 16 * cb, k0, f);
        if (ra != cb) {  // Kc_10 = Kc_0 (.) e^{B_1}: channels k0 + 2t (+1) and k0 + 8 + 2t (+1)
          const __nv_bfloat162 f0 = *reinterpret_cast<const __nv_bfloat162*>(&sh.c10[k0 + 2 * t]);
          const __nv_bfloat162 f1 = *reinterpret_cast<const __nv_bfloat162*>(&sh.c10[k0 + 8 + 2 * t]);
          bf[0] = mul_bf16x2(bf[0], f0), bf[1] = mul_bf16x2(bf[1], f1);
          bf[2] = mul_bf16x2(bf[2], f0), bf[3] = mul_bf16x2(bf[3], f1);
        }
        mma2(acc, af, bf);
      }
      for_tile(16 * ra, 16 * cb, lane, [&](int n, int e, int i, int j) {
        const bool below = ra != cb || j < i;
        if (is_p) {
          sh.p[i][j] = below ? acc[n][e] : 0.0f;
          if (!kGivenDV && ra == cb) sh.l_t[ra][j - 16 * cb][i - 16 * ra] = below ? sh.beta[i] * acc[n][e] : 0.0f;
          if (ab == 0) sh.p[i][j + kChunk] = 0.0f;  // the block above the diagonal
        } else {
          sh.chain.a_qk[i][j] = __float2bfloat16_rn(below || i == j ? acc[n][e] : 0.0f);
          if (ab == 0) sh.chain.a_qk[i][j + kChunk] = __float2bfloat16_rn(0.0f);
        }
      });
      if (!kGivenDV && is_p && ra == cb) {  // dVb given: no M here
        __syncwarp();
        if (lane < kChunk) {
          const int c = lane, o = kChunk * ra;
          float col[kChunk];
          unit_lower_inverse_column_t(sh.l_t[ra], c, col);
#pragma unroll
          for (int i = 0; i < kChunk; ++i) {
            sh.m_b[o + i][o + c] = __float2bfloat16_rn(col[i]);
            if constexpr (!kGivenDV) {  // dV' given: only M_00 and M_11 are read (phase 3's dVb)
              sh.chain.m[o + i][o + c] = col[i];
              sh.chain.mb_b[o + i][o + c] = __float2bfloat16_rn(col[i] * sh.beta[o + c]);
              if (ra == 0) {  // the block above the diagonal
                sh.chain.m[i][kChunk + c] = 0.0f;
                sh.m_b[i][kChunk + c] = __float2bfloat16_rn(0.0f);
                sh.chain.mb_b[i][kChunk + c] = __float2bfloat16_rn(0.0f);
              }
            }
          }
        }
      }
    }
    compute_barrier();
    BLOCK_PHASE_MARK(3);
    if constexpr (kProducer && kGivenDV) {
      if (more) named_arrive(kDStatesFree);  // dS'^T: last read by dK_ (phase 2, every warp's)
    }

    // With states stored every 64 tokens: the state entering the pair's second block, in place of
    // this block's S^T (last read in phase 4 where V' is given; the producer warp then loads no S^T
    // for that block):
    //   S_32 = Diag(e^{Gamma_31}) S_0 + K_^T V',  i.e.  S^T <- S^T Diag(e^gamma) + V'^T K_,
    // V' the walk's per-token values (the same whatever the chunking: the delta rule's innovations)
    // and K_ = k e^{gamma - Gamma} the bf16 operand the products here use, accumulated in fp32 and
    // rounded to bf16 once, as pass 1 rounds the states it stores. The 64 16 x 16 tiles of S^T on
    // warps 0-11 in phase 6, where warps 12-15 run the dL chain. (26 of them on warps 0-12 in phase
    // 5, beside warps 13-15's H, and the rest in phase 6: the same bits, no faster, 6.65-6.66 ms
    // against 6.60 for pass 3 on an H100.) Where dV' is given: on warps 0-9 in phase 4 (S^T last
    // read in phase 3; K_ lives on, dGamma lying elsewhere).
    const bool make_next_state = chained && (cur.index & 1) == 0 && cur.index + 1 < num_blocks;
    auto next_state = [&](auto warps) {  // std::integral_constant: the warps that share the tiles
      for (int tile = warp; tile < (V / 16) * (K / 16); tile += warps()) {
        const int v0 = 16 * (tile / (K / 16)), c0 = 16 * (tile % (K / 16));
        float acc[2][4] = {};
#pragma unroll
        for (int t0 = 0; t0 < kBlock; t0 += 16) {
          uint32_t af[4], bf[4];
          a_trans(af, &sh.v_new[0][0], kRowV, v0, t0, f);          // (V'^T)[v][t]
          b_trans(bf, &sh.decayed.k_bar[0][0], kRowK, c0, t0, f);  // K_[t][c]
          mma2(acc, af, bf);
        }
        for_tile(v0, c0, lane, [&](int n, int e, int i, int c) {
          if ((e & 1) == 0) {
            const float2 s = load_bf16x2(&sh.s_t[i][c]);
            store_bf16x2(&sh.s_t[i][c], exp_ftz(sh.last[c]) * s.x + acc[n][e],
                         exp_ftz(sh.last[c + 1]) * s.y + acc[n][e + 1]);
          }
        });
      }
    };

    // A lower 16 x 16 tile of dL (rows 16 ra, columns 16 cb) from acc = -dL: dP = Diag(beta) dL (bf16;
    // tile (0, 0) also zeroes the block above the diagonal), dbeta's sum_j dL_ij P_ij into dbeta_l[cb].
    auto store_d_l = [&](int ra, int cb, const float (&acc)[2][4]) {
      float row_sum[2] = {};  // rows 16 ra + g, + 8
      for_tile(16 * ra, 16 * cb, lane, [&](int n, int e, int i, int j) {
        const float dl = i > j ? -acc[n][e] : 0.0f;
        sh.d_p[i][j] = __float2bfloat16_rn(sh.beta[i] * dl);
        if (ra == 0 && cb == 0) sh.d_p[i][j + kChunk] = __float2bfloat16_rn(0.0f);
        row_sum[e >> 1] += dl * sh.p[i][j];
      });
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float sum = row_sum[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        if (t == 0) sh.dbeta_l[cb][16 * ra + g + 8 * r] = sum;
      }
    };

    // The intra blocks' gradients (phase 7; phase 5 where dV' is given). Rows (this tile's sub-chunk a = rt): dX_a = sum_{b <= a}
    // dA_ab Kc_ab for Aqk (into dq) and P (into dk); columns (b = rt): dKc_ab = dAqk_ab^T Xq_a +
    // dP_ab^T Xk_a for a >= b (into dk). dGamma's factors are the bf16 operands the products saw.
    // dGamma goes to d_gamma, for the last phase's reverse sum.
    auto intra_blocks = [&](float (*d_gamma)[Shared::kPadK]) {
      float dxq[2][4] = {}, dxk[2][4] = {};
      for (int b = 0; b <= rt; ++b) {
        uint32_t aq[4], ap[4], bf[4];
        a_rows(aq, &sh.d_aqk[0][0], kRowC, m0, 16 * b, f);
        a_rows(ap, &sh.d_p[0][0], kRowC, m0, 16 * b, f);
        b_trans(bf, &sh.k_c[0][0], kRowK, n0, 16 * b, f);
        if (b != rt) {  // Kc_10 = Kc_0 (.) e^{B_1}: channel n0 + g (b0, b1), n0 + 8 + g (b2, b3)
          const bf16 c0 = sh.c10[n0 + g], c1 = sh.c10[n0 + 8 + g];
          const __nv_bfloat162 f0 = __halves2bfloat162(c0, c0), f1 = __halves2bfloat162(c1, c1);
          bf[0] = mul_bf16x2(bf[0], f0), bf[1] = mul_bf16x2(bf[1], f0);
          bf[2] = mul_bf16x2(bf[2], f1), bf[3] = mul_bf16x2(bf[3], f1);
        }
        mma2(dxq, aq, bf);
        mma2(dxk, ap, bf);
      }
      // dKc_ab for a = b = rt (dkc) and, in row tile 0, for the (1, 0) block (dkc10).
      float dkc[2][4] = {}, dkc10[2][4] = {};
      auto column_block = [&](int ra, float (&acc)[2][4]) {
        uint32_t aq[4], ap[4], bq[4], bk[4];
        a_trans(aq, &sh.d_aqk[0][0], kRowC, m0, 16 * ra, f);
        a_trans(ap, &sh.d_p[0][0], kRowC, m0, 16 * ra, f);
        b_trans(bq, &sh.x_q[0][0], kRowK, n0, 16 * ra, f);
        b_trans(bk, &sh.x_k[0][0], kRowK, n0, 16 * ra, f);
        mma2(acc, aq, bq);
        mma2(acc, ap, bk);
      };
      column_block(rt, dkc);
      if (rt == 0) column_block(1, dkc10);
      for_tile(m0, n0, lane, [&](int n, int e, int i, int c) {
        const float gam = gamma_rows[i][c], b_own = rt == 0 ? 0.0f : sh.anchor[c];
        float up, down;
        exp_both(gam - b_own, up, down);  // e^{Gamma - B_rt}, e^{B_rt - Gamma}
        dq[n][e] += a.scale * up * dxq[n][e];
        dgam[n][e] += dxq[n][e] * __bfloat162float(sh.x_q[i][c]);
        dk[n][e] += up * dxk[n][e];
        dgam[n][e] += dxk[n][e] * __bfloat162float(sh.x_k[i][c]);
        const bf16 kc = sh.k_c[i][c];
        dk[n][e] += down * dkc[n][e];
        dgam[n][e] -= dkc[n][e] * __bfloat162float(kc);
        if (rt == 0) {  // the (1, 0) block: Kc_10 = bf16(Kc_0 e^{B_1}), its factor e^{B_1 - Gamma}
          const float kc10 = __bfloat162float(__hmul(kc, sh.c10[c]));
          dk[n][e] += exp_ftz(sh.anchor[c] - gam) * dkc10[n][e];
          dgam[n][e] -= dkc10[n][e] * kc10;
        }
      });
      // dq and dk are final: stored; dGamma to shared memory for the reverse sum.
      for_tile(m0, n0, lane, [&](int n, int e, int i, int c) {
        if ((e & 1) != 0) return;
        if (i < valid) {
          store_pair(static_cast<bf16*>(a.dq) + token(i) * K + c, dq[n][e], dq[n][e + 1]);
          store_pair(static_cast<bf16*>(a.dk) + token(i) * K + c, dk[n][e], dk[n][e + 1]);
        }
        *reinterpret_cast<float2*>(&d_gamma[i][c]) = make_float2(dgam[n][e], dgam[n][e + 1]);
      });
    };

    if constexpr (kGivenDV) {
      // dVb given (the default; d_new_values, kept by the reverse walk in place of dV'): the chain
      // through M collapses (model::kda::BackwardForm::kKeptInnovationGradients; kda_backward.cu's
      // derivation). dVb = M^T dU is the gradient of the input Vb = Diag(beta) V, the same whatever
      // the chunking, so the walk's chunk of 16 gives the block's; then, since M Vb - M Kb S = U -
      // W S = V',
      //   dKb = M^T dW = -dVb S^T =: -Y,   dL = -M^T dM M^T = -dVb V'^T (strictly lower),
      //   dK^ += Diag(beta) dKb,   dbeta_i = dVb_i . V_i - Y_i . K^_i + sum_j dL_ij P_ij,
      // and no M, W, dW, G, H nor dM here. Phase 1 makes each warp's tile of Y; phase 2 holds every
      // warp's dK_, with dAqk (13-15) and P (10-12); phase 4 dL (13-15) beside the pair's next state.
      //
      // dbeta's terms of rows m0 + g (+ 8) over this tile's 16 columns, which lie in the four lanes t
      // of their g: into dbeta_parts[row][this tile's column tile].
      auto store_row_parts = [&](const float (&part)[2]) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float x = part[r];
          x += __shfl_xor_sync(0xffffffffu, x, 1);
          x += __shfl_xor_sync(0xffffffffu, x, 2);
          if (t == 0) sh.given.dbeta_parts[m0 + g + 8 * r][warp % 8] = x;
        }
      };
      // Phase 3: on this warp's tile, with Y = dVb S^T from phase 1: dK^ = -Diag(beta) Y (into dk,
      // dGamma); dv = Diag(beta) dVb (to global); dbeta's dVb (.) V - Y (.) K^; dQ^.
      {
        float rowpart[2] = {};
        float q_acc[2][4] = {};  // dQ^ = dO S^T, its epilogue sharing e^Gamma with dK^'s
        tile_product<V, true>(q_acc, &sh.d_o[0][0], kRowV, m0, &sh.s_t[0][0], kRowK, n0, f);
        for_tile(m0, n0, lane, [&](int n, int e, int i, int c) {
          const float dvb = __bfloat162float(sh.d_v_new[i][c]);
          rowpart[e >> 1] += dvb * __bfloat162float(sh.v[i][c]);
          if ((e & 1) == 0 && i < valid) {
            store_pair(static_cast<bf16*>(a.dv) + token(i) * V + c, sh.beta[i] * dvb,
                       sh.beta[i] * __bfloat162float(sh.d_v_new[i][c + 1]));
          }
          const float kh = __bfloat162float(sh.decayed.k_hat[i][c]), dkh = -sh.beta[i] * y[n][e];
          const float decay = exp_ftz(gamma_rows[i][c]);  // e^Gamma
          dk[n][e] += dkh * decay;
          dgam[n][e] += dkh * kh;
          rowpart[e >> 1] -= y[n][e] * kh;
          const float term = a.scale * decay * q_acc[n][e];  // dQ^ (.) scale e^Gamma
          dq[n][e] += term;
          dgam[n][e] += term * __bfloat162float(sh.in.q[i][c]);  // dQ^ (.) Q^
        });
        store_row_parts(rowpart);
      }
      compute_barrier();
      BLOCK_PHASE_MARK(4);
      if constexpr (kProducer) {
        if (more) named_arrive(kKeysFree);  // q, k, v and dO: last read in phase 3 (dQ^, dbeta's dVb (.) V)
      }

      // Phase 4: dL = -dVb V'^T on the lower 16 x 16 blocks (warps 13-15), dP = Diag(beta) dL and
      // dbeta's sum_j dL_ij P_ij; the pair's next state in place of S^T (warps 0-12).
      if (warp >= 13) {
        const int ab = warp - 13;
        const LowerBlock blk(ab);
        const int ra = blk.ra, cb = blk.cb;
        float acc[2][4] = {};
        tile_product<V, false>(acc, &sh.d_v_new[0][0], kRowV, 16 * ra, &sh.v_new[0][0], kRowV, 16 * cb, f);
        store_d_l(ra, cb, acc);
      } else if (make_next_state) {
        next_state(std::integral_constant<int, 13>{});
      }
      compute_barrier();
      BLOCK_PHASE_MARK(5);
      if constexpr (kProducer) {
        if (more) named_arrive(kValuesFree);  // S^T, V' and dVb: last read in phase 4
      }

      // Phase 5: the intra blocks' gradients. Warp 5 first issues the next item's beta (as raw bf16
      // bits, stored to sh.beta in the last phase), so that its global load's latency passes under
      // the intra blocks: issued in the last phase, it held that phase's barrier (~2.8K cycles a
      // block against ~1.3K for the other warps' work there; thirtieth session's profile).
      if (tid >= K + kBlock && tid < K + 2 * kBlock && more) {
        const Item next = item_at(next_w);
        const int i = tid - K - kBlock;
        next_beta = i < next.valid ? reinterpret_cast<const unsigned short*>(beta)[(next.row0 + i) * H + next.h] : 0;
      }
      intra_blocks(sh.d_gamma);
      compute_barrier();
      BLOCK_PHASE_MARK(8);
    } else {
    // Phase 3: M_10 = -(M_11 L_10) M_00 (warp 0); dV' = K_ dS' + Aqk^T dO on every warp's tile,
    // stored bf16.
    if (warp == 0) {
      // Y = M_11 L_10 (L_10[j][c] = beta_{16+j} P[16+j][c] as B from registers).
      float y[2][4] = {};
      {
        uint32_t af[4], bf[4];
        a_rows(af, &sh.m_b[0][0], kRowC, kChunk, kChunk, f);
        auto l10 = [&](int j, int col) { return sh.beta[kChunk + j] * sh.p[kChunk + j][col]; };
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          bf[2 * n] = pack_bf16(l10(2 * t, 8 * n + g), l10(2 * t + 1, 8 * n + g));
          bf[2 * n + 1] = pack_bf16(l10(2 * t + 8, 8 * n + g), l10(2 * t + 9, 8 * n + g));
        }
        mma2(y, af, bf);
      }
      // Y as an A fragment: blocks (0, 0), (1, 0), (0, 1), (1, 1) of 8 x 8.
      const uint32_t ya[4] = {pack_bf16(y[0][0], y[0][1]), pack_bf16(y[0][2], y[0][3]),
                              pack_bf16(y[1][0], y[1][1]), pack_bf16(y[1][2], y[1][3])};
      // M_10 = -Y M_00
      float m10[2][4] = {};
      uint32_t bf[4];
      b_trans(bf, &sh.m_b[0][0], kRowC, 0, 0, f);
      mma2(m10, ya, bf);
      for_tile(kChunk, 0, lane, [&](int n, int e, int i, int c) {
        const float x = -m10[n][e];
        sh.chain.m[i][c] = x;
        sh.m_b[i][c] = __float2bfloat16_rn(x);
        sh.chain.mb_b[i][c] = __float2bfloat16_rn(x * sh.beta[c]);
      });
    }
    {
      float dvn[2][4] = {};
      tile_product<K, false>(dvn, &sh.decayed.k_bar[0][0], kRowK, m0, &sh.ds_t[0][0], kRowK, n0, f);
      // (Aqk^T)[i][t] = Aqk[t][i], nonzero for t >= i: k-steps from this tile's rows on.
      for (int k0 = m0; k0 < kBlock; k0 += 16) {
        uint32_t af[4], bf[4];
        a_trans(af, &sh.chain.a_qk[0][0], kRowC, m0, k0, f);
        b_trans(bf, &sh.d_o[0][0], kRowV, n0, k0, f);
        mma2(dvn, af, bf);
      }
      for_tile(m0, n0, lane, [&](int n, int e, int i, int c) {
        if ((e & 1) == 0) store_bf16x2(&sh.d_v_new[i][c], dvn[n][e], dvn[n][e + 1]);
      });
    }
    compute_barrier();
    BLOCK_PHASE_MARK(4);

    // Phase 4: W = M Diag(beta) K^ (stored), U = M Diag(beta) V (kept), unless V' is given;
    // dW = -dV' S^T (stored); G = dV' V^T (warps 13-15, the lower blocks).
    float u[2][4] = {};
    {
      if constexpr (!kGivenV) {
        float wt[2][4] = {};
        for (int k0 = 0; k0 <= m0; k0 += 16) {  // M is lower: columns up to this tile's rows
          uint32_t af[4], bf[4], bv[4];
          a_rows(af, &sh.chain.mb_b[0][0], kRowC, m0, k0, f);
          b_trans(bf, &sh.decayed.k_hat[0][0], kRowK, n0, k0, f);
          b_trans(bv, &sh.v[0][0], kRowV, n0, k0, f);
          mma2(wt, af, bf);
          mma2(u, af, bv);
        }
        for_tile(m0, n0, lane, [&](int n, int e, int i, int c) {
          if ((e & 1) == 0) store_bf16x2(&sh.mid.w[i][c], wt[n][e], wt[n][e + 1]);
        });
      }
      float dw[2][4] = {};
      tile_product<V, true>(dw, &sh.d_v_new[0][0], kRowV, m0, &sh.s_t[0][0], kRowK, n0, f);
      for_tile(m0, n0, lane, [&](int n, int e, int i, int c) {
        if ((e & 1) == 0) store_bf16x2(&sh.mid.d_w[i][c], -dw[n][e], -dw[n][e + 1]);
      });
    }
    if (warp >= 13) {
      const int ab = warp - 13;
      const LowerBlock blk(ab);
      const int ra = blk.ra, cb = blk.cb;
      float acc[2][4] = {};
      tile_product<V, false>(acc, &sh.d_v_new[0][0], kRowV, 16 * ra, &sh.v[0][0], kRowV, 16 * cb, f);
      for_tile(16 * ra, 16 * cb, lane, [&](int n, int e, int i, int j) {
        sh.chain.gh[i][j] = ra != cb || j <= i ? acc[n][e] : 0.0f;
        if (ab == 0) sh.chain.gh[i][j + kChunk] = 0.0f;
      });
    }
    compute_barrier();
    BLOCK_PHASE_MARK(5);

    // Phase 5: V' = U - W S (stored, unless given); dK^ = Diag(beta) M^T dW (into dk, dGamma); dv =
    // Diag(beta) M^T dV' (stored to global); H = dW K^^T added to G (warps 13-15, the same entries).
    {
      if constexpr (!kGivenV) {
        float ws[2][4] = {};
        tile_product<K, false>(ws, &sh.mid.w[0][0], kRowK, m0, &sh.s_t[0][0], kRowK, n0, f);
        for_tile(m0, n0, lane, [&](int n, int e, int i, int c) {
          if ((e & 1) == 0) store_bf16x2(&sh.v_new[i][c], u[n][e] - ws[n][e], u[n][e + 1] - ws[n][e + 1]);
        });
      }
      float dkb[2][4] = {}, dvb[2][4] = {};
      for (int k0 = m0; k0 < kBlock; k0 += 16) {  // (M^T)[i][t] = M[t][i], nonzero for t >= i
        uint32_t af[4], bf[4], bv[4];
        a_trans(af, &sh.m_b[0][0], kRowC, m0, k0, f);
        b_trans(bf, &sh.mid.d_w[0][0], kRowK, n0, k0, f);
        b_trans(bv, &sh.d_v_new[0][0], kRowV, n0, k0, f);
        mma2(dkb, af, bf);
        mma2(dvb, af, bv);
      }
      for_tile(m0, n0, lane, [&](int n, int e, int i, int c) {
        const float dkh = sh.beta[i] * dkb[n][e];  // dK^
        dk[n][e] += dkh * exp_ftz(gamma_rows[i][c]);
        dgam[n][e] += dkh * __bfloat162float(sh.decayed.k_hat[i][c]);
        if ((e & 1) == 0 && i < valid) {
          store_pair(static_cast<bf16*>(a.dv) + token(i) * V + c, sh.beta[i] * dvb[n][e], sh.beta[i] * dvb[n][e + 1]);
        }
      });
    }
    if (warp >= 13) {
      const int ab = warp - 13;
      const LowerBlock blk(ab);
      const int ra = blk.ra, cb = blk.cb;
      float acc[2][4] = {};
      tile_product<K, false>(acc, &sh.mid.d_w[0][0], kRowK, 16 * ra, &sh.decayed.k_hat[0][0], kRowK, 16 * cb, f);
      for_tile(16 * ra, 16 * cb, lane, [&](int n, int e, int i, int j) {
        if (ra != cb || j <= i) sh.chain.gh[i][j] += acc[n][e];
        // dM[t][s] = beta_s (G + H)[t][s], below the diagonal (the only entries dL depends on)
        sh.chain.d_m[i][j] = __float2bfloat16_rn(i > j ? sh.beta[j] * sh.chain.gh[i][j] : 0.0f);
        if (ab == 0) sh.chain.d_m[i][j + kChunk] = __float2bfloat16_rn(0.0f);
      });
    }
    compute_barrier();
    BLOCK_PHASE_MARK(6);
    if constexpr (kProducer) {
      if (more) named_arrive(kKeysFree);  // q and k's space (Middle's): last read in phase 5
    } else if constexpr (kTma) {
      if (more && tid == 0) tma_keys(item_at(next_w));
    }

    // Phase 6: dK_ = V' dS'^T (into dk, dGamma and dgamma's column sums) unless dV' is given (then
    // in phases 2-3); dAqk = dO V'^T (warps 9-11); dL = -M^T (dM M^T), strictly lower, with
    // dM = (G + H) Diag(beta) below the diagonal
    // (T1 = dM M^T on warps 12-15, dL's tiles on 12-14), then dP = Diag(beta) dL and dbeta's
    // sum_j dL_ij P_ij.
    d_k_bar();
    if (warp >= 9 && warp < 12) {
      d_aqk_block(warp - 9);
      if (make_next_state) next_state(std::integral_constant<int, 12>{});
    } else if (warp < 9) {
      if (make_next_state) next_state(std::integral_constant<int, 12>{});
    } else if (warp >= 12) {
      // T1 = dM M^T, a 16 x 16 tile a warp (B[s][j] = M[j][s]: M's rows), then (warps 12-14)
      // dL = -M^T T1 on the tiles below the diagonal; dP = Diag(beta) dL, and sum_j dL_ij P_ij.
      const int x = warp - 12, ti = x / 2, tj = x % 2;
      {
        float acc[2][4] = {};
        tile_product<kBlock, false>(acc, &sh.chain.d_m[0][0], kRowC, 16 * ti, &sh.m_b[0][0], kRowC, 16 * tj, f);
        for_tile(16 * ti, 16 * tj, lane, [&](int n, int e, int i, int j) {
          if ((e & 1) == 0) store_bf16x2(&sh.chain.t1[i][j], acc[n][e], acc[n][e + 1]);
        });
      }
      asm volatile("bar.sync 1, 128;\n" ::: "memory");  // warps 12-15: T1 complete
      if (x < 3) {
        const int li = x == 0 ? 0 : 1, lj = x == 2 ? 1 : 0;  // dL tiles (0, 0), (1, 0), (1, 1)
        float acc[2][4] = {};
        for (int k0 = 16 * li; k0 < kBlock; k0 += 16) {
          uint32_t af[4], bf[4];
          a_trans(af, &sh.m_b[0][0], kRowC, 16 * li, k0, f);
          b_trans(bf, &sh.chain.t1[0][0], kRowC, 16 * lj, k0, f);
          mma2(acc, af, bf);
        }
        store_d_l(li, lj, acc);
      }
    }
    compute_barrier();
    BLOCK_PHASE_MARK(7);
    if constexpr (kProducer) {
      if (more) named_arrive(kValuesFree);  // S^T, v, dO (and dS'^T unless it went after phase 3)
    } else if constexpr (kTma) {
      if (more && tid == 0) tma_states_and_values(item_at(next_w));
    }

    intra_blocks(sh.d_gamma);
    compute_barrier();
    BLOCK_PHASE_MARK(8);
    if constexpr (kProducer) {
      if (more) named_arrive(kGatesFree);  // Gamma: last read in phase 7
    } else if constexpr (kTma) {
      if (more && tid == 0) tma_gates(item_at(next_w));
    }

    }  // dV' given or not

    // Phase 8 (6 where dV' is given): dg = reverse cumulative sum of dGamma + dgamma (threads 0 .. K -
    // 1); dbeta (threads K .. K + 31): sum_t M[t][i] (G + H)[t][i] + sum_j dL_ij P_ij, or where dV' is
    // given the parts dVb (.) V - Y (.) K^ of the 8 column tiles + sum_j dL_ij P_ij.
    if (tid < K) {
      const int c = tid;
      float acc = sh.kbar_sum[0][c] + sh.kbar_sum[1][c], dd = 0.0f;
#pragma unroll
      for (int s = 0; s < kSlices; ++s) dd += sh.d_decay[s][c];
      acc += exp_ftz(sh.last[c]) * dd;
      const float* d_gamma = &sh.d_gamma[0][c];
      store_reverse_column_sum<kBlock>(a.dg + token(0) * K + c, static_cast<int64_t>(H) * K, d_gamma, Shared::kPadK,
                                       acc, valid);
    } else if (tid < K + kBlock && tid - K < valid) {
      const int i = tid - K;
      float acc = sh.dbeta_l[0][i] + (i >= kChunk ? sh.dbeta_l[1][i] : 0.0f);
      if constexpr (kGivenDV) {
#pragma unroll
        for (int x = 0; x < V / 16; ++x) acc += sh.given.dbeta_parts[i][x];
      } else {
        for (int r = i; r < kBlock; ++r) acc += sh.chain.m[r][i] * sh.chain.gh[r][i];
      }
      a.dbeta[token(i)] = acc;
    } else if (kGivenDV && tid >= K + kBlock && tid < K + 2 * kBlock && more) {
      // the next item's beta, loaded in phase 5 (read from phase 2 on; this item's last read in phase 4)
      sh.beta[tid - K - kBlock] = __bfloat162float(__ushort_as_bfloat16(next_beta));
    }
    compute_barrier();  // phase 8's reads (dGamma, the partial sums) before the next block writes them
    BLOCK_PHASE_MARK(9);
  }
}

// cuTensorMapEncodeTiled from the driver (through the runtime: no libcuda link), once.
using TensorMapEncoder = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                      const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                      CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
inline TensorMapEncoder tensor_map_encoder() {
  static const TensorMapEncoder encoder = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<TensorMapEncoder>(nullptr);
    }
    return reinterpret_cast<TensorMapEncoder>(fn);
  }();
  return encoder;
}

// A tiled map of a dense tensor (dims innermost first, rank 3 or 4) with boxes `box`; the box may
// run past dim 0 (the padded rows) and past the rows (zero fill).
inline bool encode_tensor_map(CUtensorMap& map, TensorMapEncoder encode, CUtensorMapDataType type, int element_bytes,
                              const void* base, std::initializer_list<uint64_t> dims,
                              std::initializer_list<uint32_t> box) {
  const uint32_t rank = static_cast<uint32_t>(dims.size());
  cuuint64_t size[5], stride[4];
  cuuint32_t boxes[5], steps[5] = {1, 1, 1, 1, 1};
  uint64_t bytes = static_cast<uint64_t>(element_bytes);
  uint32_t i = 0;
  for (const uint64_t d : dims) {
    size[i] = d;
    if (i > 0) stride[i - 1] = bytes;
    bytes *= d;
    ++i;
  }
  i = 0;
  for (const uint32_t b : box) boxes[i++] = b;
  return encode(&map, type, rank, const_cast<void*>(base), size, stride, boxes, steps, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int K, int V>
cudaError_t block_tensor_maps(BlockTensorMaps& maps, const ChunkGradientArgs& a, int64_t batch) {
  const TensorMapEncoder encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const uint64_t chunks = static_cast<uint64_t>((a.length + kChunk - 1) / kChunk);
  const uint64_t pairs = static_cast<uint64_t>(batch) * static_cast<uint64_t>(a.heads);
  const uint64_t h = static_cast<uint64_t>(a.heads), n = static_cast<uint64_t>(batch), l = static_cast<uint64_t>(a.length);
  auto stored = [&](int interval) { return pairs * ((chunks + interval - 1) / interval); };
  constexpr auto kBf16 = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const bool ok =
      encode_tensor_map(maps.s, encode, kBf16, 2, a.chunk_states, {K, V, stored(a.states_interval)}, {K + 8, V, 1}) &&
      encode_tensor_map(maps.ds, encode, kBf16, 2, a.chunk_d_states, {K, V, stored(a.d_states_interval)},
                        {K + 8, V, 1}) &&
      encode_tensor_map(maps.v, encode, kBf16, 2, a.v, {V, h, l, n}, {V + 8, 1, kBlock, 1}) &&
      encode_tensor_map(maps.d_o, encode, kBf16, 2, a.d_o, {V, h, l, n}, {V + 8, 1, kBlock, 1}) &&
      encode_tensor_map(maps.q, encode, kBf16, 2, a.q, {K, h, l, n}, {K + 8, 1, kBlock, 1}) &&
      encode_tensor_map(maps.k, encode, kBf16, 2, a.k, {K, h, l, n}, {K + 8, 1, kBlock, 1}) &&
      encode_tensor_map(maps.g, encode, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, a.g, {K, h, l, n}, {K + 4, 1, kBlock, 1});
  return ok ? cudaSuccess : cudaErrorInvalidValue;
}

// kGivenV, kGivenDV: V' (and dV') from ChunkGradientArgs::new_values (and d_new_values).
template <int K, int V, BlockLoads kLoads = BlockLoads::kTop, bool kGivenV = false, bool kGivenDV = false>
cudaError_t launch_block_gradients(ChunkGradientArgs a, int64_t batch, cudaStream_t stream) {
  constexpr size_t shared = block_shared_bytes<K, V>();
  constexpr int kThreads = block_gradient_threads<kLoads>();
  const auto kernel = kda_block_gradient_kernel<K, V, kLoads, kGivenV, kGivenDV>;
  if ((kGivenV && a.new_values == nullptr) || (kGivenDV && a.d_new_values == nullptr)) return cudaErrorInvalidValue;
  BlockTensorMaps maps{};
  if constexpr (kLoads == BlockLoads::kTma) {
    const cudaError_t error = block_tensor_maps<K, V>(maps, a, batch);
    if (error != cudaSuccess) return error;
  }
  // States every 64 tokens (the second block of each pair made by the first) only with V' in shared
  // memory, and not with the tensor-memory accelerator's loads (which always carry S^T).
  if (a.states_interval == 4 && (!kGivenV || kLoads == BlockLoads::kTma)) return cudaErrorInvalidValue;
  const int64_t blocks = (a.length + kBlock - 1) / kBlock;
  a.items = (blocks + (blocks & 1)) * a.heads * batch;  // slots: each head's blocks padded to pairs
  int64_t ctas = 0;
  const cudaError_t error = persistent_ctas(kernel, kThreads, shared, a.items / 2, ctas);
  if (error != cudaSuccess) return error;
  kernel<<<static_cast<unsigned>(ctas), kThreads, shared, stream>>>(a, maps);
  return cudaGetLastError();
}

}  // namespace
}  // namespace odyssey::kernels
