#include "model/attention.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <exception>
#include <limits>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/version.h>

#include "model/precision.h"

namespace odyssey::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::ScalarType compute_dtype(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void check_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "attention: q, k, v must be [B, H, T, D]; got ranks ", q.dim(), ", ", k.dim(),
              ", ", v.dim());
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0),
              "attention: batch sizes differ: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(v.size(1) == k.size(1) && v.size(2) == k.size(2),
              "attention: k ", k.sizes(), " and v ", v.sizes(), " differ in heads or tokens");
  TORCH_CHECK(k.size(1) >= 1 && q.size(1) % k.size(1) == 0, "attention: key heads ", k.size(1),
              " must divide query heads ", q.size(1));
  TORCH_CHECK(k.size(3) == q.size(3), "attention: q width ", q.size(3), " != k width ",
              k.size(3));
}

// The query heads that share one key/value head are folded into the rows of one matrix:
// q [B, Hq, Tq, D] -> [B, Hk, (Hq/Hk)*Tq, D], row r at position r % Tq (+ causal offset).
at::Tensor fold_queries(const at::Tensor& q, int64_t kv_heads) {
  return q.reshape({q.size(0), kv_heads, (q.size(1) / kv_heads) * q.size(2), q.size(3)});
}

// The range of query positions (relative to k[0]) held by folded rows [r0, r1).
struct RowTile {
  int64_t r0, rows;
  int64_t min_pos, max_pos;
  int64_t key_tile;  // keys per score tile: the tile holds about block² scores
};

RowTile row_tile(int64_t r0, int64_t r1, int64_t tq, int64_t offset, int64_t block) {
  const bool wraps = (r1 - 1) / tq != r0 / tq;  // spans the end of one head and the next
  const int64_t lo = wraps ? 0 : r0 % tq;
  const int64_t hi = wraps ? tq - 1 : (r1 - 1) % tq;
  return {r0, r1 - r0, lo + offset, hi + offset, std::max(block, block * block / (r1 - r0))};
}

// True where key c0 + j lies in the future of row tile's row i: [rows, c1 - c0].
at::Tensor future_mask(const RowTile& t, int64_t c0, int64_t c1, int64_t tq, int64_t offset,
                       const at::Device& device) {
  const auto idx = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor pos = at::arange(t.r0, t.r0 + t.rows, idx).remainder_(tq).add_(offset);
  const at::Tensor keys = at::arange(c0, c1, idx);
  return keys.unsqueeze(0) > pos.unsqueeze(1);
}

// 0 until first read, then set_cpu_attention_threads' count, or ODYSSEY_ATTENTION_THREADS, or 1.
std::atomic<int> g_cpu_attention_threads{0};

// tiles [0, tiles) split into `workers` contiguous ranges, the first on this thread, the others on
// threads of their own; an exception in any is rethrown here after all have finished.
template <typename F>
void run_tiles_on_threads(int64_t tiles, int64_t workers, const F& run_tiles) {
  const int64_t per = (tiles + workers - 1) / workers;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(workers));
  std::vector<std::thread> threads;
  for (int64_t w = 1; w < workers; ++w) {
    threads.emplace_back([&, w] {
      try {
        run_tiles(std::min(tiles, w * per), std::min(tiles, (w + 1) * per));
      } catch (...) {
        errors[static_cast<size_t>(w)] = std::current_exception();
      }
    });
  }
  try {
    run_tiles(0, std::min(tiles, per));
  } catch (...) {
    errors[0] = std::current_exception();
  }
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// Folded q [B, G, R, D], k [B, G, Tk, D], v [B, G, Tk, Dv]; writes o [B, G, R, Dv] (zeros on
// entry, compute dtype) and returns the log-sum-exp of each row's scaled scores [B, G, R, 1]
// (finite for every row, also one that sees no key). No autograd.
at::Tensor flash_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         at::Tensor& o, int64_t tq, int64_t offset, double scale, int64_t block,
                         at::ScalarType cdt) {
  const int64_t B = q.size(0), G = q.size(1), R = q.size(2), tk = k.size(2);
  const auto opts = q.options().dtype(cdt);
  const double lowest = cdt == at::kDouble ? std::numeric_limits<double>::lowest()
                                           : double(std::numeric_limits<float>::lowest());
  const double neg_inf = -std::numeric_limits<double>::infinity();
  // With the max subtracted, every row that sees a key has running sum >= 1 (its max term is
  // exp(0)); rows that see none keep 0. clamp_min(1) therefore only touches the latter.
  at::Tensor lse = at::empty({B, G, R, 1}, opts);
  // Row tiles are independent (each writes its own rows of o and lse). On the CPU they run in
  // parallel, each thread taking whole tiles with single-threaded ops inside (one parallel region
  // per call instead of one per small op), so the result is the same whatever the thread count.
  const int64_t tiles = (R + block - 1) / block;
  const at::ThreadLocalState caller;  // grad mode and the like, the same in every worker thread
  auto run_tiles = [&](int64_t first, int64_t last) {
    const at::ThreadLocalStateGuard same_state(caller);
    for (int64_t r0 = first * block; r0 < std::min(R, last * block); r0 += block) {
      const RowTile t = row_tile(r0, std::min(R, r0 + block), tq, offset, block);
      const int64_t key_end = std::min(tk, t.max_pos + 1);
      // Wider key tiles on the CPU: a quarter of the small ops per score (a 256 x 1024 tile is
      // 1 MB of fp32 scores, still in a core's L2).
      const int64_t key_tile = q.is_cpu() ? 4 * t.key_tile : t.key_tile;
      const at::Tensor qs = q.narrow(2, r0, t.rows).to(cdt) * scale;
      at::Tensor m = at::full({B, G, t.rows, 1}, lowest, opts);
      at::Tensor l = at::zeros({B, G, t.rows, 1}, opts);
      at::Tensor acc = o.narrow(2, r0, t.rows);
      for (int64_t c0 = 0; c0 < key_end; c0 += key_tile) {
        const int64_t c1 = std::min(key_end, c0 + key_tile);
        const at::Tensor kb = k.narrow(2, c0, c1 - c0).to(cdt);
        const at::Tensor vb = v.narrow(2, c0, c1 - c0).to(cdt);
        at::Tensor s = at::matmul(qs, kb.transpose(-2, -1));
        if (c1 - 1 > t.min_pos) {
          s.masked_fill_(future_mask(t, c0, c1, tq, offset, q.device()), neg_inf);
        }
        // amax, not max: max also computes the argmax, in a scalar loop.
        const at::Tensor m_new = at::maximum(m, at::amax(s, {-1}, /*keepdim=*/true));
        const at::Tensor p = s.sub_(m_new).exp_();
        const at::Tensor alpha = (m - m_new).exp_();
        l.mul_(alpha).add_(p.sum(-1, /*keepdim=*/true));
        acc.mul_(alpha).add_(at::matmul(p, vb));
        m = m_new;
      }
      l.clamp_min_(1.0);
      acc.div_(l);
      lse.narrow(2, r0, t.rows).copy_(m + l.log());
    }
  };
  const int64_t workers = q.is_cpu() ? std::min<int64_t>(cpu_attention_threads(), tiles) : 1;
  if (workers > 1) {
    run_tiles_on_threads(tiles, workers, run_tiles);
  } else if (q.is_cpu()) {
    at::parallel_for(0, tiles, 1, run_tiles);
  } else {
    run_tiles(0, tiles);
  }
  return lse;
}

struct FlashGrads {
  at::Tensor dq, dk, dv;  // folded shapes, compute dtype
};

// The flash-attention backward: recompute p = exp(s - lse) tile by tile.
FlashGrads flash_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& o, const at::Tensor& lse, const at::Tensor& d_o,
                          int64_t tq, int64_t offset, double scale, int64_t block,
                          at::ScalarType cdt) {
  const int64_t R = q.size(2), tk = k.size(2);
  const auto opts = q.options().dtype(cdt);
  const double neg_inf = -std::numeric_limits<double>::infinity();
  const at::Tensor delta = (d_o * o).sum(-1, /*keepdim=*/true);  // rowsum(dO ∘ O)
  at::Tensor dq = at::zeros(q.sizes(), opts);
  at::Tensor dk = at::zeros(k.sizes(), opts);
  at::Tensor dv = at::zeros(v.sizes(), opts);
  for (int64_t r0 = 0; r0 < R; r0 += block) {
    const RowTile t = row_tile(r0, std::min(R, r0 + block), tq, offset, block);
    const int64_t key_end = std::min(tk, t.max_pos + 1);
    const at::Tensor qs = q.narrow(2, r0, t.rows).to(cdt) * scale;
    const at::Tensor dob = d_o.narrow(2, r0, t.rows);
    const at::Tensor lse_t = lse.narrow(2, r0, t.rows);
    const at::Tensor delta_t = delta.narrow(2, r0, t.rows);
    at::Tensor dq_t = dq.narrow(2, r0, t.rows);
    for (int64_t c0 = 0; c0 < key_end; c0 += t.key_tile) {
      const int64_t c1 = std::min(key_end, c0 + t.key_tile);
      const at::Tensor kb = k.narrow(2, c0, c1 - c0).to(cdt);
      const at::Tensor vb = v.narrow(2, c0, c1 - c0).to(cdt);
      at::Tensor s = at::matmul(qs, kb.transpose(-2, -1));
      if (c1 - 1 > t.min_pos) {
        s.masked_fill_(future_mask(t, c0, c1, tq, offset, q.device()), neg_inf);
      }
      const at::Tensor p = s.sub_(lse_t).exp_();
      dv.narrow(2, c0, c1 - c0).add_(at::matmul(p.transpose(-2, -1), dob));
      const at::Tensor ds = at::matmul(dob, vb.transpose(-2, -1)).sub_(delta_t).mul_(p);
      dq_t.add_(at::matmul(ds, kb));
      dk.narrow(2, c0, c1 - c0).add_(at::matmul(ds.transpose(-2, -1), qs));
    }
    dq_t.mul_(scale);
  }
  return {dq, dk, dv};
}

struct BlockwiseAttentionFunction : torch::autograd::Function<BlockwiseAttentionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, double scale, int64_t causal_offset,
                            int64_t block, bool keep_compute_dtype) {
    const at::ScalarType cdt = compute_dtype(q);
    const at::Tensor o_compute =
        at::zeros({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options().dtype(cdt));
    at::Tensor o_folded = fold_queries(o_compute, k.size(1));
    const at::Tensor lse = flash_forward(fold_queries(q, k.size(1)), k, v, o_folded, q.size(2),
                                         causal_offset, scale, block, cdt);
    ctx->save_for_backward({q, k, v, o_compute, lse});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["causal_offset"] = causal_offset;
    ctx->saved_data["block"] = block;
    return keep_compute_dtype ? o_compute : o_compute.to(q.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &o = saved[3], &lse = saved[4];
    const at::ScalarType cdt = compute_dtype(q);
    const int64_t kv_heads = k.size(1);
    const FlashGrads g = flash_backward(
        fold_queries(q, kv_heads), k, v, fold_queries(o, kv_heads), lse,
        fold_queries(grad_outputs[0].to(cdt), kv_heads), q.size(2),
        ctx->saved_data["causal_offset"].toInt(), ctx->saved_data["scale"].toDouble(),
        ctx->saved_data["block"].toInt(), cdt);
    return {g.dq.view(q.sizes()).to(q.scalar_type()), g.dk.to(k.scalar_type()),
            g.dv.to(v.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

void set_cpu_attention_threads(int threads) {
  g_cpu_attention_threads.store(std::clamp(threads, 1, kMaxCpuAttentionThreads),
                                std::memory_order_relaxed);
}

int parse_cpu_attention_threads(const char* value) {
  if (value == nullptr || *value == '\0') return 1;
  char* end = nullptr;
  errno = 0;
  const long n = std::strtol(value, &end, 10);
  TORCH_CHECK(*end == '\0' && errno == 0 && n >= 1 && n <= kMaxCpuAttentionThreads,
              "ODYSSEY_ATTENTION_THREADS='", value, "': expected a whole number of threads from 1 to ",
              kMaxCpuAttentionThreads, " (the CPU attention's threads; unset means 1)");
  return static_cast<int>(n);
}

int cpu_attention_threads() {
  int n = g_cpu_attention_threads.load(std::memory_order_relaxed);
  if (n == 0) {
    n = parse_cpu_attention_threads(std::getenv("ODYSSEY_ATTENTION_THREADS"));
    g_cpu_attention_threads.store(n, std::memory_order_relaxed);
  }
  return n;
}

// LibTorch's fused attention: scaled_dot_product_attention from 2.1 (flash / memory-efficient, the
// causal mask aligned top-left); the memory-efficient kernel itself, whose mask can be aligned
// bottom-right (a chunk continuing a cache), from 2.4 (its signature since then; 2.11 is the one the
// GPU build is tested with). LibTorch records both for autograd.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
#define ODYSSEY_FUSED_ATTENTION 1
#endif
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define ODYSSEY_BOTTOM_RIGHT_CAUSAL_ATTENTION 1
#endif

#ifdef ODYSSEY_FUSED_ATTENTION
namespace {
// Everything fused_attention_applies asks but the dtypes. Row i sees keys 0 ... causal_offset + i,
// so with causal_offset + Tq <= Tk the keys after causal_offset + Tq - 1 are never seen and the
// rest is causal attention aligned to the last kept key: plain causal when causal_offset is 0, a
// chunk continuing a cache (bottom-right) otherwise.
bool fused_attention_shapes_apply(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  int64_t causal_offset) {
  const int64_t tq = q.size(2), tk = k.size(2);
  const bool sees_all = causal_offset >= tk - 1;
  const bool causal_prefix = causal_offset >= 0 && tq >= 1 && causal_offset + tq <= tk;
#ifdef ODYSSEY_BOTTOM_RIGHT_CAUSAL_ATTENTION
  const bool mask_applies = sees_all || causal_prefix;
#else
  const bool mask_applies = sees_all || (causal_prefix && causal_offset == 0);
#endif
  return q.is_cuda() && q.size(1) == k.size(1) && std::max(q.size(3), v.size(3)) <= 256 && mask_applies;
}
}  // namespace
#endif

bool fused_attention_applies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             int64_t causal_offset) {
#ifdef ODYSSEY_FUSED_ATTENTION
  const bool half = q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf;
  return half && k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
         fused_attention_shapes_apply(q, k, v, causal_offset);
#else
  (void)q, (void)k, (void)v, (void)causal_offset;
  return false;  // LibTorch < 2.1 has no scaled_dot_product_attention with a scale
#endif
}

namespace {

#ifdef ODYSSEY_FUSED_ATTENTION
// Zero columns appended up to a multiple of 8 (the kernels' 16-byte alignment) change no dot
// product (q, k) and only add output columns that are sliced off again (v).
at::Tensor widen_to(const at::Tensor& t, int64_t width) {
  return t.size(3) == width ? t : at::constant_pad_nd(t, {0, width - t.size(3)});
}

#ifdef ODYSSEY_BOTTOM_RIGHT_CAUSAL_ATTENTION
// The memory-efficient kernel (LibTorch's cutlass kernel) on [B, H, T, D] operands: mask 0 none,
// 1 causal from the top-left, 2 causal from the bottom-right. q, k and v may differ in width.
at::Tensor efficient_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               double scale, int64_t mask) {
  const int64_t d = (q.size(3) + 7) / 8 * 8, dv = (v.size(3) + 7) / 8 * 8;
  const bool keep_lse = at::GradMode::is_enabled() &&
                        (q.requires_grad() || k.requires_grad() || v.requires_grad());
  const auto result = at::_efficient_attention_forward(
      widen_to(q, d).transpose(1, 2), widen_to(k, d).transpose(1, 2), widen_to(v, dv).transpose(1, 2),
      /*bias=*/c10::nullopt, /*cu_seqlens_q=*/c10::nullopt, /*cu_seqlens_k=*/c10::nullopt,
      /*max_seqlen_q=*/c10::nullopt, /*max_seqlen_k=*/c10::nullopt, /*dropout_p=*/0.0, mask,
      /*compute_log_sumexp=*/keep_lse, scale);
  const at::Tensor o = std::get<0>(result).transpose(1, 2);  // [B, T, H, dv] -> [B, H, T, dv]
  return o.size(3) == v.size(3) ? o : o.narrow(3, 0, v.size(3));
}
#endif

// LibTorch's fused attention for what fused_attention_shapes_apply accepts. Self-attention and
// rows that see every key go through scaled_dot_product_attention (flash where it applies, which
// wants one head width for q, k and v); a chunk continuing a cache, and fp32 operands (`high`,
// `highest`), through the memory-efficient kernel with the matching mask.
at::Tensor fused_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                           int64_t causal_offset, bool keep_compute_dtype) {
  const int64_t tq = q.size(2), tk = k.size(2), dv = v.size(3);
  const bool sees_all = causal_offset >= tk - 1;
  // Keys after the last row's position are never seen.
  const at::Tensor kk = sees_all ? k : k.narrow(2, 0, causal_offset + tq);
  const at::Tensor vv = sees_all ? v : v.narrow(2, 0, causal_offset + tq);
  at::Tensor o;
#ifdef ODYSSEY_BOTTOM_RIGHT_CAUSAL_ATTENTION
  if (q.scalar_type() == at::kFloat || (!sees_all && causal_offset > 0)) {
    o = efficient_attention(q, kk, vv, scale, sees_all ? 0 : (causal_offset == 0 ? 1 : 2));
    return keep_compute_dtype ? o.to(at::kFloat) : o;
  }
#endif
  const int64_t width = (std::max(q.size(3), dv) + 7) / 8 * 8;
  const bool is_causal = !sees_all && tq > 1;  // plain causal over the first Tq keys
  o = at::scaled_dot_product_attention(widen_to(q, width), widen_to(kk, width), widen_to(vv, width),
                                       /*attn_mask=*/{}, /*dropout_p=*/0.0, is_causal, scale);
  if (dv != width) o = o.narrow(3, 0, dv);
  return keep_compute_dtype ? o.to(at::kFloat) : o;
}
#endif

}  // namespace

at::Tensor blockwise_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               double scale, int64_t causal_offset, int64_t block,
                               bool keep_compute_dtype, bool allow_fused) {
  check_shapes(q, k, v);
  TORCH_CHECK(block >= 1, "blockwise_attention: block must be >= 1, got ", block);
#ifdef ODYSSEY_FUSED_ATTENTION
  if (allow_fused && fused_attention_applies(q, k, v, causal_offset)) {
    return fused_attention(q, k, v, scale, causal_offset, keep_compute_dtype);
  }
  const bool fp32 = q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                    v.scalar_type() == at::kFloat;
  if (allow_fused && q.is_cuda() && fp32 && float32_matmul_precision() == Float32MatmulPrecision::kMedium &&
      fused_attention_shapes_apply(q, k, v, causal_offset)) {
    // model/precision.h: fp32 at medium takes the fused kernel on bf16 copies (the casts recorded,
    // so the gradients reach the fp32 inputs); its output comes back in fp32, q's dtype.
    return fused_attention(q.to(at::kBFloat16), k.to(at::kBFloat16), v.to(at::kBFloat16), scale, causal_offset,
                           /*keep_compute_dtype=*/true);
  }
#ifdef ODYSSEY_BOTTOM_RIGHT_CAUSAL_ATTENTION
  if (allow_fused && q.is_cuda() && fp32 && fused_attention_shapes_apply(q, k, v, causal_offset)) {
    // model/precision.h: fp32 at high and highest takes the memory-efficient kernel on the fp32
    // operands. Its fp32 products are 3xTF32 on tensor cores (each operand a TF32 value plus a TF32
    // remainder, three products), within ~1e-6 of the fp32 blockwise path: what LibTorch's own
    // scaled_dot_product_attention runs for fp32 at every matmul precision.
    return fused_attention(q, k, v, scale, causal_offset, keep_compute_dtype);
  }
#endif
#endif
  // `block` is the CPU's tile (rows of queries, and keys per step: about block² scores, which
  // stay in cache). CUDA tensors use tiles of at least kCudaAttentionBlock: with 256-wide tiles
  // a 16K-token chunk against a 1M-token cache is a quarter of a million tile steps of ~10 small
  // kernels each, per layer; 4096-wide tiles (64 MB of fp32 scores per batch-head) make it 256
  // steps that each fill the GPU. The tile changes only the order of fp32 sums.
  constexpr int64_t kCudaAttentionBlock = 4096;
  const int64_t tile = q.is_cuda() ? std::max(block, kCudaAttentionBlock) : block;
  return BlockwiseAttentionFunction::apply(q, k, v, scale, causal_offset, tile,
                                           keep_compute_dtype);
}

at::Tensor naive_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           double scale, int64_t causal_offset, bool keep_compute_dtype) {
  check_shapes(q, k, v);
  const at::ScalarType cdt = compute_dtype(q);
  const int64_t group = q.size(1) / k.size(1), tq = q.size(2), tk = k.size(2);
  const at::Tensor kc = k.to(cdt).repeat_interleave(group, /*dim=*/1);
  const at::Tensor vc = v.to(cdt).repeat_interleave(group, /*dim=*/1);
  at::Tensor s = at::matmul(q.to(cdt), kc.transpose(-2, -1)) * scale;
  const auto idx = at::TensorOptions().dtype(at::kLong).device(q.device());
  const at::Tensor pos = at::arange(tq, idx).add_(causal_offset).unsqueeze(1);
  const at::Tensor future = at::arange(tk, idx).unsqueeze(0) > pos;  // [Tq, Tk]
  const at::Tensor blind = (pos < 0);                                 // rows that see no key
  s = s.masked_fill(future, -std::numeric_limits<double>::infinity()).masked_fill(blind, 0.0);
  const at::Tensor p = at::softmax(s, -1).masked_fill(blind, 0.0);
  const at::Tensor o = at::matmul(p, vc);
  return keep_compute_dtype ? o : o.to(q.scalar_type());
}

}  // namespace odyssey::model
