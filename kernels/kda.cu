// KDA chunked forward and decode step (contract: kernels/kda.h; math: MODEL.md, "Incremental
// attention"). Design notes and the performance ladder: kernels/README.md.
//
// Chunked forward. One CTA of 4 warps per (sequence, head, 64 value columns); when K or V is 32,
// one CTA of 2 warps per (sequence, head, 32 value columns) (Walk, walk_tile in kda_chunk.cuh).
// Each warp keeps 16 rows of the transposed state S^T [V, K] in fp32 mma accumulators for the
// whole sequence (64 registers at K = 128, 16 at K = 32), so that S^T is directly the A operand
// of the next chunk's products (an m16n8 accumulator pair is an m16k16 A fragment, as in
// FlashAttention-2). Chunks of 16 tokens are processed in groups of one chunk per warp (4, or 2):
//   prepare  (parallel) warp w prepares chunk w of the group alone: Gamma, Q^, K^, K~,
//            L and Aqk (mma), M = (I + L)^-1 (fp32 forward substitution), W = M Diag(beta) K^,
//            U = M Diag(beta) V (mma), written to its slot in shared memory;
//   walk     (serial)   all warps walk the group's chunks in order, each on its 16 state rows:
//            V'^T = U^T - S^T W^T,  O^T = S^T Q^^T + V'^T Aqk^T,
//            S^T = (S^T + V'^T K~) Diag(e^gamma)   (= S^T Diag(e^gamma) + V'^T K_, K_ = K~ Diag(e^gamma)).
// Two CTAs of 4 warps fit on an SM (108.8 KB of shared memory each at K = 128), so one CTA's
// global loads in the prepare phase overlap the other's walk; the 2-warp CTAs are smaller
// (22.9 KB and ~140 registers at K = V = 32: 6-7 per SM, bound by registers).
//
// Whole heads (bf16, K = V = 128, KdaChunkedOptions::head_walk, the default): kda_head_kernel, one
// CTA of 16 warps per (sequence, head) for the forward, states and transition passes: 8 walk the
// state while 4 pairs prepare the next chunks (prepare_chunk_pair, kda_chunk.cuh), each chunk once,
// from raw rows staged in shared memory; bit for bit the 64-column CTAs' results (1.56 ms against
// 3.31 at B=2 T=16K H=64).
//
// Context parallelism (few long chains; kda.h): the same kernel in Pass::kTransition walks each
// segment's [A_seg | B_seg] from [I | 0] without outputs, kda_segment_scan_kernel chains the
// segments in fp32, and Pass::kForward walks every segment from its start state. Pass::kStates is
// the forward's walk without outputs that stores the state entering every chunk (bf16) for the
// backward (kda_backward.cu); Pass::kForwardStates the forward's walk that also stores them (a
// training step's forward keeping them for its backward: KdaChunkedOptions::chunk_states with o).
#include "kernels/kda.h"

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/kda_chunk.cuh"

namespace odyssey::kernels {
namespace {

// A hint, no data movement the kernel depends on: bring this CTA's input rows [row0, row0 + rows)
// (q unless only transitions, k, g, its value columns unless without values, beta) into L2, so
// that the next prepare phase, which is bound by the latency of its global loads, finds them
// there. Issued by all threads while the current group is walked; one instruction per 128-byte
// line (each row's slice of a tensor is a whole number of aligned lines, or the aligned half of
// one: 32 bf16 columns).
template <typename T, int K, int kTile, bool kOutputs>
__device__ void prefetch_rows(const ChunkedArgs& a, int64_t row0, int rows, int h, int v0,
                              bool with_values) {
  constexpr int kKeyLines = (K * static_cast<int>(sizeof(T)) + 127) / 128;  // q, k
  constexpr int kGateLines = (K * static_cast<int>(sizeof(float)) + 127) / 128;
  constexpr int kValueLines = (kTile * static_cast<int>(sizeof(T)) + 127) / 128;
  constexpr int kPerRow = 2 * kKeyLines + kGateLines + kValueLines + 1;
  const int H = a.heads, V = a.value_dim;
  for (int item = threadIdx.x; item < rows * kPerRow; item += Walk<kTile>::kThreads) {
    const int64_t r = row0 + item / kPerRow;
    int line = item % kPerRow;
    const char* p;
    if (line < kKeyLines) {
      if (!kOutputs) continue;
      p = reinterpret_cast<const char*>(static_cast<const T*>(a.q) + (r * H + h) * K) + 128 * line;
    } else if ((line -= kKeyLines) < kKeyLines) {
      p = reinterpret_cast<const char*>(static_cast<const T*>(a.k) + (r * H + h) * K) + 128 * line;
    } else if ((line -= kKeyLines) < kGateLines) {
      p = reinterpret_cast<const char*>(a.g + (r * H + h) * K) + 128 * line;
    } else if ((line -= kGateLines) < kValueLines) {
      if (!with_values) continue;
      p = reinterpret_cast<const char*>(static_cast<const T*>(a.v) + (r * H + h) * V + v0) +
          128 * line;
    } else {
      p = reinterpret_cast<const char*>(static_cast<const T*>(a.beta) + r * H + h);
    }
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
  }
}

// The walk over one prepared chunk, by one warp on its 16 rows of S^T (state[K / 8][4]: n-tile
// j holds S^T[v_row + g (+8)][8j + 2t (+1)]). Writes the chunk's O for this warp's 16 value
// columns through `stage` (this warp's private shared memory). Without kOutputs (transition
// pass) only the state is updated; without values (A_seg columns) U is taken as zero.
// kKeepValues (the passes that keep chunk states): V' of this warp's 16 value columns into
// a.new_values, where given.
template <typename T, int K, int kTile, bool kOutputs, bool kKeepValues = false, typename Slot = ChunkSlot<K, kTile>>
__device__ void walk_chunk(const ChunkedArgs& a, const Slot& slot,
                           float (&state)[K / 8][4], float* stage, int64_t row0, int valid,
                           int h, int v_col, bool with_values, int lane) {
  const FragmentOffsets f(lane);
  const int g = lane >> 2, t = lane & 3;

  // X^T = S^T W^T and P^T = S^T Q^^T, with S^T rounded to bf16 as the A operand.
  float x[2][4] = {}, p[2][4] = {};
#pragma unroll
  for (int k0 = 0; k0 < K; k0 += 16) {
    const int j = k0 / 8;
    const uint32_t s[4] = {pack_bf16(state[j][0], state[j][1]),
                           pack_bf16(state[j][2], state[j][3]),
                           pack_bf16(state[j + 1][0], state[j + 1][1]),
                           pack_bf16(state[j + 1][2], state[j + 1][3])};
    uint32_t bw[4], bq[4];
    ldmatrix_x4(bw, &slot.w[f.b_row][k0 + f.b_col]);
    mma(x[0], s, bw[0], bw[1]);
    mma(x[1], s, bw[2], bw[3]);
    if constexpr (kOutputs) {
      ldmatrix_x4(bq, &slot.q_hat[f.b_row][k0 + f.b_col]);
      mma(p[0], s, bq[0], bq[1]);
      mma(p[1], s, bq[2], bq[3]);
    }
  }

  // V'^T = U^T - X^T, as the A operand of the two products that follow.
  const int v_local = v_col % kTile;  // this warp's first value column within the CTA tile
  float vn[2][4];
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = n * 8 + 2 * t + (e & 1), vr = v_local + g + (e >> 1) * 8;
      vn[n][e] = (with_values ? slot.u[i][vr] : 0.0f) - x[n][e];
    }
  }
  const uint32_t va[4] = {pack_bf16(vn[0][0], vn[0][1]), pack_bf16(vn[0][2], vn[0][3]),
                          pack_bf16(vn[1][0], vn[1][1]), pack_bf16(vn[1][2], vn[1][3])};
  if constexpr (kKeepValues) {
    if (a.new_values != nullptr) {
      bf16* out = static_cast<bf16*>(a.new_values) + (row0 * a.heads + h) * static_cast<int64_t>(a.value_dim) + v_col;
      store_transposed_tile(out, static_cast<int64_t>(a.heads) * a.value_dim, va, valid, lane);
    }
  }

  // O^T = P^T + V'^T Aqk^T.
  if constexpr (kOutputs) {
    uint32_t b[4];
    ldmatrix_x4(b, &slot.a_qk[f.b_row][f.b_col]);
    mma(p[0], va, b[0], b[1]);
    mma(p[1], va, b[2], b[3]);
  }

  // O through shared memory: stage[i][v] (stride 20 floats), then 16-byte rows to global.
  if constexpr (kOutputs) {
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        stage[(n * 8 + 2 * t + (e & 1)) * 20 + g + (e >> 1) * 8] = p[n][e];
      }
    }
    __syncwarp();
    {
      const int i = lane >> 1, half = lane & 1;
      if (i < valid) {
        T* o = static_cast<T*>(a.o) +
               ((row0 + i) * a.heads + h) * static_cast<int64_t>(a.value_dim) + v_col + half * 8;
        store8(o, &stage[i * 20 + half * 8]);
      }
    }
    __syncwarp();
  }

  // S^T = S^T Diag(e^gamma) + V'^T K_ = (S^T + V'^T K~) Diag(e^gamma), as K_ = K~ Diag(e^gamma):
  // the prepare makes K~ for L and Aqk anyway, and the decay's multiplies are the same.
#pragma unroll
  for (int n0 = 0; n0 < K; n0 += 16) {
    uint32_t b[4];
    ldmatrix_x4_trans(b, &slot.k_walk[f.t_row][n0 + f.t_col]);
    mma(state[n0 / 8], va, b[0], b[1]);
    mma(state[n0 / 8 + 1], va, b[2], b[3]);
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int j = n0 / 8 + n;
      const float2 d = *reinterpret_cast<const float2*>(&slot.decay_last[8 * j + 2 * t]);
      state[j][0] *= d.x, state[j][1] *= d.y, state[j][2] *= d.x, state[j][3] *= d.y;
    }
  }
}

// The state entering chunk `chunk` of sequence `seq` (this warp's 16 rows of S^T, as bf16) into
// a.chunk_states [N, H, ceil(chunks / i), V, K] (transposed: row = value column, K contiguous),
// when the chunk is one of every i = a.state_interval (chunks 0, i, 2i, ...; a warp-uniform skip).
template <int K>
__device__ __forceinline__ void store_chunk_state(const ChunkedArgs& a, const float (&state)[K / 8][4],
                                                  int seq, int h, int64_t chunk, int v_col,
                                                  int lane) {
  const int interval = a.state_interval;
  if (chunk % interval != 0) return;
  const int64_t stored = ((a.length + kChunk - 1) / kChunk + interval - 1) / interval;
  bf16* base = static_cast<bf16*>(a.chunk_states) +
               ((static_cast<int64_t>(seq) * a.heads + h) * stored + chunk / interval) * a.value_dim * K;
  store_state_rows<K>(base + static_cast<int64_t>(v_col) * K, state, lane);
}

// A segment's first token within its sequence: segment 0 holds first_segment_length tokens, every
// other segment_length (the last may hold fewer). Segments are whole chunks.
__device__ __forceinline__ int64_t segment_begin(const ChunkedArgs& a, int segment) {
  return segment == 0 ? 0 : a.first_segment_length + (segment - 1) * a.segment_length;
}

// The rows a walk covers: sequence seq of a packed batch (cu_seqlens), or segment `segment` of
// sequence seq (the whole sequence when there is one segment).
__device__ __forceinline__ void walk_rows(const ChunkedArgs& a, int seq, int segment, int64_t& row0,
                                          int64_t& length) {
  if (a.cu_seqlens) {
    row0 = a.cu_seqlens[seq];
    length = a.cu_seqlens[seq + 1] - a.cu_seqlens[seq];
  } else {
    const int64_t begin = segment_begin(a, segment);
    row0 = seq * a.length + begin;
    length = min64(segment == 0 ? a.first_segment_length : a.segment_length, a.length - begin);
  }
}

// Which (sequence, segment) grid z stands for: every segment in the forward and states passes
// (1..P-1 when the lead walked segment 0 in the transition pass), 0..P-2 in the transition pass.
template <bool kForward>
__device__ __forceinline__ void walk_segment(const ChunkedArgs& a, int& seq, int& segment) {
  const int first = kForward && a.lead ? 1 : 0;
  const int per_sequence = kForward ? a.segments - first : a.segments - 1;
  seq = blockIdx.z / per_sequence;
  segment = first + blockIdx.z % per_sequence;
}

// The state tile a walk starts from: the forward's start state (0 without one); the transition
// pass's [I | 0] (A_seg's columns from I, B_seg's from 0).
template <int K, bool kForward>
__device__ __forceinline__ void walk_start_tile(float (&state)[K / 8][4], const float* start,
                                                int64_t start_offset, int V, int v_col,
                                                bool a_columns, int lane) {
  if constexpr (kForward) {
    load_state_tile<K>(state, start, start_offset, V, v_col, lane);
  } else {
    transition_start_tile<K>(state, v_col, a_columns, lane);
  }
}

// Where a walk's state goes at its end: the final state (the last segment of the forward), or the
// segment's transition pair (A_seg transposed, B_seg) for kda_segment_scan_kernel.
template <int K, bool kForward>
__device__ __forceinline__ void walk_end_tile(const ChunkedArgs& a, const float (&state)[K / 8][4],
                                              int64_t state_offset, int seq, int segment, int h,
                                              int V, int v_col, bool a_columns, int lane) {
  if constexpr (kForward) {
    if (segment == a.segments - 1) {
      store_state_tile<K>(a.final_state, state_offset, state, V, v_col, lane);
    } else if (segment == 0 && a.lead) {  // the lead: segment 1's start state, for the scan
      const int64_t start = ((static_cast<int64_t>(seq) * a.segments + 1) * a.heads + h) * K * V;
      store_state_tile<K>(a.lead_states, start, state, V, v_col, lane);
    }
  } else {
    const int64_t pair = (static_cast<int64_t>(seq) * (a.segments - 1) + segment) * a.heads + h;
    store_transition_tile<K>(a, state, pair, V, v_col, a_columns, lane);
  }
}

// kTile value columns per CTA (Walk: kTile / 16 warps, groups of kTile / 16 chunks).
// Forward: grid (V / kTile, H, N * P); CTA (tile x, h, z = sequence * P + segment) walks its
// segment from the initial state (P = 1) or the segment's state (P > 1), writing o and, for the
// last segment, final_state.
// Transition: grid (K / kTile + V / kTile, H, N * (P - 1)); tiles x < K / kTile are kTile columns
// of A_seg (state starts at I, values zero), the others kTile columns of B_seg (state starts at 0).
// With the lead, segment 0's CTAs x < V / kTile walk it forward instead (kLead: kForward, or
// kStates / kForwardStates when chunk states are kept), and the forward pass's grid z covers
// segments 1..P-1.
template <typename T, int K, int kTile, Pass kPass>
__device__ __forceinline__ void chunked_walk(const ChunkedArgs& a, int seq, int segment, int x) {
  // kForward: walks from the initial or segment state (the forward and the state recompute);
  // kOutputs: also Q^, Aqk and o (the forward only).
  constexpr bool kForward = kPass != Pass::kTransition;
  constexpr bool kOutputs = pass_writes_outputs(kPass);
  constexpr int kWarps = Walk<kTile>::kWarps;
  static_assert(K % kTile == 0 || kForward, "the transition pass tiles K too");
  extern __shared__ __align__(16) unsigned char shared_raw[];
  ChunkSlot<K, kTile>* slots = reinterpret_cast<ChunkSlot<K, kTile>*>(shared_raw);

  const int lane = threadIdx.x & 31, warp = warp_index();
  const int h = blockIdx.y;
  const int H = a.heads, V = a.value_dim;
  const bool a_columns = !kForward && x < K / kTile;  // A_seg columns (transition)
  const bool with_values = !a_columns;
  const int v0 = (kForward || a_columns ? x : x - K / kTile) * kTile;
  int64_t row0, length;
  walk_rows(a, seq, segment, row0, length);
  const int v_col = v0 + warp * 16;  // this warp's first value column (A_seg column)

  // S^T rows v_col + g (+8), columns 8j + 2t (+1); S is [K, V] per (sequence, head).
  const int64_t state_offset = (static_cast<int64_t>(seq) * H + h) * K * V;
  const float* start = a.initial_state;
  int64_t start_offset = state_offset;
  if (kForward && a.segment_states != nullptr) {
    start = a.segment_states;
    start_offset = ((static_cast<int64_t>(seq) * a.segments + segment) * H + h) * K * V;
  }
  float state[K / 8][4];
  walk_start_tile<K, kForward>(state, start, start_offset, V, v_col, a_columns, lane);

  const int64_t num_chunks = (length + kChunk - 1) / kChunk;
  // This segment's first chunk within the sequence (segments are whole chunks).
  const int64_t chunk_base = a.cu_seqlens ? 0 : segment_begin(a, segment) / kChunk;
  for (int64_t group = 0; group < num_chunks; group += kWarps) {
    const int64_t mine = group + warp;
    if (mine < num_chunks) {
      const int valid = static_cast<int>(min64(kChunk, length - mine * kChunk));
      prepare_chunk<T, K, kTile, kOutputs>(a, slots[warp], row0 + mine * kChunk, valid, h, v0,
                                           with_values, lane);
    }
    __syncthreads();
    if (a.prefetch && group + kWarps < num_chunks) {
      const int64_t next = (group + kWarps) * kChunk;
      prefetch_rows<T, K, kTile, kOutputs>(
          a, row0 + next, static_cast<int>(min64(kWarps * kChunk, length - next)), h, v0,
          with_values);
    }
    const int count = static_cast<int>(min64(kWarps, num_chunks - group));
    float* stage = reinterpret_cast<float*>(&slots[warp].k_check[0][0]);
    for (int s = 0; s < count; ++s) {
      const int64_t chunk = group + s;
      const int valid = static_cast<int>(min64(kChunk, length - chunk * kChunk));
      if constexpr (pass_keeps_states(kPass)) {
        store_chunk_state<K>(a, state, seq, h, chunk_base + chunk, v_col, lane);
      }
      walk_chunk<T, K, kTile, kOutputs, pass_keeps_states(kPass)>(a, slots[s], state, stage, row0 + chunk * kChunk,
                                                                  valid, h, v_col, with_values, lane);
    }
    __syncthreads();
  }

  walk_end_tile<K, kForward>(a, state, state_offset, seq, segment, h, V, v_col, a_columns, lane);
}

template <typename T, int K, int kTile, Pass kPass, Pass kLead = kPass>
__global__ void __launch_bounds__(Walk<kTile>::kThreads, 2)
    kda_chunked_kernel(const ChunkedArgs a) {
  int seq, segment;
  walk_segment<kPass != Pass::kTransition>(a, seq, segment);
  if constexpr (kLead != kPass) {
    if (segment == 0) {  // the lead: segment 0 forward, one CTA per value tile
      if (blockIdx.x < a.value_dim / kTile) chunked_walk<T, K, kTile, kLead>(a, seq, 0, blockIdx.x);
      return;
    }
  }
  chunked_walk<T, K, kTile, kPass>(a, seq, segment, blockIdx.x);
}

template <typename T, int K, int kTile, Pass kPass, Pass kLead = kPass>
cudaError_t launch_chunked(const ChunkedArgs& a, dim3 grid, cudaStream_t stream) {
  constexpr size_t shared = chunked_shared_bytes<K, kTile>();
  auto* kernel = kda_chunked_kernel<T, K, kTile, kPass, kLead>;
  // Set on every launch: the attribute belongs to the current device, and costs ~1 us.
  const cudaError_t configured =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
  if (configured != cudaSuccess) return configured;
  // As much shared memory as the SM has (two CTAs of 108.8 KB must fit).
  const cudaError_t carveout = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                                    cudaSharedmemCarveoutMaxShared);
  if (carveout != cudaSuccess) return carveout;
  kernel<<<grid, Walk<kTile>::kThreads, shared, stream>>>(a);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Whole-head forward (bf16, K = V = 128; KdaChunkedOptions::head_walk). With 64-column CTAs the
// two CTAs of a head each prepare every chunk (Q^, K~, K_, L, Aqk, M, W: all of the key side),
// and the prepare, not the walk, is most of the time. Here one CTA owns the whole head and
// prepares each chunk once, with specialized warps (head_pipeline, kda_chunk.cuh): 8 walking
// warps (16 rows of S^T each) and 4 preparing pairs at once (warp 2p + m of a pair takes key and
// value columns [64m, 64m + 64), the L product (m = 0) or the Aqk product (m = 1), and m = 0 the
// forward substitution). Every value is computed by the same operations in the same order as in
// the 64-column CTAs: the results are bit for bit theirs.
// Ladder (B=2, T=16K, H=64; kernels/README.md): 64-column CTAs 3.31 ms; whole heads with 8 warps
// that alternated between preparing a group of 4 chunks (a pair each) and walking it 1.95 ms;
// specialized warps 1.56 ms (with 2 preparing pairs: 2.05, with 3: 1.80).
// Grid (1, H, N * P): CTA (h, z = sequence * P + segment) walks its segment from the initial or
// segment state, as kda_chunked_kernel's forward and states passes do with 64-column CTAs.
template <int K, int V, Pass kPass>
__device__ __forceinline__ void head_walk(const ChunkedArgs& a, int seq, int segment, bool a_columns) {
  // kForward: walks from the initial or segment state (the forward and the states pass); the
  // transition pass: CTA x = 0 walks the K columns of A_seg from I without values, x = 1 the V
  // columns of B_seg from 0 (grid (2, H, N (P - 1))).
  constexpr bool kForward = kPass != Pass::kTransition;
  constexpr bool kOutputs = pass_writes_outputs(kPass);
  static_assert(kForward || K == V, "the transition pass's two CTAs walk K and V columns with one shape");
  using T = bf16;
  using Shared = HeadShared<K, V, /*kGradients=*/false>;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  Shared& sh = *reinterpret_cast<Shared*>(shared_raw);

  const int lane = threadIdx.x & 31, warp = warp_index();
  const int h = blockIdx.y;
  const int H = a.heads;
  const bool with_values = !a_columns;
  int64_t row0, length;
  walk_rows(a, seq, segment, row0, length);
  const int64_t num_chunks = (length + kChunk - 1) / kChunk;
  auto valid_rows = [&](int64_t chunk) { return static_cast<int>(min64(kChunk, length - chunk * kChunk)); };

  // Walking warps: 16 rows of S^T.
  const bool walker = warp < kHeadWalkWarps;
  const int v_col = warp * 16;
  const int64_t state_offset = (static_cast<int64_t>(seq) * H + h) * K * V;
  const int64_t chunk_base = a.cu_seqlens ? 0 : segment_begin(a, segment) / kChunk;
  float state[K / 8][4];
  if (walker) {
    const float* start = a.initial_state;
    int64_t start_offset = state_offset;
    if (kForward && a.segment_states != nullptr) {
      start = a.segment_states;
      start_offset = ((static_cast<int64_t>(seq) * a.segments + segment) * H + h) * K * V;
    }
    walk_start_tile<K, kForward>(state, start, start_offset, V, v_col, a_columns, lane);
  }
  // Preparing pairs.
  const int pair = (warp - kHeadWalkWarps) >> 1, member = warp & 1;
  float beta = 0.0f;  // the staged chunk's beta (member 0, lanes 0-15)

  head_pipeline(
      num_chunks, warp,
      [&](int slot, int64_t chunk) {
        if constexpr (pass_keeps_states(kPass)) store_chunk_state<K>(a, state, seq, h, chunk_base + chunk, v_col, lane);
        walk_chunk<T, K, V, kOutputs, pass_keeps_states(kPass)>(a, sh.slot[slot], state, sh.stage[warp],
                                                                row0 + chunk * kChunk, valid_rows(chunk), h, v_col,
                                                                with_values, lane);
      },
      [&](int64_t chunk) {
        for (int part = 0; part < 4; ++part) {
          issue_head_loads<K, V, kOutputs>(a, static_cast<const bf16*>(a.v), sh.staging[pair], row0 + chunk * kChunk,
                                           valid_rows(chunk), h, member, lane, part, beta, with_values);
        }
      },
      [&](int slot, int64_t) {
        prepare_chunk_pair<K, V, kOutputs, /*kGradients=*/false>(a, sh.slot[slot], sh.scratch[pair], sh.staging[pair],
                                                                preparing_pair_barrier(pair), member, beta, lane,
                                                                with_values);
      });

  if (walker) walk_end_tile<K, kForward>(a, state, state_offset, seq, segment, h, V, v_col, a_columns, lane);
}

// With the lead (kLead != kPass: the transition pass), segment 0's CTA x = 0 walks it forward
// (kForward, or kStates / kForwardStates when chunk states are kept) and x = 1 has nothing to do.
template <int K, int V, Pass kPass, Pass kLead = kPass>
__global__ void __launch_bounds__(kHeadThreads, 1) kda_head_kernel(const ChunkedArgs a) {
  int seq, segment;
  walk_segment<kPass != Pass::kTransition>(a, seq, segment);
  if constexpr (kLead != kPass) {
    if (segment == 0) {
      if (blockIdx.x == 0) head_walk<K, V, kLead>(a, seq, 0, false);
      return;
    }
  }
  head_walk<K, V, kPass>(a, seq, segment, kPass == Pass::kTransition && blockIdx.x == 0);
}

template <int K, int V, Pass kPass, Pass kLead = kPass>
cudaError_t launch_head(const ChunkedArgs& a, dim3 grid, cudaStream_t stream) {
  constexpr size_t shared = sizeof(HeadShared<K, V, false>);
  auto* kernel = kda_head_kernel<K, V, kPass, kLead>;
  const cudaError_t configured =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
  if (configured != cudaSuccess) return configured;
  kernel<<<grid, kHeadThreads, shared, stream>>>(a);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Segment scan of context parallelism: S_start[0] = initial state (or 0), S_start[p + 1] =
// A_p S_start[p] + B_p, in fp32 on CUDA cores; with the lead, S_start[1] is already in
// segment_states (segment 0's walk stored it) and the scan starts there (first = 1).
// One CTA of K threads per (sequence, head, 4 value columns): thread i owns row i of the 4
// columns, whose S_start[p] is shared through shared memory. A_p is stored transposed (A_p^T[j][i]
// at j * K + i) and copied into shared memory by cp.async kDepth - 1 steps before its use (kDepth
// buffers), B_p's rows into registers one step before; so the serial chain waits on neither.
// (CTAs of 2 or 4 groups of 4 columns, each reading A_p once for more columns, were slower: the
// FMAs, not L2, bound a step; kernels/JOURNAL.md, "Context parallelism".)
constexpr int kScanColumns = 4;

// next[c] += sum over j of A[i][j] S[j][c] (c = 0..3): a(j) = A[i][j], x(j) = S[j][c..c+3], both in
// shared memory. Four partial sums over the quarters of j, each an fmaf chain, added pairwise at
// the end: one chain of K fmaf waited on each load's latency (~30 cycles a j, 1.9 us a step at
// K = 128, most of the scan's time); four chains give the loads four times the work to hide
// behind.
template <int K, typename LoadA, typename LoadX>
__device__ __forceinline__ void scan_step_products(float4& next, LoadA&& a_of, LoadX&& x_of) {
  constexpr int kParts = 4, kQuarter = K / kParts;
  float4 part[kParts];
#pragma unroll
  for (int q = 0; q < kParts; ++q) part[q] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
  for (int u = 0; u < kQuarter; ++u) {
#pragma unroll
    for (int q = 0; q < kParts; ++q) {
      const float a = a_of(q * kQuarter + u);
      const float4 x = x_of(q * kQuarter + u);
      part[q].x = fmaf(a, x.x, part[q].x);
      part[q].y = fmaf(a, x.y, part[q].y);
      part[q].z = fmaf(a, x.z, part[q].z);
      part[q].w = fmaf(a, x.w, part[q].w);
    }
  }
  next.x += (part[0].x + part[1].x) + (part[2].x + part[3].x);
  next.y += (part[0].y + part[1].y) + (part[2].y + part[3].y);
  next.z += (part[0].z + part[1].z) + (part[2].z + part[3].z);
  next.w += (part[0].w + part[1].w) + (part[2].w + part[3].w);
}

template <int K, int kDepth>
constexpr size_t scan_shared_bytes() {
  return (kDepth * K * K + K * kScanColumns) * sizeof(float);
}

template <int K, int kDepth>
__global__ void __launch_bounds__(K) kda_segment_scan_kernel(const float* initial_state,
                                                                      const float* transition_a,
                                                                      const float* transition_b,
                                                                      float* segment_states, int heads,
                                                                      int value_dim, int segments, int first) {
  extern __shared__ __align__(16) unsigned char scan_raw[];
  float* a_shared = reinterpret_cast<float*>(scan_raw);  // [kDepth][K * K]: A_p^T, A_{p+1}^T, ...
  float* column = a_shared + kDepth * K * K;             // [K][4]: S_start[p], this CTA's columns
  const int i = threadIdx.x, h = blockIdx.y, seq = blockIdx.z;
  const int v0 = blockIdx.x * kScanColumns;
  const int H = heads, V = value_dim, P = segments;
  const int64_t head = static_cast<int64_t>(seq) * H + h;
  auto pair = [&](int p) { return (static_cast<int64_t>(seq) * (P - 1) + p) * H + h; };
  auto fetch = [&](int p) {  // A_p^T into buffer p % kDepth, 16 bytes per copy, coalesced (none past P - 2)
    if (p < P - 1) {
      const float* from = transition_a + pair(p) * K * K;
      float* to = a_shared + (p % kDepth) * K * K;
      for (int x = 4 * i; x < K * K; x += 4 * K) cp_async16(to + x, from + x);
    }
    cp_async_commit();  // one group a fetch, empty or not: the wait below counts them
  };
  auto load_b = [&](int p) { return *reinterpret_cast<const float4*>(&transition_b[pair(p) * K * V + i * V + v0]); };

  float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (first > 0) {
    s = *reinterpret_cast<const float4*>(&segment_states[((static_cast<int64_t>(seq) * P + first) * H + h) * K * V + i * V + v0]);
  } else if (initial_state) {
    s = *reinterpret_cast<const float4*>(&initial_state[head * K * V + i * V + v0]);
  }
  float4 b = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (first < P - 1) b = load_b(first);
  for (int d = 0; d < kDepth - 1; ++d) fetch(first + d);
  for (int p = first;; ++p) {
    const int64_t pair_state = ((static_cast<int64_t>(seq) * P + p) * H + h) * K * V;
    *reinterpret_cast<float4*>(&segment_states[pair_state + i * V + v0]) = s;
    if (p == P - 1) break;
    float4 next = b;
    *reinterpret_cast<float4*>(&column[i * kScanColumns]) = s;
    if (p + 1 < P - 1) b = load_b(p + 1);  // used in the next step
    fetch(p + kDepth - 1);  // its buffer was last read in step p - 1, before that step's final barrier
    cp_async_wait<kDepth - 1>();
    __syncthreads();  // A_p^T and the columns of S_start[p] are in shared memory
    const float* a_t = a_shared + (p % kDepth) * K * K;
    scan_step_products<K>(
        next, [&](int j) { return a_t[j * K + i]; },  // A_p[i][j]
        [&](int j) { return *reinterpret_cast<const float4*>(&column[j * kScanColumns]); });
    s = next;
    __syncthreads();  // everyone is done with A_p^T's buffer and the columns
  }
}

template <int K, int kDepth>
cudaError_t launch_segment_scan_with(const ChunkedArgs& a, float* segment_states, int64_t batch,
                                     cudaStream_t stream) {
  constexpr size_t shared = scan_shared_bytes<K, kDepth>();
  auto* kernel = kda_segment_scan_kernel<K, kDepth>;
  const cudaError_t configured =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
  if (configured != cudaSuccess) return configured;
  const dim3 grid(static_cast<unsigned>(a.value_dim / kScanColumns), static_cast<unsigned>(a.heads),
                  static_cast<unsigned>(batch));
  kernel<<<grid, K, shared, stream>>>(a.initial_state, a.transition_a, a.transition_b, segment_states,
                                                a.heads, a.value_dim, a.segments, a.lead ? 1 : 0);
  return cudaGetLastError();
}

// A^T fetched two steps ahead (three buffers, 194 KB at K = 128) where the device gives a CTA
// that much shared memory, one step ahead otherwise. Measured on an H200 at B=1 T=64K H=4, P=34:
// 0.061 ms with three buffers, 0.069 with two (kernels/JOURNAL.md, "Context parallelism").
template <int K>
cudaError_t launch_segment_scan(const ChunkedArgs& a, float* segment_states, int64_t batch,
                                cudaStream_t stream) {
  int device = 0, optin = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error == cudaSuccess) error = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (error != cudaSuccess) return error;
  if (static_cast<size_t>(optin) >= scan_shared_bytes<K, 3>()) {
    return launch_segment_scan_with<K, 3>(a, segment_states, batch, stream);
  }
  return launch_segment_scan_with<K, 2>(a, segment_states, batch, stream);
}

// ---------------------------------------------------------------------------------------------
// Decode step: one CTA per (sequence, head, 32 value columns); lane = value column, warp w holds
// the state rows w, w + 4, ... (K / 4 of them: 8 at K = 32) in registers between the read and
// the write-back.

constexpr int kDecodeColumns = 32;
constexpr int kDecodeWarps = 4;

template <typename T, int K>
__global__ void __launch_bounds__(kDecodeWarps * 32)
    kda_decode_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                      const float* __restrict__ g, const T* __restrict__ beta,
                      float* __restrict__ state, T* __restrict__ o, int heads, int value_dim,
                      float scale) {
  __shared__ float key[K], query[K], decay[K];
  __shared__ float partial_r[kDecodeWarps][kDecodeColumns], partial_o[kDecodeWarps][kDecodeColumns];
  __shared__ float delta_shared[kDecodeColumns];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int v0 = blockIdx.x * kDecodeColumns, h = blockIdx.y, seq = blockIdx.z;
  const int64_t head = static_cast<int64_t>(seq) * heads + h;
  for (int i = threadIdx.x; i < K; i += blockDim.x) {
    key[i] = to_float(k[head * K + i]);
    query[i] = scale * to_float(q[head * K + i]);
    decay[i] = exp_ftz(g[head * K + i]);
  }
  __syncthreads();

  constexpr int kRows = K / kDecodeWarps;
  float* column = state + head * K * value_dim + v0 + lane;
  float s[kRows];
  float r = 0.0f, read = 0.0f;  // partial S~^T k and S~^T q' over this warp's rows
#pragma unroll
  for (int j = 0; j < kRows; ++j) s[j] = column[static_cast<int64_t>(warp + kDecodeWarps * j) * value_dim];
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    const int i = warp + kDecodeWarps * j;
    s[j] *= decay[i];
    r += key[i] * s[j];
    read += query[i] * s[j];
  }
  partial_r[warp][lane] = r;
  partial_o[warp][lane] = read;
  __syncthreads();

  if (warp == 0) {
    float kq = 0.0f;
    for (int i = lane; i < K; i += 32) kq += key[i] * query[i];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) kq += __shfl_xor_sync(0xffffffffu, kq, offset);
    float r_all = 0.0f, read_all = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) r_all += partial_r[w][lane], read_all += partial_o[w][lane];
    const float delta =
        to_float(beta[head]) * (to_float(v[head * value_dim + v0 + lane]) - r_all);
    o[head * value_dim + v0 + lane] = from_float<T>(read_all + delta * kq);
    delta_shared[lane] = delta;
  }
  __syncthreads();

  const float delta = delta_shared[lane];
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    const int i = warp + kDecodeWarps * j;
    column[static_cast<int64_t>(i) * value_dim] = s[j] + key[i] * delta;
  }
}

template <typename T, int K>
cudaError_t launch_decode(const void* q, const void* k, const void* v, const float* g,
                          const void* beta, float* state, void* o, int64_t batch, int64_t heads,
                          int64_t value_dim, float scale, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(value_dim / kDecodeColumns),
                  static_cast<unsigned>(heads), static_cast<unsigned>(batch));
  kda_decode_kernel<T, K><<<grid, kDecodeWarps * 32, 0, stream>>>(
      static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), g,
      static_cast<const T*>(beta), state, static_cast<T*>(o), static_cast<int>(heads),
      static_cast<int>(value_dim), scale);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Context parallelism: when and how finely to split (kda.h).

constexpr int64_t kContextParallelMinLength = 4096;  // automatic: shorter sequences walk serially
constexpr int64_t kContextParallelMinSegment = 256;  // automatic: at least this many tokens each
constexpr int64_t kContextParallelMinSegments = 4;   // automatic: fewer do not pay for ~3 passes

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Whole-head context parallelism: a transition CTA's time per chunk against a forward CTA's, both
// with the GPU full (no Q^, Aqk or outputs; A_seg's CTA no values), measured on an H200 at B=1
// T=64K H=4 (kernels/JOURNAL.md, "Context parallelism"): sizes the lead.
constexpr double kTransitionCost = 0.72;

struct SegmentPlan {
  int64_t segment_length;        // tokens per segment after the first (the last may be shorter)
  int64_t segments;              // P; 1 = the serial walk
  int64_t first_segment_length;  // segment 0's tokens
  bool lead;                     // segment 0 is walked forward in the transition pass (kda.h)
};

// whole_heads: the walks take one CTA per (sequence, head) (kda_head_kernel), so the automatic
// plan is theirs: P - 1 = SMs / chains segments after the lead fill one wave of the forward pass,
// and the lead is as long as the transition pass's waves of segment walks take (kTransitionCost).
SegmentPlan plan_segments(bool packed, int64_t batch, int64_t length, int64_t heads,
                          int64_t key_dim, int64_t value_dim, int64_t requested,
                          int64_t requested_lead, bool whole_heads) {
  const SegmentPlan serial{length, 1, length, false};
  if (packed || requested < 0 || length == 0 || batch < 1 || heads < 1) return serial;
  int64_t segment = requested, lead = requested_lead > 0 ? requested_lead : 0;
  if (requested == 0) {
    if (length < kContextParallelMinLength) return serial;
    int device = 0, sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      (void)cudaGetLastError();
      return serial;
    }
    if (whole_heads && requested_lead == 0) {
      const int64_t chains = batch * heads;
      const int64_t after_lead = sms / chains;  // segments 1..P-1: one forward CTA each per head
      if (after_lead + 1 < kContextParallelMinSegments) return serial;
      // The transition pass: two CTAs per (segment 1..P-2, head) and the lead's.
      const int64_t waves = ceil_div((2 * after_lead - 1) * chains, sms);
      const double ratio = static_cast<double>(waves) * kTransitionCost;  // the lead against a segment
      const double chunks = static_cast<double>(ceil_div(length, kChunk));
      segment = static_cast<int64_t>(std::ceil(chunks / (static_cast<double>(after_lead) + ratio))) * kChunk;
      if (segment < kContextParallelMinSegment) segment = kContextParallelMinSegment;
      lead = static_cast<int64_t>(std::lround(ratio * static_cast<double>(segment / kChunk))) * kChunk;
    } else {
      // Chains walked serially, one CTA each; about 8 walking warps per SM (2 CTAs of 4 warps, as
      // measured with 64 columns; 4 of 2 warps with 32) is what fills the GPU.
      const int64_t tile = walk_tile(key_dim, value_dim);
      const int64_t chains = batch * heads * (value_dim / tile);
      const int64_t wanted = 2 * (64 / tile) * static_cast<int64_t>(sms) / chains;
      if (wanted < kContextParallelMinSegments) return serial;
      const int64_t group = Walk<64>::kWarps * kChunk;  // whole groups of chunks for either CTA
      segment = ceil_div(ceil_div(length, wanted), group) * group;
      if (segment < kContextParallelMinSegment) segment = kContextParallelMinSegment;
    }
  }
  const int64_t first = lead > 0 ? lead : segment;
  if (first >= length) return serial;
  const int64_t segments = 1 + ceil_div(length - first, segment);
  if (batch * segments > 65535) return serial;
  return {segment, segments, first, lead > 0};
}

// Whether the walks take whole heads (kda_head_kernel) for these inputs: ChunkedArgs::head_walk,
// decided once per call, for the plan and for every launch of run_chunked.
bool walks_whole_heads(KdaDtype dtype, int64_t key_dim, int64_t value_dim, const KdaChunkedOptions& options) {
  return dtype == KdaDtype::kBFloat16 && key_dim == 128 && value_dim == 128 && options.head_walk &&
         head_walk_fits<128, 128>();
}

SegmentPlan plan_segments(bool packed, int64_t batch, int64_t length, int64_t heads, int64_t key_dim,
                          int64_t value_dim, const KdaChunkedOptions& options, bool whole_heads) {
  return plan_segments(packed, batch, length, heads, key_dim, value_dim, options.segment_length,
                       options.lead_length, whole_heads);
}

// The workspace of the context-parallel path: segment states [N, P, H, K, V], then A_seg^T
// [N, P - 1, H, K, K], then B_seg [N, P - 1, H, K, V], each 256-byte aligned.
struct WorkspaceLayout {
  size_t states = 0, transition_a = 0, transition_b = 0, bytes = 0;
  WorkspaceLayout(const SegmentPlan& plan, int64_t batch, int64_t heads, int64_t key,
                  int64_t value) {
    if (plan.segments <= 1) return;
    auto aligned = [](size_t n) { return (n + 255) / 256 * 256; };
    const size_t f = sizeof(float);
    const size_t pairs = static_cast<size_t>(batch * heads);
    transition_a = aligned(pairs * plan.segments * key * value * f);
    transition_b = transition_a + aligned(pairs * (plan.segments - 1) * key * key * f);
    bytes = transition_b + aligned(pairs * (plan.segments - 1) * key * value * f);
  }
};

template <typename T, int K, int kTile>
cudaError_t run_chunked(ChunkedArgs a, const SegmentPlan& plan, unsigned char* workspace,
                        const WorkspaceLayout& layout, int64_t batch, int64_t heads,
                        int64_t value_dim, cudaStream_t stream) {
  const unsigned h = static_cast<unsigned>(heads), n = static_cast<unsigned>(batch);
  const unsigned v_tiles = static_cast<unsigned>(value_dim / kTile);
  // With chunk_states: the same walk storing every chunk's entering state, without outputs (the
  // backward's state recompute, o nullptr) or with them (a training step's forward).
  const bool keep_states = a.chunk_states != nullptr, outputs = a.o != nullptr;
  // The walk's pass as a type, for the launchers' template arguments.
  auto with_walk_pass = [&](auto launch) {
    using Forward = std::integral_constant<Pass, Pass::kForward>;
    using States = std::integral_constant<Pass, Pass::kStates>;
    using ForwardStates = std::integral_constant<Pass, Pass::kForwardStates>;
    return !keep_states ? launch(Forward{}) : outputs ? launch(ForwardStates{}) : launch(States{});
  };
  // The forward and states passes of bf16 K = V = 128 heads: one CTA of 8 warps per head.
  auto walk = [&](unsigned z) {
    return with_walk_pass([&](auto pass) -> cudaError_t {
      constexpr Pass kPass = decltype(pass)::value;
      if constexpr (std::is_same_v<T, bf16> && K == 128 && kTile == 64) {
        if (a.head_walk) return launch_head<K, 128, kPass>(a, dim3(1, h, z), stream);
      }
      return launch_chunked<T, K, kTile, kPass>(a, dim3(v_tiles, h, z), stream);
    });
  };
  if (plan.segments == 1) return walk(n);

  const unsigned p = static_cast<unsigned>(plan.segments);
  float* states = reinterpret_cast<float*>(workspace + layout.states);
  a.segment_length = plan.segment_length;
  a.first_segment_length = plan.first_segment_length;
  a.segments = static_cast<int>(plan.segments);
  a.lead = plan.lead;
  a.lead_states = plan.lead ? states : nullptr;
  a.transition_a = reinterpret_cast<float*>(workspace + layout.transition_a);
  a.transition_b = reinterpret_cast<float*>(workspace + layout.transition_b);
  // The transition pass (segments 0..P-2; with the lead, segment 0 walked forward instead).
  auto transitions = [&](auto lead) -> cudaError_t {
    constexpr Pass kLead = decltype(lead)::value;
    if constexpr (std::is_same_v<T, bf16> && K == 128 && kTile == 64) {
      // Whole heads: one CTA for A_seg, one for B_seg (where the device gives them their shared memory).
      if (a.head_walk) {
        return launch_head<K, 128, Pass::kTransition, kLead>(a, dim3(2, h, n * (p - 1)), stream);
      }
    }
    return launch_chunked<T, K, kTile, Pass::kTransition, kLead>(a, dim3(K / kTile + v_tiles, h, n * (p - 1)),
                                                                 stream);
  };
  // The lead walks segment 0 with the walk's own pass.
  using NoLead = std::integral_constant<Pass, Pass::kTransition>;
  cudaError_t error = !plan.lead ? transitions(NoLead{}) : with_walk_pass(transitions);
  if (error != cudaSuccess) return error;
  if (!plan.lead || p > 2) {  // with the lead and P = 2, segment 1's start is the lead's end state
    error = launch_segment_scan<K>(a, states, batch, stream);
    if (error != cudaSuccess) return error;
  }
  a.segment_states = states;
  return walk(n * (plan.lead ? p - 1 : p));
}

bool chunked_sizes_supported(int64_t batch, int64_t length, int64_t heads, int64_t key_dim,
                             int64_t value_dim) {
  return head_width_supported(key_dim) && head_width_supported(value_dim) && batch >= 0 &&
         length >= 0 && heads >= 1 && batch <= 65535 && heads <= 65535;
}

}  // namespace

size_t kda_chunked_forward_workspace_bytes(KdaDtype dtype, bool packed, int64_t batch, int64_t length,
                                           int64_t heads, int64_t key_dim, int64_t value_dim,
                                           const KdaChunkedOptions& options) {
  if (!chunked_sizes_supported(batch, length, heads, key_dim, value_dim) ||
      (options.segment_length > 0 && options.segment_length % kChunk != 0) ||
      (options.lead_length > 0 && options.lead_length % kChunk != 0)) {
    return 0;
  }
  const SegmentPlan plan = plan_segments(packed, batch, length, heads, key_dim, value_dim, options,
                                         walks_whole_heads(dtype, key_dim, value_dim, options));
  return WorkspaceLayout(plan, batch, heads, key_dim, value_dim).bytes;
}

cudaError_t kda_chunked_forward(KdaDtype dtype, const void* q, const void* k, const void* v,
                                const float* g, const void* beta, const float* initial_state,
                                void* o, float* final_state, const int32_t* cu_seqlens,
                                int64_t batch, int64_t length, int64_t heads, int64_t key_dim,
                                int64_t value_dim, float scale, cudaStream_t stream) {
  return kda_chunked_forward(dtype, q, k, v, g, beta, initial_state, o, final_state, cu_seqlens,
                             batch, length, heads, key_dim, value_dim, scale,
                             KdaChunkedOptions{}, stream);
}

cudaError_t kda_chunked_forward(KdaDtype dtype, const void* q, const void* k, const void* v,
                                const float* g, const void* beta, const float* initial_state,
                                void* o, float* final_state, const int32_t* cu_seqlens,
                                int64_t batch, int64_t length, int64_t heads, int64_t key_dim,
                                int64_t value_dim, float scale, const KdaChunkedOptions& options,
                                cudaStream_t stream) {
  if (!chunked_sizes_supported(batch, length, heads, key_dim, value_dim) ||
      (options.segment_length > 0 && options.segment_length % kChunk != 0) ||
      (options.lead_length > 0 && options.lead_length % kChunk != 0)) {
    return cudaErrorInvalidValue;
  }
  if (batch == 0) return cudaSuccess;
  if (final_state == nullptr) return cudaErrorInvalidValue;
  if (length == 0) {
    // No tokens: the state passes through unchanged (empty tensors may have null pointers).
    const size_t bytes = static_cast<size_t>(batch) * static_cast<size_t>(heads) *
                         static_cast<size_t>(key_dim) * static_cast<size_t>(value_dim) * sizeof(float);
    if (initial_state == nullptr) return cudaMemsetAsync(final_state, 0, bytes, stream);
    if (initial_state == final_state) return cudaSuccess;
    return cudaMemcpyAsync(final_state, initial_state, bytes, cudaMemcpyDeviceToDevice, stream);
  }
  if (q == nullptr || k == nullptr || v == nullptr || g == nullptr || beta == nullptr ||
      (o == nullptr && options.chunk_states == nullptr) ||
      (options.chunk_states != nullptr && cu_seqlens != nullptr) ||
      (options.chunk_state_interval != 1 && options.chunk_state_interval != 2 && options.chunk_state_interval != 4) ||
      (options.new_values != nullptr &&
       (options.chunk_states == nullptr || reinterpret_cast<uintptr_t>(options.new_values) % 16 != 0))) {
    return cudaErrorInvalidValue;
  }
  const bool whole_heads = walks_whole_heads(dtype, key_dim, value_dim, options);
  const SegmentPlan plan =
      plan_segments(cu_seqlens != nullptr, batch, length, heads, key_dim, value_dim, options, whole_heads);
  const WorkspaceLayout layout(plan, batch, heads, key_dim, value_dim);
  unsigned char* workspace = static_cast<unsigned char*>(options.workspace);
  bool allocated = false;
  if (layout.bytes > 0) {
    if (workspace == nullptr) {
      const cudaError_t error = cudaMallocAsync(reinterpret_cast<void**>(&workspace), layout.bytes, stream);
      if (error != cudaSuccess) return error;
      allocated = true;
    } else if (options.workspace_bytes < layout.bytes ||
               reinterpret_cast<uintptr_t>(workspace) % 16 != 0) {
      return cudaErrorInvalidValue;
    }
  }
  ChunkedArgs a{};
  a.q = q, a.k = k, a.v = v, a.beta = beta, a.g = g, a.initial_state = initial_state;
  a.o = o, a.final_state = final_state, a.cu_seqlens = cu_seqlens, a.length = length;
  a.heads = static_cast<int>(heads), a.value_dim = static_cast<int>(value_dim), a.scale = scale;
  a.segment_length = length, a.first_segment_length = length, a.segments = 1;
  a.lead = false, a.lead_states = nullptr;
  a.prefetch = options.prefetch;
  a.head_walk = whole_heads;
  a.chunk_states = options.chunk_states;
  a.state_interval = options.chunk_state_interval;
  a.new_values = options.new_values;
  cudaError_t error =
      with_walk_types(dtype, key_dim, value_dim, [&](auto type, auto key, auto tile) {
        return run_chunked<typename decltype(type)::type, key(), tile()>(
            a, plan, workspace, layout, batch, heads, value_dim, stream);
      });
  if (allocated) {
    const cudaError_t freed = cudaFreeAsync(workspace, stream);
    if (error == cudaSuccess) error = freed;
  }
  return error;
}

cudaError_t launch_kda_segment_scan(int64_t key_dim, const float* initial, const float* transition_a,
                                    const float* transition_b, float* states, int64_t batch, int heads,
                                    int value_dim, int segments, cudaStream_t stream) {
  ChunkedArgs a{};
  a.initial_state = initial;
  a.transition_a = const_cast<float*>(transition_a), a.transition_b = const_cast<float*>(transition_b);
  a.heads = heads, a.value_dim = value_dim, a.segments = segments, a.lead = false;
  return with_head_width(key_dim, [&](auto key) { return launch_segment_scan<key()>(a, states, batch, stream); });
}

cudaError_t kda_decode_step(KdaDtype dtype, const void* q, const void* k, const void* v,
                            const float* g, const void* beta, float* state, void* o,
                            int64_t batch, int64_t heads, int64_t key_dim, int64_t value_dim,
                            float scale, cudaStream_t stream) {
  if (!head_width_supported(key_dim) || value_dim < kDecodeColumns ||
      value_dim % kDecodeColumns != 0 || value_dim > 256 || batch < 0 || heads < 1 ||
      batch > 65535 || heads > 65535) {
    return cudaErrorInvalidValue;
  }
  if (batch == 0) return cudaSuccess;
  return with_element_type(dtype, [&](auto type) {
    return with_head_width(key_dim, [&](auto key) {
      return launch_decode<typename decltype(type)::type, key()>(q, k, v, g, beta, state, o, batch,
                                                                 heads, value_dim, scale, stream);
    });
  });
}

}  // namespace odyssey::kernels
