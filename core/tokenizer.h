// Tokenizers: the framework owns tokenization, and text is a view derived from token ids.
//
// A Tokenizer turns plain text into ids and ids back into text, and names the special
// (control) tokens the framework uses to lay out a trajectory: role headers, turn ends,
// tool-call and tool-result brackets, image brackets and image patch positions.
//
// Contracts every implementation keeps:
// - encode() treats its input as plain text. Text that spells a special token, such as
//   "<|eos|>" inside a tool result or a user message, encodes as ordinary text, never as the
//   special id: only explicit calls (special_id) put control tokens into a sequence, so
//   neither a tool nor a user can inject them.
// - Every SpecialToken has an id (a loader for a foreign vocabulary maps or appends them,
//   or fails to load).
// - decode() always returns valid UTF-8 (ill-formed bytes become U+FFFD), because decoded
//   text goes into JSON and terminals. Special ids decode to their names ("<|eos|>"); ids
//   outside the vocabulary (corrupt or foreign data) decode to "<|unknown:ID|>".
// - Instances are immutable after construction; every method is const and thread-safe.
//
// Tokenizers are found by name (make_tokenizer); a trajectory record stores the name of
// the tokenizer its tokens came from (schema: Trajectory.tokenizer).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace odyssey {

// The framework's control tokens. The order is part of the "byte-v1" wire format (its ids
// are 256 + this value): append new kinds at the end, under a new tokenizer name.
enum class SpecialToken : uint32_t {
  kPad = 0,        // <|pad|>
  kBos,            // <|bos|>
  kEos,            // <|eos|>
  kSystem,         // <|system|>     role headers: a turn starts with one
  kUser,           // <|user|>
  kAssistant,      // <|assistant|>
  kTool,           // <|tool|>
  kEndTurn,        // <|end_turn|>
  kToolCall,       // <|tool_call|>  the model's call, as JSON, sits between these two
  kToolCallEnd,    // <|/tool_call|>
  kToolResult,     // <|tool_result|> what the environment returned
  kToolResultEnd,  // <|/tool_result|>
  kImage,          // <|image|>       an image: begin, one patch token per vision patch, end
  kImageEnd,       // <|/image|>
  kImagePatch,     // <|image_patch|>
};
inline constexpr uint32_t kNumSpecialTokens = 15;

// "<|eos|>" for kEos, and so on.
const char* special_token_text(SpecialToken token);
// The SpecialToken spelled `text` ("<|eos|>"), if any.
std::optional<SpecialToken> parse_special_token(std::string_view text);

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // The registry name, stored in trajectory records ("byte-v1").
  virtual std::string name() const = 0;
  // Ids are 0 .. vocab_size()-1.
  virtual uint32_t vocab_size() const = 0;

  // Plain text to ids; never produces a special id (see the contract above).
  virtual std::vector<uint32_t> encode(std::string_view text) const = 0;
  // Ids to valid UTF-8 text; special ids render as their names.
  virtual std::string decode(const uint32_t* ids, size_t count) const = 0;
  std::string decode(const std::vector<uint32_t>& ids) const { return decode(ids.data(), ids.size()); }

  // The id of one of the framework's control tokens.
  virtual uint32_t special_id(SpecialToken token) const = 0;
  // The id of a special token by its text ("<|eos|>"), including any special tokens of a
  // foreign vocabulary that SpecialToken does not name.
  virtual std::optional<uint32_t> find_special(std::string_view text) const = 0;
  // Which framework control token `id` is, if it is one.
  virtual std::optional<SpecialToken> special_kind(uint32_t id) const = 0;
  virtual bool is_special(uint32_t id) const = 0;

  // One token for display, always valid UTF-8: special tokens by name; for "byte-v1",
  // printable ASCII as itself and other bytes as "<0xNN>".
  virtual std::string token_text(uint32_t id) const = 0;
};

// Byte-level tokenizer "byte-v1": ids 0..255 are the raw bytes, 256.. the special tokens in
// SpecialToken order; vocab_size() is 256 + kNumSpecialTokens. decode(encode(text)) == text
// for every valid UTF-8 `text`, including text that spells a special token's name (it stays
// bytes).
class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr uint32_t kFirstSpecialId = 256;

  std::string name() const override { return "byte-v1"; }
  uint32_t vocab_size() const override { return kFirstSpecialId + kNumSpecialTokens; }
  std::vector<uint32_t> encode(std::string_view text) const override;
  using Tokenizer::decode;
  std::string decode(const uint32_t* ids, size_t count) const override;
  uint32_t special_id(SpecialToken token) const override;
  std::optional<uint32_t> find_special(std::string_view text) const override;
  std::optional<SpecialToken> special_kind(uint32_t id) const override;
  bool is_special(uint32_t id) const override;
  std::string token_text(uint32_t id) const override;
};

// Names make_tokenizer accepts ("hf-bpe:<path to tokenizer.json>" stands for any such path).
std::vector<std::string> tokenizer_names();
// The tokenizer registered as `name`, or for "hf-bpe:<path>" the Hugging Face byte-level BPE
// tokenizer.json at path (core/bpe_tokenizer.h; its name() is "hf-bpe:<content hash>");
// kInvalidArgument naming the known ones otherwise, or the loader's error.
Result<std::unique_ptr<Tokenizer>> make_tokenizer(const std::string& name);

}  // namespace odyssey
