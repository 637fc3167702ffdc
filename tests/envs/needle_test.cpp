// The built-in needle environment (envs/builtin/needle), loaded as a plugin through the C ABI:
// a scripted searcher that reads only what the tools return follows the question's chain and
// earns every reward, grading is exact after normalization, the corpus has the requested size
// and builds fast, episodes are deterministic, the train/eval splits are disjoint, long
// documents page, and snapshots resume exactly.
#include <cctype>
#include <chrono>
#include <cstdio>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "envs/conformance.h"
#include "envs/env_test_helpers.h"
#include "envs/plugin.h"

namespace odyssey::envs {
namespace {

using nlohmann::json;

std::shared_ptr<Plugin> needle_plugin() { return test_support::builtin_plugin("needle"); }

std::unique_ptr<EnvSession> make_session(const json& config = json::object()) {
  return test_support::builtin_session("needle", config);
}

env::Action call(const std::string& tool, const json& arguments) { return test_support::tool_call(tool, arguments); }

using test_support::reset;
using test_support::score;
using test_support::step;
using test_support::part;
// The content of the single tool result of `obs` (and that it is not an error).
std::string result(const env::Observation& obs) {
  EXPECT_EQ(obs.tool_results.size(), 1u);
  if (obs.tool_results.empty()) return "";
  EXPECT_FALSE(obs.tool_results[0].is_error) << obs.tool_results[0].content;
  return obs.tool_results[0].content;
}
std::string question_of(const std::string& prompt) {
  const size_t at = prompt.find("Question: ");
  EXPECT_NE(at, std::string::npos) << prompt;
  return at == std::string::npos ? "" : prompt.substr(at + 10);
}

// ---- a scripted searcher -----------------------------------------------------------------
// It knows the question grammar and how pages word each relation (as a reader of English
// would), nothing else: every name comes from the tools' output.

struct Relation {
  std::string prefix, suffix;        // question phrase: prefix + X + suffix
  std::vector<std::string> clauses;  // page wordings with S (subject) and O (the name to read)
};

const std::vector<Relation>& relations() {
  static const std::vector<Relation> r = {
      {"the mentor of ", "", {"S was mentored by O", "S trained under O", "the mentor of S was O"}},
      {"the city where ", " was born", {"S was born in O", "the birthplace of S is O", "S is a native of O"}},
      {"the company that employs ", "", {"S works for O", "S is employed by O", "S holds a position at O"}},
      {"the company founded by ", "", {"S founded O", "S is the founder of O", "S established O"}},
      {"the city where ", " is headquartered",
       {"S is headquartered in O", "the head office of S is in O", "S has its headquarters in O"}},
      {"the founder of ", "", {"S was founded by O", "S was established by O", "the founder of S is O"}},
      {"the chief executive of ", "",
       {"the chief executive of S is O", "S is run by chief executive O", "O serves as chief executive of S"}},
      {"the lead engineer of ", "", {"S is led by O", "the lead engineer of S is O", "O leads S"}},
      {"the sponsor of ", "", {"S is sponsored by O", "S receives its funding from its sponsor O", "the sponsor of S is O"}},
      {"the mayor of ", "", {"the mayor of S is O", "S is governed by mayor O", "O serves as mayor of S"}},
      {"the country in which ", " lies", {"S is a city in O", "S lies in O", "S is located in the country of O"}},
      {"the capital of ", "", {"the capital of S is O", "O is the capital of S", "S has its capital at O"}},
  };
  return r;
}

bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }
bool ends_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

// "the company founded by the mentor of Ilsa Varkon" -> start "Ilsa Varkon", relations from the
// innermost out.
void parse_phrase(const std::string& phrase, std::string* start, std::vector<const Relation*>* chain) {
  for (const Relation& r : relations()) {
    if (starts_with(phrase, r.prefix) && ends_with(phrase, r.suffix) && phrase.size() > r.prefix.size() + r.suffix.size()) {
      // "the city where" has two suffixes; the other one must not fit inside.
      parse_phrase(phrase.substr(r.prefix.size(), phrase.size() - r.prefix.size() - r.suffix.size()), start, chain);
      chain->push_back(&r);
      return;
    }
  }
  *start = phrase;
}

// Every sentence of `page` (split at ". "), each without its final period.
std::vector<std::string> sentences(const std::string& page) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < page.size()) {
    size_t end = page.find(". ", at);
    if (end == std::string::npos) end = page.size();
    std::string s = page.substr(at, end - at);
    if (!s.empty() && s.back() == '.') s.pop_back();
    out.push_back(s);
    at = end + 2;
  }
  return out;
}

// The O of `clause` in a sentence about subject `s`, if the sentence is that clause.
std::optional<std::string> read_clause(const std::string& sentence, const std::string& clause, const std::string& s) {
  const size_t o = clause.find('O');  // split first: the subject's name may contain an 'O'
  auto fill = [&](const std::string& part) {
    std::string out;
    for (const char c : part) out += c == 'S' ? s : std::string(1, c);
    return out;
  };
  std::string before = fill(clause.substr(0, o));
  const std::string after = fill(clause.substr(o + 1));
  if (!before.empty()) before[0] = static_cast<char>(std::toupper(before[0]));  // sentences start capitalized
  if (sentence.size() <= before.size() + after.size() || !starts_with(sentence, before) || !ends_with(sentence, after))
    return std::nullopt;
  return sentence.substr(before.size(), sentence.size() - before.size() - after.size());
}

struct SearchHit {
  std::string id, title;
};
std::vector<SearchHit> parse_results(const std::string& text) {
  std::vector<SearchHit> hits;
  size_t at = 0;
  while ((at = text.find("\n[d", at)) != std::string::npos) {
    const size_t close = text.find("] ", at);
    const size_t eol = text.find('\n', close);
    hits.push_back({text.substr(at + 2, close - at - 2), text.substr(close + 2, eol - close - 2)});
    at = eol;
  }
  return hits;
}

// Opens document `id` page by page until its end; returns the whole text.
std::string read_document(EnvSession& s, const std::string& id, std::vector<env::RewardPart>* rewards) {
  std::string text;
  int64_t offset = 0;
  for (;;) {
    const env::Observation obs = step(s, call("open", {{"doc_id", id}, {"offset", offset}}));
    for (const auto& r : obs.rewards) rewards->push_back(r);
    const std::string page = result(obs);
    const size_t header_end = page.find('\n');
    std::string body = page.substr(header_end + 1);
    const size_t more = body.find("\n[more: open ");
    if (more == std::string::npos) return text + body;
    const size_t eq = body.find("offset=", more);
    offset = std::stoll(body.substr(eq + 7));
    text += body.substr(0, more);
  }
}

struct Solved {
  std::string answer;
  std::vector<env::RewardPart> rewards;
  std::vector<std::string> opened;  // page ids, in order
};

// Follows the chain: search the current name, open its page (title == name), read the relation.
Solved solve(EnvSession& s, const std::string& prompt) {
  Solved out;
  std::string question = question_of(prompt);
  EXPECT_TRUE(starts_with(question, "What is the name of ") && ends_with(question, "?")) << question;
  std::string name;
  std::vector<const Relation*> chain;
  parse_phrase(question.substr(20, question.size() - 21), &name, &chain);
  EXPECT_FALSE(chain.empty()) << question;
  for (const Relation* r : chain) {
    const env::Observation found = step(s, call("search", {{"query", name}}));
    const std::vector<SearchHit> hits = parse_results(result(found));
    const SearchHit* page = nullptr;
    for (const SearchHit& h : hits)
      if (h.title == name && page == nullptr) page = &h;
    if (page == nullptr) {
      ADD_FAILURE() << "no page titled '" << name << "' among the results:\n" << result(found);
      return out;
    }
    EXPECT_EQ(hits[0].title, name) << "BM25 should rank the page of the searched name first";
    out.opened.push_back(page->id);
    const std::string text = read_document(s, page->id, &out.rewards);
    std::optional<std::string> next;
    for (const std::string& sentence : sentences(text))
      for (const std::string& clause : r->clauses)
        if (!next) next = read_clause(sentence, clause, name);
    if (!next) {
      ADD_FAILURE() << "the page of '" << name << "' states no '" << r->prefix << "' fact:\n" << text;
      return out;
    }
    name = *next;
  }
  out.answer = name;
  return out;
}

// ---- tests ---------------------------------------------------------------------------------

TEST(NeedleEnv, AScriptedSearcherFollowsTheChainAndEarnsEveryReward) {
  auto s = make_session();  // the default: a 1M-byte corpus, 2 hops
  ASSERT_TRUE(s);
  const env::Observation first = reset(*s, json::object(), /*seed=*/11);
  EXPECT_TRUE(first.tool_results.empty());
  EXPECT_FALSE(first.done);
  const Solved solved = solve(*s, first.text);
  ASSERT_EQ(solved.rewards.size(), 2u) << "one reward per gold page";
  EXPECT_EQ(solved.rewards[0].name, "hop_1");
  EXPECT_EQ(solved.rewards[1].name, "hop_2");
  EXPECT_DOUBLE_EQ(solved.rewards[0].value, 0.1);

  const env::Observation last = step(*s, call("answer", {{"value", solved.answer}}));
  EXPECT_TRUE(last.done);
  ASSERT_EQ(last.rewards.size(), 1u);
  EXPECT_EQ(last.rewards[0].name, "correct");
  EXPECT_DOUBLE_EQ(last.rewards[0].value, 1.0);

  const env::Score sc = score(*s);
  EXPECT_TRUE(sc.success);
  EXPECT_DOUBLE_EQ(sc.reward, 1.2);
  EXPECT_DOUBLE_EQ(part(sc, "hop_1"), 0.1);
  EXPECT_DOUBLE_EQ(part(sc, "hop_2"), 0.1);
  EXPECT_DOUBLE_EQ(part(sc, "correct"), 1.0);
  EXPECT_EQ(sc.info["expected_answer"], solved.answer);
  ASSERT_EQ(sc.info["gold_chain"].size(), 2u);
  EXPECT_EQ(sc.info["gold_chain"][0]["doc_id"], solved.opened[0]);
  EXPECT_EQ(sc.info["gold_chain"][1]["doc_id"], solved.opened[1]);
}

TEST(NeedleEnv, EveryGeneratedQuestionIsAnswerableFromThePages) {
  // Many worlds, up to 4 hops: the chain's facts are on the pages and the searcher finds them.
  for (uint32_t hops = 1; hops <= 4; ++hops) {
    auto s = make_session({{"corpus_tokens", 60000}, {"hops", hops}});
    ASSERT_TRUE(s);
    for (uint64_t seed = 0; seed < 6; ++seed) {
      const Solved solved = solve(*s, reset(*s, json::object(), seed).text);
      EXPECT_EQ(solved.rewards.size(), hops) << "hops " << hops << " seed " << seed;
      step(*s, call("answer", {{"value", solved.answer}}));
      const env::Score sc = score(*s);
      EXPECT_TRUE(sc.success) << "hops " << hops << " seed " << seed << ": " << sc.info.dump(2);
      EXPECT_DOUBLE_EQ(sc.reward, 1.0 + 0.1 * hops);
    }
  }
}

TEST(NeedleEnv, WrongAnswersEarnNoCorrectnessReward) {
  auto s = make_session({{"corpus_tokens", 100000}});
  ASSERT_TRUE(s);
  // A guess without reading anything scores exactly 0.
  reset(*s, json::object(), 3);
  EXPECT_TRUE(step(*s, call("answer", {{"value", "Nobody In Particular"}})).done);
  env::Score sc = score(*s);
  EXPECT_FALSE(sc.success);
  EXPECT_DOUBLE_EQ(sc.reward, 0.0);
  EXPECT_DOUBLE_EQ(part(sc, "correct"), 0.0);

  // Following the chain but answering a near miss keeps only the hop rewards.
  const Solved solved = solve(*s, reset(*s, json::object(), 3).text);
  std::string near_miss = solved.answer;
  near_miss.back() = near_miss.back() == 'x' ? 'y' : 'x';
  const env::Observation last = step(*s, call("answer", {{"value", near_miss}}));
  ASSERT_EQ(last.rewards.size(), 1u);
  EXPECT_DOUBLE_EQ(last.rewards[0].value, 0.0);
  sc = score(*s);
  EXPECT_FALSE(sc.success);
  EXPECT_DOUBLE_EQ(part(sc, "correct"), 0.0);
  EXPECT_DOUBLE_EQ(sc.reward, 0.2);

  // Case, spacing and punctuation do not matter.
  reset(*s, json::object(), 3);
  std::string shouted;
  for (const char c : solved.answer) shouted += static_cast<char>(std::toupper(c));
  step(*s, call("answer", {{"value", "  " + shouted + ". "}}));
  EXPECT_TRUE(score(*s).success);
}

TEST(NeedleEnv, CorpusSizeIsWithinTenPercentOfTheTargetAndBuildsInUnderASecond) {
  for (const uint64_t target : {1000000ull, 250000ull, 20000ull}) {
    auto s = make_session({{"corpus_tokens", target}});
    ASSERT_TRUE(s);
    const auto t0 = std::chrono::steady_clock::now();
    const env::Observation obs = reset(*s, json::object(), 5);
    const double reset_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const double bytes = obs.info["corpus_bytes"].get<double>();
    std::printf("needle corpus_tokens=%llu: %.0f bytes in %u documents, %zu terms; generate %.1f ms, index %.1f ms, "
                "reset %.1f ms\n",
                static_cast<unsigned long long>(target), bytes, obs.info["documents"].get<unsigned>(),
                obs.info["terms"].get<size_t>(), obs.info["generate_ms"].get<double>(),
                obs.info["index_ms"].get<double>(), reset_ms);
    EXPECT_NEAR(bytes, static_cast<double>(target), 0.1 * static_cast<double>(target));
    if (target == 1000000) {
      EXPECT_EQ(obs.info["documents"], 1000);
      EXPECT_LT(obs.info["generate_ms"].get<double>() + obs.info["index_ms"].get<double>(), 1000.0);
    }
  }
}

TEST(NeedleEnv, InlineCorpusPutsEveryDocumentInTheFirstObservationBeforeTheQuestion) {
  auto plain = make_session({{"corpus_tokens", 20000}});
  auto inlined = make_session({{"corpus_tokens", 20000}, {"inline_corpus", true}});
  ASSERT_TRUE(plain && inlined);
  const env::Observation short_obs = reset(*plain, json::object(), 9);
  const env::Observation long_obs = reset(*inlined, json::object(), 9);
  const auto documents = long_obs.info["documents"].get<size_t>();
  const auto bytes = long_obs.info["corpus_bytes"].get<size_t>();
  ASSERT_LT(short_obs.text.size(), 2000u);
  // The corpus, then the same instructions and question as the searching form.
  EXPECT_EQ(long_obs.text.substr(long_obs.text.size() - short_obs.text.size()), short_obs.text);
  EXPECT_EQ(long_obs.text.rfind("The corpus (" + std::to_string(documents) + " documents):", 0), 0u);
  EXPECT_GT(long_obs.text.size(), bytes + short_obs.text.size());
  EXPECT_LT(long_obs.text.size(), bytes + short_obs.text.size() + 40 * documents);
  size_t headers = 0, at = 0;
  std::string previous;
  while ((at = long_obs.text.find("\n\n[d", at)) != std::string::npos) {
    const std::string id = long_obs.text.substr(at + 3, long_obs.text.find(']', at) - at - 3);
    EXPECT_LT(previous, id) << "documents are in id order";
    previous = id;
    ++headers, ++at;
  }
  EXPECT_EQ(headers, documents);
  // The tools still work on the inlined corpus.
  const env::Observation found = step(*inlined, call("search", {{"query", "mentor"}}));
  EXPECT_NE(result(found).find("Results for"), std::string::npos) << result(found);
}

TEST(NeedleEnv, TheSameTaskAndSeedGiveTheSameEpisode) {
  const json config = {{"corpus_tokens", 100000}};
  auto a = make_session(config), b = make_session(config);
  ASSERT_TRUE(a && b);
  const std::string prompt = reset(*a, json::object(), 42).text;
  EXPECT_EQ(reset(*b, json::object(), 42).text, prompt);
  const auto search = call("search", {{"query", "mayor annual review"}});
  EXPECT_EQ(result(step(*a, search)), result(step(*b, search)));
  const auto open = call("open", {{"doc_id", "d000007"}});
  EXPECT_EQ(result(step(*a, open)), result(step(*b, open)));
  EXPECT_EQ(score(*a).info["gold_chain"], score(*b).info["gold_chain"]);

  EXPECT_NE(reset(*b, json::object(), 43).text, prompt) << "another seed, another question";
  EXPECT_EQ(reset(*b, json::object(), 42).text, prompt) << "an instance reset again gives it back";

  // A split task is fixed: the seed does not matter. {} with seed S is train task S.
  const json task = {{"split", "train"}, {"index", 5}};
  EXPECT_EQ(reset(*a, task, 1).text, reset(*b, task, 999).text);
  EXPECT_EQ(reset(*a, json::object(), 5).text, reset(*b, task, 0).text);
}

TEST(NeedleEnv, TrainAndEvalTasksAreDisjoint) {
  auto s = make_session({{"corpus_tokens", 20000}});
  ASSERT_TRUE(s);
  std::set<std::string> train, eval;
  for (int i = 0; i < 40; ++i) {
    reset(*s, {{"split", "train"}, {"index", i}});
    train.insert(score(*s).info["question"].get<std::string>() + " => " + score(*s).info["expected_answer"].get<std::string>());
    reset(*s, {{"split", "eval"}, {"index", i}});
    eval.insert(score(*s).info["question"].get<std::string>() + " => " + score(*s).info["expected_answer"].get<std::string>());
  }
  EXPECT_EQ(train.size(), 40u) << "train tasks are distinct";
  EXPECT_EQ(eval.size(), 40u) << "eval tasks are distinct";
  for (const std::string& q : eval) EXPECT_EQ(train.count(q), 0u) << "in both splits: " << q;
}

TEST(NeedleEnv, LongDocumentsAreReadPageByPage) {
  auto s = make_session({{"corpus_tokens", 200000}, {"page_bytes", 500}});
  ASSERT_TRUE(s);
  reset(*s, json::object(), 9);
  // Find a document longer than three pages by its header ("bytes 0-1 of N").
  std::string id;
  size_t size = 0;
  for (int d = 0; d < 200 && id.empty(); ++d) {
    char name[16];
    std::snprintf(name, sizeof(name), "d%06d", d);
    const std::string head = result(step(*s, call("open", {{"doc_id", name}, {"length", 1}})));
    size = std::stoul(head.substr(head.rfind(" of ") + 4));
    if (size > 1500) id = name;
  }
  ASSERT_FALSE(id.empty());
  std::vector<env::RewardPart> rewards;
  const std::string paged = read_document(*s, id, &rewards);
  EXPECT_EQ(paged.size(), size);
  const std::string whole = result(step(*s, call("open", {{"doc_id", id}, {"length", 65536}})));
  EXPECT_EQ(whole.substr(whole.find('\n') + 1), paged);
  EXPECT_NE(whole.find("(bytes 0-" + std::to_string(size) + " of " + std::to_string(size) + ")"), std::string::npos);
}

TEST(NeedleEnv, BadToolArgumentsAreToolErrorsAndTheEpisodeGoesOn) {
  auto s = make_session({{"corpus_tokens", 20000}, {"max_turns", 10}});
  ASSERT_TRUE(s);
  reset(*s, json::object(), 1);
  auto error_of = [&](const env::Action& a) {
    const env::Observation obs = step(*s, a);
    EXPECT_FALSE(obs.done);
    EXPECT_EQ(obs.tool_results.size(), 1u);
    if (obs.tool_results.empty()) return std::string();
    EXPECT_TRUE(obs.tool_results[0].is_error) << obs.tool_results[0].content;
    return obs.tool_results[0].content;
  };
  EXPECT_NE(error_of(call("open", {{"doc_id", "d999999"}})).find("unknown doc_id 'd999999'"), std::string::npos);
  EXPECT_NE(error_of(call("open", {{"doc_id", "42"}})).find("ids look like"), std::string::npos);
  EXPECT_NE(error_of(call("open", {{"doc_id", "d000001"}, {"offset", 10000000}})).find("past the end"), std::string::npos);
  EXPECT_NE(error_of(call("search", {{"query", "?!  ..."}})).find("no words"), std::string::npos);
  EXPECT_NE(error_of(call("search", {{"query", std::string(3000, 'a')}})).find("limit"), std::string::npos);

  // The answer ends the episode; a call after it in the same turn is refused, and so is a
  // further step.
  env::Action both = {"", {{"c1", "answer", {{"value", "x"}}}, {"c2", "search", {{"query", "x"}}}}};
  const env::Observation last = step(*s, both);
  EXPECT_TRUE(last.done);
  ASSERT_EQ(last.tool_results.size(), 2u);
  EXPECT_FALSE(last.tool_results[0].is_error);
  EXPECT_TRUE(last.tool_results[1].is_error);
  EXPECT_FALSE(s->step(call("search", {{"query", "x"}})).ok());
}

TEST(NeedleEnv, TheTurnLimitEndsAnUnansweredEpisode) {
  auto s = make_session({{"corpus_tokens", 20000}, {"max_turns", 2}});
  ASSERT_TRUE(s);
  reset(*s, json::object(), 1);
  EXPECT_FALSE(step(*s, call("search", {{"query", "river"}})).done);
  const env::Observation last = step(*s, env::Action{"I am thinking.", {}});
  EXPECT_TRUE(last.done);
  EXPECT_NE(last.text.find("Turn limit"), std::string::npos);
  const env::Score sc = score(*s);
  EXPECT_FALSE(sc.success);
  EXPECT_TRUE(sc.info["answer"].is_null());
}

TEST(NeedleEnv, BadConfigsAndTasksAreRefusedNamingTheField) {
  auto plugin = needle_plugin();
  ASSERT_TRUE(plugin);
  auto refused = [&](const json& config) {
    auto s = plugin->create(config);
    EXPECT_FALSE(s.ok()) << config.dump();
    return s.ok() ? std::string() : s.status().message();
  };
  EXPECT_NE(refused({{"corpus_token", 5000}}).find("did you mean 'corpus_tokens'"), std::string::npos);
  EXPECT_NE(refused({{"hops", 0}}).find("'hops'"), std::string::npos);
  EXPECT_NE(refused({{"hops", "two"}}).find("'hops'"), std::string::npos);
  EXPECT_NE(refused({{"corpus_tokens", -1}}).find("'corpus_tokens'"), std::string::npos);
  EXPECT_NE(refused({{"corpus_tokens", 10000}, {"documents", 2000}}).find("documents"), std::string::npos);
  EXPECT_NE(refused({{"hop_reward", 3}}).find("'hop_reward'"), std::string::npos);
  EXPECT_NE(refused({{"inline_corpus", "yes"}}).find("'inline_corpus'"), std::string::npos);

  auto s = make_session({{"corpus_tokens", 20000}});
  ASSERT_TRUE(s);
  auto bad_task = [&](const json& task) {
    auto obs = s->reset(task, 0);
    EXPECT_FALSE(obs.ok()) << task.dump();
    return obs.ok() ? std::string() : obs.status().message();
  };
  EXPECT_NE(bad_task({{"split", "test"}, {"index", 1}}).find("'split'"), std::string::npos);
  EXPECT_NE(bad_task({{"split", "train"}}).find("'index'"), std::string::npos);
  EXPECT_NE(bad_task({{"split", "train"}, {"index", -3}}).find("'index'"), std::string::npos);
  EXPECT_NE(bad_task({{"level", 3}}).find("'level'"), std::string::npos);
  EXPECT_FALSE(s->step(call("search", {{"query", "x"}})).ok()) << "no episode was started";
}

TEST(NeedleEnv, ASnapshotResumesTheEpisodeInAFreshInstance) {
  const json config = {{"corpus_tokens", 100000}};
  auto a = make_session(config);
  ASSERT_TRUE(a);
  const std::string prompt = reset(*a, json::object(), 21).text;
  const Solved solved = solve(*a, prompt);  // both hops opened, not yet answered
  auto bytes = a->snapshot();
  ASSERT_TRUE(bytes.ok()) << bytes.status().to_string();

  auto b = make_session(config);
  ASSERT_TRUE(b);
  ASSERT_TRUE(b->restore(*bytes).ok());
  // Hops already earned are not paid twice; the answer finishes the restored episode.
  EXPECT_TRUE(step(*b, call("open", {{"doc_id", solved.opened[0]}})).rewards.empty());
  step(*b, call("answer", {{"value", solved.answer}}));
  step(*a, call("open", {{"doc_id", solved.opened[0]}}));
  step(*a, call("answer", {{"value", solved.answer}}));
  const env::Score from_a = score(*a), from_b = score(*b);
  EXPECT_TRUE(from_b.success);
  EXPECT_DOUBLE_EQ(from_b.reward, from_a.reward);
  EXPECT_EQ(from_b.info, from_a.info);

  EXPECT_FALSE(b->restore("{\"env\": \"needle\", \"version\": 7}").ok());
  EXPECT_FALSE(b->restore("not json").ok());
  auto other = make_session({{"corpus_tokens", 50000}});
  ASSERT_TRUE(other);
  const Status refused = other->restore(*bytes);
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("corpus_tokens"), std::string::npos) << refused.message();
}

TEST(NeedleEnv, PassesTheConformanceSuite) {
  auto plugin = needle_plugin();
  ASSERT_TRUE(plugin);
  const json config = {{"corpus_tokens", 20000}};
  const ConformanceReport report = run_conformance(
      [plugin, config]() -> Result<std::unique_ptr<EnvSession>> { return plugin->create(config); }, ConformanceOptions{});
  EXPECT_TRUE(report.passed()) << report.to_text();
  for (const CheckResult& c : report.checks) {
    if (c.name == "determinism") continue;  // reset's info holds generation and index timings
    EXPECT_NE(c.outcome, CheckOutcome::kWarn) << c.name << ": " << c.detail;
  }
}

}  // namespace
}  // namespace odyssey::envs
