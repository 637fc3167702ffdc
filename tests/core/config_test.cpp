#include "core/config.h"

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>

#include <gtest/gtest.h>

namespace odyssey {
namespace {

namespace fs = std::filesystem;

// A fresh directory for one test's TOML files, removed with everything in it afterwards.
class ConfigDir {
 public:
  ConfigDir() {
    static std::atomic<int> counter{0};
    const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           fmt::format("odyssey_config_test_{}_{}_{}", ::getpid(), test->name(), counter++);
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  ~ConfigDir() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  ConfigDir(const ConfigDir&) = delete;
  ConfigDir& operator=(const ConfigDir&) = delete;

  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::string write(const std::string& name, const std::string& text) const {
    const fs::path file = dir_ / name;
    fs::create_directories(file.parent_path());
    std::ofstream(file) << text;
    return file.string();
  }

 private:
  fs::path dir_;
};

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The error lines of a load that must fail.
std::vector<std::string> errors_of(const Result<Config>& result) {
  EXPECT_FALSE(result.ok());
  if (result.ok()) return {};
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
  return lines_of(result.status().message());
}

std::string logic_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::logic_error& e) {
    return e.what();
  }
  return "no std::logic_error";
}

TEST(Config, DefaultsOnlyWhenNoFilesOrOverridesAreGiven) {
  auto config = load_config({}, {});
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  EXPECT_EQ(config->get_string("job.name"), "tiny");
  EXPECT_EQ(config->get_int("replay.credits"), 16);
  EXPECT_TRUE(config->get_bool("replay.sync"));
  EXPECT_EQ(config->get_string("replay.sampler"), "fifo");
  EXPECT_EQ(config->get_double("replay.rate_limiter.error_buffer"), 64.0);
  EXPECT_EQ(config->get_int("replay.rate_limiter.min_size_to_sample"), 1);
  EXPECT_EQ(config->source("replay.credits"), "default");
}

TEST(Config, LaterFilesOverrideEarlierOnesKeyByKeyAndTablesMerge) {
  ConfigDir dir;
  const auto a = dir.write("a.toml",
                           "[replay]\n"
                           "credits = 8\n"
                           "dir = \"a\"\n"
                           "[replay.rate_limiter]\n"
                           "max_policy_lag = 2\n");
  const auto b = dir.write("b.toml",
                           "replay.credits = 9\n"
                           "replay.rate_limiter = { min_size_to_sample = 5 }\n");
  auto config = load_config({a, b}, {});
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  EXPECT_EQ(config->get_int("replay.credits"), 9);
  EXPECT_EQ(config->source("replay.credits"), b + ":1");
  EXPECT_EQ(config->get_string("replay.dir"), "a");
  EXPECT_EQ(config->source("replay.dir"), a + ":3");
  EXPECT_EQ(config->get_int("replay.rate_limiter.max_policy_lag"), 2);
  EXPECT_EQ(config->get_int("replay.rate_limiter.min_size_to_sample"), 5);
  EXPECT_TRUE(config->get_bool("replay.sync"));
}

TEST(Config, SetOverridesApplyAfterAllFilesInOrder) {
  ConfigDir dir;
  const auto file = dir.write("job.toml", "[replay]\ncredits = 8\nsync = false\n");
  auto config = load_config({file}, {"replay.credits=3", "replay.credits = 4"});
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  EXPECT_EQ(config->get_int("replay.credits"), 4);
  EXPECT_EQ(config->source("replay.credits"), "--set");
  EXPECT_FALSE(config->get_bool("replay.sync"));
  EXPECT_EQ(config->source("replay.sync"), file + ":3");
}

TEST(Config, ExtendsChainAppliesBasesFirstRelativeToTheIncludingFile) {
  ConfigDir dir;
  const auto root = dir.write("root.toml", "[replay]\ncredits = 1\ndir = \"root\"\nsampler = \"uniform\"\n");
  dir.write("sub/mid.toml", "extends = \"../root.toml\"\n[replay]\ncredits = 2\n");
  const auto leaf = dir.write("sub/leaf.toml", "extends = \"mid.toml\"\n[replay]\ndir = \"leaf\"\n");
  auto config = load_config({leaf}, {});
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  EXPECT_EQ(config->get_string("replay.sampler"), "uniform");
  EXPECT_EQ(config->source("replay.sampler"), root + ":4");
  EXPECT_EQ(config->get_int("replay.credits"), 2);
  EXPECT_EQ(config->source("replay.credits"), dir.path("sub/mid.toml") + ":3");
  EXPECT_EQ(config->get_string("replay.dir"), "leaf");
}

TEST(Config, ExtendsCycleIsAnErrorNamingTheFiles) {
  ConfigDir dir;
  const auto a = dir.write("a.toml", "extends = \"b.toml\"\n");
  const auto b = dir.write("b.toml", "extends = \"a.toml\"\n");
  const auto self = dir.write("self.toml", "extends = \"self.toml\"\n");
  EXPECT_EQ(errors_of(load_config({a}, {})),
            std::vector<std::string>{fmt::format("config {}:1: extends cycle: {} -> {} -> {}", b, a, b, a)});
  EXPECT_EQ(errors_of(load_config({self}, {})),
            std::vector<std::string>{fmt::format("config {}:1: extends cycle: {} -> {}", self, self, self)});
}

TEST(Config, MissingFilesAndSyntaxErrorsNameTheFile) {
  ConfigDir dir;
  const auto missing = dir.path("missing.toml");
  const auto orphan = dir.write("orphan.toml", "\nextends = \"gone.toml\"\n");
  const auto broken = dir.write("broken.toml", "[replay]\ncredits = = 3\n");
  EXPECT_EQ(errors_of(load_config({missing, orphan}, {})),
            (std::vector<std::string>{
                fmt::format("config {}: file does not exist", missing),
                fmt::format("config {}:2: extends 'gone.toml', but {} does not exist", orphan, dir.path("gone.toml")),
            }));
  const auto errors = errors_of(load_config({broken}, {}));
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].rfind(fmt::format("config {}:2:", broken), 0), 0u) << errors[0];
}

TEST(Config, SetReadsTheValueTextAsTheKeysDeclaredType) {
  ConfigSchema schema;
  schema.add_bool("job.flag", true, "a bool")
      .add_int("job.count", 1, "an int")
      .add_double("job.rate", 0.5, "a double")
      .add_string("job.name", "x", "a string")
      .add_string("job.note", "x", "a string")
      .add_string("job.empty", "x", "a string")
      .add_strings("job.stops", {"</s>"}, "a string list");
  auto config = load_config({}, {"job.flag=false", "job.count=-42", "job.rate=2", "job.name=two words",
                                  "job.note=\"quoted # not a comment\"", "job.empty=",
                                  "job.stops=[\"a\", 'b']"},
                            schema);
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  EXPECT_FALSE(config->get_bool("job.flag"));
  EXPECT_EQ(config->get_int("job.count"), -42);
  EXPECT_EQ(config->get_double("job.rate"), 2.0);
  EXPECT_EQ(config->get_string("job.name"), "two words");
  EXPECT_EQ(config->get_string("job.note"), "quoted # not a comment");
  EXPECT_EQ(config->get_string("job.empty"), "");
  EXPECT_EQ(config->get_strings("job.stops"), (std::vector<std::string>{"a", "b"}));
}

TEST(Config, SetErrorsNameTheArgumentAndAreAllReported) {
  EXPECT_EQ(errors_of(load_config({}, {"replay.credits", "replay.credts=3", "replay.credits=abc",
                                       "replay.sync=yes", "replay.credits=1.5", "replay=3",
                                       "replay.credits=3\njob.seed=4", "replay.sampler=lifo"})),
            (std::vector<std::string>{
                "config --set 'replay.credits': expected section.key=value",
                "config --set 'replay.credts=3': unknown key 'replay.credts' (did you mean 'replay.credits'?)",
                "config --set 'replay.credits=abc': key 'replay.credits' must be an integer, got \"abc\"",
                "config --set 'replay.sync=yes': key 'replay.sync' must be a boolean (true or false), got \"yes\"",
                "config --set 'replay.credits=1.5': key 'replay.credits' must be an integer, got float 1.5",
                "config --set 'replay=3': 'replay' is a table of keys, not a key",
                "config --set 'replay.credits=3",
                "job.seed=4': key 'replay.credits' must be an integer, got \"3\\njob.seed=4\"",
                "config --set 'replay.sampler=lifo': key 'replay.sampler' must be one of fifo, uniform, "
                "prioritized, group_complete, got \"lifo\" (did you mean 'fifo'?)",
            }));
}

TEST(Config, UnknownKeyNamesFileLineAndSuggestsNearMiss) {
  ConfigDir dir;
  const auto file = dir.write("tiny.toml",
                              "# a job\n"
                              "[replay]\n"
                              "credits = 4\n"
                              "credts = 5\n");
  EXPECT_EQ(errors_of(load_config({file}, {})),
            std::vector<std::string>{
                fmt::format("config {}:4: unknown key 'replay.credts' (did you mean 'replay.credits'?)", file)});
}

TEST(Config, UnknownKeySuggestsTheSameKeyInAnotherTableOrNothing) {
  ConfigDir dir;
  const auto file = dir.write("job.toml",
                              "nothing_like_it = 1\n"
                              "[replay]\n"
                              "min_size_to_sample = 3\n"
                              "\"rate_limiter.max_policy_lag\" = 3\n"
                              "[replai]\n"
                              "credits = 1\n");
  EXPECT_EQ(errors_of(load_config({file}, {})),
            (std::vector<std::string>{
                fmt::format("config {}:1: unknown key 'nothing_like_it'", file),
                fmt::format("config {}:3: unknown key 'replay.min_size_to_sample' "
                            "(did you mean 'replay.rate_limiter.min_size_to_sample'?)",
                            file),
                fmt::format("config {}:4: key \"rate_limiter.max_policy_lag\" holds a '.' inside quotes; "
                            "write it unquoted to mean 'replay.rate_limiter.max_policy_lag'",
                            file),
                fmt::format("config {}:5: unknown key 'replai' (did you mean 'replay'?)", file),
            }));
}

TEST(Config, WrongTypeNamesTheKeyTheExpectedTypeAndTheValue) {
  ConfigDir dir;
  const auto file = dir.write("tiny.toml",
                              "[replay]\n"
                              "sync = 1\n"
                              "credits = \"abc\"\n"
                              "priority_exponent = true\n"
                              "dir = [\"a\"]\n"
                              "retention = 3\n"
                              "[replay.sampler]\n");
  EXPECT_EQ(errors_of(load_config({file}, {})),
            (std::vector<std::string>{
                fmt::format("config {}:2: key 'replay.sync' must be a boolean (true or false), got integer 1", file),
                fmt::format("config {}:3: key 'replay.credits' must be an integer, got string \"abc\"", file),
                fmt::format("config {}:4: key 'replay.priority_exponent' must be a number, got boolean true", file),
                fmt::format("config {}:5: key 'replay.dir' must be a string, got array [\"a\"]", file),
                fmt::format("config {}:6: 'replay.retention' is a table of keys, not a key", file),
                fmt::format("config {}:7: key 'replay.sampler' must be a string, got a table", file),
            }));
}

TEST(Config, ValueOutsideTheAllowedSetNamesTheAllowedValues) {
  ConfigDir dir;
  const auto file = dir.write("job.toml", "[replay]\nsampler = \"fif0\"\n");
  EXPECT_EQ(errors_of(load_config({file}, {})),
            std::vector<std::string>{fmt::format(
                "config {}:2: key 'replay.sampler' must be one of fifo, uniform, prioritized, group_complete, "
                "got \"fif0\" (did you mean 'fifo'?)",
                file)});
}

TEST(Config, NumberOutsideItsRangeIsRejected) {
  ConfigDir dir;
  const auto file = dir.write("job.toml",
                              "[replay]\n"
                              "credits = 0\n"
                              "priority_exponent = -0.5\n");
  EXPECT_EQ(errors_of(load_config({file}, {})),
            (std::vector<std::string>{
                fmt::format("config {}:2: key 'replay.credits' must be at least 1, got 0", file),
                fmt::format("config {}:3: key 'replay.priority_exponent' must be at least 0, got -0.5", file),
            }));
  ConfigSchema schema;
  schema.add_double("learner.clip", 0.2, "a fraction", between(0, 1));
  schema.add_int("learner.steps", 5, "bounded above", at_most(10));
  EXPECT_EQ(errors_of(load_config({}, {"learner.clip=1.5", "learner.steps=11"}, schema)),
            (std::vector<std::string>{
                "config --set 'learner.clip=1.5': key 'learner.clip' must be between 0 and 1, got 1.5",
                "config --set 'learner.steps=11': key 'learner.steps' must be at most 10, got 11",
            }));
}

TEST(Config, AllErrorsAcrossFilesAndOverridesAreReportedTogetherInLineOrder) {
  ConfigDir dir;
  const auto first = dir.write("first.toml",
                               "[replay]\n"
                               "zzz = 1\n"
                               "credits = \"many\"\n"
                               "aaa = 2\n"
                               "[bench.replay]\n"
                               "writers = 0\n");
  const auto second = dir.write("second.toml", "[job]\nseed = 1.5\n");
  const auto errors = errors_of(load_config({first, second}, {"job.nam=x"}));
  ASSERT_EQ(errors.size(), 6u) << ::testing::PrintToString(errors);
  EXPECT_EQ(errors[0].rfind(fmt::format("config {}:2: unknown key 'replay.zzz'", first), 0), 0u);
  EXPECT_EQ(errors[1].rfind(fmt::format("config {}:3: key 'replay.credits'", first), 0), 0u);
  EXPECT_EQ(errors[2].rfind(fmt::format("config {}:4: unknown key 'replay.aaa'", first), 0), 0u);
  EXPECT_EQ(errors[3].rfind(fmt::format("config {}:6: key 'bench.replay.writers'", first), 0), 0u);
  EXPECT_EQ(errors[4], fmt::format("config {}:2: key 'job.seed' must be an integer, got float 1.5", second));
  EXPECT_EQ(errors[5], "config --set 'job.nam=x': unknown key 'job.nam' (did you mean 'job.name'?)");
}

TEST(Config, SourcesSayWhereEachValueCameFrom) {
  ConfigDir dir;
  const auto base = dir.write("base.toml", "[replay]\ncredits = 2\n");
  const auto job = dir.write("job.toml", "extends = \"base.toml\"\n\n[job]\nseed = 7\n");
  auto config = load_config({job}, {"replay.sync=false"});
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  EXPECT_EQ(config->source("job.name"), "default");
  EXPECT_EQ(config->source("replay.credits"), base + ":2");
  EXPECT_EQ(config->source("job.seed"), job + ":4");
  EXPECT_EQ(config->source("replay.sync"), "--set");
}

TEST(Config, ToTomlPrintsEveryKeyWithSourcesAndRoundTrips) {
  ConfigDir dir;
  const std::string tiny = std::string(ODYSSEY_SOURCE_DIR) + "/configs/tiny.toml";
  auto config = load_config({tiny}, {"replay.rate_limiter.samples_per_insert=0.1", "job.seed=-3"});
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  const std::string text = config->to_toml();
  EXPECT_NE(text.find("\n[replay.rate_limiter]\n"), std::string::npos) << text;
  EXPECT_NE(text.find("samples_per_insert = 0.1  # from --set\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\ncredits = 16 "), std::string::npos) << text;
  EXPECT_NE(text.find("  # from " + std::string(ODYSSEY_SOURCE_DIR) + "/configs/tiny.toml:8\n"), std::string::npos)
      << text;

  auto reloaded = load_config({dir.write("resolved.toml", text)}, {});
  ASSERT_TRUE(reloaded.ok()) << reloaded.status().to_string() << "\n" << text;
  for (const ConfigKey& key : config_schema().keys()) {
    EXPECT_EQ(reloaded->value(key.path), config->value(key.path)) << key.path;
  }
  const auto defaults = load_config({}, {});
  ASSERT_TRUE(defaults.ok());
  EXPECT_EQ(defaults->to_toml().find("# from"), std::string::npos);
}

TEST(Config, ToTomlRoundTripsAwkwardStringsListsAndNumbers) {
  ConfigSchema schema;
  schema.add_string("a.text", "", "a string")
      .add_strings("a.list", {}, "a list")
      .add_double("a.small", 0.0, "a double")
      .add_double("a.big", 0.0, "a double")
      .add_double("a.whole", 0.0, "a double")
      .add_int("a.b.int", 0, "an int")
      .add_bool("z.flag", false, "a bool");
  ConfigDir dir;
  const auto file = dir.write("awkward.toml",
                              "[a]\n"
                              "text = \"quote \\\" backslash \\\\ tab \\t newline \\n bell \\u0007 é\"\n"
                              "list = [\"\", \"x,y\", \"[z]\"]\n"
                              "small = 1e-300\n"
                              "big = 1.5e300\n"
                              "whole = -3\n"
                              "b.int = -9223372036854775808\n");
  auto config = load_config({file}, {}, schema);
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  const std::string text = config->to_toml();
  auto reloaded = load_config({dir.write("resolved.toml", text)}, {}, schema);
  ASSERT_TRUE(reloaded.ok()) << reloaded.status().to_string() << "\n" << text;
  for (const ConfigKey& key : schema.keys()) {
    EXPECT_EQ(reloaded->value(key.path), config->value(key.path)) << key.path << "\n" << text;
  }
  EXPECT_EQ(config->get_double("a.whole"), -3.0);
}

TEST(Config, GettersThrowLogicErrorNamingTheKeyForUnregisteredKeysOrWrongTypes) {
  auto config = load_config({}, {});
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(logic_error_of([&] { (void)config->get_int("replay.nope"); }),
            "config key 'replay.nope' is not registered (core/config_keys.cpp)");
  EXPECT_EQ(logic_error_of([&] { (void)config->get_string("replay.credits"); }),
            "config key 'replay.credits' is of type int, not string");
  EXPECT_EQ(logic_error_of([&] { (void)config->source("nope"); }),
            "config key 'nope' is not registered (core/config_keys.cpp)");
}

TEST(ConfigSchema, RejectsInvalidRegistrations) {
  ConfigSchema schema;
  schema.add_int("replay.rate_limiter.min_size_to_sample", 1, "a key", at_least(0));
  EXPECT_NE(logic_error_of([&] { schema.add_int("replay.rate_limiter.min_size_to_sample", 1, "again"); })
                .find("registered twice"),
            std::string::npos);
  EXPECT_NE(logic_error_of([&] { schema.add_int("replay.rate_limiter", 1, "a table"); }).find("also a table"),
            std::string::npos);
  EXPECT_NE(logic_error_of([&] { schema.add_int("replay.rate_limiter.min_size_to_sample.more", 1, "under a key"); }).find("not a table"),
            std::string::npos);
  EXPECT_NE(logic_error_of([&] { schema.add_bool("flag", true, "no section"); }).find("section.key"),
            std::string::npos);
  EXPECT_NE(logic_error_of([&] { schema.add_bool("Job.Flag", true, "upper case"); }).find("section.key"),
            std::string::npos);
  EXPECT_NE(logic_error_of([&] { schema.add_bool("job..flag", true, "empty part"); }).find("section.key"),
            std::string::npos);
  EXPECT_NE(logic_error_of([&] { schema.add_int("job.n", 0, "below min", at_least(1)); }).find("at least 1"),
            std::string::npos);
  EXPECT_NE(logic_error_of([&] { schema.add_string("job.s", "c", "not allowed", {"a", "b"}); }).find("one of a, b"),
            std::string::npos);
  EXPECT_NE(logic_error_of([&] { schema.add_bool("job.b", true, ""); }).find("one-line doc"), std::string::npos);
  EXPECT_EQ(schema.keys().size(), 1u);
}

TEST(ConfigSchema, ReferenceListsEveryKeyWithTypeDefaultDocAndLimits) {
  const std::string reference = config_schema().reference();
  const auto lines = lines_of(reference);
  ASSERT_EQ(lines.size(), config_schema().keys().size()) << reference;
  for (size_t i = 0; i < lines.size(); ++i) {
    const ConfigKey& key = config_schema().keys()[i];
    EXPECT_EQ(lines[i].rfind(key.path + " ", 0), 0u) << lines[i];
    EXPECT_NE(lines[i].find(config_type_name(key.type)), std::string::npos) << lines[i];
    EXPECT_NE(lines[i].find(config_value_to_toml(key.default_value)), std::string::npos) << lines[i];
    EXPECT_NE(lines[i].find(key.doc), std::string::npos) << lines[i];
  }
  EXPECT_NE(reference.find("(one of fifo, uniform, prioritized, group_complete)"), std::string::npos);
  EXPECT_NE(reference.find("(at least 4096)"), std::string::npos);
}

TEST(Config, EveryShippedConfigLoads) {
  const fs::path configs = fs::path(ODYSSEY_SOURCE_DIR) / "configs";
  int loaded = 0;
  for (const auto& entry : fs::directory_iterator(configs)) {
    if (entry.path().extension() != ".toml") continue;
    auto config = load_config({entry.path().string()}, {});
    EXPECT_TRUE(config.ok()) << config.status().to_string();
    ++loaded;
  }
  EXPECT_GE(loaded, 3);

  auto tiny = load_config({(configs / "tiny.toml").string()}, {});
  ASSERT_TRUE(tiny.ok());
  EXPECT_EQ(tiny->get_string("job.name"), "tiny");
  EXPECT_EQ(tiny->get_string("replay.dir"), "out/tiny/replay");
  auto replay = load_config({(configs / "replay.toml").string()}, {});
  ASSERT_TRUE(replay.ok());
  EXPECT_EQ(replay->get_string("replay.sampler"), "group_complete");
}

TEST(Config, BaseConfigRestatesTheRegisteredDefaults) {
  auto base = load_config({std::string(ODYSSEY_SOURCE_DIR) + "/configs/base.toml"}, {});
  ASSERT_TRUE(base.ok()) << base.status().to_string();
  for (const ConfigKey& key : config_schema().keys()) {
    EXPECT_EQ(base->value(key.path), key.default_value)
        << key.path << " in configs/base.toml differs from core/config_keys.cpp";
  }
}

}  // namespace
}  // namespace odyssey
