// The Unicode character classes that tokenizer pre-tokenization patterns name: letters
// (regex \p{L}), numbers (\p{N}) and white space (\s), everything else being "other"
// (punctuation, symbols, marks, controls, unassigned).
//
// Letters and numbers come from a table generated from the Unicode Character Database
// (scripts/gen_unicode_class_table.py; version in unicode_data_version()). White space is the
// Unicode White_Space property, which is what \s means in the Rust regex and Oniguruma
// engines Hugging Face tokenizers use. Pure functions; thread-safe.
#pragma once

#include <cstdint>

namespace odyssey {

enum class CharClass : uint8_t {
  kOther = 0,
  kLetter,      // general category L*: Lu Ll Lt Lm Lo
  kNumber,      // general category N*: Nd Nl No
  kWhitespace,  // White_Space property: \t \n \v \f \r, space, U+0085, U+00A0, U+1680, ...
};

CharClass char_class(char32_t code_point);

// The Unicode version the letter and number table was generated from ("14.0.0").
const char* unicode_data_version();

}  // namespace odyssey
