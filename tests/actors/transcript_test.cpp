#include "actors/transcript.h"

#include <gtest/gtest.h>

#include "core/codec.h"
#include "core/tokenizer.h"

namespace odyssey::actors {
namespace {

const ByteTokenizer kTok;
uint32_t sp(SpecialToken t) { return kTok.special_id(t); }

TEST(Transcript, PromptIsBosUserTurnWithImagesSplicedThenAssistant) {
  env::Observation obs;
  obs.text = "hi";
  env::Image image;
  image.width = 20;
  image.height = 12;
  image.data.assign(20 * 12 * 3, 7);
  obs.images.push_back(image);
  const PatchCounter eight = [](int64_t h, int64_t w) { return ((h + 7) / 8) * ((w + 7) / 8); };
  const TranscriptPiece p = prompt_piece(obs, kTok, eight);
  // <|bos|> <|user|> h i <|image|> <|image_patch|> x6 <|/image|> <|end_turn|> <|assistant|>
  std::vector<uint32_t> want = {sp(SpecialToken::kBos), sp(SpecialToken::kUser), 'h', 'i', sp(SpecialToken::kImage)};
  want.insert(want.end(), 6, sp(SpecialToken::kImagePatch));
  for (SpecialToken t : {SpecialToken::kImageEnd, SpecialToken::kEndTurn, SpecialToken::kAssistant}) want.push_back(sp(t));
  EXPECT_EQ(p.tokens, want);
  ASSERT_EQ(p.images.size(), 1u);
  EXPECT_EQ(p.images[0].offset, 4u);
  EXPECT_EQ(p.images[0].patches, 6u);
  const std::vector<uint8_t> mask = p.patch_mask();
  ASSERT_EQ(mask.size(), want.size());
  for (size_t i = 0; i < mask.size(); ++i) EXPECT_EQ(mask[i], i >= 5 && i < 11 ? 1 : 0) << i;
  EXPECT_EQ(encode_image(image).substr(0, 11), "P6\n20 12\n25");
  EXPECT_EQ(encode_image(image).size(), 13 + 20 * 12 * 3);
  EXPECT_EQ(image_media_type(image), "image/x-portable-pixmap");
}

TEST(SegmentBuilder, CutsFullSegmentsContinuesTurnsAndKeepsCallsWithTheirResults) {
  SegmentBuilder b(/*segment_tokens=*/8);
  b.append(sp(SpecialToken::kBos), 0, 1, false);
  b.begin_turn(schema::Role::USER);
  for (int i = 0; i < 3; ++i) b.append('u', 0, 1, false);
  b.begin_turn(schema::Role::ASSISTANT);
  b.append(sp(SpecialToken::kAssistant), 0, 1, false);
  const uint64_t model_start = b.position();  // 5
  for (int i = 0; i < 10; ++i) b.append('m', -0.5f, i < 5 ? 1 : 2, true);  // crosses a weights version
  b.end_turn();
  ASSERT_TRUE(b.has_full());
  SegmentData first = b.take_full();
  EXPECT_FALSE(b.has_full());
  ASSERT_EQ(first.tokens.size(), 8u);
  ASSERT_EQ(first.turns.size(), 2u);
  EXPECT_EQ(first.turns[0].role, schema::Role::USER);
  EXPECT_EQ(first.turns[0].start, 1u);
  EXPECT_EQ(first.turns[0].length, 3u);
  EXPECT_EQ(first.turns[1].start, 4u);
  EXPECT_EQ(first.turns[1].length, 4u);
  EXPECT_EQ(first.loss_mask, (std::vector<uint8_t>{0, 0, 0, 0, 0, 1, 1, 1}));
  EXPECT_EQ(first.logprobs[0], 0.0f);
  EXPECT_EQ(first.logprobs[5], -0.5f);

  // The tool turn: one call whose <|tool_call|> is model token 2 (in the first segment) and one
  // at model token 9 (still pending).
  ToolCallData early, late;
  early.call_id = "call_0";
  late.call_id = "call_1";
  b.add_tool_call(early, model_start + 2, b.position());
  b.add_tool_call(late, model_start + 9, b.position());
  TranscriptPiece obs;
  obs.tokens = {sp(SpecialToken::kTool), 'r', sp(SpecialToken::kEndTurn)};
  const uint64_t obs_start = b.position();
  b.begin_turn(schema::Role::TOOL);
  b.append(obs, 2);
  b.end_turn();
  SegmentData second = b.take_all();
  EXPECT_TRUE(b.empty());
  ASSERT_EQ(second.tokens.size(), 10u);  // the rest of the model turn (7) + the observation (3)
  ASSERT_EQ(second.turns.size(), 2u);
  EXPECT_TRUE(second.turns[0].continued);
  EXPECT_EQ(second.turns[0].role, schema::Role::ASSISTANT);
  EXPECT_EQ(second.turns[0].start, 0u);
  EXPECT_EQ(second.turns[0].length, 7u);
  EXPECT_FALSE(second.turns[1].continued);
  EXPECT_EQ(second.turns[1].role, schema::Role::TOOL);
  EXPECT_EQ(second.turns[1].start, 7u);
  ASSERT_EQ(second.tool_calls.size(), 2u);
  EXPECT_EQ(second.tool_calls[0].call_token_start, 0u);  // clamped: its call went out before
  EXPECT_EQ(second.tool_calls[1].call_token_start, model_start + 9 - 8);
  EXPECT_EQ(second.tool_calls[0].result_token_start, obs_start - 8);
  EXPECT_EQ(second.policy_versions.back(), 2u);

  // Both segments are valid trajectory segments.
  SegmentPosition pos;
  pos.trajectory_id = 1;
  EXPECT_TRUE(encode_segment(pos, first).ok());
  pos.seq = 1;
  pos.token_start = 8;
  auto encoded = encode_segment(pos, second);
  EXPECT_TRUE(encoded.ok()) << encoded.status().message();
}

TEST(SegmentBuilder, CallsWhoseObservationWasLeftOutGoInTheLastSegment) {
  SegmentBuilder b(4);
  b.begin_turn(schema::Role::ASSISTANT);
  for (int i = 0; i < 6; ++i) b.append('m', -1, 1, true);
  b.end_turn();
  ToolCallData call;
  call.call_id = "call_0";
  b.add_tool_call(call, 5, b.position());  // result position == the end of every token
  b.add_snapshot({4, 1, "fmt", "bytes"});
  // The full segment ends before the call's result position: the call waits for the rest.
  SegmentData full = b.take_full();
  EXPECT_TRUE(full.tool_calls.empty());
  EXPECT_EQ(full.state_snapshots.size(), 1u);
  EXPECT_FALSE(b.empty());
  SegmentData rest = b.take_all();
  EXPECT_EQ(rest.tokens.size(), 2u);
  ASSERT_EQ(rest.tool_calls.size(), 1u);
  EXPECT_EQ(rest.tool_calls[0].call_token_start, 1u);
  EXPECT_EQ(rest.tool_calls[0].result_token_start, 2u);  // just past the last token
  ASSERT_EQ(rest.turns.size(), 1u);
  EXPECT_TRUE(rest.turns[0].continued);
  SegmentPosition pos;
  pos.trajectory_id = 1;
  pos.seq = 1;
  pos.token_start = 4;
  EXPECT_TRUE(encode_segment(pos, rest).ok());
  EXPECT_TRUE(b.empty());
}

}  // namespace
}  // namespace odyssey::actors
