#include "grid.h"

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <stdexcept>

namespace odyssey::gridworld {

int Layout::wall_count() const { return static_cast<int>(std::count(wall.begin(), wall.end(), uint8_t{1})); }

std::string Layout::key() const {
  std::string k = std::to_string(size) + "|a" + std::to_string(agent.row) + "," + std::to_string(agent.col) + "|g" +
                  std::to_string(goal.row) + "," + std::to_string(goal.col) + "|w";
  for (const uint8_t w : wall) k += w ? '1' : '0';
  return k;
}

Split split_of(const Layout& layout) {
  return mix64(fnv1a64(layout.key())) % kEvalModulus == 0 ? Split::kEval : Split::kTrain;
}

const char* split_name(Split split) { return split == Split::kEval ? "eval" : "train"; }

int shortest_path(const Layout& layout, Cell from) {
  const int n = layout.size;
  std::vector<int> dist(static_cast<size_t>(n * n), -1);
  std::deque<Cell> queue = {from};
  dist[static_cast<size_t>(from.row * n + from.col)] = 0;
  static constexpr int kDr[] = {-1, 1, 0, 0}, kDc[] = {0, 0, -1, 1};
  while (!queue.empty()) {
    const Cell c = queue.front();
    queue.pop_front();
    const int d = dist[static_cast<size_t>(c.row * n + c.col)];
    if (c == layout.goal) return d;
    for (int k = 0; k < 4; ++k) {
      const Cell next{c.row + kDr[k], c.col + kDc[k]};
      if (!layout.inside(next) || layout.is_wall(next)) continue;
      int& nd = dist[static_cast<size_t>(next.row * n + next.col)];
      if (nd >= 0) continue;
      nd = d + 1;
      queue.push_back(next);
    }
  }
  return -1;
}

namespace {

// Marks `count` cells chosen uniformly among those with free[i] == 1 as walls.
void place_walls(Layout& layout, const std::vector<uint8_t>& free, int count, Rng& rng) {
  std::vector<int> candidates;
  for (int i = 0; i < static_cast<int>(free.size()); ++i)
    if (free[static_cast<size_t>(i)]) candidates.push_back(i);
  std::fill(layout.wall.begin(), layout.wall.end(), uint8_t{0});
  for (int i = 0; i < count; ++i) {  // partial Fisher-Yates
    const auto j = static_cast<size_t>(rng.uniform(i, static_cast<int64_t>(candidates.size()) - 1));
    std::swap(candidates[static_cast<size_t>(i)], candidates[j]);
    layout.wall[static_cast<size_t>(candidates[static_cast<size_t>(i)])] = 1;
  }
}

}  // namespace

Layout generate(int size, int walls, Rng& rng) {
  Layout layout;
  layout.size = size;
  layout.wall.assign(static_cast<size_t>(size * size), 0);
  const auto cells = static_cast<int64_t>(size) * size;
  const auto cell = [&](int64_t i) { return Cell{static_cast<int>(i / size), static_cast<int>(i % size)}; };
  const auto index = [&](Cell c) { return static_cast<size_t>(c.row * size + c.col); };

  for (int draw = 0; draw < kLayoutDraws; ++draw) {
    layout.agent = cell(rng.uniform(0, cells - 1));
    do layout.goal = cell(rng.uniform(0, cells - 1));
    while (layout.goal == layout.agent);
    std::vector<uint8_t> free(static_cast<size_t>(cells), 1);
    free[index(layout.agent)] = free[index(layout.goal)] = 0;
    place_walls(layout, free, walls, rng);
    if (shortest_path(layout, layout.agent) >= 0) return layout;
  }

  // Dense walls: keep a random monotone path free, then place the walls around it.
  std::vector<uint8_t> free(static_cast<size_t>(cells), 1);
  Cell c = layout.agent;
  free[index(c)] = 0;
  int vertical = std::abs(layout.goal.row - c.row), horizontal = std::abs(layout.goal.col - c.col);
  const int dr = layout.goal.row > c.row ? 1 : -1, dc = layout.goal.col > c.col ? 1 : -1;
  while (vertical + horizontal > 0) {
    if (rng.uniform(1, vertical + horizontal) <= vertical) {
      c.row += dr;
      --vertical;
    } else {
      c.col += dc;
      --horizontal;
    }
    free[index(c)] = 0;
  }
  place_walls(layout, free, walls, rng);
  return layout;
}

Layout layout_for(int size, int walls, Split split, uint64_t index) {
  const uint64_t domain = fnv1a64(split == Split::kEval ? "gridworld/eval" : "gridworld/train");
  const uint64_t task_seed = mix64(domain ^ mix64(index));
  for (int attempt = 0; attempt < kMaxAttempts; ++attempt) {
    Rng rng(mix64(task_seed + static_cast<uint64_t>(attempt)));
    Layout layout = generate(size, walls, rng);
    if (split_of(layout) == split) return layout;
  }
  throw std::invalid_argument(std::string("no ") + split_name(split) + " layout found in " +
                              std::to_string(kMaxAttempts) + " draws: this config has too few layouts (raise size)");
}

std::vector<uint8_t> render_rgb(const Layout& layout, Cell agent, int cell_pixels) {
  const int n = layout.size, side = n * cell_pixels;
  std::vector<uint8_t> pixels(static_cast<size_t>(side) * static_cast<size_t>(side) * 3);
  for (int y = 0; y < side; ++y) {
    for (int x = 0; x < side; ++x) {
      const Cell c{y / cell_pixels, x / cell_pixels};
      const Rgb colour = c == agent         ? kAgentColour
                         : c == layout.goal ? kGoalColour
                         : layout.is_wall(c) ? kWallColour
                                             : kEmptyColour;
      uint8_t* p = &pixels[(static_cast<size_t>(y) * static_cast<size_t>(side) + static_cast<size_t>(x)) * 3];
      p[0] = colour.r;
      p[1] = colour.g;
      p[2] = colour.b;
    }
  }
  return pixels;
}

std::string render_text(const Layout& layout, Cell agent) {
  std::string out;
  for (int r = 0; r < layout.size; ++r) {
    if (r > 0) out += '\n';
    for (int c = 0; c < layout.size; ++c) {
      const Cell cell{r, c};
      out += cell == agent ? 'A' : cell == layout.goal ? 'G' : layout.is_wall(cell) ? '#' : '.';
    }
  }
  return out;
}

}  // namespace odyssey::gridworld
