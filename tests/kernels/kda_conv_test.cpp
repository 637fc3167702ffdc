// The KDA layer's fused short convolution (kernels/kda_conv.h, kda_short_conv_autograd, and
// IncrementalAttention taking it) against the LibTorch formula the layer uses otherwise: the
// causal depthwise convolution of [conv_inputs | x] as products and sums in order, SiLU, and each
// head's L2 norm. y against the formula in fp32 on the same device (with how many elements differ
// at all), dx, d conv_inputs and d weight against autograd of the formula in fp64; convolution
// widths 1 to 4, no norm and heads of 32 and 128 channels, 0 to 700 tokens, one and two sequences;
// the weight's gradient the same bits every run; a layer run chunk by chunk equal to one call;
// what the kernel refuses. Every comparison prints its max error. Skipped without a CUDA device.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/function.h>
#include <torch/cuda.h>

#include "kernels/kda_autograd.h"
#include "kernels/kda_conv.h"
#include "kernels/torch_bindings.h"
#include "model/kda.h"

namespace odyssey::kernels {
namespace {

constexpr double kEps = 1e-6;

double relative_error(const at::Tensor& got, const at::Tensor& expected) {
  if (expected.numel() == 0) return 0.0;
  const double scale = std::max(1e-30, expected.abs().max().item<double>());
  return (got.to(at::kDouble) - expected.to(at::kDouble)).abs().max().item<double>() / scale;
}

// The layer's LibTorch chain, any dtype.
at::Tensor reference(const at::Tensor& x, const at::Tensor& conv_inputs, const at::Tensor& weight, int64_t head) {
  return model::kda::short_conv_reference(x, conv_inputs, weight, head, kEps);
}

class KdaConvKernel : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(KdaConvKernel, ForwardAndBackwardMatchTheLayersFormulaAndItsFp64Autograd) {
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  for (int64_t width : {1, 2, 3, 4}) {
    for (int64_t head : {0, 32, 128}) {
      for (int64_t batch : {1, 2}) {
        for (int64_t length : {0, 1, 3, 100, 700}) {
          const int64_t channels = head == 32 ? 128 : 256;
          const std::string name = "W " + std::to_string(width) + ", head " + std::to_string(head) + ", B " +
                                   std::to_string(batch) + ", T " + std::to_string(length);
          at::manual_seed(width * 1000 + head * 10 + batch + length);
          const at::Tensor x = at::randn({batch, length, channels}, cuda);
          const at::Tensor conv_inputs = at::randn({batch, width - 1, channels}, cuda);
          const at::Tensor weight = at::randn({channels, 1, width}, cuda) * 0.5;
          ASSERT_TRUE(kda_short_conv_supported(x, conv_inputs, weight, head)) << name;

          const at::Tensor y = kda_short_conv(x, conv_inputs, weight, head, kEps);
          const at::Tensor y_ref = reference(x, conv_inputs, weight, head);
          ASSERT_EQ(y.sizes(), x.sizes()) << name;
          const double y_error = length == 0 ? 0.0 : (y - y_ref).abs().max().item<double>();
          const int64_t differing = length == 0 ? 0 : (y != y_ref).sum().item<int64_t>();
          // |y| <= ~10 without the norm, <= 1 with it: a few ulps of fp32.
          EXPECT_LE(y_error, 1e-5) << name;

          const at::Tensor xg = x.detach().requires_grad_(true);
          const at::Tensor cg = conv_inputs.detach().requires_grad_(true);
          const at::Tensor wg = weight.detach().requires_grad_(true);
          const at::Tensor dy = at::randn(x.sizes(), cuda);
          kda_short_conv_autograd(xg, cg, wg, head, kEps).backward(dy);
          const at::Tensor xr = x.to(at::kDouble).requires_grad_(true);
          const at::Tensor cr = conv_inputs.to(at::kDouble).requires_grad_(true);
          const at::Tensor wr = weight.to(at::kDouble).requires_grad_(true);
          reference(xr, cr, wr, head).backward(dy.to(at::kDouble));
          const double e_y = relative_error(y, reference(xr, cr, wr, head).detach());
          const double e_dx = relative_error(xg.grad(), xr.grad());
          const double e_dc = relative_error(cg.grad(), cr.grad());
          const double e_dw = relative_error(wg.grad(), wr.grad());
          if (length == 700 && batch == 2) {
            std::printf("  short conv %-28s y %.1e of fp32 LibTorch (%lld of %lld elements differ), of fp64 %.1e; "
                        "dx %.1e, d conv_inputs %.1e, d weight %.1e\n",
                        name.c_str(), y_error, static_cast<long long>(differing),
                        static_cast<long long>(y.numel()), e_y, e_dx, e_dc, e_dw);
          }
          EXPECT_LT(e_y, 2e-6) << name;
          EXPECT_LT(e_dx, 1e-5) << name;
          EXPECT_LT(e_dc, 1e-5) << name;
          EXPECT_LT(e_dw, 2e-5) << name;
          EXPECT_EQ(wg.grad().sizes(), weight.sizes()) << name;
          EXPECT_EQ(cg.grad().sizes(), conv_inputs.sizes()) << name;
        }
      }
    }
  }
}

TEST_F(KdaConvKernel, WeightGradientIsTheSameEveryRunAndOnlyWhatIsAskedIsMade) {
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  at::manual_seed(5);
  const at::Tensor x = at::randn({2, 3000, 512}, cuda), conv_inputs = at::randn({2, 3, 512}, cuda);
  const at::Tensor weight = at::randn({512, 1, 4}, cuda), dy = at::randn({2, 3000, 512}, cuda);
  const KdaShortConvGradients a = kda_short_conv_backward(x, conv_inputs, weight, 128, kEps, dy, true, true, true);
  const KdaShortConvGradients b = kda_short_conv_backward(x, conv_inputs, weight, 128, kEps, dy, true, true, true);
  EXPECT_TRUE(at::equal(a.dx, b.dx));
  EXPECT_TRUE(at::equal(a.d_conv_inputs, b.d_conv_inputs));
  EXPECT_TRUE(at::equal(a.d_weight, b.d_weight));
  const KdaShortConvGradients w = kda_short_conv_backward(x, conv_inputs, weight, 128, kEps, dy, false, false, true);
  EXPECT_FALSE(w.dx.defined());
  EXPECT_FALSE(w.d_conv_inputs.defined());
  EXPECT_TRUE(at::equal(w.d_weight, a.d_weight));
}

TEST_F(KdaConvKernel, LayerChunkByChunkEqualsOneCallThroughTheKernels) {
  // fp32 on CUDA, heads of 64 (D = 128): the layer's q, k, v take the fused convolution, and the
  // conv inputs it carries between calls continue the sequence.
  model::IncrementalAttentionOptions options;
  options.hidden = 64;
  options.heads = 2;
  options.head_k_dim = 64;
  options.head_v_dim = 64;
  options.decay_rank = 16;
  at::manual_seed(12);
  model::IncrementalAttention layer(options);
  layer->to(at::kCUDA);
  const at::Tensor x = at::randn({2, 70, options.hidden}, at::TensorOptions().device(at::kCUDA));
  const at::NoGradGuard no_grad;
  const at::Tensor whole = layer->forward(x);
  model::KdaState state = layer->initial_state(2);
  const at::Tensor first = layer->forward_chunk(x.slice(1, 0, 2), state);  // shorter than the window
  const at::Tensor second = layer->forward_chunk(x.slice(1, 2, 33), state);
  const at::Tensor third = layer->forward_chunk(x.slice(1, 33, 70), state);
  const double error = (at::cat({first, second, third}, 1) - whole).abs().max().item<double>();
  std::printf("  layer chunk by chunk (2 + 31 + 37 tokens) against one call: max error %.2e\n", error);
  // The outputs go through the attention core's kernels, whose bf16 matmul operands round
  // differently under another chunking (kernels/kda.h, "Numerics"; the core's own continuation test
  // allows 2e-2): the convolution's share is the conv inputs it carries, equal bit for bit below.
  EXPECT_LT(error, 2e-2 * std::max(1.0, whole.abs().max().item<double>()));
  // The conv inputs carried: the last three projections, as one call over all 70 tokens leaves them.
  model::KdaState once = layer->initial_state(2);
  layer->forward_chunk(x, once);
  EXPECT_TRUE(at::equal(state.q_conv_inputs, once.q_conv_inputs));
  EXPECT_TRUE(at::equal(state.k_conv_inputs, once.k_conv_inputs));
  EXPECT_TRUE(at::equal(state.v_conv_inputs, once.v_conv_inputs));
}

TEST_F(KdaConvKernel, RefusesWhatItCannotRun) {
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  const at::Tensor x = at::randn({1, 5, 128}, cuda), conv_inputs = at::zeros({1, 3, 128}, cuda);
  const at::Tensor weight = at::randn({128, 1, 4}, cuda);
  EXPECT_TRUE(kda_short_conv_supported(x, conv_inputs, weight, 128));
  EXPECT_FALSE(kda_short_conv_supported(at::randn({1, 5, 96}, cuda), at::zeros({1, 3, 96}, cuda),
                                        at::randn({96, 1, 4}, cuda), 32));  // D not a multiple of 128
  EXPECT_FALSE(kda_short_conv_supported(x.to(at::kBFloat16), conv_inputs, weight, 128));
  EXPECT_FALSE(kda_short_conv_supported(x, conv_inputs, at::randn({128, 1, 5}, cuda), 128));  // W = 5
  EXPECT_FALSE(kda_short_conv_supported(x, at::zeros({1, 2, 128}, cuda), weight, 128));      // W - 1 rows
  EXPECT_FALSE(kda_short_conv_supported(x, conv_inputs, weight, 96));                          // 24 lanes
  EXPECT_FALSE(kda_short_conv_supported(x.cpu(), conv_inputs, weight, 128));
  try {
    kda_short_conv(x, conv_inputs, weight, 96, kEps);
    FAIL() << "head 96 was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("head 96"), std::string::npos) << e.what();
  }
  EXPECT_EQ(kda_short_conv_forward(x.data_ptr<float>(), conv_inputs.data_ptr<float>(), weight.data_ptr<float>(),
                                   x.data_ptr<float>(), 1, 5, 128, 5, 128, 1e-6f, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(kda_short_conv_backward(x.data_ptr<float>(), conv_inputs.data_ptr<float>(), weight.data_ptr<float>(),
                                    x.data_ptr<float>(), nullptr, nullptr, weight.data_ptr<float>(),
                                    /*workspace=*/nullptr, 1, 5, 128, 4, 128, 1e-6f, nullptr),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace odyssey::kernels
