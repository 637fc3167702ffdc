// The arith environment's calculator: an exact evaluator of integer arithmetic expressions.
//
// Grammar (recursive descent; spaces and tabs are ignored between tokens):
//
//   expression = term (("+" | "-") term)*
//   term       = unary (("*" | "/") unary)*
//   unary      = ("-" | "+") unary | primary
//   primary    = integer | "(" expression ")"
//   integer    = decimal digits
//
// Values are exact rationals (numerator and denominator in the signed 64-bit range, the
// denominator positive, the fraction reduced): 7/2 stays 7/2, 7/2*2 is 7. Intermediate
// products are computed in 128 bits, so a value that does not fit after reduction is an
// overflow error; nothing is ever rounded and no floating point is used.
//
// Errors are values, not exceptions: a message that says what went wrong and where, with
// 1-based columns ("division by zero at column 4", "unexpected 'x' at column 3 (expected a
// number or '(')"). Inputs are bounded (kMaxLength characters, kMaxDepth nested parentheses or
// signs), so no input can exhaust the stack. Thread-safe: no shared state.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace odyssey::arith {

struct Rational {
  int64_t num = 0;
  int64_t den = 1;  // > 0; gcd(num, den) == 1

  bool is_integer() const { return den == 1; }
  bool operator==(const Rational& o) const { return num == o.num && den == o.den; }
  // "7", "-3", "7/2", "-1/3".
  std::string to_string() const;
};

struct Evaluation {
  std::optional<Rational> value;  // set on success
  std::string error;              // set on failure
  bool ok() const { return value.has_value(); }
};

inline constexpr size_t kMaxLength = 1000;
inline constexpr int kMaxDepth = 100;

Evaluation evaluate(std::string_view expression);

}  // namespace odyssey::arith
