// The KDA CUDA kernels (kernels/kda.h) against the plain LibTorch reference (model/kda.h) in fp64:
// random inputs in bf16 and fp32, saturated gates (g = -5), alpha = 1 (g = 0), partly filled
// last chunks, prefix invariance, initial state in / final state out (a continuation equals one
// long call), packed variable-length batches, context parallelism (segments combined by a scan)
// against the serial walk and the reference, decode vs chunked, and the model's dispatch.
// The backward kernel: the gradients of every input (q, k, v, g, beta, initial state) against
// autograd through the fp64 chunked reference, and a layer's parameter gradients through the
// kernels against the fp64 reference layer.
// Head widths: K, V in {32, 64, 128} (32 is the tiny model's, walked by 2-warp CTAs of 32 value
// columns; kernels/README.md), equal and mixed. Every comparison prints its max abs error.
// Skipped without a CUDA device.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include "kernels/kda.h"
#include "kernels/kda_autograd.h"
#include "kernels/torch_bindings.h"
#include "model/kda.h"
#include "model/precision.h"

namespace odyssey::kernels {
namespace {

namespace kda = odyssey::model::kda;

struct Inputs {
  at::Tensor q, k, v, g, beta, state;  // on the GPU, q k v beta in the tested dtype
  double scale = 0;
};

enum class Gates { kRandom, kSaturated, kOne };

// Inputs as the layer makes them: q, k L2-normalised per head, v ~ N(0, 1), beta in (0, 1),
// g in [-5, 0]; an optional random initial state.
Inputs make_inputs(int64_t batch, int64_t length, int64_t heads, int64_t key, int64_t value,
                   at::ScalarType dtype, Gates gates, bool with_state, uint64_t seed) {
  at::manual_seed(seed);
  const auto cuda = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  auto l2 = [](const at::Tensor& x) { return x * at::rsqrt(x.pow(2).sum(-1, true) + 1e-6); };
  Inputs in;
  in.q = l2(at::randn({batch, length, heads, key}, cuda)).to(dtype);
  in.k = l2(at::randn({batch, length, heads, key}, cuda)).to(dtype);
  in.v = at::randn({batch, length, heads, value}, cuda).to(dtype);
  in.beta = at::sigmoid(at::randn({batch, length, heads}, cuda)).to(dtype);
  switch (gates) {
    case Gates::kRandom:
      // Mostly slow forgetting with some fast channels, as the initialised gate gives.
      in.g = -5.0 * at::sigmoid(at::randn({batch, length, heads, key}, cuda) * 2.0 - 3.0);
      break;
    case Gates::kSaturated:
      in.g = at::full({batch, length, heads, key}, -5.0, cuda);
      break;
    case Gates::kOne:
      in.g = at::zeros({batch, length, heads, key}, cuda);
      break;
  }
  if (with_state) in.state = at::randn({batch, heads, key, value}, cuda) * 0.5;
  in.scale = 1.0 / std::sqrt(static_cast<double>(key));
  return in;
}

// The fp64 recurrence on exactly the values the kernel sees (bf16 inputs upcast).
kda::Output reference(const Inputs& in, bool token_by_token = true) {
  auto d = [](const at::Tensor& t) { return t.defined() ? t.to(at::kDouble) : t; };
  if (token_by_token) {
    return kda::recurrent(d(in.q), d(in.k), d(in.v), d(in.g), d(in.beta), d(in.state), in.scale);
  }
  return kda::chunked_reference(d(in.q), d(in.k), d(in.v), d(in.g), d(in.beta), d(in.state),
                                in.scale);
}

double max_abs(const at::Tensor& a) { return a.abs().max().item<double>(); }

double max_error(const at::Tensor& got, const at::Tensor& expected) {
  return max_abs(got.to(at::kDouble) - expected.to(at::kDouble));
}

// Kernel vs reference: o and the final state, each within `tolerance` times the reference's
// largest magnitude (the kernel's matmul operands are bf16: relative error ~ 2^-9 per product).
// A CPU emulation of the kernel's rounding points gave ~4e-3 of the largest magnitude at
// T = 2000 (o and S), so kBf16Tolerance = 2e-2 leaves a factor ~5.
void expect_close(const char* what, const KdaChunkedOutput& got, const kda::Output& expected,
                  double tolerance) {
  ASSERT_TRUE(at::isfinite(got.o.to(at::kFloat)).all().item<bool>()) << what << ": o not finite";
  ASSERT_TRUE(at::isfinite(got.final_state).all().item<bool>())
      << what << ": state not finite";
  const double o_error = max_error(got.o, expected.o);
  const double s_error = max_error(got.final_state, expected.final_state);
  const double o_scale = std::max(1e-3, max_abs(expected.o));
  const double s_scale = std::max(1e-3, max_abs(expected.final_state));
  std::printf("  %-44s max|o - ref| %.3e (|o| <= %.2f)   max|S - ref| %.3e (|S| <= %.2f)\n",
              what, o_error, max_abs(expected.o), s_error, max_abs(expected.final_state));
  EXPECT_LE(o_error, tolerance * o_scale) << what;
  EXPECT_LE(s_error, tolerance * s_scale) << what;
}

constexpr double kBf16Tolerance = 2e-2;

// "B2 T100 H3 K128 V64 bf16": a case's shape and dtype, for the printed lines and failures.
std::string shape_name(int64_t batch, int64_t length, int64_t heads, int64_t key, int64_t value,
                       at::ScalarType dtype) {
  return "B" + std::to_string(batch) + " T" + std::to_string(length) + " H" +
         std::to_string(heads) + " K" + std::to_string(key) + " V" + std::to_string(value) +
         (dtype == at::kBFloat16 ? " bf16" : " fp32");
}

// K x V shapes beside the main 128 x 128 for the tests that otherwise run one shape: the tiny
// model's 32 x 32 (2-warp CTAs, groups of 2 chunks, half the lanes preparing key columns).
struct HeadShape {
  int64_t key, value;
};
const HeadShape kMainAndTinyShapes[] = {{128, 128}, {32, 32}};

class KdaKernel : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(KdaKernel, ChunkedMatchesFp64RecurrenceOnRandomInputs) {
  struct Case {
    int64_t batch, length, heads, key, value;
    at::ScalarType dtype;
    bool with_state;
  };
  const std::vector<Case> cases = {
      {2, 100, 3, 128, 128, at::kBFloat16, true}, {2, 100, 3, 128, 128, at::kFloat, true},
      {1, 64, 2, 128, 128, at::kBFloat16, false}, {2, 77, 2, 64, 64, at::kBFloat16, true},
      {1, 50, 2, 128, 64, at::kBFloat16, true},   {1, 50, 2, 64, 128, at::kFloat, false},
      {2, 100, 2, 32, 32, at::kBFloat16, true},   {2, 77, 3, 32, 32, at::kFloat, false},
      {1, 50, 2, 32, 128, at::kFloat, true},      {1, 50, 2, 128, 32, at::kBFloat16, true},
      {1, 45, 3, 32, 64, at::kBFloat16, true},    {1, 45, 2, 64, 32, at::kFloat, true},
  };
  for (const Case& c : cases) {
    const Inputs in = make_inputs(c.batch, c.length, c.heads, c.key, c.value, c.dtype,
                                  Gates::kRandom, c.with_state, /*seed=*/7 + c.length);
    const std::string name = shape_name(c.batch, c.length, c.heads, c.key, c.value, c.dtype) +
                             (c.with_state ? " +state" : "");
    expect_close(name.c_str(), kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale),
                 reference(in), kBf16Tolerance);
  }
}

TEST_F(KdaKernel, LongSequenceMatchesFp64ChunkedReference) {
  const Inputs in = make_inputs(1, 2000, 2, 128, 128, at::kBFloat16, Gates::kRandom, true, 11);
  expect_close("T2000 bf16", kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale),
               reference(in, /*token_by_token=*/false), kBf16Tolerance);
}

TEST_F(KdaKernel, SaturatedGatesStayFiniteAndMatch) {
  // g = -5 everywhere: e^-Gamma reaches e^80 inside a chunk, the edge of the exponent budget.
  for (at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    const Inputs in = make_inputs(2, 90, 2, 128, 128, dtype, Gates::kSaturated, true, 3);
    expect_close(dtype == at::kFloat ? "g = -5, fp32" : "g = -5, bf16",
                 kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale), reference(in),
                 kBf16Tolerance);
  }
}

TEST_F(KdaKernel, AlphaOneMatches) {
  const Inputs in = make_inputs(2, 90, 2, 128, 128, at::kBFloat16, Gates::kOne, true, 5);
  expect_close("g = 0", kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale),
               reference(in), kBf16Tolerance);
}

TEST_F(KdaKernel, PartlyFilledLastChunksMatch) {
  for (const HeadShape& shape : kMainAndTinyShapes) {
    for (int64_t length : {1, 5, 15, 16, 17, 31, 33, 63, 65}) {
      const Inputs in = make_inputs(1, length, 2, shape.key, shape.value, at::kBFloat16,
                                    Gates::kRandom, true, 100 + length);
      const std::string name = shape_name(1, length, 2, shape.key, shape.value, at::kBFloat16);
      expect_close(name.c_str(), kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale),
                   reference(in), kBf16Tolerance);
    }
  }
}

TEST_F(KdaKernel, EmptySequenceReturnsTheInitialState) {
  const Inputs in = make_inputs(2, 0, 2, 64, 64, at::kBFloat16, Gates::kRandom, true, 1);
  const KdaChunkedOutput out = kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale);
  EXPECT_EQ(out.o.size(1), 0);
  EXPECT_EQ(max_error(out.final_state, in.state), 0.0);
}

TEST_F(KdaKernel, OutputsBeforeAPositionIgnoreLaterTokens) {
  // Prefix invariance at P = 21 (inside the second chunk) and P = 32 (a chunk boundary).
  for (int64_t prefix : {21, 32}) {
    const Inputs a = make_inputs(1, 48, 2, 128, 128, at::kBFloat16, Gates::kRandom, true, 9);
    Inputs b = a;
    const Inputs other = make_inputs(1, 48, 2, 128, 128, at::kBFloat16, Gates::kRandom, true, 10);
    auto tail = [&](at::Tensor& t, const at::Tensor& from) {
      t = t.clone();
      t.slice(1, prefix).copy_(from.slice(1, prefix));
    };
    tail(b.q, other.q), tail(b.k, other.k), tail(b.v, other.v), tail(b.g, other.g),
        tail(b.beta, other.beta);
    const at::Tensor oa = kda_chunked(a.q, a.k, a.v, a.g, a.beta, a.state, a.scale).o;
    const at::Tensor ob = kda_chunked(b.q, b.k, b.v, b.g, b.beta, b.state, b.scale).o;
    const double before = max_error(oa.slice(1, 0, prefix), ob.slice(1, 0, prefix));
    const double after = max_error(oa.slice(1, prefix), ob.slice(1, prefix));
    std::printf("  P = %-3lld max|o_a - o_b| before P %.3e, at or after P %.3e\n",
                static_cast<long long>(prefix), before, after);
    EXPECT_LE(before, 1e-6);
    EXPECT_GT(after, 1e-3);  // the tails differ, so the change must show
  }
}

TEST_F(KdaKernel, ContinuingFromTheFinalStateEqualsOneLongCall) {
  const Inputs in = make_inputs(2, 80, 2, 128, 128, at::kBFloat16, Gates::kRandom, true, 21);
  const KdaChunkedOutput whole = kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale);
  const int64_t split = 37;  // mid-chunk: the two calls chunk the tokens differently
  auto head = [&](const at::Tensor& t) { return t.slice(1, 0, split); };
  auto rest = [&](const at::Tensor& t) { return t.slice(1, split); };
  const KdaChunkedOutput first =
      kda_chunked(head(in.q), head(in.k), head(in.v), head(in.g), head(in.beta), in.state,
                  in.scale);
  const KdaChunkedOutput second = kda_chunked(rest(in.q), rest(in.k), rest(in.v), rest(in.g),
                                              rest(in.beta), first.final_state, in.scale);
  const KdaChunkedOutput joined{at::cat({first.o, second.o}, 1), second.final_state, at::Tensor(), at::Tensor()};
  expect_close("split at 37 vs one call", joined, {whole.o, whole.final_state}, kBf16Tolerance);
  expect_close("split at 37 vs fp64", joined, reference(in), kBf16Tolerance);

  // The state may be updated in place (final_state aliasing initial_state is allowed by the
  // launcher; the binding always writes a fresh tensor, so check the launcher directly).
  at::Tensor state = in.state.clone();
  at::Tensor o = at::empty_like(in.v);
  const cudaError_t error = kda_chunked_forward(
      KdaDtype::kBFloat16, in.q.data_ptr(), in.k.data_ptr(), in.v.data_ptr(),
      in.g.data_ptr<float>(), in.beta.data_ptr(), state.data_ptr<float>(), o.data_ptr(),
      state.data_ptr<float>(), nullptr, 2, 80, 2, 128, 128, static_cast<float>(in.scale),
      nullptr);
  ASSERT_EQ(error, cudaSuccess) << cudaGetErrorString(error);
  EXPECT_EQ(max_error(state, whole.final_state), 0.0);
  EXPECT_EQ(max_error(o, whole.o), 0.0);
}

TEST_F(KdaKernel, PackedVariableLengthsEqualSeparateCalls) {
  const std::vector<int64_t> lengths = {5, 40, 17, 0, 33};
  std::vector<int32_t> offsets = {0};
  for (int64_t n : lengths) offsets.push_back(offsets.back() + static_cast<int32_t>(n));
  const int64_t total = offsets.back();
  const Inputs in = make_inputs(1, total, 2, 128, 128, at::kBFloat16, Gates::kRandom, false, 31);
  const at::Tensor states =
      at::randn({static_cast<int64_t>(lengths.size()), 2, 128, 128}, in.q.options().dtype(at::kFloat));
  const at::Tensor cu = at::tensor(offsets, at::TensorOptions().dtype(at::kInt));
  const KdaChunkedOutput packed =
      kda_chunked(in.q, in.k, in.v, in.g, in.beta, states, in.scale, cu);
  double o_error = 0, s_error = 0;
  for (int64_t n = 0; n < static_cast<int64_t>(lengths.size()); ++n) {
    const int64_t begin = offsets[n], end = offsets[n + 1];
    auto part = [&](const at::Tensor& t) { return t.slice(1, begin, end); };
    const at::Tensor state = states.slice(0, n, n + 1);
    const KdaChunkedOutput alone = kda_chunked(part(in.q), part(in.k), part(in.v), part(in.g),
                                               part(in.beta), state, in.scale);
    if (lengths[n] > 0) o_error = std::max(o_error, max_error(part(packed.o), alone.o));
    s_error = std::max(s_error, max_error(packed.final_state.slice(0, n, n + 1), alone.final_state));
  }
  std::printf("  packed vs separate: max|o| diff %.3e, max|S| diff %.3e\n", o_error, s_error);
  EXPECT_EQ(o_error, 0.0);
  EXPECT_EQ(s_error, 0.0);
}

// Context parallelism (kda.h, KdaChunkedOptions): segments from a zero state, their transitions
// (A_seg, B_seg) combined by a scan, then every segment's forward from its true start state.
// T = 4096 + 37: with 256-token segments P = 17 and the last segment holds 37 tokens (a partly
// filled last chunk); 400-token segments (25 chunks) end in a partly filled group of 4 chunks;
// 4128-token segments leave a last segment of 5 tokens (one partial chunk); 0 is the automatic
// choice (context parallel on an H200 for 8 chains of 4133 tokens at K = V = 128, 4 at 32; with
// whole heads, 4 chains, its lead of segment 0 walked forward during the transition pass). The
// explicit leads: 512 tokens before 256-token segments; 4000 tokens, which leaves one segment (P = 2,
// no scan); a lead of the whole sequence (the serial walk); none with the automatic segments. Each
// result is compared with the serial walk (segment_length = -1) and the fp64 chunked reference.
// Both at K = V = 128 and at the tiny model's 32 (CTAs of 2 warps, groups of 2 chunks).
TEST_F(KdaKernel, ContextParallelMatchesSerialAndFp64) {
  const int64_t length = 4096 + 37;
  const struct {
    Gates gates;
    const char* name;
  } gate_cases[] = {{Gates::kRandom, "random g"}, {Gates::kSaturated, "g = -5"}, {Gates::kOne, "g = 0"}};
  for (const HeadShape& shape : kMainAndTinyShapes) {
    for (const auto& gc : gate_cases) {
      const Inputs in = make_inputs(2, length, 2, shape.key, shape.value, at::kBFloat16, gc.gates,
                                    true, 71);
      const kda::Output expected = reference(in, /*token_by_token=*/false);
      const KdaChunkedOutput serial = kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state,
                                                  in.scale, at::Tensor(), /*segment_length=*/-1);
      const std::string prefix = "K" + std::to_string(shape.key) + " V" +
                                 std::to_string(shape.value) + " " + gc.name;
      expect_close((prefix + ", serial vs fp64").c_str(), serial, expected, kBf16Tolerance);
      const std::pair<int64_t, int64_t> plans[] = {{256, 0},   {400, 0}, {4128, 0}, {0, 0},
                                                   {256, 512}, {400, 4000}, {256, 4144}, {0, -1}};
      for (const auto& [segment, lead] : plans) {
        const KdaChunkedOutput parallel = kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale,
                                                      at::Tensor(), segment, true, true, lead);
        const std::string name = prefix + ", segments of " +
                                 (segment ? std::to_string(segment) : std::string("auto")) + ", lead " +
                                 (lead ? std::to_string(lead) : std::string("auto"));
        expect_close((name + " vs fp64").c_str(), parallel, expected, kBf16Tolerance);
        expect_close((name + " vs serial").c_str(), parallel, {serial.o, serial.final_state},
                     kBf16Tolerance);
      }
    }
  }
}

TEST_F(KdaKernel, ContextParallelCoversEveryShapeAndDtype) {
  struct Case {
    int64_t batch, length, heads, key, value;
    at::ScalarType dtype;
    bool with_state;
    int64_t segment, lead = 0;
  };
  // The last case is the automatic choice at the tiny model's widths (2-warp CTAs; on an H200,
  // 2 chains of 4133 tokens: context parallel).
  const std::vector<Case> cases = {
      {1, 1000, 2, 64, 64, at::kFloat, true, 160},     {2, 700, 1, 128, 64, at::kBFloat16, true, 64},
      {1, 555, 3, 64, 128, at::kBFloat16, false, 96},  {1, 300, 2, 128, 128, at::kFloat, false, 16},
      {1, 1000, 2, 32, 32, at::kBFloat16, true, 160},  {2, 700, 1, 32, 128, at::kFloat, true, 64},
      {1, 555, 3, 128, 32, at::kBFloat16, false, 96},  {1, 300, 2, 32, 64, at::kBFloat16, true, 16},
      {1, 4133, 2, 32, 32, at::kBFloat16, true, 0},
      // Leads on the 64-column CTAs (fp32, K or V of 32 or 64): segment 0 walked forward in the
      // transition pass by one CTA per value tile.
      {1, 1000, 2, 64, 64, at::kFloat, true, 160, 400},   {2, 700, 1, 32, 128, at::kFloat, true, 64, 96},
      {1, 555, 3, 128, 32, at::kBFloat16, false, 96, 160}, {1, 300, 2, 128, 128, at::kFloat, false, 16, 32},
  };
  for (const Case& c : cases) {
    const Inputs in = make_inputs(c.batch, c.length, c.heads, c.key, c.value, c.dtype,
                                  Gates::kRandom, c.with_state, /*seed=*/81 + c.length);
    const std::string name = shape_name(c.batch, c.length, c.heads, c.key, c.value, c.dtype) +
                             (c.with_state ? " +state" : "") + " segments of " +
                             (c.segment ? std::to_string(c.segment) : std::string("auto")) + " lead " +
                             std::to_string(c.lead);
    expect_close(name.c_str(),
                 kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale, at::Tensor(),
                             c.segment, true, true, c.lead),
                 reference(in, /*token_by_token=*/false), kBf16Tolerance);
  }
}

TEST_F(KdaKernel, ContextParallelLauncherUpdatesTheStateInPlace) {
  // final_state aliasing initial_state, and the workspace taken from cudaMallocAsync (none
  // passed): the same result as the binding (which passes a workspace), bit for bit.
  const Inputs in = make_inputs(1, 1000, 2, 128, 128, at::kBFloat16, Gates::kRandom, true, 91);
  const KdaChunkedOutput expected = kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state,
                                                in.scale, at::Tensor(), /*segment_length=*/128);
  at::Tensor state = in.state.clone();
  at::Tensor o = at::empty_like(in.v);
  KdaChunkedOptions options;
  options.segment_length = 128;
  ASSERT_GT(kda_chunked_forward_workspace_bytes(KdaDtype::kBFloat16, false, 1, 1000, 2, 128, 128, options), 0u);
  const cudaError_t error = kda_chunked_forward(
      KdaDtype::kBFloat16, in.q.data_ptr(), in.k.data_ptr(), in.v.data_ptr(),
      in.g.data_ptr<float>(), in.beta.data_ptr(), state.data_ptr<float>(), o.data_ptr(),
      state.data_ptr<float>(), nullptr, 1, 1000, 2, 128, 128, static_cast<float>(in.scale),
      options, nullptr);
  ASSERT_EQ(error, cudaSuccess) << cudaGetErrorString(error);
  EXPECT_EQ(max_error(state, expected.final_state), 0.0);
  EXPECT_EQ(max_error(o, expected.o), 0.0);
  // A segment or lead length that is not a multiple of the chunk is refused before any launch.
  for (const auto& [segment, lead] : {std::pair<int64_t, int64_t>{100, 0}, {128, 100}}) {
    options.segment_length = segment;
    options.lead_length = lead;
    EXPECT_EQ(kda_chunked_forward(KdaDtype::kBFloat16, in.q.data_ptr(), in.k.data_ptr(),
                                  in.v.data_ptr(), in.g.data_ptr<float>(), in.beta.data_ptr(),
                                  state.data_ptr<float>(), o.data_ptr(), state.data_ptr<float>(),
                                  nullptr, 1, 1000, 2, 128, 128, static_cast<float>(in.scale),
                                  options, nullptr),
              cudaErrorInvalidValue)
        << "segment " << segment << " lead " << lead;
  }
  try {
    kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale, at::Tensor(), 128, true, true, 100);
    ADD_FAILURE() << "a lead of 100 tokens was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("lead_length must be a multiple of 16"), std::string::npos) << e.what();
  }
}

TEST_F(KdaKernel, L2PrefetchChangesNothing) {
  // The prefetch of the next group's rows is a hint: serial and context-parallel results are
  // bit for bit those without it (T = 1000 with 64-token groups: 15 prefetches, the last of a
  // partly filled group).
  // At K = V = 32 a row's q, k and value slices are half a 128-byte line (bf16).
  for (const HeadShape& shape : kMainAndTinyShapes) {
    const Inputs in = make_inputs(2, 1000, 2, shape.key, shape.value, at::kBFloat16,
                                  Gates::kRandom, true, 95);
    for (int64_t segment : {-1, 192}) {
      const KdaChunkedOutput on = kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state,
                                              in.scale, at::Tensor(), segment, /*prefetch=*/true);
      const KdaChunkedOutput off = kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state,
                                               in.scale, at::Tensor(), segment, /*prefetch=*/false);
      const std::string name = "K" + std::to_string(shape.key) + " V" +
                               std::to_string(shape.value) + " segment_length " +
                               std::to_string(segment);
      EXPECT_EQ(max_error(on.o, off.o), 0.0) << name;
      EXPECT_EQ(max_error(on.final_state, off.final_state), 0.0) << name;
    }
  }
}

TEST_F(KdaKernel, HeadWalkEqualsTheColumnTilesBitForBit) {
  // bf16 K = V = 128: one CTA of 16 specialized warps per head (KdaChunkedOptions::head_walk,
  // the default) computes every value with the operations of the two 64-column CTAs, in the same
  // order (its 8 walkers and 4 preparing pairs meet at named barriers, one slot a pair):
  // serial and context-parallel, partly filled groups and chunks, packed sequences, an initial
  // state; and the backward's state recompute (through the gradients).
  for (int64_t length : {1, 77, 1000}) {
    const Inputs in = make_inputs(2, length, 3, 128, 128, at::kBFloat16, Gates::kRandom, true, 96);
    // Context parallel also with a lead (segment 0 walked forward during the transition pass, by
    // the whole-head kernel's x = 0 CTA or by the two 64-column CTAs).
    for (const auto& [segment, lead] : {std::pair<int64_t, int64_t>{-1, 0}, {192, -1}, {192, 320}}) {
      const KdaChunkedOutput head = kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale,
                                                at::Tensor(), segment, true, /*head_walk=*/true, lead);
      const KdaChunkedOutput tiles = kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale,
                                                 at::Tensor(), segment, true, /*head_walk=*/false, lead);
      const std::string name = "T " + std::to_string(length) + " segment_length " + std::to_string(segment) +
                               " lead " + std::to_string(lead);
      EXPECT_EQ(max_error(head.o, tiles.o), 0.0) << name;
      EXPECT_EQ(max_error(head.final_state, tiles.final_state), 0.0) << name;
    }
  }
  const Inputs in = make_inputs(1, 300, 2, 128, 128, at::kBFloat16, Gates::kRandom, false, 97);
  const at::Tensor cu = at::tensor(std::vector<int64_t>{0, 17, 17, 140, 300}, at::kLong);
  const KdaChunkedOutput head =
      kda_chunked(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), in.scale, cu, 0, true, true);
  const KdaChunkedOutput tiles =
      kda_chunked(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), in.scale, cu, 0, true, false);
  EXPECT_EQ(max_error(head.o, tiles.o), 0.0) << "packed";
  EXPECT_EQ(max_error(head.final_state, tiles.final_state), 0.0) << "packed";
}

TEST_F(KdaKernel, DecodeStepMatchesFp64Step) {
  const HeadShape shapes[] = {{64, 128}, {128, 128}, {32, 32}, {32, 128}, {128, 32}, {32, 64}};
  for (at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    for (const auto& [key, value] : shapes) {
      const Inputs in = make_inputs(5, 1, 3, key, value, dtype, Gates::kRandom, true, 41 + key);
      at::Tensor state = in.state.clone();
      at::Tensor expected_state = in.state.to(at::kDouble);
      auto d = [](const at::Tensor& t) { return t.select(1, 0).to(at::kDouble); };
      const at::Tensor expected = kda::step_reference(d(in.q), d(in.k), d(in.v), d(in.g),
                                                      d(in.beta), expected_state, in.scale);
      const at::Tensor o = kda_step(in.q.select(1, 0), in.k.select(1, 0), in.v.select(1, 0),
                                    in.g.select(1, 0), in.beta.select(1, 0), state, in.scale);
      const double o_error = max_error(o, expected), s_error = max_error(state, expected_state);
      std::printf("  decode K%-3lld V%-3lld %s: max|o - ref| %.3e, max|S - ref| %.3e\n",
                  static_cast<long long>(key), static_cast<long long>(value),
                  dtype == at::kFloat ? "fp32" : "bf16", o_error, s_error);
      // fp32 throughout; a bf16 output carries its own rounding.
      EXPECT_LE(o_error, dtype == at::kFloat ? 1e-5 : 1e-2 * max_abs(expected));
      EXPECT_LE(s_error, 1e-4);
    }
  }
}

TEST_F(KdaKernel, DecodeContinuesAChunkedPrefill) {
  const int64_t prefill = 20, steps = 5;
  for (const HeadShape& shape : kMainAndTinyShapes) {
    const Inputs in = make_inputs(3, prefill + steps, 2, shape.key, shape.value, at::kBFloat16,
                                  Gates::kRandom, true, 51);
    const KdaChunkedOutput whole =
        kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale);
    auto head = [&](const at::Tensor& t) { return t.slice(1, 0, prefill); };
    at::Tensor state = kda_chunked(head(in.q), head(in.k), head(in.v), head(in.g), head(in.beta),
                                   in.state, in.scale)
                           .final_state;
    std::vector<at::Tensor> outputs;
    for (int64_t t = prefill; t < prefill + steps; ++t) {
      outputs.push_back(kda_step(in.q.select(1, t), in.k.select(1, t), in.v.select(1, t),
                                 in.g.select(1, t), in.beta.select(1, t), state, in.scale));
    }
    const at::Tensor decoded = at::stack(outputs, 1);
    const KdaChunkedOutput got{decoded, state, at::Tensor(), at::Tensor()};
    const kda::Output expected{whole.o.slice(1, prefill), whole.final_state};
    const std::string name = "K" + std::to_string(shape.key) + " V" +
                             std::to_string(shape.value) + " prefill 20 + decode 5 vs chunked 25";
    expect_close(name.c_str(), got, expected, kBf16Tolerance);
  }
}

TEST_F(KdaKernel, ModelDispatchesToTheKernelWithAndWithoutGradients) {
  for (const HeadShape& shape : kMainAndTinyShapes) {
    const std::string name = "K" + std::to_string(shape.key) + " V" + std::to_string(shape.value);
    const Inputs in =
        make_inputs(1, 40, 2, shape.key, shape.value, at::kFloat, Gates::kRandom, true, 61);
    const KdaChunkedOutput kernel =
        kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale);
    {
      const kda::Output out = kda::chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale);
      EXPECT_EQ(max_error(out.o, kernel.o), 0.0) << name << ": kda::chunked on CUDA without grad";
    }
    {
      // With a gradient wanted: the forward kernel (bit for bit), recorded with the backward
      // kernel as its backward.
      const at::Tensor q = in.q.clone().requires_grad_(true);
      const kda::Output out = kda::chunked(q, in.k, in.v, in.g, in.beta, in.state, in.scale);
      ASSERT_TRUE(out.o.requires_grad()) << "with grad, kda::chunked must record for autograd";
      EXPECT_EQ(max_error(out.o.detach(), kernel.o), 0.0)
          << name << ": kda::chunked on CUDA with grad";
      EXPECT_EQ(max_error(out.final_state.detach(), kernel.final_state), 0.0) << name;
      out.o.sum().backward();
      ASSERT_TRUE(q.grad().defined());
      const at::Tensor expected =
          kda_chunked_backward(in.q, in.k, in.v, in.g, in.beta, in.state,
                               at::ones_like(kernel.o), at::Tensor(), in.scale)
              .dq;
      EXPECT_EQ(max_error(q.grad(), expected), 0.0)
          << name << ": q.grad is the backward kernel's dq";
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward kernel (kda_chunked_backward) against autograd through the fp64 chunked reference.

struct Gradients {
  at::Tensor dq, dk, dv, dg, dbeta, d_state;
};

// Autograd of <o, d_o> + <final_state, d_final> through kda::chunked_reference in fp64 on exactly
// the values the kernel sees.
Gradients reference_gradients(const Inputs& in, const at::Tensor& d_o, const at::Tensor& d_final) {
  auto leaf = [](const at::Tensor& t) {
    return t.defined() ? t.to(at::kDouble).detach().requires_grad_(true) : t;
  };
  const at::Tensor q = leaf(in.q), k = leaf(in.k), v = leaf(in.v), g = leaf(in.g),
                   beta = leaf(in.beta), state = leaf(in.state);
  const kda::Output out = kda::chunked_reference(q, k, v, g, beta, state, in.scale);
  at::Tensor loss = (out.o * d_o.to(at::kDouble)).sum();
  if (d_final.defined()) loss = loss + (out.final_state * d_final.to(at::kDouble)).sum();
  loss.backward();
  return {q.grad(), k.grad(), v.grad(), g.grad(), beta.grad(),
          state.defined() ? state.grad() : at::Tensor()};
}

// Each gradient within `tolerance` times the reference's largest magnitude (floor 1e-3); the
// kernel's matmul operands are bf16, and the states and their gradients are kept in bf16
// between its passes. A CPU emulation of the backward's rounding points gave 2e-3 to 4.4e-3 of
// the largest magnitude (random g, g = -5, g = 0; K = V = 128; kernels/JOURNAL.md, "Fifteenth session"): a factor ~10.
constexpr double kGradientTolerance = 5e-2;

void expect_gradients(const std::string& what, const Gradients& got, const Gradients& expected) {
  const std::pair<const char*, std::pair<at::Tensor, at::Tensor>> pairs[] = {
      {"dq", {got.dq, expected.dq}},       {"dk", {got.dk, expected.dk}},
      {"dv", {got.dv, expected.dv}},       {"dg", {got.dg, expected.dg}},
      {"dbeta", {got.dbeta, expected.dbeta}}, {"dS0", {got.d_state, expected.d_state}},
  };
  std::printf("  %s\n", what.c_str());
  for (const auto& [name, tensors] : pairs) {
    const auto& [g, e] = tensors;
    if (!e.defined()) continue;
    ASSERT_TRUE(g.defined()) << what << ": " << name << " missing";
    ASSERT_EQ(g.sizes(), e.sizes()) << what << ": " << name;
    ASSERT_TRUE(at::isfinite(g.to(at::kFloat)).all().item<bool>()) << what << ": " << name
                                                                   << " not finite";
    const double error = max_error(g, e), magnitude = max_abs(e);
    std::printf("    %-6s max|d - ref| %.3e (|ref| <= %.3e, relative %.2e)\n", name, error,
                magnitude, error / std::max(1e-3, magnitude));
    EXPECT_LE(error, kGradientTolerance * std::max(1e-3, magnitude)) << what << ": " << name;
  }
}

Gradients kernel_gradients(const Inputs& in, const at::Tensor& d_o, const at::Tensor& d_final,
                           bool pass3_blocks = true, bool keep_values = true, int64_t pass3_block_tokens = 0,
                           bool pass3_block_producer = false) {
  const KdaChunkedGradients d = kda_chunked_backward(in.q, in.k, in.v, in.g, in.beta, in.state, d_o, d_final,
                                                     in.scale, at::Tensor(), pass3_blocks, keep_values, at::Tensor(),
                                                     pass3_block_tokens, pass3_block_producer);
  return {d.dq, d.dk, d.dv, d.dg, d.dbeta, in.state.defined() ? d.d_initial_state : at::Tensor()};
}

// f throws a c10::Error whose message contains `message` (a refusal by name).
void refused(const std::function<void()>& f, const std::string& message) {
  try {
    f();
    ADD_FAILURE() << "accepted: " << message;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
}

// The six gradients of a kda_chunked_backward by name, in a fixed order.
std::vector<std::pair<std::string, at::Tensor>> by_name(const KdaChunkedGradients& d) {
  return {{"dq", d.dq}, {"dk", d.dk}, {"dv", d.dv}, {"dg", d.dg}, {"dbeta", d.dbeta}, {"dS0", d.d_initial_state}};
}

// Random output gradients: d_o like o, d_final like the state (or none).
std::pair<at::Tensor, at::Tensor> output_gradients(const Inputs& in, bool with_final,
                                                   uint64_t seed) {
  at::manual_seed(seed);
  const at::Tensor d_o = at::randn(in.v.sizes(), in.v.options().dtype(at::kFloat)).to(in.q.scalar_type());
  at::Tensor d_final;
  if (with_final) {
    d_final = at::randn({in.q.size(0), in.q.size(2), in.q.size(3), in.v.size(3)},
                        in.v.options().dtype(at::kFloat)) * 0.5;
  }
  return {d_o, d_final};
}

TEST_F(KdaKernel, BackwardMatchesAutogradOfTheFp64Reference) {
  struct Case {
    int64_t batch, length, heads, key, value;
    at::ScalarType dtype;
    Gates gates;
    bool with_state, with_final;
  };
  const std::vector<Case> cases = {
      {2, 100, 2, 128, 128, at::kBFloat16, Gates::kRandom, true, true},
      {2, 100, 2, 128, 128, at::kFloat, Gates::kRandom, true, true},
      {1, 90, 2, 128, 128, at::kFloat, Gates::kSaturated, true, true},
      {1, 90, 2, 128, 128, at::kBFloat16, Gates::kOne, true, true},
      {1, 90, 2, 128, 128, at::kBFloat16, Gates::kSaturated, true, true},
      {2, 37, 2, 128, 128, at::kFloat, Gates::kRandom, true, true},
      {1, 50, 3, 64, 64, at::kFloat, Gates::kRandom, true, true},
      {1, 50, 2, 128, 64, at::kBFloat16, Gates::kRandom, false, true},
      {1, 64, 2, 64, 128, at::kFloat, Gates::kRandom, true, false},
      {2, 48, 2, 128, 128, at::kFloat, Gates::kRandom, false, false},
      {2, 100, 2, 32, 32, at::kBFloat16, Gates::kRandom, true, true},
      {2, 100, 2, 32, 32, at::kFloat, Gates::kRandom, true, true},
      {1, 90, 2, 32, 32, at::kFloat, Gates::kSaturated, true, true},
      {1, 90, 2, 32, 32, at::kBFloat16, Gates::kOne, true, true},
      {1, 50, 3, 32, 128, at::kFloat, Gates::kRandom, true, false},
      {1, 64, 2, 128, 32, at::kBFloat16, Gates::kRandom, false, true},
      {1, 37, 2, 32, 64, at::kFloat, Gates::kRandom, true, true},
      {1, 45, 2, 64, 32, at::kFloat, Gates::kRandom, true, true},
  };
  const char* gate_names[] = {"random g", "g = -5", "g = 0"};
  for (const Case& c : cases) {
    const Inputs in = make_inputs(c.batch, c.length, c.heads, c.key, c.value, c.dtype, c.gates,
                                  c.with_state, /*seed=*/200 + c.length + c.key);
    const auto [d_o, d_final] = output_gradients(in, c.with_final, 300 + c.length);
    const std::string name = shape_name(c.batch, c.length, c.heads, c.key, c.value, c.dtype) +
                             " " + gate_names[static_cast<int>(c.gates)] +
                             (c.with_state ? " +state" : "") + (c.with_final ? " +dS_final" : "");
    expect_gradients(name, kernel_gradients(in, d_o, d_final),
                     reference_gradients(in, d_o, d_final));
  }
}

TEST_F(KdaKernel, BackwardOfPartlyFilledLastChunksMatches) {
  for (const HeadShape& shape : kMainAndTinyShapes) {
    for (int64_t length : {1, 5, 15, 16, 17, 33, 37, 50, 63, 65}) {
      const Inputs in = make_inputs(1, length, 2, shape.key, shape.value, at::kFloat,
                                    Gates::kRandom, true, 400 + length);
      const auto [d_o, d_final] = output_gradients(in, /*with_final=*/true, 500 + length);
      expect_gradients(shape_name(1, length, 2, shape.key, shape.value, at::kFloat),
                       kernel_gradients(in, d_o, d_final), reference_gradients(in, d_o, d_final));
    }
  }
}

// Pass 3 by 32-token blocks (KdaBackwardOptions::pass3_blocks, kda_block_gradient.cuh; bf16, K = V
// = 128) against fp64 autograd, and the 16-token pass on the same inputs: blocks of one token, of
// one sub-chunk, full ones, partly filled second sub-chunks, many blocks (2000 tokens: 62 and a
// half), with random gates, g = -5 (the (1, 0) block's factor e^{B_1} at e^{-80}) and g = 0.
TEST_F(KdaKernel, BackwardByThirtyTwoTokenBlocksMatches) {
  for (const Gates gates : {Gates::kRandom, Gates::kSaturated, Gates::kOne}) {
    for (int64_t length : {1, 15, 16, 17, 31, 32, 33, 47, 63, 65, 2000}) {
      if (gates == Gates::kOne && length < 32) continue;
      const Inputs in = make_inputs(2, length, 2, 128, 128, at::kBFloat16, gates, true, 600 + length);
      const auto [d_o, d_final] = output_gradients(in, /*with_final=*/true, 700 + length);
      const char* gate_names[] = {"", " g = -5", " g = 0"};
      const std::string name = shape_name(2, length, 2, 128, 128, at::kBFloat16) + gate_names[static_cast<int>(gates)];
      const Gradients expected = reference_gradients(in, d_o, d_final);
      expect_gradients(name + " 32-token blocks", kernel_gradients(in, d_o, d_final, /*pass3_blocks=*/true,
                                                                   /*keep_values=*/false), expected);
      expect_gradients(name + " 16-token chunks", kernel_gradients(in, d_o, d_final, /*pass3_blocks=*/false), expected);
    }
  }
}

TEST_F(KdaKernel, BackwardOfALongSequenceMatches) {
  // 125 chunks: 31 full groups of 4 and a partly filled one in the reverse walk (62 full groups
  // of 2 and a partly filled one at K = V = 32).
  for (const HeadShape& shape : kMainAndTinyShapes) {
    const Inputs in = make_inputs(1, 2000, 2, shape.key, shape.value, at::kBFloat16,
                                  Gates::kRandom, true, 13);
    const auto [d_o, d_final] = output_gradients(in, /*with_final=*/true, 14);
    expect_gradients(shape_name(1, 2000, 2, shape.key, shape.value, at::kBFloat16),
                     kernel_gradients(in, d_o, d_final), reference_gradients(in, d_o, d_final));
  }
}

TEST_F(KdaKernel, BackwardThroughTheContextParallelStatePassMatches) {
  // One sequence of 4133 tokens with 2 heads: the backward's state recompute (pass 1) is context
  // parallel on an H200 (with whole heads, its lead of segment 0 stores chunk states during the
  // transition pass). g = 0 carries the state across every segment.
  for (const Gates gates : {Gates::kRandom, Gates::kOne}) {
    const Inputs in = make_inputs(1, 4133, 2, 128, 128, at::kBFloat16, gates, true, 15);
    const auto [d_o, d_final] = output_gradients(in, /*with_final=*/true, 16);
    expect_gradients(shape_name(1, 4133, 2, 128, 128, at::kBFloat16) + (gates == Gates::kOne ? " g = 0" : ""),
                     kernel_gradients(in, d_o, d_final), reference_gradients(in, d_o, d_final));
  }
}

// A training step's forward keeping the chunk states (kda_chunked's keep_chunk_states: the walk
// with outputs that also stores them, Pass::kForwardStates) and the backward from them: o, the
// final state, the states themselves and every gradient are bit for bit what the forward alone,
// the states pass (the launcher with chunk_states and no o) and the recomputing backward give: on
// the whole-head walk, the 64-column CTAs, head widths 32 and 64, partly filled last chunks and the
// context-parallel path with its lead (4133 tokens, 2 heads). Bad chunk_states are refused by name.
TEST_F(KdaKernel, KeptChunkStatesEqualTheRecomputeBitForBit) {
  struct Case {
    int64_t batch, length, heads, key, value;
    at::ScalarType dtype;
    bool with_state;
  };
  const std::vector<Case> cases = {
      {2, 100, 2, 128, 128, at::kBFloat16, true}, {2, 100, 2, 128, 128, at::kFloat, true},
      {1, 37, 3, 32, 32, at::kBFloat16, false},   {1, 50, 2, 64, 128, at::kFloat, true},
      {1, 4133, 2, 128, 128, at::kBFloat16, true},
  };
  for (const Case& c : cases) {
    const Inputs in = make_inputs(c.batch, c.length, c.heads, c.key, c.value, c.dtype, Gates::kRandom,
                                  c.with_state, /*seed=*/900 + c.length);
    const std::string name = shape_name(c.batch, c.length, c.heads, c.key, c.value, c.dtype);
    const KdaChunkedOutput plain = kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale);
    const KdaChunkedOutput kept = kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale, at::Tensor(),
                                              0, true, true, 0, /*keep_chunk_states=*/true);
    ASSERT_TRUE(kept.chunk_states.defined()) << name;
    const int64_t chunks = (c.length + 15) / 16;
    ASSERT_EQ(kept.chunk_states.sizes(), at::IntArrayRef({c.batch, c.heads, chunks, c.value, c.key})) << name;
    EXPECT_FALSE(plain.chunk_states.defined()) << name;
    EXPECT_TRUE(at::equal(kept.o, plain.o)) << name << ": o";
    EXPECT_TRUE(at::equal(kept.final_state, plain.final_state)) << name << ": final state";

    at::Tensor states = at::empty_like(kept.chunk_states), final_state = at::empty_like(plain.final_state);
    KdaChunkedOptions options;
    options.chunk_states = states.data_ptr();
    const cudaError_t error = kda_chunked_forward(
        c.dtype == at::kBFloat16 ? KdaDtype::kBFloat16 : KdaDtype::kFloat32, in.q.data_ptr(), in.k.data_ptr(),
        in.v.data_ptr(), in.g.data_ptr<float>(), in.beta.data_ptr(),
        in.state.defined() ? in.state.data_ptr<float>() : nullptr, /*o=*/nullptr, final_state.data_ptr<float>(),
        nullptr, c.batch, c.length, c.heads, c.key, c.value, static_cast<float>(in.scale), options, nullptr);
    ASSERT_EQ(error, cudaSuccess) << name << ": " << cudaGetErrorString(error);
    EXPECT_TRUE(at::equal(kept.chunk_states, states)) << name << ": chunk states";

    const auto [d_o, d_final] = output_gradients(in, /*with_final=*/true, 950 + c.length);
    // States kept without V': pass 3 recomputes V' and dV', so the recompute does too (keep_values
    // off; NewValuesKeptByTheForwardFeedTheBlockedPassBitForBit covers the two kept together).
    const KdaChunkedGradients recomputed = kda_chunked_backward(
        in.q, in.k, in.v, in.g, in.beta, in.state, d_o, d_final, in.scale, at::Tensor(), true, /*keep_values=*/false);
    const KdaChunkedGradients given =
        kda_chunked_backward(in.q, in.k, in.v, in.g, in.beta, in.state, d_o, d_final, in.scale, kept.chunk_states);
    for (const auto& [what, a, b] :
         {std::tuple{"dq", given.dq, recomputed.dq}, std::tuple{"dk", given.dk, recomputed.dk},
          std::tuple{"dv", given.dv, recomputed.dv}, std::tuple{"dg", given.dg, recomputed.dg},
          std::tuple{"dbeta", given.dbeta, recomputed.dbeta},
          std::tuple{"dS0", given.d_initial_state, recomputed.d_initial_state}}) {
      EXPECT_TRUE(at::equal(a, b)) << name << ": " << what << " max diff " << max_error(a, b);
    }
    std::printf("  %-28s o, final state, %ld chunk states and the gradients from them: bit for bit\n",
                name.c_str(), static_cast<long>(chunks));
  }

  const Inputs in = make_inputs(1, 40, 2, 64, 64, at::kBFloat16, Gates::kRandom, false, 960);
  const auto [d_o, d_final] = output_gradients(in, /*with_final=*/false, 961);
  const at::Tensor kept = kda_chunked(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), in.scale, at::Tensor(), 0,
                                      true, true, 0, true).chunk_states;
  const std::pair<const char*, at::Tensor> bad[] = {
      {"must be [B, H, ceil(T / 16), V, K]", kept.narrow(2, 0, 2).contiguous()},
      {"must be bf16", kept.to(at::kFloat)},
      {"must be contiguous", kept.transpose(3, 4).contiguous().transpose(3, 4)},
  };
  for (const auto& [message, states] : bad) {
    try {
      kda_chunked_backward(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), d_o, d_final, in.scale, states);
      ADD_FAILURE() << "chunk_states accepted; expected: " << message;
    } catch (const c10::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("chunk_states"), std::string::npos) << what;
      EXPECT_NE(what.find(message), std::string::npos) << what;
    }
  }
  const at::Tensor packed = at::tensor({0, 15, 40}, at::TensorOptions().dtype(at::kInt));
  try {
    kda_chunked(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), in.scale, packed, 0, true, true, 0, true);
    ADD_FAILURE() << "keep_chunk_states accepted with cu_seqlens";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("keep_chunk_states is not supported with cu_seqlens"), std::string::npos)
        << e.what();
  }
}

// Pass 3 by 32-token blocks without V' (keep_values off) reads the state entering every block and
// the gradient of the state leaving it, so its passes 1 and 2 store every second chunk's
// (KdaChunkedOptions::chunk_state_interval = 2; half the bytes written and half the workspace;
// with V', every fourth state: NewValuesKeptByTheForwardFeedTheBlockedPassBitForBit). The states kept at
// interval 2 are every second one of interval 1's, bit for bit (the whole-head walk, its context-
// parallel path with the lead at 4133 tokens, one chunk, partly filled last blocks), and the
// blocked backward gives the same gradients bit for bit from either, or recomputing them. Wrong
// intervals are refused by name.
TEST_F(KdaKernel, StatesOfEverySecondChunkFeedTheBlockedPassBitForBit) {
  for (const int64_t length : {16, 17, 33, 100, 4133}) {
    const int64_t batch = length == 4133 ? 1 : 2;
    const Inputs in = make_inputs(batch, length, 2, 128, 128, at::kBFloat16, Gates::kRandom, true, 970 + length);
    const std::string name = shape_name(batch, length, 2, 128, 128, at::kBFloat16);
    auto forward = [&](int64_t interval) {
      return kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale, at::Tensor(), 0, true, true, 0,
                         /*keep_chunk_states=*/true, interval);
    };
    const KdaChunkedOutput every = forward(1), second = forward(2);
    const int64_t chunks = (length + 15) / 16;
    ASSERT_EQ(second.chunk_states.size(2), (chunks + 1) / 2) << name;
    EXPECT_TRUE(at::equal(second.o, every.o)) << name << ": o";
    EXPECT_TRUE(at::equal(second.chunk_states,
                          every.chunk_states.index({at::indexing::Slice(), at::indexing::Slice(),
                                                    at::indexing::Slice(at::indexing::None, at::indexing::None, 2)})))
        << name << ": every second chunk state";

    const auto [d_o, d_final] = output_gradients(in, /*with_final=*/true, 990 + length);
    auto backward = [&](const at::Tensor& states) {  // V' and dV' recomputed in pass 3, as from states alone
      return kda_chunked_backward(in.q, in.k, in.v, in.g, in.beta, in.state, d_o, d_final, in.scale, states,
                                  /*pass3_blocks=*/true, /*keep_values=*/false);
    };
    const KdaChunkedGradients recomputed = backward(at::Tensor()), from_every = backward(every.chunk_states),
                              from_second = backward(second.chunk_states);
    const auto r = by_name(recomputed), e = by_name(from_every), s = by_name(from_second);
    for (size_t x = 0; x < r.size(); ++x) {
      const std::string& what = r[x].first;
      const at::Tensor &a = r[x].second, &b = e[x].second, &c = s[x].second;
      EXPECT_TRUE(at::equal(a, b)) << name << ": " << what << " from every chunk's states, max diff " << max_error(a, b);
      EXPECT_TRUE(at::equal(a, c)) << name << ": " << what << " from every second one, max diff " << max_error(a, c);
    }
    std::printf("  %-28s %ld of %ld chunk states kept; the blocked gradients from them, from all, recomputed: "
                "bit for bit\n", name.c_str(), static_cast<long>(second.chunk_states.size(2)),
                static_cast<long>(chunks));
  }

  const Inputs in = make_inputs(1, 40, 2, 128, 128, at::kBFloat16, Gates::kRandom, false, 1000);
  const auto [d_o, d_final] = output_gradients(in, /*with_final=*/false, 1001);
  const at::Tensor second = kda_chunked(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), in.scale, at::Tensor(), 0,
                                        true, true, 0, true, 2).chunk_states;
  try {
    kda_chunked_backward(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), d_o, d_final, in.scale, second,
                         /*pass3_blocks=*/false);
    ADD_FAILURE() << "every second chunk's states accepted by the 16-token pass 3";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("chunk_states must be [B, H, ceil(T / 16), V, K]"), std::string::npos)
        << e.what();
  }
  try {
    kda_chunked(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), in.scale, at::Tensor(), 0, true, true, 0, true, 3);
    ADD_FAILURE() << "chunk_state_interval 3 accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("chunk_state_interval must be 1, 2 or 4"), std::string::npos) << e.what();
  }
  // The launchers themselves: an interval other than 1, 2 or 4, and states of every second chunk for
  // the 16-token pass, are cudaErrorInvalidValue before anything runs.
  at::Tensor states = at::empty({1, 2, 2, 128, 128}, in.q.options()), final_state = at::empty({1, 2, 128, 128},
                                                                                               in.g.options());
  KdaChunkedOptions options;
  options.chunk_states = states.data_ptr();
  options.chunk_state_interval = 3;
  EXPECT_EQ(kda_chunked_forward(KdaDtype::kBFloat16, in.q.data_ptr(), in.k.data_ptr(), in.v.data_ptr(),
                                in.g.data_ptr<float>(), in.beta.data_ptr(), nullptr, nullptr,
                                final_state.data_ptr<float>(), nullptr, 1, 40, 2, 128, 128,
                                static_cast<float>(in.scale), options, nullptr),
            cudaErrorInvalidValue);
  at::Tensor grads = at::empty({6, 1, 40, 2, 128}, in.g.options()), dbeta = at::empty({1, 40, 2}, in.g.options());
  KdaBackwardOptions backward_options;
  backward_options.pass3_blocks = false;
  backward_options.chunk_states_interval = 2;  // without pass3_blocks
  const at::Tensor d_o16 = d_o.to(at::kBFloat16).contiguous();
  EXPECT_EQ(kda_chunked_backward(KdaDtype::kBFloat16, in.q.data_ptr(), in.k.data_ptr(), in.v.data_ptr(),
                                 in.g.data_ptr<float>(), in.beta.data_ptr(), nullptr, d_o16.data_ptr(), nullptr,
                                 grads[0].data_ptr(), grads[1].data_ptr(), grads[2].data_ptr(),
                                 grads[3].data_ptr<float>(), dbeta.data_ptr<float>(), nullptr, 1, 40, 2, 128, 128,
                                 static_cast<float>(in.scale), second.data_ptr(), nullptr, 0, nullptr,
                                 backward_options),
            cudaErrorInvalidValue);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
}

// KdaBackwardOptions::keep_values: passes 1 and 2 keep V' and dV', and pass 3 by 32-token blocks reads them
// instead of recomputing both (a block's first sub-chunk's dV' taken from its chunk's to its
// block's by Y^T dV'_1). Against fp64 autograd on the blocked pass's cases: blocks of one token, of
// one sub-chunk, partly filled second sub-chunks, 2000 tokens; random gates, g = -5 and g = 0.
TEST_F(KdaKernel, BackwardWithValuesKeptByTheWalksMatches) {
  for (const Gates gates : {Gates::kRandom, Gates::kSaturated, Gates::kOne}) {
    for (int64_t length : {1, 15, 17, 31, 33, 47, 65, 2000}) {
      if (gates == Gates::kOne && length < 32) continue;
      const Inputs in = make_inputs(2, length, 2, 128, 128, at::kBFloat16, gates, true, 1100 + length);
      const auto [d_o, d_final] = output_gradients(in, /*with_final=*/true, 1200 + length);
      const char* gate_names[] = {"", " g = -5", " g = 0"};
      const std::string name = shape_name(2, length, 2, 128, 128, at::kBFloat16) + gate_names[static_cast<int>(gates)];
      expect_gradients(name + " V' and dV' kept, 32-token blocks",
                       kernel_gradients(in, d_o, d_final, /*pass3_blocks=*/true, /*keep_values=*/true,
                                        /*pass3_block_tokens=*/32),
                       reference_gradients(in, d_o, d_final));
    }
  }
}

// V' kept by a training step's forward (kda_chunked's keep_new_values, with its states at the
// interval kda_backward_state_interval gives: 4, every fourth chunk's) is what pass 1 keeps, so the
// backward from both gives the recompute's gradients with keep_values bit for bit: the whole-head
// walk, partly filled last blocks, a pair without its second block (3 blocks at 65 and 100 tokens),
// and at 4133 tokens of one sequence the context-parallel forward (with its lead) and reverse walk;
// for the 32-token pass and the default (64-token blocks).
// The 64-column walks keep the same V' bit for bit. Within bf16 rounding of both: the backward that
// recomputes V' and dV' in pass 3, and the one from states kept at interval 2 (pass 3 then reads
// every block's entering state instead of making every second one from the one before). Misuse is
// refused by name.
TEST_F(KdaKernel, NewValuesKeptByTheForwardFeedTheBlockedPassBitForBit) {
  const int interval = kda_backward_state_interval(KdaDtype::kBFloat16, 128, 128);
  ASSERT_EQ(interval, 4);
  for (const int64_t length : {17, 65, 100, 4133}) {
    const int64_t batch = length == 4133 ? 1 : 2;
    const Inputs in = make_inputs(batch, length, 2, 128, 128, at::kBFloat16, Gates::kRandom, true, 1300 + length);
    const std::string name = shape_name(batch, length, 2, 128, 128, at::kBFloat16);
    auto forward = [&](bool head_walk, int64_t every) {
      return kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale, at::Tensor(), 0, true, head_walk, 0,
                         /*keep_chunk_states=*/true, every, /*keep_new_values=*/true);
    };
    const KdaChunkedOutput kept = forward(true, interval), kept_second = forward(true, 2);
    ASSERT_EQ(kept.chunk_states.size(2), ((length + 15) / 16 + 3) / 4) << name;
    ASSERT_EQ(kept.new_values.sizes(), in.v.sizes()) << name;
    EXPECT_TRUE(at::equal(kept.o, kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale).o)) << name << ": o";
    if (length != 4133) {
      EXPECT_TRUE(at::equal(forward(false, interval).new_values, kept.new_values))
          << name << ": V' of the 64-column walks";
    }
    const auto [d_o, d_final] = output_gradients(in, /*with_final=*/true, 1400 + length);
    // The 32-token pass and the default (64-token blocks, V' and dVb being at hand).
    for (const int64_t tokens : {32, 0}) {
      const std::string named = name + (tokens == 32 ? " 32-token blocks" : " by default");
      auto backward = [&](const at::Tensor& states, const at::Tensor& values, bool keep_values) {
        return kda_chunked_backward(in.q, in.k, in.v, in.g, in.beta, in.state, d_o, d_final, in.scale, states,
                                    /*pass3_blocks=*/true, keep_values, values, tokens);
      };
      const KdaChunkedGradients recomputed = backward(at::Tensor(), at::Tensor(), true),
                                from_kept = backward(kept.chunk_states, kept.new_values, false),
                                without = backward(at::Tensor(), at::Tensor(), false),
                                from_second = backward(kept_second.chunk_states, kept_second.new_values, false);
      const auto r = by_name(recomputed), k = by_name(from_kept), w = by_name(without), s2 = by_name(from_second);
      for (size_t x = 0; x < r.size(); ++x) {
        const std::string& what = r[x].first;
        const at::Tensor &a = r[x].second, &b = k[x].second;
        EXPECT_TRUE(at::equal(a, b)) << named << ": " << what << " from the kept V', max diff " << max_error(a, b);
        for (const auto& [label, other] :
             {std::pair<const char*, const at::Tensor*>{"V' and dV' recomputed in pass 3", &w[x].second},
              {"every block's state read (interval 2)", &s2[x].second}}) {
          const double error = max_error(a, *other), magnitude = max_abs(*other);
          std::printf("  %-44s %-5s against %s: %.3e of %.3e (%.2e)\n", named.c_str(), what.c_str(), label, error,
                      magnitude, error / std::max(1e-3, magnitude));
          EXPECT_LE(error, kGradientTolerance * std::max(1e-3, magnitude)) << named << ": " << what << ", " << label;
        }
      }
    }
  }

  const Inputs in = make_inputs(1, 40, 2, 128, 128, at::kBFloat16, Gates::kRandom, false, 1500);
  const auto [d_o, d_final] = output_gradients(in, /*with_final=*/false, 1501);
  refused([&] { kda_chunked(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), in.scale, at::Tensor(), 0, true, true, 0,
                            /*keep_chunk_states=*/false, 1, /*keep_new_values=*/true); },
          "keep_new_values needs keep_chunk_states");
  const KdaChunkedOutput kept = kda_chunked(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), in.scale, at::Tensor(), 0,
                                            true, true, 0, true, 2, true);
  refused([&] { kda_chunked_backward(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), d_o, d_final, in.scale,
                                     at::Tensor(), true, false, kept.new_values); },
          "new_values is kept with chunk_states");
  refused([&] { kda_chunked_backward(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), d_o, d_final, in.scale,
                                     kept.chunk_states, true, false, kept.new_values.narrow(1, 0, 39)); },
          "new_values must be bf16 [B, T, H, V]");
  // Every fourth chunk's states (40 tokens: 3 chunks, one state) need V' to make the others.
  const KdaChunkedOutput fourth = kda_chunked(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), in.scale, at::Tensor(),
                                              0, true, true, 0, true, 4, true);
  ASSERT_EQ(fourth.chunk_states.size(2), 1);
  refused([&] { kda_chunked_backward(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), d_o, d_final, in.scale,
                                     fourth.chunk_states, true, true); },
          "with new_values every fourth chunk's");
  // The launchers: V' without chunk states, or misaligned, is cudaErrorInvalidValue before anything runs.
  at::Tensor o = at::empty_like(in.v), final_state = at::empty({1, 2, 128, 128}, in.g.options());
  KdaChunkedOptions options;
  options.new_values = kept.new_values.data_ptr();
  EXPECT_EQ(kda_chunked_forward(KdaDtype::kBFloat16, in.q.data_ptr(), in.k.data_ptr(), in.v.data_ptr(),
                                in.g.data_ptr<float>(), in.beta.data_ptr(), nullptr, o.data_ptr(),
                                final_state.data_ptr<float>(), nullptr, 1, 40, 2, 128, 128, in.scale, options, nullptr),
            cudaErrorInvalidValue);
  // ... and states given at interval 4 without V' (pass 3 could not make every second block's).
  at::Tensor grads = at::empty({4, 1, 40, 2, 128}, in.g.options()), dbeta = at::empty({1, 40, 2}, in.g.options());
  const at::Tensor d_o16 = d_o.to(at::kBFloat16).contiguous();
  KdaBackwardOptions backward_options;
  backward_options.chunk_states_interval = 4;
  EXPECT_EQ(kda_chunked_backward(KdaDtype::kBFloat16, in.q.data_ptr(), in.k.data_ptr(), in.v.data_ptr(),
                                 in.g.data_ptr<float>(), in.beta.data_ptr(), nullptr, d_o16.data_ptr(), nullptr,
                                 grads[0].data_ptr(), grads[1].data_ptr(), grads[2].data_ptr(),
                                 grads[3].data_ptr<float>(), dbeta.data_ptr<float>(), nullptr, 1, 40, 2, 128, 128,
                                 static_cast<float>(in.scale), fourth.chunk_states.data_ptr(), nullptr, 0, nullptr,
                                 backward_options),
            cudaErrorInvalidValue);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
}

// Pass 3 by fused 64-token blocks (KdaBackwardOptions::pass3_block_tokens = 64,
// kda_block64_gradient.cuh; passes 1 and 2 store every fourth chunk's state and state gradient)
// against fp64 autograd: blocks of one token, of one to four sub-chunks, partly filled ones, exactly
// full ones, many blocks (2000 tokens: 31 and a quarter), with random gates, g = -5 (the factors
// e^{B_a - B_b} down to e^{-240}) and g = 0; and within bf16 rounding of the 32-token pass.
TEST_F(KdaKernel, BackwardBySixtyFourTokenBlocksMatches) {
  for (const Gates gates : {Gates::kRandom, Gates::kSaturated, Gates::kOne}) {
    for (int64_t length : {1, 15, 16, 17, 31, 33, 47, 49, 63, 64, 65, 100, 129, 2000}) {
      if (gates == Gates::kOne && length < 32) continue;
      const Inputs in = make_inputs(2, length, 2, 128, 128, at::kBFloat16, gates, true, 1600 + length);
      const auto [d_o, d_final] = output_gradients(in, /*with_final=*/true, 1700 + length);
      const char* gate_names[] = {"", " g = -5", " g = 0"};
      const std::string name = shape_name(2, length, 2, 128, 128, at::kBFloat16) + gate_names[static_cast<int>(gates)];
      const Gradients fused = kernel_gradients(in, d_o, d_final, true, true, /*pass3_block_tokens=*/64);
      expect_gradients(name + " 64-token blocks", fused, reference_gradients(in, d_o, d_final));
      expect_gradients(name + " 64-token blocks against 32", fused,
                       kernel_gradients(in, d_o, d_final, true, true, /*pass3_block_tokens=*/32));
      // The default takes them (V' and dVb are at hand): the same bits.
      const Gradients by_default = kernel_gradients(in, d_o, d_final);
      for (const auto& [what, x, y] : {std::tuple<const char*, at::Tensor, at::Tensor>{"dq", fused.dq, by_default.dq},
                                       {"dk", fused.dk, by_default.dk}, {"dv", fused.dv, by_default.dv},
                                       {"dg", fused.dg, by_default.dg}, {"dbeta", fused.dbeta, by_default.dbeta}}) {
        EXPECT_TRUE(at::equal(x, y)) << name << ": " << what << " by default";
      }
      // Its copies by a producer warp: the same arithmetic, the same bits.
      const Gradients producer = kernel_gradients(in, d_o, d_final, true, true, 64, /*pass3_block_producer=*/true);
      const auto same = [&](const char* what, const at::Tensor& x, const at::Tensor& y) {
        if (x.defined()) EXPECT_TRUE(at::equal(x, y)) << name << ": " << what << " with the producer warp";
      };
      same("dq", fused.dq, producer.dq), same("dk", fused.dk, producer.dk), same("dv", fused.dv, producer.dv);
      same("dg", fused.dg, producer.dg), same("dbeta", fused.dbeta, producer.dbeta);
    }
  }
}

// States and V' kept by a training step's forward at every fourth chunk feed the 64-token pass: the
// same gradients bit for bit as its recompute (the whole-head walk, partly filled last blocks, and
// at 4133 tokens of one sequence the context-parallel forward and reverse walk). Misuse is refused by
// name: 64-token blocks without V' and dVb, and block sizes other than 32 and 64.
TEST_F(KdaKernel, KeptStatesFeedTheSixtyFourTokenPassBitForBit) {
  for (const int64_t length : {17, 65, 100, 4133}) {
    const int64_t batch = length == 4133 ? 1 : 2;
    const Inputs in = make_inputs(batch, length, 2, 128, 128, at::kBFloat16, Gates::kRandom, true, 1800 + length);
    const std::string name = shape_name(batch, length, 2, 128, 128, at::kBFloat16);
    const KdaChunkedOutput kept = kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale, at::Tensor(), 0,
                                              true, true, 0, /*keep_chunk_states=*/true, 4, /*keep_new_values=*/true);
    const auto [d_o, d_final] = output_gradients(in, /*with_final=*/true, 1900 + length);
    const KdaChunkedGradients recomputed =
        kda_chunked_backward(in.q, in.k, in.v, in.g, in.beta, in.state, d_o, d_final, in.scale, at::Tensor(), true,
                             true, at::Tensor(), 64);
    const KdaChunkedGradients from_kept =
        kda_chunked_backward(in.q, in.k, in.v, in.g, in.beta, in.state, d_o, d_final, in.scale, kept.chunk_states,
                             true, false, kept.new_values, 64);
    const auto r = by_name(recomputed), k = by_name(from_kept);
    for (size_t x = 0; x < r.size(); ++x) {
      EXPECT_TRUE(at::equal(r[x].second, k[x].second))
          << name << ": " << r[x].first << " from the kept states, max diff " << max_error(r[x].second, k[x].second);
    }
  }
  const Inputs in = make_inputs(1, 40, 2, 128, 128, at::kBFloat16, Gates::kRandom, false, 2000);
  const auto [d_o, d_final] = output_gradients(in, /*with_final=*/false, 2001);
  refused([&] { kda_chunked_backward(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), d_o, d_final, in.scale,
                                     at::Tensor(), true, /*keep_values=*/false, at::Tensor(), 64); },
          "pass3_block_tokens = 64 reads V' and dVb");
  refused([&] { kda_chunked_backward(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), d_o, d_final, in.scale,
                                     at::Tensor(), true, true, at::Tensor(), 48); },
          "pass3_block_tokens must be 0");
  // The launcher: 64-token blocks without V' and dVb are cudaErrorInvalidValue before anything runs.
  at::Tensor grads = at::empty({4, 1, 40, 2, 128}, in.g.options()), dbeta = at::empty({1, 40, 2}, in.g.options());
  const at::Tensor d_o16 = d_o.to(at::kBFloat16).contiguous();
  KdaBackwardOptions options;
  options.keep_values = false;
  options.pass3_block_tokens = 64;
  EXPECT_EQ(kda_chunked_backward(KdaDtype::kBFloat16, in.q.data_ptr(), in.k.data_ptr(), in.v.data_ptr(),
                                 in.g.data_ptr<float>(), in.beta.data_ptr(), nullptr, d_o16.data_ptr(), nullptr,
                                 grads[0].data_ptr(), grads[1].data_ptr(), grads[2].data_ptr(),
                                 grads[3].data_ptr<float>(), dbeta.data_ptr<float>(), nullptr, 1, 40, 2, 128, 128,
                                 static_cast<float>(in.scale), nullptr, nullptr, 0, nullptr, options),
            cudaErrorInvalidValue);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
}

// KdaBackwardOptions::pass3_block_tokens = 0 (the default) takes 64-token blocks where V' and dVb
// are at hand and 32-token ones where they are not (V' recomputed in pass 3, or states given
// without V'): the same bits as asking for each, and the workspace of each.
TEST_F(KdaKernel, TheDefaultBlockIsSixtyFourTokensWhereVPrimeIsAtHand) {
  for (const int64_t length : {33, 100, 2000}) {
    const Inputs in = make_inputs(2, length, 2, 128, 128, at::kBFloat16, Gates::kRandom, true, 2100 + length);
    const auto [d_o, d_final] = output_gradients(in, /*with_final=*/true, 2200 + length);
    const std::string name = shape_name(2, length, 2, 128, 128, at::kBFloat16);
    for (const bool keep_values : {true, false}) {
      const Gradients by_default = kernel_gradients(in, d_o, d_final, true, keep_values);
      const Gradients asked = kernel_gradients(in, d_o, d_final, true, keep_values, keep_values ? 64 : 32);
      const Gradients other = kernel_gradients(in, d_o, d_final, true, true, keep_values ? 32 : 64);
      for (const auto& [what, x, y, z] :
           {std::tuple<const char*, at::Tensor, at::Tensor, at::Tensor>{"dq", by_default.dq, asked.dq, other.dq},
            {"dk", by_default.dk, asked.dk, other.dk}, {"dg", by_default.dg, asked.dg, other.dg}}) {
        EXPECT_TRUE(at::equal(x, y)) << name << ": " << what << (keep_values ? " with V' kept" : " without V'");
        EXPECT_FALSE(at::equal(x, z)) << name << ": " << what << ", the other block size gives other roundings";
      }
    }
    KdaBackwardOptions by_default, blocks32, blocks64, without;
    blocks32.pass3_block_tokens = 32, blocks64.pass3_block_tokens = 64, without.keep_values = false;
    const auto bytes = [&](const KdaBackwardOptions& options) {
      return kda_chunked_backward_workspace_bytes(KdaDtype::kBFloat16, 2, length, 2, 128, 128, false, options);
    };
    EXPECT_EQ(bytes(by_default), bytes(blocks64)) << name;
    EXPECT_LT(bytes(blocks64), bytes(blocks32)) << name << ": dS' of one chunk in four";
    blocks32.keep_values = false;
    EXPECT_EQ(bytes(without), bytes(blocks32)) << name;
  }
}

TEST_F(KdaKernel, BackwardOfAnEmptySequencePassesTheStateGradientThrough) {
  const Inputs in = make_inputs(2, 0, 2, 64, 64, at::kBFloat16, Gates::kRandom, true, 1);
  const auto [d_o, d_final] = output_gradients(in, /*with_final=*/true, 2);
  const KdaChunkedGradients d =
      kda_chunked_backward(in.q, in.k, in.v, in.g, in.beta, in.state, d_o, d_final, in.scale);
  EXPECT_EQ(d.dq.size(1), 0);
  EXPECT_EQ(max_error(d.d_initial_state, d_final), 0.0);
}

// f() throws a c10::Error whose message contains `text` (printed).
template <typename F>
void expect_error(const std::string& what, F&& f, const std::string& text) {
  try {
    f();
    ADD_FAILURE() << what << ": no error";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    std::printf("  %s: %s\n", what.c_str(), message.c_str());
    EXPECT_NE(message.find(text), std::string::npos) << what << ": " << message;
  }
}

TEST_F(KdaKernel, LaunchersAndBindingsRejectUnsupportedSizes) {
  // Launchers: cudaErrorInvalidValue before anything is read (every pointer is null here).
  const HeadShape unsupported[] = {{96, 128}, {48, 32}, {32, 48}, {16, 16}, {32, 16}, {256, 64}};
  for (const auto& [key, value] : unsupported) {
    const std::string name = "K" + std::to_string(key) + " V" + std::to_string(value);
    EXPECT_EQ(kda_chunked_forward(KdaDtype::kBFloat16, nullptr, nullptr, nullptr, nullptr, nullptr,
                                  nullptr, nullptr, nullptr, nullptr, /*batch=*/1, /*length=*/16,
                                  /*heads=*/1, key, value, 1.0f, nullptr),
              cudaErrorInvalidValue)
        << name;
    EXPECT_EQ(kda_chunked_forward_workspace_bytes(KdaDtype::kBFloat16, false, 1, 8192, 1, key, value, {}), 0u) << name;
    EXPECT_EQ(kda_chunked_backward(KdaDtype::kBFloat16, nullptr, nullptr, nullptr, nullptr, nullptr,
                                   nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                   nullptr, nullptr, /*batch=*/1, /*length=*/16, /*heads=*/1, key,
                                   value, 1.0f, /*chunk_states=*/nullptr, nullptr, 0, nullptr),
              cudaErrorInvalidValue)
        << name;
  }
  for (const auto& [key, value] : {HeadShape{48, 32}, HeadShape{16, 32}, HeadShape{32, 16},
                                   HeadShape{32, 48}}) {
    EXPECT_EQ(kda_decode_step(KdaDtype::kBFloat16, nullptr, nullptr, nullptr, nullptr, nullptr,
                              nullptr, nullptr, /*batch=*/1, /*heads=*/1, key, value, 1.0f,
                              nullptr),
              cudaErrorInvalidValue)
        << "decode K" << key << " V" << value;
  }
  for (const auto& [key, value] : kMainAndTinyShapes) {
    EXPECT_EQ(kda_chunked_backward(KdaDtype::kBFloat16, nullptr, nullptr, nullptr, nullptr, nullptr,
                                   nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                   nullptr, nullptr, /*batch=*/1, /*length=*/16, /*heads=*/1, key,
                                   value, 1.0f, /*chunk_states=*/nullptr, nullptr, 0, nullptr),
              cudaErrorInvalidValue)
        << "null inputs, K" << key << " V" << value;
  }

  // Bindings: not supported (kda::chunked / kda::step take the reference), and a direct call
  // names the widths it got and what it takes.
  for (const auto& [key, value] : {HeadShape{48, 32}, HeadShape{32, 16}}) {
    const Inputs in = make_inputs(1, 20, 2, key, value, at::kBFloat16, Gates::kRandom, true, 3);
    const std::string widths = "got K = " + std::to_string(key) + ", V = " + std::to_string(value);
    EXPECT_FALSE(kda_chunked_supported(in.q, in.k, in.v, in.g, in.beta, in.state, 16)) << widths;
    expect_error("kda_chunked " + widths,
                 [&] { kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.state, in.scale); },
                 "K and V must be 32, 64 or 128, " + widths);
    expect_error("kda_chunked_backward " + widths,
                 [&] {
                   kda_chunked_backward(in.q, in.k, in.v, in.g, in.beta, in.state,
                                        at::zeros_like(in.v), at::Tensor(), in.scale);
                 },
                 "K and V must be 32, 64 or 128, " + widths);
    at::Tensor state = in.state.clone();
    auto first = [](const at::Tensor& t) { return t.select(1, 0); };
    EXPECT_FALSE(kda_step_supported(first(in.q), first(in.k), first(in.v), first(in.g),
                                    first(in.beta), state))
        << widths;
    expect_error("kda_step " + widths,
                 [&] {
                   kda_step(first(in.q), first(in.k), first(in.v), first(in.g), first(in.beta),
                            state, in.scale);
                 },
                 "K must be 32, 64 or 128 and V a multiple of 32 up to 256, " + widths);
  }
  const Inputs tiny = make_inputs(1, 20, 2, 32, 32, at::kBFloat16, Gates::kRandom, true, 4);
  EXPECT_TRUE(kda_chunked_supported(tiny.q, tiny.k, tiny.v, tiny.g, tiny.beta, tiny.state, 16));
}

TEST_F(KdaKernel, AutogradFunctionMatchesTheReferenceThroughAnInitialState) {
  // kda_chunked_autograd in a graph: the initial state itself comes from ops that require grad,
  // and only final_state reaches the loss through one path, o through another.
  const Inputs in = make_inputs(2, 45, 2, 128, 128, at::kFloat, Gates::kRandom, true, 77);
  auto run = [&](bool kernel) {
    const auto dtype = kernel ? at::kFloat : at::kDouble;
    auto leaf = [&](const at::Tensor& t) { return t.to(dtype).detach().requires_grad_(true); };
    const at::Tensor q = leaf(in.q), k = leaf(in.k), v = leaf(in.v), g = leaf(in.g),
                     beta = leaf(in.beta), s0 = leaf(in.state);
    const at::Tensor state = s0 * 2.0;
    const kda::Output out = kernel ? [&] {
      const KdaChunkedOutput r = kda_chunked_autograd(q, k, v, g, beta, state, in.scale);
      return kda::Output{r.o, r.final_state};
    }()
                                   : kda::chunked_reference(q, k, v, g, beta, state, in.scale);
    const at::Tensor loss = out.o.pow(2).sum() + out.final_state.sin().sum();
    loss.backward();
    return Gradients{q.grad(), k.grad(), v.grad(), g.grad(), beta.grad(), s0.grad()};
  };
  expect_gradients("autograd function vs fp64 reference", run(true), run(false));
}

TEST_F(KdaKernel, AutogradFunctionWorksWithoutAnInitialStateAndWithFewInputsNeedingGrad) {
  // No initial state, and only q and g require grad: the other gradients are not asked for.
  const Inputs in = make_inputs(1, 37, 2, 64, 64, at::kFloat, Gates::kRandom, false, 78);
  auto run = [&](bool kernel) {
    const auto dtype = kernel ? at::kFloat : at::kDouble;
    const at::Tensor q = in.q.to(dtype).detach().requires_grad_(true);
    const at::Tensor g = in.g.to(dtype).detach().requires_grad_(true);
    const at::Tensor k = in.k.to(dtype), v = in.v.to(dtype), beta = in.beta.to(dtype);
    const at::Tensor o = kernel ? kda_chunked_autograd(q, k, v, g, beta, at::Tensor(), in.scale).o
                                : kda::chunked_reference(q, k, v, g, beta, at::Tensor(), in.scale).o;
    o.pow(2).sum().backward();
    EXPECT_FALSE(k.grad().defined());
    return std::make_pair(q.grad().to(at::kDouble), g.grad().to(at::kDouble));
  };
  const auto [dq, dg] = run(true);
  const auto [dq_ref, dg_ref] = run(false);
  for (const auto& [name, got, expected] :
       {std::tuple{"dq", dq, dq_ref}, std::tuple{"dg", dg, dg_ref}}) {
    const double error = max_error(got, expected), magnitude = max_abs(expected);
    std::printf("  %-3s max|d - ref| %.3e (|ref| <= %.3e)\n", name, error, magnitude);
    EXPECT_LE(error, kGradientTolerance * std::max(1e-6, magnitude)) << name;
  }
}

TEST_F(KdaKernel, AutogradKeepingTheChunkStatesGivesTheSameGradients) {
  // kda_chunked_autograd with keep_chunk_states: the forward keeps the states, the backward skips
  // their recompute; outputs and every gradient bit for bit those of the recomputing function.
  const Inputs in = make_inputs(2, 70, 2, 128, 128, at::kBFloat16, Gates::kRandom, true, 79);
  auto run = [&](bool keep) {
    auto leaf = [](const at::Tensor& t) { return t.detach().clone().requires_grad_(true); };
    const at::Tensor q = leaf(in.q), k = leaf(in.k), v = leaf(in.v), g = leaf(in.g), beta = leaf(in.beta),
                     s0 = leaf(in.state);
    const KdaChunkedOutput r = kda_chunked_autograd(q, k, v, g, beta, s0, in.scale, keep);
    (r.o.to(at::kFloat).pow(2).sum() + r.final_state.sin().sum()).backward();
    return std::make_pair(r.o.detach(), Gradients{q.grad(), k.grad(), v.grad(), g.grad(), beta.grad(), s0.grad()});
  };
  const auto [o, recomputed] = run(false);
  const auto [o_kept, kept] = run(true);
  EXPECT_TRUE(at::equal(o, o_kept)) << "o";
  for (const auto& [what, a, b] :
       {std::tuple{"dq", kept.dq, recomputed.dq}, std::tuple{"dk", kept.dk, recomputed.dk},
        std::tuple{"dv", kept.dv, recomputed.dv}, std::tuple{"dg", kept.dg, recomputed.dg},
        std::tuple{"dbeta", kept.dbeta, recomputed.dbeta}, std::tuple{"dS0", kept.d_state, recomputed.d_state}}) {
    ASSERT_TRUE(a.defined() && b.defined()) << what;
    EXPECT_TRUE(at::equal(a, b)) << what << " max diff " << max_error(a, b);
  }
}

TEST_F(KdaKernel, ModelChunkedInsideTheKeepGuardGivesTheSameGradients) {
  // kda::chunked inside model::kda::KeepChunkStatesGuard (the learner's recompute pass) records
  // the kernels with their chunk states kept; outputs and gradients are bit for bit those without.
  const Inputs in = make_inputs(1, 80, 2, 64, 64, at::kBFloat16, Gates::kRandom, true, 81);
  auto run = [&](bool keep) {
    auto leaf = [](const at::Tensor& t) { return t.detach().clone().requires_grad_(true); };
    const at::Tensor q = leaf(in.q), k = leaf(in.k), g = leaf(in.g), s0 = leaf(in.state);
    const kda::KeepChunkStatesGuard guard(keep);
    const kda::Output out = kda::chunked(q, k, in.v, g, in.beta, s0, in.scale);
    (out.o.to(at::kFloat).pow(2).sum() + out.final_state.sum()).backward();
    return std::vector<at::Tensor>{out.o.detach(), q.grad(), k.grad(), g.grad(), s0.grad()};
  };
  const std::vector<at::Tensor> plain = run(false), kept = run(true);
  const char* names[] = {"o", "dq", "dk", "dg", "dS0"};
  for (size_t i = 0; i < plain.size(); ++i) {
    ASSERT_TRUE(plain[i].defined() && kept[i].defined()) << names[i];
    EXPECT_TRUE(at::equal(plain[i], kept[i])) << names[i] << " max diff " << max_error(plain[i], kept[i]);
  }
}

TEST_F(KdaKernel, ModelChunkedAtMediumPrecisionRunsTheBf16KernelsOnRoundedInputs) {
  // model/precision.h: at medium, kda::chunked on fp32 CUDA inputs is the kernels on bf16 copies
  // of q, k, v, beta: o and every gradient bit for bit those of the bf16 call (cast to fp32), and
  // the fp32 inputs' gradients arrive through the casts. At highest it is the fp32 kernels.
  for (const int64_t width : {int64_t{128}, int64_t{64}}) {
    const Inputs in = make_inputs(2, 100, 2, width, width, at::kFloat, Gates::kRandom, true, 83);
    auto leaf = [](const at::Tensor& t, at::ScalarType dtype) {
      return t.detach().to(dtype).clone().requires_grad_(true);
    };
    auto run = [&](at::ScalarType dtype, model::Float32MatmulPrecision precision) {
      const model::Float32MatmulPrecisionScope scope(precision);
      const at::Tensor q = leaf(in.q, dtype), k = leaf(in.k, dtype), v = leaf(in.v, dtype);
      const at::Tensor beta = leaf(in.beta, dtype), g = leaf(in.g, at::kFloat), s0 = leaf(in.state, at::kFloat);
      const kda::Output out = kda::chunked(q, k, v, g, beta, s0, in.scale);
      EXPECT_EQ(out.o.scalar_type(), dtype);
      (out.o.to(at::kFloat).pow(2).sum() + out.final_state.sum()).backward();
      std::vector<at::Tensor> r{out.o.detach(), out.final_state.detach()};
      for (const at::Tensor* t : {&q, &k, &v, &beta, &g, &s0}) {
        EXPECT_EQ(t->grad().scalar_type(), dtype == at::kFloat || t == &g || t == &s0 ? at::kFloat : dtype);
        r.push_back(t->grad().to(at::kFloat));
      }
      r[0] = r[0].to(at::kFloat);
      return r;
    };
    const auto medium = run(at::kFloat, model::Float32MatmulPrecision::kMedium);
    const auto bf16 = run(at::kBFloat16, model::Float32MatmulPrecision::kHighest);
    const auto highest = run(at::kFloat, model::Float32MatmulPrecision::kHighest);
    const char* names[] = {"o", "final state", "dq", "dk", "dv", "dbeta", "dg", "dS0"};
    double moved = 0;
    for (size_t i = 0; i < medium.size(); ++i) {
      EXPECT_TRUE(at::equal(medium[i], bf16[i])) << "K = V = " << width << ": " << names[i] << " max diff "
                                                 << max_error(medium[i], bf16[i]);
      const double error = max_error(medium[i], highest[i]), magnitude = max_abs(highest[i]);
      std::printf("  K = V = %3lld %-11s medium against highest: %.3e of %.3e\n", static_cast<long long>(width),
                  names[i], error, magnitude);
      EXPECT_LE(error, kGradientTolerance * std::max(1e-6, magnitude)) << names[i];
      moved = std::max(moved, error);
    }
    EXPECT_GT(moved, 0.0) << "medium should round q, k, v and beta; nothing changed";
  }
}

TEST_F(KdaKernel, LayerParametersGetTheReferenceGradientsThroughTheKernels) {
  // Head widths 64 and 32 (the tiny model's layer: 2 heads of K = V = 32), at each float32 matmul
  // precision the learner may set (model/precision.h: TF32 projections; bf16 kernels).
  for (const auto precision : {model::Float32MatmulPrecision::kHighest, model::Float32MatmulPrecision::kHigh,
                               model::Float32MatmulPrecision::kMedium})
  for (int64_t width : {64, 32}) {
    const model::Float32MatmulPrecisionScope scope(precision);
    std::printf("  precision %s\n", model::float32_matmul_precision_name(precision));
    model::IncrementalAttentionOptions options;
    options.hidden = 96;
    options.heads = 2;
    options.head_k_dim = width;
    options.head_v_dim = width;
    options.decay_rank = 16;
    std::printf("  K = V = %lld\n", static_cast<long long>(width));
    at::manual_seed(81);
    model::IncrementalAttention layer(options);
    layer->to(at::kCUDA);
    const at::Tensor x = at::randn({2, 70, options.hidden}, at::TensorOptions().device(at::kCUDA));
    const at::Tensor weight = at::randn({2, 70, options.hidden}, x.options());

    // fp32 on CUDA: kda::chunked takes the kernels (forward + backward kernel).
    (layer->forward(x) * weight).sum().backward();
    std::vector<std::pair<std::string, at::Tensor>> kernel_grads;
    for (const auto& p : layer->named_parameters()) {
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      kernel_grads.emplace_back(p.key(), p.value().grad().to(at::kDouble));
    }
    // fp64 on CUDA: kda::chunked is the reference (the kernels take bf16 / fp32 only).
    layer->zero_grad();
    layer->to(at::kDouble);
    (layer->forward(x.to(at::kDouble)) * weight.to(at::kDouble)).sum().backward();
    size_t i = 0;
    for (const auto& p : layer->named_parameters()) {
      const auto& [name, got] = kernel_grads[i++];
      ASSERT_EQ(name, p.key());
      const at::Tensor expected = p.value().grad();
      const double error = max_error(got, expected), magnitude = max_abs(expected);
      std::printf("    %-16s max|grad - ref| %.3e (|ref| <= %.3e)\n", name.c_str(), error,
                  magnitude);
      EXPECT_LE(error, kGradientTolerance * std::max(1e-6, magnitude)) << "K = V = " << width
                                                                      << ": " << name;
    }
  }
}

}  // namespace
}  // namespace odyssey::kernels
