#include "model/vision.h"

#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "model/config.h"

namespace odyssey::model {
namespace {

ModelConfig load_tiny() {
  auto config = load_model_config({std::string(ODYSSEY_SOURCE_DIR) + "/configs/model/tiny.toml"});
  EXPECT_TRUE(config.ok()) << config.status().message();
  return config.ok() ? *config : ModelConfig{};
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// The tiny config's encoder in fp64 (P = 8, C = 3, width 64, depth 2, 4 heads, d = 128).
VisionEncoder tiny_encoder_fp64() {
  at::manual_seed(7);
  VisionEncoder encoder(vision_encoder_options(load_tiny()));
  encoder->to(at::kDouble);
  return encoder;
}

at::Tensor images(int64_t batch, int64_t h, int64_t w) {
  return at::rand({batch, 3, h, w}, at::TensorOptions().dtype(at::kDouble));
}

TEST(VisionEncoder, NamesAndShapesMatchTheConfigTensorList) {
  const ModelConfig config = load_tiny();
  ASSERT_TRUE(config.vision.enabled);
  VisionEncoder encoder(vision_encoder_options(config));
  std::vector<std::string> expected, actual;
  for (const ModelTensor& t : model_tensors(config)) {
    if (t.component != Component::kVision) continue;
    std::string shape;
    for (int64_t s : t.shape) shape += " " + std::to_string(s);
    expected.push_back(t.name + shape);
  }
  for (const auto& item : encoder->named_parameters()) {
    std::string shape;
    for (int64_t s : item.value().sizes()) shape += " " + std::to_string(s);
    actual.push_back("vision." + item.key() + shape);
  }
  EXPECT_EQ(actual, expected);
  EXPECT_EQ(encoder->buffers().size(), 0u);
}

TEST(VisionEncoder, ShapesAndPatchCounts) {
  VisionEncoder encoder = tiny_encoder_fp64();
  EXPECT_EQ(encoder->num_patches(32, 24), 12);
  EXPECT_EQ(encoder->num_patches(33, 24), 15);
  EXPECT_EQ(encoder->num_patches(1, 1), 1);
  EXPECT_EQ(vision_num_patches(14, 224, 224), 256);
  EXPECT_EQ(vision_num_patches(14, 225, 230), 17 * 17);
  at::NoGradGuard no_grad;
  const at::Tensor y = encoder->encode(images(2, 32, 24));
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{2, 12, 128}));
  EXPECT_EQ(y.scalar_type(), at::kDouble);
  EXPECT_EQ(encoder->encode(images(1, 17, 9)).sizes(), (std::vector<int64_t>{1, 3 * 2, 128}));
  EXPECT_THROW(encoder->encode(at::rand({1, 4, 8, 8}, at::kDouble)), c10::Error);  // 4 channels
  EXPECT_THROW(encoder->encode(at::rand({3, 8, 8}, at::kDouble)), c10::Error);     // no batch dim
}

// Same inputs, same outputs, bit for bit; and each image is encoded independently of its batch.
TEST(VisionEncoder, DeterministicAndBatchIndependent) {
  VisionEncoder encoder = tiny_encoder_fp64();
  at::NoGradGuard no_grad;
  const at::Tensor x = images(3, 16, 24);
  const at::Tensor a = encoder->encode(x);
  EXPECT_TRUE(at::equal(a, encoder->encode(x)));
  const double diff = max_abs_diff(a.narrow(0, 1, 1), encoder->encode(x.narrow(0, 1, 1)));
  std::printf("  max |diff| batch vs alone %.3e\n", diff);
  EXPECT_LT(diff, 1e-12);
}

// Patch p = r·cols + c holds pixels (ch, r·P + i, c·P + j) at feature ch·P·P + i·P + j; the
// padding is zeros at the bottom and the right.
TEST(VisionEncoder, PatchLayoutAndPadding) {
  VisionEncoder encoder = tiny_encoder_fp64();
  const at::Tensor x = images(2, 13, 19);  // 2 rows × 3 cols of 8×8 patches, padded to 16 × 24
  const at::Tensor patches = encoder->patchify(x);
  ASSERT_EQ(patches.sizes(), (std::vector<int64_t>{2, 6, 3 * 64}));
  const at::Tensor padded = at::zeros({2, 3, 16, 24}, x.options());
  padded.narrow(2, 0, 13).narrow(3, 0, 19).copy_(x);
  for (int64_t r = 0; r < 2; ++r) {
    for (int64_t c = 0; c < 3; ++c) {
      const at::Tensor expected = padded.narrow(2, r * 8, 8).narrow(3, c * 8, 8).reshape({2, 3 * 64});
      EXPECT_TRUE(at::equal(patches.select(1, r * 3 + c), expected)) << "patch " << r << "," << c;
    }
  }
  at::NoGradGuard no_grad;
  // An image that is not a multiple of P encodes as its zero-padded version.
  EXPECT_TRUE(at::equal(encoder->encode(x), encoder->encode(padded)));
  const at::Tensor changed = x.clone();
  changed[0][0][12][18] += 0.5;  // the bottom-right pixel, inside the last patch
  EXPECT_FALSE(at::equal(encoder->encode(changed), encoder->encode(x)));
}

// Bidirectional: the first patch's output depends on the last patch (no causal mask).
TEST(VisionEncoder, AttentionSeesEveryPatch) {
  VisionEncoder encoder = tiny_encoder_fp64();
  at::NoGradGuard no_grad;
  const at::Tensor x = images(1, 16, 16);
  const at::Tensor changed = x.clone();
  changed.narrow(2, 8, 8).narrow(3, 8, 8).add_(0.25);  // the last of 4 patches
  const at::Tensor a = encoder->encode(x);
  const at::Tensor b = encoder->encode(changed);
  EXPECT_GT(max_abs_diff(a.select(1, 0), b.select(1, 0)), 1e-6);
}

TEST(VisionEncoder, GradientsReachEveryParameterAndThePixels) {
  VisionEncoder encoder = tiny_encoder_fp64();
  const at::Tensor x = images(2, 20, 12).requires_grad_(true);
  const at::Tensor y = encoder->encode(x);
  (y * at::randn_like(y)).sum().backward();
  for (const auto& item : encoder->named_parameters()) {
    ASSERT_TRUE(item.value().grad().defined()) << item.key();
    EXPECT_GT(item.value().grad().abs().max().item<double>(), 0) << item.key();
  }
  ASSERT_TRUE(x.grad().defined());
  EXPECT_GT(x.grad().abs().max().item<double>(), 0);
}

TEST(VisionEncoder, Fp32MatchesFp64) {
  VisionEncoder encoder = tiny_encoder_fp64();
  at::NoGradGuard no_grad;
  const at::Tensor x = images(1, 24, 24);
  const at::Tensor reference = encoder->encode(x);
  encoder->to(at::kFloat);
  const at::Tensor y = encoder->encode(x.to(at::kFloat));
  EXPECT_EQ(y.scalar_type(), at::kFloat);
  const double diff = max_abs_diff(y, reference);
  std::printf("  max |diff| fp32 vs fp64 %.3e\n", diff);
  EXPECT_LT(diff, 1e-4);
}

}  // namespace
}  // namespace odyssey::model
