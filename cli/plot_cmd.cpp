// odyssey plot DIR: the run's curves (DIR/metrics.jsonl, written by `odyssey run`) as one PNG,
// DIR/curves.png by default: reward and success (training and held-out eval), policy lag,
// throughput (actors' and learner's tokens/s) — against minutes since the run's first line.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "cli/commands.h"
#include "core/png.h"

namespace odyssey::cli {

namespace {

struct Series {
  std::string label;
  Rgb color;
  std::vector<std::pair<double, double>> points;  // (minutes, value)
};

struct Panel {
  std::string title;
  std::vector<Series> series;
};

std::string tick_text(double v) {
  const double a = std::abs(v);
  if (a >= 1e6) return fmt::format("{:.1f}M", v / 1e6);
  if (a >= 1e3) return fmt::format("{:.1f}K", v / 1e3);
  if (a >= 10 || v == 0) return fmt::format("{:.0f}", v);
  return fmt::format("{:.2f}", v);
}

void draw_panel(Canvas& c, const Panel& p, int x0, int y0, int w, int h) {
  const Rgb ink{40, 40, 40}, grid{225, 225, 225};
  c.text(x0 + 8, y0 + 6, p.title, ink, 2);
  const int left = x0 + 60, right = x0 + w - 16, top = y0 + 32, bottom = y0 + h - 44;
  double xmin = std::numeric_limits<double>::infinity(), xmax = -xmin, ymin = xmin, ymax = -xmin;
  for (const auto& s : p.series) {
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(y)) continue;
      xmin = std::min(xmin, x), xmax = std::max(xmax, x), ymin = std::min(ymin, y), ymax = std::max(ymax, y);
    }
  }
  c.rect(left, top, right, bottom, ink);
  if (!std::isfinite(xmin)) {
    c.text(left + 12, top + 12, "no data yet", ink);
    return;
  }
  if (xmax - xmin < 1e-9) xmax = xmin + 1;
  if (ymax - ymin < 1e-9) ymax = ymin + (std::abs(ymin) > 0 ? std::abs(ymin) * 0.1 : 1);
  const double pad = (ymax - ymin) * 0.05;
  ymin -= pad, ymax += pad;
  auto px = [&](double x) { return left + (x - xmin) / (xmax - xmin) * (right - left); };
  auto py = [&](double y) { return bottom - (y - ymin) / (ymax - ymin) * (bottom - top); };
  for (int i = 0; i <= 4; ++i) {
    const double yv = ymin + (ymax - ymin) * i / 4, xv = xmin + (xmax - xmin) * i / 4;
    const int gy = static_cast<int>(py(yv)), gx = static_cast<int>(px(xv));
    if (i > 0 && i < 4) {
      c.line(left + 1, gy, right - 1, gy, grid);
      c.line(gx, top + 1, gx, bottom - 1, grid);
    }
    const std::string yt = tick_text(yv), xt = tick_text(xv);
    c.text(left - 6 - Canvas::text_width(yt), gy - 3, yt, ink);
    c.text(gx - Canvas::text_width(xt) / 2, bottom + 6, xt, ink);
  }
  c.text((left + right) / 2 - Canvas::text_width("minutes") / 2, bottom + 20, "minutes", ink);
  int legend_x = left + 8;
  for (const auto& s : p.series) {
    for (size_t i = 1; i < s.points.size(); ++i) {
      const auto [xa, ya] = s.points[i - 1];
      const auto [xb, yb] = s.points[i];
      c.line(px(xa), py(ya), px(xb), py(yb), s.color, 2);
    }
    if (s.points.size() == 1) c.fill(px(s.points[0].first) - 2, py(s.points[0].second) - 2,
                                     px(s.points[0].first) + 2, py(s.points[0].second) + 2, s.color);
    c.fill(legend_x, top + 8, legend_x + 10, top + 14, s.color);
    legend_x += 16 + c.text(legend_x + 14, top + 8, s.label, ink) + 10;
  }
}

int run_plot(const std::string& dir, std::string out) {
  const std::string path = dir + "/metrics.jsonl";
  std::ifstream in(path);
  if (!in) {
    spdlog::error("plot: cannot read {} (is {} the --out of an `odyssey run`?)", path, dir);
    return 1;
  }
  const Rgb blue{31, 119, 180}, orange{255, 127, 14}, green{44, 160, 44}, red{214, 39, 40}, purple{148, 103, 189};
  Panel reward{"reward", {{"train reward", blue, {}}, {"eval reward", orange, {}}}};
  Panel success{"success rate", {{"train", blue, {}}, {"held-out eval", green, {}}}};
  Panel lag{"policy lag (versions)", {{"mean", purple, {}}, {"max", red, {}}}};
  Panel speed{"throughput (tokens/s)", {{"actors", green, {}}, {"learner", blue, {}}}};
  std::map<std::string, double> actor_rates;  // latest per actor, summed at each actor line
  double t0 = std::numeric_limits<double>::quiet_NaN();
  std::string line;
  size_t lines = 0, bad = 0;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("time") || !j["time"].is_number()) {
      ++bad;
      continue;
    }
    ++lines;
    const double t = j["time"].get<double>();
    if (std::isnan(t0)) t0 = t;
    const double m = (t - t0) / 60.0;
    auto num = [&](const char* k) {
      return j.contains(k) && j[k].is_number() ? j[k].get<double>() : std::numeric_limits<double>::quiet_NaN();
    };
    auto add = [&](Series& s, double v) {
      if (std::isfinite(v)) s.points.push_back({m, v});
    };
    const std::string role = j.value("role", "");
    if (role == "learner") {
      add(reward.series[0], num("reward_mean"));
      add(success.series[0], num("success_rate"));
      add(lag.series[0], num("policy_lag_mean"));
      add(lag.series[1], num("policy_lag_max"));
      add(speed.series[1], num("tokens_per_s"));
    } else if (role == "eval") {
      add(reward.series[1], num("eval_reward"));
      add(success.series[1], num("eval_success"));
    } else if (role.rfind("actor", 0) == 0 && std::isfinite(num("tokens_per_s"))) {
      actor_rates[role] = num("tokens_per_s");
      double sum = 0;
      for (const auto& [name, v] : actor_rates) sum += v;
      add(speed.series[0], sum);
    }
  }
  if (out.empty()) out = dir + "/curves.png";
  const int panel_w = 640, panel_h = 360;
  Canvas canvas(panel_w * 2, panel_h * 2 + 30);
  canvas.text(12, 8, fmt::format("odyssey run {}  ({} metric lines)", dir, lines), {0, 0, 0}, 2);
  const Panel* panels[] = {&reward, &success, &lag, &speed};
  for (int i = 0; i < 4; ++i) draw_panel(canvas, *panels[i], (i % 2) * panel_w, 30 + (i / 2) * panel_h, panel_w, panel_h);
  const Status st = write_png(out, canvas);
  if (!st.ok()) {
    spdlog::error("plot: {}", st.to_string());
    return 1;
  }
  std::printf("plot: %zu metric lines%s -> %s\n", lines, bad ? fmt::format(" ({} unreadable lines skipped)", bad).c_str() : "",
              out.c_str());
  return 0;
}

}  // namespace

void add_plot_commands(CLI::App& app, Action& action) {
  static std::string dir, out;
  auto* plot = app.add_subcommand("plot", "draw a run's curves (reward, success, policy lag, throughput) to a PNG");
  plot->add_option("dir", dir, "the run's output directory (holds metrics.jsonl)")->required();
  plot->add_option("-o,--output", out, "PNG to write (default DIR/curves.png)");
  plot->callback([&action] { action = [] { return run_plot(dir, out); }; });
}

}  // namespace odyssey::cli
