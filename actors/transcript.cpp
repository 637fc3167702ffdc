#include "actors/transcript.h"

#include <algorithm>
#include <cassert>
#include <limits>
#include <utility>

#include "envs/turn.h"

namespace odyssey::actors {

namespace {
constexpr uint64_t kOpen = std::numeric_limits<uint64_t>::max();
}  // namespace

std::vector<uint8_t> TranscriptPiece::patch_mask() const {
  if (images.empty()) return {};
  std::vector<uint8_t> mask(tokens.size(), 0);
  for (const TranscriptImage& im : images)
    for (uint32_t j = 0; j < im.patches; ++j) mask[im.offset + 1 + j] = 1;
  return mask;
}

TranscriptPiece render_with_images(const env::Observation& obs, const Tokenizer& tokenizer, SpecialToken role,
                                   const PatchCounter& patches) {
  const envs::RenderedObservation rendered = envs::render_observation(obs, tokenizer, role);
  TranscriptPiece piece;
  piece.tokens.assign(rendered.tokens.begin(), rendered.tokens.begin() + static_cast<std::ptrdiff_t>(rendered.image_position));
  for (const env::Image& image : obs.images) {
    TranscriptImage t;
    t.offset = piece.tokens.size();
    t.patches = static_cast<uint32_t>(std::max<int64_t>(1, patches(std::max<uint32_t>(image.height, 1),
                                                                   std::max<uint32_t>(image.width, 1))));
    t.image = image;
    piece.tokens.push_back(tokenizer.special_id(SpecialToken::kImage));
    piece.tokens.insert(piece.tokens.end(), t.patches, tokenizer.special_id(SpecialToken::kImagePatch));
    piece.tokens.push_back(tokenizer.special_id(SpecialToken::kImageEnd));
    piece.images.push_back(std::move(t));
  }
  piece.tokens.insert(piece.tokens.end(), rendered.tokens.begin() + static_cast<std::ptrdiff_t>(rendered.image_position),
                      rendered.tokens.end());
  return piece;
}

TranscriptPiece prompt_piece(const env::Observation& reset, const Tokenizer& tokenizer, const PatchCounter& patches) {
  TranscriptPiece user = render_with_images(reset, tokenizer, SpecialToken::kUser, patches);
  TranscriptPiece piece;
  piece.tokens.push_back(tokenizer.special_id(SpecialToken::kBos));
  piece.tokens.insert(piece.tokens.end(), user.tokens.begin(), user.tokens.end());
  piece.tokens.push_back(tokenizer.special_id(SpecialToken::kAssistant));
  for (TranscriptImage& im : user.images) {
    im.offset += 1;
    piece.images.push_back(std::move(im));
  }
  return piece;
}

std::string image_media_type(const env::Image& image) {
  return image.format == ODY_ENV_IMAGE_PNG ? "image/png" : "image/x-portable-pixmap";
}

std::string encode_image(const env::Image& image) {
  if (image.format == ODY_ENV_IMAGE_PNG) return std::string(image.data.begin(), image.data.end());
  std::string out = "P6\n" + std::to_string(image.width) + " " + std::to_string(image.height) + "\n255\n";
  out.append(image.data.begin(), image.data.end());
  return out;
}

SegmentBuilder::SegmentBuilder(size_t segment_tokens) : segment_tokens_(std::max<size_t>(segment_tokens, 1)) {}

void SegmentBuilder::begin_turn(schema::Role role) {
  end_turn();
  turns_.push_back({role, position(), kOpen});
}

void SegmentBuilder::end_turn() {
  if (!turns_.empty() && turns_.back().end == kOpen) {
    turns_.back().end = position();
    if (turns_.back().end == turns_.back().start) turns_.pop_back();  // an empty turn is no turn
  }
}

void SegmentBuilder::append(uint32_t token, float logprob, uint32_t policy_version, bool model_written) {
  tokens_.push_back(token);
  logprobs_.push_back(model_written ? logprob : 0.0f);
  versions_.push_back(policy_version);
  mask_.push_back(model_written ? 1 : 0);
}

void SegmentBuilder::append(const TranscriptPiece& piece, uint32_t policy_version) {
  const uint64_t base = position();
  for (const TranscriptImage& im : piece.images) {
    ImageData data;
    data.num_patch_tokens = im.patches;
    data.width = im.image.width;
    data.height = im.image.height;
    data.media_type = image_media_type(im.image);
    data.data = encode_image(im.image);
    images_.push_back({base + im.offset, std::move(data)});
  }
  for (uint32_t token : piece.tokens) append(token, 0.0f, policy_version, /*model_written=*/false);
}

void SegmentBuilder::add_tool_call(ToolCallData call, uint64_t call_position, uint64_t result_position) {
  calls_.push_back({std::move(call), call_position, std::max(result_position, start_)});
}

void SegmentBuilder::add_snapshot(StateSnapshotData snapshot) { snapshots_.push_back(std::move(snapshot)); }

SegmentData SegmentBuilder::take_full() {
  assert(has_full());
  return take(segment_tokens_);
}

SegmentData SegmentBuilder::take_all() { return take(tokens_.size()); }

SegmentData SegmentBuilder::take(size_t n) {
  SegmentData seg;
  const uint64_t end = start_ + n;
  const bool everything = n == tokens_.size();
  const auto cut = static_cast<std::ptrdiff_t>(n);
  seg.tokens.assign(tokens_.begin(), tokens_.begin() + cut);
  seg.logprobs.assign(logprobs_.begin(), logprobs_.begin() + cut);
  seg.policy_versions.assign(versions_.begin(), versions_.begin() + cut);
  seg.loss_mask.assign(mask_.begin(), mask_.begin() + cut);

  for (const Turn& t : turns_) {
    const uint64_t t_end = t.end == kOpen ? position() : t.end;
    const uint64_t lo = std::max(t.start, start_), hi = std::min(t_end, end);
    if (t.start >= end || hi <= lo) continue;
    TurnData piece;
    piece.role = t.role;
    piece.start = static_cast<uint32_t>(lo - start_);
    piece.length = static_cast<uint32_t>(hi - lo);
    piece.continued = t.start < start_;
    seg.turns.push_back(piece);
  }
  turns_.erase(std::remove_if(turns_.begin(), turns_.end(), [&](const Turn& t) { return t.end != kOpen && t.end <= end; }),
               turns_.end());

  std::vector<PendingCall> later_calls;
  for (PendingCall& c : calls_) {
    if (c.result_position < end || (everything && c.result_position <= end)) {
      c.call.call_token_start = static_cast<uint32_t>(c.call_position >= start_ ? c.call_position - start_ : 0);
      c.call.result_token_start = static_cast<uint32_t>(c.result_position - start_);
      seg.tool_calls.push_back(std::move(c.call));
    } else {
      later_calls.push_back(std::move(c));
    }
  }
  calls_ = std::move(later_calls);

  std::vector<PendingImage> later_images;
  for (PendingImage& im : images_) {
    if (im.position < end) {
      im.image.token_offset = static_cast<uint32_t>(im.position - start_);
      seg.images.push_back(std::move(im.image));
    } else {
      later_images.push_back(std::move(im));
    }
  }
  images_ = std::move(later_images);
  seg.state_snapshots = std::move(snapshots_);
  snapshots_.clear();
  seg.created_unix_nanos = unix_nanos_now();

  tokens_.erase(tokens_.begin(), tokens_.begin() + cut);
  logprobs_.erase(logprobs_.begin(), logprobs_.begin() + cut);
  versions_.erase(versions_.begin(), versions_.begin() + cut);
  mask_.erase(mask_.begin(), mask_.begin() + cut);
  start_ = end;
  return seg;
}

}  // namespace odyssey::actors
