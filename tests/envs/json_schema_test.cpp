// JsonSchema against the official JSON-Schema-Test-Suite (Debian's json-schema-test-suite), plus
// its messages and the schemas compile() must reject.
#include "envs/json_schema.h"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace odyssey::envs {
namespace {

using nlohmann::json;

const char* const kSuiteDir = "/usr/share/json-schema-test-suite/tests";

// A case we do not run, by file, group description and (empty for the whole group) test description.
struct Excluded {
  const char* file;
  const char* group;
  const char* test;
  const char* why;
};

const Excluded kExcluded[] = {
    {"ref.json", "remote ref, containing refs itself", "",
     "refers to http://json-schema.org/draft-07/schema: only references inside the document are supported"},
    {"ref.json", "Recursive references between schemas", "",
     "resolves \"$ref\": \"node\" against a nested $id: only '#'/'#/pointer' references are supported"},
};

bool excluded(const std::string& file, const std::string& group, const std::string& test) {
  for (const Excluded& e : kExcluded)
    if (file == e.file && group == e.group && (*e.test == '\0' || test == e.test)) return true;
  return false;
}

struct SuiteCount {
  int passed = 0;
  int total = 0;
  int skipped = 0;
};

// Runs every case of `files` in `draft`'s directory. Schemas get `dialect` as their "$schema" (the
// suite leaves it out: a file's directory is its dialect), which decides how $ref treats siblings.
SuiteCount run_suite(const std::string& draft, const std::vector<std::string>& files, const std::string& dialect) {
  SuiteCount count;
  const std::filesystem::path dir = std::filesystem::path(kSuiteDir) / draft;
  if (!std::filesystem::is_directory(dir)) {
    ADD_FAILURE() << dir << " is missing: the official JSON Schema test suite comes from the Debian package "
                  << "json-schema-test-suite; run ./dev.sh test, which installs it";
    return count;
  }
  for (const std::string& file : files) {
    std::ifstream in(dir / file);
    if (!in) {
      ADD_FAILURE() << "cannot read " << (dir / file);
      continue;
    }
    const json groups = json::parse(in);
    for (const json& group : groups) {
      const std::string group_name = group.at("description");
      json schema = group.at("schema");
      if (schema.is_object() && !schema.contains("$schema")) schema["$schema"] = dialect;
      const bool skip_group = excluded(file, group_name, "");
      Result<JsonSchema> compiled = JsonSchema::compile(schema, draft + "/" + file);
      if (!compiled.ok()) {
        if (skip_group) {
          count.skipped += static_cast<int>(group.at("tests").size());
        } else {
          ADD_FAILURE() << draft << "/" << file << " '" << group_name
                        << "': compile failed: " << compiled.status().message();
        }
        continue;
      }
      for (const json& test : group.at("tests")) {
        const std::string test_name = test.at("description");
        if (excluded(file, group_name, test_name)) {
          ++count.skipped;
          continue;
        }
        ++count.total;
        const std::vector<std::string> errors = compiled->validate(test.at("data"));
        const bool valid = test.at("valid");
        if (errors.empty() != valid) {
          std::string listed;
          for (const std::string& e : errors) listed += "\n    " + e;
          ADD_FAILURE() << draft << "/" << file << " '" << group_name << "' / '" << test_name << "': data "
                        << test.at("data").dump() << " should be " << (valid ? "valid" : "invalid") << listed;
          continue;
        }
        ++count.passed;
        for (const std::string& e : errors)
          EXPECT_TRUE(e.rfind("(root): ", 0) == 0 || e.rfind("/", 0) == 0) << "no instance pointer: " << e;
      }
    }
  }
  std::printf("%s: %d/%d cases passed (%d excluded) in %zu files\n", draft.c_str(), count.passed, count.total,
              count.skipped, files.size());
  return count;
}

TEST(JsonSchemaSuite, PassesEveryDraft7CaseForTheSupportedKeywords) {
  // Left out: definitions.json and refRemote.json (they need remote schemas: the draft-07
  // metaschema and a localhost server), and optional/ (format assertions, bignum, ECMA regex).
  const std::vector<std::string> files = {
      "additionalItems.json", "additionalProperties.json", "allOf.json", "anyOf.json",
      "boolean_schema.json", "const.json", "contains.json", "default.json",
      "dependencies.json", "enum.json", "exclusiveMaximum.json", "exclusiveMinimum.json",
      "if-then-else.json", "items.json", "maxItems.json", "maxLength.json",
      "maxProperties.json", "maximum.json", "minItems.json", "minLength.json",
      "minProperties.json", "minimum.json", "multipleOf.json", "not.json",
      "oneOf.json", "pattern.json", "patternProperties.json", "properties.json",
      "propertyNames.json", "ref.json", "required.json", "type.json",
      "uniqueItems.json",
  };
  const SuiteCount count = run_suite("draft7", files, "http://json-schema.org/draft-07/schema#");
  EXPECT_GT(count.total, 350);
  EXPECT_EQ(count.passed, count.total);
}

TEST(JsonSchemaSuite, PassesDraft4BooleanExclusiveBounds) {
  const SuiteCount count =
      run_suite("draft4", {"minimum.json", "maximum.json"}, "http://json-schema.org/draft-04/schema#");
  EXPECT_GT(count.total, 0);
  EXPECT_EQ(count.passed, count.total);
}

// Debian 12's suite (2.0.0) predates draft 2020-12, so its keywords are checked here.
TEST(JsonSchema, AppliesDraft202012Keywords) {
  struct Case {
    const char* schema;
    const char* data;
    bool valid;
  };
  const Case cases[] = {
      // prefixItems, then items for the rest
      {R"({"prefixItems": [{"type": "integer"}, {"type": "string"}], "items": false})", R"([1, "a"])", true},
      {R"({"prefixItems": [{"type": "integer"}, {"type": "string"}], "items": false})", R"([1, "a", 2])", false},
      {R"({"prefixItems": [{"type": "integer"}], "items": {"type": "boolean"}})", R"([1, true, false])", true},
      {R"({"prefixItems": [{"type": "integer"}], "items": {"type": "boolean"}})", R"([1, true, 3])", false},
      {R"({"prefixItems": [{"type": "integer"}]})", R"(["x"])", false},
      {R"({"prefixItems": [{"type": "integer"}]})", R"([])", true},
      // $defs
      {R"({"$defs": {"pos": {"type": "integer", "minimum": 1}}, "items": {"$ref": "#/$defs/pos"}})", "[1, 2]", true},
      {R"({"$defs": {"pos": {"type": "integer", "minimum": 1}}, "items": {"$ref": "#/$defs/pos"}})", "[1, 0]", false},
      // 2020-12 applies the siblings of $ref
      {R"({"$defs": {"a": {"type": "array"}}, "$ref": "#/$defs/a", "maxItems": 1})", "[1, 2]", false},
      {R"({"$schema": "https://json-schema.org/draft/2020-12/schema", "$defs": {"a": {"type": "array"}},
           "$ref": "#/$defs/a", "maxItems": 1})", "[1]", true},
      // dependentRequired, dependentSchemas
      {R"({"dependentRequired": {"a": ["b", "c"]}})", R"({"a": 1, "b": 2, "c": 3})", true},
      {R"({"dependentRequired": {"a": ["b", "c"]}})", R"({"a": 1, "b": 2})", false},
      {R"({"dependentRequired": {"a": ["b"]}})", R"({"b": 2})", true},
      {R"({"dependentSchemas": {"a": {"required": ["b"]}}})", R"({"a": 1})", false},
      {R"({"dependentSchemas": {"a": {"required": ["b"]}}})", R"({"c": 1})", true},
      // minContains, maxContains
      {R"({"contains": {"const": 1}, "minContains": 2})", "[1, 2, 1]", true},
      {R"({"contains": {"const": 1}, "minContains": 2})", "[1, 2]", false},
      {R"({"contains": {"const": 1}, "maxContains": 1})", "[1, 1]", false},
      {R"({"contains": {"const": 1}, "maxContains": 1})", "[1, 2]", true},
      {R"({"contains": {"const": 1}, "minContains": 0})", "[]", true},
      {R"({"contains": {"const": 1}})", "[]", false},
      // numeric exclusive bounds, integers written as floats
      {R"({"exclusiveMinimum": 0, "exclusiveMaximum": 1})", "0.5", true},
      {R"({"exclusiveMinimum": 0})", "0", false},
      {R"({"type": "integer"})", "1.0", true},
      {R"({"type": "integer"})", "1.5", false},
      {R"({"maxLength": 2.0})", R"("abc")", false},
      // format is an annotation
      {R"({"format": "email"})", R"("not an email")", true},
  };
  for (const Case& c : cases) {
    auto schema = JsonSchema::compile(json::parse(c.schema), "case");
    ASSERT_TRUE(schema.ok()) << c.schema << ": " << schema.status().message();
    EXPECT_EQ(schema->validate(json::parse(c.data)).empty(), c.valid) << c.schema << " with " << c.data;
  }
}

// [[[...value...]]], `depth` arrays deep.
json nested(json value, int depth) {
  for (int i = 0; i < depth; ++i) {
    json outer = json::array();
    outer.push_back(std::move(value));
    value = std::move(outer);
  }
  return value;
}

std::vector<std::string> check(const char* schema, const json& value) {
  auto compiled = JsonSchema::compile(json::parse(schema), "test");
  EXPECT_TRUE(compiled.ok()) << compiled.status().message();
  return compiled.ok() ? compiled->validate(value) : std::vector<std::string>{"compile failed"};
}

using Messages = std::vector<std::string>;

TEST(JsonSchema, NamesTheInstancePointerAndWhatIsWrong) {
  const char* schema = R"({
    "type": "object",
    "required": ["path"],
    "properties": {"path": {"type": "string"}, "items": {"type": "array", "items": {"type": "integer"}}}
  })";
  EXPECT_EQ(check(schema, json::parse(R"({"items": [1, 2, "x"]})")),
            (Messages{"/items/2: expected integer, got string", "(root): missing required property 'path'"}));
  EXPECT_EQ(check(schema, json::parse(R"({"path": "a", "items": [1, 2.0]})")), Messages{});
  EXPECT_EQ(check(schema, json::parse("[]")), Messages{"(root): expected object, got array"});
  EXPECT_EQ(check(R"({"properties": {"a/b~c": {"type": "integer"}}})", json::parse(R"({"a/b~c": 1.5})")),
            Messages{"/a~1b~0c: expected integer, got number"});
  EXPECT_EQ(check(R"({"type": ["integer", "null"]})", "x"), Messages{"(root): expected one of [integer, null], got string"});
}

TEST(JsonSchema, ExplainsObjectArrayStringAndNumberViolations) {
  EXPECT_EQ(check(R"({"properties": {"a": {}}, "additionalProperties": false})", json::parse(R"({"a": 1, "b": 2})")),
            Messages{"(root): unexpected property 'b'"});
  EXPECT_EQ(check(R"({"enum": ["read", "write"]})", "delete"),
            Messages{R"((root): expected one of ["read","write"], got "delete")"});
  EXPECT_EQ(check(R"({"maxItems": 2, "uniqueItems": true})", json::parse("[1, 2, 1.0]")),
            (Messages{"(root): expected at most 2 items, got 3", "(root): items 0 and 2 are equal; items must be unique"}));
  // Lengths count code points: "héé" is 3 characters, 5 bytes.
  EXPECT_EQ(check(R"({"maxLength": 3})", "h\xC3\xA9\xC3\xA9"), Messages{});
  EXPECT_EQ(check(R"({"minLength": 4})", "h\xC3\xA9\xC3\xA9"), Messages{"(root): expected at least 4 characters, got 3"});
  EXPECT_EQ(check(R"({"pattern": "^[a-z_]+$"})", "Bad-Name"), Messages{"(root): does not match pattern '^[a-z_]+$'"});
  EXPECT_EQ(check(R"({"minimum": 1, "maximum": 10, "multipleOf": 2})", 11),
            (Messages{"(root): expected a number <= 10, got 11", "(root): expected a multiple of 2, got 11"}));
  EXPECT_EQ(check(R"({"minimum": 1, "exclusiveMinimum": true})", 1), Messages{"(root): expected a number > 1, got 1"});
  EXPECT_EQ(check(R"({"propertyNames": {"pattern": "^[a-z]+$"}})", json::parse(R"({"ok": 1, "Bad": 2})")),
            Messages{"(root): property name 'Bad': does not match pattern '^[a-z]+$'"});
  EXPECT_EQ(check(R"({"dependentRequired": {"start": ["end"]}})", json::parse(R"({"start": 1})")),
            Messages{"(root): property 'start' requires property 'end'"});
}

TEST(JsonSchema, ExplainsWhichAlternativesFailed) {
  EXPECT_EQ(check(R"({"anyOf": [{"type": "integer"}, {"type": "string", "minLength": 2}]})", "x"),
            Messages{"(root): matches none of the 2 anyOf schemas: [0] (root): expected integer, got string; "
                     "[1] (root): expected at least 2 characters, got 1"});
  EXPECT_EQ(check(R"({"oneOf": [{"type": "number"}, {"type": "integer"}]})", 3),
            Messages{"(root): matches oneOf schemas 0 and 1, but must match exactly one"});
  EXPECT_EQ(check(R"({"not": {"type": "null"}})", nullptr), Messages{"(root): must not match the schema in 'not'"});
  EXPECT_EQ(check(R"({"if": {"properties": {"mode": {"const": "file"}}}, "then": {"required": ["path"]}})",
                  json::parse(R"({"mode": "file"})")),
            Messages{"(root): missing required property 'path'"});
  EXPECT_EQ(check(R"({"items": false})", json::parse("[1]")), Messages{"/0: no value is allowed here (the schema is false)"});
}

TEST(JsonSchema, ReportsRefCyclesAndDeepValuesInsteadOfRecursingForever) {
  EXPECT_EQ(check(R"({"$ref": "#"})", 1), Messages{"(root): $ref '#' loops back to itself without descending into the value"});
  // Two refs that lead to each other, under anyOf, must not blow up either.
  auto looped = check(R"({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}, {"$ref": "#/$defs/b"}]},
                                    "b": {"$ref": "#/$defs/a"}},
                         "$ref": "#/$defs/a"})", 1);
  ASSERT_EQ(looped.size(), 1u);
  EXPECT_NE(looped[0].find("loops back"), std::string::npos) << looped[0];

  // A recursive schema accepts deep values up to the depth limit and reports deeper ones.
  const json deep = nested(json::array(), 100000);
  const char* tree = R"({"type": "array", "items": {"$ref": "#"}})";
  auto errors = check(tree, deep);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].find("nested deeper than 512 levels"), std::string::npos) << errors[0].substr(0, 200);
  EXPECT_EQ(check(tree, nested(json::array(), 100)), Messages{});

  // anyOf over a recursive ref is exponential in a bad value's depth: bounded, then reported.
  const json bad = nested("leaf", 40);
  const auto start = std::chrono::steady_clock::now();
  auto costly = check(R"({"anyOf": [{"type": "array", "items": {"$ref": "#"}}, {"type": "array", "items": {"$ref": "#"}}]})",
                      bad);
  ASSERT_EQ(costly.size(), 1u);
  EXPECT_NE(costly[0].find("too costly to validate"), std::string::npos) << costly[0];
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

TEST(JsonSchema, MatchesPatternsOnLongStringsWithoutOverflowingTheStack) {
  // libstdc++'s std::regex recurses per character: this overflows an 8 MiB stack at ~11,000 bytes.
  const std::string long_ok(60000, 'a');
  EXPECT_EQ(check(R"({"pattern": "^(a|b)*$"})", long_ok), Messages{});
  std::string long_bad = long_ok;
  long_bad.back() = 'c';
  EXPECT_EQ(check(R"({"pattern": "^(a|b)*$"})", long_bad), Messages{"(root): does not match pattern '^(a|b)*$'"});
  EXPECT_EQ(check(R"({"patternProperties": {"^(a|b)*$": {"type": "integer"}}})", json{{long_ok, "x"}}),
            Messages{"/" + long_ok + ": expected integer, got string"});
  // Too long to match safely even on a big stack: a violation, not a crash.
  auto huge = check(R"({"pattern": "^(a|b)*$"})", std::string(8 << 20, 'a'));
  ASSERT_EQ(huge.size(), 1u);
  EXPECT_EQ(huge[0], "(root): string of 8388608 bytes is too long to check against a pattern");
}

std::string compile_error(const char* schema) {
  auto compiled = JsonSchema::compile(json::parse(schema), "tool 'read_file' input_schema");
  return compiled.ok() ? "compiled" : compiled.status().message();
}

TEST(JsonSchema, CompileRejectsBadSchemasNamingTheKeywordPointer) {
  EXPECT_EQ(compile_error(R"({"properties": {"path": {"type": 5}}})"),
            "tool 'read_file' input_schema at /properties/path/type: expected a type name (null, boolean, object, "
            "array, number, string, integer) or a non-empty array of them, got 5");
  EXPECT_EQ(compile_error(R"({"type": ["string", "text"]})").rfind("tool 'read_file' input_schema at /type: ", 0), 0u);
  EXPECT_EQ(compile_error(R"({"required": "x"})"),
            "tool 'read_file' input_schema at /required: expected an array of property names (strings), got \"x\"");
  EXPECT_EQ(compile_error(R"({"properties": {"a": {"pattern": "(unclosed"}}})").rfind(
                "tool 'read_file' input_schema at /properties/a/pattern: pattern '(unclosed' does not compile", 0),
            0u);
  EXPECT_EQ(compile_error(R"({"patternProperties": {"[a-": {}}})").rfind(
                "tool 'read_file' input_schema at /patternProperties/[a-: pattern '[a-' does not compile", 0),
            0u);
  EXPECT_EQ(compile_error(R"({"properties": {"a": {"$ref": "#/$defs/missing"}}})"),
            "tool 'read_file' input_schema at /properties/a/$ref: $ref '#/$defs/missing' does not point to anything "
            "in this schema");
  EXPECT_EQ(compile_error(R"({"$ref": "https://example.com/schema.json"})"),
            "tool 'read_file' input_schema at /$ref: $ref 'https://example.com/schema.json': only references inside "
            "this schema ('#' or '#/json/pointer') are supported");
  EXPECT_EQ(compile_error(R"({"minLength": -1})"),
            "tool 'read_file' input_schema at /minLength: expected a non-negative integer, got -1");
  EXPECT_EQ(compile_error(R"({"multipleOf": 0})"),
            "tool 'read_file' input_schema at /multipleOf: expected a number > 0, got 0");
  EXPECT_EQ(compile_error(R"({"anyOf": []})"),
            "tool 'read_file' input_schema at /anyOf: expected a non-empty array of schemas, got []");
  EXPECT_EQ(compile_error(R"({"items": [{"type": "string"}, 3]})"),
            "tool 'read_file' input_schema at /items/1: a schema must be an object or a boolean, got 3");
  // Bad schemas under $defs are found even when nothing refers to them; a $ref target is checked too.
  EXPECT_EQ(compile_error(R"({"$defs": {"x": {"maxItems": "many"}}})"),
            "tool 'read_file' input_schema at /$defs/x/maxItems: expected a non-negative integer, got \"many\"");
  EXPECT_EQ(compile_error(R"({"x-custom": {"type": 1}, "$ref": "#/x-custom"})"),
            "tool 'read_file' input_schema at /x-custom/type: expected a type name (null, boolean, object, array, "
            "number, string, integer) or a non-empty array of them, got 1");
  EXPECT_EQ(compile_error("5"), "tool 'read_file' input_schema: a schema must be an object or a boolean, got 5");
  // Unknown keywords are ignored, as the specification says.
  EXPECT_EQ(compile_error(R"({"x-ui": {"type": 5}, "unevaluatedProperties": false})"), "compiled");
}

TEST(JsonSchema, KeepsTheSchemaAndSharesItAcrossCopies) {
  const json schema = json::parse(R"({"$defs": {"n": {"type": "integer"}}, "items": {"$ref": "#/$defs/n"}})");
  auto compiled = JsonSchema::compile(schema, "test");
  ASSERT_TRUE(compiled.ok());
  JsonSchema copy = *compiled;
  compiled = JsonSchema::compile(json::parse("{}"), "other");  // the copy's $ref targets live on
  EXPECT_EQ(copy.schema(), schema);
  EXPECT_EQ(copy.validate(json::parse(R"([1, "x"])")), Messages{"/1: expected integer, got string"});
  EXPECT_EQ(JsonSchema().validate(json::parse(R"({"anything": 1})")), Messages{});
}

}  // namespace
}  // namespace odyssey::envs
