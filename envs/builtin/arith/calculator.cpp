#include "calculator.h"

#include <cstdio>
#include <limits>

namespace odyssey::arith {
namespace {

using i128 = __int128;
constexpr int64_t kMax = std::numeric_limits<int64_t>::max();  // values live in [-kMax, kMax]

i128 gcd128(i128 a, i128 b) {
  if (a < 0) a = -a;
  if (b < 0) b = -b;
  while (b != 0) {
    const i128 t = a % b;
    a = b;
    b = t;
  }
  return a;
}

// Thrown inside the parser only; evaluate() turns it into Evaluation::error.
struct ParseFailure {
  std::string message;
};

// num/den from 128-bit parts (den != 0), reduced, sign on the numerator; fails when it does
// not fit the 64-bit range. `column` is the operator that produced it, for the message.
Rational make(i128 num, i128 den, size_t column) {
  if (den < 0) {
    num = -num;
    den = -den;
  }
  const i128 g = gcd128(num, den);
  if (g > 1) {
    num /= g;
    den /= g;
  }
  if (num > kMax || num < -i128(kMax) || den > kMax)
    throw ParseFailure{"overflow at column " + std::to_string(column) +
                       ": the result does not fit in 64 bits (at most 9223372036854775807 in size)"};
  return {static_cast<int64_t>(num), static_cast<int64_t>(den)};
}

class Parser {
 public:
  explicit Parser(std::string_view text) : s_(text) {}

  Rational parse() {
    skip_spaces();
    if (pos_ == s_.size()) throw ParseFailure{"empty expression"};
    const Rational v = expression();
    skip_spaces();
    if (pos_ != s_.size()) {
      if (s_[pos_] == ')') throw ParseFailure{"unmatched ')' at column " + std::to_string(pos_ + 1)};
      throw ParseFailure{"unexpected " + describe(pos_) + " at column " + std::to_string(pos_ + 1) +
                         " (expected an operator + - * / or the end)"};
    }
    return v;
  }

 private:
  Rational expression() {
    Rational v = term();
    for (;;) {
      skip_spaces();
      if (pos_ == s_.size() || (s_[pos_] != '+' && s_[pos_] != '-')) return v;
      const char op = s_[pos_];
      const size_t column = ++pos_;
      const Rational r = term();
      const i128 a = i128(v.num) * r.den, b = i128(r.num) * v.den;
      v = make(op == '+' ? a + b : a - b, i128(v.den) * r.den, column);
    }
  }

  Rational term() {
    Rational v = unary();
    for (;;) {
      skip_spaces();
      if (pos_ == s_.size() || (s_[pos_] != '*' && s_[pos_] != '/')) return v;
      const char op = s_[pos_];
      const size_t column = ++pos_;
      const Rational r = unary();
      if (op == '*') {
        v = make(i128(v.num) * r.num, i128(v.den) * r.den, column);
      } else {
        if (r.num == 0) throw ParseFailure{"division by zero at column " + std::to_string(column)};
        v = make(i128(v.num) * r.den, i128(v.den) * r.num, column);
      }
    }
  }

  Rational unary() {
    skip_spaces();
    if (pos_ < s_.size() && (s_[pos_] == '-' || s_[pos_] == '+')) {
      const bool negate = s_[pos_] == '-';
      const size_t column = ++pos_;
      enter(column);
      Rational v = unary();
      --depth_;
      if (negate) v.num = -v.num;  // |num| <= kMax, so this cannot overflow
      return v;
    }
    return primary();
  }

  Rational primary() {
    skip_spaces();
    if (pos_ == s_.size()) throw ParseFailure{"unexpected end of expression (expected a number or '(')"};
    const char c = s_[pos_];
    if (c >= '0' && c <= '9') {
      const size_t start = pos_;
      i128 n = 0;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
        n = n * 10 + (s_[pos_] - '0');
        if (n > kMax)
          throw ParseFailure{"overflow at column " + std::to_string(start + 1) + ": the number " +
                             "does not fit in 64 bits (at most 9223372036854775807)"};
        ++pos_;
      }
      return {static_cast<int64_t>(n), 1};
    }
    if (c == '(') {
      const size_t open = ++pos_;
      enter(open);
      const Rational v = expression();
      --depth_;
      skip_spaces();
      if (pos_ == s_.size())
        throw ParseFailure{"missing ')' at the end for the '(' at column " + std::to_string(open)};
      if (s_[pos_] != ')')
        throw ParseFailure{"unexpected " + describe(pos_) + " at column " + std::to_string(pos_ + 1) +
                           " (expected ')' or an operator)"};
      ++pos_;
      return v;
    }
    throw ParseFailure{"unexpected " + describe(pos_) + " at column " + std::to_string(pos_ + 1) +
                       " (expected a number or '(')"};
  }

  void enter(size_t column) {
    if (++depth_ > kMaxDepth)
      throw ParseFailure{"too deeply nested at column " + std::to_string(column) + " (at most " +
                         std::to_string(kMaxDepth) + " levels of parentheses and signs)"};
  }

  void skip_spaces() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t')) ++pos_;
  }

  // The byte at i as the message shows it: 'x', or \xNN when it is not printable ASCII.
  std::string describe(size_t i) const {
    const auto c = static_cast<unsigned char>(s_[i]);
    if (c >= 0x20 && c < 0x7f) return std::string("'") + static_cast<char>(c) + "'";
    char buf[16];
    std::snprintf(buf, sizeof buf, "byte \\x%02x", c);
    return buf;
  }

  std::string_view s_;
  size_t pos_ = 0;
  int depth_ = 0;
};

}  // namespace

std::string Rational::to_string() const {
  return den == 1 ? std::to_string(num) : std::to_string(num) + "/" + std::to_string(den);
}

Evaluation evaluate(std::string_view expression) {
  Evaluation out;
  if (expression.size() > kMaxLength) {
    out.error = "expression too long (" + std::to_string(expression.size()) + " characters; at most " +
                std::to_string(kMaxLength) + ")";
    return out;
  }
  try {
    out.value = Parser(expression).parse();
  } catch (const ParseFailure& f) {
    out.error = f.message;
  }
  return out;
}

}  // namespace odyssey::arith
