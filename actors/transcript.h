// The transcript format: how an episode becomes one token sequence. Actors write it, the
// learner trains on it, and `odyssey pretrain` generates its demonstrations in exactly this
// layout (so RL starts from a policy that has seen it). Token names are core/tokenizer.h's.
//
//   <|bos|>
//   <|user|> task text [images] <|end_turn|>          render_observation(reset observation,
//                                                      <|user|>) (envs/turn.h)
//   <|assistant|> model tokens ... <|end_turn|>        the model's turn
//   <|tool|> (<|tool_result|> result <|/tool_result|>)* text [images] <|end_turn|>
//                                                      render_observation(observation, <|tool|>)
//   <|assistant|> ...                                  again while the episode is not done
//   <|eos|>
//
// * A model turn is what the model writes after <|assistant|> up to and including its first
//   <|end_turn|> or <|eos|>, or actor.max_turn_tokens tokens, whichever comes first. The whole
//   turn goes to the environment through envs::Episode (tool calls parsed, the environment
//   stepped, malformed calls and environment failures become error results), and the
//   observation follows. A model <|eos|> ends the episode after that observation.
// * Images of an observation are spliced in at RenderedObservation::image_position (before
//   the observation's <|end_turn|>), one block per image: <|image|> <|image_patch|> x N
//   <|/image|>, N = the vision encoder's patches of the image (RaggedDecoder::image_patches;
//   16-pixel patches when the policy has no vision encoder — the patch tokens are then plain
//   tokens). The policy sees the image's patch embeddings at the patch positions.
// * Masks: tokens the model wrote have loss_mask 1 and their sampling log-prob
//   (actors/sampling.h: the behaviour distribution); every other token has loss_mask 0 and
//   log-prob 0. policy_versions: the weights version that sampled the token; for other tokens
//   the version current when they were appended.
// * Turns (SegmentData::turns): the user turn is the <|user|> rendering, an assistant turn is
//   <|assistant|> plus the model's tokens, a tool turn is the <|tool|> rendering. <|bos|> and
//   the final <|eos|> lie outside every turn.
// * Budget: the trajectory never exceeds actor.max_tokens tokens. When the model reaches it in
//   a turn, that turn is cut and not sent to the environment; when an observation does not fit
//   (with the final <|eos|>, and for an episode that goes on, the next <|assistant|> and one
//   model token), it is left out (its tool calls are still recorded, with their results). Both
//   end the episode, which is then scored as it stands.
//
// SegmentBuilder cuts the token stream into SegmentData (core/codec.h) for streaming: full
// segments of exactly `segment_tokens` tokens whenever that many are pending, and whatever is
// pending when the caller asks (the actor does at the end of each model turn's round — turn,
// tool calls, observation — so a round's calls and results sit in one segment, and at the end
// of the episode). Turns cut by a segment boundary continue in the next segment (`continued`).
// A tool call sits in the segment that holds the start of its result; its call position is
// clamped to that segment's first token when the call itself went out in an earlier segment
// (only possible for a turn longer than segment_tokens).
//
// Thread-safety: the free functions are pure; a SegmentBuilder belongs to one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/codec.h"
#include "core/tokenizer.h"
#include "odyssey/env_sdk.hpp"

namespace odyssey::actors {

// An image spliced into a piece of transcript.
struct TranscriptImage {
  size_t offset = 0;     // index of its <|image|> token in the piece's tokens
  uint32_t patches = 0;  // <|image_patch|> tokens that follow it
  env::Image image;
};

// A run of tokens the framework (not the model) writes, with its images.
struct TranscriptPiece {
  std::vector<uint32_t> tokens;
  std::vector<TranscriptImage> images;
  // 1 at every <|image_patch|> position of `images`, in token order; empty without images.
  std::vector<uint8_t> patch_mask() const;
};

// Image patches (<|image_patch|> tokens) of a height x width image.
using PatchCounter = std::function<int64_t(int64_t height, int64_t width)>;

// render_observation(obs, role) with obs.images spliced in at its image_position.
TranscriptPiece render_with_images(const env::Observation& obs, const Tokenizer& tokenizer, SpecialToken role,
                                   const PatchCounter& patches);
// The start of a transcript: <|bos|>, the reset observation as the user turn, <|assistant|>.
TranscriptPiece prompt_piece(const env::Observation& reset, const Tokenizer& tokenizer, const PatchCounter& patches);

// How an image is stored (ImageData): RGB8 pixels as a binary PPM ("image/x-portable-pixmap",
// exact), PNG bytes as they are ("image/png").
std::string image_media_type(const env::Image& image);
std::string encode_image(const env::Image& image);

class SegmentBuilder {
 public:
  explicit SegmentBuilder(size_t segment_tokens);

  // Tokens appended so far (the absolute position of the next token).
  uint64_t position() const { return start_ + tokens_.size(); }
  // Tokens appended but not yet taken.
  size_t pending() const { return tokens_.size(); }

  // A turn of `role` starts at position(); end_turn() closes it at position().
  void begin_turn(schema::Role role);
  void end_turn();

  void append(uint32_t token, float logprob, uint32_t policy_version, bool model_written);
  // The piece's tokens (loss mask 0, log-prob 0) and its images.
  void append(const TranscriptPiece& piece, uint32_t policy_version);
  // A tool call whose <|tool_call|> token is at absolute `call_position` and whose result
  // starts at absolute `result_position` (offsets in `call` are filled in when it is taken).
  void add_tool_call(ToolCallData call, uint64_t call_position, uint64_t result_position);
  // Goes into the next segment taken.
  void add_snapshot(StateSnapshotData snapshot);

  // True while at least segment_tokens tokens are pending.
  bool has_full() const { return tokens_.size() >= segment_tokens_; }
  // The next segment_tokens tokens as a segment (requires has_full()).
  SegmentData take_full();
  // Everything pending as a segment (may hold no tokens but snapshots or calls).
  SegmentData take_all();
  // Whether take_all() would return anything.
  bool empty() const { return tokens_.empty() && calls_.empty() && snapshots_.empty(); }

 private:
  struct Turn {
    schema::Role role;
    uint64_t start;
    uint64_t end;  // kOpen while open
  };
  struct PendingCall {
    ToolCallData call;
    uint64_t call_position, result_position;
  };
  struct PendingImage {
    uint64_t position;
    ImageData image;
  };
  SegmentData take(size_t n);

  size_t segment_tokens_;
  uint64_t start_ = 0;  // absolute position of tokens_[0]
  std::vector<uint32_t> tokens_;
  std::vector<float> logprobs_;
  std::vector<uint32_t> versions_;
  std::vector<uint8_t> mask_;
  std::vector<Turn> turns_;  // turns that reach into the pending tokens, and the open one
  std::vector<PendingCall> calls_;
  std::vector<PendingImage> images_;
  std::vector<StateSnapshotData> snapshots_;
};

}  // namespace odyssey::actors
