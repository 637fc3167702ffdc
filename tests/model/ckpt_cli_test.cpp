// `odyssey ckpt info` and `odyssey ckpt convert`, run as the real binary on real checkpoints.
#include <stdlib.h>

#include <filesystem>
#include <map>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "cli/run_command.h"
#include "model/checkpoint.h"

namespace odyssey::model {
namespace {

namespace fs = std::filesystem;

class CkptCli : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::path(::testing::TempDir()) / "ckpt_cli_test_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    root_ = pattern;
    at::manual_seed(5);
    tensors_ = {{"embed.weight", at::randn({16, 8})}, {"layers.0.moe.router.bias", at::randn({64})},
                {"steps", at::arange(4, at::kLong)}};
    CheckpointMeta meta{"64K", {{"step", 12}}};
    SaveOptions options;
    options.dtype = at::kFloat;
    ASSERT_TRUE(save_checkpoint(path("src"), tensors_, {{"name", "t"}}, meta, options).ok());
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string path(const std::string& name) const { return (root_ / name).string(); }
  std::string odyssey(const std::string& args, int* code) const {
    return odyssey::testing::run_shell(std::string(ODYSSEY_BINARY) + " " + args, code);
  }

  fs::path root_;
  std::map<std::string, at::Tensor> tensors_;
};

TEST_F(CkptCli, InfoPrintsStageProvenanceAndCountsByDtype) {
  int code = 0;
  const std::string out = odyssey("ckpt info --tensors " + path("src"), &code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("stage: 64K"), std::string::npos) << out;
  EXPECT_NE(out.find("\"step\":12"), std::string::npos) << out;
  EXPECT_NE(out.find("tensors: 3"), std::string::npos) << out;
  EXPECT_NE(out.find("F32"), std::string::npos) << out;
  EXPECT_NE(out.find("I64"), std::string::npos) << out;
  EXPECT_NE(out.find("layers.0.moe.router.bias"), std::string::npos) << out;
  EXPECT_NE(out.find("total_size: " + std::to_string(16 * 8 * 4 + 64 * 4 + 4 * 8)), std::string::npos) << out;
}

TEST_F(CkptCli, ConvertToBf16KeepsIntegersAndRoundsFloatsOnce) {
  int code = 0;
  std::string out = odyssey("ckpt convert " + path("src") + " " + path("bf16") + " --dtype bf16", &code);
  ASSERT_EQ(code, 0) << out;
  auto info = inspect_checkpoint(path("bf16"));
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->tensors.at("embed.weight").info.dtype, at::kBFloat16);
  EXPECT_EQ(info->tensors.at("steps").info.dtype, at::kLong);
  EXPECT_EQ(info->meta.stage, "64K");
  EXPECT_EQ(info->meta.provenance.at("step"), 12);
  EXPECT_EQ(info->meta.provenance.at("converted_to_dtype"), "bf16");
  auto loaded = load_checkpoint(path("bf16"), {{"embed.weight", {{16, 8}, at::kBFloat16}},
                                               {"layers.0.moe.router.bias", {{64}, at::kBFloat16}},
                                               {"steps", {{4}, at::kLong}}});
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  EXPECT_TRUE(at::equal(loaded->tensors.at("embed.weight"), tensors_.at("embed.weight").to(at::kBFloat16)));
  EXPECT_TRUE(at::equal(loaded->tensors.at("steps"), tensors_.at("steps")));
  // Converting back to fp32 is exact (bf16 values are fp32 values).
  out = odyssey("ckpt convert " + path("bf16") + " " + path("back") + " --dtype fp32", &code);
  ASSERT_EQ(code, 0) << out;
  auto back = inspect_checkpoint(path("back"));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->tensors.at("embed.weight").info.dtype, at::kFloat);
}

TEST_F(CkptCli, BadDtypeMissingFolderAndExistingTargetAreClearErrors) {
  int code = 0;
  std::string out = odyssey("ckpt convert " + path("src") + " " + path("x") + " --dtype fp8", &code);
  EXPECT_NE(code, 0);
  EXPECT_NE(out.find("--dtype must be bf16, fp16 or fp32"), std::string::npos) << out;
  out = odyssey("ckpt info " + path("nope"), &code);
  EXPECT_NE(code, 0);
  EXPECT_NE(out.find(path("nope")), std::string::npos) << out;
  out = odyssey("ckpt convert " + path("src") + " " + path("src"), &code);
  EXPECT_NE(code, 0) << out;
  EXPECT_TRUE(fs::exists(path("src") + "/COMPLETE")) << "the source must survive a refused convert";
}

}  // namespace
}  // namespace odyssey::model
