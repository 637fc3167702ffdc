// Device code shared by the chunked KDA forward (kda.cu) and backward (kda_backward.cu): element
// access, mma.sync / ldmatrix fragments, one chunk's prepared operands (ChunkSlot) and the
// prepare phase that fills them, and the host-side dispatch from runtime sizes to the kernels'
// template arguments. Internal: included only by those two .cu files (everything is in an
// anonymous namespace, so each gets its own copy). Math: MODEL.md, "Incremental attention".
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/kda.h"
#include "kernels/mma.cuh"

namespace odyssey::kernels {
namespace {

constexpr int kChunk = 16;

using bf16 = __nv_bfloat16;

// The walk's CTA (the forward, the transition pass, the backward's reverse walk): kTile value
// columns of S^T, 16 rows per warp, so kTile / 16 warps. They prepare a group of kTile / 16 chunks
// in parallel (one chunk each, in its own ChunkSlot) and then walk the group together. A CTA owns
// 64 columns (4 warps), or 32 (2 warps, groups of 2 chunks) when K or V is 32 (walk_tile).
template <int kTile>
struct Walk {
  static_assert(kTile == 32 || kTile == 64, "a walk CTA owns 32 or 64 value columns");
  static constexpr int kWarps = kTile / 16;
  static constexpr int kThreads = kWarps * 32;
};

// Key and value widths per head the chunked kernels are built for.
constexpr bool head_width_supported(int64_t n) { return n == 32 || n == 64 || n == 128; }

// The walk's tile for a head of K x V: 64 value columns, or 32 when either width is 32 (the
// transition pass walks the K + V columns of [A_seg | B_seg] in tiles of one width; one rule for
// every pass keeps one tile per call).
constexpr int walk_tile(int64_t key_dim, int64_t value_dim) {
  return key_dim == 32 || value_dim == 32 ? 32 : 64;
}

// Host-side dispatch from a call's runtime sizes to template arguments: each calls f with a tag
// (ElementType<T>, std::integral_constant<int, N>) and returns what f returns. Sizes are checked
// by the caller first.
template <typename T>
struct ElementType {
  using type = T;
};

template <typename F>
cudaError_t with_element_type(KdaDtype dtype, F&& f) {
  return dtype == KdaDtype::kBFloat16 ? f(ElementType<bf16>()) : f(ElementType<float>());
}

// n in {32, 64, 128} (head_width_supported).
template <typename F>
cudaError_t with_head_width(int64_t n, F&& f) {
  switch (n) {
    case 32:
      return f(std::integral_constant<int, 32>());
    case 64:
      return f(std::integral_constant<int, 64>());
    default:
      return f(std::integral_constant<int, 128>());
  }
}

// A chunked call's kernels: f(ElementType<T>(), std::integral_constant<int, K>(),
// std::integral_constant<int, kTile>()) with kTile = walk_tile(K, value_dim) (at K = 32 only the
// 32-column walk is instantiated).
template <typename F>
cudaError_t with_walk_types(KdaDtype dtype, int64_t key_dim, int64_t value_dim, F&& f) {
  return with_element_type(dtype, [&](auto type) {
    return with_head_width(key_dim, [&](auto key) {
      using Tile32 = std::integral_constant<int, 32>;
      using Tile64 = std::integral_constant<int, 64>;
      if constexpr (walk_tile(decltype(key)::value, 64) == 64) {
        if (walk_tile(key(), value_dim) == 64) return f(type, key, Tile64());
      }
      return f(type, key, Tile32());
    });
  });
}

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// threadIdx.x / 32, broadcast from lane 0 (as CUTLASS's canonical_warp_idx_sync) so that the
// compiler knows every lane of a warp holds the same value. Branches on it are then uniform, and
// the warp-synchronous code inside them (__syncwarp, shuffles, ldmatrix, mma) is compiled once:
// with `threadIdx.x >> 5`, ptxas guarded the prepare phase with a divergence check (BRA.DIV) and
// kept a second, collective copy of it (253 MUFU in the forward kernel instead of 132).
__device__ __forceinline__ int warp_index() {
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) >> 5, 0);
}

// ---------------------------------------------------------------------------------------------
// Element access for the two input types.

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float x) { return __float2bfloat16_rn(x); }
// Two adjacent elements from floats (p aligned to two elements): one 8- or 4-byte store.
__device__ __forceinline__ void store_pair(float* p, float x, float y) {
  *reinterpret_cast<float2*>(p) = make_float2(x, y);
}
__device__ __forceinline__ void store_pair(bf16* p, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}

// N consecutive elements (N in {2, 4, 8}) from global memory, as floats; p aligned to N elements.
template <int N>
__device__ __forceinline__ void load_vec(const bf16* p, float (&out)[N]) {
  static_assert(N == 2 || N == 4 || N == 8);
  uint32_t raw[N / 2];
  if constexpr (N == 2) {
    raw[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
  } else if constexpr (N == 4) {
    const uint2 r = __ldg(reinterpret_cast<const uint2*>(p));
    raw[0] = r.x, raw[1] = r.y;
  } else {
    const uint4 r = __ldg(reinterpret_cast<const uint4*>(p));
    raw[0] = r.x, raw[1] = r.y, raw[2] = r.z, raw[3] = r.w;
  }
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[i]));
    out[2 * i] = f.x, out[2 * i + 1] = f.y;
  }
}

template <int N>
__device__ __forceinline__ void load_vec(const float* p, float (&out)[N]) {
  static_assert(N == 2 || N == 4 || N == 8);
  if constexpr (N == 2) {
    const float2 r = __ldg(reinterpret_cast<const float2*>(p));
    out[0] = r.x, out[1] = r.y;
  } else {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const float4 r = __ldg(reinterpret_cast<const float4*>(p) + i);
      out[4 * i] = r.x, out[4 * i + 1] = r.y, out[4 * i + 2] = r.z, out[4 * i + 3] = r.w;
    }
  }
}

// 8 consecutive floats stored as T (p aligned to 8 elements).
__device__ __forceinline__ void store8(bf16* p, const float* x) {
  uint4 r;
  uint32_t* w = reinterpret_cast<uint32_t*>(&r);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
    w[i] = *reinterpret_cast<uint32_t*>(&h);
  }
  *reinterpret_cast<uint4*>(p) = r;
}
__device__ __forceinline__ void store8(float* p, const float* x) {
  reinterpret_cast<float4*>(p)[0] = make_float4(x[0], x[1], x[2], x[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(x[4], x[5], x[6], x[7]);
}

// ---------------------------------------------------------------------------------------------
// Exponentials of the gates. The intrinsic __expf is ex2.approx of x log2(e) plus four
// instructions that keep results below 2^-126 denormal instead of flushing them to zero; no
// result that small (e^-87) matters here, so these take ex2.approx.ftz: the intrinsic's values
// bit for bit wherever they are normal numbers, in two instructions instead of five, and e^x
// with e^-x from one multiply (MUFU.EX2 negates its operand for free).
constexpr float kLog2E = 1.4426950408889634f;
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float exp_ftz(float x) { return exp2_ftz(x * kLog2E); }
// e^x and e^-x.
__device__ __forceinline__ void exp_both(float x, float& up, float& down) {
  const float t = x * kLog2E;
  up = exp2_ftz(t);
  down = exp2_ftz(-t);
}

// A warp's 16 rows of a transposed state in mma accumulators, tile[j][e]: S^T row v_col + g
// (+8 for e >= 2), column 8j + 2t (+1 for odd e); S is fp32 [K, V] at state + offset (the walks'
// states, their gradients, the initial and final states). for_each_tile_entry calls
// f(j, e, c, vr) for every entry with its S column c and S^T row vr; load: zeros when state is
// nullptr.
template <int K, typename F>
__device__ __forceinline__ void for_each_tile_entry(int v_col, int lane, F&& f) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < K / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) f(j, e, 8 * j + 2 * t + (e & 1), v_col + g + (e >> 1) * 8);
  }
}
template <int K>
__device__ __forceinline__ void load_state_tile(float (&tile)[K / 8][4], const float* state, int64_t offset,
                                                int V, int v_col, int lane) {
  for_each_tile_entry<K>(v_col, lane, [&](int j, int e, int c, int vr) {
    tile[j][e] = state ? state[offset + c * V + vr] : 0.0f;
  });
}
template <int K>
__device__ __forceinline__ void store_state_tile(float* state, int64_t offset, const float (&tile)[K / 8][4],
                                                 int V, int v_col, int lane) {
  for_each_tile_entry<K>(v_col, lane, [&](int j, int e, int c, int vr) { state[offset + c * V + vr] = tile[j][e]; });
}


// Column c of M = (I + L)^-1 for a strictly lower 16 x 16 L read through l(i, j), in fp32, by
// right-looking substitution: once m[j] is final, every later row takes its term l(i, j) m[j] at
// once. A dependent chain of 16 updates instead of the 120 of row-by-row substitution, with each
// row's terms still subtracted in the order j = 0, 1, ...: the same operations, bit for bit.
template <typename Lower>
__device__ __forceinline__ void unit_lower_inverse_column(const Lower& l, int c, float (&m)[kChunk]) {
#pragma unroll
  for (int i = 0; i < kChunk; ++i) m[i] = i == c ? 1.0f : 0.0f;
#pragma unroll
  for (int j = 0; j < kChunk; ++j) {
#pragma unroll
    for (int i = j + 1; i < kChunk; ++i) m[i] -= l(i, j) * m[j];
  }
}

// W = M Diag(beta) K^ in place over K^ (w: the chunk's K^ rows), 16 columns at a time for kCount
// tiles from column n_begin; a_m: the A fragment of M Diag(beta) (bf16).
template <int kCount, typename Rows>
__device__ __forceinline__ void w_columns_in_place(Rows& w, const uint32_t (&a_m)[4], int n_begin,
                                                   const FragmentOffsets& f, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int s = 0; s < kCount; ++s) {
    const int n0 = n_begin + 16 * s;
    uint32_t b[4];
    ldmatrix_x4_trans(b, &w[f.t_row][n0 + f.t_col]);
    float acc[2][4] = {};
    mma(acc[0], a_m, b[0], b[1]);
    mma(acc[1], a_m, b[2], b[3]);
    __syncwarp();
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int col = n0 + n * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(&w[g][col]) = pack_bf16(acc[n][0], acc[n][1]);
      *reinterpret_cast<uint32_t*>(&w[g + 8][col]) = pack_bf16(acc[n][2], acc[n][3]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Chunked forward.

// One chunk's prepared operands (written by one warp in the prepare phase, read by all warps in
// the walk) and that warp's scratch; kTile: the CTA's value columns (Walk). bf16 rows are padded
// by 8 elements so that the 8 row addresses of an ldmatrix fall in distinct bank groups (row
// strides of 80, 144 and 272 bytes at 32, 64 and 128 columns).
template <int K, int kTile>
struct alignas(16) ChunkSlot {
  static_assert(K == 32 || K == 64 || K == 128, "key width");
  static constexpr int kRow = K + 8;
  // The walk stages a warp's 16 x 16 outputs as 16 rows of 20 floats over its k_check.
  static_assert(kRow * sizeof(bf16) >= 20 * sizeof(float), "k_check too small to stage O");
  bf16 q_hat[kChunk][kRow];    // scale q e^Gamma
  bf16 w[kChunk][kRow];        // K^ = k e^Gamma while preparing, then W = M Diag(beta) K^
  // The K operand of the walk's state update: K~ in the forward walks, S^T <- (S^T + V'^T K~)
  // Diag(e^gamma) (k_check is O's staging then); K_ = K~ Diag(e^gamma) in the reverse walk.
  bf16 k_walk[kChunk][kRow];
  bf16 k_check[kChunk][kRow];  // k e^-Gamma (prepare only); the walk stages this warp's O here
  bf16 a_qk[kChunk][24];       // lower_incl_diagonal(Q^ K~^T)
  bf16 m_beta[kChunk][24];     // M Diag(beta)       (prepare only)
  bf16 v[kChunk][kTile + 8];   // this CTA's value columns (prepare only)
  float u[kChunk][kTile + 4];  // U = M Diag(beta) V
  union {
    float lower[kChunk][kChunk + 1];  // L = Diag(beta) strictly_lower(K^ K~^T)  (prepare only)
    bf16 m[kChunk][24];               // then, in the reverse walk, M (dVb^T = dV'^T M)
  };
  float decay_last[K];         // e^gamma
};

// One slot per warp of the walk CTA. K = 128: 108.8 KB (64 columns), 48.3 KB (32); K = 64:
// 75.0 KB, 31.4 KB; K = 32: 22.9 KB (32 columns only).
template <int K, int kTile>
constexpr size_t chunked_shared_bytes() {
  return sizeof(ChunkSlot<K, kTile>) * Walk<kTile>::kWarps;
}

struct ChunkedArgs {
  const void *q, *k, *v, *beta;
  const float *g, *initial_state;
  void* o;
  float* final_state;
  const int32_t* cu_seqlens;
  int64_t length;
  int heads, value_dim;
  float scale;
  // Segments (context parallelism; kda.h). segments == 1 and segment_length == length for the
  // serial walk (and always with cu_seqlens). CTAs along grid z are (sequence, segment) pairs.
  int64_t segment_length;
  int segments;
  // Segment 0's tokens (== segment_length unless it is the lead, which may be longer).
  int64_t first_segment_length;
  // The lead (P > 1): the transition pass walks segment 0 forward from the initial state (outputs,
  // or chunk states in the states pass) alongside the other segments' transitions, and stores its
  // end state as segment 1's start in lead_states [N, P, H, K, V]; the scan starts there and the
  // forward pass walks segments 1..P-1 only. Segment 0's transition pair is then unused.
  bool lead;
  float* lead_states;
  const float* segment_states;  // forward pass: [N, P, H, K, V] state entering each segment
  float* transition_a;          // transition pass: [N, P - 1, H, K, K], A_seg transposed
  float* transition_b;          // transition pass: [N, P - 1, H, K, V], B_seg
  bool prefetch;                // L2 prefetch of the next group's inputs during the walk
  bool head_walk;               // whole heads (kda_head_kernel): bf16, K = V = 128, the option, the device fits it
  // Forward pass, for the backward: bf16 [N, H, ceil(chunks / state_interval), V, K], the state
  // entering chunks 0, i, 2i, ... (i = state_interval), transposed (nullptr: not kept). Not with
  // cu_seqlens.
  void* chunk_states;
  int state_interval;
  // Forward pass, for the backward's pass 3 by blocks: bf16 [rows, H, V], every token's V' = U - W S
  // (the values the walk adds to the state), as the walk rounds it for its products (nullptr: not
  // kept). Only the passes that keep chunk states write it.
  void* new_values;
};

// The kernels built from the prepare/walk code: the forward (outputs, state from the initial or
// segment state), the transition pass of context parallelism (no outputs, no Q^ / Aqk), the
// backward's state recompute (the forward's walk without outputs, storing every chunk's entering
// state in chunk_states), and the forward of a training step that keeps those states for its
// backward (outputs and chunk_states: kForwardStates).
enum class Pass { kForward, kTransition, kStates, kForwardStates };
constexpr bool pass_writes_outputs(Pass p) { return p == Pass::kForward || p == Pass::kForwardStates; }
constexpr bool pass_keeps_states(Pass p) { return p == Pass::kStates || p == Pass::kForwardStates; }

// Transition walks of context parallelism (the forward's and the backward's reverse walk): a
// segment's affine map X_end = A X_start + B is walked as one state [A | B] from [I | 0], the A
// columns without values. transition_start_tile: this warp's tile of [I | 0] (a_columns: the A
// walk). store_transition_tile: its end into pair slot `pair` of ChunkedArgs::transition_a (A
// transposed, A[c][vr] at vr K + c: the segment scan reads A's columns) or ::transition_b (B,
// [K][V]).
template <int K>
__device__ __forceinline__ void transition_start_tile(float (&tile)[K / 8][4], int v_col, bool a_columns, int lane) {
  for_each_tile_entry<K>(v_col, lane, [&](int j, int e, int c, int vr) { tile[j][e] = a_columns && c == vr ? 1.0f : 0.0f; });
}

template <int K>
__device__ __forceinline__ void store_transition_tile(const ChunkedArgs& a, const float (&tile)[K / 8][4], int64_t pair,
                                                      int V, int v_col, bool a_columns, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < K / 8; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int c = 8 * j + 2 * t, vr = v_col + g + half * 8;
      if (a_columns) {
        *reinterpret_cast<float2*>(&a.transition_a[pair * K * K + vr * K + c]) =
            make_float2(tile[j][2 * half], tile[j][2 * half + 1]);
      } else {
        a.transition_b[pair * K * V + c * V + vr] = tile[j][2 * half];
        a.transition_b[pair * K * V + (c + 1) * V + vr] = tile[j][2 * half + 1];
      }
    }
  }
}

// kTile value columns [v0, v0 + kTile) of rows [row0, row0 + valid) of x [*, H, V] as bf16 (zeros
// past valid), by one warp, into rows[16][kTile + 8]: 8 columns per item, 16-byte stores.
template <typename T, int kTile>
__device__ void load_value_rows(const T* x, bf16 (*rows)[kTile + 8], int64_t row0, int valid,
                                int h, int heads, int value_dim, int v0, int lane) {
  static_assert(kChunk * kTile / 8 % 32 == 0, "whole items per lane");
#pragma unroll
  for (int r = 0; r < kChunk * kTile / 8 / 32; ++r) {
    const int item = lane + 32 * r;
    const int i = item / (kTile / 8), col = (item % (kTile / 8)) * 8;
    float f[8] = {};
    if (i < valid) load_vec(x + ((row0 + i) * heads + h) * static_cast<int64_t>(value_dim) + v0 + col, f);
    uint32_t packed[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) packed[j] = pack_bf16(f[2 * j], f[2 * j + 1]);
    *reinterpret_cast<uint4*>(&rows[i][col]) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

// The prepare phase for one chunk, by one warp: rows [row0, row0 + valid) of the sequence
// (valid in 1..16; missing rows are zeros, which leaves the real rows exact).
// kOutputs: also Q^ and Aqk (the forward). with_values: also V and U (false for the A_seg columns
// of the transition pass, whose values are zero; U is then left unwritten).
// kGradients (the backward's reverse walk): slot.k_walk gets K_ instead of K~.
template <typename T, int K, int kTile, bool kOutputs, bool kGradients = false>
__device__ void prepare_chunk(const ChunkedArgs& a, ChunkSlot<K, kTile>& slot, int64_t row0,
                              int valid, int h, int v0, bool with_values, int lane) {
  // Key columns per lane, an even number (stored as bf16 pairs): at K = 32 lanes 0-15 hold two
  // each and lanes 16-31 idle until the matmuls (key_lane is a constant true at K >= 64).
  constexpr int kCols = K / 32 >= 2 ? K / 32 : 2;
  constexpr int kKeyLanes = K / kCols;
  const bool key_lane = kKeyLanes == 32 || lane < kKeyLanes;
  const int c0 = lane * kCols;
  const int H = a.heads, V = a.value_dim;
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  auto key_offset = [&](int i) { return ((row0 + i) * H + h) * static_cast<int64_t>(K) + c0; };

  // bf16 inputs: the chunk's raw rows of q, k (in place of Q^ and K~, which each lane then
  // overwrites column by column) and v go to shared memory by cp.async, all in flight together
  // with the loads of g (kept in registers) and beta: one round trip to L2 per chunk. fp32 inputs
  // load row by row.
  constexpr bool kStaged = std::is_same_v<T, bf16>;
  float beta = 0.0f;
  if constexpr (kStaged) {
    constexpr int kPieces = K / 8;  // 16-byte pieces of a row of K bf16
    const int64_t last_row = row0 + valid - 1;  // a readable address for the zero-filled rows
#pragma unroll
    for (int r = 0; r < kChunk * kPieces / 32; ++r) {
      const int item = lane + 32 * r, i = item / kPieces, col = (item % kPieces) * 8;
      const int64_t src = (min64(row0 + i, last_row) * H + h) * static_cast<int64_t>(K) + col;
      if constexpr (kOutputs) cp_async16_or_zero(&slot.q_hat[i][col], q + src, i < valid);
      cp_async16_or_zero(&slot.k_check[i][col], k + src, i < valid);
    }
    if (with_values) {
      constexpr int kValuePieces = kTile / 8;
      const bf16* vp = static_cast<const bf16*>(a.v);
#pragma unroll
      for (int r = 0; r < kChunk * kValuePieces / 32; ++r) {
        const int item = lane + 32 * r, i = item / kValuePieces, col = (item % kValuePieces) * 8;
        const int64_t src = (min64(row0 + i, last_row) * H + h) * static_cast<int64_t>(V) + v0 + col;
        cp_async16_or_zero(&slot.v[i][col], vp + src, i < valid);
      }
    }
    cp_async_commit();
  }
  if (lane < valid) beta = to_float(static_cast<const T*>(a.beta)[(row0 + lane) * H + h]);

  // g of every row (zeros past valid) and gamma = Gamma of the last real row.
  float g_rows[kStaged ? kChunk : 1][kCols] = {};
  float gamma[kCols] = {};
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    if (key_lane) {
      // Branch-free in the row (the address clamped to a real row, the value selected): a
      // branch per row made the compiler keep two copies of the rest of the prepare phase.
      float gi[kCols];
      load_vec(a.g + key_offset(i < valid ? i : valid - 1), gi);
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        gi[c] = i < valid ? gi[c] : 0.0f;
        gamma[c] += gi[c];
        if constexpr (kStaged) g_rows[i][c] = gi[c];
      }
    }
  }
  float decay_last[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    decay_last[c] = exp_ftz(gamma[c]);
    if (key_lane) slot.decay_last[c0 + c] = decay_last[c];
  }
  if constexpr (kStaged) {
    cp_async_wait<0>();
    __syncwarp();
  }

  // Q^, K^, K~, K_ row by row, Gamma accumulated from the chunk start.
  float cum[kCols] = {};
  auto prepare_row = [&](int i) {
    float gi[kCols] = {}, qi[kCols] = {}, ki[kCols] = {};
    if constexpr (kStaged) {
      if (key_lane) {
#pragma unroll
        for (int c = 0; c < kCols; c += 2) {
          gi[c] = g_rows[i][c], gi[c + 1] = g_rows[i][c + 1];
          const float2 kk = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&slot.k_check[i][c0 + c]));
          ki[c] = kk.x, ki[c + 1] = kk.y;
          if constexpr (kOutputs) {
            const float2 qq = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&slot.q_hat[i][c0 + c]));
            qi[c] = qq.x, qi[c + 1] = qq.y;
          }
        }
      }
    } else if (key_lane && i < valid) {
      load_vec(a.g + key_offset(i), gi);
      if constexpr (kOutputs) load_vec(q + key_offset(i), qi);
      load_vec(k + key_offset(i), ki);
    }
    float q_hat[kCols], k_hat[kCols], k_check[kCols], k_bar[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      cum[c] += gi[c];
      float up, down;
      exp_both(cum[c], up, down);
      q_hat[c] = a.scale * qi[c] * up;
      k_hat[c] = ki[c] * up;
      k_check[c] = ki[c] * down;
      k_bar[c] = ki[c] * (decay_last[c] * down);
    }
    if (key_lane) {
#pragma unroll
      for (int c = 0; c < kCols; c += 2) {
        if constexpr (kOutputs) {
          *reinterpret_cast<uint32_t*>(&slot.q_hat[i][c0 + c]) = pack_bf16(q_hat[c], q_hat[c + 1]);
        }
        *reinterpret_cast<uint32_t*>(&slot.w[i][c0 + c]) = pack_bf16(k_hat[c], k_hat[c + 1]);
        const uint32_t k_check_pair = pack_bf16(k_check[c], k_check[c + 1]);
        *reinterpret_cast<uint32_t*>(&slot.k_check[i][c0 + c]) = k_check_pair;
        *reinterpret_cast<uint32_t*>(&slot.k_walk[i][c0 + c]) =
            kGradients ? pack_bf16(k_bar[c], k_bar[c + 1]) : k_check_pair;
      }
    }
  };
  if constexpr (kStaged) {
#pragma unroll
    for (int i = 0; i < kChunk; ++i) prepare_row(i);  // whole: g_rows stays in registers
  } else {
#pragma unroll 4
    for (int i = 0; i < kChunk; ++i) prepare_row(i);
  }

  // fp32 inputs: this CTA's value columns (lane i < 16 holds row i's beta, loaded above).
  if constexpr (!kStaged) {
    if (with_values) {
      load_value_rows<T, kTile>(static_cast<const T*>(a.v), slot.v, row0, valid, h, H, V, v0, lane);
    }
  }

  __syncwarp();

  const FragmentOffsets f(lane);
  const int g = lane >> 2, t = lane & 3;

  // L and Aqk: [16 x K] x [K x 16], both against K~.
  float l_acc[2][4] = {}, a_acc[2][4] = {};
#pragma unroll
  for (int k0 = 0; k0 < K; k0 += 16) {
    uint32_t a_k[4], a_q[4], b[4];
    ldmatrix_x4(a_k, &slot.w[f.a_row][k0 + f.a_col]);
    ldmatrix_x4(b, &slot.k_check[f.b_row][k0 + f.b_col]);
    mma(l_acc[0], a_k, b[0], b[1]);
    mma(l_acc[1], a_k, b[2], b[3]);
    if constexpr (kOutputs) {
      ldmatrix_x4(a_q, &slot.q_hat[f.a_row][k0 + f.a_col]);
      mma(a_acc[0], a_q, b[0], b[1]);
      mma(a_acc[1], a_q, b[2], b[3]);
    }
  }
  const float beta_row[2] = {__shfl_sync(0xffffffffu, beta, g),
                             __shfl_sync(0xffffffffu, beta, g + 8)};
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = g + (e >> 1) * 8, j = n * 8 + 2 * t + (e & 1);
      slot.lower[i][j] = j < i ? beta_row[e >> 1] * l_acc[n][e] : 0.0f;
    }
#pragma unroll
    for (int half = 0; half < 2 && kOutputs; ++half) {
      const int i = g + half * 8, j = n * 8 + 2 * t;
      const float x0 = j <= i ? a_acc[n][2 * half] : 0.0f;
      const float x1 = j + 1 <= i ? a_acc[n][2 * half + 1] : 0.0f;
      *reinterpret_cast<uint32_t*>(&slot.a_qk[i][j]) = pack_bf16(x0, x1);
    }
  }
  __syncwarp();

  // M = (I + L)^-1 in fp32: lane c (mod 16) owns column c of M.
  {
    const int c = lane & 15;
    float m[kChunk];
    unit_lower_inverse_column([&](int i, int j) { return slot.lower[i][j]; }, c, m);
    if (lane < 16) {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) slot.m_beta[i][c] = __float2bfloat16_rn(m[i] * beta);
    }
    if constexpr (kGradients) {  // M itself, over L (every lane's reads of it done)
      __syncwarp();
      if (lane < 16) {
#pragma unroll
        for (int i = 0; i < kChunk; ++i) slot.m[i][c] = __float2bfloat16_rn(m[i]);
      }
    }
  }
  __syncwarp();

  // W = M Diag(beta) K^ (in place over K^, 16 columns at a time) and U = M Diag(beta) V.
  uint32_t a_m[4];
  ldmatrix_x4(a_m, &slot.m_beta[f.a_row][f.a_col]);
  w_columns_in_place<K / 16>(slot.w, a_m, 0, f, lane);
#pragma unroll
  for (int n0 = 0; n0 < kTile; n0 += 16) {
    if (!with_values) break;
    uint32_t b[4];
    ldmatrix_x4_trans(b, &slot.v[f.t_row][n0 + f.t_col]);
    float acc[2][4] = {};
    mma(acc[0], a_m, b[0], b[1]);
    mma(acc[1], a_m, b[2], b[3]);
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int col = n0 + n * 8 + 2 * t;
      *reinterpret_cast<float2*>(&slot.u[g][col]) = make_float2(acc[n][0], acc[n][1]);
      *reinterpret_cast<float2*>(&slot.u[g + 8][col]) = make_float2(acc[n][2], acc[n][3]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The whole-head walks (bf16, K = V = 128): kda.cu's kda_head_kernel (the forward, states and
// transition passes) and kda_backward.cu's kda_head_state_gradient_kernel (the reverse walk).
// One CTA of 16 warps per (sequence, head) walks a head's chunks with specialized warps
// (head_pipeline): 8 walking warps, each on 16 rows of the transposed state (or its gradient),
// and 4 preparing pairs at once. Pair p prepares the chunks p, p + 4, p + 8, ... of the walk's
// order (prepare_chunk_pair, each chunk once) into slot p of shared memory, from raw rows it
// staged there by cp.async, while the walkers walk the slots in order (kernels/JOURNAL.md,
// "Whole-head walk").
constexpr int kHeadWalkWarps = 8;
constexpr int kHeadPairs = 4;  // preparing pairs, one slot each
constexpr int kHeadWalkThreads = kHeadWalkWarps * 32;
constexpr int kHeadThreads = kHeadWalkThreads + kHeadPairs * 64;
constexpr int kHeadSlotThreads = kHeadWalkThreads + 64;  // a slot's barriers: the walkers and its pair

// One chunk's raw inputs, staged by its pair (rows past the end zeros).
template <int K, int V>
struct alignas(16) HeadStaging {
  bf16 q[kChunk][K + 8];
  bf16 k[kChunk][K + 8];
  bf16 v[kChunk][V + 8];
  float g[kChunk][K];
};

// What a walk reads of one prepared chunk (ChunkSlot without the prepare's own arrays; K~ once,
// for L, Aqk and the walk): the forward's U, or the reverse walk's dO (kGradients).
template <int K, int V, bool kGradients>
struct alignas(16) HeadSlot {
  bf16 q_hat[kChunk][K + 8];  // scale q e^Gamma
  bf16 w[kChunk][K + 8];      // K^ while preparing, then W = M Diag(beta) K^
  bf16 k_walk[kChunk][K + 8];   // forward: K~ = k e^-Gamma (L, Aqk, the state update); reverse: K_
  bf16 a_qk[kChunk][24];      // lower_incl_diagonal(Q^ K~^T)
  float decay_last[K];        // e^gamma
  float u[kGradients ? 1 : kChunk][V + 4];  // U = M Diag(beta) V (forward)
  bf16 v[kGradients ? kChunk : 1][V + 8];   // dO (reverse walk)
  bf16 m[kGradients ? kChunk : 1][24];      // M (reverse walk: dVb^T = dV'^T M)
};

// The prepare's own arrays, one set per pair.
template <int K, bool kGradients>
struct alignas(16) PrepareScratch {
  bf16 k_check[kGradients ? kChunk : 1][K + 8];  // K~ for L and Aqk (reverse walk: k_walk is K_)
  bf16 m_beta[kChunk][24];          // M Diag(beta)
  float lower[kChunk][kChunk + 1];  // L = Diag(beta) strictly_lower(K^ K~^T)
};

// 191 KB (forward: with each walking warp's O staged for 16-byte stores) and 182 KB (reverse
// walk) at K = V = 128.
template <int K, int V, bool kGradients>
struct HeadShared {
  HeadSlot<K, V, kGradients> slot[kHeadPairs];
  PrepareScratch<K, kGradients> scratch[kHeadPairs];
  HeadStaging<K, V> staging[kHeadPairs];
  float stage[kGradients ? 1 : kHeadWalkWarps][kChunk * 20];
};

// Whether the current device gives a CTA the whole-head kernels' shared memory (191 KB at
// K = V = 128: sm_90; an A100's 163 KB does not): the callers fall back to the 64-column CTAs.
template <int K, int V>
bool head_walk_fits() {
  int device = 0, optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return static_cast<size_t>(optin) >= std::max(sizeof(HeadShared<K, V, false>), sizeof(HeadShared<K, V, true>));
}

// Named barriers (barrier 0 is __syncthreads): slot s's "full" and "empty", and each pair's own.
static_assert(1 + 3 * kHeadPairs <= 16, "named barriers: 16 per CTA");
__device__ __forceinline__ int full_barrier(int slot) { return 1 + slot; }
__device__ __forceinline__ int empty_barrier(int slot) { return 1 + kHeadPairs + slot; }
__device__ __forceinline__ int preparing_pair_barrier(int pair) { return 1 + 2 * kHeadPairs + pair; }
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Barrier `id` of the 64 threads of a pair of warps.
__device__ __forceinline__ void pair_barrier(int id) {
  asm volatile("bar.sync %0, 64;\n" ::"r"(id) : "memory");
}

// The specialized-warp pipeline over `count` chunks in walk order (i = 0, 1, ...; the caller maps
// i to a chunk). Walking warps (0-7): walk(slot, i) for every i in order, each once slot i % 4 is
// full. Pair p (warps 8 + 2p, 9 + 2p): load(i) issues chunk i's raw rows into its staging (one
// cp.async group), prepare(slot, i) makes chunk i's slot from them, for i = p, p + 4, ...; the
// next chunk's rows are loaded while the walkers walk the three chunks between. Slot p's "full"
// barrier: the pair arrives, the walkers wait; its "empty": the walkers arrive (only where the pair
// will wait, so every arrival is matched), the pair waits before preparing its next chunk there.
// A pair owns its slot, so a barrier always joins the same warps.
template <typename Walk, typename Load, typename Prepare>
__device__ __forceinline__ void head_pipeline(int64_t count, int warp, Walk&& walk, Load&& load, Prepare&& prepare) {
  if (warp < kHeadWalkWarps) {
    for (int64_t i = 0; i < count; ++i) {
      const int slot = static_cast<int>(i % kHeadPairs);
      named_barrier_sync(full_barrier(slot), kHeadSlotThreads);
      walk(slot, i);
      if (i + kHeadPairs < count) named_barrier_arrive(empty_barrier(slot), kHeadSlotThreads);
    }
    return;
  }
  const int pair = (warp - kHeadWalkWarps) >> 1;
  if (pair < count) load(pair);
  for (int64_t i = pair; i < count; i += kHeadPairs) {
    cp_async_wait<0>();
    __syncwarp();
    if (i >= kHeadPairs) named_barrier_sync(empty_barrier(pair), kHeadSlotThreads);
    prepare(pair, i);
    named_barrier_arrive(full_barrier(pair), kHeadSlotThreads);
    // Each member read only its own half of the staging: its next loads may go there now.
    if (i + kHeadPairs < count) load(i + kHeadPairs);
  }
}

// Rows [0, 16) of a chunk of a [rows, H, kWidth] tensor (head_row: the [rows, H] index of its
// first row), member p's half of the columns, into `rows` (row stride kRow) by 16-byte cp.async;
// rows past `valid` are zero-filled (their address: the last real row's). A lane's column is the
// same in every row it loads, so only the row moves: one pointer, plus row x stride.
template <int kWidth, int kRow, typename E>
__device__ __forceinline__ void stage_half_rows(E (*rows)[kRow], const E* x, int64_t head_row, int heads, int valid,
                                                int p, int lane) {
  constexpr int kPer = 16 / static_cast<int>(sizeof(E));  // elements a piece
  constexpr int kPieces = kWidth / 2 / kPer;                // pieces of a half row
  static_assert(32 % kPieces == 0, "a lane's column is the same in every row it loads");
  const int col = p * (kWidth / 2) + (lane % kPieces) * kPer;
  const E* base = x + head_row * kWidth + col;
  const int64_t stride = static_cast<int64_t>(heads) * kWidth;
#pragma unroll
  for (int r = 0; r < kChunk * kPieces / 32; ++r) {
    const int i = (lane + 32 * r) / kPieces;
    cp_async16_or_zero(&rows[i][col], base + min(i, valid - 1) * stride, i < valid);
  }
}

// The loads of one chunk's half (member p of its pair): key and value columns [64p, 64p + 64)
// of q (with outputs), k, v and g into its staging, by cp.async, in four parts (0: q and beta,
// 1: k, 2: v, 3: g and the commit; one cp.async group). Both callers now issue the four at once
// (a preparing pair, right after its prepare); the parts are what the alternating 8-warp walk
// spread over the chunks it walked. Folding them into one call changes the machine code of
// three kernels (scripts/same_sass.py), so it waits for a GPU run.
// beta (member 0, lanes 0-15) goes to a register.
// `values`: v for the forward, dO for the backward's reverse walk ([*, H, V] bf16 either way).
template <int K, int V, bool kOutputs>
__device__ __forceinline__ void issue_head_loads(const ChunkedArgs& a, const bf16* values,
                                                 HeadStaging<K, V>& st, int64_t row0, int valid,
                                                 int h, int p, int lane, int part, float& beta,
                                                 bool with_values = true) {
  const int64_t head_row = row0 * a.heads + h;  // [rows, H] index of the chunk's first row
  constexpr int kRowK = K + 8, kRowV = V + 8;
  if (part == 0) {
    if constexpr (kOutputs) stage_half_rows<K, kRowK>(st.q, static_cast<const bf16*>(a.q), head_row, a.heads, valid, p, lane);
    beta = p == 0 && lane < valid ? __bfloat162float(static_cast<const bf16*>(a.beta)[(row0 + lane) * a.heads + h]) : 0.0f;
  } else if (part == 1) {
    stage_half_rows<K, kRowK>(st.k, static_cast<const bf16*>(a.k), head_row, a.heads, valid, p, lane);
  } else if (part == 2) {
    if (!with_values) return;  // the A_seg columns of the transition pass: no values
    stage_half_rows<V, kRowV>(st.v, values, head_row, a.heads, valid, p, lane);
  } else {
    stage_half_rows<K, K>(st.g, a.g, head_row, a.heads, valid, p, lane);
    cp_async_commit();
  }
}

// The prepare phase of one chunk by a pair of warps (member p; `barrier`: the pair's named
// barrier), from its staging (complete: each member waited for its own loads), into its slot:
// what the walk reads (Q^, W, K~, Aqk, U, e^gamma) into `slot`, the prepare's own arrays (L,
// M Diag(beta)) into `scratch`. The operations are
// prepare_chunk's, split by columns. kGradients (the backward's reverse walk): the staged values
// are dO, copied to slot.v for the walk instead of making U.
template <int K, int V, bool kOutputs, bool kGradients, typename Slot, typename Scratch>
__device__ __forceinline__ void prepare_chunk_pair(const ChunkedArgs& a, Slot& slot, Scratch& scratch,
                                                   const HeadStaging<K, V>& st, int barrier, int p,
                                                   float beta, int lane, bool with_values = true) {
  const int c0 = p * (K / 2) + 2 * lane;  // this lane's two key columns
  // K~ for L and Aqk: the walk's operand in the forward; the reverse walk's is K_ (k_walk), which
  // needs e^gamma in the rows, hence a first pass over g there.
  bf16 (*k_tilde)[K + 8] = nullptr;
  if constexpr (kGradients) k_tilde = scratch.k_check; else k_tilde = slot.k_walk;
  float decay_last[2] = {};
  if constexpr (kGradients) {
    float gamma[2] = {};
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const float2 gi = *reinterpret_cast<const float2*>(&st.g[i][c0]);
      gamma[0] += gi.x, gamma[1] += gi.y;
    }
    decay_last[0] = exp_ftz(gamma[0]), decay_last[1] = exp_ftz(gamma[1]);
  }
  float cum[2] = {};
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    const float2 gi = *reinterpret_cast<const float2*>(&st.g[i][c0]);
    const float2 ki = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&st.k[i][c0]));
    float2 qi = make_float2(0.0f, 0.0f);
    if constexpr (kOutputs) qi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&st.q[i][c0]));
    const float g2[2] = {gi.x, gi.y}, k2[2] = {ki.x, ki.y}, q2[2] = {qi.x, qi.y};
    float q_hat[2], k_hat[2], k_check[2], k_bar[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      cum[j] += g2[j];
      float up, down;
      exp_both(cum[j], up, down);
      q_hat[j] = a.scale * q2[j] * up;
      k_hat[j] = k2[j] * up;
      k_check[j] = k2[j] * down;
      k_bar[j] = k2[j] * (decay_last[j] * down);
    }
    if constexpr (kOutputs) *reinterpret_cast<uint32_t*>(&slot.q_hat[i][c0]) = pack_bf16(q_hat[0], q_hat[1]);
    *reinterpret_cast<uint32_t*>(&slot.w[i][c0]) = pack_bf16(k_hat[0], k_hat[1]);
    *reinterpret_cast<uint32_t*>(&k_tilde[i][c0]) = pack_bf16(k_check[0], k_check[1]);
    if constexpr (kGradients) *reinterpret_cast<uint32_t*>(&slot.k_walk[i][c0]) = pack_bf16(k_bar[0], k_bar[1]);
  }
  // e^gamma: Gamma of the last row (rows past the end add zeros; the first pass's sum, bit for bit).
  *reinterpret_cast<float2*>(&slot.decay_last[c0]) = make_float2(exp_ftz(cum[0]), exp_ftz(cum[1]));
  pair_barrier(barrier);

  const FragmentOffsets f(lane);
  const int g = lane >> 2, t = lane & 3;
  if (p == 0) {
    // L = Diag(beta) strictly_lower(K^ K~^T), then M = (I + L)^-1 (lane c owns column c).
    float l_acc[2][4] = {};
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += 16) {
      uint32_t a_k[4], b[4];
      ldmatrix_x4(a_k, &slot.w[f.a_row][k0 + f.a_col]);
      ldmatrix_x4(b, &k_tilde[f.b_row][k0 + f.b_col]);
      mma(l_acc[0], a_k, b[0], b[1]);
      mma(l_acc[1], a_k, b[2], b[3]);
    }
    const float beta_row[2] = {__shfl_sync(0xffffffffu, beta, g), __shfl_sync(0xffffffffu, beta, g + 8)};
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = g + (e >> 1) * 8, j = n * 8 + 2 * t + (e & 1);
        scratch.lower[i][j] = j < i ? beta_row[e >> 1] * l_acc[n][e] : 0.0f;
      }
    }
    __syncwarp();
    const int col = lane & 15;
    float m[kChunk];
    unit_lower_inverse_column([&](int i, int j) { return scratch.lower[i][j]; }, col, m);
    if (lane < 16) {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        scratch.m_beta[i][col] = __float2bfloat16_rn(m[i] * beta);
        if constexpr (kGradients) slot.m[i][col] = __float2bfloat16_rn(m[i]);
      }
    }
  } else if constexpr (kOutputs) {
    // Aqk = lower_incl_diagonal(Q^ K~^T).
    float a_acc[2][4] = {};
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += 16) {
      uint32_t a_q[4], b[4];
      ldmatrix_x4(a_q, &slot.q_hat[f.a_row][k0 + f.a_col]);
      ldmatrix_x4(b, &k_tilde[f.b_row][k0 + f.b_col]);
      mma(a_acc[0], a_q, b[0], b[1]);
      mma(a_acc[1], a_q, b[2], b[3]);
    }
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = g + half * 8, j = n * 8 + 2 * t;
        const float x0 = j <= i ? a_acc[n][2 * half] : 0.0f;
        const float x1 = j + 1 <= i ? a_acc[n][2 * half + 1] : 0.0f;
        *reinterpret_cast<uint32_t*>(&slot.a_qk[i][j]) = pack_bf16(x0, x1);
      }
    }
  }
  pair_barrier(barrier);

  // W = M Diag(beta) K^ (in place over K^) and U = M Diag(beta) V, on this member's columns.
  uint32_t a_m[4];
  ldmatrix_x4(a_m, &scratch.m_beta[f.a_row][f.a_col]);
  w_columns_in_place<K / 32>(slot.w, a_m, p * (K / 2), f, lane);
  if constexpr (kGradients) {
    // dO for the walk; zeros without values (the A' columns of the reverse walk's transition pass).
#pragma unroll
    for (int r = 0; r < kChunk * (V / 2 / 8) / 32; ++r) {
      const int item = lane + 32 * r, i = item / (V / 2 / 8), col = p * (V / 2) + (item % (V / 2 / 8)) * 8;
      *reinterpret_cast<uint4*>(&slot.v[i][col]) =
          with_values ? *reinterpret_cast<const uint4*>(&st.v[i][col]) : make_uint4(0, 0, 0, 0);
    }
  } else if (with_values) {
#pragma unroll
    for (int n0 = p * (V / 2); n0 < (p + 1) * (V / 2); n0 += 16) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, &st.v[f.t_row][n0 + f.t_col]);
      float acc[2][4] = {};
      mma(acc[0], a_m, b[0], b[1]);
      mma(acc[1], a_m, b[2], b[3]);
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const int col = n0 + n * 8 + 2 * t;
        *reinterpret_cast<float2*>(&slot.u[g][col]) = make_float2(acc[n][0], acc[n][1]);
        *reinterpret_cast<float2*>(&slot.u[g + 8][col]) = make_float2(acc[n][2], acc[n][3]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// A warp's 16 rows of a transposed state as bf16 rows of K in global memory (the backward's
// chunk states and their gradients): out[(row0 + g (+8)) * K + c] for the accumulator layout
// state[j][e] (rows g, g + 8; columns 8j + 2t, +1). Each quad (the 4 lanes of one g) transposes
// its packed pairs 4 x 4 (quad_transpose, mma.cuh), so that lane t writes columns 8j .. 8j + 7 for
// the j = t mod 4 as one 16-byte store: 2 K / 32 stores a lane instead of K / 4 of 4 bytes (whose
// 8-row strips half fill every 32-byte sector).
template <int K>
__device__ __forceinline__ void store_state_rows(bf16* out, const float (&state)[K / 8][4], int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int m = 0; m < K / 32; ++m) {
      uint32_t r[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) r[i] = pack_bf16(state[4 * m + i][2 * half], state[4 * m + i][2 * half + 1]);
      quad_transpose(r, t);
      const int j = 4 * m + t;  // this lane's 8 columns: 8j .. 8j + 7 of row g (+8)
      *reinterpret_cast<uint4*>(out + static_cast<int64_t>(g + 8 * half) * K + 8 * j) = make_uint4(r[0], r[1], r[2], r[3]);
    }
  }
}

}  // namespace

// The segment scan of context parallelism (kda.cu), for the backward's reverse walk too:
// states[0] = initial (zeros when nullptr), states[p + 1] = A_p states[p] + B_p for p = 0..P-2,
// A_p^T at transition_a + ((n (P - 1) + p) H + h) K K, B_p at transition_b + (...) K V, states
// [N, P, H, K, V], all fp32.
cudaError_t launch_kda_segment_scan(int64_t key_dim, const float* initial, const float* transition_a,
                                    const float* transition_b, float* states, int64_t batch, int heads,
                                    int value_dim, int segments, cudaStream_t stream);

}  // namespace odyssey::kernels
