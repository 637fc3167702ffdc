// Token sampling for rollouts: temperature, top-k, top-p (nucleus), greedy at temperature 0,
// with counter-based randomness so that a sequence's tokens depend only on (seed, sequence id,
// position) — never on which other sequences shared its batch, in what order, or how many
// tokens the process sampled before.
//
// The distribution a token is drawn from, for logits z over the vocabulary:
//   1. z / temperature (logits that are NaN or -inf are never chosen);
//   2. top-k: the k largest (ties broken by the lower token id), when 0 < k < vocab;
//   3. top-p: of those, the smallest prefix in descending-probability order whose probability
//      (renormalised over step 2's set) reaches p, when p < 1 (at least one token);
//   4. renormalised over what is left; one uniform u in [0, 1) from counter_uniform picks the
//      token by walking that order's cumulative probabilities.
// SampledToken::logprob is log q(token) under exactly that truncated, tempered distribution q:
// the BEHAVIOUR policy the learner's importance weights divide by (its own log-probs are of the
// untruncated model at temperature 1). Temperature 0 is greedy: the arg-max (lowest id among
// ties), drawn from a point mass, so logprob = 0.
//
// Thread-safety: TokenSampler is immutable after construction; every method is const and
// thread-safe. Errors: sample() is kInvalidArgument for a row with no finite logit (a broken
// model), naming the row.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/status.h"

namespace odyssey::actors {

struct SamplingOptions {
  double temperature = 1.0;  // 0 = greedy
  int64_t top_k = 0;         // 0 = every token
  double top_p = 1.0;        // in (0, 1]; 1 = every token
};

// kInvalidArgument naming the field: temperature < 0, top_k < 0, top_p outside (0, 1].
Status validate(const SamplingOptions& options);

// A uniform double in [0, 1) (53 random bits) that is a pure function of its three counters:
// the randomness of draw `position` of sequence `sequence` under `seed`.
double counter_uniform(uint64_t seed, uint64_t sequence, uint64_t position);

// Which draw a row is: its sequence id and the position of the token being sampled.
struct DrawKey {
  uint64_t sequence = 0;
  uint64_t position = 0;
};

struct SampledToken {
  uint32_t token = 0;
  float logprob = 0;  // log q(token), q the distribution sampled from (see above)
};

class TokenSampler {
 public:
  TokenSampler(SamplingOptions options, uint64_t seed);

  // One row of logits (`vocab` values).
  Result<SampledToken> sample(const double* logits, size_t vocab, DrawKey key) const;
  // logits [B, V] (any floating dtype, any device; copied to the CPU as fp64), one key per row.
  Result<std::vector<SampledToken>> sample(const at::Tensor& logits, const std::vector<DrawKey>& keys) const;

  // The distribution q of one row (probabilities over the vocabulary, 0 outside the kept
  // set; a point mass when greedy). For tests and diagnostics.
  Result<std::vector<double>> distribution(const double* logits, size_t vocab) const;

  const SamplingOptions& options() const { return options_; }
  uint64_t seed() const { return seed_; }

 private:
  // The kept tokens in sampling order with unnormalised weights, and their sum.
  struct Kept {
    std::vector<uint32_t> ids;
    std::vector<double> weights;
    double total = 0;
  };
  Result<Kept> kept(const double* logits, size_t vocab) const;

  SamplingOptions options_;
  uint64_t seed_;
};

}  // namespace odyssey::actors
