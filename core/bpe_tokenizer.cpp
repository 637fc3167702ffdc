#include "core/bpe_tokenizer.h"

#include <algorithm>
#include <fstream>
#include <mutex>
#include <queue>
#include <sstream>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "core/unicode_class.h"
#include "core/utf8.h"

namespace odyssey {
namespace {

using Json = nlohmann::json;

// Ids above this are refused, so a corrupt file cannot make the loader allocate without bound.
constexpr uint32_t kMaxTokenId = (1u << 24) - 1;
// Pieces up to this many bytes are cached, up to this many of them.
constexpr size_t kMaxCachedPieceBytes = 256;
constexpr size_t kMaxCachedPieces = 1 << 16;

// A tokenizer.json that cannot be loaded; parse() turns it into kInvalidArgument.
struct LoadError {
  std::string message;
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw LoadError{fmt::format(f, std::forward<Args>(args)...)};
}

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves; the others
// (controls, space, DEL, NBSP, soft hyphen) take U+0100 upward in byte order, so space is
// U+0120 'Ġ' and newline U+010A 'Ċ'.
const std::array<char32_t, 256>& byte_code_points() {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> t{};
    char32_t next = 0x100;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      t[b] = printable ? b : next++;
    }
    return t;
  }();
  return table;
}

// The byte a byte-level symbol stands for, or -1.
int symbol_byte(char32_t cp) {
  static const std::unordered_map<char32_t, uint8_t> inverse = [] {
    std::unordered_map<char32_t, uint8_t> m;
    for (uint32_t b = 0; b < 256; ++b) m[byte_code_points()[b]] = static_cast<uint8_t>(b);
    return m;
  }();
  auto it = inverse.find(cp);
  return it == inverse.end() ? -1 : it->second;
}

std::string byte_level_spelling(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) append_utf8_char(out, byte_code_points()[static_cast<uint8_t>(c)]);
  return out;
}

// The raw bytes of a vocabulary token: through the inverse byte table when every character
// is a byte-level symbol, else the token's own UTF-8 (Hugging Face's ByteLevel decoder rule).
std::string token_bytes(std::string_view spelling) {
  std::string out;
  size_t pos = 0;
  while (pos < spelling.size()) {
    char32_t cp;
    const size_t n = decode_utf8_char(spelling, pos, &cp);
    const int byte = n == 0 ? -1 : symbol_byte(cp);
    if (byte < 0) return std::string(spelling);
    out.push_back(static_cast<char>(byte));
    pos += n;
  }
  return out;
}

std::string in_quotes(std::string_view s) {
  constexpr size_t kMax = 120;
  std::string v = to_valid_utf8(s.substr(0, utf8_prefix_length(s, kMax)));
  return "'" + v + (s.size() > kMax ? "...'" : "'");
}

// obj[key], or nullptr when absent or null.
const Json* member(const Json& obj, const char* key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

bool bool_field(const Json& obj, const char* key, bool fallback, const std::string& where) {
  const Json* v = member(obj, key);
  if (!v) return fallback;
  if (!v->is_boolean()) fail("{}.{}: expected true or false", where, key);
  return v->get<bool>();
}

std::string string_field(const Json& obj, const char* key, const std::string& where) {
  const Json* v = member(obj, key);
  if (!v) fail("{}.{}: missing", where, key);
  if (!v->is_string()) fail("{}.{}: expected a string", where, key);
  return v->get<std::string>();
}

uint32_t id_value(const Json& v, const std::string& where) {
  if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > kMaxTokenId)
    fail("{}: expected a token id, an integer in 0..{}", where, kMaxTokenId);
  return static_cast<uint32_t>(v.get<int64_t>());
}

std::string_view kind_name(SpecialToken kind) { return special_token_text(kind); }

bool is_word_char(char32_t cp) {
  const CharClass cls = char_class(cp);
  return cp == '_' || cls == CharClass::kLetter || cls == CharClass::kNumber;
}

// The code point that ends text[0, end), or nullopt at the start or after an ill-formed byte.
std::optional<char32_t> char_before(std::string_view text, size_t end) {
  size_t start = end;
  while (start > 0 && end - start < 4) {
    --start;
    if ((static_cast<uint8_t>(text[start]) & 0xC0) != 0x80) break;
  }
  char32_t cp;
  if (start == end || decode_utf8_char(text, start, &cp) != end - start) return std::nullopt;
  return cp;
}

// The end of the run of white space starting at text[pos].
size_t skip_white_space(std::string_view text, size_t pos) {
  char32_t cp;
  size_t n;
  while (pos < text.size() && (n = decode_utf8_char(text, pos, &cp)) != 0 &&
         char_class(cp) == CharClass::kWhitespace)
    pos += n;
  return pos;
}

// The start of the run of white space that ends text[begin, end) (end when there is none).
size_t white_space_suffix(std::string_view text, size_t begin, size_t end) {
  size_t start = end, pos = begin;
  while (pos < end) {
    char32_t cp;
    size_t n = decode_utf8_char(text, pos, &cp);
    const bool space = n != 0 && char_class(cp) == CharClass::kWhitespace;
    if (!space) start = end;
    else if (start == end) start = pos;
    pos += n == 0 ? 1 : n;
  }
  return start;
}

struct PreTokenizerSpec {
  std::vector<SplitPattern> splits;
  bool byte_level_seen = false;
};

void parse_pre_tokenizer(const Json& spec, const std::string& where, PreTokenizerSpec* out) {
  const std::string type = string_field(spec, "type", where);
  if (type == "Sequence") {
    const Json* steps = member(spec, "pretokenizers");
    if (!steps || !steps->is_array()) fail("{}.pretokenizers: expected an array", where);
    for (size_t i = 0; i < steps->size(); ++i)
      parse_pre_tokenizer((*steps)[i], fmt::format("{}.pretokenizers[{}]", where, i), out);
  } else if (type == "ByteLevel") {
    if (bool_field(spec, "add_prefix_space", /*fallback=*/true, where))
      fail("{}.add_prefix_space: true is not supported (it puts a space before the text, so "
           "decode(encode(text)) would not be text); set it to false",
           where);
    if (bool_field(spec, "use_regex", /*fallback=*/true, where)) out->splits.push_back(SplitPattern::kGpt2);
    out->byte_level_seen = true;
  } else if (type == "Split") {
    if (out->byte_level_seen) fail("{}: a Split after ByteLevel is not supported (it would see byte-level symbols)", where);
    const Json* pattern = member(spec, "pattern");
    if (!pattern || !pattern->is_object()) fail("{}.pattern: expected {{\"Regex\": ...}}", where);
    const Json* regex = member(*pattern, "Regex");
    if (!regex || !regex->is_string())
      fail("{}.pattern: only {{\"Regex\": ...}} patterns are supported, got {}", where, in_quotes(pattern->dump()));
    const std::string text = regex->get<std::string>();
    auto parsed = parse_split_pattern(text);
    if (!parsed)
      fail("{}.pattern.Regex: unsupported split pattern {} (supported, spelled exactly as in their "
           "tokenizer.json: the GPT-2, Llama 3 / cl100k and Qwen 2 patterns; see core/split_pattern.h)",
           where, in_quotes(text));
    const std::string behavior = string_field(spec, "behavior", where);
    if (behavior != "Isolated") fail("{}.behavior: {} is not supported (only \"Isolated\")", where, in_quotes(behavior));
    if (bool_field(spec, "invert", /*fallback=*/false, where)) fail("{}.invert: true is not supported", where);
    out->splits.push_back(*parsed);
  } else {
    fail("{}.type: unsupported pre-tokenizer {} (supported: ByteLevel, Split, Sequence)", where, in_quotes(type));
  }
}

std::string hash_name(std::string_view json_text, const HfBpeOptions& options) {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  XXH3_64bits_update(&state, json_text.data(), json_text.size());
  for (const auto& [kind, content] : options.special_tokens) {
    const std::string entry = fmt::format("\n{}={}", kind_name(kind), content);
    XXH3_64bits_update(&state, entry.data(), entry.size());
  }
  return fmt::format("hf-bpe:{:016x}", XXH3_64bits_digest(&state));
}

}  // namespace

Result<std::unique_ptr<HfBpeTokenizer>> HfBpeTokenizer::load(const std::string& path, const HfBpeOptions& options) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_status(StatusCode::kIo, "cannot open tokenizer file {}", path);
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return make_status(StatusCode::kIo, "cannot read tokenizer file {}", path);
  auto tokenizer = parse(text.str(), options);
  if (!tokenizer.ok()) return tokenizer.status().with_context(path);
  return tokenizer;
}

Result<std::unique_ptr<HfBpeTokenizer>> HfBpeTokenizer::parse(std::string_view json_text, const HfBpeOptions& options) {
  std::unique_ptr<HfBpeTokenizer> tok(new HfBpeTokenizer());
  try {
    Json root;
    try {
      root = Json::parse(json_text);
    } catch (const Json::parse_error& e) {
      fail("not valid JSON: {}", e.what());
    }
    if (!root.is_object()) fail("expected a JSON object at the top level");

    // model
    const Json* model = member(root, "model");
    if (!model || !model->is_object()) fail("model: missing");
    if (const Json* type = member(*model, "type")) {
      if (!type->is_string() || type->get<std::string>() != "BPE")
        fail("model.type: unsupported model type {} (only \"BPE\")", in_quotes(type->is_string() ? type->get<std::string>() : type->dump()));
    }
    if (bool_field(*model, "byte_fallback", false, "model"))
      fail("model.byte_fallback: true is not supported (a SentencePiece-style BPE, not byte-level)");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      const Json* v = member(*model, key);
      if (v && !(v->is_string() && v->get<std::string>().empty())) fail("model.{}: not supported (only null or \"\")", key);
    }
    if (const Json* dropout = member(*model, "dropout")) {
      if (!dropout->is_number() || dropout->get<double>() != 0.0)
        fail("model.dropout: {} is not supported (encoding must be deterministic)", dropout->dump());
    }
    tok->ignore_merges_ = bool_field(*model, "ignore_merges", false, "model");

    const Json* vocab = member(*model, "vocab");
    if (!vocab) fail("model.vocab: missing (an object of token -> id)");
    if (!vocab->is_object()) fail("model.vocab: expected an object of token -> id");
    for (const auto& [spelling, id_json] : vocab->items()) {
      const uint32_t id = id_value(id_json, fmt::format("model.vocab[{}]", in_quotes(spelling)));
      if (id >= tok->tokens_.size()) tok->tokens_.resize(id + 1);
      TokenEntry& entry = tok->tokens_[id];
      if (entry.defined)
        fail("model.vocab: id {} is both {} and {}", id, in_quotes(tok->token_text(id)), in_quotes(spelling));
      entry.defined = true;
      entry.bytes = token_bytes(spelling);
      tok->vocab_.emplace(spelling, id);
    }
    for (uint32_t b = 0; b < 256; ++b) {
      std::string symbol;
      append_utf8_char(symbol, byte_code_points()[b]);
      auto it = tok->vocab_.find(symbol);
      if (it == tok->vocab_.end())
        fail("model.vocab: lacks the byte-level symbol {} for byte 0x{:02X} (byte-level BPE needs all 256)", in_quotes(symbol), b);
      tok->byte_ids_[b] = it->second;
    }

    const Json* merges = member(*model, "merges");
    if (!merges) fail("model.merges: missing");
    if (!merges->is_array()) fail("model.merges: expected an array");
    for (size_t rank = 0; rank < merges->size(); ++rank) {
      const Json& m = (*merges)[rank];
      const std::string where = fmt::format("model.merges[{}]", rank);
      std::string left, right;
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const size_t space = s.find(' ');
        if (space == std::string::npos || space == 0 || space + 1 == s.size() || s.find(' ', space + 1) != std::string::npos)
          fail("{}: {} is not two tokens separated by one space", where, in_quotes(s));
        left = s.substr(0, space);
        right = s.substr(space + 1);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        left = m[0].get<std::string>();
        right = m[1].get<std::string>();
      } else {
        fail("{}: expected \"a b\" or [\"a\", \"b\"]", where);
      }
      auto lookup = [&](const std::string& spelling) {
        auto it = tok->vocab_.find(spelling);
        if (it == tok->vocab_.end())
          fail("{} ({} {}): {} is not in model.vocab", where, in_quotes(left), in_quotes(right), in_quotes(spelling));
        return it->second;
      };
      const uint32_t left_id = lookup(left), right_id = lookup(right), merged_id = lookup(left + right);
      tok->merges_.emplace(uint64_t{left_id} << 32 | right_id, Merge{static_cast<uint32_t>(rank), merged_id});
    }

    // normalizer, pre_tokenizer, decoder
    if (const Json* normalizer = member(root, "normalizer")) {
      const std::string type = string_field(*normalizer, "type", "normalizer");
      if (type != "NFC") fail("normalizer.type: unsupported normalizer {} (supported: null, NFC)", in_quotes(type));
    }
    const Json* pre = member(root, "pre_tokenizer");
    if (!pre) fail("pre_tokenizer: missing (byte-level BPE needs a ByteLevel pre-tokenizer)");
    PreTokenizerSpec pre_spec;
    parse_pre_tokenizer(*pre, "pre_tokenizer", &pre_spec);
    if (!pre_spec.byte_level_seen) fail("pre_tokenizer: no ByteLevel step (only byte-level BPE is supported)");
    tok->splits_ = std::move(pre_spec.splits);
    if (const Json* decoder = member(root, "decoder")) {
      const std::string type = string_field(*decoder, "type", "decoder");
      if (type != "ByteLevel") fail("decoder.type: unsupported decoder {} (supported: null, ByteLevel)", in_quotes(type));
    }

    // added_tokens
    if (const Json* added = member(root, "added_tokens")) {
      if (!added->is_array()) fail("added_tokens: expected an array");
      for (size_t i = 0; i < added->size(); ++i) {
        const Json& a = (*added)[i];
        const std::string where = fmt::format("added_tokens[{}]", i);
        if (!a.is_object()) fail("{}: expected an object", where);
        const Json* id_json = member(a, "id");
        if (!id_json) fail("{}.id: missing", where);
        const uint32_t id = id_value(*id_json, where + ".id");
        const std::string content = string_field(a, "content", where);
        if (content.empty()) fail("{}.content: empty", where);
        if (!is_valid_utf8(content)) fail("{}.content: not valid UTF-8", where);
        if (id >= tok->tokens_.size()) tok->tokens_.resize(id + 1);
        TokenEntry& entry = tok->tokens_[id];
        if (entry.added) fail("{}: id {} is already the added token {}", where, id, in_quotes(entry.bytes));
        if (entry.defined && entry.bytes != content && token_bytes(content) != entry.bytes)
          fail("{}: id {} is {} in model.vocab, not {}", where, id, in_quotes(to_valid_utf8(entry.bytes)), in_quotes(content));
        entry = TokenEntry{content, /*defined=*/true, /*added=*/true, bool_field(a, "special", false, where)};
        const auto first = static_cast<uint8_t>(content[0]);
        tok->added_by_first_byte_[first].push_back(AddedToken{id, content, bool_field(a, "lstrip", false, where),
                                                              bool_field(a, "rstrip", false, where),
                                                              bool_field(a, "single_word", false, where)});
      }
      for (auto& list : tok->added_by_first_byte_)
        std::stable_sort(list.begin(), list.end(),
                         [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
    }
    tok->file_vocab_size_ = static_cast<uint32_t>(tok->tokens_.size());

    // Framework control tokens.
    auto find_added = [&](std::string_view content) -> std::optional<uint32_t> {
      if (content.empty()) return std::nullopt;
      for (const AddedToken& a : tok->added_by_first_byte_[static_cast<uint8_t>(content[0])])
        if (a.content == content) return a.id;
      return std::nullopt;
    };
    for (uint32_t k = 0; k < kNumSpecialTokens; ++k) {
      const auto kind = static_cast<SpecialToken>(k);
      std::optional<uint32_t> id;
      auto mapped = options.special_tokens.find(kind);
      if (mapped != options.special_tokens.end()) {
        id = find_added(mapped->second);
        if (!id)
          fail("special token mapping {} -> {}: no added token has that content", kind_name(kind), in_quotes(mapped->second));
      } else {
        id = find_added(kind_name(kind));
      }
      if (!id) {
        id = static_cast<uint32_t>(tok->tokens_.size());
        tok->tokens_.push_back(TokenEntry{std::string(kind_name(kind)), true, true, true});
      }
      if (auto [it, inserted] = tok->special_kinds_.emplace(*id, kind); !inserted)
        fail("special token mapping: {} and {} would both be token {} ({})", kind_name(it->second), kind_name(kind),
             *id, in_quotes(tok->tokens_[*id].bytes));
      if (std::find(tok->byte_ids_.begin(), tok->byte_ids_.end(), *id) != tok->byte_ids_.end())
        fail("special token mapping: {} would be the single-byte token {}", kind_name(kind), *id);
      tok->tokens_[*id].special = true;
      tok->special_ids_[k] = *id;
    }
    for (uint32_t id = 0; id < tok->tokens_.size(); ++id)
      if (tok->tokens_[id].special) tok->special_by_content_.emplace(tok->tokens_[id].bytes, id);
    // No text may reach a special id: merges that would build one are dropped.
    for (auto it = tok->merges_.begin(); it != tok->merges_.end();)
      it = tok->tokens_[it->second.merged_id].special ? tok->merges_.erase(it) : std::next(it);
  } catch (const LoadError& e) {
    return invalid_argument("tokenizer.json: {}", e.message);
  }
  tok->name_ = hash_name(json_text, options);
  return tok;
}

const HfBpeTokenizer::Merge* HfBpeTokenizer::find_merge(uint32_t left, uint32_t right) const {
  auto it = merges_.find(uint64_t{left} << 32 | right);
  return it == merges_.end() ? nullptr : &it->second;
}

std::vector<uint32_t> HfBpeTokenizer::encode(std::string_view text) const {
  std::vector<uint32_t> ids;
  ids.reserve(text.size() / 3 + 1);
  encode_plain(text, &ids);
  return ids;
}

void HfBpeTokenizer::encode_plain(std::string_view text, std::vector<uint32_t>* ids) const {
  if (text.empty()) return;
  std::vector<std::string_view> pieces{text}, next;
  for (SplitPattern pattern : splits_) {
    next.clear();
    for (std::string_view piece : pieces) split_text(pattern, piece, &next);
    pieces.swap(next);
  }
  for (std::string_view piece : pieces) encode_piece(piece, ids);
}

void HfBpeTokenizer::encode_piece(std::string_view piece, std::vector<uint32_t>* ids) const {
  const bool cacheable = piece.size() <= kMaxCachedPieceBytes;
  if (cacheable) {
    std::shared_lock lock(cache_mutex_);
    auto it = cache_.find(std::string(piece));
    if (it != cache_.end()) {
      ids->insert(ids->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = ids->size();
  merge_piece(piece, ids);
  if (cacheable) {
    std::unique_lock lock(cache_mutex_);
    if (cache_.size() < kMaxCachedPieces)
      cache_.emplace(std::string(piece), std::vector<uint32_t>(ids->begin() + first, ids->end()));
  }
}

void HfBpeTokenizer::merge_piece(std::string_view piece, std::vector<uint32_t>* ids) const {
  if (ignore_merges_) {
    auto it = vocab_.find(byte_level_spelling(piece));
    if (it != vocab_.end() && !tokens_[it->second].special) {
      ids->push_back(it->second);
      return;
    }
  }
  // Symbols form a linked list over the piece's bytes; a symbol absorbs its right neighbour
  // when their pair is merged. Candidates are ordered by rank, then by position; a candidate
  // whose symbols changed since it was queued is skipped when it no longer names the pair.
  struct Symbol {
    uint32_t id;
    int32_t prev, next;
    bool alive;
  };
  struct Candidate {
    uint32_t rank, pos, merged_id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  const auto n = static_cast<int32_t>(piece.size());
  std::vector<Symbol> symbols(n);
  for (int32_t i = 0; i < n; ++i)
    symbols[i] = Symbol{byte_ids_[static_cast<uint8_t>(piece[i])], i - 1, i + 1 < n ? i + 1 : -1, true};
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto consider = [&](int32_t pos) {
    if (pos < 0 || symbols[pos].next < 0) return;
    if (const Merge* m = find_merge(symbols[pos].id, symbols[symbols[pos].next].id))
      queue.push(Candidate{m->rank, static_cast<uint32_t>(pos), m->merged_id});
  };
  for (int32_t i = 0; i + 1 < n; ++i) consider(i);
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& left = symbols[c.pos];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    const Merge* m = find_merge(left.id, right.id);
    if (!m || m->rank != c.rank || m->merged_id != c.merged_id) continue;
    left.id = c.merged_id;
    right.alive = false;
    left.next = right.next;
    if (left.next >= 0) symbols[left.next].prev = static_cast<int32_t>(c.pos);
    consider(left.prev);
    consider(static_cast<int32_t>(c.pos));
  }
  for (int32_t i = 0; i >= 0 && i < n; i = symbols[i].next) ids->push_back(symbols[i].id);
}

const HfBpeTokenizer::AddedToken* HfBpeTokenizer::match_added(std::string_view text, size_t pos) const {
  for (const AddedToken& a : added_by_first_byte_[static_cast<uint8_t>(text[pos])]) {
    if (text.compare(pos, a.content.size(), a.content) != 0) continue;
    if (a.single_word) {
      auto before = char_before(text, pos);
      char32_t after;
      const size_t end = pos + a.content.size();
      if ((before && is_word_char(*before)) ||
          (end < text.size() && decode_utf8_char(text, end, &after) != 0 && is_word_char(after)))
        continue;
    }
    return &a;
  }
  return nullptr;
}

std::vector<uint32_t> HfBpeTokenizer::encode_with_added_tokens(std::string_view text) const {
  std::vector<uint32_t> ids;
  size_t plain_start = 0, pos = 0;
  while (pos < text.size()) {
    const AddedToken* a = match_added(text, pos);
    if (!a) {
      ++pos;
      continue;
    }
    const size_t plain_end = a->lstrip ? white_space_suffix(text, plain_start, pos) : pos;
    encode_plain(text.substr(plain_start, plain_end - plain_start), &ids);
    ids.push_back(a->id);
    pos += a->content.size();
    if (a->rstrip) pos = skip_white_space(text, pos);
    plain_start = pos;
  }
  encode_plain(text.substr(plain_start), &ids);
  return ids;
}

std::string HfBpeTokenizer::decode(const uint32_t* ids, size_t count) const {
  std::string out, run;
  for (size_t i = 0; i < count; ++i) {
    const uint32_t id = ids[i];
    if (id < tokens_.size() && tokens_[id].defined && !tokens_[id].added) {
      run += tokens_[id].bytes;
      continue;
    }
    append_valid_utf8(out, run);
    run.clear();
    out += id < tokens_.size() && tokens_[id].defined ? tokens_[id].bytes : fmt::format("<|unknown:{}|>", id);
  }
  append_valid_utf8(out, run);
  return out;
}

uint32_t HfBpeTokenizer::special_id(SpecialToken token) const {
  return special_ids_[static_cast<uint32_t>(token) % kNumSpecialTokens];
}

std::optional<uint32_t> HfBpeTokenizer::find_special(std::string_view text) const {
  auto it = special_by_content_.find(std::string(text));
  if (it != special_by_content_.end()) return it->second;
  if (auto kind = parse_special_token(text)) return special_id(*kind);
  return std::nullopt;
}

std::optional<SpecialToken> HfBpeTokenizer::special_kind(uint32_t id) const {
  auto it = special_kinds_.find(id);
  if (it == special_kinds_.end()) return std::nullopt;
  return it->second;
}

bool HfBpeTokenizer::is_special(uint32_t id) const { return id < tokens_.size() && tokens_[id].special; }

std::string HfBpeTokenizer::token_text(uint32_t id) const {
  if (id >= tokens_.size() || !tokens_[id].defined) return fmt::format("<|unknown:{}|>", id);
  const std::string& bytes = tokens_[id].bytes;
  if (is_valid_utf8(bytes)) return bytes;
  std::string out;
  for (char c : bytes) {
    const auto b = static_cast<uint8_t>(c);
    if (b >= 0x20 && b < 0x7F) out.push_back(c);
    else out += fmt::format("<0x{:02X}>", b);
  }
  return out;
}

Result<std::unique_ptr<Tokenizer>> load_hf_tokenizer(const std::string& path, const HfBpeOptions& options) {
  auto tokenizer = HfBpeTokenizer::load(path, options);
  if (!tokenizer.ok()) return tokenizer.status();
  return std::unique_ptr<Tokenizer>(std::move(tokenizer).value());
}

}  // namespace odyssey
