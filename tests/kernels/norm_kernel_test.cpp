// The fused RMSNorm (kernels/rms_norm.h, kernels/norm_autograd.h) against autograd of the plain
// LibTorch formula (model::rms_norm_reference) in fp64: y, dx and dweight for bf16 / fp32 inputs
// and weights, widths 2 ... 1024, rows 0 ... 1000; dweight's determinism; and model::rms_norm's
// dispatch. The same for the attention-residual mix (kernels/attn_res.h) against
// model::attn_res_mix_reference. Every comparison prints its max error. Skipped without a CUDA
// device.
#include <algorithm>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include "kernels/norm_autograd.h"
#include "kernels/torch_bindings.h"
#include "model/attn_res.h"
#include "model/rms_norm.h"

namespace odyssey::kernels {
namespace {

double relative_error(const at::Tensor& got, const at::Tensor& expected) {
  if (expected.numel() == 0) return 0.0;
  const double scale = std::max(1e-12, expected.abs().max().item<double>());
  return (got.to(at::kDouble) - expected).abs().max().item<double>() / scale;
}

class NormKernel : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(NormKernel, RmsNormForwardAndBackwardMatchAutogradOfTheFp64Reference) {
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  for (at::ScalarType x_dtype : {at::kFloat, at::kBFloat16}) {
    for (at::ScalarType w_dtype : {at::kFloat, at::kBFloat16}) {
      // (Width 1 is left out: there dx is eps-sized, all cancellation, in any precision.)
      for (int64_t width : {2, 7, 32, 33, 127, 128, 384, 513, 1024}) {
        for (int64_t rows : {0, 1, 5, 1000}) {
          at::manual_seed(width * 7 + rows);
          const at::Tensor x = (at::randn({rows, width}, cuda) * 3).to(x_dtype).requires_grad_(true);
          const at::Tensor w = (at::rand({width}, cuda) + 0.5).to(w_dtype).requires_grad_(true);
          ASSERT_TRUE(rms_norm_supported(x, w));
          const at::Tensor y = rms_norm_autograd(x, w, 1e-5);
          const at::Tensor dy = at::randn({rows, width}, cuda).to(x_dtype);
          y.backward(dy);
          const at::Tensor xr = x.detach().to(at::kDouble).requires_grad_(true);
          const at::Tensor wr = w.detach().to(at::kDouble).requires_grad_(true);
          const at::Tensor yr = model::rms_norm_reference(xr, wr, 1e-5);
          yr.backward(dy.to(at::kDouble));
          const double e_y = relative_error(y, yr.detach()), e_dx = relative_error(x.grad(), xr.grad());
          const double e_dw = relative_error(w.grad(), wr.grad());
          const std::string name = std::string(x_dtype == at::kFloat ? "fp32" : "bf16") + " x, " +
                                   (w_dtype == at::kFloat ? "fp32" : "bf16") + " w, width " +
                                   std::to_string(width) + ", rows " + std::to_string(rows);
          if (rows == 1000 && (width == 384 || width == 1024)) {
            std::printf("  rms norm %-40s y %.2e, dx %.2e, dw %.2e (relative to the largest fp64 value)\n",
                        name.c_str(), e_y, e_dx, e_dw);
          }
          // fp32 results: fp32 arithmetic (dw sums 1000 rows); bf16: one rounding of the result.
          EXPECT_LT(e_y, x_dtype == at::kFloat ? 2e-6 : 8e-3) << name;
          EXPECT_LT(e_dx, x_dtype == at::kFloat ? 2e-5 : 1.6e-2) << name;
          EXPECT_LT(e_dw, w_dtype == at::kFloat ? 2e-5 : 8e-3) << name;
          EXPECT_EQ(y.scalar_type(), x_dtype);
          EXPECT_EQ(x.grad().scalar_type(), x_dtype);
          EXPECT_EQ(w.grad().scalar_type(), w_dtype);
          if (rows == 0) {
            EXPECT_EQ(w.grad().abs().max().item<double>(), 0.0) << name;
          }
        }
      }
    }
  }
}

TEST_F(NormKernel, WeightGradientIsTheSameEveryRun) {
  // dweight is summed without atomics: per-CTA partial rows, then added in CTA order.
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  at::manual_seed(3);
  const at::Tensor x = at::randn({8192, 384}, cuda), w = at::rand({384}, cuda) + 0.5;
  const at::Tensor dy = at::randn({8192, 384}, cuda);
  const RmsNormForward f = rms_norm_forward(x, w, 1e-6);
  const at::Tensor first = rms_norm_backward(x, w, f.inv_rms, dy, true).dw;
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(at::equal(rms_norm_backward(x, w, f.inv_rms, dy, true).dw, first));
  EXPECT_FALSE(rms_norm_backward(x, w, f.inv_rms, dy, false).dw.defined());
}

TEST_F(NormKernel, ModelRmsNormTakesTheKernelWhereItApplies) {
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  at::manual_seed(5);
  const at::Tensor x = at::randn({3, 17, 384}, cuda), w = at::rand({384}, cuda) + 0.5;
  // Same fp32 operations, in the same order per element: equal up to the sum of squares' order.
  const double e = relative_error(model::rms_norm(x, w, 1e-5), model::rms_norm_reference(x, w, 1e-5).to(at::kDouble));
  std::printf("  model::rms_norm on CUDA vs rms_norm_reference: %.2e relative\n", e);
  EXPECT_LT(e, 2e-6);
  EXPECT_FALSE(rms_norm_supported(at::randn({4, 1025}, cuda), at::ones({1025}, cuda)));  // too wide: the reference
  EXPECT_FALSE(rms_norm_supported(at::randn({4, 8}, cuda.dtype(at::kDouble)), at::ones({8}, cuda)));
  EXPECT_EQ(model::rms_norm(at::randn({4, 1025}, cuda), at::ones({1025}, cuda), 1e-5).sizes(), (at::IntArrayRef{4, 1025}));
  EXPECT_THROW(rms_norm_forward(at::randn({4, 8}), at::ones({8}), 1e-5), c10::Error);  // CPU tensors
}

// ---- the attention-residual mix ---------------------------------------------------------------

TEST_F(NormKernel, AttnResMixForwardAndBackwardMatchAutogradOfTheFp64Reference) {
  // Sources of one shape, as the stream's embedding, block sums and running sum: 2 to 32 of them,
  // widths 7 ... 1024, rows 0 ... 1000, each source scaled differently (the RMSNorm makes the
  // logits scale-free; a large w saturates the softmax) and one source all zeros in some rows.
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  for (at::ScalarType t_dtype : {at::kFloat, at::kBFloat16}) {
    for (at::ScalarType w_dtype : {at::kFloat, at::kBFloat16}) {
      for (const auto& [count, width, rows, w_scale] : std::vector<std::tuple<int64_t, int64_t, int64_t, double>>{
               {2, 1024, 1000, 0.05}, {3, 1024, 257, 1.0}, {4, 384, 1000, 0.3}, {5, 33, 70, 0.5}, {9, 1024, 64, 0.2},
               {2, 7, 10, 1.0}, {32, 128, 40, 0.2}, {3, 1024, 0, 1.0}, {4, 256, 300, 8.0}}) {
        at::manual_seed(count * 131 + width + rows);
        std::vector<at::Tensor> sources, leaves_ref;
        for (int64_t s = 0; s < count; ++s) {
          at::Tensor x = at::randn({rows, width}, cuda) * (0.5 + s);
          if (s == 1 && rows > 3) x.narrow(0, 0, 3).zero_();
          sources.push_back(x.to(t_dtype).requires_grad_(true));
          leaves_ref.push_back(sources.back().detach().to(at::kDouble).requires_grad_(true));
        }
        const at::Tensor w = (at::randn({width}, cuda) * w_scale).to(w_dtype).requires_grad_(true);
        const at::Tensor w_ref = w.detach().to(at::kDouble).requires_grad_(true);
        ASSERT_TRUE(attn_res_mix_supported(sources, w));
        const at::Tensor h = attn_res_mix_autograd(sources, w, 1e-6);
        const at::Tensor dh = at::randn({rows, width}, cuda).to(t_dtype);
        h.backward(dh);
        const at::Tensor h_ref = model::attn_res_mix_reference(leaves_ref, w_ref, 1e-6);
        h_ref.backward(dh.to(at::kDouble));
        const std::string name = std::string(t_dtype == at::kFloat ? "fp32" : "bf16") + " sources, " +
                                 (w_dtype == at::kFloat ? "fp32" : "bf16") + " w, " + std::to_string(count) +
                                 " of width " + std::to_string(width) + ", rows " + std::to_string(rows);
        double e_dx = 0;
        for (int64_t s = 0; s < count; ++s) {
          ASSERT_TRUE(sources[s].grad().defined()) << name << ": source " << s;
          EXPECT_EQ(sources[s].grad().scalar_type(), t_dtype);
          e_dx = std::max(e_dx, relative_error(sources[s].grad(), leaves_ref[s].grad()));
        }
        const double e_h = relative_error(h, h_ref.detach()), e_dw = relative_error(w.grad(), w_ref.grad());
        if (rows >= 257 || count >= 9) {
          std::printf("  attn res mix %-50s h %.2e, dx %.2e, dw %.2e\n", name.c_str(), e_h, e_dx, e_dw);
        }
        // fp32: fp32 arithmetic (dw sums rows x sources), the logits' rounding amplified by their
        // size (|l| up to |w| sqrt(width): a saturated softmax); bf16 sources: one rounding of h
        // and dx, and dw from bf16 sources through softmax and norm terms.
        const double logits = std::max(1.0, w_scale);
        EXPECT_LT(e_h, t_dtype == at::kFloat ? 4e-6 * logits : 8e-3) << name;
        EXPECT_LT(e_dx, t_dtype == at::kFloat ? 4e-5 * logits : 1.6e-2) << name;
        EXPECT_LT(e_dw, t_dtype == at::kFloat && w_dtype == at::kFloat ? 4e-5 * logits : 1.6e-2) << name;
        EXPECT_EQ(h.scalar_type(), t_dtype);
        EXPECT_EQ(w.grad().scalar_type(), w_dtype);
        if (rows == 0) {
          EXPECT_EQ(w.grad().abs().max().item<double>(), 0.0) << name;
        }
      }
    }
  }
}

TEST_F(NormKernel, AttnResMixWeightsAreTheSoftmaxAndDwIsTheSameEveryRun) {
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  at::manual_seed(9);
  const std::vector<at::Tensor> sources = {at::randn({4096, 1024}, cuda), at::randn({4096, 1024}, cuda) * 3,
                                           at::randn({4096, 1024}, cuda) * 0.1};
  const at::Tensor w = at::randn({1024}, cuda) * 0.1, dh = at::randn({4096, 1024}, cuda);
  const AttnResMixForward f = attn_res_mix_forward(sources, w, 1e-6);
  // The kept weights are the reference's softmax, [rows, S].
  const at::Tensor expected = model::attn_res_weights(sources, w, 1e-6);  // [S, rows]
  const double e = relative_error(f.weights, expected.t().to(at::kDouble));
  std::printf("  attn res mix weights vs attn_res_weights: %.2e relative\n", e);
  EXPECT_LT(e, 2e-6);
  const at::Tensor first = attn_res_mix_backward(sources, w, f.weights, f.inv_rms, dh, true).dw;
  for (int i = 0; i < 5; ++i) {
    EXPECT_TRUE(at::equal(attn_res_mix_backward(sources, w, f.weights, f.inv_rms, dh, true).dw, first));
  }
  EXPECT_FALSE(attn_res_mix_backward(sources, w, f.weights, f.inv_rms, dh, false).dw.defined());
}

TEST_F(NormKernel, ModelAttnResMixTakesTheKernelWhereItApplies) {
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  at::manual_seed(11);
  const std::vector<at::Tensor> sources = {at::randn({3, 17, 384}, cuda), at::randn({3, 17, 384}, cuda)};
  const at::Tensor w = at::randn({384}, cuda);
  ASSERT_TRUE(attn_res_mix_supported(sources, w));
  const double e = relative_error(model::attn_res_mix(sources, w, 1e-6),
                                  model::attn_res_mix_reference(sources, w, 1e-6).to(at::kDouble));
  std::printf("  model::attn_res_mix on CUDA vs attn_res_mix_reference: %.2e relative\n", e);
  EXPECT_LT(e, 4e-6);
  // One source is the identity (no kernel); 33 sources, too wide, fp64 or mixed dtypes: the reference.
  EXPECT_FALSE(attn_res_mix_supported({sources[0]}, w));
  EXPECT_TRUE(model::attn_res_mix({sources[0]}, w, 1e-6).is_same(sources[0]));
  EXPECT_FALSE(attn_res_mix_supported(std::vector<at::Tensor>(33, sources[0]), w));
  EXPECT_EQ(model::attn_res_mix(std::vector<at::Tensor>(33, sources[0]), w, 1e-6).sizes(), sources[0].sizes());
  EXPECT_FALSE(attn_res_mix_supported({at::randn({4, 1025}, cuda), at::randn({4, 1025}, cuda)}, at::ones({1025}, cuda)));
  EXPECT_FALSE(attn_res_mix_supported({sources[0].to(at::kDouble), sources[1].to(at::kDouble)}, w));
  EXPECT_FALSE(attn_res_mix_supported({sources[0], sources[1].to(at::kBFloat16)}, w));
  EXPECT_THROW(attn_res_mix_forward({at::randn({4, 8}), at::randn({4, 8})}, at::ones({8}), 1e-6), c10::Error);  // CPU
}

}  // namespace
}  // namespace odyssey::kernels
