#include "bench/learner_bench.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/types.h>
// after torch/types.h, which it needs
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#ifdef ODYSSEY_WITH_CUDA_KERNELS
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "learner/batch.h"
#include "learner/chunked_policy.h"
#include "learner/optimizer.h"
#include "learner/policy_gradient.h"
#include "model/config.h"
#include "model/policy.h"
#include "model/precision.h"

namespace odyssey::bench {

namespace {

using Clock = std::chrono::steady_clock;

double best_seconds(int repeats, const std::function<void()>& fn) {
  fn();  // warm-up
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = Clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

// LibTorch's CUDA allocator's peak since the last reset, in MB (0 on the CPU build).
double peak_gpu_mb(const at::Device& device) {
#ifdef ODYSSEY_WITH_CUDA_KERNELS
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
    return static_cast<double>(
               stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak) /
           (1024.0 * 1024.0);
  }
#endif
  (void)device;
  return 0.0;
}

void synchronize(const at::Device& device) {
#ifdef ODYSSEY_WITH_CUDA_KERNELS
  if (device.is_cuda()) c10::cuda::device_synchronize();
#endif
  (void)device;
}

double peak_rss_mb() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux: kilobytes
}

// `rows` synthetic trajectories of `length` tokens: random tokens, the second half model-written
// with log-probs near the policy's (a uniform guess), advantages alternating +1 / -1.
std::vector<learner::TrajectoryTokens> synthetic_batch(int64_t rows, int64_t length, int64_t vocab) {
  std::vector<learner::TrajectoryTokens> out(static_cast<size_t>(rows));
  const at::Tensor tokens = at::randint(0, 256, {rows, length}, at::kInt);
  auto acc = tokens.accessor<int32_t, 2>();
  for (int64_t r = 0; r < rows; ++r) {
    auto& t = out[static_cast<size_t>(r)];
    t.id = static_cast<uint64_t>(r + 1);
    t.advantage = r % 2 == 0 ? 1.0 : -1.0;
    for (int64_t p = 0; p < length; ++p) {
      t.tokens.push_back(acc[r][p]);
      t.logprobs.push_back(-std::log(static_cast<float>(vocab)));
      t.loss_mask.push_back(p >= length / 2 ? 1 : 0);
    }
  }
  return out;
}

// The kind of a device kernel, from its name (for the profile's summary).
const char* kernel_kind(const std::string& name) {
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if (has("kda")) return "KDA kernels";
  if (has("moe") || has("situ") || has("router")) return "MoE kernels";
  if (has("gemm") || has("Gemm") || has("cutlass") || has("xmma") || has("nvjet") || has("wgmma") || has("cublas"))
    return "cuBLAS / CUTLASS GEMMs";
  if (has("flash") || has("fmha") || has("attention")) return "fused attention";
  if (has("Memcpy") || has("Memset") || has("memcpy") || has("memset")) return "copies and fills";
  if (has("reduce") || has("Reduce") || has("norm")) return "reductions";
  if (has("multi_tensor") || has("foreach") || has("fused_adam")) return "optimizer and clipping (multi-tensor)";
  if (has("elementwise") || has("vectorized") || has("unrolled") || has("Elementwise")) return "elementwise";
  if (has("index") || has("gather") || has("scatter") || has("Index")) return "index, gather, scatter";
  return "other";
}

// An event's duration in ns: durationNs() where LibTorch has it (2.x), else durationUs() (1.13).
template <typename Event>
auto event_ns(const Event& e, int) -> decltype(static_cast<double>(e.durationNs())) {
  return static_cast<double>(e.durationNs());
}
template <typename Event>
double event_ns(const Event& e, long) {
  return static_cast<double>(e.durationUs()) * 1e3;
}

// One call of `step` under LibTorch's profiler (Kineto): the Chrome trace to `path`, and a summary
// to stdout. On a GPU: the device's kernels by total time and by kind, and their sum against the
// step's wall time (how busy the device was; the rest is the host's launches and syncs). On the
// CPU: the operators by total time (inclusive of what they call).
Status profile_step(const std::function<void()>& step, bool cuda, const std::string& path) {
  namespace prof = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  std::set<ActivityType> activities{ActivityType::CPU};
  if (cuda) activities.insert(ActivityType::CUDA);
  const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
  std::unique_ptr<prof::ProfilerResult> result;
  double wall_s = 0;
  try {
    prof::prepareProfiler(config, activities);
    prof::enableProfiler(config, activities);
    const auto t0 = Clock::now();
    step();
    wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
    result = prof::disableProfiler();
  } catch (const c10::Error& e) {
    return make_status(StatusCode::kFailedPrecondition, "bench learner --profile {}: LibTorch's profiler failed: {}", path,
                       e.what_without_backtrace());
  }
  struct Total {
    double us = 0;
    int64_t count = 0;
  };
  std::map<std::string, Total> by_name, by_kind;
  double device_us = 0;
  for (const auto& e : result->events()) {
    if ((e.deviceType() == c10::DeviceType::CUDA) != cuda) continue;
    const double us = event_ns(e, 0) * 1e-3;
    Total& t = by_name[e.name()];
    t.us += us;
    ++t.count;
    if (cuda) {
      Total& k = by_kind[kernel_kind(e.name())];
      k.us += us;
      ++k.count;
      device_us += us;
    }
  }
  auto print_top = [](const std::map<std::string, Total>& totals, size_t n) {
    std::vector<std::pair<std::string, Total>> rows(totals.begin(), totals.end());
    std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.us > b.second.us; });
    for (size_t i = 0; i < std::min(n, rows.size()); ++i) {
      std::string name = rows[i].first;
      if (name.size() > 110) name = name.substr(0, 107) + "...";
      std::printf("  %10.3f ms %7ld  %s\n", rows[i].second.us * 1e-3, static_cast<long>(rows[i].second.count),
                  name.c_str());
    }
  };
  std::string written = "trace written to " + path;
  try {
    result->save(path);
  } catch (const c10::Error& e) {
    // Debian's LibTorch 1.13 is built without Kineto: the summary works, the trace file does not.
    written = fmt::format("no trace written ({})", e.what_without_backtrace());
    written = written.substr(0, written.find('\n'));
  }
  std::printf("profile of one more step: %.3f s wall, %s\n", wall_s, written.c_str());
  if (cuda) {
    int64_t kernels = 0;
    for (const auto& k : by_kind) kernels += k.second.count;
    std::printf("device time in kernels and copies: %.3f s over %ld launches, %.0f%% of the step's wall time\n",
                device_us * 1e-6, static_cast<long>(kernels), 100.0 * device_us * 1e-6 / wall_s);
    std::printf("by kind (total, launches):\n");
    print_top(by_kind, by_kind.size());
    std::printf("the 30 longest kernels by total time (total, launches):\n");
    print_top(by_name, 30);
  } else {
    std::printf("the 30 longest operators by total time, inclusive of what they call (total, calls):\n");
    print_top(by_name, 30);
  }
  return Status::Ok();
}

}  // namespace

Result<LearnerBenchResult> run_learner_bench(const LearnerBenchOptions& o) {
  if (!o.profile_path.empty() && o.long_tokens <= 0)
    return invalid_argument("bench learner: --profile needs --long N (it profiles one step on that trajectory)");
  if (o.repeats < 1 || o.batch_tokens < 2 || o.chunk_tokens < 16 || o.lengths.empty())
    return invalid_argument("bench learner: need repeats >= 1, batch_tokens >= 2, chunk_tokens >= 16 and a length");
  for (int64_t length : o.lengths) {
    if (length < 2) return invalid_argument("bench learner: --lengths: {} is too short (a length is at least 2 tokens)", length);
  }
  const Result<model::Float32MatmulPrecision> precision = model::parse_float32_matmul_precision(o.float32_matmul_precision);
  if (!precision.ok()) return invalid_argument("bench learner: --float32-matmul-precision: {}", precision.status().message());
  at::set_num_threads(std::max(1, o.threads));
  if (o.device != "cpu" && o.device.rfind("cuda", 0) != 0)
    return invalid_argument("bench learner: --device must be cpu or cuda[:N], got '{}'", o.device);
  ODY_ASSIGN_OR_RETURN(auto cfg, model::load_model_config({o.model_config}));
  const model::Float32MatmulPrecisionScope precision_scope(*precision);
  const at::Device device(o.device);
  if (device.is_cuda() && !at::hasCUDA())
    return invalid_argument("bench learner: --device {} needs the GPU build on a machine with a GPU", o.device);
  at::manual_seed(0);
  model::Policy policy(cfg);
  policy->to(device);
  policy->train();
  learner::ChunkedPolicy runner(policy);
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& p : policy->named_parameters()) named.emplace_back(p.key(), p.value());
  std::vector<at::Tensor> params;
  for (auto& p : named) params.push_back(p.second);
  learner::AdamW adamw(named, learner::AdamWOptions{1e-5, 0.9, 0.95, 1e-8, 0.0});
  learner::PolicyGradientOptions pgo;
  pgo.chunk_tokens = o.chunk_tokens;
  pgo.recompute = o.recompute;
  pgo.kda_keep_chunk_states = o.kda_keep_chunk_states;
  pgo.device = device;

  // The learner's step compute on `batch`. Given `phases`, each phase is timed to its end on the
  // device: [0] the policy gradient (forward and backward), [1] clipping, [2] the optimizer.
  auto learner_step = [&](const std::vector<learner::TrajectoryTokens>& batch, double* phases = nullptr) {
    auto t = Clock::now();
    auto lap = [&](int i) {
      if (phases == nullptr) return;
      synchronize(device);
      const auto now = Clock::now();
      phases[i] = std::chrono::duration<double>(now - t).count();
      t = now;
    };
    for (auto& p : params) p.mutable_grad() = at::Tensor();
    learner::accumulate_policy_gradient(runner, nullptr, batch, {}, pgo);
    lap(0);
    learner::clip_grad_norm(params, 1.0);
    lap(1);
    adamw.step(1e-5);
    lap(2);
    synchronize(device);
  };

  std::printf("model %s (%s) on %s, %d thread(s), chunk_tokens %ld, recompute %s, kda_keep_chunk_states %s, "
              "float32_matmul_precision %s\n",
              cfg.name.c_str(), o.model_config.c_str(), o.device.c_str(), std::max(1, o.threads),
              static_cast<long>(o.chunk_tokens), o.recompute ? "on" : "off", o.kda_keep_chunk_states ? "on" : "off",
              model::float32_matmul_precision_name(*precision));
  LearnerBenchResult result;
  if (o.long_tokens > 0) {
    const auto batch = synthetic_batch(1, o.long_tokens, cfg.vocab_size);
    const double rss_before = peak_rss_mb();
    // The first step (which also pays for the process's first launches and allocations), then the
    // best of --repeats - 1 more where asked.
    double phases[3] = {0, 0, 0}, best_phases[3] = {0, 0, 0};
    auto timed_step = [&] {
      const auto t0 = Clock::now();
      learner_step(batch, phases);
      return std::chrono::duration<double>(Clock::now() - t0).count();
    };
    const double first = timed_step();
    double secs = first;
    std::copy(phases, phases + 3, best_phases);
    for (int i = 1; i < o.repeats; ++i) {
      const double s = timed_step();
      if (i == 1 || s < secs) {
        secs = s;
        std::copy(phases, phases + 3, best_phases);
      }
    }
    result.learner_tokens_per_s = static_cast<double>(o.long_tokens) / secs;
    std::printf("one trajectory of %ld tokens (%ld trained): one learner step in %.2f s (%s), peak RSS %.0f MB (%.0f MB "
                "before)\n",
                static_cast<long>(o.long_tokens), static_cast<long>(batch[0].trained_tokens()), secs,
                o.repeats > 1 ? fmt::format("best of {} after the first, which took {:.2f} s", o.repeats - 1, first).c_str()
                              : "the first",
                peak_rss_mb(), rss_before);
    std::printf("its phases: policy gradient (forward and backward) %.3f s, gradient clipping %.3f s, optimizer %.3f s\n",
                best_phases[0], best_phases[1], best_phases[2]);
    // The two phases alone against their baselines, on the step's gradients: the per-parameter
    // AdamW (the same update in eight LibTorch passes a parameter) and LibTorch's clip_grad_norm_.
    auto best_of_3 = [&](const std::function<void()>& f) {
      return best_seconds(3, [&] {
        f();
        synchronize(device);
      });
    };
    const double fused_s = best_of_3([&] { adamw.step(1e-5); });
    adamw.set_fused(false);
    const double per_parameter_s = best_of_3([&] { adamw.step(1e-5); });
    adamw.set_fused(true);
    const double clip_s = best_of_3([&] { learner::clip_grad_norm(params, 1.0); });
    const double torch_clip_s = best_of_3([&] { torch::nn::utils::clip_grad_norm_(params, 1.0); });
    std::printf("optimizer step alone: %.2f ms, per-parameter form %.2f ms (%.2fx); gradient clipping alone: %.2f ms, "
                "torch::nn::utils::clip_grad_norm_ %.2f ms (%.2fx)\n",
                fused_s * 1e3, per_parameter_s * 1e3, per_parameter_s / fused_s, clip_s * 1e3, torch_clip_s * 1e3,
                torch_clip_s / clip_s);
    if (device.is_cuda()) std::printf("peak GPU memory (LibTorch allocator): %.0f MB\n", peak_gpu_mb(device));
    if (!o.profile_path.empty())
      ODY_RETURN_IF_ERROR(profile_step([&] { learner_step(batch); }, device.is_cuda(), o.profile_path));
    std::printf("learner_long_tokens_per_s: %.1f\n", result.learner_tokens_per_s);
    return result;
  }

  torch::optim::AdamW reference_adamw(policy->parameters(), torch::optim::AdamWOptions(1e-5).weight_decay(0));
  std::printf("%8s %6s %16s %16s %8s\n", "length", "rows", "learner tok/s", "reference tok/s", "ratio");
  for (int64_t length : o.lengths) {
    const int64_t rows = std::max<int64_t>(1, o.batch_tokens / length);
    const auto batch = synthetic_batch(rows, length, cfg.vocab_size);
    const double tokens = static_cast<double>(rows * length);
    const double learner_s = best_seconds(o.repeats, [&] { learner_step(batch); });

    // Plain LibTorch: one whole-sequence forward, the same token-mean policy-gradient loss.
    at::Tensor tok = at::zeros({rows, length}, at::kLong), adv = at::zeros({rows, 1}), mask = at::zeros({rows, length});
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t p = 0; p < length; ++p) {
        tok[r][p] = batch[static_cast<size_t>(r)].tokens[static_cast<size_t>(p)];
        mask[r][p] = p >= 1 && batch[static_cast<size_t>(r)].loss_mask[static_cast<size_t>(p)] ? 1.0 : 0.0;
      }
      adv[r][0] = batch[static_cast<size_t>(r)].advantage;
    }
    const at::Tensor inputs = tok.narrow(1, 0, length - 1).to(device), targets = tok.narrow(1, 1, length - 1).to(device);
    const at::Tensor m = mask.narrow(1, 1, length - 1).to(device);
    adv = adv.to(device);
    const double reference_s = best_seconds(o.repeats, [&] {
      reference_adamw.zero_grad();
      const at::Tensor logp =
          at::log_softmax(policy->forward(inputs), -1).gather(2, targets.unsqueeze(2)).squeeze(2);
      const at::Tensor loss = -(adv * logp * m).sum() / m.sum();
      loss.backward();
      torch::nn::utils::clip_grad_norm_(policy->parameters(), 1.0);
      reference_adamw.step();
      synchronize(device);
    });
    result.learner_tokens_per_s = tokens / learner_s;
    result.reference_tokens_per_s = tokens / reference_s;
    std::printf("%8ld %6ld %16.0f %16.0f %8.2f\n", static_cast<long>(length), static_cast<long>(rows),
                result.learner_tokens_per_s, result.reference_tokens_per_s, reference_s / learner_s);
  }
  std::printf("peak RSS %.0f MB\n", peak_rss_mb());
  std::printf("learner_tokens_per_s: %.1f\n", result.learner_tokens_per_s);
  return result;
}

}  // namespace odyssey::bench
