// The dV' correction of pass 3 by blocks, checked in fp64 on the CPU (no GPU, no build of the
// project): the reverse walk keeps dV' of every 16-token chunk, the gradient of V' with the later
// chunks' V' depending on it through the state; a block of n sub-chunks needs the gradient with
// every V' of the block a function of the state entering it. They differ by
//   dV'_a (block) = dV'_a (chunk) + sum over b > a of (M_bb L_ba)^T dV'_b (chunk),
// M_bb the sub-chunk's own (I + L_bb)^-1 and L_ba = Diag(beta_b) P_ba the block's off-diagonal blocks
// (kernels/kda_block_gradient.cuh uses n = 2: Y = M_11 L_10; kernels/JOURNAL.md, "Eighteenth
// session"). Both views are built with autograd on one head of 4 sub-chunks of 4 tokens; the program
// prints each sub-chunk's difference with and without the correction and exits 1 if the corrected
// one is above 1e-10 of the largest gradient.
//   g++ -std=c++17 -O1 scripts/kda_dv_correction_check.cpp -I/usr/include/torch/csrc/api/include
//       -ltorch -ltorch_cpu -lc10 -o /tmp/dv_check && /tmp/dv_check
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <vector>

using at::Tensor;

// One chunk's V' (a graph node keeping its gradient) and M = (I + L)^-1.
struct Chunk {
  Tensor new_values, m;
};

int main() {
  at::manual_seed(3);
  const int64_t K = 6, V = 5, C = 4, n = 4, T = C * n;
  auto o = at::TensorOptions().dtype(at::kDouble);
  Tensor q = at::randn({T, K}, o), k = at::randn({T, K}, o) * 0.5, v = at::randn({T, V}, o);
  Tensor g = -at::rand({T, K}, o) * 0.5, beta = at::rand({T}, o), s0 = at::randn({K, V}, o);
  Tensor d_o = at::randn({T, V}, o), d_end = at::randn({K, V}, o);
  v.requires_grad_(true), s0.requires_grad_(true);
  // One chunk's forward (MODEL.md; scale 1, no anchoring: fp64) from state s: O, S', V' and M.
  auto chunk = [&](int64_t r0, int64_t len, const Tensor& s, Tensor& out, Tensor& s_next, Chunk& c) {
    Tensor qq = q.narrow(0, r0, len), kk = k.narrow(0, r0, len), vv = v.narrow(0, r0, len);
    Tensor gam = g.narrow(0, r0, len).cumsum(0), bb = beta.narrow(0, r0, len);
    Tensor e = gam.exp(), last = gam[len - 1];
    Tensor qh = qq * e, kh = kk * e, kt = kk / e, kb = kk * (last.unsqueeze(0) - gam).exp();
    Tensor p = at::tril(kh.matmul(kt.t()), -1), aqk = at::tril(qh.matmul(kt.t()));
    Tensor m = at::inverse(at::eye(len, o) + bb.unsqueeze(1) * p);
    Tensor w = m.matmul(bb.unsqueeze(1) * kh), u = m.matmul(bb.unsqueeze(1) * vv);
    c.new_values = u - w.matmul(s);
    c.new_values.retain_grad();
    c.m = m;
    out = qh.matmul(s) + aqk.matmul(c.new_values);
    s_next = last.exp().unsqueeze(1) * s + kb.t().matmul(c.new_values);
  };
  // The chunk view: n chunks of C tokens, each from the state the previous one leaves.
  std::vector<Chunk> cs(n);
  Tensor s = s0, loss = at::zeros({}, o);
  for (int64_t c = 0; c < n; ++c) {
    Tensor out, next;
    chunk(c * C, C, s, out, next, cs[c]);
    loss = loss + (out * d_o.narrow(0, c * C, C)).sum();
    s = next;
  }
  loss = loss + (s * d_end).sum();
  loss.backward();
  // The block view: one chunk of T tokens from s0.
  Chunk blk;
  Tensor out, end;
  chunk(0, T, s0, out, end, blk);
  ((out * d_o).sum() + (end * d_end).sum()).backward();
  double worst_v = 0, worst_d = 0, scale = blk.new_values.grad().abs().max().item<double>();
  // P and L of the block view (Gamma from the block's start), for the correction.
  Tensor gam = g.cumsum(0), e = gam.exp();
  Tensor pb = at::tril((k * e).matmul((k / e).t()), -1), lb = beta.unsqueeze(1) * pb;
  for (int64_t a = 0; a < n; ++a) {
    worst_v = std::max(worst_v, (blk.new_values.detach().narrow(0, a * C, C) - cs[a].new_values.detach()).abs().max().item<double>());
    Tensor corrected = cs[a].new_values.grad().clone();
    for (int64_t b = a + 1; b < n; ++b) {
      Tensor y = cs[b].m.matmul(lb.narrow(0, b * C, C).narrow(1, a * C, C));  // M_bb L_ba
      corrected += y.t().matmul(cs[b].new_values.grad());
    }
    const double d = (blk.new_values.grad().narrow(0, a * C, C) - corrected).abs().max().item<double>();
    const double plain = (blk.new_values.grad().narrow(0, a * C, C) - cs[a].new_values.grad()).abs().max().item<double>();
    std::printf("sub-chunk %ld: |dV'_block - corrected| %.3e (uncorrected %.3e)\n", (long)a, d, plain);
    worst_d = std::max(worst_d, d);
  }
  std::printf("V' block vs chunks %.3e; dV' worst %.3e of %.3e\n", worst_v, worst_d, scale);
  return worst_d < 1e-10 * scale ? 0 : 1;
}
