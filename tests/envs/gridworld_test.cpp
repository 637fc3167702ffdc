// The built-in gridworld environment (envs/builtin/gridworld), loaded as a plugin through the
// C ABI: a policy that reads only the pixels solves it, moves show in the image, bumps are tool
// errors, layouts are solvable and deterministic, train/eval are disjoint, snapshots resume.
#include <deque>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "envs/env_test_helpers.h"
#include "envs/plugin.h"

namespace odyssey::envs {
namespace {

using nlohmann::json;

std::shared_ptr<Plugin> gridworld_plugin() { return test_support::builtin_plugin("gridworld"); }

std::unique_ptr<EnvSession> make_session(const json& config = json::object()) {
  return test_support::builtin_session("gridworld", config);
}

using test_support::reset;
using test_support::score;
using test_support::step;

env::Action moves(const std::vector<std::string>& directions) {
  env::Action a;
  for (size_t i = 0; i < directions.size(); ++i)
    a.tool_calls.push_back({"call_" + std::to_string(i), "move", {{"direction", directions[i]}}});
  return a;
}

// The grid as the policy sees it in the pixels: one character per cell, read from the cell's
// centre pixel ('#' wall, 'A' agent, 'G' goal, '.' empty).
struct Seen {
  int size = 0;
  std::vector<std::string> rows;
  int agent_row = -1, agent_col = -1, goal_row = -1, goal_col = -1;
  int walls = 0;
};

Seen read_pixels(const env::Image& image, int cell_pixels) {
  Seen seen;
  EXPECT_EQ(image.format, ODY_ENV_IMAGE_RGB8);
  EXPECT_EQ(image.width, image.height);
  EXPECT_EQ(image.data.size(), size_t(image.width) * image.height * 3);
  seen.size = static_cast<int>(image.width) / cell_pixels;
  for (int r = 0; r < seen.size; ++r) {
    std::string row;
    for (int c = 0; c < seen.size; ++c) {
      const size_t y = size_t(r * cell_pixels + cell_pixels / 2), x = size_t(c * cell_pixels + cell_pixels / 2);
      const uint8_t* p = &image.data[(y * image.width + x) * 3];
      // Every pixel of a cell has the cell's colour.
      for (int dy = 0; dy < cell_pixels; ++dy)
        for (int dx = 0; dx < cell_pixels; ++dx) {
          const uint8_t* q = &image.data[((size_t(r * cell_pixels + dy)) * image.width + size_t(c * cell_pixels + dx)) * 3];
          EXPECT_TRUE(q[0] == p[0] && q[1] == p[1] && q[2] == p[2]) << "cell " << r << "," << c << " is not uniform";
        }
      char ch = '?';
      if (p[0] == 255 && p[1] == 255 && p[2] == 255) ch = '.';
      else if (p[0] == 64 && p[1] == 64 && p[2] == 64) ch = '#';
      else if (p[0] == 0 && p[1] == 0 && p[2] == 255) ch = 'A';
      else if (p[0] == 0 && p[1] == 200 && p[2] == 0) ch = 'G';
      EXPECT_NE(ch, '?') << "unknown colour at cell " << r << "," << c;
      if (ch == 'A') seen.agent_row = r, seen.agent_col = c;
      if (ch == 'G') seen.goal_row = r, seen.goal_col = c;
      if (ch == '#') ++seen.walls;
      row += ch;
    }
    seen.rows.push_back(row);
  }
  return seen;
}

// Breadth-first search on what was seen: the directions of a shortest path to the goal.
std::vector<std::string> plan(const Seen& g) {
  const int n = g.size;
  std::vector<int> from(size_t(n * n), -2);
  std::deque<int> queue = {g.agent_row * n + g.agent_col};
  from[size_t(queue.front())] = -1;
  const int dr[] = {-1, 1, 0, 0}, dc[] = {0, 0, -1, 1};
  const char* names[] = {"up", "down", "left", "right"};
  while (!queue.empty()) {
    const int cell = queue.front();
    queue.pop_front();
    for (int k = 0; k < 4; ++k) {
      const int r = cell / n + dr[k], c = cell % n + dc[k];
      if (r < 0 || c < 0 || r >= n || c >= n || g.rows[size_t(r)][size_t(c)] == '#' || from[size_t(r * n + c)] != -2)
        continue;
      from[size_t(r * n + c)] = cell;
      queue.push_back(r * n + c);
    }
  }
  const int goal = g.goal_row * n + g.goal_col;
  if (from[size_t(goal)] == -2) return {"unreachable"};
  std::vector<std::string> path;
  for (int cell = goal; from[size_t(cell)] != -1; cell = from[size_t(cell)]) {
    const int prev = from[size_t(cell)];
    for (int k = 0; k < 4; ++k)
      if (prev / n + dr[k] == cell / n && prev % n + dc[k] == cell % n) path.insert(path.begin(), names[k]);
  }
  return path;
}

TEST(GridworldEnv, DeclaresImagesSnapshotsAndTheMoveTool) {
  auto plugin = gridworld_plugin();
  ASSERT_TRUE(plugin);
  EXPECT_EQ(plugin->info().name, "gridworld");
  EXPECT_TRUE(plugin->info().images);
  EXPECT_TRUE(plugin->info().snapshots);
  ASSERT_EQ(plugin->info().tools.size(), 1u);
  EXPECT_EQ(plugin->info().tools[0].name, "move");
  EXPECT_EQ(plugin->info().tools[0].input_schema["properties"]["direction"]["enum"],
            json({"up", "down", "left", "right"}));
}

TEST(GridworldEnv, PolicyReadingOnlyThePixelsReachesTheGoal) {
  auto s = make_session({{"size", 6}, {"walls", 8}, {"cell_pixels", 3}, {"max_turns", 40}});
  ASSERT_TRUE(s);
  for (uint64_t seed = 0; seed < 60; ++seed) {
    const env::Observation first = reset(*s, json::object(), seed);
    ASSERT_EQ(first.images.size(), 1u);
    const Seen seen = read_pixels(first.images[0], 3);
    EXPECT_EQ(seen.size, 6);
    EXPECT_EQ(seen.walls, 8);
    ASSERT_GE(seen.agent_row, 0);
    ASSERT_GE(seen.goal_row, 0);
    const std::vector<std::string> path = plan(seen);
    ASSERT_NE(path, std::vector<std::string>{"unreachable"});
    EXPECT_EQ(first.info["optimal_steps"], path.size());
    env::Observation last;
    if (seed % 2 == 0) {
      last = step(*s, moves(path));  // the whole path in one turn
    } else {
      for (const std::string& d : path) {  // one move a turn
        last = step(*s, moves({d}));
        for (const auto& r : last.tool_results) EXPECT_FALSE(r.is_error) << r.content;
      }
    }
    EXPECT_TRUE(last.done);
    const env::Score sc = score(*s);
    EXPECT_TRUE(sc.success) << "seed " << seed;
    EXPECT_EQ(sc.info["optimal_steps"], path.size());
    EXPECT_EQ(sc.info["moves"], path.size());
    EXPECT_NEAR(sc.reward, 1.0 - 0.01 * double(path.size()), 1e-12);
    ASSERT_EQ(sc.parts.size(), 2u);
    EXPECT_EQ(sc.parts[0].name, "goal");
    EXPECT_EQ(sc.parts[0].value, 1.0);
    EXPECT_EQ(sc.parts[1].name, "step_cost");
    EXPECT_NEAR(sc.parts[1].value, -0.01 * double(path.size()), 1e-12);
    EXPECT_EQ(last.rewards.size(), 2u) << "the final step reports the reward it earned";
  }
}

TEST(GridworldEnv, ImageHasTheConfiguredSizeAndTheAgentsPixelsMove) {
  auto s = make_session({{"size", 7}, {"walls", 0}, {"cell_pixels", 5}});
  ASSERT_TRUE(s);
  const env::Observation first = reset(*s, json::object(), 11);
  ASSERT_EQ(first.images.size(), 1u);
  EXPECT_EQ(first.images[0].width, 35u);
  EXPECT_EQ(first.images[0].height, 35u);
  EXPECT_EQ(first.images[0].data.size(), 35u * 35u * 3u);
  const Seen before = read_pixels(first.images[0], 5);
  // Without walls the first step of the plan is always free.
  const std::string d = plan(before).front();
  const env::Observation after = step(*s, moves({d}));
  ASSERT_EQ(after.images.size(), 1u);
  ASSERT_EQ(after.tool_results.size(), 1u);
  EXPECT_FALSE(after.tool_results[0].is_error);
  const Seen moved = read_pixels(after.images[0], 5);
  const int dr = d == "up" ? -1 : d == "down" ? 1 : 0, dc = d == "left" ? -1 : d == "right" ? 1 : 0;
  EXPECT_EQ(moved.agent_row, before.agent_row + dr);
  EXPECT_EQ(moved.agent_col, before.agent_col + dc);
  if (!after.done) {
    EXPECT_EQ(moved.rows[size_t(before.agent_row)][size_t(before.agent_col)], '.');
  }
}

TEST(GridworldEnv, BumpingAWallOrTheEdgeIsAToolErrorAndTheAgentStays) {
  auto s = make_session({{"size", 5}, {"walls", 10}});
  ASSERT_TRUE(s);
  int wall_bumps = 0, edge_bumps = 0;
  for (uint64_t seed = 0; seed < 40; ++seed) {
    const Seen seen = read_pixels(reset(*s, json::object(), seed).images[0], 4);
    const int dr[] = {-1, 1, 0, 0}, dc[] = {0, 0, -1, 1};
    const char* names[] = {"up", "down", "left", "right"};
    for (int k = 0; k < 4; ++k) {
      const int r = seen.agent_row + dr[k], c = seen.agent_col + dc[k];
      const bool edge = r < 0 || c < 0 || r >= 5 || c >= 5;
      if (!edge && seen.rows[size_t(r)][size_t(c)] != '#') continue;
      const env::Observation obs = step(*s, moves({names[k]}));
      ASSERT_EQ(obs.tool_results.size(), 1u);
      EXPECT_TRUE(obs.tool_results[0].is_error);
      EXPECT_NE(obs.tool_results[0].content.find(edge ? "edge" : "wall"), std::string::npos)
          << obs.tool_results[0].content;
      EXPECT_FALSE(obs.done);
      const Seen still = read_pixels(obs.images[0], 4);
      EXPECT_EQ(still.rows, seen.rows);
      (edge ? edge_bumps : wall_bumps)++;
    }
    // A direction outside the enum is a tool error too.
    const env::Observation bad = step(*s, moves({"north"}));
    ASSERT_EQ(bad.tool_results.size(), 1u);
    EXPECT_TRUE(bad.tool_results[0].is_error);
    EXPECT_NE(bad.tool_results[0].content.find("'direction'"), std::string::npos);
  }
  EXPECT_GT(wall_bumps, 0);
  EXPECT_GT(edge_bumps, 0);
}

TEST(GridworldEnv, BumpsCostStepsAndMovesAfterTheGoalAreRefused) {
  auto s = make_session({{"size", 5}, {"walls", 0}, {"step_cost", 0.05}});
  ASSERT_TRUE(s);
  for (uint64_t seed = 0; seed < 20; ++seed) {
    const Seen seen = read_pixels(reset(*s, json::object(), seed).images[0], 4);
    if (seen.agent_row != 0) continue;  // want an agent on the top edge
    std::vector<std::string> turn = {"up"};
    for (const std::string& d : plan(seen)) turn.push_back(d);
    turn.push_back("left");
    const env::Observation obs = step(*s, moves(turn));
    EXPECT_TRUE(obs.tool_results.front().is_error);
    EXPECT_TRUE(obs.tool_results.back().is_error);
    EXPECT_NE(obs.tool_results.back().content.find("already reached"), std::string::npos);
    EXPECT_TRUE(obs.done);
    const env::Score sc = score(*s);
    EXPECT_TRUE(sc.success);
    EXPECT_EQ(sc.info["bumps"], 1);
    EXPECT_NEAR(sc.reward, 1.0 - 0.05 * double(turn.size() - 1), 1e-12);
    EXPECT_FALSE(s->step(moves({"up"})).ok()) << "no step after the episode is over";
    return;
  }
  FAIL() << "no seed put the agent on the top row";
}

TEST(GridworldEnv, TextGridMatchesThePixels) {
  auto s = make_session({{"size", 5}, {"walls", 6}, {"text_grid", true}});
  ASSERT_TRUE(s);
  for (uint64_t seed = 0; seed < 20; ++seed) {
    const env::Observation obs = reset(*s, json::object(), seed);
    const Seen seen = read_pixels(obs.images[0], 4);
    std::string grid;
    for (const std::string& row : seen.rows) grid += "\n" + row;
    ASSERT_GE(obs.text.size(), grid.size());
    EXPECT_EQ(obs.text.substr(obs.text.size() - grid.size()), grid);
  }
}

TEST(GridworldEnv, EndsUnsolvedAfterMaxTurns) {
  auto s = make_session({{"max_turns", 2}});
  ASSERT_TRUE(s);
  reset(*s, json::object(), 4);
  EXPECT_FALSE(step(*s, env::Action{}).done);
  EXPECT_TRUE(step(*s, env::Action{}).done);
  const env::Score sc = score(*s);
  EXPECT_FALSE(sc.success);
  EXPECT_EQ(sc.reward, 0.0);
  EXPECT_EQ(sc.info["turns"], 2);
}

TEST(GridworldEnv, EveryLayoutIsSolvableEvenWithDenseWalls) {
  for (const json& config : {json{{"size", 4}, {"walls", 9}}, json{{"size", 2}, {"walls", 1}},
                             json{{"size", 8}, {"walls", 30}}}) {
    auto s = make_session(config);
    ASSERT_TRUE(s);
    const int size = config["size"];
    for (uint64_t seed = 0; seed < 200; ++seed) {
      const env::Observation obs = reset(*s, json::object(), seed);
      const Seen seen = read_pixels(obs.images[0], 4);
      EXPECT_EQ(seen.size, size);
      EXPECT_EQ(seen.walls, config["walls"].get<int>());
      const std::vector<std::string> path = plan(seen);
      ASSERT_NE(path, std::vector<std::string>{"unreachable"}) << config << " seed " << seed;
      EXPECT_EQ(obs.info["optimal_steps"], path.size());
    }
  }
}

TEST(GridworldEnv, SameTaskAndSeedGiveTheSameEpisodeAndSeedsDiffer) {
  auto a = make_session();
  auto b = make_session();
  ASSERT_TRUE(a && b);
  std::set<std::vector<uint8_t>> images;
  for (uint64_t seed = 0; seed < 50; ++seed) {
    const env::Observation oa = reset(*a, json::object(), seed), ob = reset(*b, json::object(), seed);
    EXPECT_EQ(oa.images[0].data, ob.images[0].data);
    EXPECT_EQ(oa.text, ob.text);
    images.insert(oa.images[0].data);
  }
  EXPECT_GE(images.size(), 48u);
  EXPECT_EQ(reset(*a, json::object(), 9).images[0].data, reset(*b, {{"split", "train"}, {"index", 9}}, 77).images[0].data);
}

TEST(GridworldEnv, TrainAndEvalSplitsNeverShareALayout) {
  auto s = make_session({{"size", 4}, {"walls", 3}});
  ASSERT_TRUE(s);
  std::set<std::vector<uint8_t>> train, eval;
  for (uint64_t i = 0; i < 2000; ++i) {
    train.insert(reset(*s, {{"split", "train"}, {"index", i}}).images[0].data);
    eval.insert(reset(*s, {{"split", "eval"}, {"index", i}}).images[0].data);
  }
  for (const auto& image : eval) EXPECT_EQ(train.count(image), 0u) << "a layout is in both splits";
  EXPECT_GE(eval.size(), 1500u);
  EXPECT_GE(train.size(), 1500u);
}

TEST(GridworldEnv, SnapshotRestoresIntoAFreshInstanceAndContinuesIdentically) {
  const json config = {{"size", 6}, {"walls", 6}, {"cell_pixels", 2}};
  auto original = make_session(config);
  ASSERT_TRUE(original);
  const Seen seen = read_pixels(reset(*original, {{"split", "eval"}, {"index", 2}}).images[0], 2);
  const std::vector<std::string> path = plan(seen);
  ASSERT_GE(path.size(), 2u);
  step(*original, moves({path[0]}));
  auto bytes = original->snapshot();
  ASSERT_TRUE(bytes.ok()) << bytes.status().to_string();
  EXPECT_TRUE(json::parse(*bytes).is_object());

  auto fork = make_session(config);
  ASSERT_TRUE(fork);
  ASSERT_TRUE(fork->restore(*bytes).ok());
  std::vector<env::Observation> seen_a, seen_b;
  for (size_t i = 1; i < path.size(); ++i) {
    seen_a.push_back(step(*original, moves({path[i]})));
    seen_b.push_back(step(*fork, moves({path[i]})));
    EXPECT_EQ(seen_a.back().images[0].data, seen_b.back().images[0].data);
    EXPECT_EQ(seen_a.back().text, seen_b.back().text);
    EXPECT_EQ(seen_a.back().done, seen_b.back().done);
  }
  const env::Score a = score(*original), b = score(*fork);
  EXPECT_TRUE(b.success);
  EXPECT_EQ(a.reward, b.reward);
  EXPECT_EQ(a.info, b.info);

  auto other = make_session({{"size", 7}});
  const Status refused = other->restore(*bytes);
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("another config"), std::string::npos) << refused.message();
}

TEST(GridworldEnv, RefusesBadConfigsAndTasksNamingTheField) {
  auto plugin = gridworld_plugin();
  ASSERT_TRUE(plugin);
  const std::vector<std::pair<json, std::string>> configs = {
      {{{"size", 1}}, "'size'"},          {{{"size", 5}, {"walls", 17}}, "'walls'"},
      {{{"cell_pixels", 0}}, "'cell_pixels'"}, {{{"max_turns", "10"}}, "'max_turns'"},
      {{{"step_cost", 1}}, "'step_cost'"}, {{{"text_grid", "yes"}}, "'text_grid'"},
      {{{"colour", 1}}, "'colour'"},      {{{"cell_pixel", 3}}, "(did you mean 'cell_pixels'?)"},
  };
  for (const auto& [config, field] : configs) {
    auto session = plugin->create(config);
    ASSERT_FALSE(session.ok()) << config;
    EXPECT_NE(session.status().message().find(field), std::string::npos) << session.status().message();
  }
  auto s = make_session();
  ASSERT_TRUE(s);
  for (const auto& [task, field] : std::vector<std::pair<json, std::string>>{
           {{{"split", "dev"}, {"index", 0}}, "'split'"}, {{{"split", "train"}, {"index", 1.5}}, "'index'"},
           {{{"maze", 1}}, "'maze'"}}) {
    auto obs = s->reset(task, 0);
    ASSERT_FALSE(obs.ok()) << task;
    EXPECT_NE(obs.status().message().find(field), std::string::npos) << obs.status().message();
  }
}

}  // namespace
}  // namespace odyssey::envs
