// The fused RMSNorm (kernels/rms_norm.h, kernels/norm_autograd.h) against autograd of the plain
// LibTorch formula (model::rms_norm_reference) in fp64: y, dx and dweight for bf16 / fp32 inputs
// and weights, widths 2 ... 1024, rows 0 ... 1000; dweight's determinism; and model::rms_norm's
// dispatch. Every comparison prints its max error. Skipped without a CUDA device.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include "kernels/norm_autograd.h"
#include "kernels/torch_bindings.h"
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

}  // namespace
}  // namespace odyssey::kernels
