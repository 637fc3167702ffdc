#include "problems.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

namespace odyssey::arith {

Split split_of(std::string_view expression) {
  return mix64(fnv1a64(expression)) % kEvalModulus == 0 ? Split::kEval : Split::kTrain;
}

const char* split_name(Split split) { return split == Split::kEval ? "eval" : "train"; }

namespace {

int precedence(char op) { return op == '+' || op == '-' ? 1 : 2; }

// Story pieces. Placeholders: {Name} {He} {he} {him} {His} {his} {himself} {a} {b}.
struct Theme {
  const char* intro;
  std::vector<const char*> add, sub, mul, div;
  const char* question;
};

const std::vector<Theme>& themes() {
  static const std::vector<Theme> all = {
      {"{Name} has {a} apples.",
       {"{He} picks {b} more apples.", "A friend gives {him} {b} apples."},
       {"{He} eats {b} of them.", "{He} gives {b} apples to a neighbour."},
       {"{He} swaps each apple for {b} apples at the market.",
        "Then {his} pile of apples becomes {b} times as big."},
       {"{He} splits {his} apples into {b} equal bags and keeps only one bag.",
        "{He} shares the apples equally among {b} people, {himself} included, and keeps {his} share."},
       "How many apples does {he} have now?"},
      {"{Name} has {a} dollars.",
       {"{He} earns {b} dollars.", "{His} aunt gives {him} {b} dollars."},
       {"{He} spends {b} dollars on lunch.", "{He} pays {b} dollars for a book."},
       {"{His} savings grow to {b} times as much.", "{He} invests it and ends up with {b} times as much money."},
       {"{He} splits the money equally into {b} envelopes and keeps one envelope.",
        "{He} shares the money equally among {b} people, {himself} included, and keeps {his} share."},
       "How many dollars does {he} have now?"},
      {"A train leaves the first station with {a} passengers.",
       {"At the next stop {b} people get on.", "At the next station {b} more passengers board."},
       {"At the next stop {b} people get off.", "At the next station {b} passengers leave the train."},
       {"At a big city the number of passengers becomes {b} times as large."},
       {"The train is split into {b} parts with equal numbers of passengers, and only one part travels on."},
       "How many passengers are on the train now?"},
      {"{Name}'s shelf holds {a} books.",
       {"{He} buys {b} new books.", "{He} receives {b} books as a gift."},
       {"{He} lends {b} books to friends.", "{He} donates {b} books to a school."},
       {"{He} inherits a collection, and {his} books become {b} times as many."},
       {"{He} sorts {his} books equally onto {b} shelves, then gives away every shelf but one."},
       "How many books does {he} have now?"},
  };
  return all;
}

struct Person {
  const char* name;
  bool she;
};
constexpr Person kPeople[] = {{"Mia", true}, {"Tom", false}, {"Ava", true},  {"Leo", false},
                              {"Sara", true}, {"Omar", false}, {"Lena", true}, {"Ben", false}};

std::string fill(std::string_view pattern, const Person& who, int64_t a, int64_t b) {
  std::string out;
  for (size_t i = 0; i < pattern.size();) {
    if (pattern[i] != '{') {
      out += pattern[i++];
      continue;
    }
    const size_t close = pattern.find('}', i);
    const std::string_view key = pattern.substr(i + 1, close - i - 1);
    i = close + 1;
    if (key == "Name") out += who.name;
    else if (key == "He") out += who.she ? "She" : "He";
    else if (key == "he") out += who.she ? "she" : "he";
    else if (key == "him") out += who.she ? "her" : "him";
    else if (key == "His") out += who.she ? "Her" : "His";
    else if (key == "his") out += who.she ? "her" : "his";
    else if (key == "himself") out += who.she ? "herself" : "himself";
    else if (key == "a") out += std::to_string(a);
    else if (key == "b") out += std::to_string(b);
  }
  return out;
}

// Divisors of v in [lo, hi] (every number there when v == 0).
std::vector<int64_t> divisors(int64_t v, int64_t lo, int64_t hi) {
  std::vector<int64_t> out;
  for (int64_t d = lo; d <= hi; ++d)
    if (v % d == 0) out.push_back(d);
  return out;
}

struct Operation {
  char op;
  int64_t operand;
  bool operand_left;  // terse only: "b+(...)" instead of "(...)+b"
};

}  // namespace

Problem generate(const ProblemSettings& s, Rng& rng) {
  const bool words = s.word_problems;
  const int64_t M = s.max_operand;
  // Stories never say "1 books" or "0 passengers": their operands start at 2.
  const int64_t lo = words ? 2 : 0;   // smallest operand of + and - (and first value)
  const int64_t mlo = words ? 2 : 0;  // smallest multiplier
  const int64_t dlo = words ? 2 : 1;  // smallest divisor
  const int steps = static_cast<int>(rng.uniform(s.min_steps, s.max_steps));

  // The first operation draws both operands together, so that a - b >= 0 and a / b is exact
  // with a <= max_operand: a - b orders two uniform draws, a / b draws a and then one of its
  // divisors.
  const char first_ops[] = {'+', '-', '*', '/'};
  const char first = first_ops[rng.uniform(0, 3)];
  int64_t a = rng.uniform(lo, M), b = 0;
  switch (first) {
    case '+': b = rng.uniform(lo, M); break;
    case '-': b = rng.uniform(lo, M); if (b > a) std::swap(a, b); break;
    case '*': b = rng.uniform(mlo, M); break;
    default: {
      const std::vector<int64_t> divs = divisors(a, dlo, M);
      b = divs[rng.uniform(0, static_cast<int64_t>(divs.size()) - 1)];
      break;
    }
  }
  std::vector<Operation> ops = {{first, b, false}};
  int64_t v = first == '+' ? a + b : first == '-' ? a - b : first == '*' ? a * b : a / b;

  for (int i = 1; i < steps; ++i) {
    // Each operation with its operand range, when that range is not empty.
    std::vector<char> feasible;
    if (kValueCap - v >= lo) feasible.push_back('+');
    if (v >= lo) feasible.push_back('-');
    const int64_t mhi = std::min(M, kValueCap / std::max<int64_t>(v, 1));
    // Multiplying or dividing a zero would only repeat it.
    if (mhi >= mlo && v != 0) feasible.push_back('*');
    std::vector<int64_t> divs;
    if (v != 0) {
      divs = divisors(v, dlo, M);
      if (!divs.empty()) feasible.push_back('/');
    }
    const char op = feasible[rng.uniform(0, static_cast<int64_t>(feasible.size()) - 1)];
    int64_t operand = 0;
    switch (op) {
      case '+': operand = rng.uniform(lo, std::min(M, kValueCap - v)); v += operand; break;
      case '-': operand = rng.uniform(lo, std::min(M, v)); v -= operand; break;
      case '*': operand = rng.uniform(mlo, mhi); v *= operand; break;
      default:
        operand = divs[rng.uniform(0, static_cast<int64_t>(divs.size()) - 1)];
        v /= operand;
        break;
    }
    const bool commutative = op == '+' || op == '*';
    ops.push_back({op, operand, !words && commutative && rng.uniform(0, 1) == 1});
  }

  Problem p;
  p.answer = v;
  p.steps = steps;

  // The terse expression, with parentheses only where precedence needs them.
  std::string expr = std::to_string(a) + first + std::to_string(b);
  int prec = precedence(first);
  for (size_t i = 1; i < ops.size(); ++i) {
    const Operation& o = ops[i];
    const std::string inner = prec < precedence(o.op) ? "(" + expr + ")" : expr;
    expr = o.operand_left ? std::to_string(o.operand) + o.op + inner : inner + o.op + std::to_string(o.operand);
    prec = precedence(o.op);
  }
  p.expression = expr;

  if (!words) {
    p.prompt = expr + "=?";
    return p;
  }
  const Theme& theme = themes()[rng.uniform(0, static_cast<int64_t>(themes().size()) - 1)];
  const Person& who = kPeople[rng.uniform(0, std::size(kPeople) - 1)];
  std::string story = fill(theme.intro, who, a, 0);
  for (const Operation& o : ops) {
    const std::vector<const char*>& choices =
        o.op == '+' ? theme.add : o.op == '-' ? theme.sub : o.op == '*' ? theme.mul : theme.div;
    story += ' ';
    story += fill(choices[rng.uniform(0, static_cast<int64_t>(choices.size()) - 1)], who, a, o.operand);
  }
  story += ' ';
  story += fill(theme.question, who, a, 0);
  p.prompt = story;
  return p;
}

Problem problem_for(const ProblemSettings& settings, Split split, uint64_t index) {
  const uint64_t domain = fnv1a64(split == Split::kEval ? "arith/eval" : "arith/train");
  const uint64_t task_seed = mix64(domain ^ mix64(index));
  for (int attempt = 0; attempt < kMaxAttempts; ++attempt) {
    Rng rng(mix64(task_seed + static_cast<uint64_t>(attempt)));
    Problem p = generate(settings, rng);
    if (split_of(p.expression) == split) return p;
  }
  throw std::invalid_argument(std::string("no ") + split_name(split) + " problem found in " +
                              std::to_string(kMaxAttempts) +
                              " draws: this config's problem space is too small (raise max_operand or max_steps)");
}

}  // namespace odyssey::arith
