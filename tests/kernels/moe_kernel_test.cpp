// The MoE CUDA kernels (kernels/moe.h, kernels/moe_autograd.h) against the plain LibTorch
// references: router top-k with the balancing bias vs model::select_experts (n = 64 / 896 / 1024,
// ties from a saturated or constant bias), the quantile histogram vs
// QuantileBalancer::local_histogram (exact), the permutation vs model::permute_tokens (exact,
// experts without tokens), gather / weighted un-permute and their gradients vs model::permute /
// unpermute, SiTU-GLU forward and backward vs autograd of model::situ_glu in fp64, the expert
// GEMMs (at::_grouped_mm where it applies, and the per-expert loop) vs an fp64 loop, and the
// whole MoeImpl forward + backward on CUDA (bf16 and fp32) vs its fp64 reference path with every
// parameter gradient. Every comparison prints its max error. Skipped without a CUDA device.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include "kernels/grouped_gemm.h"
#include "kernels/moe.h"
#include "kernels/moe_autograd.h"
#include "kernels/moe_experts_sm90.h"
#include "kernels/torch_bindings.h"
#include "model/balancing.h"
#include "model/ffn.h"
#include "model/moe.h"
#include "model/precision.h"

namespace odyssey::kernels {
namespace {

namespace model = odyssey::model;

at::TensorOptions cuda(at::ScalarType dtype = at::kFloat) {
  return at::TensorOptions().device(at::kCUDA).dtype(dtype);
}

double max_abs(const at::Tensor& a) { return a.numel() == 0 ? 0.0 : a.abs().max().item<double>(); }

double max_error(const at::Tensor& got, const at::Tensor& expected) {
  return max_abs(got.to(at::kDouble).cpu() - expected.to(at::kDouble).cpu());
}

// got vs expected within tolerance * max(1e-6, |expected|max); prints the error.
void expect_close(const std::string& what, const at::Tensor& got, const at::Tensor& expected,
                  double tolerance) {
  ASSERT_TRUE(got.defined()) << what << ": no result";
  ASSERT_EQ(got.sizes(), expected.sizes()) << what;
  ASSERT_TRUE(at::isfinite(got.to(at::kFloat)).all().item<bool>()) << what << ": not finite";
  const double error = max_error(got, expected);
  const double scale = std::max(1e-6, max_abs(expected.to(at::kDouble)));
  std::printf("  %-58s max err %.3e (|ref| <= %.3e, %.2e relative)\n", what.c_str(), error, scale,
              error / scale);
  EXPECT_LE(error, tolerance * scale) << what;
}

class MoeKernel : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  }
};

// ---- router top-k ---------------------------------------------------------------------------------

struct TopkCheck {
  int64_t rows_with_boundary_tie = 0;
  int64_t set_mismatches = 0;  // among rows without a tie at the k-th place
};

// The kernel's selection against select_experts: per row, the selected biased values as a
// multiset (always equal for any valid top-k), the id sets where the k-th and (k+1)-th biased
// values differ, descending order, and p from the unbiased scores.
TopkCheck check_topk(const std::string& what, const at::Tensor& scores, const at::Tensor& bias,
                     int64_t k) {
  const MoeRouterTopk got = moe_router_topk(scores, bias, k);
  const at::Tensor expected = model::select_experts(scores, bias, k);
  const at::Tensor biased = (scores + bias.to(scores.device(), at::kFloat)).cpu();
  const at::Tensor got_ids = got.ids.cpu(), ref_ids = expected.cpu();
  const at::Tensor got_values = biased.gather(1, got_ids);
  const at::Tensor ref_values = biased.gather(1, ref_ids);
  EXPECT_TRUE(at::equal(std::get<0>(at::sort(got_values, 1)), std::get<0>(at::sort(ref_values, 1))))
      << what << ": the selected biased values differ from select_experts'";
  // Best first.
  EXPECT_TRUE((got_values.narrow(1, 0, k - 1) >= got_values.narrow(1, 1, k - 1)).all().item<bool>() ||
              k == 1)
      << what << ": ids not in descending order";
  TopkCheck check;
  const int64_t n = scores.size(1);
  const at::Tensor sorted = std::get<0>(at::sort(biased, 1, /*descending=*/true));
  const at::Tensor got_sorted = std::get<0>(at::sort(got_ids, 1)), ref_sorted = std::get<0>(at::sort(ref_ids, 1));
  for (int64_t i = 0; i < scores.size(0); ++i) {
    const bool tie = k < n && sorted[i][k - 1].item<float>() == sorted[i][k].item<float>();
    if (tie) {
      ++check.rows_with_boundary_tie;
    } else if (!at::equal(got_sorted[i], ref_sorted[i])) {
      ++check.set_mismatches;
    }
  }
  const at::Tensor chosen = scores.cpu().gather(1, got_ids);
  const at::Tensor p = chosen / chosen.sum(-1, true);
  std::printf("  %-40s rows %ld, ties at the k-th place %ld, set mismatches %ld\n", what.c_str(),
              static_cast<long>(scores.size(0)), static_cast<long>(check.rows_with_boundary_tie),
              static_cast<long>(check.set_mismatches));
  expect_close(what + ": p", got.weights, p, 1e-6);
  return check;
}

// The router's logits from bf16 GEMMs with fp32 results equal the reference's fp32 GEMM (a bf16
// model keeps W_r in fp32: split into three bf16 parts; a bf16 W_r is one part), and the split
// backward matches the fp32 gradients: dW to fp32 precision, dx (bf16) to bf16 rounding.
TEST_F(MoeKernel, RouterLogitsOnTensorCoresMatchTheFp32Gemm) {
  if (!moe_grouped_mm_compiled()) GTEST_SKIP() << "needs LibTorch >= 2.8";
  for (const at::ScalarType weight_dtype : {at::kFloat, at::kBFloat16}) {
    torch::manual_seed(11);
    const auto cuda = at::TensorOptions().device(at::kCUDA);
    const at::Tensor x = at::randn({333, 96}, cuda.dtype(at::kBFloat16)).requires_grad_(true);
    const at::Tensor w = (at::randn({40, 96}, cuda) * 0.1).to(weight_dtype).requires_grad_(true);
    ASSERT_TRUE(router_logits_applies(x, w));
    const at::Tensor logits = router_logits_autograd(x, w);
    ASSERT_EQ(logits.scalar_type(), at::kFloat);
    const at::Tensor xr = x.detach().to(at::kDouble).requires_grad_(true);
    const at::Tensor wr = w.detach().to(at::kDouble).requires_grad_(true);
    const at::Tensor ref = at::mm(xr, wr.t());
    auto rel = [](const at::Tensor& a, const at::Tensor& b) {
      return (a.to(at::kDouble) - b).abs().max().item<double>() / b.abs().max().item<double>();
    };
    const double fwd = rel(logits, ref);
    const at::Tensor g = at::randn({333, 40}, cuda);
    (logits * g).sum().backward();
    (ref * g.to(at::kDouble)).sum().backward();
    const double dx = rel(x.grad(), xr.grad()), dw = rel(w.grad(), wr.grad());
    std::printf("  router logits, %s W_r: forward %.2e, d x %.2e, d W %.2e (relative to the largest reference value)\n",
                weight_dtype == at::kFloat ? "fp32" : "bf16", fwd, dx, dw);
    EXPECT_LT(fwd, 2e-6);  // fp32 sums of exact products
    EXPECT_LT(dx, 8e-3);   // a bf16 result: one rounding of 2^-9
    EXPECT_LT(dw, weight_dtype == at::kFloat ? 2e-6 : 8e-3);
    EXPECT_EQ(x.grad().scalar_type(), at::kBFloat16);
    EXPECT_EQ(w.grad().scalar_type(), weight_dtype);
  }
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  EXPECT_FALSE(router_logits_applies(at::zeros({4, 8}, cuda), at::zeros({3, 8}, cuda)));  // fp32 tokens
}

TEST_F(MoeKernel, RouterWeightsFunctionMatchesAutogradOfTheFp64Reference) {
  // p = s[ids] / sum(s[ids]) with s = sigmoid(x W_r^T), recorded as one Function of x and W_r
  // (what MoeImpl::route records in training): p, d x and d W_r against autograd of the fp64
  // formula; and the fused kernel's logit gradient (the sum of its three bf16 parts) against the
  // fp64 chain through p and the sigmoid, zero outside the selection.
  if (!moe_grouped_mm_compiled()) GTEST_SKIP() << "needs LibTorch >= 2.8";
  struct Case {
    int64_t m, d, n, k;
  };
  for (const Case& c : std::vector<Case>{{300, 256, 896, 16}, {77, 96, 64, 8}, {40, 64, 33, 2}}) {
    for (at::ScalarType weight_dtype : {at::kFloat, at::kBFloat16}) {
      torch::manual_seed(c.n + c.k);
      const auto cuda = at::TensorOptions().device(at::kCUDA);
      const at::Tensor x = at::randn({c.m, c.d}, cuda.dtype(at::kBFloat16)).requires_grad_(true);
      const at::Tensor w = (at::randn({c.n, c.d}, cuda) * 0.1).to(weight_dtype).requires_grad_(true);
      at::Tensor scores, ids;
      {
        const c10::NoGradGuard no_grad;
        scores = at::sigmoid(router_logits_autograd(x, w));
        ids = moe_router_topk(scores, at::zeros({c.n}, cuda.dtype(at::kFloat)), c.k).ids;
      }
      const at::Tensor p = router_weights_autograd(x, w, scores, ids);
      const at::Tensor dp = at::randn({c.m, c.k}, cuda);
      p.backward(dp);

      const at::Tensor xr = x.detach().to(at::kDouble).requires_grad_(true);
      const at::Tensor wr = w.detach().to(at::kDouble).requires_grad_(true);
      const at::Tensor logits = at::mm(xr, wr.t());
      logits.retain_grad();
      const at::Tensor chosen = at::sigmoid(logits).gather(1, ids);
      const at::Tensor pr = chosen / chosen.sum(-1, true);
      pr.backward(dp.to(at::kDouble));
      auto rel = [](const at::Tensor& a, const at::Tensor& b) {
        return (a.to(at::kDouble) - b).abs().max().item<double>() / b.abs().max().item<double>();
      };
      const at::Tensor d_logits = moe_router_logit_gradient(scores, ids, dp);  // [m, k], aligned with ids
      const at::Tensor unselected = at::ones({c.m, c.n}, cuda.dtype(at::kBool)).scatter(1, ids, false);
      const std::string name = "m" + std::to_string(c.m) + " n" + std::to_string(c.n) + " k" + std::to_string(c.k) +
                               (weight_dtype == at::kFloat ? " fp32 W_r" : " bf16 W_r");
      const double e_p = rel(p, pr.detach()), e_logits = rel(d_logits, logits.grad().gather(1, ids));
      const double e_dx = rel(x.grad(), xr.grad()), e_dw = rel(w.grad(), wr.grad());
      std::printf("  router weights %s: p %.2e, d logits %.2e, d x %.2e, d W %.2e (relative to the largest reference value)\n",
                  name.c_str(), e_p, e_logits, e_dx, e_dw);
      EXPECT_LT(e_p, 4e-6) << name;        // fp32 scores (split-bf16 logits) against fp64
      EXPECT_LT(e_logits, 2e-5) << name;   // fp32 arithmetic on fp32 scores
      // The sparse backward's premise: no logit outside the selection has a gradient.
      EXPECT_EQ(logits.grad().masked_select(unselected).abs().max().item<double>(), 0.0) << name;
      EXPECT_LT(e_dx, 8e-3) << name;       // a bf16 result
      EXPECT_LT(e_dw, weight_dtype == at::kFloat ? 4e-5 : 8e-3) << name;
      EXPECT_EQ(x.grad().scalar_type(), at::kBFloat16) << name;
      EXPECT_EQ(w.grad().scalar_type(), weight_dtype) << name;
      // The same bits every run, and with the caller's permutation as with the backward's own.
      const at::Tensor dx_first = x.grad().clone(), dw_first = w.grad().clone();
      x.mutable_grad().zero_();
      w.mutable_grad().zero_();
      const MoePermutation permutation = moe_permutation(ids, c.n);
      router_weights_autograd(x, w, scores, ids, &permutation).backward(dp);
      EXPECT_TRUE(at::equal(x.grad(), dx_first)) << name;
      EXPECT_TRUE(at::equal(w.grad(), dw_first)) << name;
    }
  }
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  EXPECT_THROW(moe_router_logit_gradient(at::rand({4, 8}, cuda), at::zeros({4, 3}, cuda.dtype(at::kLong)),
                                         at::zeros({4, 2}, cuda)),
               c10::Error);  // d_p of another shape than ids
}

TEST_F(MoeKernel, SplitBf16PartsEqualTheCastChainBitForBit) {
  // moe_split_bf16 (the router's W_r parts in one pass) against the LibTorch chain it replaced:
  // part i = bf16(rest), rest -= part i; values across the exponent range, zeros and subnormals.
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  torch::manual_seed(7);
  const at::Tensor x = at::cat({at::randn({896, 1024}, cuda) * at::pow(10.0, at::randint(-30, 30, {896, 1}, cuda)),
                                at::zeros({1, 1024}, cuda), at::full({1, 1024}, 1e-41, cuda)})
                           .contiguous();
  for (int parts = 1; parts <= 3; ++parts) {
    const std::vector<at::Tensor> got = moe_split_bf16(x, parts);
    ASSERT_EQ(static_cast<int>(got.size()), parts);
    at::Tensor rest = x;
    for (int i = 0; i < parts; ++i) {
      const at::Tensor want = rest.to(at::kBFloat16);
      EXPECT_TRUE(at::equal(got[i], want)) << "part " << i << " of " << parts;
      rest = rest - want.to(at::kFloat);
    }
  }
  EXPECT_THROW(moe_split_bf16(x.to(at::kBFloat16), 2), c10::Error);
  EXPECT_THROW(moe_split_bf16(x, 4), c10::Error);
}

TEST_F(MoeKernel, RouterSparseBackwardMatchesTheDenseProductsUnderSkewedRouting) {
  // d x = G W_r and d W_r = G^T x for the logits' gradient G scattered to [m, n], against fp64
  // dense products, with every token picking expert 0, experts no token picks (their d W_r rows
  // exact zeros), two runs equal bit for bit, widths from 32 to 1056
  // (more than one 1024-column block of d W_r), up to 1024 experts and 32 slots.
  struct Case {
    int64_t m, d, n, k;
  };
  for (const Case& c : std::vector<Case>{{1000, 1024, 896, 16}, {3, 32, 40, 2}, {257, 1056, 1024, 32},
                                          {64, 96, 33, 1}}) {
    torch::manual_seed(c.m + c.n);
    const auto cuda = at::TensorOptions().device(at::kCUDA);
    // Expert 0 in every row, then k - 1 distinct others from the first half of the experts.
    const at::Tensor others = std::get<1>(at::rand({c.m, c.n / 2 - 1}, cuda).sort(1)).narrow(1, 0, c.k - 1) + 1;
    const at::Tensor ids = at::cat({at::zeros({c.m, 1}, cuda.dtype(at::kLong)), others}, 1).contiguous();
    const at::Tensor d_logits = at::randn({c.m, c.k}, cuda);
    const at::Tensor x = at::randn({c.m, c.d}, cuda.dtype(at::kBFloat16));
    const at::Tensor dense = at::zeros({c.m, c.n}, cuda.dtype(at::kDouble)).scatter(1, ids, d_logits.to(at::kDouble));
    const MoePermutation permutation = moe_permutation(ids, c.n);
    for (at::ScalarType weight_dtype : {at::kFloat, at::kBFloat16}) {
      const at::Tensor w = at::randn({c.n, c.d}, cuda).to(weight_dtype);
      const std::string name = "m" + std::to_string(c.m) + " d" + std::to_string(c.d) + " n" +
                               std::to_string(c.n) + " k" + std::to_string(c.k) +
                               (weight_dtype == at::kFloat ? " fp32 W_r" : " bf16 W_r");
      const at::Tensor dx = moe_router_dx(d_logits, ids, w);
      const at::Tensor dx_ref = at::mm(dense, w.to(at::kDouble));
      const at::Tensor dw = moe_router_dw(d_logits, x, permutation, weight_dtype);
      const at::Tensor dw_ref = at::mm(dense.t(), x.to(at::kDouble));
      auto rel = [](const at::Tensor& a, const at::Tensor& b) {
        return (a.to(at::kDouble) - b).abs().max().item<double>() / b.abs().max().item<double>();
      };
      const double e_dx = rel(dx, dx_ref), e_dw = rel(dw, dw_ref);
      std::printf("  router sparse backward %s: d x %.2e, d W %.2e\n", name.c_str(), e_dx, e_dw);
      EXPECT_EQ(dx.scalar_type(), at::kBFloat16) << name;
      EXPECT_EQ(dw.scalar_type(), weight_dtype) << name;
      EXPECT_LT(e_dx, 8e-3) << name;  // bf16 results of fp32 sums
      EXPECT_LT(e_dw, weight_dtype == at::kFloat ? 2e-6 : 8e-3) << name;
      const at::Tensor picked = at::zeros({c.n}, cuda.dtype(at::kBool)).index_fill_(0, ids.reshape({-1}), true);
      const at::Tensor unpicked_rows = dw.index_select(0, at::nonzero(picked.logical_not()).reshape({-1}));
      EXPECT_GT(unpicked_rows.size(0), 0) << name;
      EXPECT_EQ(unpicked_rows.abs().max().item<double>(), 0.0) << name;
      EXPECT_TRUE(at::equal(moe_router_dw(d_logits, x, permutation, weight_dtype), dw)) << name;
      EXPECT_TRUE(at::equal(moe_router_dx(d_logits, ids, w), dx)) << name;
    }
  }
  // No tokens: d x is empty, d W_r all zeros.
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  const at::Tensor no_ids = at::zeros({0, 4}, cuda.dtype(at::kLong));
  const at::Tensor none = at::zeros({0, 4}, cuda);
  EXPECT_EQ(moe_router_dx(none, no_ids, at::randn({16, 64}, cuda)).size(0), 0);
  const at::Tensor dw0 = moe_router_dw(none, at::zeros({0, 64}, cuda.dtype(at::kBFloat16)),
                                       moe_permutation(no_ids, 16), at::kFloat);
  EXPECT_EQ(dw0.abs().max().item<double>(), 0.0);
  // What they refuse, by name: d not a multiple of 32 (d x), more than 1024 experts, mismatched ids.
  EXPECT_THROW(moe_router_dx(at::zeros({4, 2}, cuda), at::zeros({4, 2}, cuda.dtype(at::kLong)),
                             at::zeros({8, 48}, cuda)),
               c10::Error);
  EXPECT_THROW(moe_router_dx(at::zeros({4, 2}, cuda), at::zeros({4, 2}, cuda.dtype(at::kLong)),
                             at::zeros({1025, 64}, cuda)),
               c10::Error);
  EXPECT_THROW(moe_router_dx(at::zeros({4, 2}, cuda), at::zeros({4, 3}, cuda.dtype(at::kLong)),
                             at::zeros({8, 64}, cuda)),
               c10::Error);
  EXPECT_FALSE(router_weights_applies(at::zeros({4, 48}, cuda.dtype(at::kBFloat16)), at::zeros({8, 48}, cuda), 2));
}

TEST_F(MoeKernel, RouterTopkMatchesSelectExperts) {
  struct Case {
    int64_t m, n, k;
  };
  for (const Case& c : std::vector<Case>{{1000, 64, 4}, {4096, 896, 16}, {333, 100, 7},
                                          {64, 1024, 32}, {17, 5, 5}, {9, 33, 1}}) {
    at::manual_seed(c.n + c.k);
    const at::Tensor scores = at::sigmoid(at::randn({c.m, c.n}, cuda()));
    const at::Tensor bias = at::randn({c.n}, cuda()) * 0.1;
    const std::string name = "m" + std::to_string(c.m) + " n" + std::to_string(c.n) + " k" + std::to_string(c.k);
    const TopkCheck check = check_topk(name, scores, bias, c.k);
    EXPECT_EQ(check.set_mismatches, 0) << name;
  }
}

TEST_F(MoeKernel, RouterTopkTiesKeepTheLowerExpertIds) {
  const int64_t m = 256, n = 896, k = 16;
  at::manual_seed(5);
  const at::Tensor scores = at::sigmoid(at::randn({m, n}, cuda()));
  // A saturated bias: s + b rounds to 2^30 for every expert (s < 1 is below half an ulp), so every
  // value ties and the kernel takes experts 0..k-1 in order.
  {
    const at::Tensor bias = at::full({n}, 1073741824.0, cuda());
    check_topk("saturated bias, all tied", scores, bias, k);
    const MoeRouterTopk got = moe_router_topk(scores, bias, k);
    const at::Tensor expected_ids = at::arange(k, cuda(at::kLong)).expand({m, k});
    EXPECT_TRUE(at::equal(got.ids, expected_ids)) << "ties must keep the lowest expert ids";
    const at::Tensor chosen = scores.narrow(1, 0, k);
    expect_close("saturated bias: p from the unbiased scores", got.weights,
                 chosen / chosen.sum(-1, true), 1e-6);
  }
  // 40 experts saturated (every third one), the rest far below: the lowest 16 of the 40.
  {
    at::Tensor bias = at::full({n}, -10.0, cuda());
    bias.slice(0, 0, 120, 3).fill_(1073741824.0);
    const MoeRouterTopk got = moe_router_topk(scores, bias, k);
    const at::Tensor expected_ids = (at::arange(k, cuda(at::kLong)) * 3).expand({m, k});
    EXPECT_TRUE(at::equal(got.ids, expected_ids)) << "partly saturated bias";
    check_topk("partly saturated bias", scores, bias, k);
  }
  // Constant scores, zero bias: everything ties.
  {
    const at::Tensor flat = at::full({m, 64}, 0.5, cuda());
    const MoeRouterTopk got = moe_router_topk(flat, at::zeros({64}, cuda()), 4);
    EXPECT_TRUE(at::equal(got.ids, at::arange(4, cuda(at::kLong)).expand({m, 4})));
    expect_close("constant scores: p = 1/k", got.weights, at::full({m, 4}, 0.25, cuda()), 1e-7);
  }
}

// Lane l of the kernel's warp holds experts l, l + 32, ...; each lane keeps a short list of its
// next best and refills it when it runs dry. Here one lane (or two) holds every winner, so the
// lists run dry again and again: the selection must still be select_experts', best first.
TEST_F(MoeKernel, RouterTopkTakesEveryExpertFromOneLane) {
  struct Case {
    int64_t m, n, k;
    std::vector<int64_t> lanes;
  };
  for (const Case& c : std::vector<Case>{{512, 896, 16, {7}}, {256, 1024, 32, {7, 8}}, {300, 100, 4, {3}},
                                          {128, 896, 28, {31}}}) {
    at::manual_seed(c.n + c.k);
    const at::Tensor scores = at::sigmoid(at::randn({c.m, c.n}, cuda()));
    at::Tensor bias = at::randn({c.n}, cuda()) * 0.1;
    for (const int64_t lane : c.lanes) bias.slice(0, lane, c.n, 32).add_(3.0);
    const std::string name = "winners in lanes of k " + std::to_string(c.k) + " n " + std::to_string(c.n);
    const TopkCheck check = check_topk(name, scores, bias, c.k);
    EXPECT_EQ(check.set_mismatches, 0) << name;
    const at::Tensor ids = moe_router_topk(scores, bias, c.k).ids.cpu();
    at::Tensor in_lanes = at::zeros_like(ids, at::kBool);
    for (const int64_t lane : c.lanes) in_lanes = in_lanes | ((ids % 32) == lane);
    EXPECT_TRUE(in_lanes.all().item<bool>()) << name << ": every winner comes from the boosted lanes";
  }
}

TEST_F(MoeKernel, RouterTopkRejectsUnsupportedSizes) {
  const at::Tensor scores = at::rand({4, 1100}, cuda());
  EXPECT_FALSE(moe_router_topk_supported(scores, 8));
  EXPECT_THROW(moe_router_topk(scores, at::zeros({1100}, cuda()), 8), c10::Error);
  EXPECT_EQ(moe_router_topk(nullptr, nullptr, nullptr, nullptr, 4, 64, 33, nullptr),
            cudaErrorInvalidValue);
}

// ---- quantile histogram -----------------------------------------------------------------------------

TEST_F(MoeKernel, QuantileHistogramEqualsTheReferenceExactly) {
  struct Case {
    int64_t m, n, k;
    bool literal_alpha;
    bool tied_scores;  // scores on a 1/16 grid: ties everywhere, also across the k-th place
  };
  for (const Case& c : std::vector<Case>{{1000, 64, 4, false, false}, {1000, 64, 4, true, false},
                                          {2048, 896, 16, false, false}, {500, 64, 4, false, true},
                                          {300, 896, 16, true, true}}) {
    at::manual_seed(c.m + c.n);
    at::Tensor scores = at::sigmoid(at::randn({c.m, c.n}, cuda()));
    if (c.tied_scores) scores = at::round(scores * 16.0) / 16.0;
    model::QuantileBalancerOptions options;
    options.num_experts = c.n;
    options.top_k = c.k;
    options.histogram_bins = 1000;
    options.literal_alpha = c.literal_alpha;
    model::QuantileBalancer reference(options), gpu(options);
    const at::Tensor bias = at::randn({c.n}, at::kFloat) * 0.05;
    ASSERT_TRUE(reference.restore({bias, 0}).ok());
    ASSERT_TRUE(gpu.restore({bias, 0}).ok());
    const at::Tensor expected = reference.local_histogram(scores.cpu());  // the LibTorch path
    const at::Tensor through_balancer = gpu.local_histogram(scores);      // dispatches to the kernel
    const auto [lo, hi] = reference.histogram_range();
    const at::Tensor direct =
        moe_quantile_histogram(scores, bias.cuda(), c.k, options.histogram_bins, lo, hi, c.literal_alpha);
    const std::string name = "m" + std::to_string(c.m) + " n" + std::to_string(c.n) + " k" +
                             std::to_string(c.k) + (c.literal_alpha ? " literal" : "") +
                             (c.tied_scores ? " tied" : "");
    const int64_t differing = (direct.cpu() != expected).sum().item<int64_t>();
    std::printf("  histogram %-32s bins differing %ld of %ld, total %ld (expected %ld)\n", name.c_str(),
                static_cast<long>(differing), static_cast<long>(expected.numel()),
                static_cast<long>(direct.sum().item<int64_t>()), static_cast<long>(c.m * c.n));
    EXPECT_TRUE(at::equal(direct.cpu(), expected)) << name;
    EXPECT_TRUE(at::equal(through_balancer.cpu(), expected)) << name << " (through the balancer)";
    // The targets from either histogram are then the same too.
    EXPECT_TRUE(at::equal(gpu.histogram_target(direct).cpu(), reference.histogram_target(expected).cpu()));
  }
}

// ---- permutation ----------------------------------------------------------------------------------------

void expect_permutation_matches(const std::string& what, const at::Tensor& selected, int64_t n) {
  const MoePermutation got = moe_permutation(selected, n);
  const model::TokenPermutation expected = model::permute_tokens(selected, n);
  const int64_t copies = selected.numel();
  EXPECT_TRUE(at::equal(got.tokens_per_expert.cpu(), expected.tokens_per_expert.cpu())) << what << ": counts";
  EXPECT_TRUE(at::equal(got.source.cpu(), expected.source.cpu())) << what << ": source (stable order)";
  EXPECT_TRUE(at::equal(got.token.cpu(), expected.token.cpu())) << what << ": token";
  const at::Tensor cumulative = at::cumsum(expected.tokens_per_expert.cpu(), 0);
  EXPECT_TRUE(at::equal(got.offsets.cpu().narrow(0, 1, n), cumulative)) << what << ": offsets";
  EXPECT_EQ(got.offsets.cpu()[0].item<int64_t>(), 0) << what;
  EXPECT_TRUE(at::equal(got.group_ends.cpu().to(at::kLong), cumulative)) << what << ": group_ends";
  EXPECT_TRUE(at::equal(got.inverse.index_select(0, got.source).cpu(), at::arange(copies, at::kLong)))
      << what << ": inverse";
  const int64_t empty = (expected.tokens_per_expert == 0).sum().item<int64_t>();
  std::printf("  permutation %-36s copies %ld, experts without tokens %ld\n", what.c_str(),
              static_cast<long>(copies), static_cast<long>(empty));
}

TEST_F(MoeKernel, PermutationEqualsPermuteTokensExactly) {
  struct Case {
    int64_t m, n, k;
  };
  for (const Case& c : std::vector<Case>{{1000, 64, 4}, {8192, 896, 16}, {3, 10, 2}, {5000, 8192, 2}}) {
    at::manual_seed(c.m);
    // Top-k selections with the upper half of the experts pushed out: experts without tokens.
    const at::Tensor scores = at::sigmoid(at::randn({c.m, c.n}, cuda()));
    at::Tensor bias = at::zeros({c.n}, cuda());
    bias.narrow(0, c.n / 2, c.n - c.n / 2).fill_(-10.0);
    const at::Tensor selected = model::select_experts(scores, bias, c.k);
    const std::string name = "m" + std::to_string(c.m) + " n" + std::to_string(c.n) + " k" + std::to_string(c.k);
    expect_permutation_matches(name + " top-k", selected, c.n);
    // Arbitrary ids (repeats within a token allowed).
    expect_permutation_matches(name + " random ids", at::randint(0, c.n, {c.m, c.k}, cuda(at::kLong)), c.n);
  }
  // No tokens at all.
  const MoePermutation none = moe_permutation(at::zeros({0, 4}, cuda(at::kLong)), 64);
  EXPECT_EQ(none.tokens_per_expert.sum().item<int64_t>(), 0);
  EXPECT_EQ(none.offsets.cpu()[64].item<int64_t>(), 0);
}

// The top-k routing of m random tokens over n experts (no bias): p and both permutations.
struct Routing {
  at::Tensor weights;
  MoePermutation perm;
  model::TokenPermutation ref;
};

Routing random_routing(int64_t m, int64_t n, int64_t k) {
  const at::Tensor scores = at::sigmoid(at::randn({m, n}, cuda()));
  const at::Tensor selected = model::select_experts(scores, at::zeros({n}, cuda()), k);
  const at::Tensor chosen = scores.gather(1, selected);
  return {chosen / chosen.sum(-1, true), moe_permutation(selected, n), model::permute_tokens(selected, n)};
}

TEST_F(MoeKernel, PermuteAndUnpermuteMatchTheReferenceWithGradients) {
  const int64_t m = 777, n = 64, k = 4, width = 96;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    at::manual_seed(3);
    const Routing routing = random_routing(m, n, k);
    const at::Tensor& weights = routing.weights;
    const MoePermutation& perm = routing.perm;
    const model::TokenPermutation& ref = routing.ref;
    const std::string tag = dtype == at::kFloat ? " fp32" : " bf16";

    const at::Tensor tokens = at::randn({m, width}, cuda(dtype));
    EXPECT_TRUE(at::equal(moe_gather_rows(tokens, perm.token), model::permute(tokens, ref))) << "gather" << tag;

    const at::Tensor copies = at::randn({m * k, width}, cuda(dtype));
    const at::Tensor expected = model::unpermute(copies, ref, weights);
    const at::Tensor got = moe_unpermute(copies, perm, weights, at::kFloat);
    expect_close("unpermute" + tag, got, expected, 1e-5);

    // Gradients through both autograd functions vs autograd of the reference (fp64 copies).
    const at::Tensor d_out = at::randn({m, width}, cuda());
    auto run = [&](bool kernels) {
      const c10::AutoGradMode grad(true);
      at::Tensor t = (kernels ? tokens : tokens.to(at::kDouble)).detach().requires_grad_(true);
      at::Tensor w = (kernels ? weights : weights.to(at::kDouble)).detach().requires_grad_(true);
      const at::Tensor rows = kernels ? moe_permute_autograd(t, perm) : model::permute(t, ref);
      const at::Tensor scaled = rows * 1.5;  // something between the two steps
      const at::Tensor out = kernels ? moe_unpermute_autograd(scaled, perm, w) : model::unpermute(scaled, ref, w);
      (out.to(at::kDouble) * d_out.to(at::kDouble)).sum().backward();
      return std::make_pair(t.grad(), w.grad());
    };
    const auto [dt, dw] = run(true);
    const auto [dt_ref, dw_ref] = run(false);
    const double tolerance = dtype == at::kFloat ? 1e-5 : 2e-2;
    expect_close("permute backward (d tokens)" + tag, dt, dt_ref, tolerance);
    expect_close("unpermute backward (d weights)" + tag, dw, dw_ref, tolerance);
  }
}

TEST_F(MoeKernel, UnpermuteAndItsBackwardMatchTheReferenceAtEveryWidth) {
  // Widths below a warp, not a multiple of 32, the layer's 384 and above the 1024 threads a CTA
  // can have: every column once, whatever the CTA's shape.
  const int64_t m = 300, n = 40, k = 3;
  at::manual_seed(4);
  const Routing routing = random_routing(m, n, k);
  const at::Tensor& weights = routing.weights;
  const MoePermutation& perm = routing.perm;
  const model::TokenPermutation& ref = routing.ref;
  for (const int64_t width : {1, 33, 96, 384, 1100}) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      const std::string tag = " width " + std::to_string(width) + (dtype == at::kFloat ? " fp32" : " bf16");
      const at::Tensor copies = at::randn({m * k, width}, cuda(dtype));
      expect_close("unpermute" + tag, moe_unpermute(copies, perm, weights, at::kFloat),
                   model::unpermute(copies, ref, weights), 1e-5);
      const at::Tensor d_out = at::randn({m, width}, cuda());
      const MoeUnpermuteGradients got = moe_unpermute_backward(copies, perm, weights, d_out, true);
      // d copies: one fp32 product rounded once, as LibTorch rounds it: equal bit for bit.
      const at::Tensor row_weight = weights.reshape({-1}).index_select(0, perm.source).unsqueeze(1);
      const at::Tensor d_copies = (row_weight * d_out.index_select(0, perm.token)).to(dtype);
      EXPECT_TRUE(at::equal(got.d_copies, d_copies)) << "d copies" << tag;
      // d p: <d_out[token], copy> for each (token, slot).
      const at::Tensor token_of_copy = at::arange(m * k, cuda(at::kLong)).div(k, /*rounding_mode=*/"floor");
      const at::Tensor d_weights = (d_out.to(at::kDouble).index_select(0, token_of_copy) *
                                    copies.to(at::kDouble).index_select(0, perm.inverse))
                                       .sum(1)
                                       .reshape({m, k});
      expect_close("unpermute backward d p" + tag, got.d_weights, d_weights, 1e-5);
      // Without d p: the same d copies, no d p.
      const MoeUnpermuteGradients copies_only = moe_unpermute_backward(copies, perm, weights, d_out, false);
      EXPECT_FALSE(copies_only.d_weights.defined()) << tag;
      EXPECT_TRUE(at::equal(copies_only.d_copies, d_copies)) << "d copies without d p" << tag;
    }
  }
}

TEST_F(MoeKernel, UnpermuteInSixteenBytePiecesEqualsTheColumnKernelBitForBit) {
  // bf16 copies of widths divisible by 8 take the 16-byte path (8 columns a thread, 8 slots' rows
  // loaded at a time): the same fmaf in slot order as the one-column-a-thread kernel, so the same
  // bits, for fp32 and bf16 results, with and without weights, and slot counts past 8.
  for (const int64_t k : {1, 3, 16, 20}) {
    const int64_t m = 257, n = 40;
    at::manual_seed(5 + k);
    const Routing routing = random_routing(m, n, k);
    for (const int64_t width : {8, 384, 1104}) {
      const at::Tensor copies = at::randn({m * k, width}, cuda(at::kBFloat16));
      for (at::ScalarType out_dtype : {at::kFloat, at::kBFloat16}) {
        for (const bool weighted : {true, false}) {
          const at::Tensor w = weighted ? routing.weights : at::Tensor();
          const std::string tag = "k " + std::to_string(k) + " width " + std::to_string(width) +
                                  (out_dtype == at::kFloat ? " fp32 out" : " bf16 out") + (weighted ? "" : " no weights");
          EXPECT_TRUE(at::equal(moe_unpermute(copies, routing.perm, w, out_dtype),
                                moe_unpermute(copies, routing.perm, w, out_dtype, /*vectors=*/false)))
              << tag;
        }
      }
    }
  }
}

// ---- SiTU-GLU ----------------------------------------------------------------------------------------------

TEST_F(MoeKernel, SituGluForwardAndBackwardMatchAutogradOfTheReference) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    at::manual_seed(11);
    // Wide inputs so both caps saturate somewhere (|g| up to ~24, |u| up to ~60).
    const at::Tensor gate = (at::randn({513, 129}, cuda()) * 6.0).to(dtype);
    const at::Tensor up = (at::randn({513, 129}, cuda()) * 15.0).to(dtype);
    const at::Tensor dh = at::randn({513, 129}, cuda()).to(dtype);
    const c10::AutoGradMode grad(true);
    const at::Tensor g64 = gate.to(at::kDouble).requires_grad_(true);
    const at::Tensor u64 = up.to(at::kDouble).requires_grad_(true);
    const at::Tensor h64 = model::situ_glu(g64, u64, 4.0, 25.0);
    (h64 * dh.to(at::kDouble)).sum().backward();
    const std::string tag = dtype == at::kFloat ? " fp32" : " bf16";
    const double tolerance = dtype == at::kFloat ? 1e-5 : 1e-2;  // one rounding to bf16: 2^-9
    expect_close("situ_glu forward" + tag, situ_glu(gate, up, 4.0, 25.0), h64.detach(), tolerance);
    const SituGluGradients d = situ_glu_backward(gate, up, dh, 4.0, 25.0);
    expect_close("situ_glu d gate" + tag, d.d_gate, g64.grad(), tolerance);
    expect_close("situ_glu d up" + tag, d.d_up, u64.grad(), tolerance);
    // Through the autograd function.
    const at::Tensor g = gate.detach().requires_grad_(true), u = up.detach().requires_grad_(true);
    (situ_glu_autograd(g, u, 4.0, 25.0).to(at::kDouble) * dh.to(at::kDouble)).sum().backward();
    expect_close("situ_glu_autograd d gate" + tag, g.grad(), g64.grad(), tolerance);
  }
}

TEST_F(MoeKernel, SituGluBackwardWithHEqualsTheTwoPassesExactly) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    at::manual_seed(12);
    const at::Tensor gate = (at::randn({777, 65}, cuda()) * 6.0).to(dtype);
    const at::Tensor up = (at::randn({777, 65}, cuda()) * 15.0).to(dtype);
    const at::Tensor dh = at::randn({777, 65}, cuda()).to(dtype);
    const std::string tag = dtype == at::kFloat ? " fp32" : " bf16";
    const SituGluBackwardWithH fused = situ_glu_backward_with_h(gate, up, dh, 4.0, 25.0);
    const SituGluGradients separate = situ_glu_backward(gate, up, dh, 4.0, 25.0);
    EXPECT_TRUE(at::equal(fused.h, situ_glu(gate, up, 4.0, 25.0))) << "h" << tag;
    EXPECT_TRUE(at::equal(fused.d_gate, separate.d_gate)) << "d gate" << tag;
    EXPECT_TRUE(at::equal(fused.d_up, separate.d_up)) << "d up" << tag;
    const SituGluBackwardWithH without_h = situ_glu_backward_with_h(gate, up, dh, 4.0, 25.0, /*want_h=*/false);
    EXPECT_FALSE(without_h.h.defined()) << tag;
    EXPECT_TRUE(at::equal(without_h.d_gate, separate.d_gate)) << "d gate without h" << tag;
    std::printf("  situ_glu_backward_with_h%s: h, d gate, d up equal to the two passes bit for bit\n", tag.c_str());
  }
  EXPECT_THROW(situ_glu_backward_with_h(at::zeros({4, 8}, cuda()), at::zeros({4, 9}, cuda()),
                                        at::zeros({4, 8}, cuda()), 4.0, 25.0),
               c10::Error);
}

TEST_F(MoeKernel, SituGluInSixteenBytePiecesEqualsTheElementPassBitForBit) {
  // bf16 with a count of whole 8-element pieces and 16-byte aligned pointers takes the kernels that
  // move 16 bytes at a time; the same values one element into a buffer (2-byte aligned) take the
  // element-by-element kernels. Every element must come out the same, forward and backward.
  at::manual_seed(14);
  const int64_t n = 1031 * 8;
  auto aligned_and_shifted = [&](const at::Tensor& values) {
    at::Tensor shifted = at::zeros({n + 1}, values.options()).narrow(0, 1, n);
    shifted.copy_(values);
    EXPECT_NE(reinterpret_cast<uintptr_t>(shifted.data_ptr()) % 16, 0u);
    return std::make_pair(values, shifted);
  };
  const auto [gate, gate_shifted] = aligned_and_shifted((at::randn({n}, cuda()) * 6.0).to(at::kBFloat16));
  const auto [up, up_shifted] = aligned_and_shifted((at::randn({n}, cuda()) * 15.0).to(at::kBFloat16));
  const auto [dh, dh_shifted] = aligned_and_shifted(at::randn({n}, cuda()).to(at::kBFloat16));
  ASSERT_EQ(reinterpret_cast<uintptr_t>(gate.data_ptr()) % 16, 0u);
  EXPECT_TRUE(at::equal(situ_glu(gate, up, 4.0, 25.0), situ_glu(gate_shifted, up_shifted, 4.0, 25.0))) << "h";
  const SituGluBackwardWithH pieces = situ_glu_backward_with_h(gate, up, dh, 4.0, 25.0);
  const SituGluBackwardWithH elements = situ_glu_backward_with_h(gate_shifted, up_shifted, dh_shifted, 4.0, 25.0);
  EXPECT_TRUE(at::equal(pieces.h, elements.h)) << "recomputed h";
  EXPECT_TRUE(at::equal(pieces.d_gate, elements.d_gate)) << "d gate";
  EXPECT_TRUE(at::equal(pieces.d_up, elements.d_up)) << "d up";
  EXPECT_TRUE(at::equal(pieces.h, situ_glu(gate, up, 4.0, 25.0))) << "the backward's h is the forward's";
  std::printf("  situ_glu in 16-byte pieces: h, d gate, d up equal to the element-by-element kernels\n");
}

// ---- expert GEMMs ------------------------------------------------------------------------------------------

// StackedExperts in fp64, one expert at a time (the reference).
at::Tensor experts_reference(const at::Tensor& rows, const at::Tensor& gate, const at::Tensor& up,
                             const at::Tensor& down, const at::Tensor& counts) {
  const at::Tensor host = counts.cpu();
  std::vector<at::Tensor> out;
  int64_t start = 0;
  for (int64_t e = 0; e < gate.size(0); ++e) {
    const int64_t c = host[e].item<int64_t>();
    if (c == 0) continue;
    const at::Tensor x = rows.narrow(0, start, c);
    const at::Tensor h = model::situ_glu(at::matmul(x, gate[e].t()), at::matmul(x, up[e].t()), 4.0, 25.0);
    out.push_back(at::matmul(h, down[e].t()));
    start += c;
  }
  return at::cat(out, 0);
}

// m tokens routed to k of n >= 16 experts: every token picks expert 0 (with m = 700, k = 2: 700
// rows, tiles of 117 rows, 22 chunks of 32), experts 13..15 get no rows, the rest at random.
MoePermutation popular_and_empty_experts(int64_t m, int64_t n, int64_t k) {
  at::Tensor bias = at::zeros({n}, cuda());
  bias[0].fill_(10.0);
  bias.narrow(0, 13, 3).fill_(-10.0);
  return moe_permutation(model::select_experts(at::sigmoid(at::randn({m, n}, cuda())), bias, k), n);
}

// y and the gradients of <y, dy> with respect to rows, gate, up and down: through
// moe_experts_autograd with `gemm`, or (reference) through experts_reference in fp64.
std::vector<at::Tensor> expert_outputs_and_grads(const at::Tensor& rows, const at::Tensor& gate,
                                                 const at::Tensor& up, const at::Tensor& down,
                                                 const at::Tensor& dy, const MoePermutation& perm,
                                                 bool reference, MoeGemm gemm) {
  const c10::AutoGradMode grad(true);
  auto leaf = [&](const at::Tensor& t) { return (reference ? t.to(at::kDouble) : t).detach().requires_grad_(true); };
  std::vector<at::Tensor> in = {leaf(rows), leaf(gate), leaf(up), leaf(down)};
  const at::Tensor y = reference ? experts_reference(in[0], in[1], in[2], in[3], perm.tokens_per_expert)
                                 : moe_experts_autograd(in[0], in[1], in[2], in[3], perm, 4.0, 25.0, gemm);
  (y.to(at::kDouble) * dy.to(at::kDouble)).sum().backward();
  std::vector<at::Tensor> out = {y.detach()};
  for (const at::Tensor& t : in) out.push_back(t.grad());
  return out;
}

TEST_F(MoeKernel, ExpertGemmsMatchTheLoopAndTheFp64Reference) {
  const int64_t m = 300, n = 12, k = 2, latent = 64, ffn = 48;
  at::manual_seed(21);
  // Experts 9..11 get no tokens.
  at::Tensor bias = at::zeros({n}, cuda());
  bias.narrow(0, 9, 3).fill_(-10.0);
  const at::Tensor selected = model::select_experts(at::sigmoid(at::randn({m, n}, cuda())), bias, k);
  const MoePermutation perm = moe_permutation(selected, n);
  std::printf("  grouped GEMM compiled in: %s\n", moe_grouped_mm_compiled() ? "yes" : "no (LibTorch < 2.8)");
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor rows = at::randn({m * k, latent}, cuda(dtype));
    const at::Tensor gate = (at::randn({n, ffn, latent}, cuda()) * 0.2).to(dtype);
    const at::Tensor up = (at::randn({n, ffn, latent}, cuda()) * 0.2).to(dtype);
    const at::Tensor down = (at::randn({n, latent, ffn}, cuda()) * 0.2).to(dtype);
    const at::Tensor dy = at::randn({m * k, latent}, cuda());
    auto grads_of = [&](bool reference, MoeGemm gemm) {
      return expert_outputs_and_grads(rows, gate, up, down, dy, perm, reference, gemm);
    };
    const std::vector<at::Tensor> expected = grads_of(true, MoeGemm::kLoop);
    const std::vector<const char*> names = {"y", "d rows", "d gate_proj", "d up_proj", "d down_proj"};
    const std::string tag = dtype == at::kFloat ? " fp32" : " bf16";
    const double tolerance = dtype == at::kFloat ? 1e-4 : 3e-2;
    std::vector<MoeGemm> gemms = {MoeGemm::kLoop};
    if (moe_grouped_mm_applies(rows, gate, up, down)) gemms.push_back(MoeGemm::kGrouped);
    if (cublas_grouped_gemm_applies(rows, gate)) gemms.push_back(MoeGemm::kCublas);
    for (MoeGemm gemm : gemms) {
      const std::vector<at::Tensor> got = grads_of(false, gemm);
      const char* form = gemm == MoeGemm::kGrouped ? "grouped " : gemm == MoeGemm::kCublas ? "cublas " : "loop ";
      for (size_t i = 0; i < got.size(); ++i) {
        expect_close(std::string(form) + names[i] + tag, got[i], expected[i], tolerance);
      }
      // Experts without tokens get exactly zero weight gradients.
      for (size_t i = 2; i < got.size(); ++i) {
        EXPECT_EQ(max_abs(got[i].narrow(0, 9, 3)), 0.0) << names[i] << tag;
      }
    }
    if (dtype == at::kFloat && cublas_grouped_gemm_applies(rows, gate)) {
      // fp32 has no at::_grouped_mm: kAuto takes cuBLAS's grouped GEMM, not one at::mm an expert.
      const std::vector<at::Tensor> automatic = grads_of(false, MoeGemm::kAuto), cublas = grads_of(false, MoeGemm::kCublas);
      for (size_t i = 0; i < automatic.size(); ++i)
        EXPECT_TRUE(at::equal(automatic[i], cublas[i])) << "kAuto is kCublas for fp32: " << names[i];
    }
  }
}

TEST_F(MoeKernel, GroupedGemmsMatchTheLoopOfMatmulsAndFp64) {
  // kernels/grouped_gemm.h: every expert's block of rows times its weight in one launch, against a
  // loop of at::mm on the same operands and an fp64 loop. Blocks: empty at the start, in the middle
  // and at the end, one expert with most of the rows (several 64-row tiles), sizes that are not
  // multiples of the tiles; weights given as [E, K, N] and as the transposed view of [E, N, K] (both
  // layouts the experts' GEMMs pass). fp32 through our CUDA-core kernels (both thread forms; kAuto takes one)
  // and cuBLAS's grouped GEMM, bf16 through cuBLAS; widths with and without 16-byte rows.
  if (!cublas_grouped_gemm_compiled()) GTEST_SKIP() << "built against cuBLAS < 12.5";
  const std::vector<int64_t> counts = {0, 5, 301, 0, 1, 17, 64, 0, 3, 0, 65, 128};
  const int64_t experts = static_cast<int64_t>(counts.size());
  int64_t rows_total = 0;
  for (int64_t c : counts) rows_total += c;
  at::manual_seed(77);
  struct Form {
    at::ScalarType dtype;
    GroupedGemmBackend backend;
    const char* name;
  };
  for (const auto& [K, N] : std::vector<std::pair<int64_t, int64_t>>{{96, 40}, {384, 192}, {37, 130}}) {
    for (const Form& form : {Form{at::kFloat, GroupedGemmBackend::kSimt8x8, "fp32 kSimt8x8"},
                             Form{at::kFloat, GroupedGemmBackend::kSimt4x4, "fp32 kSimt4x4"},
                             Form{at::kFloat, GroupedGemmBackend::kCublas, "fp32 kCublas"},
                             Form{at::kBFloat16, GroupedGemmBackend::kAuto, "bf16 kAuto (cuBLAS)"}}) {
      const std::string tag = " " + std::string(form.name) + " K=" + std::to_string(K) + " N=" + std::to_string(N);
      const at::Tensor x = at::randn({rows_total, K}, cuda(form.dtype));
      const at::Tensor w_kn = at::randn({experts, K, N}, cuda(form.dtype));
      const at::Tensor w_nk = at::randn({experts, N, K}, cuda(form.dtype));
      const at::Tensor dy = at::randn({rows_total, N}, cuda(form.dtype));
      auto loop_rows_times = [&](const at::Tensor& a, const at::Tensor& w) {
        at::Tensor out = at::empty({a.size(0), w.size(2)}, a.options());
        int64_t start = 0;
        for (int64_t e = 0; e < experts; ++e) {
          if (counts[static_cast<size_t>(e)] == 0) continue;
          out.narrow(0, start, counts[static_cast<size_t>(e)])
              .copy_(at::mm(a.narrow(0, start, counts[static_cast<size_t>(e)]), w[e]));
          start += counts[static_cast<size_t>(e)];
        }
        return out;
      };
      const bool fp32 = form.dtype == at::kFloat;
      const double tolerance = fp32 ? 1e-5 : 1e-2;
      const at::Tensor got_kn = grouped_rows_times(x, w_kn, counts, form.backend);
      const at::Tensor got_nk = grouped_rows_times(x, w_nk.transpose(1, 2), counts, form.backend);
      expect_close("rows times [E, K, N]" + tag, got_kn, loop_rows_times(x, w_kn), tolerance);
      expect_close("rows times the transposed [E, N, K]" + tag, got_nk, loop_rows_times(x, w_nk.transpose(1, 2)),
                   tolerance);
      if (fp32) {
        // An fp32 GEMM's accuracy: against the fp64 products, within fp32 rounding of K-term sums.
        expect_close("rows times [E, K, N] vs fp64" + tag, got_kn,
                     loop_rows_times(x.to(at::kDouble), w_kn.to(at::kDouble)), 2e-6);
      }
      // The weight gradient: a_e^T b_e, exact zeros for the empty blocks (the CUDA-core kernels write every
      // output itself, in memory it did not clear).
      const at::Tensor grad = grouped_weight_grad(dy, x, counts, form.backend);
      ASSERT_EQ(grad.sizes(), (std::vector<int64_t>{experts, N, K}));
      int64_t start = 0;
      for (int64_t e = 0; e < experts; ++e) {
        const int64_t c = counts[static_cast<size_t>(e)];
        if (c == 0) {
          EXPECT_EQ(max_abs(grad[e]), 0.0) << "empty expert " << e << tag;
          EXPECT_FALSE(at::isnan(grad[e]).any().item<bool>()) << "empty expert " << e << tag;
          continue;
        }
        const at::Tensor a = dy.narrow(0, start, c), b = x.narrow(0, start, c);
        expect_close("weight grad of expert " + std::to_string(e) + tag, grad[e], at::mm(a.t(), b), tolerance);
        if (fp32) {
          expect_close("weight grad of expert " + std::to_string(e) + " vs fp64" + tag, grad[e],
                       at::mm(a.t().to(at::kDouble), b.to(at::kDouble)), 2e-6);
        }
        start += c;
      }
      if (form.backend == GroupedGemmBackend::kSimt8x8 || form.backend == GroupedGemmBackend::kSimt4x4) {
        // One FMA chain an output, in a fixed order: the same bits every run and in both thread forms,
        // and kAuto is one of them.
        EXPECT_TRUE(at::equal(got_kn, grouped_rows_times(x, w_kn, counts))) << tag;
        EXPECT_TRUE(at::equal(got_nk, grouped_rows_times(x, w_nk.transpose(1, 2), counts))) << tag;
        EXPECT_TRUE(at::equal(grad, grouped_weight_grad(dy, x, counts))) << tag;
      }
    }
  }
  // Bad input names the call and what is wrong.
  const at::Tensor x = at::randn({10, 8}, cuda());
  try {
    grouped_rows_times(x, at::randn({3, 8, 4}, cuda()), {4, 4, 3});
    ADD_FAILURE() << "counts summing to 11 for 10 rows were accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the counts sum to 11, the rows are 10"), std::string::npos) << e.what();
  }
  try {
    const at::Tensor xb = x.to(at::kBFloat16);
    grouped_weight_grad(xb, xb, {4, 6}, GroupedGemmBackend::kSimt8x8);
    ADD_FAILURE() << "bf16 operands were accepted by kSimt8x8";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("take fp32 operands only; got BFloat16"), std::string::npos) << e.what();
  }
  // No rows at all: zeros from the weight gradient, an empty product.
  const at::Tensor none = at::empty({0, 8}, cuda());
  EXPECT_EQ(max_abs(grouped_weight_grad(none, none, {0, 0, 0})), 0.0);
  EXPECT_EQ(grouped_rows_times(none, at::randn({3, 8, 4}, cuda()), {0, 0, 0}).numel(), 0);
  EXPECT_FALSE(cublas_grouped_gemm_applies(x, x.to(at::kBFloat16)));
  EXPECT_FALSE(cublas_grouped_gemm_applies(x.cpu(), x.cpu()));
}

TEST_F(MoeKernel, FusedExpertsMatchTheGroupedGemmsAndTheFp64Reference) {
  // The fused forward (both GEMMs and SiTU-GLU per tile of rows) on the small config's widths and
  // two smaller ones, with one expert that every token picks (several tiles of one expert), three
  // experts without rows and the rest uneven: y, the saved gate and up activations and every
  // gradient (the backward is the grouped / loop one, from what the fused forward saved).
  const int64_t m = 700, n = 16, k = 2;
  for (const auto& [latent, ffn] : std::vector<std::pair<int64_t, int64_t>>{{128, 64}, {256, 128}, {384, 192}}) {
    at::manual_seed(23 + latent);
    const MoePermutation perm = popular_and_empty_experts(m, n, k);
    const at::Tensor rows = at::randn({m * k, latent}, cuda(at::kBFloat16));
    const double scale = 1.0 / std::sqrt(static_cast<double>(latent));
    const at::Tensor gate = (at::randn({n, ffn, latent}, cuda()) * 3 * scale).to(at::kBFloat16);
    const at::Tensor up = (at::randn({n, ffn, latent}, cuda()) * 3 * scale).to(at::kBFloat16);
    const at::Tensor down = (at::randn({n, latent, ffn}, cuda()) * 3 * scale).to(at::kBFloat16);
    const at::Tensor dy = at::randn({m * k, latent}, cuda());
    ASSERT_TRUE(moe_experts_fused_applies(rows, gate, up, down)) << latent << " x " << ffn;
    const std::string tag = " L=" + std::to_string(latent) + " F=" + std::to_string(ffn);

    auto grads_of = [&](bool reference, MoeGemm gemm) {
      return expert_outputs_and_grads(rows, gate, up, down, dy, perm, reference, gemm);
    };
    const std::vector<at::Tensor> expected = grads_of(true, MoeGemm::kLoop);
    const std::vector<at::Tensor> got = grads_of(false, MoeGemm::kFused);
    const std::vector<const char*> names = {"y", "d rows", "d gate_proj", "d up_proj", "d down_proj"};
    for (size_t i = 0; i < got.size(); ++i) {
      expect_close(std::string("fused ") + names[i] + tag, got[i], expected[i], 3e-2);
    }
    for (size_t i = 2; i < got.size(); ++i) EXPECT_EQ(max_abs(got[i].narrow(0, 13, 3)), 0.0) << names[i] << tag;

    // Against the unfused chain on the same bf16 operands: the same roundings, the fp32 sums in
    // another order. And kAuto takes the fused forward here.
    const c10::NoGradGuard no_grad;
    const MoeExpertsFused fused = moe_experts_fused_forward(rows, gate, up, down, perm, 4.0, 25.0, true);
    const MoeExpertGroups g = moe_expert_groups(perm.tokens_per_expert, perm.group_ends,
                                                moe_grouped_mm_applies(rows, gate, up, down));
    const at::Tensor gate_act = moe_expert_rows_times(rows, gate.transpose(1, 2), g);
    const at::Tensor up_act = moe_expert_rows_times(rows, up.transpose(1, 2), g);
    const at::Tensor y_chain =
        moe_expert_rows_times(situ_glu(gate_act, up_act, 4.0, 25.0), down.transpose(1, 2), g);
    expect_close("fused gate activations vs the GEMM" + tag, fused.gate, gate_act, 1e-2);
    expect_close("fused up activations vs the GEMM" + tag, fused.up, up_act, 1e-2);
    expect_close("fused y vs the unfused chain" + tag, fused.y, y_chain, 1e-2);
    EXPECT_TRUE(at::equal(fused.y, got[0])) << "kFused's forward is moe_experts_fused_forward" << tag;
    EXPECT_TRUE(at::equal(fused.y, moe_experts_autograd(rows, gate, up, down, perm, 4.0, 25.0)))
        << "kAuto takes the fused forward" << tag;
    const MoeExpertsFused y_only = moe_experts_fused_forward(rows, gate, up, down, perm, 4.0, 25.0, false);
    EXPECT_TRUE(at::equal(fused.y, y_only.y)) << "y without storing the activations" << tag;
    EXPECT_FALSE(y_only.gate.defined());
  }
}

TEST_F(MoeKernel, WgmmaExpertsMatchTheMmaSyncKernelAndTheFp64Reference) {
  // The Hopper kernel (moe_experts_sm90.cu) against the mma.sync one and fp64: the widths it
  // compiles from the smallest to the largest L and F, on two routings: one expert every token
  // picks (700 rows: five full 128-row tiles and one of 60, which only the first warpgroup takes),
  // three without rows and the rest uneven; and 896 experts of ~9 rows each (every tile a part of
  // one 64-row block), as an untrained router of the small config spreads a short batch.
  if (!moe_experts_forward_wgmma_supported(384, 192, 896)) GTEST_SKIP() << "needs an sm_90 GPU (wgmma)";
  struct Case {
    int64_t latent, ffn, experts;
  };
  for (const Case& c : std::vector<Case>{{128, 64, 16}, {128, 448, 16}, {256, 128, 16}, {384, 192, 16},
                                         {512, 64, 16}, {384, 192, 896}}) {
    const int64_t m = c.experts == 16 ? 700 : 4096, k = 2;
    at::manual_seed(31 + c.latent + c.ffn + c.experts);
    const MoePermutation perm =
        c.experts == 16 ? popular_and_empty_experts(m, c.experts, k)
                        : moe_permutation(model::select_experts(at::sigmoid(at::randn({m, c.experts}, cuda())),
                                                                at::zeros({c.experts}, cuda()), k),
                                          c.experts);
    const at::Tensor rows = at::randn({m * k, c.latent}, cuda(at::kBFloat16));
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.latent));
    const at::Tensor gate = (at::randn({c.experts, c.ffn, c.latent}, cuda()) * 3 * scale).to(at::kBFloat16);
    const at::Tensor up = (at::randn({c.experts, c.ffn, c.latent}, cuda()) * 3 * scale).to(at::kBFloat16);
    const at::Tensor down = (at::randn({c.experts, c.latent, c.ffn}, cuda()) * 3 * scale).to(at::kBFloat16);
    const std::string tag =
        " L=" + std::to_string(c.latent) + " F=" + std::to_string(c.ffn) + " E=" + std::to_string(c.experts);
    ASSERT_TRUE(moe_experts_forward_wgmma_supported(c.latent, c.ffn, c.experts)) << tag;
    const c10::NoGradGuard no_grad;
    const MoeExpertsFused wgmma =
        moe_experts_fused_forward(rows, gate, up, down, perm, 4.0, 25.0, true, MoeExpertsKernel::kWgmma);
    const MoeExpertsFused mma_sync =
        moe_experts_fused_forward(rows, gate, up, down, perm, 4.0, 25.0, true, MoeExpertsKernel::kMmaSync);
    // The same products summed in another order: G and U at most a bf16 rounding apart.
    expect_close("wgmma gate activations vs mma.sync" + tag, wgmma.gate, mma_sync.gate, 8e-3);
    expect_close("wgmma up activations vs mma.sync" + tag, wgmma.up, mma_sync.up, 8e-3);
    expect_close("wgmma y vs mma.sync" + tag, wgmma.y, mma_sync.y, 1e-2);
    const at::Tensor expected = experts_reference(rows.to(at::kDouble), gate.to(at::kDouble), up.to(at::kDouble),
                                                  down.to(at::kDouble), perm.tokens_per_expert);
    expect_close("wgmma y vs fp64" + tag, wgmma.y, expected, 3e-2);
    // kAuto takes it here, and y does not depend on storing the activations.
    EXPECT_TRUE(at::equal(wgmma.y, moe_experts_fused_forward(rows, gate, up, down, perm, 4.0, 25.0, false).y))
        << tag;
  }
  // A width the mma.sync kernel takes and this one does not (L + F = 640: its ring of four chunks
  // would not fit) is refused by name at the tensor level, and kAuto runs the mma.sync kernel.
  const MoePermutation perm = popular_and_empty_experts(64, 16, 2);
  const at::Tensor rows = at::randn({128, 512}, cuda(at::kBFloat16));
  const at::Tensor gate = (at::randn({16, 128, 512}, cuda()) * 0.1).to(at::kBFloat16);
  const at::Tensor down = (at::randn({16, 512, 128}, cuda()) * 0.1).to(at::kBFloat16);
  EXPECT_FALSE(moe_experts_forward_wgmma_supported(512, 128, 16));
  try {
    moe_experts_fused_forward(rows, gate, gate, down, perm, 4.0, 25.0, false, MoeExpertsKernel::kWgmma);
    ADD_FAILURE() << "L = 512, F = 128: no error";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("wgmma kernel does not apply to L = 512, F = 128"), std::string::npos) << message;
  }
  EXPECT_TRUE(at::equal(
      moe_experts_fused_forward(rows, gate, gate, down, perm, 4.0, 25.0, false).y,
      moe_experts_fused_forward(rows, gate, gate, down, perm, 4.0, 25.0, false, MoeExpertsKernel::kMmaSync).y));
}

TEST_F(MoeKernel, FusedExpertsRefuseWhatTheyDoNotSupport) {
  const int64_t m = 64, n = 8, k = 2;
  const at::Tensor selected = model::select_experts(at::sigmoid(at::randn({m, n}, cuda())), at::zeros({n}, cuda()), k);
  const MoePermutation perm = moe_permutation(selected, n);
  auto expect_refused = [&](int64_t latent, int64_t ffn, const std::string& why) {
    const at::ScalarType dtype = at::kBFloat16;
    const at::Tensor rows = at::randn({m * k, latent}, cuda(dtype));
    const at::Tensor gate = at::randn({n, ffn, latent}, cuda(dtype));
    const at::Tensor down = at::randn({n, latent, ffn}, cuda(dtype));
    EXPECT_FALSE(moe_experts_fused_applies(rows, gate, gate, down)) << why;
    try {
      moe_experts_autograd(rows, gate, gate, down, perm, 4.0, 25.0, MoeGemm::kFused);
      ADD_FAILURE() << why << ": no error";
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      EXPECT_NE(message.find("fused experts do not apply"), std::string::npos) << message;
      EXPECT_NE(message.find("L = " + std::to_string(latent)), std::string::npos) << message;
    }
    // The launcher refuses them too, before launching anything.
    EXPECT_EQ(moe_experts_forward(rows.data_ptr(), gate.data_ptr(), gate.data_ptr(), down.data_ptr(),
                                  perm.group_ends.data_ptr<int32_t>(), rows.data_ptr(), nullptr, nullptr,
                                  m * k, n, latent, ffn, 4.f, 25.f, nullptr),
              cudaErrorInvalidValue)
        << why;
  };
  expect_refused(64, 64, "L not a multiple of 128");
  expect_refused(128, 48, "F not a multiple of 64");
  expect_refused(2048, 1024, "too large for shared memory");
  // fp32 runs the other paths; the launcher itself only knows bf16 and cannot tell, so only the
  // tensor-level check is asked.
  const at::Tensor rows = at::randn({m * k, 128}, cuda());
  const at::Tensor gate = at::randn({n, 64, 128}, cuda());
  EXPECT_FALSE(moe_experts_fused_applies(rows, gate, gate, at::randn({n, 128, 64}, cuda())));
  // Non-positive caps.
  const at::Tensor rb = rows.to(at::kBFloat16), gb = gate.to(at::kBFloat16);
  const at::Tensor db = at::randn({n, 128, 64}, cuda(at::kBFloat16));
  EXPECT_EQ(moe_experts_forward(rb.data_ptr(), gb.data_ptr(), gb.data_ptr(), db.data_ptr(),
                                perm.group_ends.data_ptr<int32_t>(), rb.data_ptr(), nullptr, nullptr, m * k, n,
                                128, 64, 0.f, 25.f, nullptr),
            cudaErrorInvalidValue);
}

// a_e^T b_e per expert in fp64 (rows grouped as counts say): [E, M, N], zeros for empty experts.
at::Tensor weight_grad_reference(const at::Tensor& a, const at::Tensor& b, const at::Tensor& counts) {
  const at::Tensor host = counts.cpu();
  at::Tensor out = at::zeros({counts.size(0), a.size(1), b.size(1)}, a.options().dtype(at::kDouble));
  int64_t start = 0;
  for (int64_t e = 0; e < counts.size(0); ++e) {
    const int64_t c = host[e].item<int64_t>();
    if (c == 0) continue;
    out[e].copy_(at::matmul(a.narrow(0, start, c).to(at::kDouble).t(), b.narrow(0, start, c).to(at::kDouble)));
    start += c;
  }
  return out;
}

TEST_F(MoeKernel, ExpertWeightGradsMatchTheFp64ReferenceAndTheGroupedGemms) {
  // moe_experts_weight_grads (one kernel for dW_gate, dW_up, dW_down) on widths with whole and
  // half-filled 128-column tiles of F (64, 192, 320), L from 128 to 640, against fp64 sums per
  // expert and the grouped / loop GEMMs: one expert that every token picks (rows far past one
  // 32-row chunk, not a multiple of it), three experts without rows (exact zeros, written into
  // memory that held NaN), the rest uneven; and 1000 experts, most with 0 to 3 rows (the kernel
  // sorts the experts by rows: many ties). Each part alone equals the same part of a run with all
  // three, and two runs are equal bit for bit (no atomics).
  const int64_t m = 700, k = 2;
  for (const auto& [latent, ffn, n] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {128, 64, 16}, {256, 192, 16}, {384, 192, 16}, {512, 128, 16}, {640, 320, 16}, {128, 128, 1000}}) {
    at::manual_seed(31 + latent + ffn + n);
    const MoePermutation perm = popular_and_empty_experts(m, n, k);
    const int64_t r = m * k;
    const at::Tensor x = at::randn({r, latent}, cuda(at::kBFloat16));
    const at::Tensor dg = at::randn({r, ffn}, cuda(at::kBFloat16));
    const at::Tensor du = at::randn({r, ffn}, cuda(at::kBFloat16));
    const at::Tensor dy = at::randn({r, latent}, cuda(at::kBFloat16));
    const at::Tensor h = at::randn({r, ffn}, cuda(at::kBFloat16));
    const at::Tensor gate_proj = at::empty({n, ffn, latent}, cuda(at::kBFloat16));
    ASSERT_TRUE(moe_experts_weight_grads_applies(x, gate_proj)) << latent << " x " << ffn;
    const std::string tag = " L=" + std::to_string(latent) + " F=" + std::to_string(ffn) + " E=" + std::to_string(n);
    at::empty({3 * n * latent * ffn + 4096}, cuda(at::kBFloat16)).fill_(NAN);  // freed: reused below
    const MoeExpertWeightGrads all = moe_experts_weight_grads(x, dg, du, dy, h, perm.group_ends, true, true);

    const std::vector<std::tuple<const char*, at::Tensor, at::Tensor, at::Tensor>> parts = {
        {"dW_gate", all.d_gate_proj, dg, x}, {"dW_up", all.d_up_proj, du, x}, {"dW_down", all.d_down_proj, dy, h}};
    const MoeExpertGroups g = moe_expert_groups(perm.tokens_per_expert, perm.group_ends,
                                                moe_grouped_mm_applies(x, gate_proj, gate_proj, gate_proj.transpose(1, 2)));
    for (const auto& [name, got, a, b] : parts) {
      expect_close(std::string("weight grads kernel ") + name + tag, got,
                   weight_grad_reference(a, b, perm.tokens_per_expert), 1e-2);
      expect_close(std::string("weight grads kernel vs the GEMMs ") + name + tag, got,
                   moe_expert_weight_grad(a, b, g), 1e-2);
      EXPECT_EQ(max_abs(got.narrow(0, 13, 3).to(at::kFloat)), 0.0) << name << tag;
    }
    // Both kernels where the wgmma one runs (sm_90): the mma.sync one against fp64 too, the two
    // against each other (the same sums in 64- and 32-row chunks).
    if (moe_experts_weight_grads_wgmma_supported(latent, ffn, n)) {
      const MoeExpertWeightGrads wgmma =
          moe_experts_weight_grads(x, dg, du, dy, h, perm.group_ends, true, true, MoeExpertsKernel::kWgmma);
      const MoeExpertWeightGrads mma_sync =
          moe_experts_weight_grads(x, dg, du, dy, h, perm.group_ends, true, true, MoeExpertsKernel::kMmaSync);
      EXPECT_TRUE(at::equal(wgmma.d_gate_proj, all.d_gate_proj) && at::equal(wgmma.d_up_proj, all.d_up_proj) &&
                  at::equal(wgmma.d_down_proj, all.d_down_proj))
          << "kAuto takes the wgmma kernel on sm_90" << tag;
      const std::vector<std::tuple<const char*, at::Tensor, at::Tensor, at::Tensor, at::Tensor>> pairs = {
          {"dW_gate", mma_sync.d_gate_proj, wgmma.d_gate_proj, dg, x},
          {"dW_up", mma_sync.d_up_proj, wgmma.d_up_proj, du, x},
          {"dW_down", mma_sync.d_down_proj, wgmma.d_down_proj, dy, h}};
      for (const auto& [name, other, mine, a, b] : pairs) {
        expect_close(std::string("weight grads mma.sync kernel ") + name + tag, other,
                     weight_grad_reference(a, b, perm.tokens_per_expert), 1e-2);
        expect_close(std::string("weight grads wgmma vs mma.sync ") + name + tag, mine, other, 1e-2);
      }
      // fp32 outputs: the sums themselves. Rounded once they are the bf16 outputs bit for bit, and
      // they are 100x closer to fp64 than bf16 outputs can be (a bf16 rounding alone is ~2e-3).
      const MoeExpertWeightGrads sums = moe_experts_weight_grads(x, dg, du, dy, h, perm.group_ends, true, true,
                                                                 MoeExpertsKernel::kAuto, at::kFloat);
      const std::vector<std::tuple<const char*, at::Tensor, at::Tensor, at::Tensor, at::Tensor>> fp32_parts = {
          {"dW_gate", sums.d_gate_proj, wgmma.d_gate_proj, dg, x},
          {"dW_up", sums.d_up_proj, wgmma.d_up_proj, du, x},
          {"dW_down", sums.d_down_proj, wgmma.d_down_proj, dy, h}};
      for (const auto& [name, sum, rounded, a, b] : fp32_parts) {
        ASSERT_EQ(sum.scalar_type(), at::kFloat) << name << tag;
        EXPECT_TRUE(at::equal(sum.to(at::kBFloat16), rounded)) << name << ": the bf16 outputs are not the fp32 sums rounded" << tag;
        expect_close(std::string("weight grads fp32 sums ") + name + tag, sum,
                     weight_grad_reference(a, b, perm.tokens_per_expert), 2e-5);
        EXPECT_EQ(max_abs(sum.narrow(0, 13, 3)), 0.0) << name << tag;
      }
      const MoeExpertWeightGrads down_sums = moe_experts_weight_grads(
          x, at::Tensor(), at::Tensor(), dy, h, perm.group_ends, false, true, MoeExpertsKernel::kWgmma, at::kFloat);
      EXPECT_TRUE(at::equal(down_sums.d_down_proj, sums.d_down_proj)) << tag;
      EXPECT_THROW(moe_experts_weight_grads(x, dg, du, dy, h, perm.group_ends, true, true, MoeExpertsKernel::kMmaSync,
                                            at::kFloat),
                   c10::Error)
          << "fp32 outputs are the wgmma kernel's alone";
    }
    const MoeExpertWeightGrads gate_up = moe_experts_weight_grads(x, dg, du, at::Tensor(), at::Tensor(),
                                                                  perm.group_ends, true, false);
    const MoeExpertWeightGrads down = moe_experts_weight_grads(x, at::Tensor(), at::Tensor(), dy, h,
                                                               perm.group_ends, false, true);
    EXPECT_TRUE(at::equal(gate_up.d_gate_proj, all.d_gate_proj) && at::equal(gate_up.d_up_proj, all.d_up_proj)) << tag;
    EXPECT_FALSE(gate_up.d_down_proj.defined()) << tag;
    EXPECT_TRUE(at::equal(down.d_down_proj, all.d_down_proj)) << tag;
    EXPECT_FALSE(down.d_gate_proj.defined() || down.d_up_proj.defined()) << tag;
    const MoeExpertWeightGrads again = moe_experts_weight_grads(x, dg, du, dy, h, perm.group_ends, true, true);
    EXPECT_TRUE(at::equal(again.d_gate_proj, all.d_gate_proj) && at::equal(again.d_up_proj, all.d_up_proj) &&
                at::equal(again.d_down_proj, all.d_down_proj))
        << "two runs differ" << tag;
  }
}

TEST_F(MoeKernel, ExpertsOnBf16CopiesSendFp32GradientsToTheFp32Weights) {
  // fp32 weights trained through bf16 copies (MoeExpertWeightCopies; the medium float32 matmul
  // precision's routed experts): y and d rows are the bf16 weights' exactly, and the gradients go
  // to the fp32 weights, in fp32. Rounded to bf16 they are the bf16 weights' gradients bit for bit;
  // on sm_90 they are the weight-gradient kernel's fp32 sums themselves, not bf16 values cast.
  const int64_t m = 300, n = 16, k = 2, latent = 128, ffn = 64;
  at::manual_seed(23);
  const MoePermutation perm = popular_and_empty_experts(m, n, k);
  const at::Tensor rows = at::randn({m * k, latent}, cuda(at::kBFloat16));
  const at::Tensor weights[3] = {at::randn({n, ffn, latent}, cuda()) * 0.2, at::randn({n, ffn, latent}, cuda()) * 0.2,
                                 at::randn({n, latent, ffn}, cuda()) * 0.2};
  const at::Tensor dy = at::randn({m * k, latent}, cuda());
  const MoeExpertWeightCopies copies{weights[0].to(at::kBFloat16), weights[1].to(at::kBFloat16),
                                     weights[2].to(at::kBFloat16)};
  ASSERT_TRUE(moe_experts_fused_applies(rows, copies.gate_proj, copies.up_proj, copies.down_proj));
  const std::vector<at::Tensor> bf16 = expert_outputs_and_grads(rows, copies.gate_proj, copies.up_proj,
                                                                copies.down_proj, dy, perm, false, MoeGemm::kAuto);
  const std::vector<at::Tensor> expected = expert_outputs_and_grads(rows, copies.gate_proj, copies.up_proj,
                                                                    copies.down_proj, dy, perm, true, MoeGemm::kLoop);

  const c10::AutoGradMode grad(true);
  const at::Tensor r = rows.detach().requires_grad_(true);
  const at::Tensor w[3] = {weights[0].detach().requires_grad_(true), weights[1].detach().requires_grad_(true),
                           weights[2].detach().requires_grad_(true)};
  const at::Tensor y = moe_experts_autograd(r, w[0], w[1], w[2], perm, 4.0, 25.0, MoeGemm::kAuto, copies);
  (y.to(at::kDouble) * dy.to(at::kDouble)).sum().backward();
  EXPECT_TRUE(at::equal(y.detach(), bf16[0])) << "y";
  EXPECT_TRUE(at::equal(r.grad(), bf16[1])) << "d rows";
  const bool sums = moe_experts_weight_grads_wgmma_supported(latent, ffn, n);
  std::printf("  the weight-gradient kernel's fp32 sums: %s\n", sums ? "yes (sm_90)" : "no: bf16 gradients cast");
  const char* names[3] = {"d gate_proj", "d up_proj", "d down_proj"};
  for (int i = 0; i < 3; ++i) {
    const at::Tensor g = w[i].grad();
    ASSERT_TRUE(g.defined()) << names[i];
    ASSERT_EQ(g.scalar_type(), at::kFloat) << names[i];
    EXPECT_TRUE(at::equal(g.to(at::kBFloat16), bf16[2 + i])) << names[i] << ": rounded, not the bf16 weights' gradient";
    if (sums) {
      EXPECT_FALSE(at::equal(g, g.to(at::kBFloat16).to(at::kFloat))) << names[i] << ": bf16 values cast, not the sums";
    }
    expect_close(std::string("copies: ") + names[i], g, expected[2 + i], 3e-2);
    EXPECT_EQ(max_abs(g.narrow(0, 13, 3)), 0.0) << names[i] << ": experts without rows";
  }
  // A copy that does not fit its weight is named.
  try {
    moe_experts_autograd(r, w[0], w[1], w[2], perm, 4.0, 25.0, MoeGemm::kAuto,
                         {copies.gate_proj, copies.up_proj.to(at::kFloat), copies.down_proj});
    ADD_FAILURE() << "an fp32 copy was taken";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("copies.up_proj"), std::string::npos) << e.what();
  }
}

TEST_F(MoeKernel, ExpertDxMatchesTheFp64ReferenceAndTheTwoGemms) {
  // moe_experts_dx (dX = dG W_gate + dU W_up in one kernel) against fp64 per expert and the two
  // GEMMs added in place, on the widths and routings of the weight gradients' test: one expert
  // with every token (tiles of 117 rows), three without rows, 1000 experts with 0 to 3 rows each.
  const int64_t m = 700, k = 2;
  for (const auto& [latent, ffn, n] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {128, 64, 16}, {256, 192, 16}, {384, 192, 16}, {640, 320, 16}, {128, 128, 1000}}) {
    at::manual_seed(37 + latent + ffn + n);
    const MoePermutation perm = popular_and_empty_experts(m, n, k);
    const at::Tensor dg = at::randn({m * k, ffn}, cuda(at::kBFloat16));
    const at::Tensor du = at::randn({m * k, ffn}, cuda(at::kBFloat16));
    const double scale = 1.0 / std::sqrt(static_cast<double>(ffn));
    const at::Tensor gate = (at::randn({n, ffn, latent}, cuda()) * scale).to(at::kBFloat16);
    const at::Tensor up = (at::randn({n, ffn, latent}, cuda()) * scale).to(at::kBFloat16);
    ASSERT_TRUE(moe_experts_dx_applies(dg, gate));
    const std::string tag = " L=" + std::to_string(latent) + " F=" + std::to_string(ffn) + " E=" + std::to_string(n);
    const at::Tensor got = moe_experts_dx(dg, du, gate, up, perm.group_ends);

    const at::Tensor host = perm.tokens_per_expert.cpu();
    std::vector<at::Tensor> parts;
    int64_t start = 0;
    for (int64_t e = 0; e < n; ++e) {
      const int64_t c = host[e].item<int64_t>();
      if (c == 0) continue;
      parts.push_back(at::matmul(dg.narrow(0, start, c).to(at::kDouble), gate[e].to(at::kDouble)) +
                      at::matmul(du.narrow(0, start, c).to(at::kDouble), up[e].to(at::kDouble)));
      start += c;
    }
    expect_close("dx kernel" + tag, got, at::cat(parts, 0), 1e-2);
    const MoeExpertGroups g = moe_expert_groups(perm.tokens_per_expert, perm.group_ends,
                                                moe_grouped_mm_applies(dg, gate, up, gate.transpose(1, 2)));
    at::Tensor chain = moe_expert_rows_times(dg, gate, g);
    chain.add_(moe_expert_rows_times(du, up, g));
    expect_close("dx kernel vs the two GEMMs added in place" + tag, got, chain, 1e-2);
    EXPECT_TRUE(at::equal(got, moe_experts_dx(dg, du, gate, up, perm.group_ends))) << "two runs differ" << tag;
    // Both kernels where the wgmma one runs (sm_90): the same sums in the same order.
    if (moe_experts_dx_wgmma_supported(latent, ffn, n)) {
      const at::Tensor wgmma = moe_experts_dx(dg, du, gate, up, perm.group_ends, MoeExpertsKernel::kWgmma);
      const at::Tensor mma_sync = moe_experts_dx(dg, du, gate, up, perm.group_ends, MoeExpertsKernel::kMmaSync);
      expect_close("dx wgmma kernel" + tag, wgmma, at::cat(parts, 0), 1e-2);
      expect_close("dx wgmma vs mma.sync" + tag, wgmma, mma_sync, 1e-2);
      EXPECT_TRUE(at::equal(got, wgmma)) << "kAuto takes the wgmma kernel on sm_90" << tag;
    }
  }
}

TEST_F(MoeKernel, ExpertWeightGradsAndDxRefuseWhatTheyDoNotSupport) {
  const int64_t m = 64, n = 8, k = 2;
  const at::Tensor selected = model::select_experts(at::sigmoid(at::randn({m, n}, cuda())), at::zeros({n}, cuda()), k);
  const MoePermutation perm = moe_permutation(selected, n);
  auto message_of = [](auto&& call) {
    try {
      call();
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  for (const auto& [latent, ffn] : std::vector<std::pair<int64_t, int64_t>>{{64, 64}, {128, 48}, {200, 64}}) {
    const at::Tensor x = at::randn({m * k, latent}, cuda(at::kBFloat16));
    const at::Tensor d = at::randn({m * k, ffn}, cuda(at::kBFloat16));
    EXPECT_FALSE(moe_experts_weight_grads_applies(x, at::empty({n, ffn, latent}, cuda(at::kBFloat16))));
    const std::string message = message_of([&] { moe_experts_weight_grads(x, d, d, x, d, perm.group_ends, true, true); });
    EXPECT_NE(message.find("L = " + std::to_string(latent) + ", F = " + std::to_string(ffn)), std::string::npos) << message;
    void* out = d.data_ptr();
    EXPECT_EQ(moe_experts_weight_grads(x.data_ptr(), d.data_ptr(), d.data_ptr(), x.data_ptr(), d.data_ptr(),
                                       perm.group_ends.data_ptr<int32_t>(), out, out, out, m * k, n, latent, ffn,
                                       nullptr),
              cudaErrorInvalidValue)
        << latent << " x " << ffn;
  }
  // dX refuses the same widths, and names what it got.
  for (const auto& [latent, ffn] : std::vector<std::pair<int64_t, int64_t>>{{64, 64}, {128, 48}}) {
    const at::Tensor d = at::randn({m * k, ffn}, cuda(at::kBFloat16));
    const at::Tensor w = at::randn({n, ffn, latent}, cuda(at::kBFloat16));
    EXPECT_FALSE(moe_experts_dx_applies(d, w));
    const std::string message = message_of([&] { moe_experts_dx(d, d, w, w, perm.group_ends); });
    EXPECT_NE(message.find("L = " + std::to_string(latent) + ", F = " + std::to_string(ffn)), std::string::npos)
        << message;
    EXPECT_EQ(moe_experts_dx(d.data_ptr(), d.data_ptr(), w.data_ptr(), w.data_ptr(), perm.group_ends.data_ptr<int32_t>(),
                             w.data_ptr(), m * k, n, latent, ffn, nullptr),
              cudaErrorInvalidValue);
  }
  {
    const at::Tensor d = at::randn({m * k, 64}, cuda(at::kBFloat16));
    const at::Tensor w = at::randn({n, 64, 128}, cuda(at::kBFloat16));
    const std::string message = message_of([&] { moe_experts_dx(d, d, w.to(at::kFloat), w, perm.group_ends); });
    EXPECT_NE(message.find("gate_proj must be bf16"), std::string::npos) << message;
  }
  // A tensor of the wrong dtype or width is named.
  const at::Tensor x = at::randn({m * k, 128}, cuda(at::kBFloat16));
  const at::Tensor d = at::randn({m * k, 64}, cuda(at::kBFloat16));
  std::string message = message_of([&] { moe_experts_weight_grads(x, d, d.to(at::kFloat), x, d, perm.group_ends, true, true); });
  EXPECT_NE(message.find("d_up must be a bf16 [128, 64]"), std::string::npos) << message;
  message = message_of([&] { moe_experts_weight_grads(x, d, d, x, x, perm.group_ends, true, true); });
  EXPECT_NE(message.find("h must be a bf16 [128, 64]"), std::string::npos) << message;
  // Only one of d_gate_proj / d_up_proj from the launcher.
  void* out = d.data_ptr();
  EXPECT_EQ(moe_experts_weight_grads(x.data_ptr(), d.data_ptr(), d.data_ptr(), nullptr, nullptr,
                                     perm.group_ends.data_ptr<int32_t>(), out, nullptr, nullptr, m * k, n, 128, 64,
                                     nullptr),
            cudaErrorInvalidValue);
}

TEST_F(MoeKernel, FusedExpertsTakeAnEmptyBatch) {
  // No rows at all (LibTorch's empty tensors have null data): the fused forward gives [0, L], and
  // its backward (the dX and weight-gradient kernels) zero weight gradients and [0, L] for the rows.
  const int64_t n = 8, k = 2, latent = 128, ffn = 64;
  MoePermutation perm;
  perm.tokens = 0;
  perm.top_k = k;
  const auto i64 = cuda(at::kLong);
  perm.source = at::empty({0}, i64);
  perm.token = at::empty({0}, i64);
  perm.inverse = at::empty({0}, i64);
  perm.tokens_per_expert = at::zeros({n}, i64);
  perm.offsets = at::zeros({n + 1}, i64);
  perm.group_ends = at::zeros({n}, cuda(at::kInt));
  const c10::AutoGradMode grad(true);
  const at::Tensor rows = at::empty({0, latent}, cuda(at::kBFloat16)).requires_grad_(true);
  const at::Tensor gate = at::randn({n, ffn, latent}, cuda(at::kBFloat16)).requires_grad_(true);
  const at::Tensor up = at::randn({n, ffn, latent}, cuda(at::kBFloat16)).requires_grad_(true);
  const at::Tensor down = at::randn({n, latent, ffn}, cuda(at::kBFloat16)).requires_grad_(true);
  ASSERT_TRUE(moe_experts_fused_applies(rows, gate, up, down));
  const at::Tensor y = moe_experts_autograd(rows, gate, up, down, perm, 4.0, 25.0, MoeGemm::kFused);
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{0, latent}));
  y.to(at::kFloat).sum().backward();
  ASSERT_TRUE(rows.grad().defined());
  EXPECT_EQ(rows.grad().sizes(), (std::vector<int64_t>{0, latent}));
  for (const at::Tensor* w : {&gate, &up, &down}) {
    ASSERT_TRUE(w->grad().defined());
    EXPECT_EQ(w->grad().sizes(), w->sizes());
    EXPECT_EQ(max_abs(w->grad().to(at::kFloat)), 0.0);
  }
  // The launchers on their own, with null row pointers.
  const at::Tensor out = at::full({n, ffn, latent}, NAN, cuda(at::kBFloat16));
  EXPECT_EQ(moe_experts_weight_grads(nullptr, nullptr, nullptr, nullptr, nullptr, perm.group_ends.data_ptr<int32_t>(),
                                     out.data_ptr(), out.data_ptr(), nullptr, 0, n, latent, ffn, nullptr),
            cudaSuccess);
  EXPECT_EQ(max_abs(out.to(at::kFloat)), 0.0);
  EXPECT_EQ(moe_experts_dx(nullptr, nullptr, gate.data_ptr(), up.data_ptr(), perm.group_ends.data_ptr<int32_t>(),
                           nullptr, 0, n, latent, ffn, nullptr),
            cudaSuccess);
}

TEST_F(MoeKernel, ExpertGemmStepsEqualTheFunctionsForward) {
  // The steps the bench times one at a time (moe_expert_groups / rows_times / weight_grad) are the
  // Function's own: the same forward bit for bit, for the GEMMs kAuto picks and for the loop.
  const int64_t m = 200, n = 12, k = 2, latent = 64, ffn = 48;
  at::manual_seed(22);
  at::Tensor bias = at::zeros({n}, cuda());
  bias.narrow(0, 9, 3).fill_(-10.0);  // experts 9..11 get no rows
  const at::Tensor selected = model::select_experts(at::sigmoid(at::randn({m, n}, cuda())), bias, k);
  const MoePermutation perm = moe_permutation(selected, n);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor rows = at::randn({m * k, latent}, cuda(dtype));
    const at::Tensor gate = (at::randn({n, ffn, latent}, cuda()) * 0.2).to(dtype);
    const at::Tensor up = (at::randn({n, ffn, latent}, cuda()) * 0.2).to(dtype);
    const at::Tensor down = (at::randn({n, latent, ffn}, cuda()) * 0.2).to(dtype);
    std::vector<std::pair<MoeGemm, bool>> gemms = {{MoeGemm::kLoop, false}};
    if (moe_grouped_mm_applies(rows, gate, up, down)) gemms.push_back({MoeGemm::kGrouped, true});
    for (const auto& [gemm, grouped] : gemms) {
      const std::string tag = std::string(grouped ? " grouped" : " loop") + (dtype == at::kFloat ? " fp32" : " bf16");
      const c10::NoGradGuard no_grad;
      const MoeExpertGroups g = moe_expert_groups(perm.tokens_per_expert, perm.group_ends, grouped);
      const at::Tensor h = situ_glu(moe_expert_rows_times(rows, gate.transpose(1, 2), g),
                                    moe_expert_rows_times(rows, up.transpose(1, 2), g), 4.0, 25.0);
      const at::Tensor y = moe_expert_rows_times(h, down.transpose(1, 2), g);
      EXPECT_TRUE(at::equal(y, moe_experts_autograd(rows, gate, up, down, perm, 4.0, 25.0, gemm))) << "y" << tag;
      const at::Tensor d_down = moe_expert_weight_grad(rows, h, g);
      ASSERT_EQ(d_down.sizes().vec(), (std::vector<int64_t>{n, latent, ffn})) << tag;
      EXPECT_EQ(max_abs(d_down.narrow(0, 9, 3)), 0.0) << "experts without rows" << tag;
      std::printf("  expert GEMM steps%s: forward equal to moe_experts_autograd's\n", tag.c_str());
    }
  }
}

// ---- the layer ---------------------------------------------------------------------------------------------

model::MoeOptions layer_options() {
  model::MoeOptions o;  // the tiny config's routing (64 experts, top-4), widths multiples of 16
  o.hidden = 64;
  o.latent = 64;
  o.expert_ffn = 32;
  o.num_experts = 64;
  o.top_k = 4;
  o.num_shared = 2;
  o.shared_ffn = 64;
  return o;
}

void copy_state(model::MoeImpl& dst, model::MoeImpl& src) {
  const c10::NoGradGuard no_grad;
  auto d = dst.named_parameters(), s = src.named_parameters();
  for (const auto& item : s) d[item.key()].copy_(item.value());
  auto db = dst.named_buffers(), sb = src.named_buffers();
  for (const auto& item : sb) db[item.key()].copy_(item.value());
}

TEST_F(MoeKernel, LayerForwardAndBackwardMatchTheFp64ReferenceOnCuda) {
  // fp32, fp32 at the medium float32 matmul precision (model/precision.h: the routed experts on
  // bf16 copies, the fused kernels), and bf16.
  const model::MoeOptions options = layer_options();
  at::Tensor y_fp32;
  for (const auto& [dtype, medium] : {std::pair{at::kFloat, false}, std::pair{at::kFloat, true},
                                      std::pair{at::kBFloat16, false}}) {
    const model::Float32MatmulPrecisionScope scope(medium ? model::Float32MatmulPrecision::kMedium
                                                          : model::Float32MatmulPrecision::kHighest);
    at::manual_seed(31);
    model::Moe source(options);
    {
      const c10::NoGradGuard no_grad;
      for (auto& p : source->parameters()) p.copy_(at::randn(p.sizes()) * 0.3);
      source->set_expert_bias(at::randn({options.num_experts}) * 0.05);
    }
    model::Moe reference(options), layer(options);
    copy_state(*layer, *source);
    layer->to(at::kCUDA, dtype);
    layer->router->to(at::kFloat);  // W_r and b stay fp32 in a bf16 model (moe.h)...
    {
      const c10::NoGradGuard no_grad;  // ...with their fp32 values, not bf16-rounded ones
      layer->router->weight.copy_(source->router->weight);
    }
    layer->set_expert_bias(source->router->bias);
    // The reference holds exactly the kernel layer's values, in fp64.
    copy_state(*reference, *layer);
    reference->to(at::kCUDA, at::kDouble);

    const at::Tensor x = at::randn({3, 70, options.hidden}, cuda()).to(dtype);
    const at::Tensor dy = at::randn({3, 70, options.hidden}, cuda(at::kDouble));
    ASSERT_TRUE(layer->uses_kernels(x));
    ASSERT_FALSE(reference->uses_kernels(x.to(at::kDouble)));

    const c10::AutoGradMode grad(true);
    const at::Tensor xk = x.detach().requires_grad_(true);
    const at::Tensor xr = x.to(at::kDouble).detach().requires_grad_(true);
    const model::MoeOutput got = layer->forward(xk);
    const model::MoeOutput expected = reference->forward_reference(xr);
    // The same experts (as sets) for every token, or the outputs cannot be compared.
    const at::Tensor got_sel = std::get<0>(at::sort(got.routing.selected, 1)).cpu();
    const at::Tensor ref_sel = std::get<0>(at::sort(expected.routing.selected, 1)).cpu();
    ASSERT_TRUE(at::equal(got_sel, ref_sel)) << "selection differs from the fp64 reference";
    (got.y.to(at::kDouble) * dy).sum().backward();
    (expected.y * dy).sum().backward();

    const std::string tag = dtype == at::kFloat ? (medium ? " fp32 at medium" : " fp32") : " bf16";
    const double tolerance = dtype == at::kFloat && !medium ? 2e-4 : 5e-2;
    if (dtype == at::kFloat && !medium) y_fp32 = got.y.detach();
    if (medium) {
      EXPECT_EQ(got.y.scalar_type(), at::kFloat);
      EXPECT_FALSE(at::equal(got.y, y_fp32)) << "medium should run the experts on bf16 copies; nothing changed";
    }
    expect_close("layer y" + tag, got.y, expected.y.detach(), tolerance);
    expect_close("layer p" + tag, std::get<0>(at::sort(got.routing.weights, 1)),
                 std::get<0>(at::sort(expected.routing.weights, 1)), tolerance);
    expect_close("layer d x" + tag, xk.grad(), xr.grad(), tolerance);
    auto got_params = layer->named_parameters();
    for (const auto& item : reference->named_parameters()) {
      const at::Tensor g = got_params[item.key()].grad();
      ASSERT_TRUE(g.defined()) << item.key() << tag << ": no gradient";
      expect_close("layer d " + item.key() + tag, g, item.value().grad(), tolerance);
    }
  }
}

TEST_F(MoeKernel, LayerWithoutGradientsUsesTheKernelWeights) {
  const model::MoeOptions options = layer_options();
  at::manual_seed(41);
  model::Moe layer(options);
  layer->to(at::kCUDA);
  const at::Tensor x = at::randn({2, 33, options.hidden}, cuda());
  const c10::NoGradGuard no_grad;
  const model::MoeOutput got = layer->forward(x);
  const model::MoeOutput expected = layer->forward_reference(x);
  expect_close("no-grad layer y fp32", got.y, expected.y, 2e-4);
  const at::Tensor chosen = got.routing.scores.gather(1, got.routing.selected);
  expect_close("no-grad p", got.routing.weights, chosen / chosen.sum(-1, true), 1e-6);
}

}  // namespace
}  // namespace odyssey::kernels
