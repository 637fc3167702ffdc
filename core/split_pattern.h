// The regex split patterns of byte-level BPE tokenizers, as hand-written scanners.
//
// Hugging Face tokenizer.json files split text into pre-tokens with a regex over Unicode
// classes (\p{L}, \p{N}, \s), which std::regex cannot express. Instead each supported pattern,
// identified by its exact text, has a scanner with the same result as the regex engine's
// leftmost-first, backtracking match (find-all, each match a piece):
//
//   kGpt2    's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//            (GPT-2, RoBERTa; the ByteLevel pre-tokenizer's built-in pattern, use_regex: true)
//   kLlama3  (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
//            ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//            (Llama 3, tiktoken cl100k_base)
//   kQwen2   as kLlama3 with \p{N} in place of \p{N}{1,3} (Qwen 2, Qwen 2.5, Qwen 3)
//
// Any other pattern (o200k's cased-letter classes, DeepSeek's CJK and digit splits, ...) is
// not supported: parse_split_pattern returns nothing for it.
//
// Text need not be valid UTF-8: each byte that does not start a well-formed sequence counts
// as one character of class "other", so the pieces always concatenate to the input.
// Case-insensitive contractions fold as Unicode simple case folding does ('S', and U+017F
// LONG S for 's'). Letters and numbers follow core/unicode_class.h. Pure; thread-safe.
#pragma once

#include <optional>
#include <string_view>
#include <vector>

namespace odyssey {

enum class SplitPattern { kGpt2, kLlama3, kQwen2 };

// The pattern spelled exactly `regex` (as in a tokenizer.json "Regex" field), if supported.
std::optional<SplitPattern> parse_split_pattern(std::string_view regex);
// The regex text of `pattern`.
std::string_view split_pattern_regex(SplitPattern pattern);
// "gpt2", "llama3", "qwen2".
const char* split_pattern_name(SplitPattern pattern);

// Appends the pieces of `text` to `pieces` in order (views into `text`; none empty); they
// concatenate to `text`.
void split_text(SplitPattern pattern, std::string_view text, std::vector<std::string_view>* pieces);

}  // namespace odyssey
