#include "model/attention.h"

#include <sys/resource.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/utils.h>

#include "model/precision.h"

namespace odyssey::model {
namespace {

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0) return 0.0;
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

void report(const std::string& what, double value) {
  std::printf("  max |diff| %-56s %.3e\n", what.c_str(), value);
}

struct Case {
  std::string label;
  int64_t batch, q_heads, kv_heads, tq, tk, d, dv, causal_offset, block;
};

std::vector<Case> cases() {
  return {
      {"self-attention T=37 block 8", 2, 3, 3, 37, 37, 8, 5, 0, 8},
      {"self-attention T=37 block 64 (one tile)", 1, 2, 2, 37, 37, 8, 5, 0, 64},
      {"chunk continuing a cache Tq=11 Tk=30", 2, 2, 2, 11, 30, 6, 7, 19, 4},
      {"offset 0 with Tq<Tk (future keys hidden)", 1, 2, 2, 9, 25, 6, 4, 0, 3},
      {"offset 3 with Tq>Tk", 1, 2, 2, 20, 12, 6, 4, 3, 7},
      {"negative offset: first rows see no key", 1, 2, 2, 10, 10, 4, 3, -4, 3},
      {"offset >= Tk-1: every key visible", 1, 2, 2, 7, 13, 4, 3, 50, 5},
      {"shared kv head (Hk=1), Hq=5, block 4", 2, 5, 1, 9, 23, 10, 6, 14, 4},
      {"grouped queries Hq=4 Hk=2", 1, 4, 2, 13, 13, 6, 6, 0, 5},
      {"one decode token, shared kv, block 2", 2, 6, 1, 1, 17, 8, 5, 16, 2},
  };
}

struct Inputs {
  at::Tensor q, k, v;
};

Inputs random_inputs(const Case& c, uint64_t seed, at::ScalarType dtype = at::kDouble) {
  torch::manual_seed(seed);
  const auto opts = at::TensorOptions().dtype(dtype);
  return {at::randn({c.batch, c.q_heads, c.tq, c.d}, opts),
          at::randn({c.batch, c.kv_heads, c.tk, c.d}, opts),
          at::randn({c.batch, c.kv_heads, c.tk, c.dv}, opts)};
}

TEST(BlockwiseAttention, MatchesNaiveInFp64AcrossOffsetsShapesAndBlockSizes) {
  uint64_t seed = 1;
  for (const Case& c : cases()) {
    const Inputs in = random_inputs(c, seed++);
    const double scale = 1.0 / std::sqrt(double(c.d));
    const at::Tensor ref = naive_attention(in.q, in.k, in.v, scale, c.causal_offset);
    const at::Tensor out =
        blockwise_attention(in.q, in.k, in.v, scale, c.causal_offset, c.block);
    ASSERT_EQ(out.sizes(), ref.sizes()) << c.label;
    ASSERT_EQ(out.scalar_type(), at::kDouble) << c.label;
    const double diff = max_abs_diff(out, ref);
    report(c.label, diff);
    EXPECT_LT(diff, 1e-12) << c.label;
  }
}

TEST(BlockwiseAttention, RowsThatSeeNoKeyAreZero) {
  const Case c{"blind rows", 1, 1, 1, 6, 6, 4, 3, -2, 4};
  const Inputs in = random_inputs(c, 7);
  const at::Tensor out = blockwise_attention(in.q, in.k, in.v, 0.5, c.causal_offset, c.block);
  EXPECT_EQ(out.narrow(2, 0, 2).abs().max().item<double>(), 0.0);
  EXPECT_GT(out.narrow(2, 2, 4).abs().max().item<double>(), 0.0);
}

TEST(BlockwiseAttention, RowTilesOnSeveralThreadsGiveTheSameBitsAndGradients) {
  // Every case, fp32 and fp64, forward and gradients, with 1, 2 and 3 attention threads (more
  // threads than row tiles included): bit for bit the single-threaded result.
  struct Restore {
    int threads = cpu_attention_threads();
    ~Restore() { set_cpu_attention_threads(threads); }
  } restore;
  uint64_t seed = 300;
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    for (const Case& c : cases()) {
      const Inputs in = random_inputs(c, seed++, dtype);
      const double scale = 1.0 / std::sqrt(double(c.d));
      auto run = [&](int threads) {
        set_cpu_attention_threads(threads);
        const at::Tensor q = in.q.clone().requires_grad_(true);
        const at::Tensor k = in.k.clone().requires_grad_(true);
        const at::Tensor v = in.v.clone().requires_grad_(true);
        const at::Tensor o = blockwise_attention(q, k, v, scale, c.causal_offset, c.block);
        std::vector<at::Tensor> all = {o.detach()};
        for (const at::Tensor& g : torch::autograd::grad({o.sum()}, {q, k, v})) all.push_back(g);
        return all;
      };
      const std::vector<at::Tensor> one = run(1);
      for (const int threads : {2, 3}) {
        const std::vector<at::Tensor> many = run(threads);
        EXPECT_EQ(cpu_attention_threads(), threads);
        for (size_t i = 0; i < one.size(); ++i) {
          EXPECT_TRUE(at::equal(one[i], many[i])) << c.label << " threads " << threads << " output " << i;
        }
      }
    }
  }
  set_cpu_attention_threads(0);
  EXPECT_EQ(cpu_attention_threads(), 1) << "counts below 1 mean 1";
}

TEST(BlockwiseAttention, AttentionThreadsFromTheEnvironmentAreCheckedAndNamed) {
  EXPECT_EQ(parse_cpu_attention_threads(nullptr), 1);
  EXPECT_EQ(parse_cpu_attention_threads(""), 1);
  EXPECT_EQ(parse_cpu_attention_threads("2"), 2);
  for (const char* bad : {"two", "0", "-1", "2x", "1.5", "100000"}) {
    try {
      parse_cpu_attention_threads(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const c10::Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("ODYSSEY_ATTENTION_THREADS='" + std::string(bad) + "'"), std::string::npos) << message;
    }
  }
}

TEST(BlockwiseAttention, GradientsMatchNaive) {
  uint64_t seed = 100;
  for (const Case& c : cases()) {
    const Inputs in = random_inputs(c, seed++);
    const double scale = 1.0 / std::sqrt(double(c.d));
    const at::Tensor weight = at::randn({c.batch, c.q_heads, c.tq, c.dv}, at::kDouble);
    auto grads = [&](bool blockwise) {
      const at::Tensor q = in.q.clone().requires_grad_(true);
      const at::Tensor k = in.k.clone().requires_grad_(true);
      const at::Tensor v = in.v.clone().requires_grad_(true);
      const at::Tensor o = blockwise
                               ? blockwise_attention(q, k, v, scale, c.causal_offset, c.block)
                               : naive_attention(q, k, v, scale, c.causal_offset);
      return torch::autograd::grad({(o * weight).sum()}, {q, k, v});
    };
    const auto ref = grads(false);
    const auto out = grads(true);
    const char* names[] = {"dq", "dk", "dv"};
    for (int i = 0; i < 3; ++i) {
      ASSERT_EQ(out[i].sizes(), ref[i].sizes()) << c.label << " " << names[i];
      const double diff = max_abs_diff(out[i], ref[i]);
      report(std::string(names[i]) + " " + c.label, diff);
      EXPECT_LT(diff, 1e-11) << c.label << " " << names[i];
    }
  }
}

TEST(BlockwiseAttention, ComputesInFp32AndReturnsTheRequestedDtype) {
  const Case c{"bf16", 1, 2, 1, 19, 19, 16, 8, 0, 8};
  const Inputs in = random_inputs(c, 3, at::kBFloat16);
  const at::Tensor ref = naive_attention(in.q.to(at::kFloat), in.k.to(at::kFloat),
                                         in.v.to(at::kFloat), 0.25, 0);
  const at::Tensor as_input = blockwise_attention(in.q, in.k, in.v, 0.25, 0, c.block);
  const at::Tensor kept = blockwise_attention(in.q, in.k, in.v, 0.25, 0, c.block,
                                              /*keep_compute_dtype=*/true);
  EXPECT_EQ(as_input.scalar_type(), at::kBFloat16);
  EXPECT_EQ(kept.scalar_type(), at::kFloat);
  const double diff = max_abs_diff(kept, ref);
  report("bf16 inputs, fp32 output vs fp32 naive", diff);
  EXPECT_LT(diff, 1e-5);
  EXPECT_LT(max_abs_diff(as_input, ref), 2e-2);
}

long peak_rss_kib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;
}

// A T×T fp32 score matrix at T = 8192 is 256 MiB; forward and backward together must raise the
// process's peak resident memory by far less than that.
TEST(BlockwiseAttention, LongSequenceNeverMaterializesTheScoreMatrix) {
  const int64_t T = 8192, d = 8;
  torch::manual_seed(11);
  const at::Tensor q = at::randn({1, 1, T, d}).requires_grad_(true);
  const at::Tensor k = at::randn({1, 1, T, d}).requires_grad_(true);
  const at::Tensor v = at::randn({1, 1, T, d}).requires_grad_(true);
  const long before = peak_rss_kib();
  const at::Tensor o = blockwise_attention(q, k, v, 1.0 / std::sqrt(double(d)), 0, 256);
  o.sum().backward();
  const long grown_mib = (peak_rss_kib() - before) / 1024;
  std::printf("  peak resident memory grew by %ld MiB (T×T fp32 would be 256 MiB)\n", grown_mib);
  EXPECT_LT(grown_mib, 64);
  ASSERT_TRUE(k.grad().defined());

  // The last rows against the reference, which only needs a 16×T matrix for them.
  const at::Tensor tail = naive_attention(q.detach().narrow(2, T - 16, 16), k.detach(),
                                          v.detach(), 1.0 / std::sqrt(double(d)), T - 16);
  const double diff = max_abs_diff(o.detach().narrow(2, T - 16, 16), tail);
  report("T=8192 fp32, last 16 rows vs naive", diff);
  EXPECT_LT(diff, 1e-5);
}

// On the GPU build, bf16 self-attention, decode rows and chunks continuing a cache go through
// LibTorch's fused kernels; they must agree with our blockwise path (forward and gradients) to bf16
// accuracy, with the MLA shapes' unequal key and value widths (96 and 64 in the small config).
TEST(BlockwiseAttention, FusedKernelOnTheGpuAgreesWithTheBlockwisePath) {
  const at::Tensor cpu_q = at::randn({1, 2, 8, 16}, at::kBFloat16);
  EXPECT_FALSE(fused_attention_applies(cpu_q, cpu_q, cpu_q, 0)) << "CPU tensors never take the fused path";
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device: the fused path exists only on the GPU build";
  at::manual_seed(3);
  const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const int64_t B = 2, H = 4, T = 777, D = 96, Dv = 64;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  struct Case {
    int64_t tq, offset;
    const char* what;
  };
  const Case cases[] = {
      {T, 0, "self-attention"},
      {1, T - 1, "one decode row"},
      {300, T - 300, "a chunk continuing a cache (bottom-right causal)"},
      {1, T - 1 - 40, "one row that sees all but the last 40 keys"},
      {200, 100, "a chunk seeing a prefix of the keys"},
      {200, 0, "plain causal over the first 200 keys"},
  };
  for (const Case& c : cases) {
    const at::Tensor q = at::randn({B, H, c.tq, D}, opts).requires_grad_(true);
    const at::Tensor k = at::randn({B, H, T, D}, opts).requires_grad_(true);
    const at::Tensor v = at::randn({B, H, T, Dv}, opts).requires_grad_(true);
    ASSERT_TRUE(fused_attention_applies(q, k, v, c.offset)) << c.what;
    const at::Tensor fused = blockwise_attention(q, k, v, scale, c.offset, kAttentionBlock, /*keep_compute_dtype=*/true);
    const at::Tensor plain = blockwise_attention(q, k, v, scale, c.offset, kAttentionBlock, /*keep_compute_dtype=*/true,
                                                 /*allow_fused=*/false);
    ASSERT_EQ(fused.scalar_type(), at::kFloat);
    ASSERT_EQ(fused.sizes(), plain.sizes());
    const double fwd = max_abs_diff(fused, plain);
    const at::Tensor dout = at::randn_like(plain);
    const auto g_fused = torch::autograd::grad({fused}, {q, k, v}, {dout});
    const auto g_plain = torch::autograd::grad({plain}, {q, k, v}, {dout});
    double bwd = 0;
    for (size_t i = 0; i < 3; ++i) bwd = std::max(bwd, max_abs_diff(g_fused[i], g_plain[i]) /
                                                            (g_plain[i].abs().max().item<double>() + 1e-6));
    std::printf("fused vs blockwise, %s (Tq=%ld Tk=%ld offset %ld): max |fwd diff| %.3e, max relative grad diff %.3e\n",
                c.what, static_cast<long>(c.tq), static_cast<long>(T), static_cast<long>(c.offset), fwd, bwd);
    EXPECT_LT(fwd, 2e-2) << c.what;
    EXPECT_LT(bwd, 3e-2) << c.what;
  }
  // What the fused kernels' masks cannot express stays blockwise: rows that see no key, and rows
  // whose visible keys run past the last key for some rows but not others.
  const at::Tensor q = at::randn({B, H, T, D}, opts), k = at::randn({B, H, T, D}, opts);
  const at::Tensor v = at::randn({B, H, T, Dv}, opts);
  EXPECT_FALSE(fused_attention_applies(q, k, v, -1)) << "rows that see no key";
  EXPECT_FALSE(fused_attention_applies(q, k, v, 5)) << "offset + Tq past the last key";
}

// fp32 on the GPU (model/precision.h): at medium the fused kernels on bf16 copies, the bf16 call's
// output bit for bit and its gradients (cast to fp32) to within a bf16 step; at high and highest the
// memory-efficient kernel on the fp32 operands (3xTF32 products: within ~1e-6 of the fp32 blockwise
// path). Both for self-attention and for a chunk continuing a cache. LibTorch's fused backwards may
// add dq's parts in an order that differs between calls, so gradients are compared with a bound.
// A shape the kernels' masks do not express stays blockwise (at medium exactly what high gives:
// both let cuBLAS use TF32).
TEST(BlockwiseAttention, Fp32AtMediumPrecisionTakesTheFusedKernelOnBf16Copies) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device: the fused path exists only on the GPU build";
  at::manual_seed(5);
  const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  const int64_t B = 1, H = 3, T = 300, D = 96, Dv = 64;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const at::Tensor q0 = at::randn({B, H, T, D}, opts), k0 = at::randn({B, H, T, D}, opts);
  const at::Tensor v0 = at::randn({B, H, T, Dv}, opts), dout0 = at::randn({B, H, T, Dv}, opts);
  // The last tq query rows against all T keys, row i at position offset + i.
  auto run = [&](at::ScalarType dtype, Float32MatmulPrecision precision, int64_t tq, int64_t offset,
                 bool allow_fused = true) {
    const Float32MatmulPrecisionScope scope(precision);
    const at::Tensor q = q0.narrow(2, T - tq, tq).to(dtype).requires_grad_(true);
    const at::Tensor k = k0.to(dtype).requires_grad_(true), v = v0.to(dtype).requires_grad_(true);
    const at::Tensor o = blockwise_attention(q, k, v, scale, offset, kAttentionBlock, /*keep_compute_dtype=*/true,
                                             allow_fused);
    EXPECT_EQ(o.scalar_type(), at::kFloat);
    const auto g = torch::autograd::grad({o}, {q, k, v}, {dout0.narrow(2, T - tq, tq)});
    return std::vector<at::Tensor>{o.detach(), g[0].to(at::kFloat), g[1].to(at::kFloat), g[2].to(at::kFloat)};
  };
  const char* names[] = {"o", "dq", "dk", "dv"};
  for (const int64_t tq : {T, int64_t{120}}) {
    const int64_t offset = T - tq;
    const char* what = tq == T ? "self-attention" : "a chunk continuing a cache";
    const auto exact = run(at::kFloat, Float32MatmulPrecision::kHighest, tq, offset, /*allow_fused=*/false);
    const auto medium = run(at::kFloat, Float32MatmulPrecision::kMedium, tq, offset);
    const auto bf16 = run(at::kBFloat16, Float32MatmulPrecision::kHighest, tq, offset);
    const auto high = run(at::kFloat, Float32MatmulPrecision::kHigh, tq, offset);
    const auto highest = run(at::kFloat, Float32MatmulPrecision::kHighest, tq, offset);
    for (size_t i = 0; i < medium.size(); ++i) {
      const double largest = exact[i].abs().max().item<double>() + 1e-6;
      auto relative = [&](const std::vector<at::Tensor>& r) { return max_abs_diff(r[i], exact[i]) / largest; };
      const double medium_vs_bf16 = max_abs_diff(medium[i], bf16[i]) / largest;
      if (i == 0) {
        EXPECT_TRUE(at::equal(medium[i], bf16[i])) << what << ": o max diff " << max_abs_diff(medium[i], bf16[i]);
        EXPECT_TRUE(at::equal(high[i], highest[i])) << what << ": high and highest run the same kernel";
      }
      std::printf("fp32 attention, %s, against the fp32 blockwise path: %s %.3e of the largest at medium "
                  "(%.1e from the bf16 call), %.3e at high, %.3e at highest\n",
                  what, names[i], relative(medium), medium_vs_bf16, relative(high), relative(highest));
      EXPECT_LE(medium_vs_bf16, 4e-3) << what << ": " << names[i] << ": medium is the bf16 call";
      EXPECT_LT(relative(medium), 3e-2) << what << ": " << names[i];
      EXPECT_GT(relative(medium), 0.0) << what << ": " << names[i] << ": medium should round to bf16; nothing changed";
      EXPECT_LT(relative(high), 1e-5) << what << ": " << names[i];
      EXPECT_LT(relative(highest), 1e-5) << what << ": " << names[i];
    }
    EXPECT_GT(max_abs_diff(highest[0], exact[0]), 0.0) << what << ": highest should take the fused kernel";
  }
  const auto medium_cont = run(at::kFloat, Float32MatmulPrecision::kMedium, T, 5);
  const auto high_cont = run(at::kFloat, Float32MatmulPrecision::kHigh, T, 5);
  for (size_t i = 0; i < medium_cont.size(); ++i) EXPECT_TRUE(at::equal(medium_cont[i], high_cont[i])) << names[i];
}

// On CUDA tensors the blockwise path takes GPU-sized tiles; a chunk continuing a long cache (the
// learner's case) must still match the naive form, forward and gradients.
TEST(BlockwiseAttention, GpuTilesOfAChunkContinuingACacheMatchNaive) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(5);
  const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  const int64_t B = 1, H = 2, Tk = 9000, Tq = 5000, D = 48, Dv = 32, offset = Tk - Tq;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const at::Tensor q = at::randn({B, H, Tq, D}, opts).requires_grad_(true);
  const at::Tensor k = at::randn({B, H, Tk, D}, opts).requires_grad_(true);
  const at::Tensor v = at::randn({B, H, Tk, Dv}, opts).requires_grad_(true);
  // fp32 CUDA operands would take the memory-efficient kernel (model/precision.h): this test is about
  // the blockwise path's GPU tiles.
  const at::Tensor tiled = blockwise_attention(q, k, v, scale, offset, kAttentionBlock, /*keep_compute_dtype=*/true,
                                               /*allow_fused=*/false);
  const at::Tensor naive = naive_attention(q, k, v, scale, offset, /*keep_compute_dtype=*/true);
  const double fwd = max_abs_diff(tiled, naive);
  const at::Tensor dout = at::randn_like(naive);
  const auto g_tiled = torch::autograd::grad({tiled}, {q, k, v}, {dout});
  const auto g_naive = torch::autograd::grad({naive}, {q, k, v}, {dout});
  double bwd = 0;
  for (size_t i = 0; i < 3; ++i) bwd = std::max(bwd, max_abs_diff(g_tiled[i], g_naive[i]));
  std::printf("GPU tiles, Tq=%ld Tk=%ld offset %ld: max |fwd diff| %.3e, max |grad diff| %.3e\n",
              static_cast<long>(Tq), static_cast<long>(Tk), static_cast<long>(offset), fwd, bwd);
  EXPECT_LT(fwd, 1e-4);
  EXPECT_LT(bwd, 1e-3);
}

}  // namespace
}  // namespace odyssey::model
