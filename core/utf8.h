// UTF-8 checks and repair for text that leaves the process (JSON, terminals, logs).
//
// Bytes from outside (tool results, model-generated tokens, stored Text fields) may be any
// bytes; JSON and terminals need valid UTF-8. `to_valid_utf8` keeps every valid sequence
// and replaces each maximal ill-formed subpart with U+FFFD, the Unicode / WHATWG
// "substitution of maximal subparts" practice: overlong forms, surrogates (U+D800..DFFF),
// code points past U+10FFFF and truncated sequences are all ill-formed.
// Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace odyssey {

// The replacement character, as UTF-8.
inline constexpr std::string_view kUtf8Replacement = "\xEF\xBF\xBD";

bool is_valid_utf8(std::string_view bytes);

// `bytes` with every ill-formed subpart replaced by U+FFFD (the input when already valid).
std::string to_valid_utf8(std::string_view bytes);
// Appends to_valid_utf8(bytes) to `out` (no intermediate copy).
void append_valid_utf8(std::string& out, std::string_view bytes);

// The longest prefix of valid UTF-8 `text` that is at most `max_bytes` long and does not
// end inside a multi-byte character.
size_t utf8_prefix_length(std::string_view text, size_t max_bytes);

// Number of code points in valid UTF-8 `text` (for column widths).
size_t utf8_length(std::string_view text);

// The code point of the well-formed sequence starting at text[pos] (pos < text.size()) in
// `*code_point`, and its length in bytes; 0 when the bytes at pos do not start one (then
// `*code_point` is untouched).
size_t decode_utf8_char(std::string_view text, size_t pos, char32_t* code_point);
// Appends the UTF-8 encoding of `code_point` (at most U+10FFFF, not a surrogate) to `out`.
void append_utf8_char(std::string& out, char32_t code_point);

}  // namespace odyssey
