#include "replay/turns.h"

#include <gtest/gtest.h>

#include "core/codec.h"

namespace odyssey::replay {
namespace {

constexpr uint64_t kId = 77;

SegmentData tokens(uint32_t n, uint32_t first_id = 'a') {
  SegmentData d;
  for (uint32_t i = 0; i < n; ++i) {
    d.tokens.push_back(first_id + i);
    d.logprobs.push_back(-1.0f * static_cast<float>(i));
    d.policy_versions.push_back(2);
    d.loss_mask.push_back(1);
  }
  return d;
}

// Encodes `segments` as one trajectory and feeds them to `assembler`.
class Feeder {
 public:
  explicit Feeder(TurnAssembler& assembler) : assembler_(assembler) { assembler_.reset(kId); }
  Status add(const SegmentData& d) {
    auto enc = encode_segment(SegmentPosition{kId, seq_++, token_, prev_}, d);
    if (!enc.ok()) return enc.status();
    prev_ = enc->hash;
    token_ += d.tokens.size();
    MessageView view(enc->bytes);
    return assembler_.add(view.root<schema::Segment>(), [this](AssembledTurn&& t) { turns.push_back(std::move(t)); });
  }
  void finish() {
    assembler_.finish([this](AssembledTurn&& t) { turns.push_back(std::move(t)); });
  }
  std::vector<AssembledTurn> turns;

 private:
  TurnAssembler& assembler_;
  uint32_t seq_ = 0;
  uint64_t token_ = 0;
  Hash128 prev_;
};

TEST(TurnAssembler, MergesATurnContinuedOverThreeSegments) {
  TurnAssembler assembler;
  Feeder feed(assembler);
  for (int s = 0; s < 3; ++s) {
    SegmentData d = tokens(4, 'a' + 4 * s);
    d.turns.push_back({schema::Role::ASSISTANT, 0, 4, /*continued=*/s > 0});
    ASSERT_TRUE(feed.add(d).ok());
    EXPECT_TRUE(feed.turns.empty()) << "the turn may continue, so it is held";
  }
  feed.finish();
  ASSERT_EQ(feed.turns.size(), 1u);
  const AssembledTurn& t = feed.turns[0];
  EXPECT_EQ(t.num_tokens, 12u);
  EXPECT_EQ(t.first_seq, 0u);
  EXPECT_EQ(t.last_seq, 2u);
  ASSERT_EQ(t.ids.size(), 12u);
  EXPECT_EQ(t.ids[11], uint32_t{'a' + 11});
  EXPECT_TRUE(assembler.notes().empty());
}

TEST(TurnAssembler, HandsOnEachTurnAsSoonAsTheNextBegins) {
  TurnAssembler assembler;
  Feeder feed(assembler);
  SegmentData d = tokens(6);
  d.turns.push_back({schema::Role::USER, 0, 2, false});
  d.turns.push_back({schema::Role::ASSISTANT, 2, 3, false});  // token 5 is in no turn
  ASSERT_TRUE(feed.add(d).ok());
  ASSERT_EQ(feed.turns.size(), 1u);
  EXPECT_EQ(feed.turns[0].role, schema::Role::USER);
  feed.finish();
  ASSERT_EQ(feed.turns.size(), 2u);
  EXPECT_EQ(feed.turns[1].start, 2u);
  EXPECT_EQ(assembler.tokens_outside_turns(), 1u);
  EXPECT_EQ(assembler.tokens_read(), 6u);
  EXPECT_EQ(assembler.segments_read(), 1u);
}

TEST(TurnAssembler, KeepsAtMostTheTokenLimitAcrossSegmentsButCountsThemAll) {
  TurnAssemblyOptions options;
  options.max_turn_tokens = 5;
  options.keep_token_details = true;
  TurnAssembler assembler(options);
  Feeder feed(assembler);
  for (int s = 0; s < 2; ++s) {
    SegmentData d = tokens(4);
    d.turns.push_back({schema::Role::TOOL, 0, 4, s > 0});
    ASSERT_TRUE(feed.add(d).ok());
  }
  feed.finish();
  ASSERT_EQ(feed.turns.size(), 1u);
  EXPECT_EQ(feed.turns[0].num_tokens, 8u);
  EXPECT_EQ(feed.turns[0].ids.size(), 5u);
  EXPECT_EQ(feed.turns[0].logprobs.size(), 5u);
  EXPECT_EQ(feed.turns[0].loss_mask.size(), 5u);
}

TEST(TurnAssembler, AttachesACallToTheAssistantTurnHeldOpenFromTheSegmentBefore) {
  TurnAssembler assembler;
  Feeder feed(assembler);
  SegmentData first = tokens(3);
  first.turns.push_back({schema::Role::ASSISTANT, 0, 3, false});
  ASSERT_TRUE(feed.add(first).ok());
  SegmentData second = tokens(4);
  second.turns.push_back({schema::Role::ASSISTANT, 0, 2, true});
  second.turns.push_back({schema::Role::TOOL, 2, 2, false});
  ToolCallData call;
  call.name = "search";
  call.result = std::string(10, 'r');
  call.call_token_start = 1;
  call.result_token_start = 2;
  second.tool_calls.push_back(call);
  ASSERT_TRUE(feed.add(second).ok());
  feed.finish();
  ASSERT_EQ(feed.turns.size(), 2u);
  ASSERT_EQ(feed.turns[0].calls.size(), 1u);
  EXPECT_EQ(feed.turns[0].calls[0].call_position, 4u);
  EXPECT_EQ(feed.turns[0].calls[0].result_position, 5u);
  EXPECT_EQ(feed.turns[0].calls[0].seq, 1u);
  EXPECT_EQ(feed.turns[1].role, schema::Role::TOOL);
}

TEST(TurnAssembler, CutsResultsToTheLimitAndRemembersTheirSize) {
  TurnAssemblyOptions options;
  options.max_result_bytes = 4;
  TurnAssembler assembler(options);
  Feeder feed(assembler);
  SegmentData d = tokens(2);
  d.turns.push_back({schema::Role::ASSISTANT, 0, 2, false});
  ToolCallData call;
  call.result = "ab\xE4\xB8\x96z";  // "ab世z": the cut must not split the character
  d.tool_calls.push_back(call);
  ASSERT_TRUE(feed.add(d).ok());
  feed.finish();
  ASSERT_EQ(feed.turns.at(0).calls.size(), 1u);
  EXPECT_EQ(feed.turns[0].calls[0].result, "ab");
  EXPECT_EQ(feed.turns[0].calls[0].result_size, 6u);
}

TEST(TurnAssembler, NotesAContinuedPieceWithNothingToContinue) {
  TurnAssembler assembler;
  Feeder feed(assembler);
  SegmentData d = tokens(2);
  d.turns.push_back({schema::Role::USER, 0, 2, /*continued=*/true});
  ASSERT_TRUE(feed.add(d).ok());
  feed.finish();
  ASSERT_EQ(feed.turns.size(), 1u);
  ASSERT_EQ(assembler.notes().size(), 1u);
  EXPECT_EQ(assembler.notes()[0], "segment 0: its first turn is marked continued, but no turn was open");
}

TEST(TurnAssembler, RejectsATokenStartThatLeavesAGapAndKeepsItsState) {
  TurnAssembler assembler;
  assembler.reset(kId);
  SegmentData d = tokens(2);
  d.turns.push_back({schema::Role::USER, 0, 2, false});
  auto enc = encode_segment(SegmentPosition{kId, 0, /*token_start=*/5, {}}, d);
  ASSERT_TRUE(enc.ok());
  MessageView view(enc->bytes);
  int handed_on = 0;
  Status st = assembler.add(view.root<schema::Segment>(), [&](AssembledTurn&&) { ++handed_on; });
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "trajectory 000000000000004d segment 0: its tokenStart is 5, but the segments before "
                          "end at token 0");
  EXPECT_EQ(assembler.segments_read(), 0u);
  assembler.finish([&](AssembledTurn&&) { ++handed_on; });
  EXPECT_EQ(handed_on, 0);
}

}  // namespace
}  // namespace odyssey::replay
