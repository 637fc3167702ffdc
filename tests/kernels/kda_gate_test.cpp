// The KDA layer's fused decay gate (kernels/kda_gate.h, kernels/kda_autograd.h's
// kda_gate_autograd, model::kda::gate) against the plain LibTorch formula
// (model::kda::gate_reference): g against the same formula in fp32 on the same device (and how many
// elements differ in their last bits), dz, dA_log and d dt_bias against autograd of the formula in
// fp64; z in bf16 and fp32, saturated sigmoids both ways, 0 to 1000 tokens, widths 4 to 128;
// the parameters' gradients the same bits every run; what the kernel refuses, and the model's
// dispatch falling back to the reference there. Every comparison prints its max error. Skipped
// without a CUDA device.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/function.h>
#include <torch/cuda.h>

#include "kernels/kda.h"
#include "kernels/kda_autograd.h"
#include "kernels/kda_gate.h"
#include "kernels/torch_bindings.h"
#include "model/kda.h"

namespace odyssey::kernels {
namespace {

namespace kda = odyssey::model::kda;

constexpr double kGMin = -5.0;

double relative_error(const at::Tensor& got, const at::Tensor& expected) {
  if (expected.numel() == 0) return 0.0;
  const double scale = std::max(1e-30, expected.abs().max().item<double>());
  return (got.to(at::kDouble) - expected.to(at::kDouble)).abs().max().item<double>() / scale;
}

struct GateInputs {
  at::Tensor z, a_log, dt_bias;  // z [tokens, heads, width] in the tested dtype; the parameters fp32
};

// z ~ 3 N(0, 1), with every seventh element pushed to +-60 (a sigmoid saturated both ways: g = 0
// and g = g_min); A_log spread so that exp(A) runs from ~0.2 to ~5.
GateInputs make_gate_inputs(int64_t tokens, int64_t heads, int64_t width, at::ScalarType z_dtype, uint64_t seed) {
  at::manual_seed(seed);
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  at::Tensor z = at::randn({tokens, heads, width}, cuda) * 3;
  const at::Tensor saturated = (at::arange(z.numel(), cuda.dtype(at::kLong)) % 7 == 0).view(z.sizes());
  z = at::where(saturated, at::sign(z) * 60, z);
  return {z.to(z_dtype), at::randn({heads}, cuda) * 0.8, at::randn({heads * width}, cuda)};
}

class KdaGateKernel : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(KdaGateKernel, ForwardAndBackwardMatchTheReferenceAndItsFp64Autograd) {
  for (at::ScalarType z_dtype : {at::kFloat, at::kBFloat16}) {
    for (int64_t width : {4, 32, 128}) {
      for (int64_t heads : {1, 3}) {
        for (int64_t tokens : {0, 1, 37, 1000}) {
          const std::string name = std::string(z_dtype == at::kFloat ? "fp32" : "bf16") + " z, width " +
                                   std::to_string(width) + ", heads " + std::to_string(heads) + ", tokens " +
                                   std::to_string(tokens);
          const GateInputs in = make_gate_inputs(tokens, heads, width, z_dtype, 17 * width + 5 * heads + tokens);
          ASSERT_TRUE(kda_gate_supported(in.z, in.a_log, in.dt_bias)) << name;

          // Forward: against the LibTorch formula on the same device and dtypes (fp32 arithmetic).
          const at::Tensor g = kda_gate(in.z, in.a_log, in.dt_bias, kGMin);
          const at::Tensor g_ref = kda::gate_reference(in.z, in.a_log, in.dt_bias, kGMin);
          ASSERT_EQ(g.sizes(), in.z.sizes()) << name;
          ASSERT_EQ(g.scalar_type(), at::kFloat) << name;
          ASSERT_EQ(g_ref.scalar_type(), at::kFloat) << name;
          const double g_error = tokens == 0 ? 0.0 : (g - g_ref).abs().max().item<double>();
          const int64_t differing = tokens == 0 ? 0 : (g != g_ref).sum().item<int64_t>();
          if (tokens == 0) {
            EXPECT_EQ(g.numel(), 0) << name;
          }
          EXPECT_TRUE(tokens == 0 || (g.max().item<double>() <= 0.0 && g.min().item<double>() >= kGMin)) << name;
          // |g| <= 5: a few ulps of fp32 (the exponential and the division) at most.
          EXPECT_LE(g_error, 2e-6) << name;

          // Backward: autograd of the formula in fp64 on the same values.
          const at::Tensor z = in.z.detach().requires_grad_(true);
          const at::Tensor a_log = in.a_log.detach().requires_grad_(true);
          const at::Tensor dt_bias = in.dt_bias.detach().requires_grad_(true);
          const at::Tensor dg = at::randn(in.z.sizes(), in.a_log.options());
          kda_gate_autograd(z, a_log, dt_bias, kGMin).backward(dg);
          const at::Tensor zr = in.z.detach().to(at::kDouble).requires_grad_(true);
          const at::Tensor ar = in.a_log.detach().to(at::kDouble).requires_grad_(true);
          const at::Tensor br = in.dt_bias.detach().to(at::kDouble).requires_grad_(true);
          kda::gate_reference(zr, ar, br, kGMin).backward(dg.to(at::kDouble));
          ASSERT_TRUE(z.grad().defined() && a_log.grad().defined() && dt_bias.grad().defined()) << name;
          EXPECT_EQ(z.grad().scalar_type(), z_dtype) << name;
          EXPECT_EQ(a_log.grad().sizes(), a_log.sizes()) << name;
          EXPECT_EQ(dt_bias.grad().sizes(), dt_bias.sizes()) << name;
          const double e_dz = relative_error(z.grad(), zr.grad());
          // A_log's gradient sums terms of both signs over the tokens and channels: its error is
          // measured against the sum of their magnitudes (a single token's 32 terms can cancel to
          // far below any one of them).
          double e_a = 0.0;
          if (tokens > 0) {
            const at::Tensor u = zr.detach() + br.detach().view({heads, width});
            const at::Tensor e_A = ar.detach().exp().view({heads, 1});
            const at::Tensor s = at::sigmoid(e_A * u);
            const at::Tensor magnitude =
                (dg.to(at::kDouble) * kGMin * s * (1 - s) * u * e_A).abs().sum(at::IntArrayRef{0, 2});
            e_a = ((a_log.grad().to(at::kDouble) - ar.grad()).abs() / magnitude.clamp_min(1e-30)).max().item<double>();
          }
          const double e_b = relative_error(dt_bias.grad(), br.grad());
          if (tokens == 1000 && heads == 3) {
            std::printf("  gate %-38s g %.1e (%lld of %lld elements differ from fp32 LibTorch), dz %.1e, "
                        "dA_log %.1e (of its terms' magnitude), d dt_bias %.1e (relative to the largest fp64 value)\n",
                        name.c_str(), g_error, static_cast<long long>(differing),
                        static_cast<long long>(g.numel()), e_dz, e_a, e_b);
          }
          // dz: fp32 arithmetic, or one rounding to bf16; the parameters' sums over up to 1000
          // tokens (and 128 channels for A_log) in fp32.
          EXPECT_LT(e_dz, z_dtype == at::kFloat ? 2e-6 : 8e-3) << name;
          EXPECT_LT(e_a, 2e-5) << name;
          EXPECT_LT(e_b, 2e-5) << name;
          if (tokens == 0) {
            EXPECT_EQ(a_log.grad().abs().max().item<double>(), 0.0) << name;
            EXPECT_EQ(dt_bias.grad().abs().max().item<double>(), 0.0) << name;
          }
        }
      }
    }
  }
}

TEST_F(KdaGateKernel, ParameterGradientsAreTheSameEveryRun) {
  // Summed without atomics (per-part sums added in order): two runs give the same bits.
  const GateInputs in = make_gate_inputs(4133, 4, 128, at::kBFloat16, 3);
  const at::Tensor dg = at::randn(in.z.sizes(), in.a_log.options());
  const KdaGateGradients first = kda_gate_backward(in.z, in.a_log, in.dt_bias, kGMin, dg, true, true, true);
  const KdaGateGradients second = kda_gate_backward(in.z, in.a_log, in.dt_bias, kGMin, dg, true, true, true);
  EXPECT_TRUE(at::equal(first.dz, second.dz));
  EXPECT_TRUE(at::equal(first.d_a_log, second.d_a_log));
  EXPECT_TRUE(at::equal(first.d_dt_bias, second.d_dt_bias));
  // Only what is asked for is made, and it is the same.
  const KdaGateGradients params = kda_gate_backward(in.z, in.a_log, in.dt_bias, kGMin, dg, false, true, false);
  EXPECT_FALSE(params.dz.defined());
  EXPECT_FALSE(params.d_dt_bias.defined());
  EXPECT_TRUE(at::equal(params.d_a_log, first.d_a_log));
  const KdaGateGradients dz_only = kda_gate_backward(in.z, in.a_log, in.dt_bias, kGMin, dg, true, false, false);
  EXPECT_TRUE(at::equal(dz_only.dz, first.dz));
  EXPECT_FALSE(dz_only.d_a_log.defined());
}

TEST_F(KdaGateKernel, NonContiguousAndOffsetInputsGiveTheSameResult) {
  // A z that is a view (heads interleaved with something else) and one that starts 4 bytes into
  // its storage: copied to dense, aligned tensors first.
  const GateInputs in = make_gate_inputs(50, 2, 32, at::kFloat, 9);
  const at::Tensor expected = kda_gate(in.z, in.a_log, in.dt_bias, kGMin);
  const at::Tensor wide = at::zeros({50, 2, 33}, in.z.options());
  wide.narrow(2, 1, 32).copy_(in.z);
  const at::Tensor offset_view = wide.narrow(2, 1, 32);
  EXPECT_TRUE(at::equal(kda_gate(offset_view, in.a_log, in.dt_bias, kGMin), expected));
  const at::Tensor transposed = in.z.transpose(0, 1).contiguous().transpose(0, 1);
  EXPECT_TRUE(at::equal(kda_gate(transposed, in.a_log, in.dt_bias, kGMin), expected));
  const at::Tensor dg = at::randn(in.z.sizes(), in.a_log.options());
  const KdaGateGradients a = kda_gate_backward(in.z, in.a_log, in.dt_bias, kGMin, dg, true, true, true);
  const at::Tensor dg_strided = dg.transpose(0, 1).contiguous().transpose(0, 1);
  const KdaGateGradients b = kda_gate_backward(offset_view, in.a_log, in.dt_bias, kGMin, dg_strided, true, true, true);
  EXPECT_TRUE(at::equal(a.dz, b.dz));
  EXPECT_TRUE(at::equal(a.d_a_log, b.d_a_log));
  EXPECT_TRUE(at::equal(a.d_dt_bias, b.d_dt_bias));
}

TEST_F(KdaGateKernel, RefusesWhatItCannotRunAndTheModelFallsBack) {
  const GateInputs in = make_gate_inputs(10, 2, 8, at::kFloat, 4);
  const auto cuda = in.a_log.options();
  // Width not a multiple of 4; bf16 parameters; a CPU z; A_log of the wrong size.
  const at::Tensor z6 = at::randn({10, 2, 6}, cuda);
  const at::Tensor b6 = at::randn({12}, cuda);
  EXPECT_FALSE(kda_gate_supported(z6, in.a_log, b6));
  EXPECT_FALSE(kda_gate_supported(in.z, in.a_log.to(at::kBFloat16), in.dt_bias));
  EXPECT_FALSE(kda_gate_supported(in.z, in.a_log, in.dt_bias.to(at::kBFloat16)));
  EXPECT_FALSE(kda_gate_supported(in.z.cpu(), in.a_log, in.dt_bias));
  EXPECT_FALSE(kda_gate_supported(in.z, at::randn({3}, cuda), in.dt_bias));
  EXPECT_FALSE(kda_gate_supported(in.z, in.a_log, at::randn({15}, cuda)));
  // The bindings' errors name what is wrong.
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { kda_gate(z6, in.a_log, b6, kGMin); }).find("width"), std::string::npos);
  EXPECT_NE(message([&] { kda_gate(in.z, at::randn({3}, cuda), in.dt_bias, kGMin); }).find("A_log"),
            std::string::npos);
  EXPECT_NE(message([&] { kda_gate(in.z, in.a_log, at::randn({15}, cuda), kGMin); }).find("dt_bias"),
            std::string::npos);
  EXPECT_NE(message([&] {
              kda_gate_backward(in.z, in.a_log, in.dt_bias, kGMin, at::randn({10, 2, 4}, cuda), true, true, true);
            }).find("dg"),
            std::string::npos);
  // The launchers check sizes and alignment before launching anything.
  EXPECT_EQ(kda_gate_forward(KdaDtype::kFloat32, in.z.data_ptr(), in.a_log.data_ptr<float>(),
                             in.dt_bias.data_ptr<float>(), -5.0f, in.z.data_ptr<float>(), 10, 2, 6, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(kda_gate_forward(KdaDtype::kFloat32, in.z.data_ptr<float>() + 1, in.a_log.data_ptr<float>(),
                             in.dt_bias.data_ptr<float>(), -5.0f, in.z.data_ptr<float>(), 1, 2, 4, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(kda_gate_backward(KdaDtype::kFloat32, in.z.data_ptr(), in.a_log.data_ptr<float>(),
                              in.dt_bias.data_ptr<float>(), -5.0f, in.z.data_ptr<float>(), nullptr,
                              in.a_log.data_ptr<float>(), nullptr, /*workspace=*/nullptr, 10, 2, 8, nullptr),
            cudaErrorInvalidValue);
  // model::kda::gate takes the reference where the kernel does not apply (the same values).
  const at::Tensor a16 = in.a_log.to(at::kBFloat16), b16 = in.dt_bias.to(at::kBFloat16);
  EXPECT_TRUE(at::equal(kda::gate(in.z, a16, b16, kGMin), kda::gate_reference(in.z, a16, b16, kGMin)));
  EXPECT_TRUE(at::equal(kda::gate(z6, in.a_log, b6, kGMin), kda::gate_reference(z6, in.a_log, b6, kGMin)));
  // ... and the kernel where it does, recorded for autograd.
  const at::Tensor z = in.z.detach().requires_grad_(true);
  const at::Tensor g = kda::gate(z, in.a_log, in.dt_bias, kGMin);
  EXPECT_TRUE(at::equal(g.detach(), kda_gate(in.z, in.a_log, in.dt_bias, kGMin)));
  ASSERT_TRUE(g.grad_fn() != nullptr);
  EXPECT_NE(g.grad_fn()->name().find("KdaGateFunction"), std::string::npos) << g.grad_fn()->name();
}

}  // namespace
}  // namespace odyssey::kernels
