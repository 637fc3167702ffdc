// JsonSchema: a JSON Schema validator over nlohmann::json, for tool definitions (plugins, MCP
// servers) and for the tool-call arguments a model makes up against a tool's input_schema.
//
// compile() checks a schema once: every keyword it knows has a value of the right kind, every
// pattern compiles, every $ref resolves inside the document. Its error reads
// "<where> at /properties/path/type: expected a type name ...", naming the bad keyword's JSON pointer.
// validate() then returns one message per violation, each led by the instance's JSON pointer:
//   "/items/2: expected integer, got string", "(root): missing required property 'path'".
// Bad instances (deep nesting, huge strings, schemas that loop back on themselves through $ref)
// give messages, never a crash.
//
// Keywords (draft 2020-12 and draft-07, as tool schemas use them): type (integer accepts 1.0),
// enum, const; properties, required, additionalProperties, patternProperties, propertyNames,
// minProperties, maxProperties, dependentRequired, dependentSchemas, dependencies; items (a schema,
// or draft-07's array form with additionalItems), prefixItems, minItems, maxItems, uniqueItems,
// contains, minContains, maxContains; minLength, maxLength (in code points), pattern; minimum,
// maximum, exclusiveMinimum, exclusiveMaximum (numbers, or draft-04's booleans), multipleOf; allOf,
// anyOf, oneOf, not, if/then/else; $ref to "#" or "#/json/pointer" (into $defs, definitions or
// anywhere in the document); boolean schemas. format, title, description, default, examples and
// unknown keywords are annotations: they never fail a value.
// A root "$schema" naming draft-04, -06 or -07 makes $ref replace its sibling keywords, as those
// drafts say; otherwise (2020-12, or no $schema) siblings of $ref apply too.
//
// Not supported: a $ref other than "#" or "#/..." (URLs, "$id"-relative names, anchors: compile()
// rejects it); "#/..." resolves from the document root even below a nested "$id"; $dynamicRef,
// unevaluatedProperties and unevaluatedItems are ignored like unknown keywords.
// pattern and patternProperties use std::regex ECMAScript over UTF-8 bytes: "." and character
// classes match one byte, not one code point, and \p{..}, lookbehind and named groups do not
// compile (compile() says so). libstdc++ matches by recursion, one step per input character, so
// long strings are matched on a thread with a stack sized for them; a string too long even for
// that is a violation ("too long to check against pattern") rather than a risk to the process.
//
// Thread-safety: a JsonSchema is immutable after compile(); validate() may run concurrently, and
// copies share the compiled state.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace odyssey::envs {

namespace detail {
struct CompiledSchema;
}

class JsonSchema {
 public:
  // The schema `true`: every value is valid.
  JsonSchema();

  // Checks that `schema` is a schema this validator understands (types of keywords right,
  // regexes compile, $ref targets resolvable within the document); the error names `where`
  // and the JSON pointer of the bad keyword.
  static Result<JsonSchema> compile(const nlohmann::json& schema, const std::string& where);

  // Empty when `instance` is valid; otherwise one message per violation, each starting with the
  // instance's JSON pointer: "/items/2: expected integer, got string", "(root): missing required
  // property 'path'".
  std::vector<std::string> validate(const nlohmann::json& instance) const;

  const nlohmann::json& schema() const;

 private:
  explicit JsonSchema(std::shared_ptr<const detail::CompiledSchema> compiled);
  std::shared_ptr<const detail::CompiledSchema> compiled_;
};

}  // namespace odyssey::envs
