#include "core/utf8.h"

#include <gtest/gtest.h>

namespace odyssey {
namespace {

const std::string kFffd(kUtf8Replacement);

TEST(Utf8, AcceptsWellFormedTextOfEveryLength) {
  EXPECT_TRUE(is_valid_utf8(""));
  EXPECT_TRUE(is_valid_utf8("ascii"));
  EXPECT_TRUE(is_valid_utf8("é世🙂"));
  EXPECT_TRUE(is_valid_utf8("\xF4\x8F\xBF\xBF"));  // U+10FFFF
  EXPECT_EQ(to_valid_utf8("é世🙂"), "é世🙂");
}

TEST(Utf8, RejectsOverlongsSurrogatesAndCodePointsPastTheLast) {
  EXPECT_FALSE(is_valid_utf8("\xC0\xAF"));          // overlong '/'
  EXPECT_FALSE(is_valid_utf8("\xE0\x80\xAF"));      // overlong
  EXPECT_FALSE(is_valid_utf8("\xED\xA0\x80"));      // U+D800
  EXPECT_FALSE(is_valid_utf8("\xF4\x90\x80\x80"));  // U+110000
  EXPECT_FALSE(is_valid_utf8("\xE4\xB8"));          // truncated
}

TEST(Utf8, ReplacesEachMaximalIllFormedSubpartWithOneReplacementCharacter) {
  // Truncated 3-byte sequence then ASCII: one U+FFFD for both bytes.
  EXPECT_EQ(to_valid_utf8("\xE4\xB8" "A"), kFffd + "A");
  // A lead byte whose second byte is out of its range: each byte on its own.
  EXPECT_EQ(to_valid_utf8("\xE0\x80" "A"), kFffd + kFffd + "A");
  EXPECT_EQ(to_valid_utf8("\xFF\xFE"), kFffd + kFffd);
  EXPECT_EQ(to_valid_utf8("a\x80" "b"), "a" + kFffd + "b");
  EXPECT_TRUE(is_valid_utf8(to_valid_utf8("\xF0\x9F\x99")));
}

TEST(Utf8, PrefixNeverEndsInsideACharacter) {
  const std::string s = "a世b";  // 1 + 3 + 1 bytes
  EXPECT_EQ(utf8_prefix_length(s, 0), 0u);
  EXPECT_EQ(utf8_prefix_length(s, 1), 1u);
  EXPECT_EQ(utf8_prefix_length(s, 2), 1u);
  EXPECT_EQ(utf8_prefix_length(s, 3), 1u);
  EXPECT_EQ(utf8_prefix_length(s, 4), 4u);
  EXPECT_EQ(utf8_prefix_length(s, 100), 5u);
  EXPECT_EQ(utf8_length(s), 3u);
}

TEST(Utf8, DecodesAndEncodesSingleCodePoints) {
  for (char32_t cp : {char32_t{'a'}, char32_t{0xE9}, char32_t{0x4E2D}, char32_t{0x1F642}, char32_t{0x10FFFF}}) {
    std::string s;
    append_utf8_char(s, cp);
    EXPECT_TRUE(is_valid_utf8(s));
    char32_t back = 0;
    EXPECT_EQ(decode_utf8_char(s, 0, &back), s.size());
    EXPECT_EQ(back, cp);
  }
  char32_t untouched = 7;
  EXPECT_EQ(decode_utf8_char("\xC3", 0, &untouched), 0u);       // truncated
  EXPECT_EQ(decode_utf8_char("\xED\xA0\x80", 0, &untouched), 0u);  // surrogate
  EXPECT_EQ(untouched, 7u);
}

}  // namespace
}  // namespace odyssey
