// needle: long-horizon retrieval. Each episode generates a corpus (corpus.h) and indexes it
// (bm25.h); the model answers a multi-hop question with the tools search, open and answer.
//
// Config (all optional):
//   corpus_tokens       1000000  corpus size in bytes (= tokens of a byte tokenizer), 4000..33554432
//   documents           corpus_tokens / 1000 (at least 30 + 10 * hops): number of documents
//   hops                2        relations chained by the question, 1..6
//   max_turns           40       turns before the episode ends unanswered
//   results_per_search  5        documents a search returns, 1..50
//   page_bytes          4000     bytes an open returns when no length is given, 256..65536
//   hop_reward          0.1      reward for the first open of each gold-chain document
//   inline_corpus       false    the long-context form: the first observation holds the whole
//                                corpus ("[id] title" then the text, document after document,
//                                in id order) before the question, so a corpus_tokens-byte
//                                corpus makes a trajectory that long before the model's first
//                                token; the tools stay available
// Tasks: {"split": "train"|"eval", "index": N} is task N of that split; {} with seed S is train
// task S. A task's split is decided by its content: a question is an eval question when
// splitmix64(FNV-1a-64(question + "\n" + answer)) % 10 == 0, so the splits are disjoint (no
// question-and-answer pair is in both). Task N of a split is the first world, over attempts
// a = 0, 1, ..., generated from seed splitmix64(splitmix64(N) + a) whose question is in the
// split (the question is chosen before any document is written, so a rejected attempt costs
// microseconds). A split task ignores the seed.
// Rewards: "hop_k" (hop_reward) the first time the model opens hop k's gold page; "correct"
// (1.0) when the answer matches the expected name after normalization (case, punctuation,
// whitespace). score(): reward = sum of the parts, success = correct.
// Snapshots (JSON) hold the task, seed and the episode's progress; restore regenerates the
// corpus from them (same config required).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "bm25.h"
#include "corpus.h"
#include "odyssey/env_sdk.hpp"
#include "odyssey/env_util.hpp"

namespace odyssey::needle {
namespace {

using env::EnvError;
using env::ToolError;
using nlohmann::json;

constexpr int kSnapshotVersion = 1;
constexpr size_t kMaxQueryBytes = 2000;
constexpr uint64_t kMaxOpenBytes = 65536;
constexpr size_t kSnippetBytes = 240;
constexpr uint64_t kMaxAttempts = 1000;

// The split of a question is a function of its text and answer alone.
bool in_eval(const std::string& question, const std::string& answer) {
  return env::splitmix64(env::fnv1a64(question + "\n" + answer)) % 10 == 0;
}

// Lowercase ASCII, punctuation to spaces, runs of spaces collapsed, trimmed.
std::string normalized(std::string_view s) {
  std::string out;
  bool space = false;
  for (const char c : s) {
    const bool alnum = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                       static_cast<unsigned char>(c) >= 0x80;
    if (!alnum) {
      space = !out.empty();
      continue;
    }
    if (space) out += ' ';
    space = false;
    out += (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c;
  }
  return out;
}

const json& string_argument(const json& args, const char* key) {
  if (!args.is_object() || !args.contains(key) || !args[key].is_string())
    throw ToolError(std::string("argument '") + key + "' must be a string");
  return args[key];
}

struct Config {
  uint64_t corpus_tokens = 1000000;
  uint32_t documents = 0;
  uint32_t hops = 2;
  uint32_t max_turns = 40;
  uint32_t results_per_search = 5;
  uint32_t page_bytes = 4000;
  double hop_reward = 0.1;
  bool inline_corpus = false;
};

Config parse_config(const json& c) {
  const std::string what = "needle config";
  const auto bad = ODY_ENV_ERR_INVALID_CONFIG;
  env::check_keys(c, {"corpus_tokens", "documents", "hops", "max_turns", "results_per_search", "page_bytes", "hop_reward",
                 "inline_corpus"},
             what, bad);
  Config config;
  config.hops = static_cast<uint32_t>(env::integer_field(c, "hops", 2, 1, 6, what, bad));
  config.corpus_tokens = env::integer_field(c, "corpus_tokens", 1000000, 4000, 1ull << 25, what, bad);
  const uint64_t fallback_documents = std::max<uint64_t>(min_documents(config.hops), config.corpus_tokens / 1000);
  config.documents = static_cast<uint32_t>(
      env::integer_field(c, "documents", fallback_documents, min_documents(config.hops), 1000000, what, bad));
  if (config.corpus_tokens < 400ull * config.documents)
    throw EnvError(bad, what + ": " + std::to_string(config.documents) + " documents need corpus_tokens >= " +
                            std::to_string(400ull * config.documents) + " (400 bytes each), got " +
                            std::to_string(config.corpus_tokens));
  config.max_turns = static_cast<uint32_t>(env::integer_field(c, "max_turns", 40, 1, 100000, what, bad));
  config.results_per_search = static_cast<uint32_t>(env::integer_field(c, "results_per_search", 5, 1, 50, what, bad));
  config.page_bytes = static_cast<uint32_t>(env::integer_field(c, "page_bytes", 4000, 256, kMaxOpenBytes, what, bad));
  if (c.contains("hop_reward")) {
    const json& v = c["hop_reward"];
    if (!v.is_number() || v.get<double>() < 0.0 || v.get<double>() > 1.0)
      throw EnvError(bad, what + ": 'hop_reward' must be a number in [0, 1], got " + v.dump());
    config.hop_reward = v.get<double>();
  }
  if (c.contains("inline_corpus")) {
    if (!c["inline_corpus"].is_boolean())
      throw EnvError(bad, what + ": 'inline_corpus' must be true or false, got " + c["inline_corpus"].dump());
    config.inline_corpus = c["inline_corpus"].get<bool>();
  }
  return config;
}

// The sentence of `text` with the most distinct query terms (earliest on ties), cut to size.
std::string snippet(const std::string& text, const std::vector<std::string>& query_terms) {
  size_t best_start = 0, best_end = std::min(text.size(), kSnippetBytes);
  size_t best_hits = 0;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find(". ", start);
    end = end == std::string::npos ? text.size() : end + 1;
    size_t hits = 0;
    for (const std::string& t : Bm25Index::terms(std::string_view(text).substr(start, end - start)))
      if (std::find(query_terms.begin(), query_terms.end(), t) != query_terms.end()) ++hits;
    if (hits > best_hits) best_hits = hits, best_start = start, best_end = end;
    start = end;
    while (start < text.size() && (text[start] == ' ' || text[start] == '\n')) ++start;
  }
  std::string out = text.substr(best_start, std::min(best_end - best_start, kSnippetBytes));
  for (char& c : out)
    if (c == '\n') c = ' ';
  if (best_end - best_start > kSnippetBytes) out += "...";
  return out;
}

class Needle : public env::Environment {
 public:
  explicit Needle(const json& config) : config_(parse_config(config)) {
    add_tool({"search",
              "Ranks the corpus's documents against a keyword query (BM25) and returns the best ones with "
              "their ids, titles and a snippet.",
              {{"type", "object"},
               {"properties", {{"query", {{"type", "string"}, {"description", "keywords, e.g. a name"}}}}},
               {"required", {"query"}}}},
             [this](const json& args) { return search(args); });
    add_tool({"open",
              "Returns the text of a document, one page at a time: bytes [offset, offset + length).",
              {{"type", "object"},
               {"properties",
                {{"doc_id", {{"type", "string"}, {"description", "an id from search, e.g. d000042"}}},
                 {"offset", {{"type", "integer"}, {"minimum", 0}, {"description", "first byte, default 0"}}},
                 {"length", {{"type", "integer"}, {"minimum", 1}, {"description", "bytes to return"}}}}},
               {"required", {"doc_id"}}}},
             [this](const json& args) { return open(args); });
    add_tool({"answer",
              "Gives the final answer (a name) and ends the episode.",
              {{"type", "object"},
               {"properties", {{"value", {{"type", "string"}, {"description", "the answer, e.g. a name"}}}}},
               {"required", {"value"}}}},
             [this](const json& args) { return answer(args); });
  }

  env::Observation reset(const json& task, uint64_t seed) override {
    const uint64_t world_seed = world_seed_for(task, seed);
    build(world_seed);
    task_ = task;
    seed_ = seed;
    started_ = true;
    turn_ = 0;
    opened_.assign(corpus_.docs.size(), false);
    hop_found_.assign(corpus_.chain.size(), false);
    answered_ = false;
    answer_.clear();
    done_ = false;
    pending_.clear();
    searches_ = 0;
    opens_ = 0;

    env::Observation obs;
    obs.text = prompt();
    obs.info = {{"documents", corpus_.docs.size()},
                {"corpus_bytes", corpus_.bytes},
                {"generate_ms", generate_ms_},
                {"index_ms", index_ms_},
                {"terms", index_.term_count()},
                {"hops", corpus_.chain.size()},
                {"question", corpus_.question}};
    return obs;
  }

  env::Observation step(const env::Action& action) override {
    if (!started_) throw EnvError(ODY_ENV_ERR_INVALID_ACTION, "needle: step before reset");
    if (done_) throw EnvError(ODY_ENV_ERR_INVALID_ACTION, "needle: the episode is over; call score or reset");
    return Environment::step(action);
  }

  env::Score score() override {
    if (!started_) throw EnvError(ODY_ENV_ERR_INVALID_ACTION, "needle: score before reset");
    env::Score s;
    json chain = json::array();
    for (size_t k = 0; k < corpus_.chain.size(); ++k) {
      const GoldHop& hop = corpus_.chain[k];
      const double value = hop_found_[k] ? config_.hop_reward : 0.0;
      s.parts.push_back({"hop_" + std::to_string(k + 1), value});
      s.reward += value;
      chain.push_back({{"hop", k + 1},
                       {"doc_id", corpus_.docs[hop.doc].id},
                       {"title", corpus_.docs[hop.doc].title},
                       {"fact", hop.fact},
                       {"opened", static_cast<bool>(hop_found_[k])}});
    }
    const bool correct = answered_ && normalized(answer_) == normalized(corpus_.answer);
    s.parts.push_back({"correct", correct ? 1.0 : 0.0});
    s.reward += correct ? 1.0 : 0.0;
    s.success = correct;
    s.info = {{"question", corpus_.question},
              {"expected_answer", corpus_.answer},
              {"answer", answered_ ? json(answer_) : json(nullptr)},
              {"gold_chain", chain},
              {"turns", turn_},
              {"searches", searches_},
              {"opens", opens_},
              {"documents", corpus_.docs.size()},
              {"corpus_bytes", corpus_.bytes}};
    return s;
  }

  std::string snapshot() override {
    if (!started_) throw EnvError(ODY_ENV_ERR_INVALID_ACTION, "needle: snapshot before reset");
    json opened = json::array();
    for (size_t i = 0; i < opened_.size(); ++i)
      if (opened_[i]) opened.push_back(i);
    json hops = json::array();
    for (const bool b : hop_found_) hops.push_back(b);
    return json{{"env", "needle"},
                {"version", kSnapshotVersion},
                {"corpus_tokens", config_.corpus_tokens},
                {"documents", config_.documents},
                {"hops", config_.hops},
                {"task", task_},
                {"seed", seed_},
                {"turn", turn_},
                {"opened", opened},
                {"hop_found", hops},
                {"answered", answered_},
                {"answer", answer_},
                {"done", done_},
                {"searches", searches_},
                {"opens", opens_}}
        .dump();
  }

  void restore(std::string_view bytes) override {
    const json s = env::parse_snapshot(bytes, "needle", kSnapshotVersion);
    for (const char* key : {"corpus_tokens", "documents", "hops"}) {
      const uint64_t mine = key == std::string("corpus_tokens") ? config_.corpus_tokens
                            : key == std::string("documents")   ? config_.documents
                                                                : config_.hops;
      if (s.value(key, uint64_t{0}) != mine)
        throw EnvError(ODY_ENV_ERR_UNSUPPORTED, std::string("needle snapshot: taken with ") + key + "=" +
                                                    s[key].dump() + ", this instance has " + std::to_string(mine));
    }
    reset(s.at("task"), s.at("seed").get<uint64_t>());
    turn_ = s.at("turn").get<uint32_t>();
    for (const json& i : s.at("opened")) {
      const size_t d = i.get<size_t>();
      if (d >= opened_.size()) throw EnvError(ODY_ENV_ERR_UNSUPPORTED, "needle snapshot: opened document out of range");
      opened_[d] = true;
    }
    const json& hops = s.at("hop_found");
    if (hops.size() != hop_found_.size()) throw EnvError(ODY_ENV_ERR_UNSUPPORTED, "needle snapshot: wrong hop count");
    for (size_t k = 0; k < hops.size(); ++k) hop_found_[k] = hops[k].get<bool>();
    answered_ = s.at("answered").get<bool>();
    answer_ = s.at("answer").get<std::string>();
    done_ = s.at("done").get<bool>();
    searches_ = s.at("searches").get<uint32_t>();
    opens_ = s.at("opens").get<uint32_t>();
  }

 protected:
  void on_turn(const env::Action& action, env::Observation& obs) override {
    ++turn_;
    obs.rewards = std::move(pending_);
    pending_.clear();
    if (answered_) {
      done_ = true;
    } else if (turn_ >= config_.max_turns) {
      done_ = true;
      obs.text = "Turn limit (" + std::to_string(config_.max_turns) + ") reached without an answer.";
    } else if (action.tool_calls.empty()) {
      obs.text = "No tool was called. Use search and open to find the answer, then answer with the name.";
    }
    obs.done = done_;
  }

 private:
  CorpusOptions corpus_options() const {
    CorpusOptions options;
    options.target_bytes = config_.corpus_tokens;
    options.documents = config_.documents;
    options.hops = config_.hops;
    return options;
  }

  // The generator seed of a task; see the split rule at the top of this file.
  uint64_t world_seed_for(const json& task, uint64_t seed) const {
    env::check_keys(task, {"split", "index"}, "needle task", ODY_ENV_ERR_INVALID_TASK);
    bool eval = false;
    uint64_t index = seed;
    if (!task.empty()) {
      if (!task.contains("split") || !task.contains("index"))
        throw EnvError(ODY_ENV_ERR_INVALID_TASK, "needle task: give both 'split' and 'index', or neither");
      const json& split = task["split"];
      if (!split.is_string() || (split != "train" && split != "eval"))
        throw EnvError(ODY_ENV_ERR_INVALID_TASK, "needle task: 'split' must be \"train\" or \"eval\", got " + split.dump());
      eval = split == "eval";
      index = env::integer_field(task, "index", 0, 0, UINT64_MAX, "needle task", ODY_ENV_ERR_INVALID_TASK);
    }
    const CorpusOptions options = corpus_options();
    for (uint64_t attempt = 0; attempt < kMaxAttempts; ++attempt) {
      const uint64_t candidate = env::splitmix64(env::splitmix64(index) + attempt);
      try {
        const auto [question, answer] = generate_question(options, candidate);
        if (in_eval(question, answer) == eval) return candidate;
      } catch (const std::invalid_argument& e) {
        throw EnvError(ODY_ENV_ERR_INVALID_CONFIG, std::string("needle: ") + e.what());
      }
    }
    throw EnvError(ODY_ENV_ERR_INVALID_TASK, "needle task: no question of that split in " + std::to_string(kMaxAttempts) +
                                                 " attempts");
  }

  void build(uint64_t world_seed) {
    if (built_ && world_seed == world_seed_) return;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      corpus_ = generate_corpus(corpus_options(), world_seed);
    } catch (const std::invalid_argument& e) {
      throw EnvError(ODY_ENV_ERR_INVALID_CONFIG, std::string("needle: ") + e.what());
    }
    const auto t1 = std::chrono::steady_clock::now();
    index_.build(corpus_.docs);
    const auto t2 = std::chrono::steady_clock::now();
    generate_ms_ = std::chrono::duration<double, std::milli>(t1 - t0).count();
    index_ms_ = std::chrono::duration<double, std::milli>(t2 - t1).count();
    world_seed_ = world_seed;
    built_ = true;
  }

  std::string prompt() const {
    if (config_.inline_corpus) return inline_corpus() + "\n\n" + instructions();
    return instructions();
  }

  // Every document in id order (ids are a random permutation, so the gold pages sit anywhere).
  std::string inline_corpus() const {
    std::vector<const Document*> order;
    order.reserve(corpus_.docs.size());
    for (const Document& d : corpus_.docs) order.push_back(&d);
    std::sort(order.begin(), order.end(), [](const Document* a, const Document* b) { return a->id < b->id; });
    std::string out = "The corpus (" + std::to_string(order.size()) + " documents):";
    out.reserve(corpus_.bytes + 16 * order.size() + 64);
    for (const Document* d : order) out += "\n\n[" + d->id + "] " + d->title + "\n" + d->text;
    return out;
  }

  std::string instructions() const {
    return "You have a corpus of " + std::to_string(corpus_.docs.size()) + " documents (about " +
           std::to_string(corpus_.bytes) +
           " bytes) and a question. Answer it by searching and reading: the answer is a name, and finding it "
           "takes chaining facts across " +
           std::to_string(corpus_.chain.size()) +
           " documents. Entity pages state the facts; some notices quote claims that were retracted, and "
           "some names differ by a single letter.\n"
           "Tools: search {\"query\"} lists the best matching documents with ids, titles and snippets; "
           "open {\"doc_id\", \"offset\", \"length\"} returns a document's text a page at a time; "
           "answer {\"value\"} gives your final answer and ends the episode. You have " +
           std::to_string(config_.max_turns) + " turns.\n\nQuestion: " + corpus_.question;
  }

  void require_open_episode() const {
    if (answered_) throw ToolError("the episode is over: an answer was already given");
  }

  std::string search(const json& args) {
    require_open_episode();
    const std::string query = string_argument(args, "query").get<std::string>();
    if (query.size() > kMaxQueryBytes)
      throw ToolError("query is " + std::to_string(query.size()) + " bytes; the limit is " +
                      std::to_string(kMaxQueryBytes));
    const std::vector<std::string> terms = Bm25Index::terms(query);
    if (terms.empty()) throw ToolError("query has no words to search for (letters or digits)");
    ++searches_;
    size_t matched = 0;
    const auto hits = index_.search(query, config_.results_per_search, &matched);
    if (hits.empty()) return "No document matches \"" + query + "\".";
    std::string out = "Results for \"" + query + "\" (" + std::to_string(hits.size()) + " of " +
                      std::to_string(matched) + " matching documents):";
    for (const auto& hit : hits) {
      const Document& d = corpus_.docs[hit.doc];
      out += "\n[" + d.id + "] " + d.title + "\n    " + snippet(d.text, terms);
    }
    return out;
  }

  std::string open(const json& args) {
    require_open_episode();
    const std::string id = string_argument(args, "doc_id").get<std::string>();
    const size_t doc = parse_id(id);
    const Document& d = corpus_.docs[doc];
    const uint64_t offset = argument_integer(args, "offset", 0);
    const uint64_t length = std::min(argument_integer(args, "length", config_.page_bytes), kMaxOpenBytes);
    if (length == 0) throw ToolError("argument 'length' must be at least 1");
    if (offset > d.text.size() || (offset == d.text.size() && offset > 0))
      throw ToolError("offset " + std::to_string(offset) + " is past the end of " + id + " (" +
                      std::to_string(d.text.size()) + " bytes)");
    ++opens_;
    if (!opened_[doc]) {
      opened_[doc] = true;
      for (size_t k = 0; k < corpus_.chain.size(); ++k) {
        if (corpus_.chain[k].doc == doc && !hop_found_[k]) {
          hop_found_[k] = true;
          pending_.push_back({"hop_" + std::to_string(k + 1), config_.hop_reward});
        }
      }
    }
    const uint64_t end = std::min<uint64_t>(d.text.size(), offset + length);
    std::string out = "[" + d.id + "] " + d.title + " (bytes " + std::to_string(offset) + "-" + std::to_string(end) +
                      " of " + std::to_string(d.text.size()) + ")\n";
    out.append(d.text, offset, end - offset);
    if (end < d.text.size()) out += "\n[more: open " + d.id + " with offset=" + std::to_string(end) + "]";
    return out;
  }

  std::string answer(const json& args) {
    require_open_episode();
    answer_ = string_argument(args, "value").get<std::string>();
    answered_ = true;
    const bool correct = normalized(answer_) == normalized(corpus_.answer);
    pending_.push_back({"correct", correct ? 1.0 : 0.0});
    return "Answer recorded: \"" + answer_ + "\".";
  }

  size_t parse_id(const std::string& id) const {
    const std::string hint = " (ids look like d000042, from d000000 to " +
                             (corpus_.docs.empty() ? std::string("none") : corpus_.docs.back().id) + ")";
    if (id.size() != 7 || id[0] != 'd') throw ToolError("unknown doc_id '" + id + "'" + hint);
    size_t n = 0;
    for (size_t i = 1; i < id.size(); ++i) {
      if (id[i] < '0' || id[i] > '9') throw ToolError("unknown doc_id '" + id + "'" + hint);
      n = n * 10 + static_cast<size_t>(id[i] - '0');
    }
    if (n >= corpus_.docs.size()) throw ToolError("unknown doc_id '" + id + "'" + hint);
    return n;
  }

  static uint64_t argument_integer(const json& args, const char* key, uint64_t fallback) {
    if (!args.contains(key)) return fallback;
    const json& v = args[key];
    if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<int64_t>() < 0))
      throw ToolError(std::string("argument '") + key + "' must be a non-negative integer, got " + v.dump());
    return v.get<uint64_t>();
  }

  Config config_;
  Corpus corpus_;
  Bm25Index index_;
  bool built_ = false;
  uint64_t world_seed_ = 0;
  double generate_ms_ = 0;
  double index_ms_ = 0;

  json task_ = json::object();
  uint64_t seed_ = 0;
  bool started_ = false;
  uint32_t turn_ = 0;
  std::vector<bool> opened_;
  std::vector<bool> hop_found_;
  bool answered_ = false;
  std::string answer_;
  bool done_ = false;
  std::vector<env::RewardPart> pending_;
  uint32_t searches_ = 0;
  uint32_t opens_ = 0;
};

}  // namespace
}  // namespace odyssey::needle

ODY_ENV_PLUGIN_WITH_SNAPSHOT(odyssey::needle::Needle, "needle", "1.0.0",
                             "Multi-hop retrieval over a generated corpus with search, open and answer")
