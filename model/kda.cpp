#include "model/kda.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <vector>

#include <c10/core/GradMode.h>
#include <torch/nn/options/conv.h>
#include <torch/nn/options/linear.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "model/precision.h"

#ifdef ODYSSEY_WITH_CUDA_KERNELS
#include "kernels/kda_autograd.h"
#include "kernels/torch_bindings.h"
#endif

namespace odyssey::model {

namespace kda {
namespace {

at::ScalarType compute_dtype(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Shapes of q, k, v, g, beta [B, T, H, *] and of the optional state [B, H, K, V].
void check_sequence_inputs(const char* where, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                           const at::Tensor& initial_state) {
  TORCH_CHECK(q.dim() == 4, where, ": q must be [B, T, H, K], got ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes(), where, ": k must match q ", q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(g.sizes() == q.sizes(), where, ": g must match q ", q.sizes(), ", got ", g.sizes());
  TORCH_CHECK(v.dim() == 4 && v.size(0) == q.size(0) && v.size(1) == q.size(1) &&
                  v.size(2) == q.size(2),
              where, ": v must be [B, T, H, V] with B, T, H of q ", q.sizes(), ", got ", v.sizes());
  TORCH_CHECK(beta.dim() == 3 && beta.size(0) == q.size(0) && beta.size(1) == q.size(1) &&
                  beta.size(2) == q.size(2),
              where, ": beta must be [B, T, H] of q ", q.sizes(), ", got ", beta.sizes());
  if (initial_state.defined()) {
    const std::vector<int64_t> expected = {q.size(0), q.size(2), q.size(3), v.size(3)};
    TORCH_CHECK(initial_state.sizes() == at::IntArrayRef(expected), where,
                ": initial_state must be [B, H, K, V] = ", at::IntArrayRef(expected), ", got ",
                initial_state.sizes());
  }
}

at::Tensor state_or_zeros(const at::Tensor& initial_state, const at::Tensor& q,
                          const at::Tensor& v, at::ScalarType dtype) {
  if (initial_state.defined()) return initial_state.to(dtype);
  return at::zeros({q.size(0), q.size(2), q.size(3), v.size(3)}, q.options().dtype(dtype));
}

// One token for every (batch, head), as a pure function: S [B, H, K, V], q, k, g [B, H, K],
// v [B, H, V], beta [B, H] (all in one dtype). Returns (o [B, H, V], S after the token).
// The single place that fixes the order of the recurrence.
std::pair<at::Tensor, at::Tensor> token_update(const at::Tensor& state, const at::Tensor& q,
                                               const at::Tensor& k, const at::Tensor& v,
                                               const at::Tensor& g, const at::Tensor& beta,
                                               double scale) {
  const at::Tensor decayed = state * g.exp().unsqueeze(-1);                   // rows = key channel
  const at::Tensor r = at::matmul(k.unsqueeze(-2), decayed).squeeze(-2);      // S~^T k  [B, H, V]
  const at::Tensor write = (beta.unsqueeze(-1) * k).unsqueeze(-1) * (v - r).unsqueeze(-2);
  const at::Tensor updated = decayed + write;
  const at::Tensor o = at::matmul((q * scale).unsqueeze(-2), updated).squeeze(-2);
  return {o, updated};
}

// (I + L)^-1 for L strictly lower triangular [..., C, C]: L is nilpotent (L^C = 0), so
// (I + L)^-1 = (I - L)(I + L^2)(I + L^4)...(I + L^(2^m)) with 2^(m+1) >= C, exactly.
// For C = 16: (I - L)(I + L^2)(I + L^4)(I + L^8).
at::Tensor unit_lower_inverse(const at::Tensor& lower) {
  const int64_t c = lower.size(-1);
  const at::Tensor identity = at::eye(c, lower.options());
  at::Tensor inverse = identity - lower;  // (I + L)(I - L) = I - L^2
  at::Tensor power = lower;
  for (int64_t covered = 2; covered < c; covered *= 2) {
    power = at::matmul(power, power);  // L^covered
    inverse = at::matmul(inverse, identity + power);
  }
  return inverse;
}

// [B, T, H, X] -> [B, H, N, C, X], zero-padding T up to N * C.
at::Tensor to_chunks(const at::Tensor& x, int64_t chunk, int64_t num_chunks,
                     at::ScalarType dtype) {
  at::Tensor padded = x.to(dtype);
  const int64_t pad = num_chunks * chunk - x.size(1);
  if (pad > 0) padded = at::constant_pad_nd(padded, {0, 0, 0, 0, 0, pad}, 0);
  return padded.reshape({x.size(0), num_chunks, chunk, x.size(2), x.size(3)})
      .permute({0, 3, 1, 2, 4});
}

// Whether autograd would record through these (then kda::chunked takes the kernels' autograd
// function, which runs the backward kernel).
[[maybe_unused]] bool needs_grad(std::initializer_list<const at::Tensor*> tensors) {
  if (!c10::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : tensors) {
    if (t->defined() && t->requires_grad()) return true;
  }
  return false;
}

}  // namespace

Output recurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& g, const at::Tensor& beta, const at::Tensor& initial_state,
                 double scale) {
  check_sequence_inputs("kda::recurrent", q, k, v, g, beta, initial_state);
  const at::ScalarType dtype = compute_dtype(q);
  at::Tensor state = state_or_zeros(initial_state, q, v, dtype);
  const at::Tensor qc = q.to(dtype), kc = k.to(dtype), vc = v.to(dtype), gc = g.to(dtype),
                   bc = beta.to(dtype);
  // One unbind per input rather than a select per token (see chunked_reference: the backward).
  const std::vector<at::Tensor> q_t = qc.unbind(1), k_t = kc.unbind(1), v_t = vc.unbind(1), g_t = gc.unbind(1),
                                b_t = bc.unbind(1);
  std::vector<at::Tensor> outputs;
  outputs.reserve(q.size(1));
  for (size_t t = 0; t < q_t.size(); ++t) {
    auto [o, updated] = token_update(state, q_t[t], k_t[t], v_t[t], g_t[t], b_t[t], scale);
    outputs.push_back(o);
    state = updated;
  }
  at::Tensor o = outputs.empty()
                     ? at::zeros({q.size(0), 0, q.size(2), v.size(3)}, q.options().dtype(dtype))
                     : at::stack(outputs, 1);
  return {o.to(q.scalar_type()), state};
}

namespace {
thread_local bool t_keep_chunk_states = false;
}  // namespace

KeepChunkStatesGuard::KeepChunkStatesGuard(bool keep) : previous_(t_keep_chunk_states) {
  t_keep_chunk_states = keep;
}
KeepChunkStatesGuard::~KeepChunkStatesGuard() { t_keep_chunk_states = previous_; }
bool keep_chunk_states() { return t_keep_chunk_states; }

Output chunked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& g, const at::Tensor& beta, const at::Tensor& initial_state,
               double scale, int64_t chunk) {
#ifdef ODYSSEY_WITH_CUDA_KERNELS
  if (q.defined() && q.is_cuda() &&
      kernels::kda_chunked_supported(q, k, v, g, beta, initial_state, chunk)) {
    check_sequence_inputs("kda::chunked", q, k, v, g, beta, initial_state);
    if (q.scalar_type() == at::kFloat && float32_matmul_precision() == Float32MatmulPrecision::kMedium) {
      // model/precision.h: the kernels' bf16 paths on rounded copies (the casts are recorded, so
      // the gradients come back in fp32), o back in fp32.
      const Output rounded = chunked(q.to(at::kBFloat16), k.to(at::kBFloat16), v.to(at::kBFloat16), g,
                                     beta.to(at::kBFloat16), initial_state, scale, chunk);
      return {rounded.o.to(at::kFloat), rounded.final_state};
    }
    // With a gradient wanted: the forward kernel recorded with the backward kernel as its
    // backward (only the inputs are saved, and the chunk states inside a KeepChunkStatesGuard);
    // otherwise the forward kernel alone.
    kernels::KdaChunkedOutput out =
        needs_grad({&q, &k, &v, &g, &beta, &initial_state})
            ? kernels::kda_chunked_autograd(q, k, v, g, beta, initial_state, scale, keep_chunk_states())
            : kernels::kda_chunked(q, k, v, g, beta, initial_state, scale);
    return {out.o, out.final_state};
  }
#endif
  return chunked_reference(q, k, v, g, beta, initial_state, scale, chunk);
}

namespace {

// The intra-chunk products with every exponent anchored at the start of the row's sub-chunk of
// `anchor` tokens: for j <= i (tokens of one chunk, i in sub-chunk a, B_a = Gamma before a's first
// token, 0 for a = 0)
//   x_i . k_j e^{Gamma_i - Gamma_j} = (x_i e^{Gamma_i - B_a}) . (k_j e^{B_a - Gamma_j}),
// where the first factor's exponent is <= 0 and the second's <= 0 for j before sub-chunk a and at
// most anchor |g_min| within it. Row block a takes the columns of sub-chunks 0 .. a only (later
// columns would overflow; they are above the diagonal anyway). Returns [.., C, C] with x = q_scaled
// (Aqk's rows, diagonal included) and x = k (P's rows, strictly lower), unmasked above the blocks.
std::pair<at::Tensor, at::Tensor> anchored_products(const at::Tensor& q_scaled, const at::Tensor& k,
                                                    const at::Tensor& gamma_cum, int64_t anchor) {
  const int64_t chunk = gamma_cum.size(-2), blocks = chunk / anchor;
  std::vector<at::Tensor> qk_rows, kk_rows;
  for (int64_t a = 0; a < blocks; ++a) {
    const int64_t first = a * anchor, columns = first + anchor;
    const at::Tensor start =
        a == 0 ? at::zeros_like(gamma_cum.select(-2, 0)).unsqueeze(-2) : gamma_cum.narrow(-2, first - 1, 1);
    const at::Tensor rows_decay = (gamma_cum.narrow(-2, first, anchor) - start).exp();
    const at::Tensor k_cols = k.narrow(-2, 0, columns) * (start - gamma_cum.narrow(-2, 0, columns)).exp();
    const at::Tensor k_cols_t = k_cols.transpose(-1, -2);
    const std::vector<int64_t> pad = {0, chunk - columns};
    qk_rows.push_back(at::constant_pad_nd(at::matmul(q_scaled.narrow(-2, first, anchor) * rows_decay, k_cols_t), pad, 0));
    kk_rows.push_back(at::constant_pad_nd(at::matmul(k.narrow(-2, first, anchor) * rows_decay, k_cols_t), pad, 0));
  }
  return {at::cat(qk_rows, -2), at::cat(kk_rows, -2)};
}

}  // namespace

Output chunked_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& g, const at::Tensor& beta,
                         const at::Tensor& initial_state, double scale, int64_t chunk, int64_t anchor) {
  check_sequence_inputs("kda::chunked", q, k, v, g, beta, initial_state);
  TORCH_CHECK(chunk >= 1, "kda::chunked: chunk must be >= 1, got ", chunk);
  if (anchor == 0) anchor = chunk;
  TORCH_CHECK(anchor >= 1 && chunk % anchor == 0, "kda::chunked: anchor (tokens between exponent anchors) must ",
              "divide chunk = ", chunk, ", got ", anchor);
  const at::ScalarType dtype = compute_dtype(q);
  at::Tensor state = state_or_zeros(initial_state, q, v, dtype);
  const int64_t batch = q.size(0), length = q.size(1), heads = q.size(2), v_dim = v.size(3);
  if (length == 0) {
    return {at::zeros({batch, 0, heads, v_dim}, q.options()), state};
  }
  const int64_t num_chunks = (length + chunk - 1) / chunk;

  // [B, H, N, C, *]; beta as a column [B, H, N, C, 1] so that it scales rows.
  const at::Tensor qc = to_chunks(q, chunk, num_chunks, dtype);
  const at::Tensor kc = to_chunks(k, chunk, num_chunks, dtype);
  const at::Tensor vc = to_chunks(v, chunk, num_chunks, dtype);
  const at::Tensor gc = to_chunks(g, chunk, num_chunks, dtype);
  const at::Tensor bc = to_chunks(beta.unsqueeze(-1), chunk, num_chunks, dtype);

  // Gamma anchored at each chunk's first token; gamma = its last row (padding has g = 0, so for
  // a partly filled chunk gamma is the last real token's Gamma).
  const at::Tensor gamma_cum = gc.cumsum(3);
  const at::Tensor gamma_last = gamma_cum.select(3, chunk - 1);  // [B, H, N, K]
  const at::Tensor q_hat = qc * scale * gamma_cum.exp();
  const at::Tensor k_hat = kc * gamma_cum.exp();
  // K~ = K e^{-Gamma}: only with one anchor a chunk (it overflows past ~16 tokens at g = -5).
  const at::Tensor k_check = anchor == chunk ? kc * (-gamma_cum).exp() : at::Tensor();
  const at::Tensor k_bar = kc * (gamma_last.unsqueeze(3) - gamma_cum).exp();

  at::Tensor lower, a_qk;  // Diag(beta) L0 and Aqk
  if (anchor == chunk) {
    const at::Tensor k_check_t = k_check.transpose(-1, -2);
    lower = bc * at::tril(at::matmul(k_hat, k_check_t), -1);
    a_qk = at::tril(at::matmul(q_hat, k_check_t), 0);
  } else {
    const auto [qk, kk] = anchored_products(qc * scale, kc, gamma_cum, anchor);
    lower = bc * at::tril(kk, -1);
    a_qk = at::tril(qk, 0);
  }
  const at::Tensor inverse = unit_lower_inverse(lower);
  const at::Tensor w = at::matmul(inverse, bc * k_hat);  // [B, H, N, C, K]
  const at::Tensor u = at::matmul(inverse, bc * vc);     // [B, H, N, C, V]
  const at::Tensor decay_last = gamma_last.exp().unsqueeze(-1);  // [B, H, N, K, 1]
  const at::Tensor k_bar_t = k_bar.transpose(-1, -2);

  // The state hand-off is the only sequential part. Each operand is split into its chunks once
  // (unbind): under autograd that is one backward stacking every chunk's gradient, where a
  // select() per chunk would make each chunk's gradient a zero-filled tensor of the whole
  // sequence's size and sum them (quadratic in the number of chunks).
  const std::vector<at::Tensor> u_n = u.unbind(2), w_n = w.unbind(2), q_hat_n = q_hat.unbind(2),
                                a_qk_n = a_qk.unbind(2), decay_n = decay_last.unbind(2), k_bar_t_n = k_bar_t.unbind(2);
  std::vector<at::Tensor> outputs;
  outputs.reserve(num_chunks);
  for (size_t n = 0; n < static_cast<size_t>(num_chunks); ++n) {
    const at::Tensor v_new = u_n[n] - at::matmul(w_n[n], state);  // V'
    outputs.push_back(at::matmul(q_hat_n[n], state) + at::matmul(a_qk_n[n], v_new));
    state = decay_n[n] * state + at::matmul(k_bar_t_n[n], v_new);
  }
  // [B, H, N, C, V] -> [B, N * C, H, V], padding dropped.
  const at::Tensor o = at::stack(outputs, 2)
                           .permute({0, 2, 3, 1, 4})
                           .reshape({batch, num_chunks * chunk, heads, v_dim})
                           .slice(1, 0, length);
  return {o.to(q.scalar_type()), state};
}

namespace {

// x unchanged, or rounded to bf16 and back (an operand a kernel would feed its tensor cores).
at::Tensor operand(const at::Tensor& x, bool bf16) {
  return bf16 ? x.to(at::kBFloat16).to(x.scalar_type()) : x;
}

// The exponent anchors of a chunk's sub-chunks of `anchor` tokens: B_a = Gamma before sub-chunk a's
// first token ([.., 1, K] each; zeros for a = 0).
at::Tensor anchor_start(const at::Tensor& gamma_cum, int64_t a, int64_t anchor) {
  return a == 0 ? at::zeros_like(gamma_cum.select(-2, 0)).unsqueeze(-2)
                : gamma_cum.narrow(-2, a * anchor - 1, 1);
}

// The blocks (a, b <= a) of an anchored intra-chunk product A = x k^T (.) e^{Gamma_i - Gamma_j}
// (anchored_products above): the operands of block (a, b), X_ab = x_a e^{Gamma_a - B_a} and
// Kc_ab = k_b e^{B_a - Gamma_b}, each possibly rounded to bf16 (diagonal and off-diagonal blocks
// separately). Forward: A [.., C, C] (zero above the blocks).
struct AnchoredBlocks {
  int64_t chunk, anchor;
  bool round_diagonal, round_off_diagonal;
  const at::Tensor& x;
  const at::Tensor& k;
  const at::Tensor& gamma_cum;

  bool dgamma_from_unrounded = false;

  std::pair<at::Tensor, at::Tensor> operands(int64_t a, int64_t b, bool rounded = true) const {
    const at::Tensor start = anchor_start(gamma_cum, a, anchor);
    const bool bf16 = rounded && (a == b ? round_diagonal : round_off_diagonal);
    const at::Tensor xa = x.narrow(-2, a * anchor, anchor) * (gamma_cum.narrow(-2, a * anchor, anchor) - start).exp();
    const at::Tensor kb = k.narrow(-2, b * anchor, anchor) * (start - gamma_cum.narrow(-2, b * anchor, anchor)).exp();
    return {operand(xa, bf16), operand(kb, bf16)};
  }
  at::Tensor forward() const {
    const int64_t blocks = chunk / anchor;
    std::vector<at::Tensor> rows;
    for (int64_t a = 0; a < blocks; ++a) {
      std::vector<at::Tensor> row;
      for (int64_t b = 0; b < blocks; ++b) {
        if (b > a) {
          row.push_back(at::zeros_like(row.front()));
          continue;
        }
        const auto [xa, kb] = operands(a, b);
        row.push_back(at::matmul(xa, kb.transpose(-1, -2)));
      }
      rows.push_back(at::cat(row, -1));
    }
    return at::cat(rows, -2);
  }
  // Given dA (zero where A is masked): adds to dx, dk and dGamma (each [.., C, K]). Per block,
  // dX_ab = dA_ab Kc_ab and dKc_ab = dA_ab^T X_ab (operands rounded as the forward's), then
  // dx_a += dX_ab (.) e^{Gamma_a - B_a}, dk_b += dKc_ab (.) e^{B_a - Gamma_b}, and dGamma_a +=
  // dX_ab (.) X_ab, dGamma_b -= dKc_ab (.) Kc_ab (the block depends on Gamma through Gamma_i -
  // Gamma_j only, so B_a's own terms cancel).
  void backward(const at::Tensor& d_a, at::Tensor& dx, at::Tensor& dk, at::Tensor& d_gamma) const {
    const int64_t blocks = chunk / anchor;
    for (int64_t a = 0; a < blocks; ++a) {
      const at::Tensor start = anchor_start(gamma_cum, a, anchor);
      const at::Tensor row_decay = (gamma_cum.narrow(-2, a * anchor, anchor) - start).exp();
      for (int64_t b = 0; b <= a; ++b) {
        const bool bf16 = a == b ? round_diagonal : round_off_diagonal;
        const auto [xa, kb] = operands(a, b);
        const at::Tensor block = operand(d_a.narrow(-2, a * anchor, anchor).narrow(-1, b * anchor, anchor), bf16);
        const at::Tensor d_xa = at::matmul(block, kb);
        const at::Tensor d_kb = at::matmul(block.transpose(-1, -2), xa);
        const at::Tensor col_decay = (start - gamma_cum.narrow(-2, b * anchor, anchor)).exp();
        dx.narrow(-2, a * anchor, anchor).add_(d_xa * row_decay);
        dk.narrow(-2, b * anchor, anchor).add_(d_kb * col_decay);
        // dGamma's terms with the operands the products saw, so that a pair's two terms cancel
        // where they must (dgamma_from_unrounded: with the unrounded values, as a kernel would
        // that rounds its operands but not its elementwise factors).
        const auto [xe, ke] = dgamma_from_unrounded ? operands(a, b, false) : std::pair{xa, kb};
        d_gamma.narrow(-2, a * anchor, anchor).add_(d_xa * xe);
        d_gamma.narrow(-2, b * anchor, anchor).sub_(d_kb * ke);
      }
    }
  }
};

// M = (I + L)^-1 for a strictly lower L [.., C, C] by blocks of `block` rows, as a blocked kernel
// makes it: each diagonal block's own inverse (exact: the kernels' fp32 substitution), then the
// blocks below the diagonal row block by row block, M_ab = -M_aa sum_{c = b}^{a - 1} L_ac M_cb,
// with the operands of those products rounded to bf16 when `bf16` (fp32 accumulation kept).
at::Tensor unit_lower_inverse_by_blocks(const at::Tensor& lower, int64_t block, bool bf16) {
  const int64_t c = lower.size(-1), blocks = c / block;
  auto part = [&](const at::Tensor& x, int64_t a, int64_t b) {
    return x.narrow(-2, a * block, block).narrow(-1, b * block, block);
  };
  at::Tensor inverse = at::zeros_like(lower);
  for (int64_t a = 0; a < blocks; ++a) {
    const at::Tensor diagonal = unit_lower_inverse(part(lower, a, a));
    part(inverse, a, a).copy_(diagonal);
    for (int64_t b = a - 1; b >= 0; --b) {
      at::Tensor sum = at::zeros_like(diagonal);
      for (int64_t m = b; m < a; ++m) sum = sum + at::matmul(operand(part(lower, a, m), bf16), operand(part(inverse, m, b), bf16));
      part(inverse, a, b).copy_(-at::matmul(operand(diagonal, bf16), operand(sum, bf16)));
    }
  }
  return inverse;
}

// [B, H, N, C, X] -> [B, T, H, X] (padding dropped).
at::Tensor from_chunks(const at::Tensor& x, int64_t length) {
  const int64_t batch = x.size(0), heads = x.size(1), chunks = x.size(2), chunk = x.size(3), width = x.size(4);
  return x.permute({0, 2, 3, 1, 4}).reshape({batch, chunks * chunk, heads, width}).slice(1, 0, length);
}

// One chunking's forward quantities (chunked_reference's), in the compute dtype: [B, H, N, C, *] for
// chunks of `chunk` tokens with exponents anchored every `anchor`, the intra-chunk products' and M's
// operands rounded as `rounding` says; `count` chunks (the sequence zero-padded to count * chunk tokens).
// The backward reference makes one for its chunks and, for the sub-chunk forms, one for pass 2's
// sub-chunks (exact).
struct Chunking {
  int64_t chunk = 0, anchor = 0, count = 0;
  bool round_diagonal = false, round_off_diagonal = false, dgamma_from_unrounded = false;
  at::Tensor qc, kc, vc, gc, bc, doc;  // the inputs by chunk (beta as a column [.., C, 1])
  at::Tensor gamma_cum, gamma_last;    // Gamma anchored at the chunk start; its last row [.., 1, K]
  at::Tensor q_hat, k_hat, k_bar;      // scale q e^Gamma, k e^Gamma, k e^{gamma - Gamma}
  at::Tensor a_qk, p, inverse;         // Aqk, P (strictly lower), M = (I + Diag(beta) P)^-1
  at::Tensor w, u, decay_last;         // M Diag(beta) K^, M Diag(beta) V, e^gamma [.., K, 1]

  // The anchored products by blocks (they refer to this object's tensors: keep it alive).
  AnchoredBlocks qk() const {
    return {chunk, anchor, round_diagonal, round_off_diagonal, qc, kc, gamma_cum, dgamma_from_unrounded};
  }
  AnchoredBlocks kk() const {
    return {chunk, anchor, round_diagonal, round_off_diagonal, kc, kc, gamma_cum, dgamma_from_unrounded};
  }
};

Chunking chunking(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                  const at::Tensor& beta, const at::Tensor& d_o, double scale, int64_t chunk, int64_t anchor,
                  int64_t count, at::ScalarType dtype, const BackwardRounding& rounding) {
  Chunking c;
  c.chunk = chunk, c.anchor = anchor, c.count = count;
  c.round_diagonal = rounding.diagonal_blocks, c.round_off_diagonal = rounding.off_diagonal_blocks;
  c.dgamma_from_unrounded = rounding.dgamma_from_unrounded;
  c.qc = to_chunks(q, chunk, c.count, dtype), c.kc = to_chunks(k, chunk, c.count, dtype);
  c.vc = to_chunks(v, chunk, c.count, dtype), c.gc = to_chunks(g, chunk, c.count, dtype);
  c.bc = to_chunks(beta.unsqueeze(-1), chunk, c.count, dtype), c.doc = to_chunks(d_o, chunk, c.count, dtype);
  c.gamma_cum = c.gc.cumsum(3);
  c.gamma_last = c.gamma_cum.select(3, chunk - 1).unsqueeze(3);
  c.q_hat = c.qc * scale * c.gamma_cum.exp();
  c.k_hat = c.kc * c.gamma_cum.exp();
  c.k_bar = c.kc * (c.gamma_last - c.gamma_cum).exp();
  c.a_qk = at::tril(c.qk().forward(), 0) * scale;
  c.p = at::tril(c.kk().forward(), -1);
  // M, by anchor-sized blocks (exact unless rounding.inverse_blocks)
  c.inverse = unit_lower_inverse_by_blocks(c.bc * c.p, anchor, rounding.inverse_blocks);
  c.w = at::matmul(c.inverse, c.bc * c.k_hat);
  c.u = at::matmul(c.inverse, c.bc * c.vc);
  c.decay_last = c.gamma_last.squeeze(3).exp().unsqueeze(-1);
  return c;
}

// Pass 2: the reverse walk from d_state (the gradient of the state leaving the last chunk), exact.
// Fills `leaving` (dS' leaving every chunk) and `d_v_new` (every chunk's dV') and returns the
// gradient of the state entering the first chunk.
at::Tensor reverse_walk(const Chunking& c, at::Tensor d_state, std::vector<at::Tensor>& leaving,
                        std::vector<at::Tensor>& d_v_new) {
  leaving.resize(c.count), d_v_new.resize(c.count);
  for (int64_t n = c.count - 1; n >= 0; --n) {
    leaving[n] = d_state;
    d_v_new[n] = at::matmul(c.k_bar.select(2, n), d_state) +
                 at::matmul(c.a_qk.select(2, n).transpose(-1, -2), c.doc.select(2, n));
    d_state = at::matmul(c.q_hat.select(2, n).transpose(-1, -2), c.doc.select(2, n)) +
              c.decay_last.select(2, n) * d_state - at::matmul(c.w.select(2, n).transpose(-1, -2), d_v_new[n]);
  }
  return d_state;
}

}  // namespace

Gradients chunked_backward_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& g, const at::Tensor& beta,
                                     const at::Tensor& initial_state, double scale, const at::Tensor& d_o,
                                     const at::Tensor& d_final_state, int64_t chunk, int64_t anchor,
                                     const BackwardRounding& rounding, BackwardForm form) {
  constexpr const char* where = "kda::chunked_backward_reference";
  check_sequence_inputs(where, q, k, v, g, beta, initial_state);
  TORCH_CHECK(d_o.defined() && d_o.sizes() == v.sizes(), where, ": d_o must match v ", v.sizes(), ", got ",
              d_o.defined() ? c10::str(d_o.sizes()) : std::string("none"));
  TORCH_CHECK(chunk >= 1, where, ": chunk must be >= 1, got ", chunk);
  if (anchor == 0) anchor = chunk;
  TORCH_CHECK(anchor >= 1 && chunk % anchor == 0, where, ": anchor (tokens between exponent anchors) must divide ",
              "chunk = ", chunk, ", got ", anchor);
  const at::ScalarType dtype = compute_dtype(q);
  const int64_t batch = q.size(0), length = q.size(1), heads = q.size(2), k_dim = q.size(3), v_dim = v.size(3);
  const at::Tensor d_final = d_final_state.defined()
                                 ? d_final_state.to(dtype)
                                 : at::zeros({batch, heads, k_dim, v_dim}, q.options().dtype(dtype));
  TORCH_CHECK(d_final.sizes() == at::IntArrayRef({batch, heads, k_dim, v_dim}), where,
              ": d_final_state must be [B, H, K, V], got ", d_final.sizes());
  Gradients out;
  if (length == 0) {
    out.dq = at::zeros_like(q), out.dk = at::zeros_like(k), out.dv = at::zeros_like(v);
    out.dg = at::zeros_like(g), out.dbeta = at::zeros_like(beta);
    out.d_initial_state = d_final;
    return out;
  }
  const int64_t num_chunks = (length + chunk - 1) / chunk;
  const Chunking c = chunking(q, k, v, g, beta, d_o, scale, chunk, anchor, num_chunks, dtype, rounding);
  const at::Tensor &qc = c.qc, &kc = c.kc, &vc = c.vc, &gc = c.gc, &bc = c.bc, &doc = c.doc;
  const at::Tensor &gamma_cum = c.gamma_cum, &gamma_last = c.gamma_last, &decay_last = c.decay_last;
  const at::Tensor &q_hat = c.q_hat, &k_hat = c.k_hat, &k_bar = c.k_bar, &a_qk = c.a_qk, &p = c.p;
  const at::Tensor &inverse = c.inverse, &w = c.w, &u = c.u;

  // A product with the K x V state (pass 3's five, pass 2's walk): operands as the kernels feed them.
  auto state_product = [&](const at::Tensor& a, const at::Tensor& b) {
    return at::matmul(operand(a, rounding.state_products), operand(b, rounding.state_products));
  };
  auto small_product = [&](const at::Tensor& a, const at::Tensor& b) {
    return at::matmul(operand(a, rounding.small_products), operand(b, rounding.small_products));
  };

  // Pass 1: the state entering every chunk. Pass 2: dS' leaving every chunk, walked backwards. Both
  // keep their running state exact; what pass 3 reads of them is rounded as stored (states).
  std::vector<at::Tensor> entering(num_chunks), walk_v_new(num_chunks), leaving, walk_d_v_new;
  at::Tensor state = state_or_zeros(initial_state, q, v, dtype);
  for (int64_t n = 0; n < num_chunks; ++n) {
    entering[n] = state;
    walk_v_new[n] = u.select(2, n) - at::matmul(w.select(2, n), state);
    state = decay_last.select(2, n) * state + at::matmul(k_bar.select(2, n).transpose(-1, -2), walk_v_new[n]);
  }
  out.d_initial_state = reverse_walk(c, d_final, leaving, walk_d_v_new);

  // Pass 3, every chunk at once (kda_backward.cu's derivation, the anchored products' terms from
  // AnchoredBlocks::backward).
  const at::Tensor s = operand(at::stack(entering, 2), rounding.states);   // [B, H, N, K, V]
  const at::Tensor ds = operand(at::stack(leaving, 2), rounding.states);   // dS'
  const at::Tensor v_new = rounding.values_from_walk ? operand(at::stack(walk_v_new, 2), true)  // V'
                                                     : u - state_product(w, s);
  const at::Tensor d_k_bar = state_product(v_new, ds.transpose(-1, -2));   // dK_ = V' dS'^T
  const at::Tensor d_v_new = state_product(k_bar, ds) + small_product(a_qk.transpose(-1, -2), doc);
  const at::Tensor d_decay = (ds * s).sum(-1);                             // d e^gamma [B, H, N, K]
  const at::Tensor d_q_hat = state_product(doc, s.transpose(-1, -2));      // dO S^T
  const at::Tensor d_a_qk = at::tril(small_product(doc, v_new.transpose(-1, -2)), 0);
  at::Tensor d_vb, d_kb, d_l;  // dVb = M^T dU, dKb = M^T dW, dL (strictly lower)
  if (form == BackwardForm::kInverseChain) {
    const at::Tensor d_w = -state_product(d_v_new, s.transpose(-1, -2));
    d_vb = small_product(inverse.transpose(-1, -2), d_v_new);
    d_kb = small_product(inverse.transpose(-1, -2), d_w);
    // dM[t][i] = beta_i (G + H)[t][i], G = dU V^T, H = dW K^^T; dL = -M^T dM M^T, strictly lower.
    const at::Tensor d_m = (small_product(d_v_new, vc.transpose(-1, -2)) + small_product(d_w, k_hat.transpose(-1, -2))) *
                           bc.transpose(-1, -2);
    d_l = at::tril(-small_product(small_product(inverse.transpose(-1, -2), d_m), inverse.transpose(-1, -2)), -1);
  } else {
    const bool kept = form == BackwardForm::kKeptInnovationGradients;  // dVb stored, not dV'
    if (form == BackwardForm::kInnovations || anchor == chunk) {
      d_vb = small_product(inverse.transpose(-1, -2), d_v_new);
      if (kept) d_vb = operand(d_vb, rounding.states);
    } else {
      // dV' of pass 2's reverse walk over sub-chunks of `anchor` tokens (exact, stored as `states`
      // are unless dVb is what is kept), then M_aa^T dV'_a on each, with M's diagonal blocks taken
      // from `inverse` (as pass 3 makes them): [B, H, N, C, X] viewed as [B, H, N, C / anchor, anchor, X].
      const Chunking sub = chunking(q, k, v, g, beta, d_o, scale, anchor, anchor, num_chunks * chunk / anchor,
                                    dtype, {});
      std::vector<at::Tensor> sub_leaving, d_v_sub;
      reverse_walk(sub, d_final, sub_leaving, d_v_sub);
      std::vector<at::Tensor> blocks;
      for (int64_t a = 0; a < chunk / anchor; ++a) {
        blocks.push_back(inverse.narrow(-2, a * anchor, anchor).narrow(-1, a * anchor, anchor));
      }
      const at::Tensor diagonal = at::stack(blocks, 3);  // [B, H, N, C / anchor, anchor, anchor]
      const at::Tensor d_v_kept = operand(at::stack(d_v_sub, 2), kept ? false : rounding.states)
                                      .reshape({batch, heads, num_chunks, chunk / anchor, anchor, v_dim});
      d_vb = small_product(diagonal.transpose(-1, -2), d_v_kept).reshape({batch, heads, num_chunks, chunk, v_dim});
      if (kept) d_vb = operand(d_vb, rounding.states);
    }
    d_kb = -state_product(d_vb, s.transpose(-1, -2));
    d_l = at::tril(-small_product(d_vb, v_new.transpose(-1, -2)), -1);
  }
  const at::Tensor dv = bc * d_vb;
  at::Tensor d_k_hat = bc * d_kb;
  at::Tensor dbeta = (d_vb * vc).sum(-1, true) + (d_kb * k_hat).sum(-1, true);  // [B, H, N, C, 1]
  dbeta = dbeta + (d_l * p).sum(-1, true);
  const at::Tensor d_p = bc * d_l;

  // Back to the inputs. Q^, K^, K_ directly; Aqk (x = scale q) and P (x = k) through their blocks.
  at::Tensor dq_a = at::zeros_like(qc), dk = at::zeros_like(kc), d_gamma = at::zeros_like(gc);
  c.qk().backward(d_a_qk * scale, dq_a, dk, d_gamma);
  c.kk().backward(d_p, dk, dk, d_gamma);
  const at::Tensor dq = d_q_hat * scale * gamma_cum.exp() + dq_a;
  dk = dk + d_k_hat * gamma_cum.exp() + d_k_bar * (gamma_last - gamma_cum).exp();
  d_gamma = d_gamma + d_q_hat * q_hat + d_k_hat * k_hat - d_k_bar * k_bar;
  const at::Tensor d_gamma_last = (d_k_bar * k_bar).sum(3, true) + decay_last.transpose(-1, -2) * d_decay.unsqueeze(3);
  // dg[s] = sum_{t >= s} dGamma[t] + dgamma: the reverse cumulative sum over the chunk's rows.
  const at::Tensor dg = d_gamma.flip(3).cumsum(3).flip(3) + d_gamma_last;

  out.dq = from_chunks(dq, length).to(q.scalar_type());
  out.dk = from_chunks(dk, length).to(k.scalar_type());
  out.dv = from_chunks(dv, length).to(v.scalar_type());
  out.dg = from_chunks(dg, length).to(g.scalar_type());
  out.dbeta = from_chunks(dbeta, length).squeeze(-1).to(beta.scalar_type());
  return out;
}

at::Tensor step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& g, const at::Tensor& beta, at::Tensor& state, double scale) {
#ifdef ODYSSEY_WITH_CUDA_KERNELS
  if (q.defined() && q.is_cuda() && !needs_grad({&q, &k, &v, &g, &beta, &state}) &&
      kernels::kda_step_supported(q, k, v, g, beta, state)) {
    return kernels::kda_step(q, k, v, g, beta, state, scale);
  }
#endif
  return step_reference(q, k, v, g, beta, state, scale);
}

at::Tensor step_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& g, const at::Tensor& beta, at::Tensor& state,
                          double scale) {
  TORCH_CHECK(state.dim() == 4, "kda::step: state must be [B, H, K, V], got ", state.sizes());
  TORCH_CHECK(state.scalar_type() == at::kFloat || state.scalar_type() == at::kDouble,
              "kda::step: state must be fp32 or fp64, got ", state.scalar_type());
  const std::vector<int64_t> key_shape = {state.size(0), state.size(1), state.size(2)};
  TORCH_CHECK(q.sizes() == at::IntArrayRef(key_shape) && k.sizes() == q.sizes() &&
                  g.sizes() == q.sizes(),
              "kda::step: q, k, g must be [B, H, K] = ", at::IntArrayRef(key_shape), ", got ",
              q.sizes(), ", ", k.sizes(), ", ", g.sizes());
  TORCH_CHECK(v.dim() == 3 && v.size(0) == state.size(0) && v.size(1) == state.size(1) &&
                  v.size(2) == state.size(3),
              "kda::step: v must be [B, H, V] of state ", state.sizes(), ", got ", v.sizes());
  TORCH_CHECK(beta.dim() == 2 && beta.size(0) == state.size(0) && beta.size(1) == state.size(1),
              "kda::step: beta must be [B, H], got ", beta.sizes());
  const at::ScalarType dtype = state.scalar_type();
  auto [o, updated] = token_update(state, q.to(dtype), k.to(dtype), v.to(dtype), g.to(dtype),
                                   beta.to(dtype), scale);
  state.copy_(updated);
  return o.to(q.scalar_type());
}

at::Tensor gate(const at::Tensor& z, const at::Tensor& a_log, const at::Tensor& dt_bias, double g_min) {
#ifdef ODYSSEY_WITH_CUDA_KERNELS
  if (kernels::kda_gate_supported(z, a_log, dt_bias)) return kernels::kda_gate_autograd(z, a_log, dt_bias, g_min);
#endif
  return gate_reference(z, a_log, dt_bias, g_min);
}

at::Tensor gate_reference(const at::Tensor& z, const at::Tensor& a_log, const at::Tensor& dt_bias, double g_min) {
  TORCH_CHECK(z.dim() >= 2, "kda::gate: z must be [..., H, K], got ", z.sizes());
  const int64_t heads = z.size(-2), width = z.size(-1);
  TORCH_CHECK(a_log.dim() == 1 && a_log.size(0) == heads, "kda::gate: A_log must be [", heads, "], got ",
              a_log.sizes());
  TORCH_CHECK(dt_bias.numel() == heads * width, "kda::gate: dt_bias must have H * K = ", heads * width,
              " elements, got ", dt_bias.sizes());
  // exp(A) * (z + dt_bias), not exp(A) * z + dt_bias.
  return g_min * at::sigmoid(a_log.exp().view({heads, 1}) * (z + dt_bias.view({heads, width})));
}

at::Tensor short_conv_reference(const at::Tensor& x, const at::Tensor& conv_inputs, const at::Tensor& weight,
                                int64_t head, double eps) {
  TORCH_CHECK(x.dim() == 3, "kda::short_conv: x must be [B, T, D], got ", x.sizes());
  const int64_t batch = x.size(0), length = x.size(1), channels = x.size(2), width = weight.size(-1);
  TORCH_CHECK(weight.numel() == channels * width, "kda::short_conv: weight must be [", channels, ", 1, W], got ",
              weight.sizes());
  TORCH_CHECK(conv_inputs.dim() == 3 && conv_inputs.size(0) == batch && conv_inputs.size(1) == width - 1 &&
                  conv_inputs.size(2) == channels,
              "kda::short_conv: conv_inputs must be [", batch, ", ", width - 1, ", ", channels, "], got ",
              conv_inputs.sizes());
  TORCH_CHECK(head >= 0 && (head == 0 || channels % head == 0), "kda::short_conv: head must divide ", channels,
              ", got ", head);
  const at::Tensor window = at::cat({conv_inputs, x}, 1);  // [B, W-1+T, D]
  const at::Tensor taps = weight.reshape({channels, width});
  at::Tensor out = window.slice(1, 0, length) * taps.select(1, 0);
  for (int64_t j = 1; j < width; ++j) out = out + window.slice(1, j, j + length) * taps.select(1, j);
  const at::Tensor activated = at::silu(out);
  if (head == 0) return activated;
  const at::Tensor heads = activated.view({batch, length, channels / head, head});
  // x / sqrt(sum(x^2) + eps) over each head's channels.
  return (heads * at::rsqrt(heads.pow(2).sum(-1, /*keepdim=*/true) + eps)).view(x.sizes());
}

}  // namespace kda

// ---------------------------------------------------------------------------------------------
// KdaState

namespace {

constexpr const char* kRecurrentName = "recurrent";
constexpr const char* kQConvName = "q_conv_inputs";
constexpr const char* kKConvName = "k_conv_inputs";
constexpr const char* kVConvName = "v_conv_inputs";

// Byte format of KdaState::to_bytes (little-endian, as the host; only little-endian hosts
// are supported, as for safetensors):
//   8 bytes  magic "ODYKDAS1"
//   u32      tensor count
//   per tensor: u32 name length, name bytes, u8 dtype (0 f32, 1 f64, 2 bf16, 3 f16),
//               u32 rank, i64 x rank sizes, u64 byte count, the row-major element bytes.
constexpr char kMagic[8] = {'O', 'D', 'Y', 'K', 'D', 'A', 'S', '1'};
constexpr uint32_t kMaxRank = 8;

std::optional<uint8_t> dtype_code(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return 0;
    case at::kDouble: return 1;
    case at::kBFloat16: return 2;
    case at::kHalf: return 3;
    default: return std::nullopt;
  }
}

std::optional<at::ScalarType> dtype_from_code(uint8_t code) {
  switch (code) {
    case 0: return at::kFloat;
    case 1: return at::kDouble;
    case 2: return at::kBFloat16;
    case 3: return at::kHalf;
    default: return std::nullopt;
  }
}

template <typename T>
void append_pod(std::string& out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out.append(bytes, sizeof(T));
}

// Reads from a byte string with bounds checks; every failure is reported once, with the offset.
class ByteReader {
 public:
  explicit ByteReader(const std::string& bytes) : bytes_(bytes) {}
  template <typename T>
  bool read(T& value) {
    if (bytes_.size() - offset_ < sizeof(T)) return false;
    std::memcpy(&value, bytes_.data() + offset_, sizeof(T));
    offset_ += sizeof(T);
    return true;
  }
  bool read_bytes(size_t count, const char** data) {
    if (bytes_.size() - offset_ < count) return false;
    *data = bytes_.data() + offset_;
    offset_ += count;
    return true;
  }
  size_t offset() const { return offset_; }
  bool at_end() const { return offset_ == bytes_.size(); }

 private:
  const std::string& bytes_;
  size_t offset_ = 0;
};

Status corrupt(const ByteReader& reader, const std::string& what) {
  return make_status(StatusCode::kCorrupt, "KdaState bytes at offset {}: {}", reader.offset(),
                     what);
}

std::string shape_string(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

}  // namespace

std::map<std::string, at::Tensor> KdaState::to_tensors() const {
  auto snapshot = [](const at::Tensor& t) {
    TORCH_CHECK(t.defined(), "KdaState::to_tensors: the state is empty (use initial_state)");
    return t.detach().to(at::kCPU).clone(at::MemoryFormat::Contiguous);
  };
  return {{kRecurrentName, snapshot(recurrent)},
          {kQConvName, snapshot(q_conv_inputs)},
          {kKConvName, snapshot(k_conv_inputs)},
          {kVConvName, snapshot(v_conv_inputs)}};
}

KdaState KdaState::to(const at::Device& device) const {
  return {recurrent.to(device), q_conv_inputs.to(device), k_conv_inputs.to(device),
          v_conv_inputs.to(device)};
}

Result<KdaState> KdaState::from_tensors(const std::map<std::string, at::Tensor>& tensors) {
  for (const auto& [name, tensor] : tensors) {
    if (name != kRecurrentName && name != kQConvName && name != kKConvName && name != kVConvName) {
      return invalid_argument("KdaState: unexpected tensor '{}' (expected {}, {}, {}, {})", name,
                              kRecurrentName, kQConvName, kKConvName, kVConvName);
    }
    if (!tensor.defined()) return invalid_argument("KdaState: tensor '{}' is undefined", name);
    if (!at::isFloatingType(tensor.scalar_type())) {
      return invalid_argument("KdaState: tensor '{}' must be floating point", name);
    }
  }
  for (const char* name : {kRecurrentName, kQConvName, kKConvName, kVConvName}) {
    if (tensors.count(name) == 0) return invalid_argument("KdaState: missing tensor '{}'", name);
  }
  KdaState state;
  state.recurrent = tensors.at(kRecurrentName);
  state.q_conv_inputs = tensors.at(kQConvName);
  state.k_conv_inputs = tensors.at(kKConvName);
  state.v_conv_inputs = tensors.at(kVConvName);
  const at::Tensor& s = state.recurrent;
  if (s.dim() != 4) {
    return invalid_argument("KdaState: '{}' must be [B, H, K, V], got {}", kRecurrentName,
                            shape_string(s));
  }
  if (s.scalar_type() != at::kFloat && s.scalar_type() != at::kDouble) {
    return invalid_argument("KdaState: '{}' must be fp32 or fp64", kRecurrentName);
  }
  const int64_t key_channels = s.size(1) * s.size(2), value_channels = s.size(1) * s.size(3);
  const std::pair<const char*, int64_t> convs[] = {
      {kQConvName, key_channels}, {kKConvName, key_channels}, {kVConvName, value_channels}};
  for (const auto& [name, channels] : convs) {
    const at::Tensor& c = tensors.at(name);
    if (c.dim() != 3 || c.size(0) != s.size(0) || c.size(1) != state.q_conv_inputs.size(1) ||
        c.size(2) != channels) {
      return invalid_argument(
          "KdaState: '{}' must be [B, conv_width-1, {}] with B = {} from '{}' and the conv "
          "length of '{}', got {}",
          name, channels, s.size(0), kRecurrentName, kQConvName, shape_string(c));
    }
    if (c.scalar_type() != state.q_conv_inputs.scalar_type()) {
      return invalid_argument("KdaState: '{}' and '{}' must have one dtype", name, kQConvName);
    }
  }
  return state;
}

std::string KdaState::to_bytes() const {
  const auto tensors = to_tensors();
  std::string out(kMagic, sizeof(kMagic));
  append_pod<uint32_t>(out, static_cast<uint32_t>(tensors.size()));
  for (const auto& [name, tensor] : tensors) {
    const auto code = dtype_code(tensor.scalar_type());
    TORCH_CHECK(code.has_value(), "KdaState::to_bytes: unsupported dtype ", tensor.scalar_type(),
                " for '", name, "'");
    append_pod<uint32_t>(out, static_cast<uint32_t>(name.size()));
    out.append(name);
    append_pod<uint8_t>(out, *code);
    append_pod<uint32_t>(out, static_cast<uint32_t>(tensor.dim()));
    for (int64_t size : tensor.sizes()) append_pod<int64_t>(out, size);
    const uint64_t byte_count = tensor.numel() * tensor.element_size();
    append_pod<uint64_t>(out, byte_count);
    if (byte_count > 0) out.append(static_cast<const char*>(tensor.data_ptr()), byte_count);
  }
  return out;
}

Result<KdaState> KdaState::from_bytes(const std::string& bytes) {
  ByteReader reader(bytes);
  const char* magic = nullptr;
  if (!reader.read_bytes(sizeof(kMagic), &magic) ||
      std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) {
    return corrupt(reader, "not a KdaState (bad magic)");
  }
  uint32_t count = 0;
  if (!reader.read(count)) return corrupt(reader, "truncated tensor count");
  if (count > 4) return corrupt(reader, fmt::format("{} tensors (a KdaState has 4)", count));
  std::map<std::string, at::Tensor> tensors;
  for (uint32_t i = 0; i < count; ++i) {
    uint32_t name_size = 0;
    const char* name_data = nullptr;
    if (!reader.read(name_size) || !reader.read_bytes(name_size, &name_data)) {
      return corrupt(reader, "truncated tensor name");
    }
    const std::string name(name_data, name_size);
    uint8_t code = 0;
    uint32_t rank = 0;
    if (!reader.read(code) || !reader.read(rank)) return corrupt(reader, "truncated '" + name + "'");
    const auto dtype = dtype_from_code(code);
    if (!dtype) return corrupt(reader, fmt::format("unknown dtype code {} for '{}'", code, name));
    if (rank > kMaxRank) return corrupt(reader, fmt::format("rank {} of '{}'", rank, name));
    std::vector<int64_t> sizes(rank);
    // Every size is bounded by the bytes left, so the element count cannot overflow unnoticed.
    const uint64_t limit = bytes.size();
    uint64_t numel = 1;
    for (auto& size : sizes) {
      if (!reader.read(size)) return corrupt(reader, "truncated shape of '" + name + "'");
      if (size < 0 || static_cast<uint64_t>(size) > limit) {
        return corrupt(reader, fmt::format("bad size {} in '{}'", size, name));
      }
      // Saturates at limit + 1 (more than the input can hold) without overflowing.
      if (size != 0 && numel > limit / static_cast<uint64_t>(size)) {
        numel = limit + 1;
      } else {
        numel = std::min(numel * static_cast<uint64_t>(size), limit + 1);
      }
    }
    uint64_t byte_count = 0;
    if (!reader.read(byte_count)) return corrupt(reader, "truncated '" + name + "'");
    const uint64_t element_size = c10::elementSize(*dtype);
    if (numel > limit || byte_count != numel * element_size) {
      return corrupt(reader, fmt::format("'{}' holds {} bytes, its shape needs {}", name,
                                         byte_count, numel * element_size));
    }
    const char* data = nullptr;
    if (!reader.read_bytes(byte_count, &data)) {
      return corrupt(reader, "truncated data of '" + name + "'");
    }
    at::Tensor tensor = at::empty(sizes, at::TensorOptions().dtype(*dtype));
    if (byte_count > 0) std::memcpy(tensor.data_ptr(), data, byte_count);
    if (!tensors.emplace(name, tensor).second) {
      return corrupt(reader, "duplicate tensor '" + name + "'");
    }
  }
  if (!reader.at_end()) return corrupt(reader, "bytes after the last tensor");
  return from_tensors(tensors);
}

// ---------------------------------------------------------------------------------------------
// IncrementalAttentionImpl

namespace {

constexpr double kL2NormEps = 1e-6;  // added to a head's sum of squares (q, k)
constexpr double kRmsNormEps = 1e-5;

}  // namespace

IncrementalAttentionImpl::IncrementalAttentionImpl(const IncrementalAttentionOptions& options)
    : options_(options) {
  const auto& o = options_;
  TORCH_CHECK(o.hidden > 0 && o.heads > 0 && o.head_k_dim > 0 && o.head_v_dim > 0 &&
                  o.decay_rank > 0 && o.conv_width >= 1 && o.chunk >= 1,
              "IncrementalAttention: sizes must be positive (hidden ", o.hidden, ", heads ",
              o.heads, ", head_k_dim ", o.head_k_dim, ", head_v_dim ", o.head_v_dim,
              ", decay_rank ", o.decay_rank, ", conv_width ", o.conv_width, ", chunk ", o.chunk,
              ")");
  TORCH_CHECK(o.g_min < 0, "IncrementalAttention: g_min must be negative, got ", o.g_min);
  const int64_t key_channels = o.heads * o.head_k_dim;
  const int64_t value_channels = o.heads * o.head_v_dim;
  auto linear = [](int64_t in, int64_t out) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
  };
  auto depthwise = [&](int64_t channels) {
    return torch::nn::Conv1d(torch::nn::Conv1dOptions(channels, channels, o.conv_width)
                                 .groups(channels)
                                 .bias(false));
  };
  q_proj_ = register_module("q_proj", linear(o.hidden, key_channels));
  k_proj_ = register_module("k_proj", linear(o.hidden, key_channels));
  v_proj_ = register_module("v_proj", linear(o.hidden, value_channels));
  q_conv1d_ = register_module("q_conv1d", depthwise(key_channels));
  k_conv1d_ = register_module("k_conv1d", depthwise(key_channels));
  v_conv1d_ = register_module("v_conv1d", depthwise(value_channels));
  b_proj_ = register_module("b_proj", linear(o.hidden, o.heads));
  f_a_proj_ = register_module("f_a_proj", linear(o.hidden, o.decay_rank));
  f_b_proj_ = register_module("f_b_proj", linear(o.decay_rank, key_channels));
  g_proj_ = register_module("g_proj", linear(o.hidden, value_channels));
  o_proj_ = register_module("o_proj", linear(value_channels, o.hidden));

  // Initial gate: exp(A) = 1, and dt_bias chosen so that at z = 0 each channel forgets at a rate
  // -g drawn log-uniformly from [1e-3, 1e-1] per token (memories of ~10 to ~1000 tokens):
  // g_min * sigmoid(dt_bias) = -rate, i.e. dt_bias = logit(rate / |g_min|).
  torch::NoGradGuard no_grad;
  A_log_ = register_parameter("A_log", torch::zeros({o.heads}));
  const at::Tensor rate =
      at::exp(at::rand({key_channels}) * (std::log(1e-1) - std::log(1e-3)) + std::log(1e-3));
  dt_bias_ = register_parameter("dt_bias", at::logit(rate / std::abs(o.g_min)));
  o_norm_ = register_module("o_norm", RmsNorm(o.head_v_dim, kRmsNormEps));
}

KdaState IncrementalAttentionImpl::initial_state(int64_t batch) const {
  const auto& o = options_;
  const at::TensorOptions params = q_proj_->weight.options().requires_grad(false);
  const at::ScalarType state_dtype =
      params.dtype() == at::kDouble ? at::kDouble : at::kFloat;
  KdaState state;
  state.recurrent =
      at::zeros({batch, o.heads, o.head_k_dim, o.head_v_dim}, params.dtype(state_dtype));
  state.q_conv_inputs = at::zeros({batch, o.conv_width - 1, o.heads * o.head_k_dim}, params);
  state.k_conv_inputs = at::zeros({batch, o.conv_width - 1, o.heads * o.head_k_dim}, params);
  state.v_conv_inputs = at::zeros({batch, o.conv_width - 1, o.heads * o.head_v_dim}, params);
  return state;
}

at::Tensor IncrementalAttentionImpl::conv_features(const at::Tensor& projected, const at::Tensor& weight,
                                                  at::Tensor& conv_inputs, int64_t head) const {
  at::Tensor y;
#ifdef ODYSSEY_WITH_CUDA_KERNELS
  if (kernels::kda_short_conv_supported(projected, conv_inputs, weight, head)) {
    y = kernels::kda_short_conv_autograd(projected, conv_inputs, weight, head, kL2NormEps);
  }
#endif
  if (!y.defined()) y = kda::short_conv_reference(projected, conv_inputs, weight, head, kL2NormEps);
  // The inputs the next call's window starts with: the last W - 1 of [conv_inputs | projected].
  const int64_t keep = options_.conv_width - 1, length = projected.size(1);
  conv_inputs = length >= keep ? projected.slice(1, length - keep, length).contiguous()
                               : at::cat({conv_inputs.slice(1, length, keep), projected}, 1);
  return y;
}

IncrementalAttentionImpl::Features IncrementalAttentionImpl::features(const at::Tensor& x,
                                                                      KdaState& state) {
  const auto& o = options_;
  TORCH_CHECK(x.dim() == 3 && x.size(2) == o.hidden,
              "IncrementalAttention: x must be [B, T, ", o.hidden, "], got ", x.sizes());
  const int64_t batch = x.size(0), length = x.size(1);
  const std::vector<int64_t> recurrent_shape = {batch, o.heads, o.head_k_dim, o.head_v_dim};
  TORCH_CHECK(state.recurrent.defined() &&
                  state.recurrent.sizes() == at::IntArrayRef(recurrent_shape),
              "IncrementalAttention: state.recurrent must be ", at::IntArrayRef(recurrent_shape),
              " (use initial_state(batch))");
  auto check_conv = [&](const at::Tensor& c, int64_t channels, const char* name) {
    const std::vector<int64_t> shape = {batch, o.conv_width - 1, channels};
    TORCH_CHECK(c.defined() && c.sizes() == at::IntArrayRef(shape), "IncrementalAttention: state.",
                name, " must be ", at::IntArrayRef(shape), " (use initial_state(batch))");
  };
  check_conv(state.q_conv_inputs, o.heads * o.head_k_dim, "q_conv_inputs");
  check_conv(state.k_conv_inputs, o.heads * o.head_k_dim, "k_conv_inputs");
  check_conv(state.v_conv_inputs, o.heads * o.head_v_dim, "v_conv_inputs");

  Features f;
  f.q = conv_features(q_proj_(x), q_conv1d_->weight, state.q_conv_inputs, o.head_k_dim)
            .view({batch, length, o.heads, o.head_k_dim});
  f.k = conv_features(k_proj_(x), k_conv1d_->weight, state.k_conv_inputs, o.head_k_dim)
            .view({batch, length, o.heads, o.head_k_dim});
  f.v = conv_features(v_proj_(x), v_conv1d_->weight, state.v_conv_inputs, 0)
            .view({batch, length, o.heads, o.head_v_dim});
  f.beta = at::sigmoid(b_proj_(x));
  const at::Tensor z = f_b_proj_(f_a_proj_(x)).view({batch, length, o.heads, o.head_k_dim});
  f.g = kda::gate(z, A_log_, dt_bias_, o.g_min);
  return f;
}

at::Tensor IncrementalAttentionImpl::output(const at::Tensor& x, const at::Tensor& o) {
  // o [B, T, H, V] -> RMSNorm per head (weight shared by heads) -> gate -> W_o.
  const at::Tensor normed = o_norm_(o);
  const at::Tensor gate = at::sigmoid(g_proj_(x)).view(o.sizes());
  return o_proj_((gate * normed).flatten(2));
}

at::Tensor IncrementalAttentionImpl::forward(const at::Tensor& x) {
  KdaState state = initial_state(x.size(0));
  return forward_chunk(x, state);
}

at::Tensor IncrementalAttentionImpl::forward_chunk(const at::Tensor& x, KdaState& state) {
  const Features f = features(x, state);
  const double scale = 1.0 / std::sqrt(static_cast<double>(options_.head_k_dim));
  kda::Output out =
      kda::chunked(f.q, f.k, f.v, f.g, f.beta, state.recurrent, scale, options_.chunk);
  state.recurrent = out.final_state;
  return output(x, out.o);
}

at::Tensor IncrementalAttentionImpl::step(const at::Tensor& x_t, KdaState& state) {
  TORCH_CHECK(x_t.dim() == 2, "IncrementalAttention::step: x_t must be [B, hidden], got ",
              x_t.sizes());
  const at::Tensor x = x_t.unsqueeze(1);
  const Features f = features(x, state);
  const double scale = 1.0 / std::sqrt(static_cast<double>(options_.head_k_dim));
  const at::Tensor o = kda::step(f.q.squeeze(1), f.k.squeeze(1), f.v.squeeze(1), f.g.squeeze(1),
                                 f.beta.squeeze(1), state.recurrent, scale);
  return output(x, o.unsqueeze(1)).squeeze(1);
}

}  // namespace odyssey::model
