// The arith environment's problems: seeded generation and the train/eval split.
//
// A problem is a chain of `steps` operations on natural numbers, each combining the running
// value with one new operand: ((a + b) * c) / d ... Every intermediate value is a whole number
// in [0, kValueCap]: subtraction never goes below zero and division is always exact (the
// divisor is drawn from the running value's divisors). Operands are at most max_operand (a
// running value may be larger).
//
// A running value of 0 is never multiplied or divided (that would only repeat it).
//
// Two renderings of the same chain:
//   terse ("(3+4)*2=?"): the expression with the fewest parentheses; + and * may put the new
//     operand on the left ("2*(3+4)=?"); operands may be 0, divisors start at 1.
//   words: a short story from one of a handful of themes (apples, money, a train, books), one
//     sentence per operation, then a question. Every number in a story is at least 2, so no
//     sentence says "1 books" or "0 passengers".
//
// The split: every problem has a key, its terse expression (for word problems too, so a story
// in a new costume is still the same problem). A problem belongs to the eval split exactly
// when hash(key) % kEvalModulus == 0 (FNV-1a 64, then the splitmix64 finalizer), and to the
// train split otherwise. Task N of a split is the first problem, over attempts 0, 1, 2, ...,
// generated from the seed mix(split, N, attempt) whose key belongs to that split. So the two
// splits can never share a problem, under any config, and eval problems are held out of
// training. A config whose problem space has no problem of a split (tiny spaces only) makes
// problem_for throw std::invalid_argument after kMaxAttempts.
//
// Everything here is deterministic across platforms: its own generator (splitmix64) and
// integer-only sampling, no <random> distributions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "odyssey/env_util.hpp"

namespace odyssey::arith {

inline constexpr int64_t kValueCap = 1'000'000'000'000;  // 10^12
inline constexpr uint64_t kEvalModulus = 10;               // 1 problem in 10 is eval
inline constexpr int kMaxAttempts = 10000;

struct ProblemSettings {
  int min_steps = 1;
  int max_steps = 3;
  int64_t max_operand = 20;
  bool word_problems = false;
};

enum class Split { kTrain, kEval };

struct Problem {
  std::string prompt;      // what the model reads
  std::string expression;  // the terse expression without "=?": the split key
  int64_t answer = 0;
  int steps = 0;
};

// The stream tasks are drawn from, and the hashes of the split: <odyssey/env_util.hpp>, the
// same on every platform.
using Rng = odyssey::env::SplitMix64;
using odyssey::env::fnv1a64;
using odyssey::env::mix64;

Split split_of(std::string_view expression);
const char* split_name(Split split);

Problem generate(const ProblemSettings& settings, Rng& rng);
// Task `index` of `split` (see the split above).
Problem problem_for(const ProblemSettings& settings, Split split, uint64_t index);

}  // namespace odyssey::arith
