#include "replay/turns.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/codec.h"
#include "core/utf8.h"

namespace odyssey::replay {
namespace {

constexpr size_t kMaxNotes = 100;

// Where a call or image of the segment goes: a piece of this segment, the turn left open by
// the segment before, or nowhere (it precedes every turn).
constexpr int kOpenTurn = -1;
constexpr int kNoTurn = -2;

template <typename T>
struct Placed {
  int target;
  T item;
};

std::string copy_bytes(capnp::Data::Reader data, size_t max_bytes) {
  std::string_view all(reinterpret_cast<const char*>(data.begin()), data.size());
  return std::string(all.substr(0, utf8_prefix_length(all, max_bytes)));
}

}  // namespace

void TurnAssembler::reset(uint64_t trajectory_id) {
  trajectory_id_ = trajectory_id;
  next_seq_ = 0;
  next_token_ = 0;
  tokens_outside_turns_ = 0;
  open_.reset();
  notes_.clear();
}

void TurnAssembler::append_tokens(schema::Segment::Reader segment, uint32_t begin, uint32_t length,
                                  size_t kept_before, AssembledTurn& turn) const {
  turn.num_tokens += length;
  const size_t kept = kept_before + turn.ids.size();
  const size_t room = options_.max_turn_tokens > kept ? options_.max_turn_tokens - kept : 0;
  const uint32_t keep = static_cast<uint32_t>(std::min<size_t>(length, room));
  auto tokens = segment.getTokens();
  for (uint32_t i = begin; i < begin + keep; ++i) turn.ids.push_back(tokens[i]);
  if (!options_.keep_token_details) return;
  auto logprobs = segment.getLogprobs();
  auto versions = segment.getPolicyVersions();
  auto mask = segment.getLossMask();
  for (uint32_t i = begin; i < begin + keep; ++i) {
    turn.logprobs.push_back(logprobs[i]);
    turn.policy_versions.push_back(versions[i]);
    turn.loss_mask.push_back(mask[i]);
  }
}

void TurnAssembler::hand_on(PendingTurn&& pending, const TurnSink& sink) {
  sink(std::move(pending.turn));
  hand_on_loose_calls(std::move(pending.loose_calls), sink);
}

void TurnAssembler::hand_on_loose_calls(std::vector<AssembledToolCall>&& calls, const TurnSink& sink) {
  if (calls.empty()) return;
  AssembledTurn carrier;
  carrier.synthetic = true;
  carrier.role = schema::Role::ASSISTANT;
  carrier.start = calls.front().call_position;
  carrier.first_seq = calls.front().seq;
  carrier.last_seq = calls.back().seq;
  carrier.calls = std::move(calls);
  sink(std::move(carrier));
}

Status TurnAssembler::add(schema::Segment::Reader segment, const TurnSink& sink) {
  // Read phase: everything the segment contributes is copied into locals, so a segment that
  // turns out malformed halfway leaves the assembler untouched.
  const uint32_t seq = next_seq_;
  std::vector<PendingTurn> pieces;
  std::vector<Placed<AssembledToolCall>> calls;
  std::vector<Placed<AssembledImage>> images;
  std::vector<std::string> new_notes;
  bool first_continues = false, merge_first = false;
  uint64_t num_tokens = 0, outside = 0;

  Status read = guarded("segment", [&]() -> Status {
    ODY_RETURN_IF_ERROR(validate_segment(segment));
    // Walks every pointer, so a broken pointer anywhere is an error here, whichever fields
    // the view reading the segment goes on to use.
    (void)segment.totalSize();
    if (segment.getTrajectoryId() != trajectory_id_)
      return invalid_argument("it belongs to trajectory {}", format_trajectory_id(segment.getTrajectoryId()));
    if (segment.getSeq() != seq)
      return invalid_argument("it has seq {} where seq {} was expected (segments come in order, from 0)",
                              segment.getSeq(), seq);
    if (segment.getTokenStart() != next_token_)
      return invalid_argument("its tokenStart is {}, but the segments before end at token {}",
                              segment.getTokenStart(), next_token_);
    const uint64_t base = segment.getTokenStart();
    num_tokens = segment.getTokens().size();

    auto turns = segment.getTurns();
    first_continues = turns.size() > 0 && turns[0].getContinued();
    merge_first = first_continues && open_ && open_->turn.role == turns[0].getRole();
    pieces.resize(turns.size());
    uint64_t covered = 0, previous_end = 0;
    for (unsigned i = 0; i < turns.size(); ++i) {
      auto t = turns[i];
      if (i > 0 && t.getContinued())
        new_notes.push_back(fmt::format("segment {}: turn piece {} is marked continued but is not the first", seq, i));
      if (i > 0 && t.getStart() < previous_end)
        new_notes.push_back(fmt::format("segment {}: turn piece {} overlaps the one before", seq, i));
      previous_end = uint64_t{t.getStart()} + t.getLength();
      covered += t.getLength();
      AssembledTurn& turn = pieces[i].turn;
      turn.role = t.getRole();
      turn.start = base + t.getStart();
      turn.first_seq = turn.last_seq = seq;
      // A piece that continues the open turn counts against that turn's token limit.
      const size_t kept_before = i == 0 && merge_first ? open_->turn.ids.size() : 0;
      append_tokens(segment, t.getStart(), t.getLength(), kept_before, turn);
    }
    outside = covered < num_tokens ? num_tokens - covered : 0;

    // The piece that is the last to start at or before `offset`.
    auto place = [&](uint32_t offset) {
      int found = kNoTurn;
      uint32_t best = 0;
      for (unsigned i = 0; i < turns.size(); ++i) {
        const uint32_t s = turns[i].getStart();
        if (s <= offset && (found == kNoTurn || s >= best)) {
          found = static_cast<int>(i);
          best = s;
        }
      }
      if (found == kNoTurn && open_) return kOpenTurn;
      return found;
    };

    for (auto c : segment.getToolCalls()) {
      AssembledToolCall call;
      call.call_id = c.getCallId();
      call.name = c.getName();
      call.arguments = c.getArguments();
      call.error = c.getError();
      call.result = copy_bytes(c.getResult(), options_.max_result_bytes);
      call.result_size = c.getResult().size();
      call.status = c.getStatus();
      call.wall_time_nanos = c.getWallTimeNanos();
      call.call_position = base + c.getCallTokenStart();
      call.result_position = base + c.getResultTokenStart();
      call.seq = seq;
      calls.push_back({place(c.getCallTokenStart()), std::move(call)});
    }
    for (auto im : segment.getImages()) {
      AssembledImage image;
      image.position = base + im.getTokenOffset();
      image.num_patch_tokens = im.getNumPatchTokens();
      image.width = im.getWidth();
      image.height = im.getHeight();
      image.media_type = im.getMediaType();
      image.size = im.getData().size();
      if (options_.keep_image_data) image.data = copy_bytes(im.getData(), im.getData().size());
      const int target = place(im.getTokenOffset());
      if (target == kNoTurn)
        new_notes.push_back(fmt::format("segment {}: image at token {} precedes every turn; not shown", seq,
                                        image.position));
      else
        images.push_back({target, std::move(image)});
    }
    return Status::Ok();
  });
  if (!read.ok())
    return read.with_context(fmt::format("trajectory {} segment {}", format_trajectory_id(trajectory_id_), seq));

  // Apply phase.
  if (first_continues && !merge_first)
    new_notes.push_back(fmt::format(open_ ? "segment {}: its first turn continues a turn of another role"
                                          : "segment {}: its first turn is marked continued, but no turn was open",
                                    seq));
  auto target_of = [&](int target) -> PendingTurn* {
    if (target == kOpenTurn || (target == 0 && merge_first)) return &*open_;
    if (target >= 0) return &pieces[static_cast<size_t>(target)];
    return nullptr;
  };
  std::vector<AssembledToolCall> before_every_turn;
  for (auto& placed : calls) {
    PendingTurn* owner = target_of(placed.target);
    if (owner == nullptr) before_every_turn.push_back(std::move(placed.item));
    else if (owner->turn.role == schema::Role::ASSISTANT) owner->turn.calls.push_back(std::move(placed.item));
    else owner->loose_calls.push_back(std::move(placed.item));
  }
  for (auto& placed : images) target_of(placed.target)->turn.images.push_back(std::move(placed.item));

  size_t next_piece = 0;
  if (merge_first) {
    AssembledTurn& into = open_->turn;
    AssembledTurn& piece = pieces[0].turn;
    into.num_tokens += piece.num_tokens;
    into.last_seq = seq;
    into.ids.insert(into.ids.end(), piece.ids.begin(), piece.ids.end());
    into.logprobs.insert(into.logprobs.end(), piece.logprobs.begin(), piece.logprobs.end());
    into.policy_versions.insert(into.policy_versions.end(), piece.policy_versions.begin(), piece.policy_versions.end());
    into.loss_mask.insert(into.loss_mask.end(), piece.loss_mask.begin(), piece.loss_mask.end());
    next_piece = 1;
  } else if (open_) {
    hand_on(std::move(*open_), sink);
    open_.reset();
  }
  hand_on_loose_calls(std::move(before_every_turn), sink);
  for (; next_piece < pieces.size(); ++next_piece) {
    if (open_) hand_on(std::move(*open_), sink);
    open_ = std::move(pieces[next_piece]);
  }

  for (auto& note : new_notes) {
    if (notes_.size() < kMaxNotes) notes_.push_back(std::move(note));
  }
  next_seq_ = seq + 1;
  next_token_ += num_tokens;
  tokens_outside_turns_ += outside;
  return Status::Ok();
}

void TurnAssembler::finish(const TurnSink& sink) {
  if (open_) hand_on(std::move(*open_), sink);
  open_.reset();
}

}  // namespace odyssey::replay
