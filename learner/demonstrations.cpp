#include "learner/demonstrations.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "envs/episode.h"
#include "envs/plugin.h"
#include "envs/turn.h"

namespace odyssey::learner {

namespace {

using json = nlohmann::json;

// splitmix64: the same stream on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double unit() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  int64_t range(int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(next() % static_cast<uint64_t>(hi - lo + 1)); }

 private:
  uint64_t state_;
};

// The expected answer and terse expression of the problem `session` was just reset to.
struct Peek {
  int64_t expected = 0;
  std::string expression;
};
Result<Peek> peek(envs::EnvSession& session) {
  Result<env::Score> score = session.score();
  if (!score.ok()) return score.status().with_context("reading the problem from score()");
  const json& info = score->info;
  if (!info.is_object() || !info.contains("expected") || !info["expected"].is_number_integer() ||
      !info.contains("expression") || !info["expression"].is_string()) {
    return make_status(StatusCode::kInvalidArgument,
                       "plugin '{}': score().info lacks an integer \"expected\" and a string \"expression\" "
                       "(the scripted expert plays arith only), got {}",
                       session.info().name, info.dump());
  }
  return Peek{info["expected"].get<int64_t>(), info["expression"].get<std::string>()};
}

json train_task(uint64_t index) { return json{{"split", "train"}, {"index", index}}; }

}  // namespace

std::vector<ArithDifficulty> default_arith_mix() {
  return {
      {json{{"min_steps", 1}, {"max_steps", 1}, {"max_operand", 9}},
       /*weight=*/0.70, /*calculator=*/0.25, /*worked=*/1.0},
      {json{{"min_steps", 1}, {"max_steps", 2}, {"max_operand", 20}},
       /*weight=*/0.15, /*calculator=*/0.75, /*worked=*/1.0},
      {json{{"min_steps", 2}, {"max_steps", 3}, {"max_operand", 20}},
       /*weight=*/0.08, /*calculator=*/1.0, /*worked=*/1.0},
      {json{{"min_steps", 1}, {"max_steps", 3}, {"max_operand", 12}, {"word_problems", true}},
       /*weight=*/0.07, /*calculator=*/1.0, /*worked=*/1.0},
  };
}

std::string compact_tool_call(const std::string& name, const json& arguments) {
  return "{\"name\":" + json(name).dump() + ",\"arguments\":" + arguments.dump() + "}";
}

Result<Demonstration> play_arith_expert(envs::EnvSession& session, const Tokenizer& tokenizer, const json& task,
                                        ArithStrategy strategy, uint64_t seed) {
  envs::Episode episode(session, tokenizer);
  env::Observation obs = episode.start(task, seed);
  if (episode.failed()) {
    return make_status(StatusCode::kInvalidArgument, "plugin '{}': reset with task {} failed: {}", session.info().name,
                       task.dump(), episode.failure());
  }
  ODY_ASSIGN_OR_RETURN(const Peek problem, peek(session));

  Demonstration demo;
  Document& doc = demo.document;
  doc.demonstration = true;
  doc.sources.push_back({json::object(), task, problem.expression});
  const auto put = [&](uint32_t token, bool expert) {
    doc.tokens.push_back(token);
    doc.loss_mask.push_back(expert ? 1 : 0);
  };
  const auto put_all = [&](const std::vector<uint32_t>& tokens, bool expert) {
    for (uint32_t t : tokens) put(t, expert);
  };
  const auto special = [&](SpecialToken t) { return tokenizer.special_id(t); };

  put(special(SpecialToken::kBos), false);
  put_all(envs::render_observation(obs, tokenizer, SpecialToken::kUser).tokens, false);
  put(special(SpecialToken::kAssistant), false);

  // The expert's turns: [calculator,] answer.
  bool use_calculator = strategy == ArithStrategy::kCalculator;
  int64_t value = problem.expected;
  for (int turn = 0; turn < 2; ++turn) {
    const bool calculator_turn = use_calculator && turn == 0;
    const std::string call = calculator_turn ? compact_tool_call("calculator", json{{"expression", problem.expression}})
                                             : compact_tool_call("answer", json{{"value", value}});
    std::vector<uint32_t> tokens;
    if (strategy == ArithStrategy::kWorkedAnswer) {
      tokens = tokenizer.encode(problem.expression + "=" + std::to_string(value));
    }
    tokens.push_back(special(SpecialToken::kToolCall));
    const std::vector<uint32_t> text = tokenizer.encode(call);
    tokens.insert(tokens.end(), text.begin(), text.end());
    tokens.push_back(special(SpecialToken::kToolCallEnd));
    tokens.push_back(special(SpecialToken::kEndTurn));
    put_all(tokens, true);
    ++demo.turns;

    obs = episode.take_turn(tokens);
    put_all(envs::render_observation(obs, tokenizer, SpecialToken::kTool).tokens, false);
    if (calculator_turn) {
      if (obs.tool_results.size() != 1 || obs.tool_results[0].is_error) {
        return make_status(StatusCode::kInternal, "task {}: the calculator refused '{}': {}", task.dump(),
                           problem.expression, obs.tool_results.empty() ? obs.text : obs.tool_results[0].content);
      }
      try {
        value = std::stoll(obs.tool_results[0].content);
      } catch (const std::exception&) {
        return make_status(StatusCode::kInternal, "task {}: the calculator's '{}' is not an integer", task.dump(),
                           obs.tool_results[0].content);
      }
    }
    if (episode.done()) break;
    if (!calculator_turn) {
      return make_status(StatusCode::kInternal, "task {}: the episode did not end after the answer", task.dump());
    }
    put(special(SpecialToken::kAssistant), false);
  }
  put(special(SpecialToken::kEos), false);

  const envs::EpisodeScore grade = episode.finish();
  demo.answer = value;
  demo.success = grade.score.success;
  if (!demo.success) {
    return make_status(StatusCode::kInternal, "task {}: the scripted expert answered {} but the expected answer is {}{}",
                       task.dump(), value, problem.expected, grade.failed ? " (" + grade.failure + ")" : "");
  }
  return demo;
}

Document text_document(const std::string& text, const Tokenizer& tokenizer) {
  Document doc;
  doc.tokens.push_back(tokenizer.special_id(SpecialToken::kBos));
  const std::vector<uint32_t> ids = tokenizer.encode(text);
  doc.tokens.insert(doc.tokens.end(), ids.begin(), ids.end());
  doc.tokens.push_back(tokenizer.special_id(SpecialToken::kEos));
  doc.loss_mask.assign(doc.tokens.size(), 1);
  doc.loss_mask[0] = 0;
  return doc;
}

Result<DataKind> parse_data_kind(const std::string& name) {
  if (name == "demonstrations") return DataKind::kDemonstrations;
  if (name == "text") return DataKind::kText;
  if (name == "mixed") return DataKind::kMixed;
  return invalid_argument("pretrain data '{}' is not one of demonstrations, text, mixed", name);
}

const char* data_kind_name(DataKind kind) {
  switch (kind) {
    case DataKind::kDemonstrations: return "demonstrations";
    case DataKind::kText: return "text";
    case DataKind::kMixed: return "mixed";
  }
  return "?";
}

struct DocumentStream::Impl {
  const Tokenizer& tokenizer;
  DataOptions options;
  Rng rng;
  std::vector<std::unique_ptr<envs::EnvSession>> sessions;  // parallel to options.mix
  std::vector<uint64_t> next_index;                          // per difficulty: next train task
  double total_weight = 0;
  int64_t demonstrations = 0;
  int64_t texts = 0;

  Impl(const Tokenizer& t, DataOptions o) : tokenizer(t), options(std::move(o)), rng(options.seed ^ 0x5eed0d0c5ull) {}

  size_t pick_difficulty(bool words_only) {
    double total = 0;
    for (const ArithDifficulty& d : options.mix)
      if (!words_only || d.config.value("word_problems", false)) total += d.weight;
    double x = rng.unit() * total;
    size_t last = 0;
    for (size_t i = 0; i < options.mix.size(); ++i) {
      const ArithDifficulty& d = options.mix[i];
      if (words_only && !d.config.value("word_problems", false)) continue;
      last = i;
      if (x < d.weight) return i;
      x -= d.weight;
    }
    return last;
  }

  json take_task(size_t d) { return train_task(next_index[d]++); }

  Result<Document> demonstration() {
    const size_t d = pick_difficulty(false);
    ArithStrategy strategy = ArithStrategy::kCalculator;
    if (rng.unit() >= options.mix[d].calculator)
      strategy = rng.unit() < options.mix[d].worked ? ArithStrategy::kWorkedAnswer : ArithStrategy::kAnswer;
    const json task = take_task(d);
    ODY_ASSIGN_OR_RETURN(Demonstration demo,
                         play_arith_expert(*sessions[d], tokenizer, task, strategy, /*seed=*/rng.next()));
    for (DocumentSource& s : demo.document.sources) s.env_config = options.mix[d].config;
    ++demonstrations;
    return std::move(demo.document);
  }

  // A worked problem of difficulty d: its prompt (reset) and the grader's answer.
  Result<std::pair<std::string, Peek>> problem(size_t d, DocumentSource* source) {
    const json task = take_task(d);
    Result<env::Observation> obs = sessions[d]->reset(task, 0);
    if (!obs.ok()) return obs.status().with_context(fmt::format("arith reset with task {}", task.dump()));
    ODY_ASSIGN_OR_RETURN(Peek p, peek(*sessions[d]));
    *source = DocumentSource{options.mix[d].config, task, p.expression};
    return std::make_pair(obs->text, std::move(p));
  }

  Result<Document> text() {
    std::string text;
    std::vector<DocumentSource> sources;
    bool has_words = false;
    for (const ArithDifficulty& d : options.mix) has_words = has_words || d.config.value("word_problems", false);
    if (has_words && rng.unit() < 0.3) {
      // A word problem, worked: the story, its expression and the answer line.
      DocumentSource source;
      ODY_ASSIGN_OR_RETURN(auto p, problem(pick_difficulty(true), &source));
      text = fmt::format("{}\n{}={}\nanswer: {}", p.first, p.second.expression, p.second.expected, p.second.expected);
      sources.push_back(std::move(source));
    } else {
      // Lines of worked terse problems.
      const int64_t lines = rng.range(4, 12);
      for (int64_t i = 0; i < lines; ++i) {
        DocumentSource source;
        ODY_ASSIGN_OR_RETURN(auto p, problem(pick_difficulty(false), &source));
        text += fmt::format("{}{}={}", i ? "\n" : "", p.second.expression, p.second.expected);
        sources.push_back(std::move(source));
      }
    }
    Document doc = text_document(text, tokenizer);
    doc.sources = std::move(sources);
    ++texts;
    return doc;
  }
};

DocumentStream::DocumentStream(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DocumentStream::~DocumentStream() = default;

Result<std::unique_ptr<DocumentStream>> DocumentStream::create(const Tokenizer& tokenizer, const DataOptions& options) {
  if (options.mix.empty()) return invalid_argument("pretrain data: the difficulty mix is empty");
  for (const ArithDifficulty& d : options.mix) {
    if (!(d.weight > 0) || !(d.calculator >= 0 && d.calculator <= 1) || !(d.worked >= 0 && d.worked <= 1)) {
      return invalid_argument("pretrain data: difficulty {} needs weight > 0, calculator and worked in [0, 1]",
                              d.config.dump());
    }
  }
  if (!(options.text_fraction >= 0 && options.text_fraction <= 1)) {
    return invalid_argument("pretrain data: text_fraction {} is not in [0, 1]", options.text_fraction);
  }
  ODY_ASSIGN_OR_RETURN(const std::string path, envs::find_plugin(options.plugin, options.plugin_dirs));
  ODY_ASSIGN_OR_RETURN(std::shared_ptr<envs::Plugin> plugin, envs::Plugin::load(path));
  auto impl = std::make_unique<Impl>(tokenizer, options);
  for (size_t i = 0; i < options.mix.size(); ++i) {
    Result<std::unique_ptr<envs::EnvSession>> session = plugin->create(options.mix[i].config);
    if (!session.ok()) {
      return session.status().with_context(
          fmt::format("pretrain data: plugin {} with config {}", path, options.mix[i].config.dump()));
    }
    impl->sessions.push_back(std::move(session).value());
    // Each difficulty walks its own run of train tasks, starting where the seed says.
    impl->next_index.push_back((Rng(options.seed * 0x100000001b3ull + i).next() >> 40));
  }
  return std::unique_ptr<DocumentStream>(new DocumentStream(std::move(impl)));
}

Result<Document> DocumentStream::next() {
  Impl& s = *impl_;
  bool text = s.options.kind == DataKind::kText;
  if (s.options.kind == DataKind::kMixed) text = s.rng.unit() < s.options.text_fraction;
  return text ? s.text() : s.demonstration();
}

int64_t DocumentStream::demonstrations() const { return impl_->demonstrations; }
int64_t DocumentStream::texts() const { return impl_->texts; }

SequencePacker::SequencePacker(DocumentStream& stream, const Tokenizer& tokenizer, int64_t length)
    : stream_(stream), pad_(tokenizer.special_id(SpecialToken::kPad)), length_(std::max<int64_t>(length, 1)) {}

Result<PackedRow> SequencePacker::next_row() {
  PackedRow row;
  const size_t length = static_cast<size_t>(length_);
  row.tokens.reserve(length);
  row.loss_mask.reserve(length);
  while (row.tokens.size() < length) {
    if (!have_pending_) {
      ODY_ASSIGN_OR_RETURN(pending_, stream_.next());
      have_pending_ = true;
    }
    const size_t room = length - row.tokens.size();
    if (pending_.tokens.size() > room && !row.tokens.empty()) break;  // starts the next row
    const size_t take = std::min(room, pending_.tokens.size());
    row.tokens.insert(row.tokens.end(), pending_.tokens.begin(), pending_.tokens.begin() + static_cast<std::ptrdiff_t>(take));
    row.loss_mask.insert(row.loss_mask.end(), pending_.loss_mask.begin(),
                         pending_.loss_mask.begin() + static_cast<std::ptrdiff_t>(take));
    ++row.documents;
    have_pending_ = false;
  }
  row.tokens.resize(length, pad_);
  row.loss_mask.resize(length, 0);
  return row;
}

}  // namespace odyssey::learner
