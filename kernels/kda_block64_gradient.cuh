// Pass 3 of the KDA backward by fused blocks of 64 tokens (bf16, K = V = 128, V' and dVb given):
// included by kda_backward.cu after kda_block_gradient.cuh, whose pieces it uses (the fragment
// helpers, for_tile, tile_product, the items). KdaBackwardOptions::pass3_block_tokens = 64 runs it.
//
// Why: the 3x goal needs fewer bytes (kernels/README.md, "What the 3x goal needs"). Pass 3 by
// 32-token blocks reads the state gradient dS' leaving every block, so pass 2 stores every second
// chunk's: 1024 bytes a token and head written and read again. A 64-token item reads S entering it
// and dS' leaving it once, so passes 1 and 2 both store every fourth chunk's (512 bytes a token and
// head less in each of pass 2 and pass 3: 19.35 -> 17.2 GB at the bench's shape), and no item makes
// a next state (the pair chaining of the 32-token pass is gone). Its working set is what kept this
// design open since the fourteenth session (kernels/JOURNAL.md, "Thirty-first session"): with dVb
// kept by the walk no M, W, dW or Aqk is made, and the arrays are ordered by liveness:
//   phases 0-2  S^T, dS'^T, dO, v, V', dVb (136 KB) with q, k and Gamma: the three products with the
//               state (dQ^ = dO S^T, Y = dVb S^T, dK_ = V' dS'^T) and the small ones (dAqk = dO V'^T,
//               dL = -dVb V'^T, on the ten lower 16 x 16 blocks);
//   phases 3-6  in the values' place the anchored operands X_q, X_k, Kc and dP (61 KB), dGamma in q
//               and k's: P's blocks, the intra blocks' gradients and dg's reverse sums; S^T and
//               dS'^T's space takes the next item's.
// The derivation is model::kda::chunked_backward_reference(..., chunk = 64, anchor = 16, rounding,
// BackwardForm::kKeptInnovationGradients) (CPU; its bf16 emulation, the precision table's row "C=64
// anchor 16, all bf16, V' and dVb kept by the walks", 3.4-4.5e-3 of each gradient's largest
// magnitude against fp64), as the 32-token pass's with four sub-chunks:
//   dKb = -Y,  dK^ = Diag(beta) dKb,  dv = Diag(beta) dVb,  dL = -dVb V'^T (strictly lower),
//   dP = Diag(beta) dL,  dbeta_i = dVb_i . v_i - Y_i . K^_i + sum_j dL_ij P_ij,
// the intra products by blocks (a, b <= a) anchored at their row sub-chunk's start B_a:
//   X_a = x e^{Gamma - B_a} (rows of a),   Kc_ab = k e^{B_a - Gamma} (rows of b) = Kc_bb (.) e^{B_a - B_b},
// the off-diagonal column operands made from the diagonal ones by a bf16 product with the per-channel
// factor e^{B_a - B_b} <= 1 (as the 32-token pass's Kc_10), so that each pair's dGamma terms use the
// bf16 values the products saw.
//
// Work split (16 warps, one CTA an SM): warp w owns column tile w % 8 of two row tiles, w / 8 and
// 3 - w / 8, of every [64][128] result (dq, dk and dGamma in its registers; the two row tiles
// balance the intra blocks' work: a row tile a has a + 1 blocks in its rows and 4 - a in its
// columns). The ten dAqk blocks go to warps 0-9 and the ten dL blocks to warps 10-15 and 0-3, which
// keep them in registers until P's block of the same place is made (phase 4), so that P is never
// stored. Loads by cp.async from every thread, each part of the next item's as soon as its space is
// free: S^T and dS'^T after phase 2 (they land under phases 3-6), the values and g after phase 5
// (the intra operands lie in the values' space), q and k at the top (dGamma lies in theirs until
// the end); or, with kProducer (KdaBackwardOptions::pass3_block_producer), by a 17th warp at the same
// points, as the 32-token pass does, so that no compute warp stalls on the SM's outstanding copies.
// The compute threads' copies are the faster (H100: the backward 8.52-8.66 against 8.68-8.72 ms;
// kernels/JOURNAL.md, "Thirty-second session").
#pragma once

namespace odyssey::kernels {
namespace {

constexpr int kBlock64 = 64;                                                        // tokens an item
constexpr int kBlock64SubChunks = kBlock64 / kChunk;                                // 4
constexpr int kLowerBlocks64 = kBlock64SubChunks * (kBlock64SubChunks + 1) / 2;     // 10
constexpr int kOffDiagonal64 = kLowerBlocks64 - kBlock64SubChunks;                  // 6

// The lower 16 x 16 blocks of a 64 x 64 product, row by row: 0 (0, 0), 1 (1, 0), 2 (1, 1), 3 (2, 0),
// ..., 9 (3, 3).
struct LowerBlock64 {
  int ra, cb;  // row block, column block
  __device__ explicit LowerBlock64(int index) {
    ra = index < 1 ? 0 : index < 3 ? 1 : index < 6 ? 2 : 3;
    cb = index - ra * (ra + 1) / 2;
  }
};
// Where the factor e^{B_a - B_b} of the off-diagonal block (a, b), a > b, lies in Block64Shared::off.
__device__ __forceinline__ int off_diagonal_index(int a, int b) { return a * (a - 1) / 2 + b; }

template <int K, int V>
struct alignas(128) Block64Shared {
  static constexpr int kRowK = K + 8, kRowV = V + 8, kRowC = kBlock64 + 8, kPadK = K + 8;
  static constexpr int kSlices = kGradientThreads / (K / 2);  // 8: of Gamma's rows, of the V rows (d_decay)
  // S^T and dS'^T (phases 0-2): from phase 3 on the next item's land here (issued after phase 2).
  alignas(128) bf16 s_t[V][kRowK];    // S^T entering the block
  alignas(128) bf16 ds_t[V][kRowK];   // dS'^T leaving it
  struct Values {                     // phases 0-2
    bf16 d_o[kBlock64][kRowV];
    bf16 v[kBlock64][kRowV];
    bf16 v_new[kBlock64][kRowV];      // V' (pass 1's)
    bf16 d_vb[kBlock64][kRowV];       // dVb = M^T dV' (pass 2's)
  };
  struct Intra {                      // phases 3-5
    bf16 x_q[kBlock64][kRowK];        // scale q e^{Gamma - B_a}
    bf16 x_k[kBlock64][kRowK];        // k e^{Gamma - B_a}
    bf16 k_c[kBlock64][kRowK];        // k e^{B_a - Gamma}
    bf16 d_p[kBlock64][kRowC];        // dP = Diag(beta) dL (the lower blocks)
  };
  union alignas(128) {
    Values st;
    Intra in;
  };
  struct Keys {                       // phases 0-3
    bf16 q[kBlock64][kRowK];
    bf16 k[kBlock64][kRowK];
  };
  union alignas(128) {
    Keys keys;
    float d_gamma[kBlock64][kPadK];   // dGamma, for dg's reverse sums (phases 5-6)
  };
  alignas(16) float gamma[kBlock64][kPadK];  // g as loaded, then Gamma (from the block's start) in place
  union alignas(16) {
    float part[kSlices][K];                  // Gamma's partial sums (phases 0-1)
    bf16 d_aqk[kBlock64][kRowC];             // dAqk = dO V'^T (the lower blocks; phases 2-5)
  };
  float d_decay[kSlices][K];                 // sum_v dS' (.) S over slices of the V rows
  float kbar_sum[kBlock64SubChunks][K];      // column sums of dK_ (.) K_ over each row tile
  float anchor[kBlock64SubChunks][K];        // B_a = Gamma before sub-chunk a's first token (B_0 = 0)
  float last[K];                             // gamma = Gamma[63]
  bf16 off[kOffDiagonal64][K];               // e^{B_a - B_b} for a > b (off_diagonal_index)
  float dbeta_parts[kBlock64][V / 16];       // dVb (.) v - Y (.) K^ over each 16-column tile
  float dbeta_l[kBlock64SubChunks][kBlock64];  // sum_j dL_ij P_ij over the columns of block b
  float beta[kBlock64];
};

template <int K, int V>
constexpr size_t block64_shared_bytes() {
  static_assert(sizeof(Block64Shared<K, V>) <= 227 * 1024, "more than an SM's shared memory");
  return sizeof(Block64Shared<K, V>);
}

// Persistent: CTA b takes the items b, b + gridDim.x, ... (item = (sequence H + head) blocks + index).
// S^T entering chunk 4 index and dS'^T leaving chunk min(4 index + 3, chunks - 1), from passes 1 and
// 2's [N, H, ceil(chunks / i), V, K] at their intervals i (1, 2 or 4).
// kProducer: a 17th warp issues every copy (each part as soon as the item before frees its space;
// the named barriers of kda_block_gradient.cuh: kDStatesFree for S^T and dS'^T, kValuesFree for the
// values and g, kKeysFree for q and k, kLoaded when all have landed) and the 16 compute warps meet
// on a barrier of their own, so that none stalls on the SM's outstanding copies; at most 120
// registers a thread. Otherwise the compute threads issue them at the same three points.
template <int K, int V, bool kProducer = false>
__global__ void __launch_bounds__(kGradientThreads + (kProducer ? 32 : 0), 1)
    kda_block64_gradient_kernel(const ChunkGradientArgs a) {
  constexpr int kThreads = kGradientThreads + (kProducer ? 32 : 0);
  static_assert(K == 128 && V == 128, "two 16 x 16 tiles a warp of every [64][128] result");
  using Shared = Block64Shared<K, V>;
  constexpr int kTokens = kBlock64;
  constexpr int kRowK = Shared::kRowK, kRowV = Shared::kRowV, kRowC = Shared::kRowC, kSlices = Shared::kSlices;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  Shared& sh = *reinterpret_cast<Shared*>(shared_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = warp_index();
  const FragmentOffsets f(lane);
  const int g = lane >> 2;
  const int H = a.heads;
  const int64_t num_chunks = (a.length + kChunk - 1) / kChunk;
  const int64_t num_blocks = (a.length + kTokens - 1) / kTokens;
  const bf16* q = static_cast<const bf16*>(a.q);
  const bf16* k = static_cast<const bf16*>(a.k);
  const bf16* v = static_cast<const bf16*>(a.v);
  const bf16* d_o = static_cast<const bf16*>(a.d_o);
  const bf16* beta = static_cast<const bf16*>(a.beta);
  const int ct = warp % 8, n0 = 16 * ct;     // this warp's column tile
  const int row_tiles[2] = {warp / 8, 3 - warp / 8};
  const int row_starts[2] = {16 * row_tiles[0], 16 * row_tiles[1]};
  // The dL block this warp keeps from phase 2 to phase 4 (-1: none).
  const int dl_block = warp >= 10 ? warp - 10 : warp < 4 ? kOffDiagonal64 + warp : -1;
  const int cp = 2 * (tid % (K / 2)), rg = tid / (K / 2);  // the elementwise phases: column pair, row slice
  constexpr int kRows = kTokens / kSlices;                  // 8 rows a slice
  auto bf = [](bf16 x) { return __bfloat162float(x); };
  // KDA_PHASE_PROFILE: as the 32-token pass (g_phase_cycles: cycles between barriers at thread 0,
  // mark 0 the top's wait, 1-8 after phases 0-6, 7 and 8 the two halves of phase 6;
  // g_warp_phase_cycles: each warp's work before each).
#ifdef KDA_PHASE_PROFILE
  long long mark = clock64(), warp_mark = mark;
  int warp_phase = 0;
#endif
  auto barrier = [&](int id) {
    BLOCK_WARP_ARRIVE();
    if constexpr (kProducer) {
      asm volatile("bar.sync %0, %1;\n" ::"n"(kBlockComputeBarrier), "n"(kGradientThreads) : "memory");
    } else {
      __syncthreads();
    }
    BLOCK_WARP_LEAVE();
    BLOCK_PHASE_MARK(id);
  };
  auto named_sync = [](int id) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory"); };
  auto named_arrive = [](int id) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory"); };
  // The threads that issue copies: me of `stride`.
  const int me = kProducer ? lane : tid, stride = kProducer ? 32 : kGradientThreads;

  // The state entering item `it` and the state gradient leaving it, by cp.async (committed).
  auto issue_states = [&](const GradientItem& it) {
    const int64_t head = static_cast<int64_t>(it.seq) * H + it.h;
    const int si = a.states_interval, di = a.d_states_interval;
    const bf16* s = a.chunk_states + (head * stored_chunks(num_chunks, si) + 4 * it.index / si) * V * K;
    const bf16* ds =
        a.chunk_d_states + (head * stored_chunks(num_chunks, di) + min64(4 * it.index + 3, num_chunks - 1) / di) * V * K;
    for (int e = me; e < V * K / 8; e += stride) {
      const int row = e / (K / 8), col = (e % (K / 8)) * 8;
      cp_async16(&sh.s_t[row][col], s + static_cast<int64_t>(e) * 8);
      cp_async16(&sh.ds_t[row][col], ds + static_cast<int64_t>(e) * 8);
    }
    cp_async_commit();
  };
  // The values (dO, v, V', dVb) and g of item `it`, and its q and k (rows past the sequence's end zero).
  auto issue_values = [&](const GradientItem& it) {
    auto real_row = [&](int i) { return (it.row0 + (i < it.valid ? i : it.valid - 1)) * H + it.h; };
    for (int e = me; e < kTokens * V / 8; e += stride) {
      const int i = e / (V / 8), col = (e % (V / 8)) * 8;
      const int64_t at = real_row(i) * V + col;
      const bool in = i < it.valid;
      cp_async16_or_zero(&sh.st.d_o[i][col], d_o + at, in);
      cp_async16_or_zero(&sh.st.v[i][col], v + at, in);
      cp_async16_or_zero(&sh.st.v_new[i][col], a.new_values + at, in);
      cp_async16_or_zero(&sh.st.d_vb[i][col], a.d_new_values + at, in);
    }
    for (int e = me; e < kTokens * K / 4; e += stride) {
      const int i = e / (K / 4), col = (e % (K / 4)) * 4;
      cp_async16_or_zero(&sh.gamma[i][col], a.g + real_row(i) * K + col, i < it.valid);
    }
    cp_async_commit();
  };
  auto issue_keys = [&](const GradientItem& it) {
    auto real_row = [&](int i) { return (it.row0 + (i < it.valid ? i : it.valid - 1)) * H + it.h; };
    for (int e = me; e < kTokens * K / 8; e += stride) {
      const int i = e / (K / 8), col = (e % (K / 8)) * 8;
      const int64_t at = real_row(i) * K + col;
      cp_async16_or_zero(&sh.keys.q[i][col], q + at, i < it.valid);
      cp_async16_or_zero(&sh.keys.k[i][col], k + at, i < it.valid);
    }
    cp_async_commit();
  };
  auto item_at = [&](int64_t w) { return GradientItem::at(w, num_blocks, kTokens, H, a.length); };
  if constexpr (kProducer) {
    if (warp == kGradientWarps) {
      for (int64_t w = blockIdx.x; w < a.items; w += gridDim.x) {
        const GradientItem it = item_at(w);
        const bool first = w == static_cast<int64_t>(blockIdx.x);
        if (!first) named_sync(kDStatesFree);  // the item before: past its phase 2
        issue_states(it);
        if (!first) named_sync(kValuesFree);   // past its phase 5
        issue_values(it);
        if (!first) named_sync(kKeysFree);     // past its end
        issue_keys(it);
        cp_async_wait<0>();
        named_arrive(kLoaded);
      }
      return;
    }
  } else if (static_cast<int64_t>(blockIdx.x) < a.items) {
    const GradientItem first = item_at(blockIdx.x);
    issue_states(first);
    issue_values(first);
  }

  for (int64_t w = blockIdx.x; w < a.items; w += gridDim.x) {
    const GradientItem it = item_at(w);
    const int valid = it.valid;
    const bool more = w + gridDim.x < a.items;
    auto token = [&](int i) { return (it.row0 + i) * H + it.h; };  // [B, L, H] index of row i

    // q and k (the item before held dGamma in their space until its end); S^T and dS'^T, the values
    // and g were issued by the item before, after its phases 2 and 5 (or above, for the first).
#ifdef KDA_PHASE_PROFILE
    warp_phase = 0;
#endif
    if (tid < kTokens) sh.beta[tid] = tid < valid ? bf(beta[token(tid)]) : 0.0f;
    if constexpr (kProducer) {  // every compute thread meets the producer's arrival (beta stored before)
      BLOCK_WARP_ARRIVE();
      named_sync(kLoaded);
      BLOCK_WARP_LEAVE();
      BLOCK_PHASE_MARK(0);
    } else {
      issue_keys(it);
      cp_async_wait<0>();
      barrier(0);
    }

    // Phase 0: Gamma's partial sums (column pair cp, rows 8 rg .. 8 rg + 7) and d(e^gamma)'s partial
    // sums sum_v dS' (.) S over 16 V rows a thread.
    float2 local[kRows];
    block_partial_sums<kRows, V / kSlices>(&sh.gamma[rg * kRows], sh.s_t, sh.ds_t, cp, rg * (V / kSlices),
                                           &sh.part[rg][cp], &sh.d_decay[rg][cp], local);
    barrier(1);

    // Phase 1: Gamma in place of g (each thread its own rows), the anchors B_a (Gamma at rows 15, 31,
    // 47: the sums of slices 0-1, 0-3, 0-5), gamma = Gamma[63], the off-diagonal factors; and this
    // warp's two tiles of Y = dVb S^T, which need nothing made here.
    {
      float2 run = make_float2(0.0f, 0.0f), offset = run, anchors[kBlock64SubChunks];
#pragma unroll
      for (int r = 0; r < kSlices; ++r) {
        if (r == rg) offset = run;
        if (r % 2 == 0) anchors[r / 2] = run;
        const float2 x = *reinterpret_cast<const float2*>(&sh.part[r][cp]);
        run.x += x.x, run.y += x.y;
      }
      if (rg == 0) {
#pragma unroll
        for (int x = 0; x < kBlock64SubChunks; ++x) *reinterpret_cast<float2*>(&sh.anchor[x][cp]) = anchors[x];
        *reinterpret_cast<float2*>(&sh.last[cp]) = run;
#pragma unroll
        for (int x = 1; x < kBlock64SubChunks; ++x) {
#pragma unroll
          for (int y = 0; y < x; ++y) {
            store_bf16x2(&sh.off[off_diagonal_index(x, y)][cp], exp_ftz(anchors[x].x - anchors[y].x),
                         exp_ftz(anchors[x].y - anchors[y].y));
          }
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        *reinterpret_cast<float2*>(&sh.gamma[rg * kRows + r][cp]) =
            make_float2(local[r].x + offset.x, local[r].y + offset.y);
      }
    }
    float y[2][2][4] = {};
    tile_product_rows2<V, true>(y, &sh.st.d_vb[0][0], kRowV, row_starts, &sh.s_t[0][0], kRowK, n0, f);
    barrier(2);

    // Phase 2: on this warp's two tiles, dQ^ = dO S^T (into dq, dGamma), dK^ = -Diag(beta) Y (into dk,
    // dGamma), dbeta's dVb (.) v - Y (.) K^, and dK_ = V' dS'^T (into dk,
    // dGamma and dgamma's column sums); K^ = k e^Gamma and K_ = k e^{gamma - Gamma} in fp32 (no product
    // takes them here). dAqk's blocks on warps 0-9 (stored bf16), dL's on 10-15 and 0-3 (kept).
    float dq[2][2][4] = {}, dk[2][2][4] = {}, dgam[2][2][4] = {};
    float dl[2][4] = {};  // -dL's block dl_block: dVb V'^T
    // The two products with the state on both row tiles at once (one B fragment a k step for both),
    // then each tile's epilogue: per element the same operations in the same order as tile by tile.
    float acc_q[2][2][4] = {};
    tile_product_rows2<V, true>(acc_q, &sh.st.d_o[0][0], kRowV, row_starts, &sh.s_t[0][0], kRowK, n0, f);
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int rt = row_tiles[s], m0 = 16 * rt;
      {
        const float (&acc)[2][4] = acc_q[s];
        float rowpart[2] = {};
        for_tile_pairs(m0, n0, lane, [&](int n, int h, int i, int c) {
          const float2 gam = *reinterpret_cast<const float2*>(&sh.gamma[i][c]);
          const float2 qq = load_bf16x2(&sh.keys.q[i][c]), kk = load_bf16x2(&sh.keys.k[i][c]);
          const float2 dvb = load_bf16x2(&sh.st.d_vb[i][c]), vv = load_bf16x2(&sh.st.v[i][c]);
          const float beta_i = sh.beta[i];
          const float gams[2] = {gam.x, gam.y}, qs[2] = {qq.x, qq.y}, ks[2] = {kk.x, kk.y};
          const float dvbs[2] = {dvb.x, dvb.y}, vs[2] = {vv.x, vv.y};
#pragma unroll
          for (int x = 0; x < 2; ++x) {
            const int e = 2 * h + x;
            const float e_gam = exp_ftz(gams[x]);
            const float term = a.scale * e_gam * acc[n][e];  // dQ^ (.) scale e^Gamma
            dq[s][n][e] += term;
            dgam[s][n][e] += term * qs[x];                    // dQ^ (.) Q^
            const float kh = ks[x] * e_gam;                   // K^
            const float dkh = -beta_i * y[s][n][e];           // dK^
            dk[s][n][e] += dkh * e_gam;
            dgam[s][n][e] += dkh * kh;
            rowpart[h] += dvbs[x] * vs[x] - y[s][n][e] * kh;
          }
        });
        store_tile_row_sums(rowpart, lane, [&](int r, float x) { sh.dbeta_parts[m0 + g + 8 * r][ct] = x; });
      }
    }
    float acc_k[2][2][4] = {};
    tile_product_rows2<V, true>(acc_k, &sh.st.v_new[0][0], kRowV, row_starts, &sh.ds_t[0][0], kRowK, n0, f);
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int rt = row_tiles[s], m0 = 16 * rt;
      {
        const float (&acc)[2][4] = acc_k[s];
        float colsum[2][2] = {};
        for_tile_pairs(m0, n0, lane, [&](int n, int h, int i, int c) {
          const float2 last = *reinterpret_cast<const float2*>(&sh.last[c]);
          const float2 gam = *reinterpret_cast<const float2*>(&sh.gamma[i][c]);
          const float2 kk = load_bf16x2(&sh.keys.k[i][c]);
          const float lasts[2] = {last.x, last.y}, gams[2] = {gam.x, gam.y}, ks[2] = {kk.x, kk.y};
#pragma unroll
          for (int x = 0; x < 2; ++x) {
            const int e = 2 * h + x;
            const float decay = exp_ftz(lasts[x] - gams[x]);  // e^{gamma - Gamma}
            const float xk = acc[n][e] * ks[x] * decay;       // dK_ (.) K_
            dk[s][n][e] += acc[n][e] * decay;
            dgam[s][n][e] -= xk;
            colsum[n][x] += xk;
          }
        });
        store_tile_column_sums(colsum, &sh.kbar_sum[rt][n0], lane);
      }
    }
    if (warp < kLowerBlocks64) {  // dAqk = dO V'^T (lower, diagonal included)
      const LowerBlock64 blk(warp);
      float acc[2][4] = {};
      tile_product<V, false>(acc, &sh.st.d_o[0][0], kRowV, 16 * blk.ra, &sh.st.v_new[0][0], kRowV, 16 * blk.cb, f);
      for_tile(16 * blk.ra, 16 * blk.cb, lane, [&](int n, int e, int i, int j) {
        sh.d_aqk[i][j] = __float2bfloat16_rn(blk.ra != blk.cb || j <= i ? acc[n][e] : 0.0f);
      });
    }
    if (dl_block >= 0) {  // -dL = dVb V'^T
      const LowerBlock64 blk(dl_block);
      tile_product<V, false>(dl, &sh.st.d_vb[0][0], kRowV, 16 * blk.ra, &sh.st.v_new[0][0], kRowV, 16 * blk.cb, f);
    }
    barrier(3);
    // S^T and dS'^T are dead: the next item's land during phases 3-6.
    if constexpr (kProducer) {
      if (more) named_arrive(kDStatesFree);
    } else if (more) {
      issue_states(item_at(w + gridDim.x));
    }

    // Phase 3: the intra products' operands, in the space of phase 2's arrays (each thread its rows
    // of slice rg, which lie in sub-chunk rg / 2); and dv.
    {
      const int sub = rg / 2;
      const float2 anchor = *reinterpret_cast<const float2*>(&sh.anchor[sub][cp]);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int i = rg * kRows + r;
        const float2 gam = *reinterpret_cast<const float2*>(&sh.gamma[i][cp]);
        const float2 qi = load_bf16x2(&sh.keys.q[i][cp]), ki = load_bf16x2(&sh.keys.k[i][cp]);
        float2 up, down;  // e^{Gamma - B}, e^{B - Gamma}
        exp_both(gam.x - anchor.x, up.x, down.x);
        exp_both(gam.y - anchor.y, up.y, down.y);
        store_bf16x2(&sh.in.x_q[i][cp], a.scale * qi.x * up.x, a.scale * qi.y * up.y);
        store_bf16x2(&sh.in.x_k[i][cp], ki.x * up.x, ki.y * up.y);
        store_bf16x2(&sh.in.k_c[i][cp], ki.x * down.x, ki.y * down.y);
      }
    }
    // dv = Diag(beta) dVb, stored as 16-byte rows (dVb lies intact until phase 4's dP).
    for (int e = tid; e < kTokens * V / 8; e += kGradientThreads) {
      const int i = e / (V / 8), col = (e % (V / 8)) * 8;
      if (i >= valid) continue;
      const uint4 raw = *reinterpret_cast<const uint4*>(&sh.st.d_vb[i][col]);
      const __nv_bfloat162* in = reinterpret_cast<const __nv_bfloat162*>(&raw);
      uint4 out;
      __nv_bfloat162* scaled = reinterpret_cast<__nv_bfloat162*>(&out);
      const float beta_i = sh.beta[i];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 x = __bfloat1622float2(in[j]);
        scaled[j] = __floats2bfloat162_rn(beta_i * x.x, beta_i * x.y);
      }
      *reinterpret_cast<uint4*>(static_cast<bf16*>(a.dv) + token(i) * V + col) = out;
    }
    barrier(4);

    // Phase 4: P's block at each kept dL block's place (P = X_k Kc^T, strictly lower), then dP =
    // Diag(beta) dL (stored bf16) and dbeta's sum_j dL_ij P_ij over the block's columns.
    if (dl_block >= 0) {
      const LowerBlock64 blk(dl_block);
      const int ra = blk.ra, cb = blk.cb;
      const bf16* factor = ra != cb ? sh.off[off_diagonal_index(ra, cb)] : nullptr;
      float p[2][4] = {};
#pragma unroll
      for (int k0 = 0; k0 < K; k0 += 16) {
        uint32_t af[4], bfr[4];
        a_rows(af, &sh.in.x_k[0][0], kRowK, 16 * ra, k0, f);
        b_rows(bfr, &sh.in.k_c[0][0], kRowK, 16 * cb, k0, f);
        if (factor != nullptr) scale_b_rows(bfr, factor, k0, lane);  // Kc_ab = Kc_bb (.) e^{B_a - B_b}
        mma2(p, af, bfr);
      }
      float row_sum[2] = {};  // rows 16 ra + g, + 8
      for_tile(16 * ra, 16 * cb, lane, [&](int n, int e, int i, int j) {
        const float d = i > j ? -dl[n][e] : 0.0f;  // dL
        sh.in.d_p[i][j] = __float2bfloat16_rn(sh.beta[i] * d);
        row_sum[e >> 1] += d * p[n][e];
      });
      store_tile_row_sums(row_sum, lane, [&](int r, float sum) { sh.dbeta_l[cb][16 * ra + g + 8 * r] = sum; });
    }
    barrier(5);

    // Phase 5: the intra blocks' gradients on this warp's two tiles. Rows (sub-chunk a = rt): dX_a =
    // sum_{b <= a} dA_ab Kc_ab for Aqk (into dq) and P (into dk); columns (b = rt): dKc_ab = dAqk_ab^T
    // Xq_a + dP_ab^T Xk_a for each a >= b (into dk, its own factor e^{B_a - Gamma}). dGamma's factors
    // are the bf16 operands the products saw. Then dq and dk are final (stored) and dGamma goes to
    // shared memory for the reverse sums.
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int rt = row_tiles[s], m0 = 16 * rt;
      // This tile's Gamma, read once for its epilogues below (the products' ldmatrix, asm with a memory
      // clobber, would make the compiler read it again after each).
      float2 gam_tile[2][2];
      for_tile_pairs(m0, n0, lane, [&](int n, int h, int i, int c) {
        gam_tile[n][h] = *reinterpret_cast<const float2*>(&sh.gamma[i][c]);
      });
      {
        float dxq[2][4] = {}, dxk[2][4] = {};
        for (int b = 0; b <= rt; ++b) {
          uint32_t aq[4], ap[4], bfr[4];
          a_rows(aq, &sh.d_aqk[0][0], kRowC, m0, 16 * b, f);
          a_rows(ap, &sh.in.d_p[0][0], kRowC, m0, 16 * b, f);
          b_trans(bfr, &sh.in.k_c[0][0], kRowK, n0, 16 * b, f);
          if (b != rt) scale_b_trans(bfr, sh.off[off_diagonal_index(rt, b)], n0, lane);  // Kc_ab = Kc_bb (.) e^{B_a - B_b}
          mma2(dxq, aq, bfr);
          mma2(dxk, ap, bfr);
        }
        for_tile_pairs(m0, n0, lane, [&](int n, int h, int i, int c) {
          const float2 gam = gam_tile[n][h];
          const float2 anchor = *reinterpret_cast<const float2*>(&sh.anchor[rt][c]);
          const float2 xq = load_bf16x2(&sh.in.x_q[i][c]), xk = load_bf16x2(&sh.in.x_k[i][c]);
          const float gams[2] = {gam.x, gam.y}, anchors[2] = {anchor.x, anchor.y};
          const float xqs[2] = {xq.x, xq.y}, xks[2] = {xk.x, xk.y};
#pragma unroll
          for (int x = 0; x < 2; ++x) {
            const int e = 2 * h + x;
            const float up = exp_ftz(gams[x] - anchors[x]);  // e^{Gamma - B_rt}
            dq[s][n][e] += a.scale * up * dxq[n][e];
            dgam[s][n][e] += dxq[n][e] * xqs[x];
            dk[s][n][e] += up * dxk[n][e];
            dgam[s][n][e] += dxk[n][e] * xks[x];
          }
        });
      }
      for (int ra = rt; ra < kBlock64SubChunks; ++ra) {
        float dkc[2][4] = {};
        uint32_t aq[4], ap[4], bq[4], bk[4];
        a_trans(aq, &sh.d_aqk[0][0], kRowC, m0, 16 * ra, f);
        a_trans(ap, &sh.in.d_p[0][0], kRowC, m0, 16 * ra, f);
        b_trans(bq, &sh.in.x_q[0][0], kRowK, n0, 16 * ra, f);
        b_trans(bk, &sh.in.x_k[0][0], kRowK, n0, 16 * ra, f);
        mma2(dkc, aq, bq);
        mma2(dkc, ap, bk);
        const bf16* factor = ra != rt ? sh.off[off_diagonal_index(ra, rt)] : nullptr;
        for_tile_pairs(m0, n0, lane, [&](int n, int h, int i, int c) {
          const __nv_bfloat162 kc = *reinterpret_cast<const __nv_bfloat162*>(&sh.in.k_c[i][c]);
          const float2 gam = gam_tile[n][h];
          const float2 anchor = *reinterpret_cast<const float2*>(&sh.anchor[ra][c]);
          const bf16 kcs[2] = {kc.x, kc.y};
          const float gams[2] = {gam.x, gam.y}, anchors[2] = {anchor.x, anchor.y};
#pragma unroll
          for (int x = 0; x < 2; ++x) {
            const int e = 2 * h + x;
            const float kc_ab = bf(factor != nullptr ? __hmul(kcs[x], factor[c + x]) : kcs[x]);  // what the products saw
            dk[s][n][e] += exp_ftz(anchors[x] - gams[x]) * dkc[n][e];                       // e^{B_a - Gamma}
            dgam[s][n][e] -= dkc[n][e] * kc_ab;
          }
        });
      }
      for_tile(m0, n0, lane, [&](int n, int e, int i, int c) {
        if ((e & 1) != 0) return;
        if (i < valid) {
          store_pair(static_cast<bf16*>(a.dq) + token(i) * K + c, dq[s][n][e], dq[s][n][e + 1]);
          store_pair(static_cast<bf16*>(a.dk) + token(i) * K + c, dk[s][n][e], dk[s][n][e + 1]);
        }
        *reinterpret_cast<float2*>(&sh.d_gamma[i][c]) = make_float2(dgam[s][n][e], dgam[s][n][e + 1]);
      });
    }
    barrier(6);
    // The values' space (the intra operands') and Gamma are dead: the next item's values and g land
    // during phase 6.
    if constexpr (kProducer) {
      if (more) named_arrive(kValuesFree);
    } else if (more) {
      issue_values(item_at(w + gridDim.x));
    }

    // Phase 6: dg = reverse cumulative sum of dGamma + dgamma, dgamma = sum of dK_ (.) K_ over the rows
    // + e^gamma sum_v dS' (.) S, by four threads a channel (16 rows each: a thread's column seg of
    // sub-chunk `seg`): each sums its rows from the last up, the segments' totals meet in shared
    // memory (part, free since phase 1), and each adds those below it. Then dbeta (threads 0-63): the
    // column tiles' dVb (.) v - Y (.) K^ and sum_j dL_ij P_ij over the blocks b <= its own.
    const int col = tid % K, seg = tid / K;
    float suffix[kChunk];
    {
      float acc = 0.0f;
#pragma unroll
      for (int i = kChunk - 1; i >= 0; --i) {
        acc += sh.d_gamma[kChunk * seg + i][col];
        suffix[i] = acc;
      }
      sh.part[seg][col] = acc;
    }
    barrier(7);
    {
      float acc = 0.0f, dd = 0.0f;
#pragma unroll
      for (int r = 0; r < kBlock64SubChunks; ++r) {
        acc += sh.kbar_sum[r][col];
        if (r > seg) acc += sh.part[r][col];
      }
#pragma unroll
      for (int x = 0; x < kSlices; ++x) dd += sh.d_decay[x][col];
      acc += exp_ftz(sh.last[col]) * dd;
      float* out = a.dg + token(kChunk * seg) * K + col;
      const int rows = valid - kChunk * seg;
#pragma unroll
      for (int i = 0; i < kChunk; ++i, out += static_cast<int64_t>(H) * K) {
        if (i < rows) *out = suffix[i] + acc;
      }
    }
    if (tid < valid) {
      const int i = tid;
      float acc = 0.0f;
      for (int b = 0; b <= i / kChunk; ++b) acc += sh.dbeta_l[b][i];
#pragma unroll
      for (int x = 0; x < V / 16; ++x) acc += sh.dbeta_parts[i][x];
      a.dbeta[token(i)] = acc;
    }
    barrier(8);  // phase 6's reads before the next item's loads
    if constexpr (kProducer) {
      if (more) named_arrive(kKeysFree);
    }
  }
}

template <int K, int V, bool kProducer = false>
cudaError_t launch_block64_gradients(ChunkGradientArgs a, int64_t batch, cudaStream_t stream) {
  constexpr size_t shared = block64_shared_bytes<K, V>();
  constexpr int kThreads = kGradientThreads + (kProducer ? 32 : 0);
  const auto kernel = kda_block64_gradient_kernel<K, V, kProducer>;
  if (a.new_values == nullptr || a.d_new_values == nullptr) return cudaErrorInvalidValue;
  a.items = (a.length + kBlock64 - 1) / kBlock64 * a.heads * batch;
  int64_t ctas = 0;
  const cudaError_t error = persistent_ctas(kernel, kThreads, shared, a.items, ctas);
  if (error != cudaSuccess) return error;
  kernel<<<static_cast<unsigned>(ctas), kThreads, shared, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace
}  // namespace odyssey::kernels
