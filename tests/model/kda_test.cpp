#include "model/kda.h"

#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/utils.h>

#include "model/precision.h"

namespace odyssey::model {
namespace {

struct Inputs {
  at::Tensor q, k, v, g, beta, state;
};

at::Tensor l2_normalize(const at::Tensor& x) {
  return x / x.pow(2).sum(-1, /*keepdim=*/true).sqrt();
}

// q, k L2-normalised (as the layer makes them), g uniform in [g_low, g_high], beta in (0, 1).
Inputs random_inputs(int64_t batch, int64_t length, int64_t heads, int64_t k_dim, int64_t v_dim,
                     double g_low, double g_high, uint64_t seed,
                     at::ScalarType dtype = at::kDouble) {
  torch::manual_seed(seed);
  const auto opts = at::TensorOptions().dtype(dtype);
  Inputs in;
  in.q = l2_normalize(at::randn({batch, length, heads, k_dim}, opts));
  in.k = l2_normalize(at::randn({batch, length, heads, k_dim}, opts));
  in.v = at::randn({batch, length, heads, v_dim}, opts);
  in.g = g_low + (g_high - g_low) * at::rand({batch, length, heads, k_dim}, opts);
  in.beta = at::rand({batch, length, heads}, opts);
  in.state = 0.5 * at::randn({batch, heads, k_dim, v_dim}, opts);
  return in;
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0) return 0.0;
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

void report(const std::string& what, double value) {
  std::printf("  max |diff| %-48s %.3e\n", what.c_str(), value);
}

double scale_for(const at::Tensor& q) { return 1.0 / std::sqrt(static_cast<double>(q.size(-1))); }

// Checks chunked against recurrent on the same inputs, o and final state.
void expect_chunked_equals_recurrent(const Inputs& in, int64_t chunk, double tolerance,
                                     const std::string& label) {
  const double scale = scale_for(in.q);
  const auto ref = kda::recurrent(in.q, in.k, in.v, in.g, in.beta, in.state, scale);
  const auto out = kda::chunked(in.q, in.k, in.v, in.g, in.beta, in.state, scale, chunk);
  ASSERT_EQ(out.o.sizes(), ref.o.sizes());
  ASSERT_EQ(out.final_state.sizes(), ref.final_state.sizes());
  const double o_diff = max_abs_diff(out.o, ref.o);
  const double s_diff = max_abs_diff(out.final_state, ref.final_state);
  report(label + " o", o_diff);
  report(label + " final state", s_diff);
  EXPECT_LT(o_diff, tolerance) << label;
  EXPECT_LT(s_diff, tolerance) << label;
}

TEST(Kda, KeepChunkStatesGuardNestsRestoresAndStaysOnItsThread) {
  EXPECT_FALSE(kda::keep_chunk_states());
  {
    const kda::KeepChunkStatesGuard keep;
    EXPECT_TRUE(kda::keep_chunk_states());
    {
      const kda::KeepChunkStatesGuard off(false);
      EXPECT_FALSE(kda::keep_chunk_states());
    }
    EXPECT_TRUE(kda::keep_chunk_states());
    bool other = true;
    std::thread([&] { other = kda::keep_chunk_states(); }).join();
    EXPECT_FALSE(other) << "the setting leaked to another thread";
  }
  EXPECT_FALSE(kda::keep_chunk_states());
}

TEST(Kda, Float32MatmulPrecisionParsesScopesAndSwitchesCublasTf32) {
  ASSERT_EQ(float32_matmul_precision(), Float32MatmulPrecision::kHighest);
  for (const char* name : {"highest", "high", "medium"}) {
    const Result<Float32MatmulPrecision> p = parse_float32_matmul_precision(name);
    ASSERT_TRUE(p.ok()) << name;
    EXPECT_STREQ(float32_matmul_precision_name(*p), name);
  }
  const Result<Float32MatmulPrecision> bad = parse_float32_matmul_precision("fast");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'fast'"), std::string::npos) << bad.status().message();
  EXPECT_NE(bad.status().message().find("highest, high, medium"), std::string::npos) << bad.status().message();
  EXPECT_FALSE(at::globalContext().allowTF32CuBLAS());
  {
    const Float32MatmulPrecisionScope medium(Float32MatmulPrecision::kMedium);
    EXPECT_EQ(float32_matmul_precision(), Float32MatmulPrecision::kMedium);
    EXPECT_TRUE(at::globalContext().allowTF32CuBLAS()) << "medium includes high: TF32 for cuBLAS";
    Float32MatmulPrecision seen = Float32MatmulPrecision::kHighest;
    std::thread([&] { seen = float32_matmul_precision(); }).join();
    EXPECT_EQ(seen, Float32MatmulPrecision::kMedium) << "process-wide: autograd's threads must see it";
    {
      const Float32MatmulPrecisionScope highest(Float32MatmulPrecision::kHighest);
      EXPECT_FALSE(at::globalContext().allowTF32CuBLAS());
    }
    EXPECT_TRUE(at::globalContext().allowTF32CuBLAS());
  }
  EXPECT_EQ(float32_matmul_precision(), Float32MatmulPrecision::kHighest);
  EXPECT_FALSE(at::globalContext().allowTF32CuBLAS());
}

TEST(Kda, ChunkedOnTheCpuIsTheSameAtEveryFloat32MatmulPrecision) {
  // The precision trades only on CUDA: the CPU's (reference) path gives the same bits at medium.
  const Inputs in = random_inputs(1, 40, 2, 16, 16, -5.0, 0.0, 11, at::kFloat);
  const kda::Output highest = kda::chunked(in.q, in.k, in.v, in.g, in.beta, in.state, 0.25);
  const Float32MatmulPrecisionScope medium(Float32MatmulPrecision::kMedium);
  const kda::Output at_medium = kda::chunked(in.q, in.k, in.v, in.g, in.beta, in.state, 0.25);
  EXPECT_EQ(at_medium.o.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(highest.o, at_medium.o));
  EXPECT_TRUE(at::equal(highest.final_state, at_medium.final_state));
}

TEST(Kda, ChunkedEqualsRecurrentInFp64OnRandomInputs) {
  const Inputs in = random_inputs(2, 64, 2, 16, 8, /*g_low=*/-5.0, /*g_high=*/0.0, /*seed=*/1);
  expect_chunked_equals_recurrent(in, /*chunk=*/16, 1e-10, "random T=64 C=16");
  expect_chunked_equals_recurrent(in, /*chunk=*/8, 1e-10, "random T=64 C=8");
  expect_chunked_equals_recurrent(in, /*chunk=*/5, 1e-10, "random T=64 C=5");
}

TEST(Kda, ChunkedEqualsRecurrentWithSaturatedGates) {
  Inputs in = random_inputs(2, 64, 2, 16, 8, -5.0, 0.0, /*seed=*/2);
  in.g = at::full_like(in.g, -5.0);
  expect_chunked_equals_recurrent(in, /*chunk=*/16, 1e-10, "g=-5 T=64 C=16");
}

TEST(Kda, ChunkedEqualsRecurrentWithoutDecay) {
  Inputs in = random_inputs(2, 64, 2, 16, 8, -5.0, 0.0, /*seed=*/3);
  in.g = at::zeros_like(in.g);
  expect_chunked_equals_recurrent(in, /*chunk=*/16, 1e-10, "g=0 T=64 C=16");
}

TEST(Kda, ChunkedEqualsRecurrentWithPartlyFilledLastChunk) {
  for (int64_t length : {50, 17, 1}) {
    const Inputs in = random_inputs(2, length, 2, 16, 8, -5.0, 0.0, /*seed=*/10 + length);
    expect_chunked_equals_recurrent(in, /*chunk=*/16, 1e-10, "T=" + std::to_string(length));
  }
  // Saturated gates make a wrongly anchored exponent overflow: the padding must stay inert.
  Inputs in = random_inputs(1, 37, 2, 16, 8, -5.0, 0.0, /*seed=*/4);
  in.g = at::full_like(in.g, -5.0);
  expect_chunked_equals_recurrent(in, /*chunk=*/16, 1e-10, "g=-5 T=37");
}

TEST(Kda, ChunkedWithoutInitialStateStartsFromZeros) {
  const Inputs in = random_inputs(1, 20, 2, 16, 8, -5.0, 0.0, /*seed=*/5);
  const double scale = scale_for(in.q);
  const auto implicit = kda::chunked(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), scale);
  const auto explicit_zero =
      kda::recurrent(in.q, in.k, in.v, in.g, in.beta, at::zeros_like(in.state), scale);
  const double diff = max_abs_diff(implicit.o, explicit_zero.o);
  report("no initial state vs zeros o", diff);
  EXPECT_LT(diff, 1e-10);
}

TEST(Kda, ChunkedOutputsBeforePositionIgnoreLaterInputs) {
  const int64_t length = 37;
  const Inputs in = random_inputs(2, length, 2, 16, 8, -5.0, 0.0, /*seed=*/6);
  const Inputs other = random_inputs(2, length, 2, 16, 8, -5.0, 0.0, /*seed=*/7);
  const double scale = scale_for(in.q);
  const auto base = kda::chunked(in.q, in.k, in.v, in.g, in.beta, in.state, scale);
  // P on a chunk boundary, inside a full chunk, inside the partly filled last chunk.
  for (int64_t prefix : {16, 21, 35, 1}) {
    auto splice = [&](const at::Tensor& a, const at::Tensor& b) {
      return at::cat({a.slice(1, 0, prefix), b.slice(1, prefix)}, 1);
    };
    // Later tokens replaced, with saturated gates so any leak through an exponent would show.
    const auto changed = kda::chunked(splice(in.q, other.q), splice(in.k, other.k),
                                      splice(in.v, other.v),
                                      splice(in.g, at::full_like(other.g, -5.0)),
                                      splice(in.beta, other.beta), in.state, scale);
    const double diff =
        max_abs_diff(changed.o.slice(1, 0, prefix), base.o.slice(1, 0, prefix));
    report("prefix P=" + std::to_string(prefix) + " outputs before P", diff);
    EXPECT_LT(diff, 1e-14) << "P=" << prefix;
    EXPECT_GT(max_abs_diff(changed.o.slice(1, prefix), base.o.slice(1, prefix)), 1e-3)
        << "the later outputs should change (P=" << prefix << ")";
  }
}

TEST(Kda, ChunkedCarriesStateAcrossCalls) {
  const Inputs in = random_inputs(2, 50, 2, 16, 8, -5.0, 0.0, /*seed=*/8);
  const double scale = scale_for(in.q);
  const auto whole = kda::chunked(in.q, in.k, in.v, in.g, in.beta, in.state, scale);
  at::Tensor state = in.state;
  std::vector<at::Tensor> outputs;
  int64_t start = 0;
  for (int64_t size : {23, 16, 1, 10}) {
    auto part = [&](const at::Tensor& t) { return t.slice(1, start, start + size); };
    const auto out =
        kda::chunked(part(in.q), part(in.k), part(in.v), part(in.g), part(in.beta), state, scale);
    outputs.push_back(out.o);
    state = out.final_state;
    start += size;
  }
  const double o_diff = max_abs_diff(at::cat(outputs, 1), whole.o);
  const double s_diff = max_abs_diff(state, whole.final_state);
  report("split calls vs whole o", o_diff);
  report("split calls vs whole final state", s_diff);
  EXPECT_LT(o_diff, 1e-10);
  EXPECT_LT(s_diff, 1e-10);
}

TEST(Kda, StepEqualsRecurrentAndUpdatesStateInPlace) {
  const Inputs in = random_inputs(2, 20, 2, 16, 8, -5.0, 0.0, /*seed=*/9);
  const double scale = scale_for(in.q);
  const auto ref = kda::recurrent(in.q, in.k, in.v, in.g, in.beta, in.state, scale);
  at::Tensor state = in.state.clone();
  const void* storage = state.data_ptr();
  std::vector<at::Tensor> outputs;
  for (int64_t t = 0; t < in.q.size(1); ++t) {
    outputs.push_back(kda::step(in.q.select(1, t), in.k.select(1, t), in.v.select(1, t),
                                in.g.select(1, t), in.beta.select(1, t), state, scale));
  }
  EXPECT_EQ(state.data_ptr(), storage);
  const double o_diff = max_abs_diff(at::stack(outputs, 1), ref.o);
  const double s_diff = max_abs_diff(state, ref.final_state);
  report("step vs recurrent o", o_diff);
  report("step vs recurrent final state", s_diff);
  EXPECT_LT(o_diff, 1e-12);
  EXPECT_LT(s_diff, 1e-12);
}

TEST(Kda, ChunkedInFp32StaysCloseToFp64WithSaturatedGates) {
  // The full exponent budget (g = -5 over 16 tokens) in the first two chunks and in the partly
  // filled last one (T = 61).
  Inputs in = random_inputs(2, 61, 2, 16, 8, -5.0, 0.0, /*seed=*/11);
  in.g.slice(1, 0, 32).fill_(-5.0);
  in.g.slice(1, 48).fill_(-5.0);
  const double scale = scale_for(in.q);
  const auto ref = kda::recurrent(in.q, in.k, in.v, in.g, in.beta, in.state, scale);
  const auto out = kda::chunked(in.q.to(at::kFloat), in.k.to(at::kFloat), in.v.to(at::kFloat),
                                in.g.to(at::kFloat), in.beta.to(at::kFloat),
                                in.state.to(at::kFloat), scale);
  EXPECT_EQ(out.o.scalar_type(), at::kFloat);
  EXPECT_EQ(out.final_state.scalar_type(), at::kFloat);
  const double o_diff = max_abs_diff(out.o, ref.o);
  const double s_diff = max_abs_diff(out.final_state, ref.final_state);
  report("fp32 chunked vs fp64 recurrent o", o_diff);
  report("fp32 chunked vs fp64 recurrent final state", s_diff);
  EXPECT_LT(o_diff, 1e-4);
  EXPECT_LT(s_diff, 1e-4);
}

TEST(Kda, ChunkedGradientsEqualRecurrentGradientsInFp64) {
  // T = 21 with C = 8 and C = 16: full chunks, a partly filled one, and the state hand-off.
  for (int64_t chunk : {8, 16}) {
    Inputs in = random_inputs(2, 21, 2, 8, 4, -5.0, 0.0, /*seed=*/12);
    std::vector<at::Tensor> leaves = {in.q, in.k, in.v, in.g, in.beta, in.state};
    for (auto& t : leaves) t.requires_grad_(true);
    torch::manual_seed(13);
    const at::Tensor o_weight = at::randn({2, 21, 2, 4}, at::kDouble);
    const at::Tensor s_weight = at::randn({2, 2, 8, 4}, at::kDouble);
    const double scale = scale_for(in.q);
    auto loss_of = [&](const kda::Output& out) {
      return (out.o * o_weight).sum() + (out.final_state * s_weight).sum();
    };
    const auto ref_grads = torch::autograd::grad(
        {loss_of(kda::recurrent(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], leaves[5],
                                scale))},
        leaves);
    const auto grads = torch::autograd::grad(
        {loss_of(kda::chunked(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], leaves[5],
                              scale, chunk))},
        leaves);
    const char* names[] = {"q", "k", "v", "g", "beta", "initial_state"};
    for (size_t i = 0; i < leaves.size(); ++i) {
      const double diff = max_abs_diff(grads[i], ref_grads[i]);
      report("C=" + std::to_string(chunk) + " d loss / d " + names[i], diff);
      EXPECT_LT(diff, 1e-9) << names[i] << " C=" << chunk;
      EXPECT_GT(ref_grads[i].abs().max().item<double>(), 1e-3) << names[i];
    }
  }
}

TEST(Kda, ChunkedWithSubChunkAnchorsEqualsRecurrentOverLongChunks) {
  // Chunks of 32 / 48 / 64 tokens with an exponent anchor every 8 / 16 tokens (kda.h,
  // chunked_reference's `anchor`): full chunks, a partly filled last one (T = 150), random and
  // saturated gates, in fp64 against the recurrence.
  Inputs in = random_inputs(2, 150, 2, 16, 8, -5.0, 0.0, /*seed=*/21);
  const double scale = scale_for(in.q);
  const auto ref = kda::recurrent(in.q, in.k, in.v, in.g, in.beta, in.state, scale);
  for (const auto& [chunk, anchor] : std::vector<std::pair<int64_t, int64_t>>{{64, 16}, {48, 16}, {32, 8}, {16, 16}}) {
    const auto out = kda::chunked_reference(in.q, in.k, in.v, in.g, in.beta, in.state, scale, chunk, anchor);
    const std::string label = "C=" + std::to_string(chunk) + " anchor " + std::to_string(anchor);
    report(label + " o", max_abs_diff(out.o, ref.o));
    report(label + " final state", max_abs_diff(out.final_state, ref.final_state));
    EXPECT_LT(max_abs_diff(out.o, ref.o), 1e-10) << label;
    EXPECT_LT(max_abs_diff(out.final_state, ref.final_state), 1e-10) << label;
  }
  // Saturated gates in fp32: one anchor for 64 tokens needs e^{320} (past fp32's e^{88}); an anchor
  // every 16 tokens keeps the chunk-16 budget and stays within fp32 rounding of the fp64 recurrence.
  in.g = at::full_like(in.g, -5.0);
  const auto saturated = kda::recurrent(in.q, in.k, in.v, in.g, in.beta, in.state, scale);
  auto fp32 = [](const at::Tensor& t) { return t.to(at::kFloat); };
  const auto anchored = kda::chunked_reference(fp32(in.q), fp32(in.k), fp32(in.v), fp32(in.g), fp32(in.beta),
                                               fp32(in.state), scale, 64, 16);
  report("fp32 g=-5 C=64 anchor 16 o", max_abs_diff(anchored.o, saturated.o));
  EXPECT_LT(max_abs_diff(anchored.o, saturated.o), 1e-4);
  EXPECT_LT(max_abs_diff(anchored.final_state, saturated.final_state), 1e-4);
  const auto one_anchor = kda::chunked_reference(fp32(in.q), fp32(in.k), fp32(in.v), fp32(in.g), fp32(in.beta),
                                                 fp32(in.state), scale, 64, 64);
  EXPECT_FALSE(at::isfinite(one_anchor.o).all().item<bool>())
      << "one anchor a chunk of 64 at g = -5 should leave fp32's range (the reason for sub-chunk anchors)";
}

TEST(Kda, ChunkedWithSubChunkAnchorsGradientsEqualRecurrentGradientsInFp64) {
  // T = 83: one full chunk of 64 (four anchors), a partly filled one, and the hand-off between them.
  Inputs in = random_inputs(2, 83, 2, 8, 4, -5.0, 0.0, /*seed=*/22);
  std::vector<at::Tensor> leaves = {in.q, in.k, in.v, in.g, in.beta, in.state};
  for (auto& t : leaves) t.requires_grad_(true);
  torch::manual_seed(23);
  const at::Tensor o_weight = at::randn({2, 83, 2, 4}, at::kDouble);
  const at::Tensor s_weight = at::randn({2, 2, 8, 4}, at::kDouble);
  const double scale = scale_for(in.q);
  auto loss_of = [&](const kda::Output& out) { return (out.o * o_weight).sum() + (out.final_state * s_weight).sum(); };
  const auto ref_grads = torch::autograd::grad(
      {loss_of(kda::recurrent(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], leaves[5], scale))}, leaves);
  const auto grads = torch::autograd::grad(
      {loss_of(kda::chunked_reference(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], leaves[5], scale, 64, 16))},
      leaves);
  const char* names[] = {"q", "k", "v", "g", "beta", "initial_state"};
  for (size_t i = 0; i < leaves.size(); ++i) {
    const double diff = max_abs_diff(grads[i], ref_grads[i]);
    report(std::string("C=64 anchor 16 d loss / d ") + names[i], diff);
    EXPECT_LT(diff, 1e-9) << names[i];
  }
}

// The gradients of <o, d_o> + <final state, d_final_state> by autograd of chunked_reference.
std::vector<at::Tensor> autograd_gradients(const Inputs& in, const at::Tensor& d_o, const at::Tensor& d_final,
                                           int64_t chunk, int64_t anchor) {
  std::vector<at::Tensor> leaves = {in.q, in.k, in.v, in.g, in.beta, in.state};
  for (auto& t : leaves) t = t.detach().requires_grad_(true);
  const auto out = kda::chunked_reference(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], leaves[5],
                                          scale_for(in.q), chunk, anchor);
  return torch::autograd::grad({(out.o * d_o).sum() + (out.final_state * d_final).sum()}, leaves);
}

std::vector<at::Tensor> as_list(const kda::Gradients& d) {
  return {d.dq, d.dk, d.dv, d.dg, d.dbeta, d.d_initial_state};
}

TEST(Kda, BlockedBackwardEqualsAutogradOfTheChunkedForm) {
  // kda::chunked_backward_reference (the three passes written out, the anchored products block by
  // block) against autograd of chunked_reference: chunks of 16 (one anchor), 64 and 32 with anchors
  // every 16 and 8, a partly filled last chunk (T = 83), random, saturated and absent decay.
  const char* names[] = {"dq", "dk", "dv", "dg", "dbeta", "d initial state"};
  for (const double g_fill : {1.0, -5.0, 0.0}) {  // 1: random in [-5, 0]
    Inputs in = random_inputs(2, 83, 2, 8, 4, -5.0, 0.0, /*seed=*/31);
    if (g_fill <= 0.0) in.g = at::full_like(in.g, g_fill);
    torch::manual_seed(32);
    const at::Tensor d_o = at::randn_like(in.v), d_final = at::randn_like(in.state);
    for (const auto& [chunk, anchor] : std::vector<std::pair<int64_t, int64_t>>{{16, 16}, {64, 16}, {32, 8}, {32, 16}}) {
      const auto expected = autograd_gradients(in, d_o, d_final, chunk, anchor);
      // The three ways to dL (kda.h, BackwardForm): M^T dM M^T; -dVb V'^T; the same with dVb from
      // the sub-chunks' walk (the kernels' form).
      for (const auto form : {kda::BackwardForm::kInverseChain, kda::BackwardForm::kInnovations,
                              kda::BackwardForm::kSubChunkInnovations, kda::BackwardForm::kKeptInnovationGradients}) {
        const auto got = as_list(kda::chunked_backward_reference(in.q, in.k, in.v, in.g, in.beta, in.state,
                                                                 scale_for(in.q), d_o, d_final, chunk, anchor, {}, form));
        for (size_t i = 0; i < got.size(); ++i) {
          const double diff = max_abs_diff(got[i], expected[i]);
          const std::string label = std::string(names[i]) + " C=" + std::to_string(chunk) + " anchor " +
                                    std::to_string(anchor) + " form " + std::to_string(static_cast<int>(form)) +
                                    (g_fill > 0 ? " random g" : " g=" + std::to_string(g_fill));
          if (i == 3) report(label, diff);
          EXPECT_LT(diff, 1e-10 * std::max(1.0, expected[i].abs().max().item<double>())) << label;
        }
      }
    }
  }
}

TEST(Kda, BlockedBackwardPrecisionOfBf16OperandsByProductClass) {
  // Which of the backward's products can take bf16 operands, at the kernels' widths (K = V = 128),
  // against exact fp64 gradients: today's kernel (chunks of 16: S, dS' and the state products in
  // bf16, the intra-chunk products fp32-grade) and chunks of 64 with anchors every 16, with bf16
  // operands added class by class. Random g, saturated g = -5 and g = 0; error = max |diff| over the
  // largest |gradient|, per gradient, the worst printed.
  const char* names[] = {"dq", "dk", "dv", "dg", "dbeta", "d initial state"};
  struct Case {
    const char* name;
    int64_t chunk, anchor;
    kda::BackwardRounding rounding;
    kda::BackwardForm form = kda::BackwardForm::kInverseChain;
  };
  kda::BackwardRounding kernel_today;
  kernel_today.states = kernel_today.state_products = true;
  kda::BackwardRounding off_diagonal = kernel_today;
  off_diagonal.off_diagonal_blocks = true;
  kda::BackwardRounding off_and_small = off_diagonal;
  off_and_small.small_products = true;
  kda::BackwardRounding everything = off_and_small;
  everything.diagonal_blocks = true;
  kda::BackwardRounding unrounded = everything;
  unrounded.dgamma_from_unrounded = true;
  kda::BackwardRounding inverse_blocks = everything;
  inverse_blocks.inverse_blocks = true;
  kda::BackwardRounding walk_values = everything;  // the kernels' default: V' from pass 1's walk
  walk_values.values_from_walk = true;
  const std::vector<Case> cases = {
      {"C=16, today's kernel (states, state products)", 16, 16, kernel_today},
      {"C=64 anchor 16, the same", 64, 16, kernel_today},
      {"C=64 anchor 16, + off-diagonal blocks", 64, 16, off_diagonal},
      {"C=64 anchor 16, + small products", 64, 16, off_and_small},
      {"C=64 anchor 16, + diagonal blocks (all bf16)", 64, 16, everything},
      {"C=16 all bf16 (today's chunk)", 16, 16, everything},
      {"C=64 anchor 16, all bf16, dGamma's factors unrounded", 64, 16, unrounded},
      {"C=64 anchor 16, all bf16, M's blocks from bf16 products", 64, 16, inverse_blocks},
      {"C=32 anchor 16, all bf16, dL = -dVb V'^T, dVb by 16s", 32, 16, everything,
       kda::BackwardForm::kSubChunkInnovations},
      {"C=64 anchor 16, all bf16, dL = -dVb V'^T, dVb by 16s", 64, 16, everything,
       kda::BackwardForm::kSubChunkInnovations},
      {"C=32 anchor 16, all bf16, dVb kept by the walk in bf16", 32, 16, everything,
       kda::BackwardForm::kKeptInnovationGradients},
      {"C=64 anchor 16, all bf16, dVb kept by the walk in bf16", 64, 16, everything,
       kda::BackwardForm::kKeptInnovationGradients},
      {"C=32 anchor 16, all bf16, V' and dVb kept by the walks", 32, 16, walk_values,
       kda::BackwardForm::kKeptInnovationGradients},
      {"C=64 anchor 16, all bf16, V' and dVb kept by the walks", 64, 16, walk_values,
       kda::BackwardForm::kKeptInnovationGradients},
  };
  std::map<std::string, double> worst;  // case -> worst relative error over g and gradients
  for (const double g_fill : {1.0, -5.0, 0.0}) {
    Inputs in = random_inputs(1, 192, 2, 128, 128, -5.0, 0.0, /*seed=*/33);
    if (g_fill <= 0.0) in.g = at::full_like(in.g, g_fill);
    torch::manual_seed(34);
    const at::Tensor d_o = at::randn_like(in.v), d_final = at::randn_like(in.state);
    const auto exact = as_list(kda::chunked_backward_reference(in.q, in.k, in.v, in.g, in.beta, in.state,
                                                               scale_for(in.q), d_o, d_final, 16, 16));
    for (const Case& c : cases) {
      const auto got = as_list(kda::chunked_backward_reference(in.q, in.k, in.v, in.g, in.beta, in.state,
                                                               scale_for(in.q), d_o, d_final, c.chunk, c.anchor,
                                                               c.rounding, c.form));
      double case_worst = 0;
      std::string which;
      for (size_t i = 0; i < got.size(); ++i) {
        const double relative = max_abs_diff(got[i], exact[i]) / exact[i].abs().max().item<double>();
        if (relative > case_worst) case_worst = relative, which = names[i];
      }
      std::printf("  %-56s %-9s worst %.2e (%s)\n", c.name, g_fill > 0 ? "random g" : g_fill < 0 ? "g = -5" : "g = 0",
                  case_worst, which.c_str());
      worst[c.name] = std::max(worst[c.name], case_worst);
    }
  }
  // Today's kernel numerics stay within its tests' tolerance (5e-2; the kernel measures 2-8e-3).
  EXPECT_LT(worst["C=16, today's kernel (states, state products)"], 5e-2);
  EXPECT_LT(worst["C=64 anchor 16, the same"], 5e-2);
  // The finding a blocked backward is built on (kernels/JOURNAL.md, "Fifteenth session"): every product's operands may
  // be bf16 - the anchored blocks (each factor of an off-diagonal block <= 1, a diagonal block's
  // within e^{16 |g|}) and the small products around M alike - provided dGamma's elementwise
  // factors are the bf16 operands themselves, so that the two terms of each pair (i, j) that the
  // reverse cumulative sum cancels are equal: measured 3.4-4.5e-3 against 2.8-3.4e-3 for today's
  // mix; with the unrounded factors dg's error grows to ~1.1e-2 at g = -5.
  EXPECT_LT(worst["C=64 anchor 16, + diagonal blocks (all bf16)"], 6e-3);
  EXPECT_LT(worst["C=16 all bf16 (today's chunk)"], 6e-3);
  // The collapsed chain the blocked kernel computes (dVb = M_aa^T dV'_a by sub-chunks with dV' stored
  // in bf16, dKb = -dVb S^T, dL = -dVb V'^T): no less precise than the chain it replaces.
  EXPECT_LT(worst["C=32 anchor 16, all bf16, dL = -dVb V'^T, dVb by 16s"], 6e-3);
  EXPECT_LT(worst["C=64 anchor 16, all bf16, dL = -dVb V'^T, dVb by 16s"], 6e-3);
  // ... and with dVb itself kept in bf16 by the reverse walk (dv = Diag(beta) dVb from it), pass 3
  // needs no M (the kernels since the thirtieth session): the precision it costs.
  EXPECT_LT(worst["C=32 anchor 16, all bf16, dVb kept by the walk in bf16"], 6e-3);
  EXPECT_LT(worst["C=64 anchor 16, all bf16, dVb kept by the walk in bf16"], 6e-3);
  // The kernels' default, V' kept by pass 1's walk too (made from its fp32 state, not from the
  // stored bf16 S): no less precise than V' recomputed.
  EXPECT_LT(worst["C=32 anchor 16, all bf16, V' and dVb kept by the walks"], 6e-3);
  // ... and the same by 64-token blocks (the fused pass 3 of branch b64, kda_block64_gradient.cuh; its
  // K^ and K_ enter only elementwise, in fp32, where this rounds them as operands).
  EXPECT_LT(worst["C=64 anchor 16, all bf16, V' and dVb kept by the walks"], 6e-3);
  // M of a 64-token block from its 16 x 16 diagonal inverses and bf16 block products: 4.9e-3.
  EXPECT_LT(worst["C=64 anchor 16, all bf16, M's blocks from bf16 products"], 6e-3);
  EXPECT_GT(worst["C=64 anchor 16, all bf16, dGamma's factors unrounded"],
            1.5 * worst["C=64 anchor 16, + diagonal blocks (all bf16)"]);
}

TEST(Kda, ValuesKeptByTheWalkAreAsPreciseAsRecomputedOnALongMildlyDecayingSequence) {
  // The kernels' default keeps V' from pass 1's walk (made from its fp32 state); without it pass 3
  // recomputes V' = U - W S from the stored bf16 S. With mild decay (g in [-0.3, 0]) the state grows
  // over a long sequence and U - W S cancels, so the recompute might lose the state's rounding into
  // V' (and through V' into dq and dk). Emulated with every other operand bf16 as the kernels feed
  // them (C = 32, anchors every 16, dVb kept by the walk), against fp64 (relative to each gradient's
  // largest magnitude): the two are equally precise (4.4e-3 worst, dq). So a larger gap between the
  // kernels' two paths is not from V' rounding (kernels/JOURNAL.md, "Thirtieth session").
  const char* names[] = {"dq", "dk", "dv", "dg", "dbeta", "d initial state"};
  Inputs in = random_inputs(1, 1024, 1, 128, 128, -0.3, 0.0, /*seed=*/41);
  torch::manual_seed(42);
  const at::Tensor d_o = at::randn_like(in.v), d_final = at::randn_like(in.state);
  const double scale = scale_for(in.q);
  const auto exact = as_list(kda::chunked_backward_reference(in.q, in.k, in.v, in.g, in.beta, in.state, scale,
                                                             d_o, d_final, 16, 16));
  kda::BackwardRounding rounded;
  rounded.states = rounded.state_products = rounded.diagonal_blocks = rounded.off_diagonal_blocks =
      rounded.small_products = true;
  kda::BackwardRounding walk = rounded;
  walk.values_from_walk = true;
  std::vector<at::Tensor> got[2];
  double worst[2] = {0, 0};
  for (int form = 0; form < 2; ++form) {
    got[form] = as_list(kda::chunked_backward_reference(in.q, in.k, in.v, in.g, in.beta, in.state, scale, d_o,
                                                        d_final, 32, 16, form == 0 ? rounded : walk,
                                                        kda::BackwardForm::kKeptInnovationGradients));
    for (size_t i = 0; i < got[form].size(); ++i) {
      const double relative = max_abs_diff(got[form][i], exact[i]) / exact[i].abs().max().item<double>();
      std::printf("  %-26s %-16s %.2e\n", form == 0 ? "V' recomputed (U - W S)" : "V' kept by the walk", names[i],
                  relative);
      worst[form] = std::max(worst[form], relative);
    }
  }
  EXPECT_GT(max_abs_diff(got[1][0], got[0][0]), 0.0);  // the option takes effect (dq through dAqk = dO V'^T)
  EXPECT_LT(worst[1], 6e-3);
  EXPECT_LT(worst[1], 1.1 * worst[0]);
}

TEST(Kda, ChunkedRejectsAnAnchorThatDoesNotDivideTheChunk) {
  const Inputs in = random_inputs(1, 8, 1, 4, 4, -5.0, 0.0, /*seed=*/24);
  try {
    kda::chunked_reference(in.q, in.k, in.v, in.g, in.beta, in.state, 0.5, 64, 24);
    FAIL() << "anchor 24 with chunk 64 was accepted";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("anchor"), std::string::npos) << message;
    EXPECT_NE(message.find("chunk = 64, got 24"), std::string::npos) << message;
  }
}

TEST(Kda, ChunkedRejectsMismatchedShapes) {
  const Inputs in = random_inputs(1, 4, 2, 16, 8, -5.0, 0.0, /*seed=*/14);
  EXPECT_THROW(kda::chunked(in.q, in.k.slice(1, 0, 3), in.v, in.g, in.beta, in.state, 0.25),
               c10::Error);
  EXPECT_THROW(kda::recurrent(in.q, in.k, in.v, in.g, in.beta, in.state.slice(2, 0, 8), 0.25),
               c10::Error);
}

TEST(Kda, GateFollowsTheModelFormulaAndNamesBadShapes) {
  // g = g_min sigmoid(exp(A_h) (z + dt_bias)), element by element in fp64: exp(A) (z + b), not
  // exp(A) z + b; g_min scales the sigmoid (saturated z reaches g_min and 0, never past them).
  torch::manual_seed(31);
  at::Tensor z = at::randn({3, 5, 2, 4}, at::kDouble) * 3;
  z.index_put_({0, 0, 0, 0}, 1e5);
  z.index_put_({0, 0, 0, 1}, -1e5);
  const at::Tensor a_log = at::randn({2}, at::kDouble), dt_bias = at::randn({8}, at::kDouble);
  const at::Tensor g = kda::gate(z, a_log, dt_bias, -5.0);
  ASSERT_EQ(g.sizes(), z.sizes());
  double worst = 0;
  for (int64_t i = 0; i < z.numel(); ++i) {
    const int64_t h = (i / 4) % 2, c = i % 4;
    const double u = z.reshape({-1})[i].item<double>() + dt_bias[h * 4 + c].item<double>();
    const double expected = -5.0 / (1.0 + std::exp(-std::exp(a_log[h].item<double>()) * u));
    worst = std::max(worst, std::abs(g.reshape({-1})[i].item<double>() - expected));
  }
  EXPECT_LT(worst, 1e-14);
  EXPECT_DOUBLE_EQ(g[0][0][0][0].item<double>(), -5.0);
  EXPECT_DOUBLE_EQ(g[0][0][0][1].item<double>(), 0.0);
  EXPECT_TRUE(at::equal(g, kda::gate_reference(z, a_log, dt_bias, -5.0)));
  auto message = [&](const at::Tensor& a, const at::Tensor& b) {
    try {
      kda::gate(z, a, b, -5.0);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message(at::zeros({3}, at::kDouble), dt_bias).find("A_log must be [2]"), std::string::npos);
  EXPECT_NE(message(a_log, at::zeros({6}, at::kDouble)).find("dt_bias must have H * K = 8"), std::string::npos);
}

TEST(Kda, ShortConvolutionFollowsTheModelFormulaAndNamesBadShapes) {
  // y[t, d] = SiLU(sum_j w[d, j] window[t + j, d]) over the window [conv_inputs | x], then each
  // head's channels divided by sqrt(their sum of squares + eps), element by element in fp64.
  torch::manual_seed(32);
  const at::Tensor x = at::randn({2, 5, 8}, at::kDouble), conv_inputs = at::randn({2, 3, 8}, at::kDouble);
  const at::Tensor weight = at::randn({8, 1, 4}, at::kDouble);
  const at::Tensor y = kda::short_conv_reference(x, conv_inputs, weight, 4, 1e-6);
  const at::Tensor window = at::cat({conv_inputs, x}, 1);
  double worst = 0;
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t t = 0; t < 5; ++t) {
      double act[8];
      for (int64_t d = 0; d < 8; ++d) {
        double a = 0;
        for (int64_t j = 0; j < 4; ++j) a += weight[d][0][j].item<double>() * window[b][t + j][d].item<double>();
        act[d] = a / (1.0 + std::exp(-a));
      }
      for (int64_t d = 0; d < 8; ++d) {
        double squares = 0;
        for (int64_t e = (d / 4) * 4; e < (d / 4) * 4 + 4; ++e) squares += act[e] * act[e];
        worst = std::max(worst, std::abs(y[b][t][d].item<double>() - act[d] / std::sqrt(squares + 1e-6)));
      }
    }
  }
  EXPECT_LT(worst, 1e-13);
  auto message = [&](const at::Tensor& c, const at::Tensor& w, int64_t head) {
    try {
      kda::short_conv_reference(x, c, w, head, 1e-6);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message(at::zeros({2, 2, 8}, at::kDouble), weight, 4).find("conv_inputs must be [2, 3, 8]"),
            std::string::npos);
  EXPECT_NE(message(conv_inputs, at::zeros({6, 1, 4}, at::kDouble), 4).find("weight must be [8, 1, W]"),
            std::string::npos);
  EXPECT_NE(message(conv_inputs, weight, 3).find("head must divide 8"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// The layer

IncrementalAttentionOptions small_options() {
  IncrementalAttentionOptions o;
  o.hidden = 32;
  o.heads = 2;
  o.head_k_dim = 16;
  o.head_v_dim = 8;
  o.decay_rank = 8;
  return o;
}

IncrementalAttention fp64_layer(uint64_t seed) {
  torch::manual_seed(seed);
  IncrementalAttention layer(small_options());
  layer->to(at::kDouble);
  return layer;
}

TEST(Kda, LayerParametersHaveDocumentedNamesAndShapes) {
  IncrementalAttention layer(small_options());
  const std::map<std::string, std::vector<int64_t>> expected = {
      {"q_proj.weight", {32, 32}},   {"k_proj.weight", {32, 32}},
      {"v_proj.weight", {16, 32}},   {"q_conv1d.weight", {32, 1, 4}},
      {"k_conv1d.weight", {32, 1, 4}}, {"v_conv1d.weight", {16, 1, 4}},
      {"b_proj.weight", {2, 32}},    {"f_a_proj.weight", {8, 32}},
      {"f_b_proj.weight", {32, 8}},  {"A_log", {2}},
      {"dt_bias", {32}},             {"g_proj.weight", {16, 32}},
      {"o_norm.weight", {8}},        {"o_proj.weight", {32, 16}},
  };
  std::map<std::string, std::vector<int64_t>> actual;
  for (const auto& p : layer->named_parameters()) actual[p.key()] = p.value().sizes().vec();
  EXPECT_EQ(actual, expected);
}

TEST(Kda, LayerForwardChunksAndStepsAgreeInFp64) {
  IncrementalAttention layer = fp64_layer(20);
  torch::manual_seed(21);
  const at::Tensor x = at::randn({2, 40, 32}, at::kDouble);
  const at::Tensor whole = layer->forward(x);
  ASSERT_EQ(whole.sizes(), x.sizes());

  KdaState chunk_state = layer->initial_state(2);
  std::vector<at::Tensor> chunks;
  int64_t start = 0;
  for (int64_t size : {7, 16, 1, 16}) {
    chunks.push_back(layer->forward_chunk(x.slice(1, start, start + size), chunk_state));
    start += size;
  }
  const double chunk_diff = max_abs_diff(at::cat(chunks, 1), whole);
  report("layer forward_chunk vs forward", chunk_diff);
  EXPECT_LT(chunk_diff, 1e-12);

  torch::NoGradGuard no_grad;
  KdaState step_state = layer->initial_state(2);
  std::vector<at::Tensor> steps;
  for (int64_t t = 0; t < x.size(1); ++t) steps.push_back(layer->step(x.select(1, t), step_state));
  const double step_diff = max_abs_diff(at::stack(steps, 1), whole);
  report("layer step vs forward", step_diff);
  EXPECT_LT(step_diff, 1e-12);
  const double state_diff = max_abs_diff(step_state.recurrent, chunk_state.recurrent);
  report("layer step vs forward_chunk final state", state_diff);
  EXPECT_LT(state_diff, 1e-12);
  EXPECT_LT(max_abs_diff(step_state.v_conv_inputs, chunk_state.v_conv_inputs), 1e-15);
}

TEST(Kda, LayerChunkByChunkOverLongSequenceEqualsWholeForward) {
  IncrementalAttention layer = fp64_layer(22);
  torch::NoGradGuard no_grad;
  torch::manual_seed(23);
  const at::Tensor x = at::randn({1, 1000, 32}, at::kDouble);
  const at::Tensor whole = layer->forward(x);
  KdaState state = layer->initial_state(1);
  std::vector<at::Tensor> chunks;
  for (int64_t start = 0; start < x.size(1); start += 96) {
    chunks.push_back(layer->forward_chunk(x.slice(1, start, start + 96), state));
  }
  const double diff = max_abs_diff(at::cat(chunks, 1), whole);
  report("layer T=1000 in chunks of 96 vs forward", diff);
  EXPECT_LT(diff, 1e-10);
}

TEST(Kda, LayerStateRoundTripsThroughBytesAndTensors) {
  IncrementalAttention layer = fp64_layer(24);
  torch::NoGradGuard no_grad;
  torch::manual_seed(25);
  const at::Tensor x = at::randn({2, 30, 32}, at::kDouble);
  KdaState state = layer->initial_state(2);
  layer->forward_chunk(x.slice(1, 0, 19), state);

  const std::string bytes = state.to_bytes();
  auto from_bytes = KdaState::from_bytes(bytes);
  ASSERT_TRUE(from_bytes.ok()) << from_bytes.status().to_string();
  auto from_tensors = KdaState::from_tensors(state.to_tensors());
  ASSERT_TRUE(from_tensors.ok()) << from_tensors.status().to_string();
  for (const KdaState* restored : {&*from_bytes, &*from_tensors}) {
    EXPECT_TRUE(at::equal(restored->recurrent, state.recurrent));
    EXPECT_TRUE(at::equal(restored->q_conv_inputs, state.q_conv_inputs));
    EXPECT_TRUE(at::equal(restored->k_conv_inputs, state.k_conv_inputs));
    EXPECT_TRUE(at::equal(restored->v_conv_inputs, state.v_conv_inputs));
  }
  EXPECT_EQ(from_bytes->to_bytes(), bytes);

  // Continuing from the restored state is bit-identical to continuing from the original.
  KdaState restored = *from_bytes;
  const at::Tensor original_next = layer->forward_chunk(x.slice(1, 19), state);
  const at::Tensor restored_next = layer->forward_chunk(x.slice(1, 19), restored);
  report("layer continue from restored state", max_abs_diff(restored_next, original_next));
  EXPECT_TRUE(at::equal(restored_next, original_next));

  // A snapshot does not follow later in-place decode steps.
  const auto snapshot = state.to_tensors();
  layer->step(x.select(1, 0), state);
  EXPECT_FALSE(at::equal(snapshot.at("recurrent"), state.recurrent));
}

TEST(Kda, StateFromBadBytesOrTensorsIsAnErrorNotACrash) {
  IncrementalAttention layer(small_options());
  const KdaState state = layer->initial_state(3);
  const std::string bytes = state.to_bytes();
  for (size_t cut : {size_t{0}, size_t{5}, size_t{12}, bytes.size() / 2, bytes.size() - 1}) {
    auto r = KdaState::from_bytes(bytes.substr(0, cut));
    ASSERT_FALSE(r.ok()) << "cut at " << cut;
    EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << r.status().to_string();
  }
  auto trailing = KdaState::from_bytes(bytes + "x");
  EXPECT_EQ(trailing.status().code(), StatusCode::kCorrupt);
  std::string huge = bytes;
  // The most significant byte of the first tensor's (k_conv_inputs) first size.
  huge[8 + 4 + 4 + std::string("k_conv_inputs").size() + 1 + 4 + 7] = '\x7f';
  EXPECT_FALSE(KdaState::from_bytes(huge).ok());

  auto tensors = state.to_tensors();
  tensors.erase("k_conv_inputs");
  auto missing = KdaState::from_tensors(tensors);
  EXPECT_EQ(missing.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("k_conv_inputs"), std::string::npos);
  tensors = state.to_tensors();
  tensors["v_conv_inputs"] = at::zeros({3, 3, 15});
  EXPECT_EQ(KdaState::from_tensors(tensors).status().code(), StatusCode::kInvalidArgument);
}

TEST(Kda, LayerGradientsReachEveryParameter) {
  IncrementalAttention layer = fp64_layer(26);
  torch::manual_seed(27);
  const at::Tensor x = at::randn({2, 20, 32}, at::kDouble);
  layer->forward(x).pow(2).sum().backward();
  for (const auto& p : layer->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_GT(p.value().grad().abs().max().item<double>(), 0.0) << p.key();
  }
}

}  // namespace
}  // namespace odyssey::model
