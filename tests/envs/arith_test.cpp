// The built-in arith environment (envs/builtin/arith), loaded as a plugin through the C ABI:
// scripted policies solve it, grading is exact, the calculator's edge cases are tool errors,
// episodes are deterministic, the train/eval splits are disjoint and snapshots resume exactly.
#include <cctype>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "envs/env_test_helpers.h"
#include "envs/plugin.h"

namespace odyssey::envs {
namespace {

using nlohmann::json;

std::shared_ptr<Plugin> arith_plugin() { return test_support::builtin_plugin("arith"); }

std::unique_ptr<EnvSession> make_session(const json& config = json::object()) {
  return test_support::builtin_session("arith", config);
}

env::Action call(const std::string& tool, const json& arguments, const std::string& id = "call_1") {
  return test_support::tool_call(tool, arguments, id);
}
env::Action calculate(const std::string& expression) { return call("calculator", {{"expression", expression}}); }
env::Action answer(int64_t value) { return call("answer", {{"value", value}}); }
env::Action final_text(const std::string& text) { return {text, {}}; }

using test_support::reset;
using test_support::score;
using test_support::step;
using test_support::part;

// The calculator's answer to `expression` in a fresh episode: {content, is_error}.
std::pair<std::string, bool> evaluate(const std::string& expression) {
  auto s = make_session();
  reset(*s, json::object());
  const env::Observation obs = step(*s, calculate(expression));
  EXPECT_EQ(obs.tool_results.size(), 1u);
  EXPECT_FALSE(obs.done) << "a calculator call must not end the episode";
  if (obs.tool_results.empty()) return {"", true};
  return {obs.tool_results[0].content, obs.tool_results[0].is_error};
}

// A scripted reader of the word problems: each sentence's number and verb give one operation.
int64_t solve_story(const std::string& story) {
  std::vector<std::string> sentences;
  std::string current;
  for (char c : story) {
    current += c;
    if (c == '.' || c == '?') {
      sentences.push_back(current);
      current.clear();
    }
  }
  const auto number = [](const std::string& s) -> int64_t {
    for (size_t i = 0; i < s.size(); ++i)
      if (std::isdigit(static_cast<unsigned char>(s[i]))) return std::stoll(s.substr(i));
    ADD_FAILURE() << "no number in: " << s;
    return 0;
  };
  const auto has = [](const std::string& s, std::initializer_list<const char*> words) {
    for (const char* w : words)
      if (s.find(w) != std::string::npos) return true;
    return false;
  };
  EXPECT_GE(sentences.size(), 3u) << story;
  int64_t v = number(sentences.front());
  for (size_t i = 1; i + 1 < sentences.size(); ++i) {
    const std::string& s = sentences[i];
    const int64_t b = number(s);
    if (has(s, {"times", "for each", "swaps each"})) v *= b;
    else if (has(s, {"split", "shares", "sorts"})) v /= b;
    else if (has(s, {"to a neighbour", "eats", "spends", "pays", "lends", "donates", "get off", "leave"})) v -= b;
    else if (has(s, {"picks", "gives", "earns", "buys", "receives", "get on", "board"})) v += b;
    else ADD_FAILURE() << "unknown sentence: " << s;
  }
  return v;
}

TEST(ArithEnv, DescribesItsToolsAndOffersSnapshots) {
  auto plugin = arith_plugin();
  ASSERT_TRUE(plugin);
  EXPECT_EQ(plugin->info().name, "arith");
  EXPECT_TRUE(plugin->info().snapshots);
  EXPECT_FALSE(plugin->info().images);
  ASSERT_EQ(plugin->info().tools.size(), 2u);
  EXPECT_EQ(plugin->info().tools[0].name, "calculator");
  EXPECT_EQ(plugin->info().tools[1].name, "answer");
  EXPECT_EQ(plugin->info().tools[1].input_schema["properties"]["value"]["type"], "integer");
}

TEST(ArithEnv, ScriptedPolicySolvesTerseProblemsWithTheCalculator) {
  auto s = make_session({{"min_steps", 1}, {"max_steps", 4}, {"max_operand", 30}});
  ASSERT_TRUE(s);
  for (uint64_t seed = 0; seed < 100; ++seed) {
    const env::Observation first = reset(*s, json::object(), seed);
    ASSERT_GE(first.text.size(), 3u);
    ASSERT_EQ(first.text.substr(first.text.size() - 2), "=?") << first.text;
    const env::Observation calc = step(*s, calculate(first.text.substr(0, first.text.size() - 2)));
    ASSERT_EQ(calc.tool_results.size(), 1u);
    ASSERT_FALSE(calc.tool_results[0].is_error) << first.text << ": " << calc.tool_results[0].content;
    ASSERT_EQ(calc.tool_results[0].content.find('/'), std::string::npos) << "answers are integers: " << first.text;
    const env::Observation done = step(*s, answer(std::stoll(calc.tool_results[0].content)));
    EXPECT_TRUE(done.done);
    const env::Score sc = score(*s);
    EXPECT_TRUE(sc.success) << first.text << " answered " << calc.tool_results[0].content;
    EXPECT_DOUBLE_EQ(sc.reward, 1.1);
    EXPECT_DOUBLE_EQ(part(sc, "correct"), 1.0);
    EXPECT_DOUBLE_EQ(part(sc, "format"), 0.1);
    EXPECT_EQ(sc.info["expected"].get<int64_t>(), std::stoll(calc.tool_results[0].content));
    EXPECT_EQ(sc.info["answered_by"], "tool");
  }
}

TEST(ArithEnv, ScriptedReaderSolvesWordProblems) {
  auto s = make_session({{"min_steps", 1}, {"max_steps", 5}, {"max_operand", 12}, {"word_problems", true}});
  ASSERT_TRUE(s);
  std::set<std::string> openings;
  for (uint64_t seed = 0; seed < 300; ++seed) {
    const env::Observation first = reset(*s, json::object(), seed);
    ASSERT_EQ(first.text.back(), '?') << first.text;
    openings.insert(first.text.substr(0, first.text.find(' ')));
    const int64_t value = solve_story(first.text);
    // Half the episodes answer with the tool, half with the final text convention.
    const env::Observation done =
        step(*s, seed % 2 ? answer(value) : final_text("Let me see.\nanswer: " + std::to_string(value)));
    EXPECT_TRUE(done.done);
    const env::Score sc = score(*s);
    EXPECT_TRUE(sc.success) << first.text << " -> " << value << ", expected " << sc.info["expected"];
    EXPECT_EQ(sc.info["answered_by"], seed % 2 ? "tool" : "text");
  }
  EXPECT_GE(openings.size(), 6u) << "stories come from several themes and names";
}

TEST(ArithEnv, EasiestSettingAsksOneStepProblemsWithSmallOperands) {
  auto s = make_session({{"min_steps", 1}, {"max_steps", 1}, {"max_operand", 9}});
  ASSERT_TRUE(s);
  std::set<char> ops;
  for (uint64_t seed = 0; seed < 200; ++seed) {
    const std::string prompt = reset(*s, json::object(), seed).text;
    ASSERT_EQ(prompt.size(), 5u) << prompt;
    EXPECT_TRUE(std::isdigit(static_cast<unsigned char>(prompt[0])) && std::isdigit(static_cast<unsigned char>(prompt[2])))
        << prompt;
    EXPECT_EQ(prompt.substr(3), "=?");
    ops.insert(prompt[1]);
  }
  EXPECT_EQ(ops, (std::set<char>{'+', '-', '*', '/'}));
}

TEST(ArithEnv, GradesTheFinalAnswerExactly) {
  auto s = make_session();
  ASSERT_TRUE(s);
  reset(*s, {{"split", "train"}, {"index", 7}});
  const int64_t expected = score(*s).info["expected"].get<int64_t>();

  step(*s, answer(expected + 1));
  env::Score wrong = score(*s);
  EXPECT_FALSE(wrong.success);
  EXPECT_DOUBLE_EQ(part(wrong, "correct"), 0.0);
  EXPECT_DOUBLE_EQ(part(wrong, "format"), 0.1);
  EXPECT_DOUBLE_EQ(wrong.reward, 0.1);
  EXPECT_EQ(wrong.info["answer"].get<int64_t>(), expected + 1);

  // A final text without an answer line ends the episode with nothing earned.
  reset(*s, {{"split", "train"}, {"index", 7}});
  const env::Observation end = step(*s, final_text("The answer is " + std::to_string(expected)));
  EXPECT_TRUE(end.done);
  env::Score none = score(*s);
  EXPECT_FALSE(none.success);
  EXPECT_DOUBLE_EQ(none.reward, 0.0);
  EXPECT_TRUE(none.info["answer"].is_null());

  // The answer line must be the last non-empty line, with nothing after the number.
  for (const std::string& text : {"answer: " + std::to_string(expected) + " apples",
                                  "answer: " + std::to_string(expected) + "\nthanks", "answer " + std::to_string(expected)}) {
    reset(*s, {{"split", "train"}, {"index", 7}});
    step(*s, final_text(text));
    EXPECT_FALSE(score(*s).success) << text;
  }
  for (const std::string& text : {"ANSWER:" + std::to_string(expected), "work\n  Answer :  " + std::to_string(expected) + "  \n\n"}) {
    reset(*s, {{"split", "train"}, {"index", 7}});
    step(*s, final_text(text));
    EXPECT_TRUE(score(*s).success) << text;
  }

  // The answer tool takes integers only; a bad value is a tool error and the episode goes on.
  reset(*s, {{"split", "train"}, {"index", 7}});
  for (const json& bad : {json(2.5), json("7"), json(1e30)}) {
    const env::Observation obs = step(*s, call("answer", {{"value", bad}}));
    ASSERT_EQ(obs.tool_results.size(), 1u);
    EXPECT_TRUE(obs.tool_results[0].is_error) << bad;
    EXPECT_NE(obs.tool_results[0].content.find("'value'"), std::string::npos) << obs.tool_results[0].content;
    EXPECT_FALSE(obs.done);
  }
  EXPECT_TRUE(step(*s, call("answer", {{"value", double(expected)}})).done) << "42.0 is an integer";
  EXPECT_TRUE(score(*s).success);
}

TEST(ArithEnv, CallsAfterTheAnswerAreRefusedAndTheEpisodeIsOver) {
  auto s = make_session();
  ASSERT_TRUE(s);
  reset(*s, json::object(), 3);
  const int64_t expected = score(*s).info["expected"].get<int64_t>();
  env::Action turn{"", {{"a", "calculator", {{"expression", "1+1"}}},
                        {"b", "answer", {{"value", expected}}},
                        {"c", "answer", {{"value", expected + 5}}},
                        {"d", "calculator", {{"expression", "2+2"}}}}};
  const env::Observation obs = step(*s, turn);
  ASSERT_EQ(obs.tool_results.size(), 4u);
  EXPECT_EQ(obs.tool_results[0].content, "2");
  EXPECT_FALSE(obs.tool_results[1].is_error);
  EXPECT_TRUE(obs.tool_results[2].is_error);
  EXPECT_TRUE(obs.tool_results[3].is_error);
  EXPECT_EQ(obs.tool_results[3].call_id, "d");
  EXPECT_TRUE(obs.done);
  ASSERT_EQ(obs.rewards.size(), 3u);
  EXPECT_TRUE(score(*s).success) << "the first answer counts";
  auto again = s->step(answer(expected));
  EXPECT_FALSE(again.ok());
}

TEST(ArithEnv, EndsUnansweredAfterMaxTurns) {
  auto s = make_session({{"max_turns", 3}});
  ASSERT_TRUE(s);
  reset(*s, json::object(), 1);
  EXPECT_FALSE(step(*s, calculate("1+1")).done);
  EXPECT_FALSE(step(*s, calculate("2*3")).done);
  const env::Observation last = step(*s, calculate("3*3"));
  EXPECT_TRUE(last.done);
  const env::Score sc = score(*s);
  EXPECT_FALSE(sc.success);
  EXPECT_DOUBLE_EQ(sc.reward, 0.0);
  EXPECT_EQ(sc.info["turns"], 3);
  EXPECT_EQ(sc.info["calculator_calls"], 3);
}

TEST(ArithEnv, ToolBonusRewardsACorrectAnswerThatUsedTheCalculator) {
  auto s = make_session({{"tool_bonus", 0.2}, {"format_bonus", 0.0}});
  ASSERT_TRUE(s);
  reset(*s, json::object(), 5);
  const int64_t expected = score(*s).info["expected"].get<int64_t>();
  step(*s, answer(expected));
  EXPECT_DOUBLE_EQ(score(*s).reward, 1.0) << "no calculator call, no bonus";
  reset(*s, json::object(), 5);
  step(*s, calculate("1+2"));
  step(*s, answer(expected));
  const env::Score sc = score(*s);
  EXPECT_DOUBLE_EQ(part(sc, "tool_use"), 0.2);
  EXPECT_DOUBLE_EQ(sc.reward, 1.2);
}

TEST(ArithEnv, CalculatorEvaluatesExactlyWithPrecedenceAndUnaryMinus) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"2+3*4", "14"},        {"(2+3)*4", "20"},      {"10-2-3", "5"},         {"2*3/4", "3/2"},
      {"7/2*2", "7"},         {"1/3+1/6", "1/2"},     {"-3*-2", "6"},          {"-(4-6)", "2"},
      {"--5", "5"},           {"-2-3", "-5"},         {" 8 / ( 3 - 1 ) ", "4"}, {"100/7/7", "100/49"},
      {"0-7/2", "-7/2"},      {"+4", "4"},            {"((((1))))", "1"},      {"2*(3+4)*5", "70"},
      {"9223372036854775807", "9223372036854775807"},  {"-9223372036854775807", "-9223372036854775807"},
  };
  for (const auto& [expression, value] : cases) {
    const auto [content, is_error] = evaluate(expression);
    EXPECT_FALSE(is_error) << expression << ": " << content;
    EXPECT_EQ(content, value) << expression;
  }
  // Products are formed in 128 bits and reduced: a result that fits is exact even when the
  // unreduced numerator and denominator would not fit in 64 bits.
  EXPECT_EQ(evaluate("9223372036854775807/9223372036854775806*9223372036854775806").first, "9223372036854775807");
  EXPECT_EQ(evaluate("1/3037000499*3037000499").first, "1");
}

TEST(ArithEnv, CalculatorReportsBadExpressionsAsToolErrorsSayingWhere) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"1/0", "division by zero at column 2"},
      {"5/(2-2)", "division by zero at column 2"},
      {"9223372036854775807+1", "overflow at column 20"},
      {"4611686018427387904*2", "overflow at column 20"},
      {"-9223372036854775807-1", "overflow"},
      {"99999999999999999999", "overflow at column 1"},
      {"3037000500*3037000500", "overflow"},
      {"2+", "unexpected end of expression"},
      {"2+x", "unexpected 'x' at column 3"},
      {"2 3", "unexpected '3' at column 3"},
      {"2(3)", "unexpected '(' at column 2"},
      {"(1+2", "missing ')'"},
      {"1+2)", "unmatched ')' at column 4"},
      {"", "empty expression"},
      {"   ", "empty expression"},
      {"1.5+1", "unexpected '.' at column 2"},
      {"2^3", "unexpected '^' at column 2"},
      {"*3", "unexpected '*' at column 1"},
      {"1+\u00e9", "byte \\xc3 at column 3"},
      {std::string(2000, '1'), "too long"},
      {std::string(200, '(') + "1" + std::string(200, ')'), "too deeply nested"},
      {std::string(500, '-') + "1", "too deeply nested"},
  };
  for (const auto& [expression, message] : cases) {
    const auto [content, is_error] = evaluate(expression);
    EXPECT_TRUE(is_error) << expression.substr(0, 40) << " gave " << content;
    EXPECT_NE(content.find(message), std::string::npos) << expression.substr(0, 40) << ": " << content;
  }
  // An argument of the wrong type is a tool error too, not a failed step.
  auto s = make_session();
  reset(*s, json::object());
  const env::Observation obs = step(*s, call("calculator", {{"expression", 12}}));
  ASSERT_EQ(obs.tool_results.size(), 1u);
  EXPECT_TRUE(obs.tool_results[0].is_error);
  EXPECT_NE(obs.tool_results[0].content.find("'expression'"), std::string::npos);
}

TEST(ArithEnv, SameTaskAndSeedGiveTheSameEpisodeAndSeedsDiffer) {
  auto a = make_session({{"word_problems", true}});
  auto b = make_session({{"word_problems", true}});
  ASSERT_TRUE(a && b);
  std::set<std::string> prompts;
  for (uint64_t seed = 0; seed < 50; ++seed) {
    const std::string pa = reset(*a, json::object(), seed).text;
    EXPECT_EQ(pa, reset(*b, json::object(), seed).text);
    EXPECT_EQ(score(*a).info, score(*b).info);
    prompts.insert(pa);
  }
  EXPECT_GE(prompts.size(), 48u) << "different seeds draw different problems";
  // {} with seed N is train task N; a split task ignores the seed.
  EXPECT_EQ(reset(*a, json::object(), 12).text, reset(*b, {{"split", "train"}, {"index", 12}}, 999).text);
  EXPECT_EQ(reset(*a, {{"split", "eval"}, {"index", 3}}, 1).text, reset(*b, {{"split", "eval"}, {"index", 3}}, 2).text);
}

TEST(ArithEnv, TrainAndEvalSplitsNeverShareAProblem) {
  for (const json& config : {json{{"min_steps", 1}, {"max_steps", 1}, {"max_operand", 9}},
                             json{{"min_steps", 1}, {"max_steps", 3}, {"max_operand", 20}},
                             json{{"min_steps", 2}, {"max_steps", 3}, {"max_operand", 20}, {"word_problems", true}}}) {
    auto s = make_session(config);
    ASSERT_TRUE(s);
    std::set<std::string> train, eval;
    for (uint64_t i = 0; i < 2000; ++i) {
      reset(*s, {{"split", "train"}, {"index", i}});
      train.insert(score(*s).info["expression"].get<std::string>());
      reset(*s, {{"split", "eval"}, {"index", i}});
      const env::Score sc = score(*s);
      EXPECT_EQ(sc.info["split"], "eval");
      eval.insert(sc.info["expression"].get<std::string>());
    }
    for (const std::string& e : eval) EXPECT_EQ(train.count(e), 0u) << config << ": " << e << " is in both splits";
    EXPECT_GE(eval.size(), 10u) << config;
    EXPECT_GE(train.size(), 10u) << config;
  }
}

TEST(ArithEnv, SnapshotRestoresIntoAFreshInstanceAndContinuesIdentically) {
  const json config = {{"max_steps", 3}, {"word_problems", true}};
  auto original = make_session(config);
  ASSERT_TRUE(original);
  const std::string prompt = reset(*original, {{"split", "eval"}, {"index", 4}}).text;
  step(*original, calculate("6*7"));
  auto bytes = original->snapshot();
  ASSERT_TRUE(bytes.ok()) << bytes.status().to_string();
  EXPECT_TRUE(json::parse(*bytes).is_object()) << "snapshots are JSON";

  auto fork = make_session(config);
  ASSERT_TRUE(fork);
  ASSERT_TRUE(fork->restore(*bytes).ok());
  const int64_t expected = score(*original).info["expected"].get<int64_t>();
  for (auto* s : {original.get(), fork.get()}) {
    const env::Observation calc = step(*s, calculate("(1+2)*3"));
    EXPECT_EQ(calc.tool_results[0].content, "9");
    EXPECT_FALSE(calc.done);
    EXPECT_TRUE(step(*s, answer(expected)).done);
  }
  const env::Score a = score(*original), b = score(*fork);
  EXPECT_TRUE(a.success);
  EXPECT_EQ(a.reward, b.reward);
  EXPECT_EQ(a.info, b.info);
  EXPECT_EQ(b.info["turns"], 3);
  EXPECT_EQ(b.info["calculator_calls"], 2);

  // An instance with another config refuses the snapshot, naming why; garbage is refused too.
  auto other = make_session({{"max_steps", 4}});
  ASSERT_TRUE(other);
  const Status refused = other->restore(*bytes);
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("another config"), std::string::npos) << refused.message();
  EXPECT_FALSE(fork->restore("not json").ok());
  EXPECT_FALSE(fork->restore("{\"kind\":\"arith\",\"version\":1}").ok());
}

TEST(ArithEnv, RefusesBadConfigsAndTasksNamingTheField) {
  auto plugin = arith_plugin();
  ASSERT_TRUE(plugin);
  const std::vector<std::pair<json, std::string>> configs = {
      {{{"max_steps", 0}}, "'max_steps'"},
      {{{"min_steps", 3}, {"max_steps", 2}}, "'min_steps'"},
      {{{"max_operand", "9"}}, "'max_operand'"},
      {{{"max_operand", 1}, {"word_problems", true}}, "'max_operand'"},
      {{{"word_problems", 1}}, "'word_problems'"},
      {{{"max_turns", 0}}, "'max_turns'"},
      {{{"format_bonus", 2}}, "'format_bonus'"},
      {{{"max_operands", 9}}, "unknown key 'max_operands' (did you mean 'max_operand'?)"},
  };
  for (const auto& [config, field] : configs) {
    auto session = plugin->create(config);
    ASSERT_FALSE(session.ok()) << config;
    EXPECT_NE(session.status().message().find(field), std::string::npos) << session.status().message();
  }
  auto s = make_session();
  ASSERT_TRUE(s);
  const std::vector<std::pair<json, std::string>> tasks = {
      {{{"split", "test"}, {"index", 1}}, "'split'"},
      {{{"split", "eval"}}, "'index'"},
      {{{"index", 3}}, "'split'"},
      {{{"split", "eval"}, {"index", -1}}, "'index'"},
      {{{"split", "eval"}, {"index", "1"}}, "'index'"},
      {{{"level", 1}}, "'level'"},
  };
  for (const auto& [task, field] : tasks) {
    auto obs = s->reset(task, 0);
    ASSERT_FALSE(obs.ok()) << task;
    EXPECT_EQ(obs.status().code(), StatusCode::kInvalidArgument) << obs.status().to_string();
    EXPECT_NE(obs.status().message().find(field), std::string::npos) << obs.status().message();
  }
}

}  // namespace
}  // namespace odyssey::envs
