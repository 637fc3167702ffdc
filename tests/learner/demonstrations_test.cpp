// Demonstrations for pretraining (learner/demonstrations.h): the scripted expert plays the real
// arith plugin, its episodes decode to the actors' transcript format, its tool calls parse with
// TurnParser as the right answer, the loss mask is exactly the expert's turns, no eval-split
// problem ever appears, and packing keeps documents whole.
#include <cctype>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/tokenizer.h"
#include "envs/plugin.h"
#include "envs/turn.h"
#include "learner/demonstrations.h"

namespace odyssey::learner {
namespace {

using nlohmann::json;

const json kEasiest = {{"min_steps", 1}, {"max_steps", 1}, {"max_operand", 9}};

std::shared_ptr<envs::Plugin> arith() {
  static std::shared_ptr<envs::Plugin> plugin = [] {
    auto path = envs::find_plugin("arith");
    EXPECT_TRUE(path.ok()) << path.status().to_string();
    auto loaded = envs::Plugin::load(*path);
    EXPECT_TRUE(loaded.ok()) << loaded.status().to_string();
    return loaded.ok() ? *loaded : nullptr;
  }();
  return plugin;
}

std::unique_ptr<envs::EnvSession> session(const json& config) {
  auto s = arith()->create(config);
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  return s.ok() ? std::move(s).value() : nullptr;
}

std::string prompt_of(const json& config, const json& task) {
  auto s = session(config);
  auto obs = s->reset(task, 0);
  EXPECT_TRUE(obs.ok());
  return obs.ok() ? obs->text : "";
}

// "a?b=?" computed here, independently of the environment.
int64_t solve_one_step(const std::string& prompt) {
  EXPECT_EQ(prompt.size(), 5u) << prompt;
  const int64_t a = prompt[0] - '0', b = prompt[2] - '0';
  switch (prompt[1]) {
    case '+': return a + b;
    case '-': return a - b;
    case '*': return a * b;
    case '/': return a / b;
  }
  ADD_FAILURE() << "not a one-step problem: " << prompt;
  return 0;
}

// Runs of tokens with loss mask 1, as token vectors.
std::vector<std::vector<uint32_t>> expert_turns(const Document& doc) {
  std::vector<std::vector<uint32_t>> turns;
  for (size_t i = 0; i < doc.tokens.size(); ++i) {
    if (!doc.loss_mask[i]) continue;
    if (i == 0 || !doc.loss_mask[i - 1]) turns.emplace_back();
    turns.back().push_back(doc.tokens[i]);
  }
  return turns;
}

TEST(Demonstrations, DirectAnswerDecodesToTheActorsTranscriptAndParsesAsTheRightAnswer) {
  const ByteTokenizer tok;
  auto s = session(kEasiest);
  envs::TurnParser parser(arith()->info().tools);
  for (uint64_t index = 0; index < 20; ++index) {
    const json task = {{"split", "train"}, {"index", index}};
    const std::string prompt = prompt_of(kEasiest, task);
    const int64_t value = solve_one_step(prompt);
    auto demo = play_arith_expert(*s, tok, task, ArithStrategy::kAnswer);
    ASSERT_TRUE(demo.ok()) << demo.status().to_string();
    EXPECT_TRUE(demo->success);
    EXPECT_EQ(demo->turns, 1u);
    const std::string v = std::to_string(value);
    EXPECT_EQ(tok.decode(demo->document.tokens),
              "<|bos|><|user|>" + prompt + "<|end_turn|><|assistant|><|tool_call|>{\"name\":\"answer\",\"arguments\":{\"value\":" +
                  v + "}}<|/tool_call|><|end_turn|><|tool|><|tool_result|>recorded " + v +
                  "<|/tool_result|><|end_turn|><|eos|>");
    const auto turns = expert_turns(demo->document);
    ASSERT_EQ(turns.size(), 1u);
    parser.start_episode();
    const envs::ParsedTurn parsed = parser.parse(turns[0], tok);
    EXPECT_TRUE(parsed.rejected.empty());
    EXPECT_EQ(parsed.action.text, "");
    ASSERT_EQ(parsed.action.tool_calls.size(), 1u);
    EXPECT_EQ(parsed.action.tool_calls[0].name, "answer");
    EXPECT_EQ(parsed.action.tool_calls[0].arguments, (json{{"value", value}}));
  }
}

TEST(Demonstrations, WorkedAnswerWritesTheProblemOutAsTextBeforeTheCall) {
  const ByteTokenizer tok;
  auto s = session(kEasiest);
  envs::TurnParser parser(arith()->info().tools);
  const json task = {{"split", "train"}, {"index", 5}};
  const std::string prompt = prompt_of(kEasiest, task);
  const std::string v = std::to_string(solve_one_step(prompt));
  auto demo = play_arith_expert(*s, tok, task, ArithStrategy::kWorkedAnswer);
  ASSERT_TRUE(demo.ok()) << demo.status().to_string();
  EXPECT_EQ(tok.decode(demo->document.tokens),
            "<|bos|><|user|>" + prompt + "<|end_turn|><|assistant|>" + prompt.substr(0, 3) + "=" + v +
                "<|tool_call|>{\"name\":\"answer\",\"arguments\":{\"value\":" + v +
                "}}<|/tool_call|><|end_turn|><|tool|><|tool_result|>recorded " + v + "<|/tool_result|><|end_turn|><|eos|>");
  const auto turns = expert_turns(demo->document);
  ASSERT_EQ(turns.size(), 1u);
  const envs::ParsedTurn parsed = parser.parse(turns[0], tok);
  EXPECT_EQ(parsed.action.text, prompt.substr(0, 3) + "=" + v);
  ASSERT_EQ(parsed.action.tool_calls.size(), 1u);
  EXPECT_EQ(parsed.action.tool_calls[0].arguments["value"].get<int64_t>(), std::stoll(v));
}

TEST(Demonstrations, CalculatorFirstShowsTheEnvironmentsResultThenAnswersIt) {
  const ByteTokenizer tok;
  auto s = session(kEasiest);
  envs::TurnParser parser(arith()->info().tools);
  const json task = {{"split", "train"}, {"index", 3}};
  const std::string prompt = prompt_of(kEasiest, task);
  const std::string expression = prompt.substr(0, 3);
  const std::string v = std::to_string(solve_one_step(prompt));
  auto demo = play_arith_expert(*s, tok, task, ArithStrategy::kCalculator);
  ASSERT_TRUE(demo.ok()) << demo.status().to_string();
  EXPECT_EQ(demo->turns, 2u);
  EXPECT_EQ(tok.decode(demo->document.tokens),
            "<|bos|><|user|>" + prompt + "<|end_turn|><|assistant|><|tool_call|>{\"name\":\"calculator\",\"arguments\":" +
                "{\"expression\":\"" + expression + "\"}}<|/tool_call|><|end_turn|><|tool|><|tool_result|>" + v +
                "<|/tool_result|><|end_turn|><|assistant|><|tool_call|>{\"name\":\"answer\",\"arguments\":{\"value\":" +
                v + "}}<|/tool_call|><|end_turn|><|tool|><|tool_result|>recorded " + v +
                "<|/tool_result|><|end_turn|><|eos|>");
  const auto turns = expert_turns(demo->document);
  ASSERT_EQ(turns.size(), 2u);
  const envs::ParsedTurn first = parser.parse(turns[0], tok);
  ASSERT_EQ(first.action.tool_calls.size(), 1u);
  EXPECT_EQ(first.action.tool_calls[0].name, "calculator");
  const envs::ParsedTurn second = parser.parse(turns[1], tok);
  ASSERT_EQ(second.action.tool_calls.size(), 1u);
  EXPECT_EQ(second.action.tool_calls[0].name, "answer");
  EXPECT_EQ(second.action.tool_calls[0].arguments["value"].get<int64_t>(), std::stoll(v));
}

TEST(Demonstrations, LossMaskCoversExactlyTheExpertsTokens) {
  const ByteTokenizer tok;
  const uint32_t assistant = tok.special_id(SpecialToken::kAssistant);
  const uint32_t end_turn = tok.special_id(SpecialToken::kEndTurn);
  DataOptions data;
  data.seed = 11;
  auto stream = DocumentStream::create(tok, data);
  ASSERT_TRUE(stream.ok()) << stream.status().to_string();
  std::set<size_t> turn_counts;
  for (int i = 0; i < 200; ++i) {
    auto doc = (*stream)->next();
    ASSERT_TRUE(doc.ok()) << doc.status().to_string();
    ASSERT_TRUE(doc->demonstration);
    ASSERT_EQ(doc->tokens.size(), doc->loss_mask.size());
    // The expert writes every token after an <|assistant|> through the next <|end_turn|>.
    std::vector<uint8_t> expected(doc->tokens.size(), 0);
    bool in_turn = false;
    for (size_t t = 0; t < doc->tokens.size(); ++t) {
      if (in_turn) {
        expected[t] = 1;
        if (doc->tokens[t] == end_turn) in_turn = false;
      } else if (doc->tokens[t] == assistant) {
        in_turn = true;
      }
    }
    EXPECT_EQ(doc->loss_mask, expected) << tok.decode(doc->tokens);
    const auto turns = expert_turns(*doc);
    turn_counts.insert(turns.size());
    envs::TurnParser parser(arith()->info().tools);
    for (const auto& turn : turns) {
      const envs::ParsedTurn parsed = parser.parse(turn, tok);
      EXPECT_TRUE(parsed.rejected.empty()) << tok.decode(turn);
      EXPECT_EQ(parsed.action.tool_calls.size(), 1u) << tok.decode(turn);
    }
  }
  EXPECT_EQ(turn_counts, (std::set<size_t>{1, 2})) << "both strategies appear in the default mix";
  EXPECT_EQ((*stream)->demonstrations(), 200);
}

TEST(Demonstrations, NoEvalSplitProblemEverAppearsInAnyDocument) {
  const ByteTokenizer tok;
  // Every eval problem of each difficulty (the easiest space is small enough to enumerate all of
  // it; for larger ones, the first 3000 eval tasks), by the environment's own split.
  const std::vector<ArithDifficulty> mix = default_arith_mix();
  std::vector<std::set<std::string>> eval(mix.size());
  for (size_t d = 0; d < mix.size(); ++d) {
    auto s = session(mix[d].config);
    for (uint64_t i = 0; i < 3000; ++i) {
      ASSERT_TRUE(s->reset({{"split", "eval"}, {"index", i}}, 0).ok());
      eval[d].insert(s->score()->info["expression"].get<std::string>());
    }
  }
  ASSERT_GE(eval[0].size(), 10u);
  DataOptions data;
  data.kind = DataKind::kMixed;
  data.text_fraction = 0.5;
  data.seed = 5;
  auto stream = DocumentStream::create(tok, data);
  ASSERT_TRUE(stream.ok()) << stream.status().to_string();
  int64_t sources = 0;
  std::set<std::string> easiest_seen;
  for (int i = 0; i < 400; ++i) {
    auto doc = (*stream)->next();
    ASSERT_TRUE(doc.ok()) << doc.status().to_string();
    ASSERT_FALSE(doc->sources.empty());
    for (const DocumentSource& src : doc->sources) {
      ++sources;
      ASSERT_EQ(src.task["split"], "train") << src.task;
      size_t d = 0;
      while (d < mix.size() && mix[d].config != src.env_config) ++d;
      ASSERT_LT(d, mix.size()) << src.env_config;
      EXPECT_EQ(eval[d].count(src.expression), 0u) << src.expression << " is an eval problem";
      if (d == 0) easiest_seen.insert(src.expression);
      // What the document shows is that task's problem.
      EXPECT_NE(tok.decode(doc->tokens).find(src.expression), std::string::npos) << src.expression;
    }
  }
  EXPECT_GT((*stream)->texts(), 100);
  EXPECT_GT((*stream)->demonstrations(), 100);
  EXPECT_GE(easiest_seen.size(), 100u) << "the easiest config's train problems are covered widely";
  EXPECT_GT(sources, 400);
}

TEST(Demonstrations, TextDocumentsAreWorkedProblemsTheCalculatorAgreesWith) {
  const ByteTokenizer tok;
  DataOptions data;
  data.kind = DataKind::kText;
  data.seed = 2;
  auto stream = DocumentStream::create(tok, data);
  ASSERT_TRUE(stream.ok());
  auto calc = session(json::object());
  int checked = 0, stories = 0;
  for (int i = 0; i < 40; ++i) {
    auto doc = (*stream)->next();
    ASSERT_TRUE(doc.ok());
    EXPECT_FALSE(doc->demonstration);
    ASSERT_GE(doc->tokens.size(), 3u);
    EXPECT_EQ(doc->tokens.front(), tok.special_id(SpecialToken::kBos));
    EXPECT_EQ(doc->tokens.back(), tok.special_id(SpecialToken::kEos));
    EXPECT_EQ(doc->loss_mask.front(), 0);
    for (size_t t = 1; t < doc->loss_mask.size(); ++t) EXPECT_EQ(doc->loss_mask[t], 1);
    const std::string text = tok.decode(doc->tokens.data() + 1, doc->tokens.size() - 2);
    stories += text.find("answer: ") != std::string::npos;
    size_t begin = 0;
    while (begin < text.size()) {
      size_t end = text.find('\n', begin);
      if (end == std::string::npos) end = text.size();
      const std::string line = text.substr(begin, end - begin);
      begin = end + 1;
      const size_t eq = line.find('=');
      if (eq == std::string::npos || line.find(' ') != std::string::npos) continue;  // story or answer line
      ASSERT_TRUE(calc->reset(json::object(), 0).ok());
      auto obs = calc->step({"", {{"c", "calculator", {{"expression", line.substr(0, eq)}}}}});
      ASSERT_TRUE(obs.ok());
      EXPECT_EQ(obs->tool_results.at(0).content, line.substr(eq + 1)) << line;
      ++checked;
    }
  }
  EXPECT_GT(checked, 100);
  EXPECT_GT(stories, 0);
}

TEST(Demonstrations, StreamsRepeatForASeedAndDifferAcrossSeeds) {
  const ByteTokenizer tok;
  DataOptions a, b, c;
  a.kind = b.kind = c.kind = DataKind::kMixed;
  a.seed = b.seed = 9;
  c.seed = 10;
  auto sa = DocumentStream::create(tok, a), sb = DocumentStream::create(tok, b), sc = DocumentStream::create(tok, c);
  ASSERT_TRUE(sa.ok() && sb.ok() && sc.ok());
  int differ = 0;
  for (int i = 0; i < 50; ++i) {
    const Document da = *(*sa)->next(), db = *(*sb)->next(), dc = *(*sc)->next();
    EXPECT_EQ(da.tokens, db.tokens);
    EXPECT_EQ(da.loss_mask, db.loss_mask);
    differ += da.tokens != dc.tokens;
  }
  EXPECT_GT(differ, 25);
}

TEST(SequencePacker, FillsRowsWithWholeDocumentsInOrderAndPadsTheRest) {
  const ByteTokenizer tok;
  const uint32_t pad = tok.special_id(SpecialToken::kPad), bos = tok.special_id(SpecialToken::kBos);
  DataOptions data;
  data.kind = DataKind::kMixed;
  data.seed = 4;
  auto packed = DocumentStream::create(tok, data), reference = DocumentStream::create(tok, data);
  ASSERT_TRUE(packed.ok() && reference.ok());
  const size_t kRow = 640;
  SequencePacker packer(**packed, tok, static_cast<int64_t>(kRow));
  int64_t documents = 0;
  for (int r = 0; r < 30; ++r) {
    auto row = packer.next_row();
    ASSERT_TRUE(row.ok());
    ASSERT_EQ(row->tokens.size(), kRow);
    ASSERT_EQ(row->loss_mask.size(), kRow);
    EXPECT_EQ(row->tokens[0], bos);
    EXPECT_GE(row->documents, 1);
    // The row is the next documents of the stream, whole, then padding.
    size_t at = 0;
    for (int64_t d = 0; d < row->documents; ++d) {
      const Document doc = *(*reference)->next();
      ++documents;
      const size_t n = std::min(doc.tokens.size(), kRow - at);
      ASSERT_EQ(n, doc.tokens.size()) << "documents here are shorter than a row";
      EXPECT_TRUE(std::equal(doc.tokens.begin(), doc.tokens.end(), row->tokens.begin() + static_cast<std::ptrdiff_t>(at)));
      EXPECT_TRUE(std::equal(doc.loss_mask.begin(), doc.loss_mask.end(), row->loss_mask.begin() + static_cast<std::ptrdiff_t>(at)));
      at += n;
    }
    for (size_t t = at; t < kRow; ++t) {
      EXPECT_EQ(row->tokens[t], pad);
      EXPECT_EQ(row->loss_mask[t], 0);
    }
    EXPECT_LT(kRow - at, 400u) << "rows are mostly filled";
  }
  EXPECT_GT(documents, 60) << "several documents per row";
}

TEST(SequencePacker, CutsADocumentLongerThanTheRow) {
  const ByteTokenizer tok;
  DataOptions data;
  data.kind = DataKind::kDemonstrations;
  auto stream = DocumentStream::create(tok, data), reference = DocumentStream::create(tok, data);
  ASSERT_TRUE(stream.ok() && reference.ok());
  SequencePacker packer(**stream, tok, 8);
  for (int r = 0; r < 5; ++r) {
    auto row = packer.next_row();
    ASSERT_TRUE(row.ok());
    const Document doc = *(*reference)->next();
    EXPECT_EQ(row->documents, 1);
    EXPECT_EQ(row->tokens, std::vector<uint32_t>(doc.tokens.begin(), doc.tokens.begin() + 8));
  }
}

}  // namespace
}  // namespace odyssey::learner
