// The learner's chunked forms against the whole-sequence policy, in fp64: logits chunk by chunk
// with the state carried equal Policy::forward's, and the gradient of a loss over every position
// computed chunk by chunk (with and without recomputation) equals the full-sequence gradient.
#include <cmath>
#include <cstdio>
#include <map>
#include <utility>
#include <vector>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/types.h>

#include "learner/chunked_policy.h"
#include "model/config.h"
#include "model/kda.h"
#include "model/policy.h"

namespace odyssey::learner {
namespace {

model::Policy tiny_fp64(uint64_t seed) {
  auto config = model::load_model_config({std::string(ODYSSEY_SOURCE_DIR) + "/configs/model/tiny.toml"});
  EXPECT_TRUE(config.ok()) << config.status().message();
  at::manual_seed(seed);
  model::Policy policy(*config);
  policy->to(at::kDouble);
  // Non-zero mix vectors, so every attention-residual path carries signal and gradient.
  const at::NoGradGuard no_grad;
  for (auto& p : policy->named_parameters())
    if (p.key().find("_mix") != std::string::npos) p.value().normal_(0, 0.5);
  return policy;
}

std::map<std::string, at::Tensor> gradients(model::Policy& policy) {
  std::map<std::string, at::Tensor> out;
  for (auto& p : policy->named_parameters())
    if (p.value().grad().defined()) out[p.key()] = p.value().grad().clone();
  return out;
}

void zero_grads(model::Policy& policy) {
  for (auto& p : policy->parameters()) p.mutable_grad() = at::Tensor();
}

// Largest |a - b| over all parameters, relative to the largest |a|; both must name the same set.
double max_relative_difference(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0, scale = 0;
  for (const auto& [name, ga] : a) {
    auto it = b.find(name);
    if (it == b.end()) {
      ADD_FAILURE() << name << " has no gradient in the chunked run";
      continue;
    }
    diff = std::max(diff, (ga - it->second).abs().max().item<double>());
    scale = std::max(scale, ga.abs().max().item<double>());
  }
  return diff / std::max(scale, 1e-300);
}

TEST(ChunkedPolicy, LogitsChunkByChunkEqualTheWholeSequenceForward) {
  model::Policy policy = tiny_fp64(11);
  ChunkedPolicy runner(policy);
  const at::Tensor tokens = at::randint(0, 256, {2, 70}, at::kLong);
  const at::NoGradGuard no_grad;
  const at::Tensor full = policy->forward(tokens);
  for (int64_t chunk : {16, 23, 70}) {
    std::vector<at::Tensor> pieces;
    chunked_forward(runner, 2, 70, chunk, [&](int64_t s, int64_t n) { return tokens.narrow(1, s, n); },
                    [&](const ChunkView& v) { pieces.push_back(v.output->logits); });
    const double diff = (at::cat(pieces, 1) - full).abs().max().item<double>();
    std::printf("chunk %ld: max |chunked - full| = %.3g\n", static_cast<long>(chunk), diff);
    EXPECT_LT(diff, 1e-10) << "chunk " << chunk;
  }
}

TEST(ChunkedBackward, GradientChunkByChunkEqualsTheFullSequenceGradient) {
  model::Policy policy = tiny_fp64(12);
  ChunkedPolicy runner(policy);
  const int64_t B = 2, T = 40, V = policy->config().vocab_size;
  const at::Tensor tokens = at::randint(0, 256, {B, T}, at::kLong);
  const at::Tensor weights = at::randn({B, T, V}, at::kDouble);  // a loss that reads every position

  zero_grads(policy);
  (policy->forward(tokens) * weights).sum().backward();
  const auto reference = gradients(policy);

  for (const auto& [recompute, chunk] : std::vector<std::pair<bool, int64_t>>{{true, 16}, {true, 13}, {false, 16}}) {
    {
      zero_grads(policy);
      ChunkCallbacks cb;
      cb.tokens = [&](int64_t s, int64_t n) { return tokens.narrow(1, s, n); };
      cb.loss = [&](const ChunkView& v) { return (v.output->logits * weights.narrow(1, v.start, v.length)).sum(); };
      chunked_backward(runner, B, T, ChunkedBackwardOptions{chunk, recompute}, cb);
      const double diff = max_relative_difference(reference, gradients(policy));
      std::printf("recompute %d chunk %ld: max relative gradient difference %.3g\n", recompute,
                  static_cast<long>(chunk), diff);
      EXPECT_LT(diff, 1e-9) << "recompute " << recompute << " chunk " << chunk;
    }
  }
}

TEST(ChunkedBackward, RecomputeObservesEveryChunkInOrderBeforeAnyLossAndRunsTheLastChunkOnce) {
  // The callbacks' contract (learner/chunked_policy.h) with recompute over C chunks: observe once
  // per chunk, in order, each with the chunk's logits; every loss after the last observe, in
  // reverse chunk order; and 2C - 1 chunk forwards (tokens is asked once a forward): pass 1 does
  // not run the last chunk, whose one forward in pass 2 serves its observe and its loss.
  model::Policy policy = tiny_fp64(15);
  ChunkedPolicy runner(policy);
  const int64_t B = 2, T = 45, chunk = 16, chunks = 3;
  const at::Tensor tokens = at::randint(0, 256, {B, T}, at::kLong);
  at::Tensor full;
  {
    const at::NoGradGuard no_grad;
    full = policy->forward(tokens);
  }
  std::vector<std::string> calls;
  int64_t forwards = 0;
  ChunkCallbacks cb;
  cb.tokens = [&](int64_t s, int64_t n) {
    ++forwards;
    return tokens.narrow(1, s, n);
  };
  cb.observe = [&](const ChunkView& v) {
    calls.push_back("observe " + std::to_string(v.index));
    const double diff = (v.output->logits.detach() - full.narrow(1, v.start, v.length)).abs().max().item<double>();
    EXPECT_LT(diff, 1e-10) << "chunk " << v.index << "'s observed logits";
  };
  cb.loss = [&](const ChunkView& v) {
    calls.push_back("loss " + std::to_string(v.index));
    return v.output->logits.sum();
  };
  zero_grads(policy);
  chunked_backward(runner, B, T, ChunkedBackwardOptions{chunk, true}, cb);
  EXPECT_EQ(calls, (std::vector<std::string>{"observe 0", "observe 1", "observe 2", "loss 2", "loss 1", "loss 0"}));
  EXPECT_EQ(forwards, 2 * chunks - 1);
}

TEST(ChunkedBackward, KdaChunkStatesAreKeptOnlyWhileAChunksBackwardFollows) {
  // model::kda::keep_chunk_states() as each chunk's loss sees it (the loss runs right after the
  // chunk's forward, in the same scope): set in the recompute pass (each chunk's backward follows at
  // once) and for a single chunk, never for a graph over several chunks (held to the end), and
  // never when keep_kda_chunk_states is off. The CUDA kernels read it (model/kda.h); on the CPU it
  // changes nothing else.
  model::Policy policy = tiny_fp64(14);
  ChunkedPolicy runner(policy);
  const int64_t B = 1, T = 40;
  const at::Tensor tokens = at::randint(0, 256, {B, T}, at::kLong);
  struct Case {
    bool recompute;
    int64_t chunk;
    bool keep, expected;
  };
  for (const Case& c : {Case{true, 16, true, true}, Case{true, 40, true, true}, Case{false, 16, true, false},
                        Case{true, 16, false, false}}) {
    std::vector<bool> seen;
    ChunkCallbacks cb;
    cb.tokens = [&](int64_t s, int64_t n) { return tokens.narrow(1, s, n); };
    cb.loss = [&](const ChunkView& v) {
      seen.push_back(model::kda::keep_chunk_states());
      return v.output->logits.sum();
    };
    ChunkedBackwardOptions options{c.chunk, c.recompute};
    options.keep_kda_chunk_states = c.keep;
    zero_grads(policy);
    chunked_backward(runner, B, T, options, cb);
    ASSERT_FALSE(seen.empty());
    for (bool kept : seen) EXPECT_EQ(kept, c.expected) << "recompute " << c.recompute << " chunk " << c.chunk << " keep " << c.keep;
    EXPECT_FALSE(model::kda::keep_chunk_states()) << "left set after chunked_backward";
  }
}

TEST(ChunkedBackward, CuttingTheGradientAtChunkBoundariesWouldChangeIt) {
  // The check above could not fail if nothing crossed the chunk boundaries: truncated
  // backpropagation (each chunk alone, incoming state detached) gives a visibly different gradient.
  model::Policy policy = tiny_fp64(13);
  ChunkedPolicy runner(policy);
  const int64_t B = 1, T = 48, V = policy->config().vocab_size;
  const at::Tensor tokens = at::randint(0, 256, {B, T}, at::kLong);
  const at::Tensor weights = at::randn({B, T, V}, at::kDouble);
  zero_grads(policy);
  (policy->forward(tokens) * weights).sum().backward();
  const auto reference = gradients(policy);

  zero_grads(policy);
  CarriedState state = runner.initial_state(B);
  for (int64_t s = 0; s < T; s += 16) {
    for (auto& k : state.kda) {
      if (!k.recurrent.defined()) continue;
      k.recurrent = k.recurrent.detach();
      k.q_conv_inputs = k.q_conv_inputs.detach();
      k.k_conv_inputs = k.k_conv_inputs.detach();
      k.v_conv_inputs = k.v_conv_inputs.detach();
    }
    for (auto& h : state.mla)
      if (h.defined()) h = h.detach();
    const ChunkOutput out = runner.forward_chunk(tokens.narrow(1, s, 16), state);
    (out.logits * weights.narrow(1, s, 16)).sum().backward();
  }
  const double diff = max_relative_difference(reference, gradients(policy));
  std::printf("truncated at chunk boundaries: max relative gradient difference %.3g\n", diff);
  EXPECT_GT(diff, 1e-4);
}

}  // namespace
}  // namespace odyssey::learner
