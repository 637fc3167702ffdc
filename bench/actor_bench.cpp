#include "bench/actor_bench.h"

#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <numeric>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "model/config.h"
#include "model/policy.h"

namespace odyssey::bench {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double peak_rss_mb() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;
}

std::string context_label(int64_t n) {
  if (n >= (1 << 20) && n % (1 << 20) == 0) return std::to_string(n >> 20) + "m";
  if (n >= 1024 && n % 1024 == 0) return std::to_string(n >> 10) + "k";
  return std::to_string(n);
}

// Extends every MLA cache of `state` to `length` tokens by repeating its rows, with room for
// `extra` more (so the decode steps that follow never regrow it).
void tile_mla_caches(model::PolicyState& state, int64_t length, int64_t extra) {
  for (model::MlaCache& cache : state.mla) {
    if (!cache.latent.defined() || cache.length >= length) continue;
    TORCH_CHECK(cache.length > 0, "bench actor: an MLA cache to extend must hold some tokens");
    cache.reserve(length + extra);
    while (cache.length < length) {
      const int64_t n = std::min(cache.length, length - cache.length);
      cache.append(cache.latent.narrow(1, 0, n));  // rows [0, n) into [length, length + n): disjoint
    }
  }
}

double mla_cache_mb(const model::PolicyState& state) {
  double bytes = 0;
  for (const model::MlaCache& cache : state.mla)
    if (cache.latent.defined())
      bytes += static_cast<double>(cache.length) * cache.width() * static_cast<double>(cache.latent.element_size());
  return bytes / (1024.0 * 1024.0);
}

// Process CPU seconds (all threads): what the work cost, whatever else runs on the machine.
double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

double current_rss_mb() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1024.0 * 1024.0);
}

// One variant's policy and the state of its one sequence.
struct Subject {
  std::string name;
  model::Policy policy{nullptr};
  model::PolicyState state;
  int64_t real = 0;  // tokens the state really consumed (prefill and decode steps)
  double first_chunk_per_token = 0, last_chunk_per_token = 0;
  int64_t last_chunk_context = 0;

  Subject(std::string n, const model::ModelConfig& config, int64_t reserve) : name(std::move(n)) {
    at::manual_seed(0);
    policy = model::Policy(config);
    policy->eval();
    state = policy->initial_state(1, reserve);
  }

  // Real prefill up to `target` tokens, then MLA caches extended to `context` (room for
  // `extra` more). Returns the prefill seconds.
  double fill(int64_t target, int64_t context, int64_t chunk, int64_t extra) {
    const auto t0 = Clock::now();
    while (state.tokens < target) {
      const int64_t n = std::min(chunk, target - state.tokens);
      const auto c0 = Clock::now();
      (void)policy->forward_chunk(at::randint(0, 256, {1, n}, at::kLong), state);
      real += n;
      const double per_token = seconds_since(c0) / static_cast<double>(n);
      if (first_chunk_per_token == 0) first_chunk_per_token = per_token;
      last_chunk_per_token = per_token;
      last_chunk_context = state.tokens;
    }
    const double s = seconds_since(t0);
    if (state.tokens < context) {
      tile_mla_caches(state, context, extra);
      state.tokens = context;
    }
    return s;
  }

  // `n` decode steps: {wall seconds, process CPU seconds}.
  std::pair<double, double> decode(int64_t n) {
    const auto t0 = Clock::now();
    const double c0 = cpu_seconds();
    for (int64_t i = 0; i < n; ++i) (void)policy->step(at::randint(0, 256, {1}, at::kLong), state);
    real += n;
    return {seconds_since(t0), cpu_seconds() - c0};
  }

  // A real prefill costs a + b * position per token (MLA attention over the cache grows
  // linearly): a and b from the first and last measured chunks, summed up to `n` tokens.
  double prefill_estimate(int64_t n, int64_t chunk) const {
    if (last_chunk_context <= chunk || last_chunk_per_token <= first_chunk_per_token) return 0;
    const double b =
        (last_chunk_per_token - first_chunk_per_token) / static_cast<double>(last_chunk_context - chunk);
    const auto x = static_cast<double>(n);
    return first_chunk_per_token * x + b * x * x / 2;
  }
};

}  // namespace

Result<ActorBenchResult> run_actor_bench(const ActorBenchOptions& o) {
  if (o.contexts.empty() || o.decode < 1 || o.chunk < 1 || o.real_prefill < 1 || o.warmup < 0 || o.repeats < 1)
    return invalid_argument("bench actor: need contexts, decode >= 1, repeats >= 1, chunk >= 1, real-prefill >= 1");
  for (size_t i = 0; i < o.contexts.size(); ++i)
    if (o.contexts[i] < 1 || (i > 0 && o.contexts[i] <= o.contexts[i - 1]))
      return invalid_argument("bench actor: contexts must be positive and ascending");
  ODY_ASSIGN_OR_RETURN(model::ModelConfig hybrid, model::load_model_config({o.model_config}));
  if (o.threads > 0) at::set_num_threads(o.threads);
  model::ModelConfig all_mla = hybrid;
  all_mla.mla_layers.resize(static_cast<size_t>(hybrid.num_layers));
  std::iota(all_mla.mla_layers.begin(), all_mla.mla_layers.end(), int64_t{1});
  all_mla.name = hybrid.name + "-all-mla";

  std::printf("bench actor: %s (hidden %ld, %ld layers: %ld KDA + %ld MLA) vs all-MLA (%ld MLA), fp32, CPU, %d "
              "thread(s)\n",
              o.model_config.c_str(), static_cast<long>(hybrid.hidden_size), static_cast<long>(hybrid.num_layers),
              static_cast<long>(hybrid.num_kda_layers()), static_cast<long>(hybrid.num_mla_layers()),
              static_cast<long>(all_mla.num_layers), at::get_num_threads());
  std::printf("one sequence; decode: best of %d runs of %ld steps after %ld warm-up; contexts beyond %s: real prefill "
              "of %s, MLA caches extended by repeating rows (decode cost depends only on the cache length)\n",
              o.repeats, static_cast<long>(o.decode), static_cast<long>(o.warmup), context_label(o.real_prefill).c_str(),
              context_label(o.real_prefill).c_str());
  std::printf("%-8s %8s  %-22s %10s %14s %14s %12s %10s\n", "variant", "context", "filled by", "prefill_s",
              "decode_tok/s", "cpu_tok/s", "mla_cache_MB", "rss_MB");
  ActorBenchResult result;
  std::vector<ActorBenchRow> hybrid_rows, mla_rows;
  double cpu_ratio_last = 0;
  std::unique_ptr<Subject> h, m;
  try {
    c10::NoGradGuard no_grad;
    const int64_t decoded_per_row = o.warmup + o.repeats * o.decode;
    const int64_t reserve = std::min(o.contexts.back(), o.real_prefill) + decoded_per_row + 16;
    h = std::make_unique<Subject>("hybrid", hybrid, reserve);
    m = std::make_unique<Subject>("all-mla", all_mla, reserve);
    for (int64_t context : o.contexts) {
      const int64_t target = std::min(context, o.real_prefill);
      ActorBenchRow hr{"hybrid", context}, mr{"all-mla", context};
      hr.prefill_s = h->fill(target, context, o.chunk, decoded_per_row + 16);
      mr.prefill_s = m->fill(target, context, o.chunk, decoded_per_row + 16);
      hr.real_tokens = std::min(h->real, context);
      mr.real_tokens = std::min(m->real, context);
      hr.mla_cache_mb = mla_cache_mb(h->state);
      mr.mla_cache_mb = mla_cache_mb(m->state);
      // Decode, interleaved so both variants see the same machine load; best run of each.
      (void)h->decode(o.warmup);
      (void)m->decode(o.warmup);
      double h_wall = 1e30, m_wall = 1e30, h_cpu = 1e30, m_cpu = 1e30;
      for (int r = 0; r < o.repeats; ++r) {
        const auto [hw, hc] = h->decode(o.decode);
        const auto [mw, mc] = m->decode(o.decode);
        h_wall = std::min(h_wall, hw);
        m_wall = std::min(m_wall, mw);
        h_cpu = std::min(h_cpu, hc);
        m_cpu = std::min(m_cpu, mc);
      }
      hr.decode_tokens_per_s = static_cast<double>(o.decode) / h_wall;
      mr.decode_tokens_per_s = static_cast<double>(o.decode) / m_wall;
      cpu_ratio_last = m_cpu / h_cpu;
      for (const ActorBenchRow* row : {&hr, &mr}) {
        const double cpu_s = row == &hr ? h_cpu : m_cpu;
        std::printf("%-8s %8s  %-22s %10.2f %14.1f %14.1f %12.1f %10.0f\n", row->variant.c_str(),
                    context_label(context).c_str(),
                    row->real_tokens == context ? "real prefill"
                                                : ("real " + context_label(row->real_tokens) + " + tiled").c_str(),
                    row->prefill_s, row->decode_tokens_per_s, static_cast<double>(o.decode) / cpu_s,
                    row->mla_cache_mb, current_rss_mb());
      }
      std::fflush(stdout);
      hybrid_rows.push_back(hr);
      mla_rows.push_back(mr);
    }
  } catch (const c10::Error& e) {
    return Status(StatusCode::kInternal, fmt::format("bench actor: {}", e.what_without_backtrace()));
  }
  result.rows = hybrid_rows;
  result.rows.insert(result.rows.end(), mla_rows.begin(), mla_rows.end());
  result.peak_rss_mb = peak_rss_mb();
  double kda_state_kb = 0;
  for (const model::KdaState& k : h->state.kda)
    if (k.recurrent.defined())
      for (const at::Tensor& t : {k.recurrent, k.q_conv_inputs, k.k_conv_inputs, k.v_conv_inputs})
        kda_state_kb += static_cast<double>(t.numel() * t.element_size()) / 1024.0;
  std::printf("state of one sequence at %s: hybrid KDA states %.1f KB (constant) + MLA caches %.1f MB; all-MLA caches "
              "%.1f MB\n",
              context_label(o.contexts.back()).c_str(), kda_state_kb, hybrid_rows.back().mla_cache_mb,
              mla_rows.back().mla_cache_mb);
  std::printf("peak rss: %.1f MB (whole process, both variants' states live together)\n", result.peak_rss_mb);
  const double estimate_h = h->prefill_estimate(o.contexts.back(), o.chunk);
  const double estimate_m = m->prefill_estimate(o.contexts.back(), o.chunk);
  if (estimate_h > 0 && o.contexts.back() > o.real_prefill) {
    std::printf("a real prefill to %s (not run) would take about %.1f h (hybrid) and %.1f h (all-MLA) here, "
                "extrapolated from the measured chunks (MLA attention makes it quadratic)\n",
                context_label(o.contexts.back()).c_str(), estimate_h / 3600, estimate_m / 3600);
  }
  std::printf("decode cpu-time ratio at %s (all-MLA CPU seconds / hybrid's, load-independent): %.2f\n",
              context_label(o.contexts.back()).c_str(), cpu_ratio_last);
  const size_t n = o.contexts.size();
  for (size_t i = 0; i < n; ++i) {
    const double ratio = hybrid_rows[i].decode_tokens_per_s / mla_rows[i].decode_tokens_per_s;
    std::printf("decode_speedup_vs_mla_%s: %.2f\n", context_label(o.contexts[i]).c_str(), ratio);
    result.speedup_last = ratio;
  }
  std::fflush(stdout);
  return result;
}

}  // namespace odyssey::bench
