// JSON Schema validation (envs/json_schema.h): one table of keywords, each with the kind of value
// compile() expects and the check validate() applies; one recursive walk for each of the two.
#include "envs/json_schema.h"

#include <pthread.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <regex>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <fmt/format.h>

namespace odyssey::envs {

using nlohmann::json;

namespace detail {

// A compiled pattern. libstdc++'s std::regex matches by recursion, one chain of frames per input
// character: measured 320 B per character for "^[a-z]*$" up to 2.4 KB for "^(((((((a)))))))*$",
// growing with the pattern's size. stack_per_char over-estimates that about twofold.
struct Pattern {
  std::regex re;
  size_t stack_per_char = 0;
};

struct CompiledSchema {
  json root = true;
  bool ref_replaces_siblings = false;                     // draft-04/06/07 $ref semantics
  std::unordered_map<std::string, Pattern> patterns;      // by pattern text
  std::unordered_map<const json*, const json*> refs;      // schema object holding "$ref" -> target
};

}  // namespace detail

namespace {

using detail::CompiledSchema;
using detail::Pattern;

// Deeper evaluation than this is reported rather than risked (each level is a few stack frames).
constexpr int kMaxDepth = 512;
// Schema checks one validate() may make. anyOf over recursive $refs is exponential in the depth of
// a bad value; past this budget the value is rejected rather than the caller stalled.
constexpr size_t kMaxSteps = 1'000'000;
constexpr size_t kMaxPatternSize = 4096;
#if defined(__SANITIZE_ADDRESS__)
#define ODY_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ODY_ASAN 1
#endif
#endif
#ifdef ODY_ASAN
constexpr size_t kStackScale = 8;  // AddressSanitizer's redzones make regex frames ~5x bigger
#else
constexpr size_t kStackScale = 1;
#endif
constexpr size_t kInlineStack = 256 << 10;   // matches needing less run on the caller's stack
constexpr size_t kMaxMatchStack = kStackScale << 30;  // virtual; a match touches only what it uses

// ---- small helpers ----

std::string escape_token(const std::string& key) {
  std::string out;
  for (char c : key) {
    if (c == '~') out += "~0";
    else if (c == '/') out += "~1";
    else out += c;
  }
  return out;
}
std::string child(const std::string& ptr, const std::string& key) { return ptr + "/" + escape_token(key); }
std::string child(const std::string& ptr, size_t index) { return ptr + "/" + std::to_string(index); }
std::string show(const std::string& ptr) { return ptr.empty() ? "(root)" : ptr; }

// `s` cut to at most `limit` bytes, on a UTF-8 character boundary, "..." marking the cut.
std::string truncate(std::string s, size_t limit) {
  if (s.size() <= limit) return s;
  size_t n = limit - 3;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
  s.resize(n);
  return s + "...";
}

std::string brief(const json& v) { return truncate(v.dump(-1, ' ', false, json::error_handler_t::replace), 60); }

const char* type_of(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "integer";
    case json::value_t::number_float: return "number";
    case json::value_t::string: return "string";
    case json::value_t::array: return "array";
    case json::value_t::object: return "object";
    default: return "unknown";
  }
}

bool is_type_name(const json& t) {
  static const std::unordered_set<std::string> names = {"null",   "boolean", "object", "array",
                                                        "number", "string",  "integer"};
  return t.is_string() && names.count(t.get_ref<const std::string&>()) > 0;
}

bool has_type(const json& v, const std::string& type) {
  if (type == "integer") {
    if (v.is_number_integer()) return true;
    if (!v.is_number_float()) return false;
    const double d = v.get<double>();
    return std::isfinite(d) && std::floor(d) == d;
  }
  if (type == "number") return v.is_number();
  return type == type_of(v);
}

// long double holds every int64, uint64 and double exactly on x86-64, so comparisons are exact.
long double num(const json& v) { return v.get<long double>(); }

// A non-negative integer keyword value (maxLength, minItems, ...); 2.0 counts as 2.
std::optional<uint64_t> count_value(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer()) return v.get<int64_t>() >= 0 ? std::optional<uint64_t>(v.get<int64_t>()) : std::nullopt;
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (d >= 0 && d < 9.2e18 && std::floor(d) == d) return static_cast<uint64_t>(d);
  }
  return std::nullopt;
}

size_t code_points(const std::string& s) {
  return static_cast<size_t>(std::count_if(s.begin(), s.end(), [](char c) { return (c & 0xC0) != 0x80; }));
}

bool is_multiple(const json& x, const json& m) {
  if (x.is_number_integer() && m.is_number_integer()) return std::fmod(num(x), num(m)) == 0;
  const long double q = num(x) / num(m);
  if (!std::isfinite(q)) return false;
  const long double tolerance = std::max(1e-9L, 4 * std::numeric_limits<double>::epsilon() * std::fabs(q));
  return std::fabs(q - std::round(q)) <= tolerance;
}

std::string percent_decode(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && std::isxdigit(static_cast<unsigned char>(s[i + 1])) &&
        std::isxdigit(static_cast<unsigned char>(s[i + 2]))) {
      out += static_cast<char>(std::stoi(s.substr(i + 1, 2), nullptr, 16));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

// Whether `pattern` matches somewhere in `s`; nullopt with *error set when it could not be checked.
std::optional<bool> search(const Pattern& pattern, const std::string& s, std::string* error) {
  struct Job {
    const Pattern& pattern;
    const std::string& s;
    std::optional<bool> found;
    std::string error;
    void run() {
      try {
        found = std::regex_search(s, pattern.re);
      } catch (const std::exception& e) {
        error = fmt::format("pattern could not be checked: {}", e.what());
      }
    }
  } job{pattern, s, std::nullopt, {}};
  const size_t stack = (64 << 10) + s.size() * pattern.stack_per_char;
  if (stack <= kInlineStack) {
    job.run();
  } else if (s.size() > kMaxMatchStack / pattern.stack_per_char) {
    job.error = fmt::format("string of {} bytes is too long to check against a pattern", s.size());
  } else {
    pthread_attr_t attr;
    pthread_t thread;
    bool started = pthread_attr_init(&attr) == 0;
    started = started && pthread_attr_setstacksize(&attr, stack) == 0 &&
              pthread_create(&thread, &attr, [](void* j) -> void* { static_cast<Job*>(j)->run(); return nullptr; },
                             &job) == 0;
    pthread_attr_destroy(&attr);
    if (started) pthread_join(thread, nullptr);
    else job.error = fmt::format("could not start a thread to check a {}-byte string against a pattern", s.size());
  }
  if (!job.found) *error = job.error;
  return job.found;
}

// ---- validation ----

struct Violation {
  std::string ptr;
  std::string what;
};
using Violations = std::vector<Violation>;

class Evaluation;

// What a keyword's check sees: the schema object it sits in, its own value, the instance.
struct Ctx {
  Evaluation& ev;
  const json& schema;
  const json& value;
  const json& inst;
  const std::string& ptr;
  Violations& out;
  void fail(std::string what) { out.push_back({ptr, std::move(what)}); }
  const json* sibling(const char* key) const {
    auto it = schema.find(key);
    return it == schema.end() ? nullptr : &*it;
  }
};

class Evaluation {
 public:
  explicit Evaluation(const CompiledSchema& compiled) : c(compiled) {}
  void check(const json& schema, const json& inst, const std::string& ptr, Violations& out);
  bool valid(const json& schema, const json& inst, const std::string& ptr) {
    Violations v;
    check(schema, inst, ptr, v);
    return v.empty();
  }
  bool matches(const std::string& pattern, const std::string& s, Ctx& ctx) {
    std::string error;
    std::optional<bool> found = search(c.patterns.at(pattern), s, &error);
    if (!found) ctx.fail(error);
    return found.value_or(false);
  }

  const CompiledSchema& c;
  std::vector<std::pair<const json*, const json*>> active_refs;  // (target, instance) being evaluated
  int depth = 0;
  size_t steps = 0;  // past kMaxSteps every check fails, and validate() reports only that
};

// "[0] /x: expected integer, got string; [1] ..." : the first violation of each failed branch, cut
// short, since a branch's violation may itself summarize nested anyOf/oneOf branches.
std::string summarize(const std::vector<Violations>& branches) {
  std::string out;
  for (size_t i = 0; i < branches.size(); ++i) {
    if (branches[i].empty()) continue;
    const Violation& v = branches[i].front();
    out += fmt::format("{}[{}] {}", out.empty() ? "" : "; ", i, truncate(show(v.ptr) + ": " + v.what, 200));
    if (branches[i].size() > 1) out += fmt::format(" (+{} more)", branches[i].size() - 1);
  }
  return out;
}

// ---- the keyword table ----

enum class Shape {
  kAny, kArray, kBool, kString, kNumber, kNumberOrBool, kPositiveNumber, kCount, kType, kPattern,
  kRef, kStringArray, kStringArrayMap, kSchema, kSchemaArray, kSchemaMap, kPatternSchemaMap,
  kSchemaOrSchemaArray, kSchemaOrStringArrayMap,
};

struct Keyword {
  const char* name;
  Shape shape;
  void (*check)(Ctx&);  // nullptr: an annotation, or read by a sibling's check
};

void type_check(Ctx& c) {
  if (c.value.is_string()) {
    const auto& t = c.value.get_ref<const std::string&>();
    if (!has_type(c.inst, t)) c.fail(fmt::format("expected {}, got {}", t, type_of(c.inst)));
    return;
  }
  std::string names;
  for (const json& t : c.value) {
    if (has_type(c.inst, t.get_ref<const std::string&>())) return;
    names += (names.empty() ? "" : ", ") + t.get<std::string>();
  }
  c.fail(fmt::format("expected one of [{}], got {}", names, type_of(c.inst)));
}

void minimum_check(Ctx& c, bool is_max) {
  if (!c.inst.is_number()) return;
  const json* exclusive = c.sibling(is_max ? "exclusiveMaximum" : "exclusiveMinimum");
  const bool strict = exclusive && exclusive->is_boolean() && exclusive->get<bool>();
  const long double x = num(c.inst), bound = num(c.value);
  const bool ok = is_max ? (strict ? x < bound : x <= bound) : (strict ? x > bound : x >= bound);
  if (!ok)
    c.fail(fmt::format("expected a number {}{} {}, got {}", is_max ? "<" : ">", strict ? "" : "=", brief(c.value),
                       brief(c.inst)));
}

void exclusive_check(Ctx& c, bool is_max) {
  if (!c.inst.is_number() || !c.value.is_number()) return;  // the boolean form is read by minimum/maximum
  const long double x = num(c.inst), bound = num(c.value);
  if (is_max ? x >= bound : x <= bound)
    c.fail(fmt::format("expected a number {} {}, got {}", is_max ? "<" : ">", brief(c.value), brief(c.inst)));
}

void count_check(Ctx& c, size_t actual, bool is_max, const char* unit) {
  const uint64_t bound = *count_value(c.value);
  if (is_max ? actual > bound : actual < bound)
    c.fail(fmt::format("expected at {} {} {}, got {}", is_max ? "most" : "least", bound, unit, actual));
}

void items_check(Ctx& c) {
  if (!c.inst.is_array()) return;
  size_t start = 0;
  if (c.value.is_array()) {  // draft-07 tuple form; the rest is additionalItems'
    for (size_t i = 0; i < std::min(c.value.size(), c.inst.size()); ++i)
      c.ev.check(c.value[i], c.inst[i], child(c.ptr, i), c.out);
    return;
  }
  if (const json* prefix = c.sibling("prefixItems"); prefix && prefix->is_array()) start = prefix->size();
  for (size_t i = start; i < c.inst.size(); ++i) c.ev.check(c.value, c.inst[i], child(c.ptr, i), c.out);
}

void additional_items_check(Ctx& c) {
  const json* items = c.sibling("items");
  if (!c.inst.is_array() || !items || !items->is_array() || c.inst.size() <= items->size()) return;
  if (c.value == false) {
    c.fail(fmt::format("expected at most {} items, got {}", items->size(), c.inst.size()));
    return;
  }
  for (size_t i = items->size(); i < c.inst.size(); ++i) c.ev.check(c.value, c.inst[i], child(c.ptr, i), c.out);
}

void contains_check(Ctx& c) {
  if (!c.inst.is_array()) return;
  size_t matching = 0;
  for (size_t i = 0; i < c.inst.size(); ++i) matching += c.ev.valid(c.value, c.inst[i], child(c.ptr, i));
  const json* min = c.sibling("minContains");
  const json* max = c.sibling("maxContains");
  const uint64_t at_least = min ? count_value(*min).value_or(1) : 1;
  if (matching < at_least)
    c.fail(at_least == 1 && matching == 0
               ? std::string("no item matches the 'contains' schema")
               : fmt::format("expected at least {} items matching 'contains', got {}", at_least, matching));
  if (max && matching > count_value(*max).value_or(UINT64_MAX))
    c.fail(fmt::format("expected at most {} items matching 'contains', got {}", *count_value(*max), matching));
}

void unique_items_check(Ctx& c) {
  if (!c.inst.is_array() || c.value != true) return;
  for (size_t i = 0; i < c.inst.size(); ++i)
    for (size_t j = i + 1; j < c.inst.size(); ++j)
      if (c.inst[i] == c.inst[j]) return c.fail(fmt::format("items {} and {} are equal; items must be unique", i, j));
}

void properties_check(Ctx& c) {
  if (!c.inst.is_object()) return;
  for (auto it = c.value.begin(); it != c.value.end(); ++it) {
    auto found = c.inst.find(it.key());
    if (found != c.inst.end()) c.ev.check(*it, *found, child(c.ptr, it.key()), c.out);
  }
}

void pattern_properties_check(Ctx& c) {
  if (!c.inst.is_object()) return;
  for (auto prop = c.inst.begin(); prop != c.inst.end(); ++prop)
    for (auto pat = c.value.begin(); pat != c.value.end(); ++pat)
      if (c.ev.matches(pat.key(), prop.key(), c)) c.ev.check(*pat, *prop, child(c.ptr, prop.key()), c.out);
}

void additional_properties_check(Ctx& c) {
  if (!c.inst.is_object()) return;
  const json* properties = c.sibling("properties");
  const json* patterns = c.sibling("patternProperties");
  for (auto prop = c.inst.begin(); prop != c.inst.end(); ++prop) {
    if (properties && properties->contains(prop.key())) continue;
    bool matched = false;
    if (patterns)
      for (auto pat = patterns->begin(); pat != patterns->end() && !matched; ++pat)
        matched = c.ev.matches(pat.key(), prop.key(), c);
    if (matched) continue;
    if (c.value == false) c.fail(fmt::format("unexpected property '{}'", prop.key()));
    else c.ev.check(c.value, *prop, child(c.ptr, prop.key()), c.out);
  }
}

void property_names_check(Ctx& c) {
  if (!c.inst.is_object()) return;
  for (auto prop = c.inst.begin(); prop != c.inst.end(); ++prop) {
    const json name = prop.key();
    Violations v;
    c.ev.check(c.value, name, c.ptr, v);
    for (const Violation& bad : v) c.fail(fmt::format("property name '{}': {}", prop.key(), bad.what));
  }
}

void required_check(Ctx& c) {
  if (!c.inst.is_object()) return;
  for (const json& name : c.value)
    if (!c.inst.contains(name.get_ref<const std::string&>()))
      c.fail(fmt::format("missing required property '{}'", name.get_ref<const std::string&>()));
}

// dependencies (draft-07), dependentRequired, dependentSchemas: each entry is either a list of
// properties that must also be present, or a schema the whole object must then match.
void dependencies_check(Ctx& c) {
  if (!c.inst.is_object()) return;
  for (auto dep = c.value.begin(); dep != c.value.end(); ++dep) {
    if (!c.inst.contains(dep.key())) continue;
    if (!dep->is_array()) {
      c.ev.check(*dep, c.inst, c.ptr, c.out);
      continue;
    }
    for (const json& name : *dep)
      if (!c.inst.contains(name.get_ref<const std::string&>()))
        c.fail(fmt::format("property '{}' requires property '{}'", dep.key(), name.get_ref<const std::string&>()));
  }
}

void any_of_check(Ctx& c) {
  std::vector<Violations> branches(c.value.size());
  for (size_t i = 0; i < c.value.size(); ++i) {
    c.ev.check(c.value[i], c.inst, c.ptr, branches[i]);
    if (branches[i].empty()) return;
  }
  c.fail(fmt::format("matches none of the {} anyOf schemas: {}", c.value.size(), summarize(branches)));
}

void one_of_check(Ctx& c) {
  std::vector<Violations> branches(c.value.size());
  std::vector<size_t> matched;
  for (size_t i = 0; i < c.value.size(); ++i) {
    c.ev.check(c.value[i], c.inst, c.ptr, branches[i]);
    if (branches[i].empty()) matched.push_back(i);
  }
  if (matched.empty())
    c.fail(fmt::format("matches none of the {} oneOf schemas: {}", c.value.size(), summarize(branches)));
  else if (matched.size() > 1)
    c.fail(fmt::format("matches oneOf schemas {} and {}, but must match exactly one", matched[0], matched[1]));
}

void if_check(Ctx& c) {
  const json* branch = c.sibling(c.ev.valid(c.value, c.inst, c.ptr) ? "then" : "else");
  if (branch) c.ev.check(*branch, c.inst, c.ptr, c.out);
}

void ref_check(Ctx& c) {
  const json* target = c.ev.c.refs.at(&c.schema);
  const auto key = std::make_pair(target, &c.inst);
  if (std::find(c.ev.active_refs.begin(), c.ev.active_refs.end(), key) != c.ev.active_refs.end())
    return c.fail(fmt::format("$ref '{}' loops back to itself without descending into the value",
                              c.value.get_ref<const std::string&>()));
  c.ev.active_refs.push_back(key);
  c.ev.check(*target, c.inst, c.ptr, c.out);
  c.ev.active_refs.pop_back();
}

const Keyword kKeywords[] = {
    // any instance
    {"type", Shape::kType, type_check},
    {"enum", Shape::kArray,
     [](Ctx& c) {
       if (std::find(c.value.begin(), c.value.end(), c.inst) == c.value.end())
         c.fail(fmt::format("expected one of {}, got {}", brief(c.value), brief(c.inst)));
     }},
    {"const", Shape::kAny,
     [](Ctx& c) {
       if (c.inst != c.value) c.fail(fmt::format("expected {}, got {}", brief(c.value), brief(c.inst)));
     }},
    {"allOf", Shape::kSchemaArray,
     [](Ctx& c) {
       for (const json& s : c.value) c.ev.check(s, c.inst, c.ptr, c.out);
     }},
    {"anyOf", Shape::kSchemaArray, any_of_check},
    {"oneOf", Shape::kSchemaArray, one_of_check},
    {"not", Shape::kSchema,
     [](Ctx& c) {
       if (c.ev.valid(c.value, c.inst, c.ptr)) c.fail("must not match the schema in 'not'");
     }},
    {"if", Shape::kSchema, if_check},
    {"then", Shape::kSchema, nullptr},
    {"else", Shape::kSchema, nullptr},
    {"$ref", Shape::kRef, ref_check},
    {"$defs", Shape::kSchemaMap, nullptr},
    {"definitions", Shape::kSchemaMap, nullptr},
    {"$schema", Shape::kString, nullptr},
    {"format", Shape::kString, nullptr},
    // objects
    {"properties", Shape::kSchemaMap, properties_check},
    {"patternProperties", Shape::kPatternSchemaMap, pattern_properties_check},
    {"additionalProperties", Shape::kSchema, additional_properties_check},
    {"propertyNames", Shape::kSchema, property_names_check},
    {"required", Shape::kStringArray, required_check},
    {"minProperties", Shape::kCount,
     [](Ctx& c) {
       if (c.inst.is_object()) count_check(c, c.inst.size(), /*is_max=*/false, "properties");
     }},
    {"maxProperties", Shape::kCount,
     [](Ctx& c) {
       if (c.inst.is_object()) count_check(c, c.inst.size(), /*is_max=*/true, "properties");
     }},
    {"dependencies", Shape::kSchemaOrStringArrayMap, dependencies_check},
    {"dependentRequired", Shape::kStringArrayMap, dependencies_check},
    {"dependentSchemas", Shape::kSchemaMap, dependencies_check},
    // arrays
    {"items", Shape::kSchemaOrSchemaArray, items_check},
    {"prefixItems", Shape::kSchemaArray,
     [](Ctx& c) {
       if (!c.inst.is_array()) return;
       for (size_t i = 0; i < std::min(c.value.size(), c.inst.size()); ++i)
         c.ev.check(c.value[i], c.inst[i], child(c.ptr, i), c.out);
     }},
    {"additionalItems", Shape::kSchema, additional_items_check},
    {"contains", Shape::kSchema, contains_check},
    {"minContains", Shape::kCount, nullptr},
    {"maxContains", Shape::kCount, nullptr},
    {"minItems", Shape::kCount,
     [](Ctx& c) {
       if (c.inst.is_array()) count_check(c, c.inst.size(), /*is_max=*/false, "items");
     }},
    {"maxItems", Shape::kCount,
     [](Ctx& c) {
       if (c.inst.is_array()) count_check(c, c.inst.size(), /*is_max=*/true, "items");
     }},
    {"uniqueItems", Shape::kBool, unique_items_check},
    // strings
    {"minLength", Shape::kCount,
     [](Ctx& c) {
       if (c.inst.is_string()) count_check(c, code_points(c.inst.get_ref<const std::string&>()), false, "characters");
     }},
    {"maxLength", Shape::kCount,
     [](Ctx& c) {
       if (c.inst.is_string()) count_check(c, code_points(c.inst.get_ref<const std::string&>()), true, "characters");
     }},
    {"pattern", Shape::kPattern,
     [](Ctx& c) {
       if (!c.inst.is_string()) return;
       const auto& pattern = c.value.get_ref<const std::string&>();
       std::string error;
       std::optional<bool> found = search(c.ev.c.patterns.at(pattern), c.inst.get_ref<const std::string&>(), &error);
       if (!found) c.fail(error);
       else if (!*found) c.fail(fmt::format("does not match pattern '{}'", pattern));
     }},
    // numbers
    {"minimum", Shape::kNumber, [](Ctx& c) { minimum_check(c, /*is_max=*/false); }},
    {"maximum", Shape::kNumber, [](Ctx& c) { minimum_check(c, /*is_max=*/true); }},
    {"exclusiveMinimum", Shape::kNumberOrBool, [](Ctx& c) { exclusive_check(c, /*is_max=*/false); }},
    {"exclusiveMaximum", Shape::kNumberOrBool, [](Ctx& c) { exclusive_check(c, /*is_max=*/true); }},
    {"multipleOf", Shape::kPositiveNumber,
     [](Ctx& c) {
       if (c.inst.is_number() && !is_multiple(c.inst, c.value))
         c.fail(fmt::format("expected a multiple of {}, got {}", brief(c.value), brief(c.inst)));
     }},
};

const Keyword* find_keyword(const std::string& name) {
  static const std::unordered_map<std::string, const Keyword*> index = [] {
    std::unordered_map<std::string, const Keyword*> m;
    for (const Keyword& k : kKeywords) m[k.name] = &k;
    return m;
  }();
  auto it = index.find(name);
  return it == index.end() ? nullptr : it->second;
}

void Evaluation::check(const json& schema, const json& inst, const std::string& ptr, Violations& out) {
  if (schema.is_boolean()) {
    if (!schema.get<bool>()) out.push_back({ptr, "no value is allowed here (the schema is false)"});
    return;
  }
  if (depth >= kMaxDepth) {
    out.push_back({ptr, fmt::format("value or schema nested deeper than {} levels", kMaxDepth)});
    return;
  }
  if (++steps > kMaxSteps) {
    out.push_back({ptr, "too costly to validate"});
    return;
  }
  ++depth;
  const bool ref_only = c.ref_replaces_siblings && schema.contains("$ref");
  for (auto it = schema.begin(); it != schema.end(); ++it) {
    const Keyword* k = find_keyword(it.key());
    if (k == nullptr || k->check == nullptr || (ref_only && it.key() != "$ref")) continue;
    Ctx ctx{*this, schema, *it, inst, ptr, out};
    k->check(ctx);
  }
  --depth;
}

// ---- compile ----

class Compiler {
 public:
  explicit Compiler(CompiledSchema& c) : c_(c) {}

  // Checks `s`, found at JSON pointer `ptr` of the document. Errors read "<ptr>: <what>".
  Status schema(const json& s, const std::string& ptr, int depth) {
    if (s.is_boolean()) return Status::Ok();
    if (!s.is_object()) return bad(ptr, fmt::format("a schema must be an object or a boolean, got {}", brief(s)));
    if (depth >= kMaxDepth) return bad(ptr, fmt::format("schema nested deeper than {} levels", kMaxDepth));
    if (!checked_.insert(&s).second) return Status::Ok();
    for (auto it = s.begin(); it != s.end(); ++it)
      if (const Keyword* k = find_keyword(it.key()))
        ODY_RETURN_IF_ERROR(keyword(*k, s, *it, child(ptr, it.key()), depth));
    return Status::Ok();
  }

 private:
  static Status bad(const std::string& ptr, const std::string& what) {
    return invalid_argument("{}: {}", show(ptr), what);
  }

  Status schema_array(const json& v, const std::string& ptr, int depth) {
    if (!v.is_array() || v.empty())
      return bad(ptr, fmt::format("expected a non-empty array of schemas, got {}", brief(v)));
    for (size_t i = 0; i < v.size(); ++i) ODY_RETURN_IF_ERROR(schema(v[i], child(ptr, i), depth + 1));
    return Status::Ok();
  }

  static Status string_array(const json& v, const std::string& ptr) {
    if (!v.is_array() || !std::all_of(v.begin(), v.end(), [](const json& e) { return e.is_string(); }))
      return bad(ptr, fmt::format("expected an array of property names (strings), got {}", brief(v)));
    return Status::Ok();
  }

  Status pattern(const std::string& p, const std::string& ptr) {
    if (c_.patterns.count(p)) return Status::Ok();
    if (p.size() > kMaxPatternSize)
      return bad(ptr, fmt::format("pattern of {} bytes is longer than the {} supported", p.size(), kMaxPatternSize));
    try {
      c_.patterns.emplace(p, Pattern{std::regex(p, std::regex::ECMAScript), kStackScale * 200 * (p.size() + 8)});
    } catch (const std::regex_error& e) {
      return bad(ptr,
                 fmt::format("pattern '{}' does not compile as an ECMAScript regex (std::regex): {}", p, e.what()));
    }
    return Status::Ok();
  }

  Status ref(const json& s, const json& v, const std::string& ptr, int depth) {
    const std::string& r = v.get_ref<const std::string&>();
    if (r != "#" && r.rfind("#/", 0) != 0)
      return bad(ptr, fmt::format("$ref '{}': only references inside this schema ('#' or '#/json/pointer') are "
                                  "supported", r));
    const std::string target_ptr = percent_decode(r.substr(1));
    const json* target = nullptr;
    try {
      json::json_pointer p(target_ptr);
      if (c_.root.contains(p)) target = &c_.root.at(p);
    } catch (const json::exception&) {
    }
    if (target == nullptr) return bad(ptr, fmt::format("$ref '{}' does not point to anything in this schema", r));
    c_.refs[&s] = target;
    return schema(*target, target_ptr, depth + 1);
  }

  Status keyword(const Keyword& k, const json& s, const json& v, const std::string& ptr, int depth) {
    switch (k.shape) {
      case Shape::kAny: return Status::Ok();
      case Shape::kArray:
        return v.is_array() ? Status::Ok() : bad(ptr, fmt::format("expected an array, got {}", brief(v)));
      case Shape::kBool:
        return v.is_boolean() ? Status::Ok() : bad(ptr, fmt::format("expected true or false, got {}", brief(v)));
      case Shape::kString:
        return v.is_string() ? Status::Ok() : bad(ptr, fmt::format("expected a string, got {}", brief(v)));
      case Shape::kNumber:
        return v.is_number() ? Status::Ok() : bad(ptr, fmt::format("expected a number, got {}", brief(v)));
      case Shape::kNumberOrBool:
        return v.is_number() || v.is_boolean() ? Status::Ok()
                                               : bad(ptr, fmt::format("expected a number, got {}", brief(v)));
      case Shape::kPositiveNumber:
        return v.is_number() && num(v) > 0 ? Status::Ok()
                                           : bad(ptr, fmt::format("expected a number > 0, got {}", brief(v)));
      case Shape::kCount:
        return count_value(v) ? Status::Ok()
                              : bad(ptr, fmt::format("expected a non-negative integer, got {}", brief(v)));
      case Shape::kType:
        if (is_type_name(v) || (v.is_array() && !v.empty() && std::all_of(v.begin(), v.end(), is_type_name)))
          return Status::Ok();
        return bad(ptr, fmt::format("expected a type name (null, boolean, object, array, number, string, integer) "
                                    "or a non-empty array of them, got {}", brief(v)));
      case Shape::kPattern:
        if (!v.is_string()) return bad(ptr, fmt::format("expected a regex string, got {}", brief(v)));
        return pattern(v.get<std::string>(), ptr);
      case Shape::kRef:
        if (!v.is_string()) return bad(ptr, fmt::format("expected a reference string, got {}", brief(v)));
        return ref(s, v, ptr, depth);
      case Shape::kStringArray: return string_array(v, ptr);
      case Shape::kSchema: return schema(v, ptr, depth + 1);
      case Shape::kSchemaArray: return schema_array(v, ptr, depth);
      case Shape::kSchemaOrSchemaArray:
        return v.is_array() ? schema_array(v, ptr, depth) : schema(v, ptr, depth + 1);
      case Shape::kSchemaMap:
      case Shape::kPatternSchemaMap:
      case Shape::kStringArrayMap:
      case Shape::kSchemaOrStringArrayMap:
        if (!v.is_object()) return bad(ptr, fmt::format("expected an object, got {}", brief(v)));
        for (auto it = v.begin(); it != v.end(); ++it) {
          const std::string at = child(ptr, it.key());
          if (k.shape == Shape::kPatternSchemaMap) ODY_RETURN_IF_ERROR(pattern(it.key(), at));
          if (k.shape == Shape::kStringArrayMap || (k.shape == Shape::kSchemaOrStringArrayMap && it->is_array()))
            ODY_RETURN_IF_ERROR(string_array(*it, at));
          else
            ODY_RETURN_IF_ERROR(schema(*it, at, depth + 1));
        }
        return Status::Ok();
    }
    return Status::Ok();
  }

  CompiledSchema& c_;
  std::unordered_set<const json*> checked_;
};

}  // namespace

JsonSchema::JsonSchema() : compiled_(std::make_shared<CompiledSchema>()) {}

JsonSchema::JsonSchema(std::shared_ptr<const CompiledSchema> compiled) : compiled_(std::move(compiled)) {}

Result<JsonSchema> JsonSchema::compile(const json& schema, const std::string& where) {
  auto compiled = std::make_shared<CompiledSchema>();
  compiled->root = schema;  // the walk below records addresses inside this copy, which never moves
  if (schema.is_object()) {
    auto dialect = schema.find("$schema");
    compiled->ref_replaces_siblings = dialect != schema.end() && dialect->is_string() &&
                                      dialect->get_ref<const std::string&>().find("draft-0") != std::string::npos;
  }
  Status status = Compiler(*compiled).schema(compiled->root, "", 0);
  if (!status.ok()) {
    const std::string& m = status.message();
    // "(root): what" reads "<where>: what"; "/a/b: what" reads "<where> at /a/b: what".
    if (m.rfind("(root): ", 0) == 0) return invalid_argument("{}: {}", where, m.substr(8));
    return invalid_argument("{} at {}", where, m);
  }
  return JsonSchema(std::move(compiled));
}

std::vector<std::string> JsonSchema::validate(const json& instance) const {
  Evaluation ev(*compiled_);
  Violations violations;
  ev.check(compiled_->root, instance, "", violations);
  if (ev.steps > kMaxSteps)
    return {fmt::format("(root): too costly to validate: over {} schema checks (a deep value under anyOf/oneOf "
                        "with recursive $refs?)", kMaxSteps)};
  std::vector<std::string> out;
  out.reserve(violations.size());
  for (const Violation& v : violations) out.push_back(fmt::format("{}: {}", show(v.ptr), v.what));
  return out;
}

const json& JsonSchema::schema() const { return compiled_->root; }

}  // namespace odyssey::envs
