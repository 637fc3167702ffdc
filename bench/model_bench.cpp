#include "bench/model_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>

#include <ATen/ATen.h>
#include <torch/types.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include "model/config.h"
#include "model/policy.h"

namespace odyssey::bench {

namespace {

using Clock = std::chrono::steady_clock;

at::Device g_device = at::kCPU;

// Waits for the device's queued work: a copy to the host follows everything queued before it.
void sync() {
  if (!g_device.is_cpu()) at::zeros({1}, at::TensorOptions().device(g_device)).cpu();
}

// Best wall time of `repeats` runs of `fn`, after one warm-up run.
double best_seconds(int repeats, const std::function<void()>& fn) {
  fn();
  sync();
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = Clock::now();
    fn();
    sync();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

void row(const char* layer, const char* form, int64_t tokens, double secs) {
  std::printf("%-6s %-30s %8ld tokens  %9.3f ms  %12.0f tokens/s\n", layer, form, static_cast<long>(tokens),
              secs * 1e3, tokens / secs);
}

}  // namespace

Result<ModelBenchResult> run_model_bench(const ModelBenchOptions& options) {
  ModelBenchOptions o = options;
  if (o.train_tokens == 0) o.train_tokens = std::min<int64_t>(512, o.sequence - 1);
  if (o.sequence < 2 || o.chunk < 1 || o.repeats < 1 || o.decode < 1 || o.decode > o.sequence ||
      o.train_tokens < 1 || o.train_tokens >= o.sequence || o.kda_tokens < 1) {
    return invalid_argument(
        "need sequence >= 2, chunk >= 1, repeats >= 1, 1 <= decode <= sequence and "
        "1 <= train-tokens < sequence (got sequence {}, chunk {}, repeats {}, decode {}, train-tokens {})",
        o.sequence, o.chunk, o.repeats, o.decode, o.train_tokens);
  }
  ODY_ASSIGN_OR_RETURN(auto cfg, model::load_model_config({o.model_config}));
  at::ScalarType dtype = at::kFloat;
  if (o.dtype == "bf16") {
    dtype = at::kBFloat16;
  } else if (o.dtype != "fp32") {
    return invalid_argument("--dtype must be fp32 or bf16, got '{}'", o.dtype);
  }
  try {
    g_device = at::Device(o.device);
  } catch (const c10::Error&) {
    return invalid_argument("--device '{}' is not a device LibTorch knows (cpu, cuda, cuda:1)", o.device);
  }
  if (g_device.is_cuda() && !at::hasCUDA()) {
    return invalid_argument("--device {} but this LibTorch build has no CUDA device", o.device);
  }
  const auto opts = at::TensorOptions().device(g_device).dtype(dtype);
  const auto index_opts = at::TensorOptions().device(g_device).dtype(at::kLong);
  torch::NoGradGuard no_grad;
  at::manual_seed(0);
  const int64_t d = cfg.hidden_size;
  std::printf("bench model: %s (d=%ld) on %s in %s, %d CPU threads; best of %d\n", o.model_config.c_str(),
              static_cast<long>(d), g_device.str().c_str(), o.dtype.c_str(), at::get_num_threads(), o.repeats);
  const at::Tensor x = at::randn({1, o.sequence, d}, opts);

  // --- the whole policy in its three forms, then one training step ---
  {
    model::Policy policy(cfg);
    policy->to(g_device, dtype);
    const at::Tensor tokens = at::randint(0, cfg.vocab_size, {1, o.sequence}, index_opts);
    row("policy", "parallel (whole sequence)", o.sequence, best_seconds(o.repeats, [&] { policy->forward(tokens); }));
    row("policy", "chunk by chunk, state carried", o.sequence, best_seconds(o.repeats, [&] {
          auto state = policy->initial_state(1, o.sequence);
          for (int64_t t = 0; t < o.sequence; t += o.chunk)
            policy->forward_chunk(tokens.narrow(1, t, std::min(o.chunk, o.sequence - t)), state);
        }));
    row("policy", "one token at a time", o.decode, best_seconds(o.repeats, [&] {
          auto state = policy->initial_state(1, o.decode);
          for (int64_t t = 0; t < o.decode; ++t) policy->step(tokens.select(1, t), state);
        }));
    // A training step: forward, next-token cross-entropy, backward, AdamW update.
    torch::AutoGradMode grad(true);
    torch::optim::AdamW adamw(policy->parameters(), torch::optim::AdamWOptions(1e-3));
    const at::Tensor inputs = tokens.narrow(1, 0, o.train_tokens), targets = tokens.narrow(1, 1, o.train_tokens);
    row("policy", "training step (fwd+bwd+AdamW)", o.train_tokens, best_seconds(o.repeats, [&] {
          adamw.zero_grad();
          const at::Tensor logits = policy->forward(inputs);
          at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1})).backward();
          adamw.step();
        }));
  }

  // --- KDA layer in its three forms ---
  model::IncrementalAttention kda(model::kda_options(cfg));
  kda->to(g_device, dtype);
  row("kda", "parallel (chunked form)", o.sequence, best_seconds(o.repeats, [&] { kda->forward(x); }));
  row("kda", "chunk by chunk, state carried", o.sequence, best_seconds(o.repeats, [&] {
        auto state = kda->initial_state(1);
        for (int64_t t = 0; t < o.sequence; t += o.chunk)
          kda->forward_chunk(x.narrow(1, t, std::min(o.chunk, o.sequence - t)), state);
      }));
  row("kda", "one token at a time", o.decode, best_seconds(o.repeats, [&] {
        auto state = kda->initial_state(1);
        for (int64_t t = 0; t < o.decode; ++t) kda->step(x.select(1, t), state);
      }));

  // --- MLA layer ---
  if (!cfg.mla_layers.empty()) {
    model::GatedMla mla(model::mla_options(cfg));
    mla->to(g_device, dtype);
    row("mla", "parallel (blockwise)", o.sequence, best_seconds(o.repeats, [&] { mla->forward(x); }));
    row("mla", "chunk by chunk, cache carried", o.sequence, best_seconds(o.repeats, [&] {
          auto cache = mla->initial_cache(1, o.sequence);
          for (int64_t t = 0; t < o.sequence; t += o.chunk)
            mla->forward_chunk(x.narrow(1, t, std::min(o.chunk, o.sequence - t)), cache);
        }));
    row("mla", "one token at a time (absorbed)", o.decode, best_seconds(o.repeats, [&] {
          auto cache = mla->initial_cache(1, o.decode);
          for (int64_t t = 0; t < o.decode; ++t) mla->step(x.select(1, t), cache);
        }));
  }

  // --- MoE layer ---
  model::Moe moe(model::moe_options(cfg));
  moe->to(g_device, dtype);
  row("moe", "all tokens at once", o.sequence, best_seconds(o.repeats, [&] { moe->forward(x); }));
  row("moe", "one token at a time", o.decode, best_seconds(o.repeats, [&] {
        for (int64_t t = 0; t < o.decode; ++t) moe->forward(x.narrow(1, t, 1));
      }));

  // --- chunked KDA against its recurrence, same inputs ---
  const int64_t T = o.kda_tokens, H = cfg.kda.heads, K = cfg.kda.head_k_dim, V = cfg.kda.head_v_dim;
  auto l2 = [](const at::Tensor& t) { return t / t.pow(2).sum(-1, true).add(1e-6).sqrt(); };
  // The KDA core always in fp32: the comparison is about the two forms, not the dtype.
  const auto core = opts.dtype(at::kFloat);
  const at::Tensor q = l2(at::randn({1, T, H, K}, core)), k = l2(at::randn({1, T, H, K}, core));
  const at::Tensor v = at::randn({1, T, H, V}, core);
  const at::Tensor g = at::sigmoid(at::randn({1, T, H, K}, core)) * cfg.kda.g_min;
  const at::Tensor beta = at::sigmoid(at::randn({1, T, H}, core));
  const double scale = 1.0 / std::sqrt(static_cast<double>(K));
  ModelBenchResult r;
  model::kda::Output chunked_out, recurrent_out;
  r.kda_chunked_s = best_seconds(o.repeats, [&] {
    chunked_out = model::kda::chunked(q, k, v, g, beta, at::Tensor(), scale, cfg.kda.chunk_size);
  });
  r.kda_recurrent_s = best_seconds(1, [&] {
    recurrent_out = model::kda::recurrent(q, k, v, g, beta, at::Tensor(), scale);
  });
  const double max_diff = (chunked_out.o - recurrent_out.o).abs().max().item<double>();
  row("kda", "core: chunked form", T, r.kda_chunked_s);
  row("kda", "core: token-by-token recurrence", T, r.kda_recurrent_s);
  std::printf("kda core agreement at T=%ld: max |chunked - recurrent| = %.2e\n", static_cast<long>(T), max_diff);
  r.kda_chunked_speedup = r.kda_recurrent_s / r.kda_chunked_s;
  std::printf("kda_chunked_speedup: %.2f\n", r.kda_chunked_speedup);
  std::fflush(stdout);
  return r;
}

}  // namespace odyssey::bench
