// Plugin loading (envs/plugin.h): the example plugin through the C ABI, every way a broken
// plugin is refused, and discovery.
#include "envs/plugin.h"

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <gtest/gtest.h>

namespace odyssey::envs {
namespace {

using nlohmann::json;

const std::string kPluginDir = ODYSSEY_PLUGIN_DIR;
const std::string kTestPluginDir = ODYSSEY_TEST_PLUGIN_DIR;
std::string example_path() { return kPluginDir + "/libody_env_guess.so"; }
std::string test_plugin(const std::string& name) { return kTestPluginDir + "/libody_env_" + name + ".so"; }

std::shared_ptr<Plugin> load_example() {
  auto plugin = Plugin::load(example_path());
  EXPECT_TRUE(plugin.ok()) << plugin.status().to_string();
  return plugin.ok() ? *plugin : nullptr;
}

env::Action guess(int n, int id) {
  return {"", {{"call_" + std::to_string(id), "guess", json{{"n", n}}}}};
}

// The message Plugin::load gives for `path`, which must be a refusal.
std::string refusal(const std::string& path) {
  auto plugin = Plugin::load(path);
  EXPECT_FALSE(plugin.ok()) << path << " was accepted";
  return plugin.ok() ? "" : plugin.status().message();
}

TEST(Plugin, LoadsTheExampleAndDescribesIt) {
  auto plugin = load_example();
  ASSERT_TRUE(plugin);
  const EnvInfo& info = plugin->info();
  EXPECT_EQ(info.name, "guess");
  EXPECT_EQ(info.version, "1.0.0");
  EXPECT_FALSE(info.description.empty());
  ASSERT_EQ(info.tools.size(), 1u);
  EXPECT_EQ(info.tools[0].name, "guess");
  EXPECT_EQ(info.tools[0].input_schema["type"], "object");
  EXPECT_TRUE(info.snapshots);
  EXPECT_FALSE(info.images);
  EXPECT_EQ(info.source, example_path());
}

TEST(Plugin, SourceHashIsTheHexXxh128OfTheFile) {
  auto plugin = load_example();
  ASSERT_TRUE(plugin);
  std::ifstream in(example_path(), std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
  char expected[33];
  std::snprintf(expected, sizeof(expected), "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                static_cast<unsigned long long>(h.low64));
  EXPECT_EQ(plugin->info().source_hash, expected);
}

TEST(Plugin, RunsAnEpisodeThroughTheCAbi) {
  auto plugin = load_example();
  ASSERT_TRUE(plugin);
  auto session = plugin->create(json{{"low", 1}, {"high", 100}, {"max_guesses", 10}});
  ASSERT_TRUE(session.ok()) << session.status().to_string();
  auto first = (*session)->reset(json{{"target", 37}}, /*seed=*/1);
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  EXPECT_NE(first->text.find("between 1 and 100"), std::string::npos) << first->text;
  EXPECT_FALSE(first->done);

  // Binary search, one guess a turn.
  int low = 1, high = 100, turns = 0;
  bool done = false;
  while (!done && turns < 10) {
    const int mid = (low + high) / 2;
    auto obs = (*session)->step(guess(mid, turns));
    ASSERT_TRUE(obs.ok()) << obs.status().to_string();
    ASSERT_EQ(obs->tool_results.size(), 1u);
    EXPECT_EQ(obs->tool_results[0].call_id, "call_" + std::to_string(turns));
    EXPECT_FALSE(obs->tool_results[0].is_error);
    const std::string& answer = obs->tool_results[0].content;
    if (answer == "higher") low = mid + 1;
    else if (answer == "lower") high = mid - 1;
    else EXPECT_EQ(answer, "correct");
    done = obs->done;
    ++turns;
  }
  EXPECT_TRUE(done);
  EXPECT_EQ(turns, 3);  // 50 25 37
  auto score = (*session)->score();
  ASSERT_TRUE(score.ok()) << score.status().to_string();
  EXPECT_TRUE(score->success);
  EXPECT_GT(score->reward, 0.5);
  EXPECT_LT(score->reward, 1.0);
  EXPECT_EQ(score->info["target"], 37);
  EXPECT_EQ(score->info["guesses"], turns);
}

TEST(Plugin, AFailingToolCallIsAnErrorResultNotAFailedStep) {
  auto plugin = load_example();
  ASSERT_TRUE(plugin);
  auto session = plugin->create(json::object());
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE((*session)->reset(json::object(), 7).ok());
  auto obs = (*session)->step(guess(500, 0));
  ASSERT_TRUE(obs.ok()) << obs.status().to_string();
  ASSERT_EQ(obs->tool_results.size(), 1u);
  EXPECT_TRUE(obs->tool_results[0].is_error);
  EXPECT_NE(obs->tool_results[0].content.find("[1, 100]"), std::string::npos) << obs->tool_results[0].content;
}

TEST(Plugin, ErrorsNameThePluginTheCallAndThePluginsMessage) {
  auto plugin = load_example();
  ASSERT_TRUE(plugin);
  auto bad_config = plugin->create(json{{"lo", 1}});
  ASSERT_FALSE(bad_config.ok());
  EXPECT_EQ(bad_config.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_config.status().message().find("plugin 'guess' create"), std::string::npos)
      << bad_config.status().message();
  EXPECT_NE(bad_config.status().message().find("unknown config key 'lo'"), std::string::npos)
      << bad_config.status().message();

  auto session = plugin->create(json::object());
  ASSERT_TRUE(session.ok());
  auto bad_task = (*session)->reset(json{{"target", "seven"}}, 0);
  ASSERT_FALSE(bad_task.ok());
  EXPECT_NE(bad_task.status().message().find("plugin 'guess' reset"), std::string::npos);
  EXPECT_NE(bad_task.status().message().find("'target' must be an integer"), std::string::npos)
      << bad_task.status().message();
  EXPECT_FALSE((*session)->reset(json::array(), 0).ok());
  EXPECT_FALSE(plugin->create(json::array()).ok());
}

TEST(Plugin, AStepAfterTheEpisodeEndedIsRefused) {
  auto plugin = load_example();
  ASSERT_TRUE(plugin);
  auto session = plugin->create(json::object());
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE((*session)->reset(json{{"target", 9}}, 0).ok());
  auto hit = (*session)->step(guess(9, 0));
  ASSERT_TRUE(hit.ok());
  EXPECT_TRUE(hit->done);
  auto after = (*session)->step(guess(9, 1));
  ASSERT_FALSE(after.ok());
  EXPECT_EQ(after.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(after.status().message().find("the episode is over"), std::string::npos) << after.status().message();
  // The score is still there, and the session takes a new episode.
  auto score = (*session)->score();
  ASSERT_TRUE(score.ok());
  EXPECT_DOUBLE_EQ(score->reward, 1.0);
  EXPECT_TRUE((*session)->reset(json::object(), 1).ok());
}

TEST(Plugin, RestoringASnapshotIntoAFreshInstanceContinuesIdentically) {
  auto plugin = load_example();
  ASSERT_TRUE(plugin);
  auto a = plugin->create(json::object());
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE((*a)->reset(json::object(), /*seed=*/123).ok());
  ASSERT_TRUE((*a)->step(guess(50, 0)).ok());
  auto bytes = (*a)->snapshot();
  ASSERT_TRUE(bytes.ok()) << bytes.status().to_string();

  auto b = plugin->create(json::object());
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE((*b)->restore(*bytes).ok());
  for (int n : {25, 75, 12}) {
    auto from_a = (*a)->step(guess(n, n));
    auto from_b = (*b)->step(guess(n, n));
    ASSERT_TRUE(from_a.ok() && from_b.ok());
    ASSERT_EQ(from_a->tool_results.size(), 1u);
    ASSERT_EQ(from_b->tool_results.size(), 1u);
    EXPECT_EQ(from_a->tool_results[0].content, from_b->tool_results[0].content);
    EXPECT_EQ(from_a->done, from_b->done);
  }
  EXPECT_EQ((*a)->score()->info, (*b)->score()->info);
  auto garbage = (*b)->restore("not a snapshot");
  ASSERT_FALSE(garbage.ok());
  EXPECT_EQ(garbage.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(garbage.message().find("plugin 'guess' restore"), std::string::npos) << garbage.message();
}

TEST(Plugin, ASessionKeepsItsPluginLoaded) {
  std::unique_ptr<EnvSession> session;
  {
    auto plugin = load_example();
    ASSERT_TRUE(plugin);
    auto created = plugin->create(json::object());
    ASSERT_TRUE(created.ok());
    session = std::move(*created);
  }
  EXPECT_EQ(session->info().name, "guess");
  auto obs = session->reset(json::object(), 5);
  ASSERT_TRUE(obs.ok());
  EXPECT_FALSE(obs->text.empty());
}

TEST(Plugin, RefusesAPluginBuiltForAnotherAbiVersion) {
  const std::string message = refusal(test_plugin("wrong_abi"));
  EXPECT_NE(message.find(test_plugin("wrong_abi")), std::string::npos) << message;
  EXPECT_NE(message.find("built for ABI version 2"), std::string::npos) << message;
  EXPECT_NE(message.find("ABI version 1"), std::string::npos) << message;
}

TEST(Plugin, RefusesALibraryWithoutTheEntryPoint) {
  const std::string message = refusal(test_plugin("missing_symbols"));
  EXPECT_NE(message.find(test_plugin("missing_symbols")), std::string::npos) << message;
  EXPECT_NE(message.find("missing entry point ody_env_plugin_v1"), std::string::npos) << message;
}

TEST(Plugin, RefusesATableWithoutRequiredFunctionsNamingEach) {
  const std::string message = refusal(test_plugin("missing_functions"));
  EXPECT_NE(message.find("missing required entries: step, score, snapshot, restore, free_buffer (capabilities has "
                         "ODY_ENV_CAP_SNAPSHOT"),
            std::string::npos)
      << message;
}

TEST(Plugin, RefusesAToolWithAnInvalidSchemaNamingTheTool) {
  const std::string message = refusal(test_plugin("bad_schema"));
  EXPECT_NE(message.find(test_plugin("bad_schema")), std::string::npos) << message;
  EXPECT_NE(message.find("tool 'search'"), std::string::npos) << message;
  EXPECT_EQ(message.find("tool 'fetch'"), std::string::npos) << message;
}

TEST(Plugin, RefusesAnEntryPointThatReturnsNoTable) {
  const std::string message = refusal(test_plugin("null_table"));
  EXPECT_NE(message.find("returned no table for host ABI version 1"), std::string::npos) << message;
}

TEST(Plugin, RefusesAPathThatDoesNotExist) {
  auto plugin = Plugin::load("/nonexistent/libody_env_nothing.so");
  ASSERT_FALSE(plugin.ok());
  EXPECT_EQ(plugin.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(plugin.status().message(), "plugin /nonexistent/libody_env_nothing.so: no such file");
}

TEST(Plugin, RefusesAFileThatIsNotASharedLibraryWithDlopensReason) {
  char dir_template[] = "/tmp/ody_plugin_test_XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string path = std::string(dir_template) + "/libody_env_text.so";
  std::ofstream(path) << std::string(256, 'x');  // longer than an ELF header, so dlopen reads one
  const std::string message = refusal(path);
  EXPECT_NE(message.find("plugin " + path + ": cannot load it: "), std::string::npos) << message;
  EXPECT_NE(message.find("invalid ELF header"), std::string::npos) << message;
  std::remove(path.c_str());
  rmdir(dir_template);
}

TEST(ParseTools, NamesTheToolAndFieldThatIsWrong) {
  auto message = [](const json& tools) {
    auto parsed = parse_tools(tools, "here");
    EXPECT_FALSE(parsed.ok()) << tools.dump();
    return parsed.ok() ? "" : parsed.status().message();
  };
  const json ok_schema = {{"type", "object"}};
  EXPECT_EQ(message(json::object()), "here: tools must be a JSON array, got object");
  EXPECT_EQ(message(json::array({1})), "here: tool 0 must be a JSON object, got number");
  EXPECT_EQ(message(json::array({{{"description", "x"}}})), "here: tool 0 needs a \"name\" string");
  EXPECT_NE(message(json::array({{{"name", "a b"}, {"input_schema", ok_schema}}})).find("'a b'"), std::string::npos);
  EXPECT_EQ(message(json::array({{{"name", "a"}, {"input_schema", ok_schema}}, {{"name", "a"}, {"input_schema", ok_schema}}})),
            "here: tool 'a': the name is used by two tools");
  EXPECT_EQ(message(json::array({{{"name", "a"}}})), "here: tool 'a': needs an \"input_schema\" (a JSON Schema object)");
  EXPECT_NE(message(json::array({{{"name", "a"}, {"input_schema", {{"type", "array"}}}}})).find("\"type\": \"object\""),
            std::string::npos);
  EXPECT_NE(message(json::array({{{"name", "a"}, {"description", 3}, {"input_schema", ok_schema}}})).find("description"),
            std::string::npos);
}

TEST(ParseTools, AcceptsOpenAisParametersAsTheInputSchema) {
  auto parsed = parse_tools(json::parse(R"([{"name": "get_weather", "description": "Weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}])"),
                            "here");
  ASSERT_TRUE(parsed.ok()) << parsed.status().to_string();
  ASSERT_EQ(parsed->size(), 1u);
  EXPECT_EQ((*parsed)[0].input_schema["required"][0], "city");
  EXPECT_EQ((*parsed)[0].description, "Weather");
}

TEST(FindPlugin, FindsABuiltInPluginByName) {
  auto path = find_plugin("guess");
  ASSERT_TRUE(path.ok()) << path.status().to_string();
  EXPECT_NE(path->find("libody_env_guess.so"), std::string::npos);
  auto plugin = Plugin::load(*path);
  ASSERT_TRUE(plugin.ok());
  EXPECT_EQ((*plugin)->info().name, "guess");
}

TEST(FindPlugin, SearchesExtraDirectoriesAndTheEnvironmentPathFirst) {
  auto from_extra = find_plugin("null_table", {kTestPluginDir});
  ASSERT_TRUE(from_extra.ok()) << from_extra.status().to_string();
  EXPECT_EQ(*from_extra, test_plugin("null_table"));

  ASSERT_EQ(setenv("ODYSSEY_ENV_PATH", ("/nonexistent:" + kTestPluginDir).c_str(), 1), 0);
  auto from_env = find_plugin("wrong_abi");
  unsetenv("ODYSSEY_ENV_PATH");
  ASSERT_TRUE(from_env.ok()) << from_env.status().to_string();
  EXPECT_EQ(*from_env, test_plugin("wrong_abi"));
}

TEST(FindPlugin, NotFoundListsTheDirectoriesItSearched) {
  auto path = find_plugin("no_such_env", {"/opt/my-envs"});
  ASSERT_FALSE(path.ok());
  EXPECT_EQ(path.status().code(), StatusCode::kNotFound);
  const std::string& message = path.status().message();
  EXPECT_NE(message.find("no environment plugin 'no_such_env'"), std::string::npos) << message;
  EXPECT_NE(message.find("libody_env_no_such_env.so"), std::string::npos) << message;
  EXPECT_NE(message.find("/opt/my-envs"), std::string::npos) << message;
  EXPECT_NE(message.find(kPluginDir), std::string::npos) << message;
  EXPECT_NE(message.find("ODYSSEY_ENV_PATH"), std::string::npos) << message;
}

TEST(FindPlugin, TakesANameWithASlashAsAPath) {
  auto path = find_plugin(example_path());
  ASSERT_TRUE(path.ok());
  EXPECT_EQ(*path, example_path());
  auto missing = find_plugin("./libody_env_absent.so");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().message(), "plugin ./libody_env_absent.so: no such file");
}

TEST(DiscoverPlugins, ListsTheBuiltInDirectoryButNotTestPluginsUnlessAsked) {
  const auto found = discover_plugins();
  EXPECT_NE(std::find(found.begin(), found.end(), example_path()), found.end());
  for (const std::string& path : found) EXPECT_EQ(path.find(kTestPluginDir), std::string::npos) << path;
  const auto with_tests = discover_plugins({kTestPluginDir});
  EXPECT_NE(std::find(with_tests.begin(), with_tests.end(), test_plugin("bad_schema")), with_tests.end());
}

}  // namespace
}  // namespace odyssey::envs
