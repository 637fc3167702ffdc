// The learner's AdamW against torch::optim::AdamW step for step, its state round trip, the
// learning-rate schedule and gradient clipping.
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/types.h>
#include <torch/optim/adamw.h>

#include "learner/optimizer.h"

namespace odyssey::learner {
namespace {

TEST(AdamW, MatchesTorchOptimAdamWStepForStep) {
  at::manual_seed(1);
  const at::Tensor init_a = at::randn({5, 3}), init_b = at::randn({7});
  at::Tensor a = init_a.clone().requires_grad_(true), b = init_b.clone().requires_grad_(true);
  at::Tensor ta = init_a.clone().requires_grad_(true), tb = init_b.clone().requires_grad_(true);
  AdamW ours({{"a", a}, {"b", b}}, AdamWOptions{1e-2, 0.9, 0.95, 1e-8, 0.1});
  torch::optim::AdamW theirs({ta, tb}, torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1));
  for (int step = 0; step < 5; ++step) {
    const at::Tensor ga = at::randn({5, 3}), gb = at::randn({7});
    a.mutable_grad() = ga.clone();
    b.mutable_grad() = gb.clone();
    ta.mutable_grad() = ga.clone();
    tb.mutable_grad() = gb.clone();
    ours.step(1e-2);
    theirs.step();
    EXPECT_TRUE(at::allclose(a, ta, 0, 1e-7)) << "step " << step << ": " << (a - ta).abs().max().item<double>();
    EXPECT_TRUE(at::allclose(b, tb, 0, 1e-7)) << "step " << step;
  }
}

TEST(AdamW, RestoredStateContinuesBitForBit) {
  at::manual_seed(2);
  at::Tensor p = at::randn({4, 4}).requires_grad_(true);
  AdamW first({{"p", p}}, AdamWOptions{1e-3, 0.9, 0.95, 1e-8, 0.0});
  for (int i = 0; i < 3; ++i) {
    p.mutable_grad() = at::randn({4, 4});
    first.step(1e-3);
  }
  const auto state = first.state();
  at::Tensor q = p.detach().clone().requires_grad_(true);
  AdamW second({{"p", q}}, AdamWOptions{1e-3, 0.9, 0.95, 1e-8, 0.0});
  ASSERT_TRUE(second.restore(state, first.steps()).ok());
  const at::Tensor g = at::randn({4, 4});
  p.mutable_grad() = g.clone();
  q.mutable_grad() = g.clone();
  first.step(1e-3);
  second.step(1e-3);
  EXPECT_TRUE(at::equal(p, q));
  EXPECT_EQ(second.steps(), 4);
}

TEST(AdamW, RestoreRefusesAMismatchedStateAndChangesNothing) {
  at::Tensor p = at::zeros({2, 2}).requires_grad_(true);
  AdamW opt({{"p", p}}, AdamWOptions{});
  std::map<std::string, at::Tensor> bad = {{"exp_avg.p", at::ones({3})},
                                           {"exp_avg_sq.p", at::ones({2, 2})},
                                           {"step.p", at::ones({1}, at::kLong)}};
  const Status st = opt.restore(bad, 1);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("exp_avg.p"), std::string::npos) << st.message();
  EXPECT_EQ(opt.state().at("exp_avg.p").abs().sum().item<double>(), 0.0);
  EXPECT_EQ(opt.steps(), 0);
}

// On a GPU the step is LibTorch's fused multi-tensor AdamW. It has to be the same update as the
// per-parameter form (to fp32 rounding) and as torch::optim::AdamW, take the parameters whose
// gradients it cannot (a gradient laid out unlike its parameter) through the per-parameter form in
// the same step, each form continuing the other's update count when a parameter moves between
// them, leave a parameter without a gradient alone, and resume from a saved state exactly.
TEST(AdamW, GpuFusedStepMatchesThePerParameterStepAndResumes) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a CUDA device";
  at::manual_seed(3);
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  const std::vector<at::Tensor> inits = {at::randn({64, 33}, cuda), at::randn({33, 64}, cuda).t(),
                                         at::randn({1000}, cuda), at::randn({5, 3}, cuda), at::randn({7}, cuda)};
  auto make = [&](bool fused) {
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (size_t i = 0; i < inits.size(); ++i)
      named.emplace_back("p" + std::to_string(i), inits[i].clone(at::MemoryFormat::Preserve).requires_grad_(true));
    AdamWOptions o{1e-2, 0.9, 0.95, 1e-8, 0.1};
    o.fused = fused;
    return std::make_pair(named, o);
  };
  auto [fused_params, fused_options] = make(true);
  auto [plain_params, plain_options] = make(false);
  AdamW fused(fused_params, fused_options), plain(plain_params, plain_options);
  std::vector<at::Tensor> torch_params;
  for (const auto& p : inits) torch_params.push_back(p.clone(at::MemoryFormat::Preserve).requires_grad_(true));
  torch::optim::AdamW theirs(torch_params,
                             torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1));
  auto set_grads = [&](int step) {
    for (size_t i = 0; i < inits.size(); ++i) {
      if (i == 4) continue;  // p4 never has a gradient
      at::Tensor g = at::randn_like(inits[i], at::MemoryFormat::Preserve);
      // p3's gradient is laid out unlike p3 (a transposed copy) at odd steps: the per-parameter
      // form takes it then, the fused step at even ones.
      if (i == 3 && step % 2 == 1) g = at::randn({3, 5}, cuda).t();
      if (step == 2 && i == 2) continue;  // p2 skips one step
      fused_params[i].second.mutable_grad() = g.clone(at::MemoryFormat::Preserve);
      plain_params[i].second.mutable_grad() = g.clone(at::MemoryFormat::Preserve);
      torch_params[i].mutable_grad() = g.clone(at::MemoryFormat::Preserve);
    }
  };
  for (int step = 0; step < 6; ++step) {
    for (size_t i = 0; i < inits.size(); ++i) {
      fused_params[i].second.mutable_grad() = at::Tensor();
      plain_params[i].second.mutable_grad() = at::Tensor();
      torch_params[i].mutable_grad() = at::Tensor();
    }
    set_grads(step);
    fused.step(1e-2);
    plain.step(1e-2);
    theirs.step();
    for (size_t i = 0; i < inits.size(); ++i) {
      const double to_plain = (fused_params[i].second - plain_params[i].second).abs().max().item<double>();
      const double to_torch = (fused_params[i].second - torch_params[i]).abs().max().item<double>();
      EXPECT_LE(to_plain, 2e-6) << "step " << step << ", p" << i;
      EXPECT_LE(to_torch, 2e-6) << "step " << step << ", p" << i;
    }
  }
  EXPECT_TRUE(at::equal(fused_params[4].second, inits[4]));  // no gradient: untouched
  const auto state = fused.state();
  EXPECT_EQ(state.at("step.p0").item<int64_t>(), 6);
  EXPECT_EQ(state.at("step.p2").item<int64_t>(), 5);
  EXPECT_EQ(state.at("step.p4").item<int64_t>(), 0);

  // A second optimizer restored from the first's state (on fresh parameter copies) continues it
  // exactly: the fused step's device-side counts come from the restored ones.
  std::vector<std::pair<std::string, at::Tensor>> resumed_params;
  for (const auto& [name, p] : fused_params)
    resumed_params.emplace_back(name, p.detach().clone(at::MemoryFormat::Preserve).requires_grad_(true));
  AdamW resumed(resumed_params, fused_options);
  ASSERT_TRUE(resumed.restore(state, fused.steps()).ok());
  for (size_t i = 0; i < inits.size(); ++i) {
    const at::Tensor g = at::randn_like(inits[i], at::MemoryFormat::Preserve);
    fused_params[i].second.mutable_grad() = g.clone(at::MemoryFormat::Preserve);
    resumed_params[i].second.mutable_grad() = g.clone(at::MemoryFormat::Preserve);
  }
  fused.step(1e-2);
  resumed.step(1e-2);
  for (size_t i = 0; i < inits.size(); ++i)
    EXPECT_TRUE(at::equal(fused_params[i].second, resumed_params[i].second)) << "p" << i;
}

TEST(LearningRate, WarmsUpLinearlyThenHoldsOrFollowsTheCosine) {
  ScheduleOptions s{/*warmup_steps=*/4, /*total_steps=*/14, LrSchedule::kConstant};
  EXPECT_DOUBLE_EQ(learning_rate(1.0, s, 0), 0.25);
  EXPECT_DOUBLE_EQ(learning_rate(1.0, s, 3), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(1.0, s, 10), 1.0);
  s.schedule = LrSchedule::kCosine;
  EXPECT_DOUBLE_EQ(learning_rate(2.0, s, 4), 2.0);
  EXPECT_NEAR(learning_rate(2.0, s, 9), 1.0, 1e-12);  // halfway through the 10 decay steps
  EXPECT_NEAR(learning_rate(2.0, s, 14), 0.0, 1e-12);
  EXPECT_NEAR(learning_rate(2.0, s, 20), 0.0, 1e-12);
}

TEST(ClipGradNorm, ScalesTheGlobalNormDownToTheLimitAndReportsTheNormBefore) {
  at::Tensor a = at::zeros({2}).requires_grad_(true), b = at::zeros({1}).requires_grad_(true),
             c = at::zeros({1}).requires_grad_(true);
  a.mutable_grad() = at::tensor({3.0f, 0.0f});
  b.mutable_grad() = at::tensor({4.0f});
  const double norm = clip_grad_norm({a, b, c}, 1.0);  // c has no gradient
  EXPECT_NEAR(norm, 5.0, 1e-6);
  EXPECT_NEAR(a.grad()[0].item<double>(), 0.6, 1e-5);
  EXPECT_NEAR(b.grad()[0].item<double>(), 0.8, 1e-5);
  EXPECT_NEAR(clip_grad_norm({a, b}, 10.0), 1.0, 1e-5);  // under the limit: unchanged
  EXPECT_NEAR(b.grad()[0].item<double>(), 0.8, 1e-5);
}

// Gradients whose squares overflow fp32 (the multi-tensor norm's per-tensor sums) still get their
// finite norm, in fp64, and are clipped: an inf would make the learner skip the update.
TEST(ClipGradNorm, AGradientBeyondTheFp32SquaresStillGetsItsNormAndIsClipped) {
  for (const bool cuda : {false, true}) {
    if (cuda && !at::hasCUDA()) continue;
    const auto options = at::TensorOptions().device(cuda ? at::kCUDA : at::kCPU);
    at::Tensor a = at::zeros({2}, options).requires_grad_(true), b = at::zeros({1}, options).requires_grad_(true);
    a.mutable_grad() = at::full({2}, 3e38, options);
    b.mutable_grad() = at::full({1}, 3e38, options);
    const double norm = clip_grad_norm({a, b}, 1.0);
    EXPECT_NEAR(norm / 3e38, std::sqrt(3.0), 1e-6) << (cuda ? "cuda" : "cpu");
    EXPECT_NEAR(a.grad()[0].item<double>(), 1 / std::sqrt(3.0), 1e-5) << (cuda ? "cuda" : "cpu");
    EXPECT_NEAR(b.grad()[0].item<double>(), 1 / std::sqrt(3.0), 1e-5) << (cuda ? "cuda" : "cpu");
  }
}

}  // namespace
}  // namespace odyssey::learner
