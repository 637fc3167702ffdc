// Training documents for `odyssey pretrain`: episodes of the real environment plugins played by a
// scripted expert, rendered in exactly the actors' transcript format (actors/transcript.h), plus
// a small generated text corpus; and the packing of documents into fixed-length rows.
//
// A demonstration is one arith episode (envs/builtin/arith), run through envs::Episode on an
// in-process session of the real plugin, so every observation is what the environment returns:
//
//   <|bos|> <|user|> 3+4=? <|end_turn|> <|assistant|>                  prompt (render_observation)
//   <|tool_call|>{"name":"answer","arguments":{"value":7}}<|/tool_call|><|end_turn|>   the expert
//   <|tool|> <|tool_result|>recorded 7<|/tool_result|> <|end_turn|>     the env's observation
//   <|eos|>
//
// or, worked (ArithStrategy::kWorkedAnswer), the same turn with the problem worked out as text
// before the call: <|assistant|>3+4=7<|tool_call|>{"name":"answer",...}; or, with the calculator
// first (ArithStrategy::kCalculator), a turn {"name":"calculator","arguments":{"expression":"3+4"}},
// the tool turn with "7", <|assistant|>, then the answer turn as above. The worked line is the
// same text as the text corpus's lines, so what the model learns from one serves the other. Tool calls are written by a compact JSON serializer (no spaces,
// keys "name" then "arguments"). The loss mask is 1 on exactly the expert's tokens (each turn
// after <|assistant|>, through its <|end_turn|>) and 0 on everything the framework or the
// environment writes (<|bos|>, the user turn, <|assistant|>, tool turns, <|eos|>), as actors
// mask trajectories.
//
// The expert reads the problem from the environment's own grader: score() right after reset
// holds the expected answer and the terse expression (for word problems too), which it answers
// or hands to the calculator. A demonstration whose episode is not a success is an error
// (kInternal): the expert never teaches a wrong answer.
//
// Tasks are always {"split": "train", "index": N}: the eval split (held out by the environment's
// own rule, envs/builtin/arith/problems.h) never appears in any document, text included.
//
// Text documents are <|bos|> text <|eos|> with the loss on every token after <|bos|>: lines of
// worked terse problems ("(3+4)*2=14") and word problems followed by their expression and an
// "answer: N" line, all drawn from train tasks of the same difficulty mix.
//
// Everything is deterministic in DataOptions::seed (own splitmix64 generator, no <random>
// distributions). Errors: creating a stream fails (kNotFound / kInvalidArgument, naming the
// plugin or the config) when the plugin cannot be found or refuses a difficulty's config.
// Thread-safety: a DocumentStream belongs to one thread; the free functions are reentrant.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "core/tokenizer.h"
#include "envs/session.h"

namespace odyssey::learner {

// Where a document's problem came from: the environment config and the task.
struct DocumentSource {
  nlohmann::json env_config;
  nlohmann::json task;
  std::string expression;  // the problem's terse expression (the split key)
};

// One training document: tokens and, per token, whether the model learns to write it.
struct Document {
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> loss_mask;  // same length as tokens
  std::vector<DocumentSource> sources;
  bool demonstration = false;  // an episode (else text)
};

enum class ArithStrategy {
  kAnswer,        // one turn: the answer tool with the value
  kWorkedAnswer,  // one turn: "<expression>=<value>" as text, then the answer tool
  kCalculator,  // the calculator with the problem's expression, then the answer tool with its result
};

// A share of the demonstrations: an arith config, its relative weight and how the expert solves
// it: with the calculator first (probability `calculator`), else worked out as text before the
// answer (probability `worked`), else the bare answer.
struct ArithDifficulty {
  nlohmann::json config;
  double weight = 1.0;
  double calculator = 0.0;  // probability of ArithStrategy::kCalculator
  double worked = 1.0;      // of the others: probability of kWorkedAnswer (else kAnswer)
};

// Mostly the easiest config {"min_steps":1,"max_steps":1,"max_operand":9} (worked and answered
// directly three times in four, else with the calculator), plus multi-step terse and word
// problems (mostly with the calculator).
std::vector<ArithDifficulty> default_arith_mix();

// The tool call as the expert writes it: {"name":"answer","arguments":{"value":7}}.
std::string compact_tool_call(const std::string& name, const nlohmann::json& arguments);

struct Demonstration {
  Document document;
  int64_t answer = 0;  // the value the expert gave
  uint32_t turns = 0;  // model turns
  bool success = false;
};

// Plays one episode of `session` (an arith instance) on `task` with the scripted expert.
Result<Demonstration> play_arith_expert(envs::EnvSession& session, const Tokenizer& tokenizer,
                                        const nlohmann::json& task, ArithStrategy strategy, uint64_t seed = 0);

// <|bos|> text <|eos|>, loss on everything after <|bos|>.
Document text_document(const std::string& text, const Tokenizer& tokenizer);

enum class DataKind { kDemonstrations, kText, kMixed };
// "demonstrations", "text", "mixed" (pretrain.data).
Result<DataKind> parse_data_kind(const std::string& name);
const char* data_kind_name(DataKind kind);

struct DataOptions {
  DataKind kind = DataKind::kDemonstrations;
  uint64_t seed = 0;
  std::vector<ArithDifficulty> mix = default_arith_mix();
  double text_fraction = 0.25;  // kMixed: share of text documents
  std::string plugin = "arith";  // name or path (envs/plugin.h find_plugin)
  std::vector<std::string> plugin_dirs;
};

// An endless, deterministic stream of documents.
class DocumentStream {
 public:
  static Result<std::unique_ptr<DocumentStream>> create(const Tokenizer& tokenizer, const DataOptions& options);
  ~DocumentStream();

  Result<Document> next();

  int64_t demonstrations() const;  // produced so far
  int64_t texts() const;

 private:
  struct Impl;
  explicit DocumentStream(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A row of a training batch: exactly `length` tokens.
struct PackedRow {
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> loss_mask;
  int64_t documents = 0;  // documents that start in this row
};

// Fills rows of exactly `length` tokens with whole documents, one after another (so documents
// meet as ...<|eos|><|bos|>...), and pads the rest of a row with <|pad|> (loss mask 0) when the
// next document does not fit; that document starts the next row. A document longer than a row
// is cut to its first `length` tokens. The policy has no positions other than its recurrence,
// so several episodes in one row are just a longer context.
class SequencePacker {
 public:
  SequencePacker(DocumentStream& stream, const Tokenizer& tokenizer, int64_t length);

  Result<PackedRow> next_row();
  int64_t length() const { return length_; }

 private:
  DocumentStream& stream_;
  uint32_t pad_;
  int64_t length_;
  bool have_pending_ = false;
  Document pending_;
};

}  // namespace odyssey::learner
