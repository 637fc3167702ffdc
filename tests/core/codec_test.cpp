#include "core/codec.h"

#include <gtest/gtest.h>

namespace odyssey {
namespace {

SegmentData make_data(size_t n, uint32_t version = 3) {
  SegmentData d;
  for (size_t i = 0; i < n; ++i) {
    d.tokens.push_back(static_cast<uint32_t>(i * 7 % 256));
    d.logprobs.push_back(-0.5f * static_cast<float>(i % 5));
    d.policy_versions.push_back(version);
    d.loss_mask.push_back(i % 2);
  }
  d.turns.push_back({schema::Role::ASSISTANT, 0, static_cast<uint32_t>(n), false});
  ToolCallData c;
  c.call_id = "call-1";
  c.name = "calculator";
  c.arguments = R"({"expression":"2+2"})";
  c.result = "4";
  c.wall_time_nanos = 1234;
  d.tool_calls.push_back(c);
  return d;
}

TEST(SegmentCodec, RoundTripsEveryFieldAndHashIsStable) {
  SegmentPosition pos{/*trajectory_id=*/0xabcdef, /*seq=*/2, /*token_start=*/100, Hash128{1, 2}};
  auto enc = encode_segment(pos, make_data(64));
  ASSERT_TRUE(enc.ok()) << enc.status().to_string();
  auto computed = compute_self_hash(enc->bytes);
  ASSERT_TRUE(computed.ok());
  EXPECT_EQ(*computed, enc->hash);
  EXPECT_FALSE(enc->hash.is_zero());

  MessageView view(enc->bytes);
  ASSERT_TRUE(view.ok()) << view.status().to_string();
  auto s = view.root<schema::Segment>();
  EXPECT_EQ(s.getTrajectoryId(), 0xabcdefu);
  EXPECT_EQ(s.getSeq(), 2u);
  EXPECT_EQ(s.getPrevHashLo(), 1u);
  EXPECT_EQ(s.getPrevHashHi(), 2u);
  EXPECT_EQ(s.getTokens().size(), 64u);
  EXPECT_EQ(s.getTokens()[9], 63u);
  EXPECT_EQ(s.getToolCalls()[0].getName(), "calculator");
  EXPECT_EQ(s.getHashLo(), enc->hash.lo);
  EXPECT_TRUE(validate_segment(s).ok());
}

TEST(SegmentCodec, EveryFlippedByteChangesTheHash) {
  auto enc = encode_segment(SegmentPosition{7, 0, 0, {}}, make_data(16));
  ASSERT_TRUE(enc.ok());
  size_t detected = 0;
  for (size_t i = 0; i < enc->bytes.size(); ++i) {
    std::string b = enc->bytes;
    b[i] ^= 0x10;
    auto stored = stored_self_hash(b);
    auto computed = compute_self_hash(b);
    if (!stored.ok() || !computed.ok() || *stored != *computed) ++detected;
  }
  EXPECT_EQ(detected, enc->bytes.size());
}

TEST(SegmentCodec, RejectsMismatchedPerTokenLengthsNamingTheField) {
  auto d = make_data(8);
  d.logprobs.pop_back();
  auto enc = encode_segment(SegmentPosition{1, 0, 0, {}}, d);
  ASSERT_FALSE(enc.ok());
  EXPECT_NE(enc.status().message().find("logprobs"), std::string::npos) << enc.status().message();
}

TEST(SegmentCodec, RejectsTurnsPastTheEnd) {
  auto d = make_data(8);
  d.turns[0].length = 9;
  auto enc = encode_segment(SegmentPosition{1, 0, 0, {}}, d);
  ASSERT_FALSE(enc.ok());
  EXPECT_NE(enc.status().message().find("turns"), std::string::npos);
}

TEST(MessageView, RejectsTruncatedAndGarbageBytes) {
  auto enc = encode_segment(SegmentPosition{1, 0, 0, {}}, make_data(8));
  ASSERT_TRUE(enc.ok());
  EXPECT_FALSE(MessageView(std::string_view(enc->bytes).substr(0, enc->bytes.size() - 8)).ok());
  EXPECT_FALSE(MessageView("garbage!").ok());
  EXPECT_FALSE(MessageView(std::string(64, '\xff')).ok());
  EXPECT_FALSE(MessageView(enc->bytes + std::string(8, '\0')).ok());
}

TEST(MessageView, ReadsUnalignedBytes) {
  auto enc = encode_segment(SegmentPosition{5, 1, 0, {}}, make_data(8));
  ASSERT_TRUE(enc.ok());
  std::string shifted = "x" + enc->bytes;
  MessageView view(std::string_view(shifted).substr(1));
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view.root<schema::Segment>().getTrajectoryId(), 5u);
  auto h = compute_self_hash(std::string_view(shifted).substr(1));
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(*h, enc->hash);
}

TEST(TrajectoryId, FormatsAndParsesHex) {
  EXPECT_EQ(format_trajectory_id(0xab), "00000000000000ab");
  EXPECT_EQ(*parse_trajectory_id("00000000000000ab"), 0xabu);
  EXPECT_EQ(*parse_trajectory_id("0xAB"), 0xabu);
  EXPECT_FALSE(parse_trajectory_id("xyz").ok());
  EXPECT_FALSE(parse_trajectory_id("").ok());
  EXPECT_FALSE(parse_trajectory_id("12345678901234567").ok());
}

}  // namespace
}  // namespace odyssey
