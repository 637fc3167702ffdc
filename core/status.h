// Status and Result<T>: how fallible edges (I/O, network, plugins, parsing) report failure.
//
// A Status is OK or carries a code and a message that says where and what to try. Both types
// are [[nodiscard]]: a caller must look at them. Code inside a role may throw; one boundary per
// role converts exceptions to Status (see ODYSSEY_TRY below).
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <utility>
#include <variant>

#include <fmt/format.h>

namespace odyssey {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,   // bad input from outside: config, message, file, tool call
  kNotFound,
  kAlreadyExists,
  kConflict,          // same key, different content
  kCorrupt,           // stored data failed an integrity check
  kIo,
  kUnavailable,       // a peer did not answer; retrying may help
  kTimeout,
  kResourceExhausted, // over a limit; back off
  kFailedPrecondition,
  kInternal,
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "<code>: <message>", or "ok".
  std::string to_string() const;
  // Prefixes context: Status(kIo, "x").with_context("reading f") -> "reading f: x".
  Status with_context(const std::string& context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

template <typename... Args>
Status make_status(StatusCode code, fmt::format_string<Args...> f, Args&&... args) {
  return Status(code, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Status invalid_argument(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kInvalidArgument, fmt::format(f, std::forward<Args>(args)...));
}

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}                 // NOLINT: implicit on purpose
  Result(Status status) : status_(std::move(status)) { assert(!status_.ok()); }  // NOLINT

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() & { assert(ok()); return *value_; }
  const T& value() const& { assert(ok()); return *value_; }
  T&& value() && { assert(ok()); return std::move(*value_); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace odyssey

// Returns the Status from the enclosing function when it is not OK.
#define ODY_RETURN_IF_ERROR(expr)                  \
  do {                                             \
    ::odyssey::Status ody_status_ = (expr);        \
    if (!ody_status_.ok()) return ody_status_;     \
  } while (0)

#define ODY_CONCAT_INNER(a, b) a##b
#define ODY_CONCAT(a, b) ODY_CONCAT_INNER(a, b)
// ODY_ASSIGN_OR_RETURN(auto x, f()): x = f().value(), or return f()'s Status.
#define ODY_ASSIGN_OR_RETURN(lhs, expr) \
  ODY_ASSIGN_OR_RETURN_IMPL(ODY_CONCAT(ody_result_, __LINE__), lhs, expr)
#define ODY_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()
