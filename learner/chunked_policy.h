// The policy over long sequences for training: chunk by chunk, with what later chunks read from
// earlier ones carried between chunks *with its gradient path*, and an exact chunked backward
// that holds one chunk's activations at a time (activation recomputation).
//
// What a chunk reads from the tokens before it (CarriedState):
//   * KDA layers: the KdaState (recurrent S and the short-convolution inputs), constant size;
//   * MLA layers: the latent history, the [c_kv ; k_shared] row of every earlier token
//     ([B, L, Lkv + S]; the only part that grows).
// Policy::forward_chunk (model/policy.h) carries the same things, but keeps the MLA cache as
// constants (model/mla.h: the right thing for decode and prefill), which drops the gradient a
// later chunk's attention sends into earlier tokens' latents. ChunkedPolicy runs the same layers
// (the Policy's own modules and parameters) with the MLA chunk step rebuilt from the layer's
// public projections so that the history keeps its graph, or is a leaf that receives its
// gradient. Its logits equal Policy::forward's (tests/learner/chunked_policy_test.cpp checks it,
// and the gradients, in fp64).
//
// chunked_backward: the gradient of Σ_c loss_c over a whole sequence, exactly.
//   recompute = false: one forward over all chunks keeping the whole graph (states carried with
//     their graph), then one backward. Activation memory grows with the sequence.
//   recompute = true (the default for the learner):
//     pass 1, no graph: run chunks 0..C-2, keeping only each chunk's incoming state (KDA states:
//       constant size per chunk; the MLA history once, since chunk c's incoming history is the
//       first start_c rows of the one leaving chunk C-2); the observer sees their logits, and
//       the last chunk's in pass 2, whose first forward is that chunk's only one.
//     pass 2, chunks C-1..0: rebuild chunk c's graph from its incoming state made a leaf, and
//       backpropagate from two roots at once: loss_c (grad 1) and the chunk's outgoing state
//       (grad G_{c+1} = the gradient later chunks sent into it; none for the last chunk). The
//       leaves' gradients are G_c, handed to chunk c−1. Parameter gradients accumulate.
//     By the chain rule through the state, Σ_c over these backward calls is exactly the
//     full-sequence gradient (it is backpropagation through the chunk sequence, with each
//     chunk's forward recomputed from its saved input). Memory: one chunk's activations, the
//     saved KDA states, the MLA history and its gradient G (both O(T · (Lkv + S)) per MLA layer).
//   Cost: two forwards and one backward per chunk, but one forward for the last (2C - 1 in all).
//
// Routing: every chunk's per-MoE-layer router scores (detached) are handed to the observer, so
// balancing sees every token (Policy::last_routing only keeps the last call's).
//
// Thread-safety: one caller at a time per ChunkedPolicy (it drives the Policy's modules).
// Errors: shape mismatches throw c10::Error.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "model/kda.h"
#include "model/policy.h"

namespace odyssey::learner {

// What a batch of sequences carries into its next chunk. kda[i] is set for KDA layers, mla[i]
// (history [B, L, Lkv + S], undefined while L = 0) for MLA layers.
struct CarriedState {
  std::vector<model::KdaState> kda;
  std::vector<at::Tensor> mla;
  int64_t tokens = 0;
};

// One chunk's output.
struct ChunkOutput {
  at::Tensor logits;                 // [B, t, V]
  std::vector<at::Tensor> routing;   // router scores [B·t, n] (detached), one per MoE layer in moe_layers() order
};

class ChunkedPolicy {
 public:
  explicit ChunkedPolicy(model::Policy policy) : policy_(std::move(policy)) {}

  // The state before a sequence's first token.
  CarriedState initial_state(int64_t batch);
  // tokens int64 [B, t] continuing `state`, which advances by t (its tensors are replaced, with
  // their graph when grad mode is on).
  ChunkOutput forward_chunk(const at::Tensor& tokens, CarriedState& state);

  model::Policy& policy() { return policy_; }

 private:
  at::Tensor mla_chunk(model::GatedMlaImpl& mla, const at::Tensor& x, at::Tensor& history);

  model::Policy policy_;
};

// A chunk of positions [start, start + length) of a batch, as the callbacks see it.
struct ChunkView {
  int64_t index = 0;
  int64_t start = 0;
  int64_t length = 0;
  const ChunkOutput* output = nullptr;  // logits: detached in recompute's pass 1 (every chunk but the last), with graph otherwise
};

struct ChunkedBackwardOptions {
  int64_t chunk_tokens = 2048;  // positions per chunk (per sequence of the batch)
  bool recompute = true;
  // With recompute (or one chunk): each chunk's KDA forward keeps its chunk states for that
  // chunk's backward (model::kda::KeepChunkStatesGuard; the CUDA kernels only: one pass of the
  // KDA backward less, the same gradients). The cost is memory: every KDA layer's states for one
  // chunk of tokens, chunk_tokens H K V / 8 bytes a layer (/ 32 for bf16 heads of 128 x 128, whose
  // backward reads every fourth chunk's state, plus every token's V', chunk_tokens H V 2 bytes),
  // held until the chunk's backward (the full model, 69 layers of 96 heads of 128 x 128: 6.9 + 3.5
  // GB at 2048 tokens), so it is asked for.
  bool keep_kda_chunk_states = false;
};

// Callbacks:
//   tokens(start, length)  -> int64 [B, length], positions [start, start + length)
//   observe(view)          called once per chunk in order 0..C-1 with the forward's logits
//                          (before any loss); may be empty
//   loss(view)             the 0-dim sum to differentiate for this chunk (logits with graph);
//                          undefined = nothing to train on in this chunk. With recompute it is
//                          called in reverse chunk order, after every observe call.
// Accumulates d(Σ_c loss_c)/dθ into the parameters' .grad (not zeroed first).
struct ChunkCallbacks {
  std::function<at::Tensor(int64_t start, int64_t length)> tokens;
  std::function<void(const ChunkView&)> observe;
  std::function<at::Tensor(const ChunkView&)> loss;
};
void chunked_backward(ChunkedPolicy& runner, int64_t batch, int64_t length, const ChunkedBackwardOptions& options,
                      const ChunkCallbacks& callbacks);

// Runs chunks 0..C-1 without a graph and calls observe for each (log-probs of a reference
// policy, evaluation).
void chunked_forward(ChunkedPolicy& runner, int64_t batch, int64_t length, int64_t chunk_tokens,
                     const std::function<at::Tensor(int64_t, int64_t)>& tokens,
                     const std::function<void(const ChunkView&)>& observe);

}  // namespace odyssey::learner
