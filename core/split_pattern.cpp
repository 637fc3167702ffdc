#include "core/split_pattern.h"

#include <cstddef>
#include <cstdint>

#include "core/unicode_class.h"
#include "core/utf8.h"

namespace odyssey {
namespace {

constexpr std::string_view kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr std::string_view kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// One character of the text: its byte offset, code point and class. An ill-formed byte is
// a character of its own, class kOther, code point U+FFFD (which no alternative names).
struct Char {
  size_t offset;
  char32_t cp;
  CharClass cls;
};

class Scanner {
 public:
  Scanner(SplitPattern pattern, std::string_view text) : pattern_(pattern) {
    chars_.reserve(text.size());
    size_t pos = 0;
    while (pos < text.size()) {
      char32_t cp = 0xFFFD;
      size_t n = decode_utf8_char(text, pos, &cp);
      const CharClass cls = n == 0 ? CharClass::kOther : char_class(cp);
      if (n == 0) n = 1;
      chars_.push_back({pos, cp, cls});
      pos += n;
    }
    end_offset_ = text.size();
  }

  size_t size() const { return chars_.size(); }
  size_t offset(size_t i) const { return i < chars_.size() ? chars_[i].offset : end_offset_; }

  // The end (character index) of the match starting at character i < size(); always > i,
  // because every character is a letter, a number, white space or other, and each of the
  // supported patterns has an alternative that matches any of those.
  size_t match(size_t i) const {
    return pattern_ == SplitPattern::kGpt2 ? match_gpt2(i) : match_llama3(i, pattern_ == SplitPattern::kLlama3 ? 3 : 1);
  }

 private:
  bool is(size_t i, CharClass cls) const { return i < chars_.size() && chars_[i].cls == cls; }
  bool is_cp(size_t i, char32_t cp) const { return i < chars_.size() && chars_[i].cp == cp; }
  bool is_newline(size_t i) const { return is_cp(i, '\r') || is_cp(i, '\n'); }
  size_t run(size_t i, CharClass cls) const {
    while (is(i, cls)) ++i;
    return i;
  }

  // 's|'t|'re|'ve|'m|'ll|'d at i (which holds the apostrophe); the end, or 0.
  size_t contraction(size_t i, bool ignore_case) const {
    auto letter = [&](size_t k, char lower) {
      if (k >= chars_.size()) return false;
      const char32_t c = chars_[k].cp;
      if (c == static_cast<char32_t>(lower)) return true;
      if (!ignore_case) return false;
      if (c == static_cast<char32_t>(lower - 'a' + 'A')) return true;
      return lower == 's' && c == 0x017F;  // LONG S folds to 's'
    };
    if (letter(i + 1, 's') || letter(i + 1, 't') || letter(i + 1, 'm') || letter(i + 1, 'd')) return i + 2;
    if ((letter(i + 1, 'r') && letter(i + 2, 'e')) || (letter(i + 1, 'v') && letter(i + 2, 'e')) ||
        (letter(i + 1, 'l') && letter(i + 2, 'l')))
      return i + 3;
    return 0;
  }

  // \s+(?!\S)|\s+ at i (white space): the whole run when it ends the text or is one
  // character; otherwise all but its last character, which goes with what follows.
  size_t whitespace_run(size_t i) const {
    const size_t end = run(i, CharClass::kWhitespace);
    if (end == chars_.size() || end - i == 1) return end;
    return end - 1;
  }

  size_t match_gpt2(size_t i) const {
    if (is_cp(i, '\'')) {
      if (size_t end = contraction(i, /*ignore_case=*/false)) return end;
    }
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: a space joins the run that follows it.
    const size_t start = is_cp(i, ' ') ? i + 1 : i;
    for (CharClass cls : {CharClass::kLetter, CharClass::kNumber, CharClass::kOther})
      if (is(start, cls)) return run(start, cls);
    return whitespace_run(i);
  }

  size_t match_llama3(size_t i, size_t max_digits) const {
    if (is_cp(i, '\'')) {
      if (size_t end = contraction(i, /*ignore_case=*/true)) return end;
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (is(i, CharClass::kLetter)) return run(i, CharClass::kLetter);
    if (!is_newline(i) && !is(i, CharClass::kNumber) && is(i + 1, CharClass::kLetter))
      return run(i + 1, CharClass::kLetter);
    // \p{N}{1,max_digits}
    if (is(i, CharClass::kNumber)) {
      size_t end = i;
      while (end - i < max_digits && is(end, CharClass::kNumber)) ++end;
      return end;
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
    const size_t start = is_cp(i, ' ') && is(i + 1, CharClass::kOther) ? i + 1 : i;
    if (is(start, CharClass::kOther)) {
      size_t end = run(start, CharClass::kOther);
      while (is_newline(end)) ++end;
      return end;
    }
    // \s*[\r\n]+: the white space run up to and including its last line break.
    const size_t ws_end = run(i, CharClass::kWhitespace);
    for (size_t k = ws_end; k > i; --k)
      if (is_newline(k - 1)) return k;
    return whitespace_run(i);
  }

  SplitPattern pattern_;
  std::vector<Char> chars_;
  size_t end_offset_ = 0;
};

}  // namespace

std::optional<SplitPattern> parse_split_pattern(std::string_view regex) {
  for (SplitPattern p : {SplitPattern::kGpt2, SplitPattern::kLlama3, SplitPattern::kQwen2})
    if (regex == split_pattern_regex(p)) return p;
  return std::nullopt;
}

std::string_view split_pattern_regex(SplitPattern pattern) {
  switch (pattern) {
    case SplitPattern::kGpt2: return kGpt2Regex;
    case SplitPattern::kLlama3: return kLlama3Regex;
    case SplitPattern::kQwen2: return kQwen2Regex;
  }
  return {};
}

const char* split_pattern_name(SplitPattern pattern) {
  switch (pattern) {
    case SplitPattern::kGpt2: return "gpt2";
    case SplitPattern::kLlama3: return "llama3";
    case SplitPattern::kQwen2: return "qwen2";
  }
  return "?";
}

void split_text(SplitPattern pattern, std::string_view text, std::vector<std::string_view>* pieces) {
  const Scanner scanner(pattern, text);
  size_t i = 0;
  while (i < scanner.size()) {
    const size_t end = scanner.match(i);
    pieces->push_back(text.substr(scanner.offset(i), scanner.offset(end) - scanner.offset(i)));
    i = end;
  }
}

}  // namespace odyssey
