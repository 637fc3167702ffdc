// Job configuration: layered TOML files plus `--set` overrides, checked against one registry
// of keys (core/config_keys.cpp) that gives every key its type, default, doc and limits.
//
// Resolution order, each step overriding the one before key by key:
//   1. the registered defaults;
//   2. each file in `files`, left to right, after its own `extends = "base.toml"` chain (the
//      path is relative to the including file; the base is applied first, so a later file's
//      base also overrides what earlier files set);
//   3. each `--set section.key=value`, in order. The value text is read as the key's type:
//      `true`/`false`, an integer, a number, a string (bare or TOML-quoted), or a TOML array
//      of strings such as `["a","b"]`.
//
// Errors are bad input from outside, so load_config never throws for them: it checks
// everything it can reach and returns one kInvalidArgument Status with one line per problem,
// so a user fixes them in one go. Each line names where the problem is and what to try:
//   config configs/tiny.toml:12: unknown key 'replay.credts' (did you mean 'replay.credits'?)
//   config configs/tiny.toml:3: key 'replay.credits' must be an integer, got string "abc"
//   config --set 'replay.sampler=lifo': key 'replay.sampler' must be one of fifo, uniform, ...
// Missing files, TOML syntax errors (with line and column) and `extends` cycles (naming the
// files in the cycle) are reported the same way.
//
// Asking a Config for a key that is not registered, or as the wrong type, is a programming
// error and throws std::logic_error naming the key. So does registering an invalid key.
//
// Thread-safety: a ConfigSchema is built once and then only read; a Config is immutable after
// load_config. Both are safe to read from any number of threads. A Config points at the
// schema it was loaded with, which must outlive it (config_schema() lives for the process).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "core/status.h"

namespace odyssey {

enum class ConfigType { kBool, kInt, kDouble, kString, kStrings };

// "bool", "int", "double", "string", "string list".
const char* config_type_name(ConfigType type);

// Alternatives in ConfigType order.
using ConfigValue = std::variant<bool, int64_t, double, std::string, std::vector<std::string>>;

// The value as TOML text: true, 16, 1.0, "out/replay", ["a", "b"].
std::string config_value_to_toml(const ConfigValue& value);

// Inclusive bounds for an int or double key.
struct ConfigRange {
  std::optional<double> min;
  std::optional<double> max;
};
inline ConfigRange at_least(double min) { return {min, std::nullopt}; }
inline ConfigRange at_most(double max) { return {std::nullopt, max}; }
inline ConfigRange between(double min, double max) { return {min, max}; }

struct ConfigKey {
  std::string path;                  // dotted, at least "section.key": replay.rate_limiter.min_size_to_sample
  ConfigType type;
  ConfigValue default_value;
  std::string doc;                   // one line
  std::vector<std::string> allowed;  // string keys: the only values accepted; empty = any
  ConfigRange range;                 // int and double keys
};

// The registry of every key. Adding a key is one call; each call checks the path (lowercase
// letters, digits and '_' per component, at least two components), that it is new and not a
// table of another key, and that the default respects the limits (std::logic_error if not).
class ConfigSchema {
 public:
  ConfigSchema& add_bool(const std::string& path, bool default_value, const std::string& doc);
  ConfigSchema& add_int(const std::string& path, int64_t default_value, const std::string& doc,
                        ConfigRange range = {});
  ConfigSchema& add_double(const std::string& path, double default_value, const std::string& doc,
                           ConfigRange range = {});
  ConfigSchema& add_string(const std::string& path, const std::string& default_value,
                           const std::string& doc, std::vector<std::string> allowed = {});
  ConfigSchema& add_strings(const std::string& path, std::vector<std::string> default_value,
                            const std::string& doc);

  // Keys in registration order.
  const std::vector<ConfigKey>& keys() const { return keys_; }
  // Index into keys(), or nullopt when `path` is not a registered key.
  std::optional<size_t> find(std::string_view path) const;
  // Whether `path` is a table holding keys: "replay", "replay.rate_limiter".
  bool is_table(std::string_view path) const;
  // One line per key: path, type, default, doc, then the allowed values or range if any.
  // What `odyssey config keys` prints.
  std::string reference() const;

 private:
  ConfigSchema& add(ConfigKey key);

  std::vector<ConfigKey> keys_;
  std::map<std::string, size_t, std::less<>> index_;
  std::set<std::string, std::less<>> tables_;  // every proper prefix of a key path
};

// The registry of every odyssey key, built on first use (core/config_keys.cpp).
const ConfigSchema& config_schema();

// A resolved configuration: one value for every registered key, and where it came from.
class Config {
 public:
  bool get_bool(std::string_view path) const;
  int64_t get_int(std::string_view path) const;
  double get_double(std::string_view path) const;
  const std::string& get_string(std::string_view path) const;
  const std::vector<std::string>& get_strings(std::string_view path) const;
  const ConfigValue& value(std::string_view path) const;

  // "default", "<file>:<line>" (the file as named on the command line or by `extends`),
  // or "--set".
  const std::string& source(std::string_view path) const;

  // Every registered key as TOML, grouped by table in registration order, with a trailing
  // `# from <source>` on values that are not defaults. Loading the text gives back the same
  // values. This is what `--dry-run` prints.
  std::string to_toml() const;

  const ConfigSchema& schema() const { return *schema_; }

 private:
  friend class ConfigLoader;
  explicit Config(const ConfigSchema& schema);
  size_t index_of(std::string_view path) const;  // throws std::logic_error when unregistered
  const ConfigValue& typed(std::string_view path, ConfigType type) const;

  const ConfigSchema* schema_;
  std::vector<ConfigValue> values_;   // parallel to schema_->keys()
  std::vector<std::string> sources_;
};

// Resolves defaults, then `files` (may be empty), then `overrides` ("section.key=value").
Result<Config> load_config(const std::vector<std::string>& files,
                           const std::vector<std::string>& overrides,
                           const ConfigSchema& schema = config_schema());

}  // namespace odyssey
