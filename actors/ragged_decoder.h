// Continuous batching on one Policy: sequences of different lengths ("ragged") decode together,
// join when they start and leave when they finish or wait on their environment.
//
// Each sequence keeps its own batch-1 model::PolicyState (RaggedDecoder::start). A decode step
// takes any subset of sequences, one input token each, and runs the policy's layers
// (model/policy.h) once for all of them:
//   * KDA layers: the per-sequence states are constant-size, so they are stacked into one
//     [B, ...] state, stepped by one batched layer call, and each sequence keeps its row (a
//     view of the step's output state; the next step stacks again).
//   * MLA layers: every sequence's latent cache has its own length. The layer's decode step
//     runs per sequence on that sequence's cache (batch 1, the absorbed form: exactly the keys
//     it has, no padding, no key-length mask); its inputs and outputs are rows of the batch.
//     (A GPU kernel for ragged MLA decode with per-row lengths would replace this loop behind
//     the same call.)
//   * Everything else — embedding, attention-residual mixes, norms, dense FFN and MoE (routing
//     is per token), LM head — runs batched.
// Prefill (a prompt, an observation) runs Policy::forward_chunk on the sequence alone (batch 1,
// chunked parallel form), with image patch embeddings placed where the mask says.
// Every per-sequence result equals decoding that sequence alone with Policy::forward_chunk /
// Policy::step, whatever else is in the batch (tests/actors/ragged_decoder_test.cpp checks
// logits and sampled tokens in fp64).
//
// Memory per sequence: the KDA states (constant) and the MLA latent caches, which grow by
// (kv_latent + shared_key_dim) numbers per token per MLA layer — the only part that grows.
//
// Snapshots: kda_state_snapshot() writes a sequence's KDA states (the recurrent state proper)
// as bytes, format "odyssey.kda_state/1" (layout in ragged_decoder.cpp). MLA latent caches
// are left out on purpose: they are a function of the tokens before the snapshot (rebuilt by
// forward_chunk over them) and would make every snapshot as large as the trajectory so far.
//
// Errors: shapes and token ids are checked and reported as c10::Error (LibTorch), which the
// actor loop converts to Status at its boundary. Thread-safety: one thread at a time (the
// Policy runs one forward at a time); a SequenceState belongs to its caller.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/status.h"
#include "model/policy.h"

namespace odyssey::actors {

inline constexpr const char* kKdaSnapshotFormat = "odyssey.kda_state/1";

class RaggedDecoder {
 public:
  explicit RaggedDecoder(model::Policy policy);

  // A fresh sequence (batch 1) with room for `reserve_tokens` in its MLA caches.
  model::PolicyState start(int64_t reserve_tokens = 0) const;

  // Feeds `tokens` (t >= 1) to one sequence in the chunked parallel form and returns the
  // logits after its last token [V]. image_mask: empty, or one entry per token (1 = an image
  // patch position, whose embedding is the next row of image_embeddings [n, hidden]).
  at::Tensor forward_chunk(model::PolicyState& state, const std::vector<uint32_t>& tokens,
                           const std::vector<uint8_t>& image_mask = {}, const at::Tensor& image_embeddings = {});

  // One token for each of states.size() sequences (any lengths): logits [B, V], row b for
  // states[b]. Each state advances by one token.
  at::Tensor step(const std::vector<model::PolicyState*>& states, const std::vector<uint32_t>& tokens);

  // The vision encoder's patch embeddings [num_patches, hidden] of one image, pixels
  // [C, H, W] in [0, 1]; undefined when the policy has no vision encoder.
  at::Tensor image_embeddings(const at::Tensor& pixels);
  bool has_vision() const;
  // Patches (and <|image_patch|> tokens) of an image of height x width pixels: the vision
  // encoder's patching, or 16-pixel patches when vision is disabled.
  int64_t image_patches(int64_t height, int64_t width) const;

  model::Policy& policy() { return policy_; }

 private:
  model::Policy policy_;
};

// Bytes of the KDA states of a batch-1 state (see the header comment), and back: layer index
// -> state. Parsing never crashes on bad input: kCorrupt for malformed bytes.
std::string kda_state_snapshot(const model::PolicyState& state);
Result<std::map<int64_t, model::KdaState>> parse_kda_state_snapshot(std::string_view bytes);

}  // namespace odyssey::actors
