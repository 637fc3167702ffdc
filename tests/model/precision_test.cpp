// model::Bf16Shadow: the medium float32 matmul precision's kept bf16 copies of parameters.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/types.h>

#include "model/precision.h"

namespace odyssey::model {
namespace {

TEST(Bf16Shadow, CastsOnceWhileTheSourceIsUnchangedAndAgainAfterAnyInPlaceWrite) {
  at::manual_seed(4);
  at::Tensor w = at::randn({6, 5}).requires_grad_(true);
  Bf16Shadow shadow;
  const at::Tensor a = shadow.get(w), b = shadow.get(w);
  EXPECT_EQ(shadow.casts(), 1);
  EXPECT_EQ(a.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(a, w.detach().to(at::kBFloat16)));
  EXPECT_EQ(a.data_ptr(), b.data_ptr());
  {
    const at::NoGradGuard no_grad;
    w.add_(1);  // what an optimizer step does
  }
  EXPECT_TRUE(at::equal(shadow.get(w), w.detach().to(at::kBFloat16)));
  EXPECT_EQ(shadow.casts(), 2);
  {
    const at::NoGradGuard no_grad;
    w.copy_(at::zeros({6, 5}));  // a checkpoint load
  }
  EXPECT_EQ(shadow.get(w).abs().sum().item<double>(), 0.0);
  EXPECT_EQ(shadow.casts(), 3);
  // Another tensor with the same values is another source.
  const at::Tensor other = w.detach().clone();
  shadow.get(other);
  EXPECT_EQ(shadow.casts(), 4);
  shadow.clear();
  shadow.get(other);
  EXPECT_EQ(shadow.casts(), 5);
  // A copy (a cloned module's) starts empty.
  Bf16Shadow copy(shadow);
  copy.get(other);
  EXPECT_EQ(copy.casts(), 1);
}

TEST(Bf16Shadow, TheGradientReachesTheSourceAsThroughACast) {
  at::manual_seed(5);
  const at::Tensor init = at::randn({8, 4});
  const at::Tensor c = at::randn({8, 4}).to(at::kBFloat16);
  at::Tensor w = init.clone().requires_grad_(true), reference = init.clone().requires_grad_(true);
  Bf16Shadow shadow;
  // Two uses in one step (a forward and its recomputation) accumulate as two casts' would.
  for (int use = 0; use < 2; ++use) {
    (shadow.get(w) * c).to(at::kFloat).square().sum().backward();
    (reference.to(at::kBFloat16) * c).to(at::kFloat).square().sum().backward();
  }
  EXPECT_EQ(shadow.casts(), 1);
  ASSERT_TRUE(w.grad().defined());
  EXPECT_EQ(w.grad().scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(w.grad(), reference.grad()));
  {
    const at::NoGradGuard no_grad;
    EXPECT_FALSE(shadow.get(w).requires_grad());
  }
  EXPECT_FALSE(shadow.get(w.detach()).requires_grad());
}

}  // namespace
}  // namespace odyssey::model
