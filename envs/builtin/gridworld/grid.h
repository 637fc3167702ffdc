// The gridworld environment's grids: seeded layouts that are always solvable, shortest paths,
// rendering to pixels and text, and the train/eval split.
//
// A layout is a size x size grid with an agent cell, a distinct goal cell and `walls` wall
// cells (never on the agent or the goal). generate() draws agent, goal and walls uniformly and
// keeps the first draw whose goal the agent can reach (breadth-first search), for up to
// kLayoutDraws draws; after that it protects a random shortest (monotone) path from agent to
// goal and draws the walls among the other cells, which always succeeds because walls <=
// (size-1)^2 leaves enough free cells. Either way shortest_path() is finite.
//
// The split: a layout's key is its exact content (size, agent, goal, wall cells). It is an
// eval layout exactly when hash(key) % kEvalModulus == 0 (FNV-1a 64 then the splitmix64
// finalizer), a train layout otherwise. Task N of a split is the first layout, over attempts
// 0, 1, 2, ..., generated from the seed mix(split, N, attempt) that belongs to that split, so
// the splits never share a layout. Deterministic on every platform (own generator, integer
// sampling only).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "odyssey/env_util.hpp"

namespace odyssey::gridworld {

inline constexpr uint64_t kEvalModulus = 10;  // 1 layout in 10 is eval
inline constexpr int kLayoutDraws = 100;
inline constexpr int kMaxAttempts = 10000;

// RGB colours of the rendered cells.
struct Rgb {
  uint8_t r, g, b;
};
inline constexpr Rgb kEmptyColour{255, 255, 255};
inline constexpr Rgb kWallColour{64, 64, 64};
inline constexpr Rgb kAgentColour{0, 0, 255};
inline constexpr Rgb kGoalColour{0, 200, 0};

struct Cell {
  int row = 0;
  int col = 0;
  bool operator==(const Cell& o) const { return row == o.row && col == o.col; }
};

struct Layout {
  int size = 0;
  Cell agent;  // the start
  Cell goal;
  std::vector<uint8_t> wall;  // size * size, row-major; 1 = wall

  bool is_wall(Cell c) const { return wall[static_cast<size_t>(c.row * size + c.col)] != 0; }
  bool inside(Cell c) const { return c.row >= 0 && c.col >= 0 && c.row < size && c.col < size; }
  int wall_count() const;
  // The split key: "5|a1,2|g4,0|w0000100..." (one digit per cell).
  std::string key() const;
};

enum class Split { kTrain, kEval };

// The stream tasks are drawn from, and the hashes of the split: <odyssey/env_util.hpp>, the
// same on every platform.
using Rng = odyssey::env::SplitMix64;
using odyssey::env::fnv1a64;
using odyssey::env::mix64;

Split split_of(const Layout& layout);
const char* split_name(Split split);

// walls must lie in [0, (size-1)^2], size >= 2.
Layout generate(int size, int walls, Rng& rng);
Layout layout_for(int size, int walls, Split split, uint64_t index);  // throws std::invalid_argument

// Moves on the shortest path from `from` to layout.goal avoiding walls; -1 when unreachable.
int shortest_path(const Layout& layout, Cell from);

// The grid as RGB8 pixels, (size * cell_pixels) square, top row first; the agent drawn at
// `agent` (over the goal when it stands there).
std::vector<uint8_t> render_rgb(const Layout& layout, Cell agent, int cell_pixels);
// The grid as text rows: '#' wall, 'A' agent, 'G' goal, '.' empty.
std::string render_text(const Layout& layout, Cell agent);

}  // namespace odyssey::gridworld
