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

}  // namespace
}  // namespace odyssey::learner
