#include "core/utf8.h"

#include <cstdint>

namespace odyssey {
namespace {

// Length of the well-formed sequence starting at text[i], or 0 when the bytes at i do not
// start one. `*consumed` is then the length of the maximal ill-formed subpart (>= 1):
// the lead byte plus the continuation bytes that were still acceptable (Unicode Table 3-7).
size_t sequence_length(std::string_view text, size_t i, size_t* consumed) {
  const auto b0 = static_cast<uint8_t>(text[i]);
  *consumed = 1;
  if (b0 < 0x80) return 1;
  size_t need;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 3;
    if (b0 == 0xE0) lo = 0xA0;       // no overlongs
    else if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 4;
    if (b0 == 0xF0) lo = 0x90;       // no overlongs
    else if (b0 == 0xF4) hi = 0x8F;  // nothing past U+10FFFF
  } else {
    return 0;  // 0x80..0xC1 and 0xF5..0xFF never start a sequence
  }
  for (size_t k = 1; k < need; ++k) {
    if (i + k >= text.size()) return 0;
    const auto b = static_cast<uint8_t>(text[i + k]);
    const uint8_t klo = k == 1 ? lo : 0x80, khi = k == 1 ? hi : 0xBF;
    if (b < klo || b > khi) return 0;
    *consumed = k + 1;
  }
  return need;
}

}  // namespace

bool is_valid_utf8(std::string_view bytes) {
  size_t i = 0, consumed;
  while (i < bytes.size()) {
    const size_t n = sequence_length(bytes, i, &consumed);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

void append_valid_utf8(std::string& out, std::string_view bytes) {
  size_t i = 0, run = 0, consumed;
  while (i < bytes.size()) {
    const size_t n = sequence_length(bytes, i, &consumed);
    if (n != 0) {
      i += n;
      continue;
    }
    out.append(bytes.data() + run, i - run);
    out.append(kUtf8Replacement);
    i += consumed;
    run = i;
  }
  out.append(bytes.data() + run, bytes.size() - run);
}

std::string to_valid_utf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  append_valid_utf8(out, bytes);
  return out;
}

size_t utf8_prefix_length(std::string_view text, size_t max_bytes) {
  if (max_bytes >= text.size()) return text.size();
  size_t n = max_bytes;
  while (n > 0 && (static_cast<uint8_t>(text[n]) & 0xC0) == 0x80) --n;
  return n;
}

size_t utf8_length(std::string_view text) {
  size_t n = 0;
  for (char c : text)
    if ((static_cast<uint8_t>(c) & 0xC0) != 0x80) ++n;
  return n;
}

size_t decode_utf8_char(std::string_view text, size_t pos, char32_t* code_point) {
  size_t consumed;
  const size_t n = sequence_length(text, pos, &consumed);
  if (n == 0) return 0;
  const auto b0 = static_cast<uint8_t>(text[pos]);
  char32_t cp = n == 1 ? b0 : n == 2 ? (b0 & 0x1F) : n == 3 ? (b0 & 0x0F) : (b0 & 0x07);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<uint8_t>(text[pos + k]) & 0x3F);
  *code_point = cp;
  return n;
}

void append_utf8_char(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace odyssey
