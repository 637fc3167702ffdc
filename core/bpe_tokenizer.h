// Hugging Face byte-level BPE tokenizers (the tokenizer.json of GPT-2, Llama 3, Qwen 2 and
// their kin) as a Tokenizer.
//
// Supported tokenizer.json content; anything else fails to load with kInvalidArgument naming
// the field (and the file, for load()):
// - model: "type": "BPE" (or absent); "vocab" {byte-level spelling: id}, which must hold the
//   256 single-byte symbols of the GPT-2 byte-to-unicode table; "merges" in either form, "a b"
//   strings or ["a", "b"] pairs, ranked by position; "ignore_merges" (a pre-token that is a
//   whole vocabulary entry becomes that id without merging). Refused: "byte_fallback": true,
//   a non-empty "continuing_subword_prefix" or "end_of_word_suffix", a non-zero "dropout".
// - pre_tokenizer: ByteLevel ("add_prefix_space" must be false; "use_regex": true splits with
//   the GPT-2 pattern), Split ("behavior": "Isolated", "invert": false, "pattern": {"Regex":
//   one of the patterns of core/split_pattern.h: GPT-2, Llama 3 / cl100k, Qwen 2}), or a
//   Sequence of those that contains a ByteLevel with no Split after it. A pattern not in that
//   list is refused with an error that quotes it.
// - normalizer: null, or NFC, which is accepted but not applied: text that is not already in
//   NFC encodes to other ids than Hugging Face would give (the round trip stays exact).
// - decoder: null or ByteLevel (decoding is always byte-level). post_processor, truncation
//   and padding are ignored: the framework places BOS and the other control tokens itself.
// - added_tokens: id, content, special, lstrip, rstrip, single_word ("normalized" is moot
//   without normalization). An added token may reuse a vocab id only for the same token.
//
// Encoding: pre-tokenize, map each piece's bytes to byte-level symbols, merge by rank (the
// lowest-ranked adjacent pair first, leftmost on ties, which is Hugging Face's order), with a
// bounded cache of recent pieces. encode() treats text as plain text and matches no added
// token, special or not (Hugging Face matches the non-special ones): a user or tool writing
// "<|im_end|>" or "<tool_call>" gets the ids of those characters. Merges whose result is a
// special id are never applied, so no text can reach one. encode_with_added_tokens() is the
// explicit opt-in for trusted text. Input need not be valid UTF-8; every byte round-trips.
//
// Decoding: model tokens go through the inverse byte table (a token with a character outside
// it contributes its own UTF-8, as Hugging Face's decoder does), runs of bytes are repaired to
// valid UTF-8 (core/utf8.h), added and special tokens render as their content, ids outside
// the vocabulary as "<|unknown:ID|>".
//
// Framework control tokens (SpecialToken) map onto the file's tokens, for each kind in turn:
// the added token named in HfBpeOptions::special_tokens (loading fails if there is none with
// that content); else an added token spelled like the framework's name ("<|eos|>"); else a
// new token with the framework's name, appended after the highest id in the file, in
// SpecialToken order (vocab_size() grows; the model's embedding must have rows for them).
// Every mapped token is special here (is_special, never produced by encode()), and no two
// kinds may share a token. find_special() knows the file's special tokens by content and the
// framework's names ("<|eos|>") of every kind.
//
// name() is "hf-bpe:" + 16 hex digits of XXH3-64 over the file's bytes (followed by the
// special_tokens mapping, when one is given), so trajectory records name the exact
// tokenizer. make_tokenizer("hf-bpe:<path>") loads one with no mapping.
//
// Immutable after loading; every method is const and thread-safe (the piece cache is
// internally locked).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/split_pattern.h"
#include "core/status.h"
#include "core/tokenizer.h"

namespace odyssey {

struct HfBpeOptions {
  // The content of the added token that plays each framework control token, e.g.
  // {kEos: "<|endoftext|>"} for GPT-2 or {kEndTurn: "<|im_end|>", kEos: "<|endoftext|>"} for
  // Qwen. Kinds not named here use the default rule (see above).
  std::map<SpecialToken, std::string> special_tokens;
};

class HfBpeTokenizer final : public Tokenizer {
 public:
  // Reads and parses the tokenizer.json at `path`; kIo when it cannot be read, kInvalidArgument
  // (prefixed with the path) when its content is not supported.
  static Result<std::unique_ptr<HfBpeTokenizer>> load(const std::string& path, const HfBpeOptions& options = {});
  // Parses tokenizer.json content; name() hashes these bytes.
  static Result<std::unique_ptr<HfBpeTokenizer>> parse(std::string_view json_text, const HfBpeOptions& options = {});

  std::string name() const override { return name_; }
  uint32_t vocab_size() const override { return static_cast<uint32_t>(tokens_.size()); }
  std::vector<uint32_t> encode(std::string_view text) const override;
  using Tokenizer::decode;
  std::string decode(const uint32_t* ids, size_t count) const override;
  uint32_t special_id(SpecialToken token) const override;
  std::optional<uint32_t> find_special(std::string_view text) const override;
  std::optional<SpecialToken> special_kind(uint32_t id) const override;
  bool is_special(uint32_t id) const override;
  std::string token_text(uint32_t id) const override;

  // Like encode(), but text spelling an added token (special or not) becomes its id, the
  // longest one at the leftmost position, honouring lstrip, rstrip and single_word. Only for
  // text the framework itself wrote (a chat template), never model, user or tool text.
  std::vector<uint32_t> encode_with_added_tokens(std::string_view text) const;

  // Ids below this came from the file; from here up to vocab_size() are the appended
  // control tokens.
  uint32_t file_vocab_size() const { return file_vocab_size_; }

 private:
  struct Merge {
    uint32_t rank;
    uint32_t merged_id;
  };
  struct TokenEntry {
    std::string bytes;     // model tokens: raw bytes; added and appended tokens: content
    bool defined = false;  // false for ids the file skips
    bool added = false;    // decodes as its content, outside byte runs
    bool special = false;
  };
  struct AddedToken {
    uint32_t id;
    std::string content;
    bool lstrip, rstrip, single_word;
  };

  HfBpeTokenizer() = default;
  void encode_plain(std::string_view text, std::vector<uint32_t>* ids) const;
  void encode_piece(std::string_view piece, std::vector<uint32_t>* ids) const;
  void merge_piece(std::string_view piece, std::vector<uint32_t>* ids) const;
  const Merge* find_merge(uint32_t left, uint32_t right) const;
  // The added token matching at text[pos], longest first, if any.
  const AddedToken* match_added(std::string_view text, size_t pos) const;

  std::string name_;
  std::vector<SplitPattern> splits_;  // applied in order, each to every piece of the last
  bool ignore_merges_ = false;
  std::unordered_map<std::string, uint32_t> vocab_;  // byte-level spelling -> id (model.vocab)
  std::unordered_map<uint64_t, Merge> merges_;       // left id << 32 | right id
  std::array<uint32_t, 256> byte_ids_{};
  std::vector<TokenEntry> tokens_;  // by id
  std::array<std::vector<AddedToken>, 256> added_by_first_byte_;  // longest first
  std::unordered_map<std::string, uint32_t> special_by_content_;
  std::array<uint32_t, kNumSpecialTokens> special_ids_{};
  std::unordered_map<uint32_t, SpecialToken> special_kinds_;
  uint32_t file_vocab_size_ = 0;

  mutable std::shared_mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<uint32_t>> cache_;  // piece -> ids
};

// HfBpeTokenizer::load as a Tokenizer.
Result<std::unique_ptr<Tokenizer>> load_hf_tokenizer(const std::string& path, const HfBpeOptions& options = {});

}  // namespace odyssey
