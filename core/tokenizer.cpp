#include "core/tokenizer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/bpe_tokenizer.h"
#include "core/utf8.h"

namespace odyssey {
namespace {

constexpr const char* kSpecialTexts[kNumSpecialTokens] = {
    "<|pad|>",         "<|bos|>",          "<|eos|>",          "<|system|>",   "<|user|>",
    "<|assistant|>",   "<|tool|>",         "<|end_turn|>",     "<|tool_call|>", "<|/tool_call|>",
    "<|tool_result|>", "<|/tool_result|>", "<|image|>",        "<|/image|>",   "<|image_patch|>",
};

std::string unknown_token_text(uint32_t id) { return fmt::format("<|unknown:{}|>", id); }

}  // namespace

const char* special_token_text(SpecialToken token) {
  const auto i = static_cast<uint32_t>(token);
  return i < kNumSpecialTokens ? kSpecialTexts[i] : "<|invalid_special|>";
}

std::optional<SpecialToken> parse_special_token(std::string_view text) {
  for (uint32_t i = 0; i < kNumSpecialTokens; ++i)
    if (text == kSpecialTexts[i]) return static_cast<SpecialToken>(i);
  return std::nullopt;
}

std::vector<uint32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<uint32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<uint8_t>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(const uint32_t* ids, size_t count) const {
  // Bytes are gathered into runs and repaired per run, so a multi-byte character split
  // across tokens decodes whole, and one broken by a special token becomes U+FFFD.
  std::string out, run;
  out.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    const uint32_t id = ids[i];
    if (id < kFirstSpecialId) {
      run.push_back(static_cast<char>(id));
      continue;
    }
    append_valid_utf8(out, run);
    run.clear();
    out += id < vocab_size() ? std::string(kSpecialTexts[id - kFirstSpecialId]) : unknown_token_text(id);
  }
  append_valid_utf8(out, run);
  return out;
}

uint32_t ByteTokenizer::special_id(SpecialToken token) const {
  return kFirstSpecialId + static_cast<uint32_t>(token);
}

std::optional<uint32_t> ByteTokenizer::find_special(std::string_view text) const {
  auto token = parse_special_token(text);
  if (!token) return std::nullopt;
  return special_id(*token);
}

std::optional<SpecialToken> ByteTokenizer::special_kind(uint32_t id) const {
  if (!is_special(id)) return std::nullopt;
  return static_cast<SpecialToken>(id - kFirstSpecialId);
}

bool ByteTokenizer::is_special(uint32_t id) const { return id >= kFirstSpecialId && id < vocab_size(); }

std::string ByteTokenizer::token_text(uint32_t id) const {
  if (id < kFirstSpecialId) {
    if (id >= 0x20 && id < 0x7F) return std::string(1, static_cast<char>(id));
    return fmt::format("<0x{:02X}>", id);
  }
  if (id < vocab_size()) return kSpecialTexts[id - kFirstSpecialId];
  return unknown_token_text(id);
}

std::vector<std::string> tokenizer_names() { return {"byte-v1", "hf-bpe:<path to tokenizer.json>"}; }

Result<std::unique_ptr<Tokenizer>> make_tokenizer(const std::string& name) {
  if (name == "byte-v1") return std::unique_ptr<Tokenizer>(std::make_unique<ByteTokenizer>());
  constexpr std::string_view kHfBpePrefix = "hf-bpe:";
  if (name.compare(0, kHfBpePrefix.size(), kHfBpePrefix) == 0) return load_hf_tokenizer(name.substr(kHfBpePrefix.size()));
  return invalid_argument("unknown tokenizer '{}' (known: {})", to_valid_utf8(name),
                          fmt::join(tokenizer_names(), ", "));
}

}  // namespace odyssey
