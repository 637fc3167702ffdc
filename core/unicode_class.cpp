#include "core/unicode_class.h"

#include <algorithm>
#include <iterator>

namespace odyssey {
namespace {

struct ClassRange {
  char32_t first, last;
  CharClass cls;
};

#include "core/unicode_class_table.inc"

bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

}  // namespace

CharClass char_class(char32_t c) {
  if (c < 0x80) {  // the common case, without a search
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return CharClass::kLetter;
    if (c >= '0' && c <= '9') return CharClass::kNumber;
    return is_white_space(c) ? CharClass::kWhitespace : CharClass::kOther;
  }
  if (is_white_space(c)) return CharClass::kWhitespace;
  const auto* end = std::end(kClassRanges);
  const auto* it = std::upper_bound(std::begin(kClassRanges), end, c,
                                    [](char32_t cp, const ClassRange& r) { return cp < r.first; });
  if (it == std::begin(kClassRanges)) return CharClass::kOther;
  --it;
  return c <= it->last ? it->cls : CharClass::kOther;
}

const char* unicode_data_version() { return kUnicodeVersion; }

}  // namespace odyssey
