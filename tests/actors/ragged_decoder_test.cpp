// Continuous batching over ragged sequences gives each sequence exactly what decoding it alone
// with the Policy's own forms gives (fp64), whatever joins or leaves the batch around it.
#include "actors/ragged_decoder.h"

#include <algorithm>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include "actors/sampling.h"
#include "model/config.h"

namespace odyssey::actors {
namespace {

model::ModelConfig tiny_config() {
  auto config = model::load_model_config({std::string(ODYSSEY_SOURCE_DIR) + "/configs/model/tiny.toml"});
  EXPECT_TRUE(config.ok()) << config.status().message();
  return config.ok() ? *config : model::ModelConfig{};
}

// The tiny policy in fp64 with mixes and norms moved off their initial values, so every part
// of the math matters.
model::Policy tiny_policy_fp64(const model::ModelConfig& config, uint64_t seed) {
  at::manual_seed(static_cast<int64_t>(seed));
  model::Policy policy(config);
  policy->to(at::kDouble);
  c10::NoGradGuard no_grad;
  for (auto& item : policy->named_parameters()) {
    const std::string& name = item.key();
    at::Tensor p = item.value();
    if (name.size() >= 3 && name.compare(name.size() - 3, 3, "mix") == 0) p.copy_(at::randn(p.sizes(), p.options()) * 0.5);
    if (name.find("norm.weight") != std::string::npos) p.add_(at::randn(p.sizes(), p.options()) * 0.1);
  }
  return policy;
}

std::vector<uint32_t> random_tokens(size_t n, uint32_t salt) {
  std::vector<uint32_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>((i * 37 + salt * 101 + 11) % 256);
  return out;
}

// A sequence's life: chunks fed whole (prompt, observations) and decode runs of n sampled tokens
// (each fed back before the next is sampled).
struct Phase {
  std::vector<uint32_t> chunk;  // non-empty: a chunk
  int decode = 0;               // else: tokens to sample
};
struct Script {
  uint64_t id = 0;
  int start_tick = 0;  // when it joins the batch
  std::vector<Phase> phases;
};
struct Trace {
  std::vector<uint32_t> tokens;
  std::vector<float> logprobs;
  std::vector<at::Tensor> logits;  // the row each token was sampled from
  int64_t position = 0;
};

// The reference: one sequence alone through Policy::forward_chunk and Policy::step.
Trace run_alone(model::Policy& policy, const TokenSampler& sampler, const Script& script) {
  Trace trace;
  model::PolicyState state = policy->initial_state(1);
  at::Tensor logits;
  for (const Phase& phase : script.phases) {
    if (!phase.chunk.empty()) {
      const at::Tensor ids =
          at::tensor(std::vector<int64_t>(phase.chunk.begin(), phase.chunk.end()), at::kLong).view({1, -1});
      c10::NoGradGuard no_grad;
      logits = policy->forward_chunk(ids, state).select(0, 0).select(0, ids.size(1) - 1);
      trace.position += ids.size(1);
      continue;
    }
    for (int i = 0; i < phase.decode; ++i) {
      auto token = sampler.sample(logits.unsqueeze(0), {{script.id, static_cast<uint64_t>(trace.position)}});
      EXPECT_TRUE(token.ok());
      trace.tokens.push_back((*token)[0].token);
      trace.logprobs.push_back((*token)[0].logprob);
      trace.logits.push_back(logits);
      logits = policy->step(at::tensor({static_cast<int64_t>((*token)[0].token)}, at::kLong), state).select(0, 0);
      ++trace.position;
    }
  }
  return trace;
}

// The same scripts through one RaggedDecoder: every tick, sequences at a chunk prefill alone,
// then every sequence in a decode run samples and steps in one batch.
std::vector<Trace> run_batched(RaggedDecoder& decoder, const TokenSampler& sampler,
                               const std::vector<Script>& scripts, std::vector<model::PolicyState>* final_states) {
  struct Live {
    model::PolicyState state;
    size_t phase = 0;
    int done_in_phase = 0;
    at::Tensor logits;
    bool finished = false;
  };
  std::vector<Trace> traces(scripts.size());
  std::vector<Live> live(scripts.size());
  for (Live& l : live) l.state = decoder.start();
  for (int tick = 0;; ++tick) {
    bool any = false;
    std::vector<size_t> decoding;
    for (size_t s = 0; s < scripts.size(); ++s) {
      Live& l = live[s];
      if (l.finished || tick < scripts[s].start_tick) {
        any |= !l.finished;
        continue;
      }
      any = true;
      while (l.phase < scripts[s].phases.size() && !scripts[s].phases[l.phase].chunk.empty()) {
        const auto& chunk = scripts[s].phases[l.phase].chunk;
        l.logits = decoder.forward_chunk(l.state, chunk);
        traces[s].position += static_cast<int64_t>(chunk.size());
        ++l.phase;
      }
      if (l.phase == scripts[s].phases.size()) {
        l.finished = true;
        continue;
      }
      decoding.push_back(s);
    }
    if (!any) break;
    if (decoding.empty()) continue;
    std::vector<at::Tensor> rows;
    std::vector<DrawKey> keys;
    for (size_t s : decoding) {
      rows.push_back(live[s].logits);
      keys.push_back({scripts[s].id, static_cast<uint64_t>(traces[s].position)});
    }
    auto sampled = sampler.sample(at::stack(rows), keys);
    EXPECT_TRUE(sampled.ok());
    std::vector<model::PolicyState*> states;
    std::vector<uint32_t> tokens;
    for (size_t j = 0; j < decoding.size(); ++j) {
      const size_t s = decoding[j];
      traces[s].tokens.push_back((*sampled)[j].token);
      traces[s].logprobs.push_back((*sampled)[j].logprob);
      traces[s].logits.push_back(live[s].logits);
      states.push_back(&live[s].state);
      tokens.push_back((*sampled)[j].token);
    }
    const at::Tensor logits = decoder.step(states, tokens);
    for (size_t j = 0; j < decoding.size(); ++j) {
      Live& l = live[decoding[j]];
      l.logits = logits.select(0, static_cast<int64_t>(j));
      ++traces[decoding[j]].position;
      if (++l.done_in_phase == scripts[decoding[j]].phases[l.phase].decode) {
        ++l.phase;
        l.done_in_phase = 0;
      }
    }
  }
  if (final_states) {
    for (Live& l : live) final_states->push_back(l.state);
  }
  return traces;
}

TEST(RaggedDecoder, BatchedDecodingEqualsDecodingEachSequenceAloneInFp64) {
  const model::ModelConfig config = tiny_config();
  model::Policy policy = tiny_policy_fp64(config, 3);
  const TokenSampler sampler({/*temperature=*/1.0, /*top_k=*/0, /*top_p=*/1.0}, /*seed=*/77);
  // Four sequences of different lengths that join at different ticks, take observations
  // (chunks) in the middle while the others keep decoding, and leave at different times.
  const std::vector<Script> scripts = {
      {1, 0, {{random_tokens(5, 1), 0}, {{}, 12}}},
      {2, 2, {{random_tokens(17, 2), 0}, {{}, 4}, {random_tokens(9, 3), 0}, {{}, 6}}},
      {3, 5, {{random_tokens(1, 4), 0}, {{}, 9}, {random_tokens(3, 5), 0}, {{}, 3}}},
      {4, 1, {{random_tokens(40, 6), 0}, {{}, 2}}},
  };
  std::vector<model::PolicyState> states;
  RaggedDecoder decoder(policy);
  const std::vector<Trace> batched = run_batched(decoder, sampler, scripts, &states);
  double worst = 0;
  for (size_t s = 0; s < scripts.size(); ++s) {
    const Trace alone = run_alone(policy, sampler, scripts[s]);
    ASSERT_EQ(batched[s].tokens, alone.tokens) << "sequence " << scripts[s].id;
    ASSERT_EQ(batched[s].logits.size(), alone.logits.size());
    for (size_t i = 0; i < alone.logits.size(); ++i) {
      worst = std::max(worst, (batched[s].logits[i] - alone.logits[i]).abs().max().item<double>());
      EXPECT_NEAR(batched[s].logprobs[i], alone.logprobs[i], 1e-6);
    }
    // Every sequence's state holds exactly its own tokens: MLA caches grew to its length,
    // KDA states kept their constant batch-1 shape.
    for (size_t i = 0; i < states[s].mla.size(); ++i) {
      if (states[s].mla[i].latent.defined()) {
        EXPECT_EQ(states[s].mla[i].length, alone.position);
      }
      if (states[s].kda[i].recurrent.defined()) {
        EXPECT_EQ(states[s].kda[i].recurrent.size(0), 1);
      }
    }
    EXPECT_EQ(states[s].tokens, alone.position);
  }
  std::printf("max |logits batched - alone| = %.3g\n", worst);
  EXPECT_LT(worst, 1e-10);
}

TEST(RaggedDecoder, ChunksWithImagePatchesUseTheGivenEmbeddings) {
  const model::ModelConfig config = tiny_config();
  ASSERT_TRUE(config.vision.enabled);
  model::Policy policy = tiny_policy_fp64(config, 5);
  RaggedDecoder decoder(policy);
  ASSERT_TRUE(decoder.has_vision());
  const at::Tensor pixels = at::rand({3, 12, 20}, at::kDouble);
  const at::Tensor patches = decoder.image_embeddings(pixels);
  const int64_t n = decoder.image_patches(12, 20);
  ASSERT_EQ(patches.size(0), n);  // 8-pixel patches: 2 x 3
  EXPECT_EQ(n, 6);
  // <|image|> <|image_patch|> x n <|/image|> inside a chunk, against Policy::forward with the
  // same embeddings placed by the same mask.
  std::vector<uint32_t> tokens = random_tokens(4, 9);
  std::vector<uint8_t> mask(tokens.size(), 0);
  tokens.push_back(256 + 12);
  mask.push_back(0);
  for (int64_t i = 0; i < n; ++i) {
    tokens.push_back(256 + 14);
    mask.push_back(1);
  }
  tokens.push_back(256 + 13);
  mask.push_back(0);
  model::PolicyState state = decoder.start();
  const at::Tensor last = decoder.forward_chunk(state, tokens, mask, patches);
  const at::Tensor ids = at::tensor(std::vector<int64_t>(tokens.begin(), tokens.end()), at::kLong).view({1, -1});
  const at::Tensor bool_mask =
      at::tensor(at::ArrayRef<uint8_t>(mask), at::kByte).to(at::kBool).view({1, -1});
  c10::NoGradGuard no_grad;
  const at::Tensor full = policy->forward(ids, patches, bool_mask).select(0, 0);
  EXPECT_LT((last - full.select(0, full.size(0) - 1)).abs().max().item<double>(), 1e-10);
  // Without the embeddings the patch tokens are plain tokens: different logits.
  model::PolicyState plain = decoder.start();
  EXPECT_GT((decoder.forward_chunk(plain, tokens) - last).abs().max().item<double>(), 1e-6);
}

TEST(RaggedDecoder, KdaSnapshotsRoundTripBitExactAndRejectDamagedBytes) {
  const model::ModelConfig config = tiny_config();
  model::Policy policy = tiny_policy_fp64(config, 7);
  RaggedDecoder decoder(policy);
  model::PolicyState state = decoder.start();
  (void)decoder.forward_chunk(state, random_tokens(20, 3));
  model::PolicyState other = decoder.start();
  (void)decoder.step({&state, &other}, {5, 6});  // the states are now rows of a stacked batch
  const std::string bytes = kda_state_snapshot(state);
  auto parsed = parse_kda_state_snapshot(bytes);
  ASSERT_TRUE(parsed.ok()) << parsed.status().message();
  EXPECT_EQ(static_cast<int64_t>(parsed->size()), config.num_kda_layers());
  for (const auto& [layer, kda] : *parsed) {
    const model::KdaState& want = state.kda[static_cast<size_t>(layer)];
    EXPECT_TRUE(at::equal(kda.recurrent, want.recurrent.cpu())) << layer;
    EXPECT_TRUE(at::equal(kda.q_conv_inputs, want.q_conv_inputs.cpu())) << layer;
    EXPECT_TRUE(at::equal(kda.v_conv_inputs, want.v_conv_inputs.cpu())) << layer;
  }
  EXPECT_EQ(parse_kda_state_snapshot(bytes.substr(0, bytes.size() - 3)).status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(parse_kda_state_snapshot("nope").status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(parse_kda_state_snapshot(bytes + "x").status().code(), StatusCode::kCorrupt);
  std::string flipped = bytes;
  flipped[4] = 9;  // version
  EXPECT_EQ(parse_kda_state_snapshot(flipped).status().code(), StatusCode::kCorrupt);
}

}  // namespace
}  // namespace odyssey::actors
