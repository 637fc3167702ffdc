// Built-in environment "gridworld": walk to the goal in a grid seen as an image.
//
// Config (all optional; unknown keys are refused):
//   size (5)           the grid is size x size cells, 2..32
//   walls (size)       wall cells, 0..(size-1)^2; every layout is solvable (grid.h)
//   cell_pixels (4)    pixels per cell side, 1..32: the image is size*cell_pixels square
//   max_turns (20)     turns before the episode ends unsolved, 1..1000
//   step_cost (0.01)   reward lost per move call (bumps included) when the goal is reached,
//                      0..0.1, at most 0.5 in all
//   text_grid (false)  also write the grid as text ('#' wall, 'A' agent, 'G' goal, '.')
//
// Task: {} is train task number `seed`; {"split": "train"|"eval", "index": N} is task N of
// that split, whatever the seed. Train and eval never share a layout (grid.h says how).
//
// Observations: after reset and after every turn, one RGB8 image of the grid (white empty
// cells, dark grey walls, the blue agent, the green goal) and a short text. Tool:
//   move {"direction": "up"|"down"|"left"|"right"}   "up" is towards the top row.
// A move into a wall or off the grid is a tool error; the agent stays. A turn may hold several
// moves, run in order; once the goal is reached the rest are refused. The episode ends when
// the agent reaches the goal or after max_turns turns.
//
// Reward parts: "goal" (1 when reached) and "step_cost" (-step_cost per move call, bumps
// included, floored at -0.5; 0 when not reached); reward = their sum; success = reached.
// score().info: optimal_steps (BFS from the start), moves, bumps, turns, reached, split, index.
//
// Snapshots: JSON of the whole episode state (layout included) at a turn boundary; restore
// into an instance with the same config.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "grid.h"
#include "odyssey/env_sdk.hpp"
#include "odyssey/env_util.hpp"

namespace {

using nlohmann::json;
using odyssey::env::Action;
using odyssey::env::EnvError;
using odyssey::env::Observation;
using odyssey::env::Score;
using odyssey::env::ToolError;
using namespace odyssey::gridworld;

constexpr int kSnapshotVersion = 1;
constexpr double kMaxStepPenalty = 0.5;

struct Direction {
  const char* name;
  int dr, dc;
};
constexpr Direction kDirections[] = {{"up", -1, 0}, {"down", 1, 0}, {"left", 0, -1}, {"right", 0, 1}};

class Gridworld : public odyssey::env::Environment {
 public:
  explicit Gridworld(const json& config) {
    odyssey::env::check_keys(config, {"size", "walls", "cell_pixels", "max_turns", "step_cost", "text_grid"},
                             "gridworld config", ODY_ENV_ERR_INVALID_CONFIG);
    auto int_key = [&](const char* key, int64_t fallback, int64_t lo, int64_t hi) {
      return static_cast<int>(odyssey::env::integer_field(config, key, static_cast<uint64_t>(fallback),
                                                          static_cast<uint64_t>(lo), static_cast<uint64_t>(hi),
                                                          "gridworld config", ODY_ENV_ERR_INVALID_CONFIG));
    };
    size_ = int_key("size", 5, 2, 32);
    walls_ = int_key("walls", size_, 0, (size_ - 1) * (size_ - 1));
    cell_pixels_ = int_key("cell_pixels", 4, 1, 32);
    max_turns_ = int_key("max_turns", 20, 1, 1000);
    if (const auto it = config.find("step_cost"); it != config.end()) {
      if (!it->is_number() || !(it->get<double>() >= 0.0 && it->get<double>() <= 0.1))
        throw EnvError(ODY_ENV_ERR_INVALID_CONFIG, "config 'step_cost' must be a number in [0, 0.1], got " + it->dump());
      step_cost_ = it->get<double>();
    }
    if (const auto it = config.find("text_grid"); it != config.end()) {
      if (!it->is_boolean())
        throw EnvError(ODY_ENV_ERR_INVALID_CONFIG, "config 'text_grid' must be true or false, got " + it->dump());
      text_grid_ = it->get<bool>();
    }

    add_tool({"move", "Moves the agent one cell; up is towards the top row. Walls and the grid's edge block.",
              {{"type", "object"},
               {"properties",
                {{"direction", {{"type", "string"}, {"enum", {"up", "down", "left", "right"}}}}}},
               {"required", {"direction"}},
               {"additionalProperties", false}}},
             [this](const json& args) { return move(args); });
  }

  Observation reset(const json& task, uint64_t seed) override {
    const odyssey::env::SplitIndex chosen = odyssey::env::split_index_task(task, seed);
    const Split split = chosen.eval ? Split::kEval : Split::kTrain;
    const uint64_t index = chosen.index;
    try {
      layout_ = layout_for(size_, walls_, split, index);
    } catch (const std::invalid_argument& e) {
      throw EnvError(ODY_ENV_ERR_INVALID_TASK, e.what());
    }
    split_ = split;
    index_ = index;
    agent_ = layout_.agent;
    optimal_ = shortest_path(layout_, layout_.agent);
    turns_ = moves_ = bumps_ = 0;
    reached_ = done_ = false;

    Observation obs = observe();
    obs.text = "Move the blue square onto the green square; dark squares are walls. Call move with up, down, "
               "left or right." +
               grid_text();
    obs.info = {{"split", split_name(split_)}, {"index", index_}, {"optimal_steps", optimal_}};
    return obs;
  }

  Observation step(const Action& action) override {
    if (done_) throw EnvError(ODY_ENV_ERR_INVALID_ACTION, "the episode is over; call score");
    if (layout_.size == 0) throw EnvError(ODY_ENV_ERR_INVALID_ACTION, "step before reset");
    ++turns_;
    std::vector<odyssey::env::ToolResult> results;
    for (const auto& call : action.tool_calls) results.push_back(run_tool(call));
    Observation obs = observe();
    obs.tool_results = std::move(results);
    if (reached_) {
      done_ = true;
      obs.text = "You reached the goal.";
    } else if (turns_ >= max_turns_) {
      done_ = true;
      obs.text = "Out of turns.";
    } else if (action.tool_calls.empty()) {
      obs.text = "You did not move. Call move with up, down, left or right.";
    }
    obs.text += grid_text();
    if (done_) obs.rewards = parts();
    obs.done = done_;
    return obs;
  }

  Score score() override {
    Score s;
    s.parts = parts();
    for (const auto& p : s.parts) s.reward += p.value;
    s.success = reached_;
    s.info = {{"optimal_steps", optimal_}, {"moves", moves_},           {"bumps", bumps_},
              {"turns", turns_},           {"reached", reached_},       {"split", split_name(split_)},
              {"index", index_}};
    return s;
  }

  std::string snapshot() override {
    if (layout_.size == 0) throw EnvError(ODY_ENV_ERR_INVALID_ACTION, "snapshot before reset");
    std::vector<int> walls;
    for (int i = 0; i < size_ * size_; ++i)
      if (layout_.wall[static_cast<size_t>(i)]) walls.push_back(i);
    return json{{"kind", "gridworld"},
                {"version", kSnapshotVersion},
                {"config", config_json()},
                {"start", {layout_.agent.row, layout_.agent.col}},
                {"goal", {layout_.goal.row, layout_.goal.col}},
                {"walls", walls},
                {"agent", {agent_.row, agent_.col}},
                {"optimal", optimal_},
                {"split", split_name(split_)},
                {"index", index_},
                {"turns", turns_},
                {"moves", moves_},
                {"bumps", bumps_},
                {"reached", reached_},
                {"done", done_}}
        .dump();
  }

  void restore(std::string_view bytes) override {
    const json state = odyssey::env::parse_snapshot(bytes, "gridworld", kSnapshotVersion, "kind");
    if (state.at("config") != config_json())
      throw EnvError(ODY_ENV_ERR_UNSUPPORTED, "the snapshot was taken with another config: " +
                                                  state.at("config").dump() + " (this instance: " +
                                                  config_json().dump() + ")");
    const auto cell = [&](const char* key) {
      const Cell c{state.at(key).at(0).get<int>(), state.at(key).at(1).get<int>()};
      if (c.row < 0 || c.col < 0 || c.row >= size_ || c.col >= size_)
        throw EnvError(ODY_ENV_ERR_UNSUPPORTED, std::string("snapshot '") + key + "' lies outside the grid");
      return c;
    };
    Layout layout;
    layout.size = size_;
    layout.wall.assign(static_cast<size_t>(size_ * size_), 0);
    layout.agent = cell("start");
    layout.goal = cell("goal");
    for (const json& w : state.at("walls")) {
      const int i = w.get<int>();
      if (i < 0 || i >= size_ * size_) throw EnvError(ODY_ENV_ERR_UNSUPPORTED, "snapshot wall outside the grid");
      layout.wall[static_cast<size_t>(i)] = 1;
    }
    const std::string split = state.at("split").get<std::string>();
    if (split != "train" && split != "eval") throw EnvError(ODY_ENV_ERR_UNSUPPORTED, "bad split in snapshot");
    layout_ = layout;
    agent_ = cell("agent");
    optimal_ = state.at("optimal").get<int>();
    split_ = split == "eval" ? Split::kEval : Split::kTrain;
    index_ = state.at("index").get<uint64_t>();
    turns_ = state.at("turns").get<int>();
    moves_ = state.at("moves").get<int>();
    bumps_ = state.at("bumps").get<int>();
    reached_ = state.at("reached").get<bool>();
    done_ = state.at("done").get<bool>();
  }

 private:
  std::string move(const json& args) {
    if (reached_) throw ToolError("the goal is already reached");
    const auto it = args.find("direction");
    const Direction* d = nullptr;
    if (it != args.end() && it->is_string())
      for (const Direction& candidate : kDirections)
        if (*it == candidate.name) d = &candidate;
    if (d == nullptr)
      throw ToolError("'direction' must be one of up, down, left, right; got " +
                      (it == args.end() ? std::string("nothing") : it->dump()));
    const Cell next{agent_.row + d->dr, agent_.col + d->dc};
    if (!layout_.inside(next)) {
      ++bumps_;
      throw ToolError(std::string("cannot move ") + d->name + ": the edge of the grid");
    }
    if (layout_.is_wall(next)) {
      ++bumps_;
      throw ToolError(std::string("cannot move ") + d->name + ": a wall is in the way");
    }
    ++moves_;
    agent_ = next;
    if (agent_ == layout_.goal) {
      reached_ = true;
      return std::string("moved ") + d->name + "; reached the goal";
    }
    return std::string("moved ") + d->name;
  }

  Observation observe() const {
    Observation obs;
    odyssey::env::Image image;
    image.format = ODY_ENV_IMAGE_RGB8;
    image.width = image.height = static_cast<uint32_t>(size_ * cell_pixels_);
    image.data = render_rgb(layout_, agent_, cell_pixels_);
    obs.images.push_back(std::move(image));
    return obs;
  }

  std::string grid_text() const { return text_grid_ ? "\n" + render_text(layout_, agent_) : std::string(); }

  std::vector<odyssey::env::RewardPart> parts() const {
    const double cost = reached_ ? std::min(kMaxStepPenalty, step_cost_ * (moves_ + bumps_)) : 0.0;
    return {{"goal", reached_ ? 1.0 : 0.0}, {"step_cost", -cost}};
  }

  json config_json() const {
    return {{"size", size_}, {"walls", walls_}, {"cell_pixels", cell_pixels_}, {"max_turns", max_turns_},
            {"step_cost", step_cost_}, {"text_grid", text_grid_}};
  }

  int size_ = 5;
  int walls_ = 5;
  int cell_pixels_ = 4;
  int max_turns_ = 20;
  double step_cost_ = 0.01;
  bool text_grid_ = false;

  Layout layout_;
  Split split_ = Split::kTrain;
  uint64_t index_ = 0;
  Cell agent_;
  int optimal_ = 0;
  int turns_ = 0;
  int moves_ = 0;
  int bumps_ = 0;
  bool reached_ = false;
  bool done_ = false;
};

}  // namespace

ODY_ENV_PLUGIN_EX(Gridworld, "gridworld", "1.0.0", "Walk to the goal in a seeded grid seen as an image", true,
                  ODY_ENV_CAP_IMAGES)
