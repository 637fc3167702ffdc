// The gradient of the learner's loss over one rank's trajectories: packing into micro-batches,
// the chunked forward/backward with the state carried (learner/chunked_policy.h), the loss of
// every chunk (learner/loss.h), and the routing statistics the balancers need. This is the
// compute of a learner step without the replay service, the collectives and the optimizer
// (learner/trainer.h puts them around it; `odyssey bench learner` times it alone).
//
// Micro-batches: trajectories are sorted by length (longest first) and packed, right-padded with
// token 0 and loss mask 0, into micro-batches of B rows with B · (longest row) <= chunk_tokens
// (at least one row). A micro-batch runs in chunks of max(16, chunk_tokens / B) positions per
// row; a trajectory longer than chunk_tokens is thus alone and chunked along time. Causality
// makes right padding exact (no real position sees a pad), the MoE has no capacity limit (a
// token's output never depends on the others), and pads carry neither loss nor routing
// statistics. Position p predicts token p + 1 with the actor's log-prob and loss mask of p + 1;
// the last position of a row predicts nothing.
//
// Every chunk's loss is Σ ℓ_t / tokens_global, so the accumulated .grad of the parameters is
// this rank's share of the global token-mean gradient (summing over ranks gives the mean).
// Trajectories shorter than two tokens carry nothing and are skipped.
//
// Errors: LibTorch errors throw c10::Error (the trainer converts them at its boundary).
// Thread-safety: one caller per ChunkedPolicy.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "learner/batch.h"
#include "learner/chunked_policy.h"
#include "learner/loss.h"
#include "model/balancing.h"

namespace odyssey::learner {

struct PolicyGradientOptions {
  int64_t chunk_tokens = 2048;
  bool recompute = true;
  bool kda_keep_chunk_states = false;  // ChunkedBackwardOptions::keep_kda_chunk_states
  LossOptions loss;
  double tokens_global = 0;  // the token-mean denominator over all ranks (0: the local count)
  at::Device device = at::kCPU;
};

struct PolicyGradientResult {
  LossSums sums;                        // over every chunk (loss_sum left undefined)
  std::vector<at::Tensor> histograms;   // per balancer: int64 [n, bins] of this rank's tokens (CPU)
  int64_t micro_batches = 0;
  int64_t chunks = 0;
};

// Accumulates into the policy's .grad (not zeroed first). `reference` (may be null) gives
// logp_ref for the KL term; `balancers` (one per MoE layer, may be empty) give the histogram
// ranges.
PolicyGradientResult accumulate_policy_gradient(ChunkedPolicy& runner, ChunkedPolicy* reference,
                                                const std::vector<TrajectoryTokens>& trajectories,
                                                const std::vector<model::QuantileBalancer*>& balancers,
                                                const PolicyGradientOptions& options);

}  // namespace odyssey::learner
