#include "core/config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <utility>

#include <toml++/toml.h>

namespace odyssey {

namespace fs = std::filesystem;

const char* config_type_name(ConfigType type) {
  switch (type) {
    case ConfigType::kBool: return "bool";
    case ConfigType::kInt: return "int";
    case ConfigType::kDouble: return "double";
    case ConfigType::kString: return "string";
    case ConfigType::kStrings: return "string list";
  }
  return "unknown";
}

namespace {

// How an error message says what a key of `type` must be.
const char* expected_phrase(ConfigType type) {
  switch (type) {
    case ConfigType::kBool: return "a boolean (true or false)";
    case ConfigType::kInt: return "an integer";
    case ConfigType::kDouble: return "a number";
    case ConfigType::kString: return "a string";
    case ConfigType::kStrings: return "a list of strings, such as [\"a\", \"b\"]";
  }
  return "unknown";
}

// A TOML basic string: quoted, with backslash escapes for quotes and control characters.
std::string quote(std::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\t': out += "\\t"; break;
      case '\n': out += "\\n"; break;
      case '\f': out += "\\f"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
          out += fmt::format("\\u{:04X}", static_cast<unsigned char>(c));
        } else {
          out += c;
        }
    }
  }
  return out + '"';
}

// Shortest text that reads back as the same double, always with a '.' or exponent so TOML
// reads it as a float.
std::string format_double(double value) {
  std::string text = fmt::format("{}", value);
  if (text.find_first_of(".en") == std::string::npos) text += ".0";
  return text;
}

std::string join(const std::vector<std::string>& items, std::string_view separator) {
  std::string out;
  for (const std::string& item : items) {
    if (!out.empty()) out += separator;
    out += item;
  }
  return out;
}

std::string_view trim(std::string_view text) {
  const auto first = text.find_first_not_of(" \t");
  if (first == std::string_view::npos) return {};
  return text.substr(first, text.find_last_not_of(" \t") - first + 1);
}

std::string_view leaf_of(std::string_view path) { return path.substr(path.rfind('.') + 1); }

std::string_view table_of(std::string_view path) {
  const auto dot = path.rfind('.');
  return dot == std::string_view::npos ? std::string_view{} : path.substr(0, dot);
}

// Edit distance counting an insertion, deletion, substitution or swap of neighbours as one.
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

// The candidate within edit distance 2 of `word` (closest first, then earliest), or "".
std::string nearest(std::string_view word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_distance = 3;
  for (const std::string& candidate : candidates) {
    const size_t distance = edit_distance(word, candidate);
    if (distance < best_distance) {
      best = candidate;
      best_distance = distance;
    }
  }
  return best;
}

std::string did_you_mean(const std::string& candidate) {
  return candidate.empty() ? "" : fmt::format(" (did you mean '{}'?)", candidate);
}

// A registered key or table close to an unknown `path`: a typo of the whole path, else the
// same leaf in another table (job.credits -> replay.credits), else a leaf typo elsewhere.
std::string suggest_key(const ConfigSchema& schema, std::string_view path) {
  std::vector<std::string> candidates;
  for (const ConfigKey& key : schema.keys()) {
    candidates.push_back(key.path);
    for (auto table = table_of(key.path); !table.empty(); table = table_of(table)) {
      if (std::find(candidates.begin(), candidates.end(), table) == candidates.end()) {
        candidates.emplace_back(table);
      }
    }
  }
  if (std::string close = nearest(path, candidates); !close.empty()) return did_you_mean(close);
  const std::string_view leaf = leaf_of(path);
  std::string same_leaf_typo;
  for (const ConfigKey& key : schema.keys()) {
    if (leaf_of(key.path) == leaf) return did_you_mean(key.path);
    if (same_leaf_typo.empty() && leaf.size() >= 5 && edit_distance(leaf_of(key.path), leaf) <= 2) {
      same_leaf_typo = key.path;
    }
  }
  return did_you_mean(same_leaf_typo);
}

// "at least 1", "at most 10", "between 0 and 1".
std::string range_phrase(const ConfigRange& range) {
  if (range.min && range.max) return fmt::format("between {} and {}", *range.min, *range.max);
  if (range.min) return fmt::format("at least {}", *range.min);
  if (range.max) return fmt::format("at most {}", *range.max);
  return "";
}

// What is wrong with `value` under the key's allowed set and range; "" when nothing is.
std::string limit_violation(const ConfigKey& key, const ConfigValue& value) {
  if (!key.allowed.empty()) {
    const auto& text = std::get<std::string>(value);
    if (std::find(key.allowed.begin(), key.allowed.end(), text) == key.allowed.end()) {
      return fmt::format("key '{}' must be one of {}, got {}{}", key.path, join(key.allowed, ", "),
                         quote(text), did_you_mean(nearest(text, key.allowed)));
    }
  }
  if (key.type == ConfigType::kInt || key.type == ConfigType::kDouble) {
    const double number = key.type == ConfigType::kInt
                              ? static_cast<double>(std::get<int64_t>(value))
                              : std::get<double>(value);
    if ((key.range.min && number < *key.range.min) || (key.range.max && number > *key.range.max)) {
      return fmt::format("key '{}' must be {}, got {}", key.path, range_phrase(key.range),
                         config_value_to_toml(value));
    }
  }
  return "";
}

// A parsed TOML value as TOML text, strings double-quoted: "abc", 1.5, ["a", "b"].
std::string node_text(const toml::node& node) {
  if (const auto* string = node.as_string()) return quote(string->get());
  if (const auto* number = node.as_floating_point()) return format_double(number->get());
  if (const auto* array = node.as_array()) {
    std::vector<std::string> items;
    for (const toml::node& item : *array) items.push_back(node_text(item));
    return "[" + join(items, ", ") + "]";
  }
  if (node.is_table()) return "{...}";
  std::ostringstream text;
  node.visit([&](const auto& n) {
    if constexpr (toml::is_value<decltype(n)>) text << n;
  });
  return text.str();
}

// A parsed TOML value as an error message shows it: `string "abc"`, `integer 3`, `a table`.
std::string describe_node(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "array " + node_text(node);
    case toml::node_type::string: return "string " + node_text(node);
    case toml::node_type::integer: return "integer " + node_text(node);
    case toml::node_type::floating_point: return "float " + node_text(node);
    case toml::node_type::boolean: return "boolean " + node_text(node);
    case toml::node_type::date: return "date " + node_text(node);
    case toml::node_type::time: return "time " + node_text(node);
    default: return "date-time " + node_text(node);
  }
}

// Reads `node` as the key's type and checks the key's limits. The error names the key but not
// where the value came from.
Result<ConfigValue> convert(const ConfigKey& key, const toml::node& node) {
  auto mismatch = [&] {
    return invalid_argument("key '{}' must be {}, got {}", key.path, expected_phrase(key.type), describe_node(node));
  };
  ConfigValue value;
  switch (key.type) {
    case ConfigType::kBool:
      if (!node.is_boolean()) return mismatch();
      value = node.as_boolean()->get();
      break;
    case ConfigType::kInt:
      if (!node.is_integer()) return mismatch();
      value = node.as_integer()->get();
      break;
    case ConfigType::kDouble:
      if (node.is_integer()) {
        value = static_cast<double>(node.as_integer()->get());
      } else if (node.is_floating_point() && std::isfinite(node.as_floating_point()->get())) {
        value = node.as_floating_point()->get();
      } else {
        return mismatch();
      }
      break;
    case ConfigType::kString:
      if (!node.is_string()) return mismatch();
      value = node.as_string()->get();
      break;
    case ConfigType::kStrings: {
      const toml::array* array = node.as_array();
      if (array == nullptr) return mismatch();
      std::vector<std::string> items;
      for (const toml::node& item : *array) {
        if (!item.is_string()) return mismatch();
        items.push_back(item.as_string()->get());
      }
      value = std::move(items);
      break;
    }
  }
  if (std::string violation = limit_violation(key, value); !violation.empty()) {
    return Status(StatusCode::kInvalidArgument, std::move(violation));
  }
  return value;
}

// Reads `--set` value text as the key's type: bare text is the string itself for string keys;
// anything else is TOML value text, parsed as one assignment so that extra keys are rejected.
Result<ConfigValue> parse_override_value(const ConfigKey& key, const std::string& text) {
  if (key.type == ConfigType::kString && (text.empty() || (text[0] != '"' && text[0] != '\''))) {
    return convert(key, toml::value<std::string>(text));
  }
  toml::table parsed;
  try {
    parsed = toml::parse("value = " + text + "\n");
  } catch (const toml::parse_error&) {
    return invalid_argument("key '{}' must be {}, got {}", key.path, expected_phrase(key.type), quote(text));
  }
  const toml::node* node = parsed.get("value");
  if (node == nullptr || parsed.size() != 1) {
    return invalid_argument("key '{}' must be {}, got {}", key.path, expected_phrase(key.type), quote(text));
  }
  return convert(key, *node);
}

bool is_valid_path(std::string_view path) {
  if (path.find('.') == std::string_view::npos) return false;
  size_t component = 0;
  for (char c : path) {
    if (c == '.') {
      if (component == 0) return false;
      component = 0;
    } else if ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_') {
      ++component;
    } else {
      return false;
    }
  }
  return component > 0;
}

}  // namespace

std::string config_value_to_toml(const ConfigValue& value) {
  switch (static_cast<ConfigType>(value.index())) {
    case ConfigType::kBool: return std::get<bool>(value) ? "true" : "false";
    case ConfigType::kInt: return fmt::format("{}", std::get<int64_t>(value));
    case ConfigType::kDouble: return format_double(std::get<double>(value));
    case ConfigType::kString: return quote(std::get<std::string>(value));
    case ConfigType::kStrings: {
      std::vector<std::string> items;
      for (const std::string& item : std::get<std::vector<std::string>>(value)) items.push_back(quote(item));
      return "[" + join(items, ", ") + "]";
    }
  }
  return "";
}

// ---- ConfigSchema ----

ConfigSchema& ConfigSchema::add_bool(const std::string& path, bool default_value, const std::string& doc) {
  return add({path, ConfigType::kBool, default_value, doc, {}, {}});
}

ConfigSchema& ConfigSchema::add_int(const std::string& path, int64_t default_value, const std::string& doc,
                                    ConfigRange range) {
  return add({path, ConfigType::kInt, default_value, doc, {}, range});
}

ConfigSchema& ConfigSchema::add_double(const std::string& path, double default_value, const std::string& doc,
                                       ConfigRange range) {
  if (!std::isfinite(default_value)) {
    throw std::logic_error(fmt::format("config key '{}': default must be finite", path));
  }
  return add({path, ConfigType::kDouble, default_value, doc, {}, range});
}

ConfigSchema& ConfigSchema::add_string(const std::string& path, const std::string& default_value,
                                       const std::string& doc, std::vector<std::string> allowed) {
  return add({path, ConfigType::kString, default_value, doc, std::move(allowed), {}});
}

ConfigSchema& ConfigSchema::add_strings(const std::string& path, std::vector<std::string> default_value,
                                        const std::string& doc) {
  return add({path, ConfigType::kStrings, std::move(default_value), doc, {}, {}});
}

ConfigSchema& ConfigSchema::add(ConfigKey key) {
  const std::string& path = key.path;
  if (!is_valid_path(path)) {
    throw std::logic_error(fmt::format(
        "config key '{}': a path is section.key, lowercase letters, digits and '_'", path));
  }
  if (index_.count(path) != 0 || tables_.count(path) != 0) {
    throw std::logic_error(fmt::format("config key '{}' is registered twice, or is also a table", path));
  }
  for (auto table = table_of(path); !table.empty(); table = table_of(table)) {
    if (index_.count(table) != 0) {
      throw std::logic_error(fmt::format("config key '{}' sits under key '{}', which is not a table", path, table));
    }
  }
  if (!std::all_of(key.doc.begin(), key.doc.end(), [](char c) { return c != '\n'; }) || key.doc.empty()) {
    throw std::logic_error(fmt::format("config key '{}' needs a one-line doc", path));
  }
  if (std::string violation = limit_violation(key, key.default_value); !violation.empty()) {
    throw std::logic_error(fmt::format("config default: {}", violation));
  }
  for (auto table = table_of(path); !table.empty(); table = table_of(table)) tables_.emplace(table);
  index_.emplace(path, keys_.size());
  keys_.push_back(std::move(key));
  return *this;
}

std::optional<size_t> ConfigSchema::find(std::string_view path) const {
  const auto it = index_.find(path);
  if (it == index_.end()) return std::nullopt;
  return it->second;
}

bool ConfigSchema::is_table(std::string_view path) const { return tables_.find(path) != tables_.end(); }

std::string ConfigSchema::reference() const {
  size_t path_width = 0;
  size_t default_width = 0;
  for (const ConfigKey& key : keys_) {
    path_width = std::max(path_width, key.path.size());
    default_width = std::max(default_width, config_value_to_toml(key.default_value).size());
  }
  std::string out;
  for (const ConfigKey& key : keys_) {
    std::string limits;
    if (!key.allowed.empty()) limits = " (one of " + join(key.allowed, ", ") + ")";
    if (key.range.min || key.range.max) limits = " (" + range_phrase(key.range) + ")";
    out += fmt::format("{:<{}}  {:<11}  {:<{}}  {}{}\n", key.path, path_width, config_type_name(key.type),
                       config_value_to_toml(key.default_value), default_width, key.doc, limits);
  }
  return out;
}

// ---- Config ----

Config::Config(const ConfigSchema& schema) : schema_(&schema) {
  for (const ConfigKey& key : schema.keys()) {
    values_.push_back(key.default_value);
    sources_.emplace_back("default");
  }
}

size_t Config::index_of(std::string_view path) const {
  const auto index = schema_->find(path);
  if (!index) {
    throw std::logic_error(fmt::format("config key '{}' is not registered (core/config_keys.cpp)", path));
  }
  return *index;
}

const ConfigValue& Config::typed(std::string_view path, ConfigType type) const {
  const size_t index = index_of(path);
  const ConfigType actual = schema_->keys()[index].type;
  if (actual != type) {
    throw std::logic_error(fmt::format("config key '{}' is of type {}, not {}", path, config_type_name(actual),
                                       config_type_name(type)));
  }
  return values_[index];
}

bool Config::get_bool(std::string_view path) const {
  return std::get<bool>(typed(path, ConfigType::kBool));
}
int64_t Config::get_int(std::string_view path) const {
  return std::get<int64_t>(typed(path, ConfigType::kInt));
}
double Config::get_double(std::string_view path) const {
  return std::get<double>(typed(path, ConfigType::kDouble));
}
const std::string& Config::get_string(std::string_view path) const {
  return std::get<std::string>(typed(path, ConfigType::kString));
}
const std::vector<std::string>& Config::get_strings(std::string_view path) const {
  return std::get<std::vector<std::string>>(typed(path, ConfigType::kStrings));
}
const ConfigValue& Config::value(std::string_view path) const { return values_[index_of(path)]; }
const std::string& Config::source(std::string_view path) const { return sources_[index_of(path)]; }

std::string Config::to_toml() const {
  // Tables in the order their first key was registered; each table's keys together, since
  // TOML allows a [table] header only once.
  std::vector<std::pair<std::string_view, std::vector<size_t>>> tables;
  const auto& keys = schema_->keys();
  for (size_t i = 0; i < keys.size(); ++i) {
    const std::string_view table = table_of(keys[i].path);
    auto it = std::find_if(tables.begin(), tables.end(), [&](const auto& t) { return t.first == table; });
    if (it == tables.end()) it = tables.insert(tables.end(), {table, {}});
    it->second.push_back(i);
  }
  std::string out = "# odyssey configuration, resolved; values that are not defaults say where they came from.\n";
  for (const auto& [table, indices] : tables) {
    std::vector<std::string> lines;
    size_t width = 0;
    for (size_t i : indices) {
      lines.push_back(fmt::format("{} = {}", leaf_of(keys[i].path), config_value_to_toml(values_[i])));
      width = std::max(width, lines.back().size());
    }
    out += fmt::format("\n[{}]\n", table);
    for (size_t n = 0; n < indices.size(); ++n) {
      const std::string& source = sources_[indices[n]];
      if (source == "default") {
        out += lines[n] + "\n";
      } else {
        out += fmt::format("{:<{}}  # from {}\n", lines[n], width, source);
      }
    }
  }
  return out;
}

// ---- Loading ----

// Applies files and overrides onto a Config of defaults, collecting every error.
class ConfigLoader {
 public:
  explicit ConfigLoader(const ConfigSchema& schema) : schema_(schema), config_(schema) {}

  // Applies `file` after its extends chain. `chain` holds the files that extend it, outermost
  // first (to detect cycles); `origin` says who named the file ("" for the command line).
  void apply_file(const std::string& file, std::vector<std::pair<fs::path, std::string>>& chain,
                  const std::string& origin) {
    std::error_code ec;
    if (!fs::is_regular_file(file, ec)) {
      const char* problem = fs::exists(file, ec) ? "is not a regular file" : "does not exist";
      errors_.push_back(origin.empty() ? fmt::format("config {}: file {}", file, problem)
                                       : fmt::format("{} {} {}", origin, file, problem));
      return;
    }
    toml::table table;
    try {
      table = toml::parse_file(file);
    } catch (const toml::parse_error& e) {
      errors_.push_back(fmt::format("config {}:{}:{}: {}", file, e.source().begin.line, e.source().begin.column,
                                    e.description()));
      return;
    }
    chain.emplace_back(identity(file), file);
    if (const toml::node* extends = table.get("extends")) apply_extends(file, *extends, chain);
    chain.pop_back();

    std::vector<std::pair<uint32_t, std::string>> file_errors;  // (line, message)
    apply_table(table, "", file, file_errors);
    std::stable_sort(file_errors.begin(), file_errors.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    for (auto& [line, message] : file_errors) errors_.push_back(std::move(message));
  }

  void apply_override(const std::string& argument) {
    const std::string where = fmt::format("config --set '{}'", argument);
    const auto equals = argument.find('=');
    if (equals == std::string::npos) {
      errors_.push_back(where + ": expected section.key=value");
      return;
    }
    const std::string path(trim(std::string_view(argument).substr(0, equals)));
    const std::string text(trim(std::string_view(argument).substr(equals + 1)));
    const auto index = schema_.find(path);
    if (!index) {
      errors_.push_back(where + unknown_key_message(path));
      return;
    }
    set(*index, parse_override_value(schema_.keys()[*index], text), where, "--set",
        [&](std::string message) { errors_.push_back(std::move(message)); });
  }

  Result<Config> finish() && {
    if (!errors_.empty()) return Status(StatusCode::kInvalidArgument, join(errors_, "\n"));
    return std::move(config_);
  }

 private:
  static fs::path identity(const std::string& file) {
    std::error_code ec;
    fs::path canonical = fs::weakly_canonical(file, ec);
    return ec ? fs::absolute(file, ec).lexically_normal() : canonical;
  }

  void apply_extends(const std::string& file, const toml::node& extends,
                     std::vector<std::pair<fs::path, std::string>>& chain) {
    const std::string at = fmt::format("config {}:{}", file, extends.source().begin.line);
    if (!extends.is_string()) {
      errors_.push_back(fmt::format("{}: 'extends' must be a string naming a base file, got {}", at,
                                    describe_node(extends)));
      return;
    }
    const std::string& name = extends.as_string()->get();
    const std::string base = (fs::path(file).parent_path() / name).lexically_normal().string();
    const fs::path base_identity = identity(base);
    for (size_t i = 0; i < chain.size(); ++i) {
      if (chain[i].first == base_identity) {
        std::vector<std::string> cycle;
        for (size_t j = i; j < chain.size(); ++j) cycle.push_back(chain[j].second);
        cycle.push_back(base);
        errors_.push_back(fmt::format("{}: extends cycle: {}", at, join(cycle, " -> ")));
        return;
      }
    }
    apply_file(base, chain, fmt::format("{}: extends '{}', but", at, name));
  }

  void apply_table(const toml::table& table, const std::string& prefix, const std::string& file,
                   std::vector<std::pair<uint32_t, std::string>>& file_errors) {
    for (const auto& [name, node] : table) {
      if (prefix.empty() && name.str() == "extends") continue;
      const std::string path = prefix.empty() ? std::string(name.str()) : prefix + "." + std::string(name.str());
      const uint32_t line = node.source().begin.line;
      const std::string where = fmt::format("config {}:{}", file, line);
      auto report = [&](std::string message) { file_errors.emplace_back(line, std::move(message)); };
      if (name.str().find('.') != std::string_view::npos) {
        // In TOML a quoted "a.b" is one key holding a dot, not the key b in table a.
        report(fmt::format("{}: key \"{}\" holds a '.' inside quotes; write it unquoted to mean '{}'", where,
                           name.str(), path));
      } else if (const auto index = schema_.find(path)) {
        set(*index, convert(schema_.keys()[*index], node), where, fmt::format("{}:{}", file, line), report);
      } else if (const toml::table* sub = node.as_table(); sub != nullptr && schema_.is_table(path)) {
        apply_table(*sub, path, file, file_errors);
      } else {
        report(where + unknown_key_message(path));
      }
    }
  }

  std::string unknown_key_message(const std::string& path) const {
    if (schema_.is_table(path)) return fmt::format(": '{}' is a table of keys, not a key", path);
    return fmt::format(": unknown key '{}'{}", path, suggest_key(schema_, path));
  }

  template <typename Report>
  void set(size_t index, Result<ConfigValue> value, const std::string& where, std::string source, Report report) {
    if (!value.ok()) {
      report(fmt::format("{}: {}", where, value.status().message()));
      return;
    }
    config_.values_[index] = std::move(value).value();
    config_.sources_[index] = std::move(source);
  }

  const ConfigSchema& schema_;
  Config config_;
  std::vector<std::string> errors_;
};

Result<Config> load_config(const std::vector<std::string>& files, const std::vector<std::string>& overrides,
                           const ConfigSchema& schema) {
  ConfigLoader loader(schema);
  for (const std::string& file : files) {
    std::vector<std::pair<fs::path, std::string>> chain;
    loader.apply_file(file, chain, "");
  }
  for (const std::string& override_text : overrides) loader.apply_override(override_text);
  return std::move(loader).finish();
}

}  // namespace odyssey
