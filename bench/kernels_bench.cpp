#include "bench/kernels_bench.h"

#ifdef ODYSSEY_WITH_CUDA_KERNELS

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/GradMode.h>
#include <cuda_runtime.h>
#include <torch/cuda.h>

#include "kernels/kda.h"
#include "kernels/moe_autograd.h"
#include "kernels/torch_bindings.h"
#include "model/balancing.h"
#include "model/kda.h"
#include "model/moe.h"

namespace odyssey::bench {
namespace {

namespace kda = odyssey::model::kda;
namespace model = odyssey::model;

struct Timing {
  double best_ms = 0, median_ms = 0;
};

// fn enqueues work on the current stream; each repeat is bracketed by CUDA events.
Timing time_cuda(const std::function<void()>& fn, int warmup, int repeats) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  for (int i = 0; i < warmup; ++i) fn();
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> ms;
  for (int i = 0; i < std::max(1, repeats); ++i) {
    cudaEventRecord(start, stream);
    fn();
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float elapsed = 0;
    cudaEventElapsedTime(&elapsed, start, stop);
    ms.push_back(elapsed);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return {ms.front(), ms[ms.size() / 2]};
}

struct KdaInputs {
  at::Tensor q, k, v, g, beta;
  double scale = 0;
};

KdaInputs make_inputs(int64_t batch, int64_t length, int64_t heads, int64_t key, int64_t value) {
  const auto f32 = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  auto l2 = [](const at::Tensor& x) { return x * at::rsqrt(x.pow(2).sum(-1, true) + 1e-6); };
  KdaInputs in;
  in.q = l2(at::randn({batch, length, heads, key}, f32)).to(at::kBFloat16);
  in.k = l2(at::randn({batch, length, heads, key}, f32)).to(at::kBFloat16);
  in.v = at::randn({batch, length, heads, value}, f32).to(at::kBFloat16);
  in.g = -5.0 * at::sigmoid(at::randn({batch, length, heads, key}, f32) * 2.0 - 3.0);
  in.beta = at::sigmoid(at::randn({batch, length, heads}, f32)).to(at::kBFloat16);
  in.scale = 1.0 / std::sqrt(static_cast<double>(key));
  return in;
}

// FLOPs of the chunked form per chunk of C tokens per head: K^K~^T, Q^K~^T, W (3 x 2CCK),
// U and Aqk V' (2 x 2CCV), W S, Q^ S, K_^T V' (3 x 2CKV); the 16 x 16 inverse is left out.
double chunked_flops(int64_t batch, int64_t length, int64_t heads, int64_t key, int64_t value) {
  const double c = 16, chunks = std::ceil(length / c);
  return batch * heads * chunks * 2 * c * (3 * c * key + 2 * c * value + 3.0 * key * value);
}

// Bytes in and out of the forward: q, k, v, beta (bf16), g (fp32) in, o (bf16) out.
double chunked_bytes(int64_t batch, int64_t length, int64_t heads, int64_t key, int64_t value) {
  return static_cast<double>(batch) * length * heads * (2 * key * 2 + key * 4 + value * 2 + 2 + value * 2);
}

double measure_copy_gb_per_s(const KernelsBenchOptions& o) {
  const int64_t bytes = int64_t{2} << 30;
  const at::Tensor src = at::empty({bytes}, at::TensorOptions().device(at::kCUDA).dtype(at::kByte));
  at::Tensor dst = at::empty_like(src);
  const Timing t = time_cuda([&] { dst.copy_(src); }, o.warmup, o.repeats);
  const double gb_per_s = 2.0 * bytes / (t.best_ms * 1e-3) / 1e9;  // read + write
  std::printf("copy        %5.1f GB device-to-device      best %8.3f ms   %7.0f GB/s (read + write)\n",
              bytes / 1e9, t.best_ms, gb_per_s);
  return gb_per_s;
}

struct ForwardRow {
  double kernel_ms = 0, reference_ms = 0;
};

// segment_length as kernels::kda_chunked takes it: 0 automatic (context parallel where the
// launcher chooses it), -1 the serial walk. `reference` times kda::chunked_reference as well.
ForwardRow bench_forward(const KernelsBenchOptions& o, int64_t batch, int64_t length,
                         int64_t heads, double copy_gb_per_s, int64_t segment_length = 0,
                         bool reference = true, bool prefetch = true) {
  const int64_t key = 128, value = 128;
  const KdaInputs in = make_inputs(batch, length, heads, key, value);
  const Timing kernel = time_cuda(
      [&] {
        kernels::kda_chunked(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), in.scale,
                             at::Tensor(), segment_length, prefetch);
      },
      o.warmup, o.repeats);
  ForwardRow row{kernel.best_ms, 0};
  const double flops = chunked_flops(batch, length, heads, key, value);
  const double bytes = chunked_bytes(batch, length, heads, key, value);
  const double floor_ms = bytes / (copy_gb_per_s * 1e9) * 1e3;
  const char* path = !prefetch ? "no-prefetch" : segment_length < 0 ? "serial" : "auto";
  std::printf("kda forward B=%ld T=%ld H=%ld K=V=128 bf16 %-11s: kernel best %8.3f ms  median %8.3f ms"
              "  %6.1f TFLOP/s  floor %.3f ms (%.2f GB) -> %.0f%% of the floor\n",
              static_cast<long>(batch), static_cast<long>(length), static_cast<long>(heads), path,
              kernel.best_ms, kernel.median_ms, flops / (kernel.best_ms * 1e-3) / 1e12, floor_ms,
              bytes / 1e9, 100.0 * floor_ms / kernel.best_ms);
  if (o.reference && reference) {
    const Timing reference = time_cuda(
        [&] { kda::chunked_reference(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), in.scale); },
        /*warmup=*/1, o.reference_repeats);
    row.reference_ms = reference.best_ms;
    std::printf("kda forward B=%ld T=%ld H=%ld: reference (kda::chunked_reference) best %9.3f ms"
                " -> kernel %.1fx faster\n",
                static_cast<long>(batch), static_cast<long>(length), static_cast<long>(heads),
                reference.best_ms, reference.best_ms / kernel.best_ms);
  }
  std::fflush(stdout);
  return row;
}

// The backward kernel (kernels/kda.h, kda_chunked_backward: state recompute, reverse state walk,
// per-chunk gradients) at the forward's main shape with preallocated outputs and workspace,
// against the forward kernel's time on the same shape (goal: at most 3x) and, with references,
// a training step (forward + backward) of the kernels against autograd of kda::chunked_reference.
double bench_backward(const KernelsBenchOptions& o, int64_t batch, int64_t length, int64_t heads,
                      double forward_ms) {
  const int64_t key = 128, value = 128;
  const KdaInputs in = make_inputs(batch, length, heads, key, value);
  const auto f32 = in.q.options().dtype(at::kFloat);
  const at::Tensor d_o = at::randn(in.v.sizes(), f32).to(at::kBFloat16);
  at::Tensor dq = at::empty(in.q.sizes(), f32), dk = at::empty(in.q.sizes(), f32);
  at::Tensor dg = at::empty(in.q.sizes(), f32), dv = at::empty(in.v.sizes(), f32);
  at::Tensor dbeta = at::empty(in.beta.sizes(), f32);
  at::Tensor d_state = at::empty({batch, heads, key, value}, f32);
  const size_t workspace_bytes =
      kernels::kda_chunked_backward_workspace_bytes(batch, length, heads, key, value);
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(workspace_bytes)}, in.q.options().dtype(at::kByte));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  cudaError_t error = cudaSuccess;
  const Timing kernel = time_cuda(
      [&] {
        const cudaError_t e = kernels::kda_chunked_backward(
            kernels::KdaDtype::kBFloat16, in.q.data_ptr(), in.k.data_ptr(), in.v.data_ptr(),
            in.g.data_ptr<float>(), in.beta.data_ptr(), nullptr, d_o.data_ptr(), nullptr,
            dq.data_ptr<float>(), dk.data_ptr<float>(), dv.data_ptr<float>(),
            dg.data_ptr<float>(), dbeta.data_ptr<float>(), d_state.data_ptr<float>(), batch,
            length, heads, key, value, static_cast<float>(in.scale), workspace.data_ptr(),
            workspace_bytes, stream);
        if (e != cudaSuccess) error = e;
      },
      o.warmup, o.repeats);
  TORCH_CHECK(error == cudaSuccess, "kda_chunked_backward: ", cudaGetErrorString(error));
  std::printf("kda backward B=%ld T=%ld H=%ld K=V=128 bf16: kernel best %8.3f ms  median %8.3f ms"
              "  -> %.2fx the forward's %.3f ms (goal <= 3x); workspace %.2f GB\n",
              static_cast<long>(batch), static_cast<long>(length), static_cast<long>(heads),
              kernel.best_ms, kernel.median_ms, kernel.best_ms / forward_ms, forward_ms,
              workspace_bytes / 1e9);
  std::fflush(stdout);
  if (o.reference) {
    // A training step each way: forward with autograd recording, then backward of <o, d_o>.
    auto step = [&](bool use_kernels) {
      const c10::AutoGradMode grad(true);
      const at::Tensor q = in.q.detach().requires_grad_(true);
      const kda::Output out =
          use_kernels ? kda::chunked(q, in.k, in.v, in.g, in.beta, at::Tensor(), in.scale)
                      : kda::chunked_reference(q, in.k, in.v, in.g, in.beta, at::Tensor(), in.scale);
      (out.o.to(at::kFloat) * d_o.to(at::kFloat)).sum().backward();
    };
    const Timing kernels_step = time_cuda([&] { step(true); }, 1, o.reference_repeats);
    try {
      const Timing reference = time_cuda([&] { step(false); }, 0, o.reference_repeats);
      std::printf("kda train step (forward + backward) B=%ld T=%ld H=%ld: kernels best %8.3f ms,"
                  " reference (autograd of kda::chunked_reference) best %9.3f ms -> %.1fx\n",
                  static_cast<long>(batch), static_cast<long>(length), static_cast<long>(heads),
                  kernels_step.best_ms, reference.best_ms, reference.best_ms / kernels_step.best_ms);
    } catch (const c10::Error& e) {
      std::printf("kda train step B=%ld T=%ld H=%ld: kernels best %8.3f ms; reference failed (%s)\n",
                  static_cast<long>(batch), static_cast<long>(length), static_cast<long>(heads),
                  kernels_step.best_ms, e.what_without_backtrace());
    }
    std::fflush(stdout);
  }
  return kernel.best_ms;
}

double bench_decode(const KernelsBenchOptions& o, int64_t batch, int64_t heads,
                    double copy_gb_per_s) {
  const int64_t key = 128, value = 128;
  const KdaInputs in = make_inputs(batch, 1, heads, key, value);
  auto token = [](const at::Tensor& t) { return t.select(1, 0).contiguous(); };
  const at::Tensor q = token(in.q), k = token(in.k), v = token(in.v), g = token(in.g),
                   beta = token(in.beta);
  at::Tensor state = at::randn({batch, heads, key, value},
                               at::TensorOptions().device(at::kCUDA).dtype(at::kFloat)) * 0.1;
  const Timing kernel =
      time_cuda([&] { kernels::kda_step(q, k, v, g, beta, state, in.scale); }, o.warmup, o.repeats);
  const double state_bytes = 2.0 * state.numel() * 4;  // read + write
  std::printf("kda decode  batch=%ld H=%ld K=V=128 bf16: kernel best %8.3f ms  median %8.3f ms"
              "  %7.0f GB/s of state (%.0f%% of copy)\n",
              static_cast<long>(batch), static_cast<long>(heads), kernel.best_ms, kernel.median_ms,
              state_bytes / (kernel.best_ms * 1e-3) / 1e9,
              100.0 * state_bytes / (kernel.best_ms * 1e-3) / 1e9 / copy_gb_per_s);
  if (o.reference) {
    const Timing reference = time_cuda(
        [&] { kda::step_reference(q, k, v, g, beta, state, in.scale); }, 1, o.reference_repeats);
    std::printf("kda decode  batch=%ld H=%ld: reference (kda::step_reference) best %8.3f ms"
                " -> kernel %.1fx faster\n",
                static_cast<long>(batch), static_cast<long>(heads), reference.best_ms,
                reference.best_ms / kernel.best_ms);
  }
  std::fflush(stdout);
  return kernel.best_ms;
}


// ---- MoE ------------------------------------------------------------------------------------------

// The layer at configs/model/small.toml's expert shapes.
model::MoeOptions small_moe_options() {
  model::MoeOptions o;
  o.hidden = 1024;
  o.latent = 384;
  o.expert_ffn = 192;
  o.num_experts = 896;
  o.top_k = 16;
  o.num_shared = 2;
  o.shared_ffn = 512;
  return o;
}

// FLOPs of one forward, the matmuls only (see kernels_bench.h).
double moe_forward_flops(const model::MoeOptions& o, int64_t tokens) {
  const double d = o.hidden, e = o.num_experts, l = o.latent, f = o.expert_ffn, k = o.top_k,
               s = o.num_shared, fs = o.shared_ffn;
  return 2.0 * tokens * (d * e + d * l + k * 3 * l * f + l * d + s * 3 * d * fs);
}

// A bf16 [tokens, 1024] x [1024, N] matmul with about `flops` FLOPs: its TFLOP/s.
double dense_tflops(const KernelsBenchOptions& o, int64_t tokens, double flops) {
  const int64_t inner = 1024;
  const int64_t columns = std::max<int64_t>(
      64, static_cast<int64_t>(std::llround(flops / (2.0 * tokens * inner) / 64.0)) * 64);
  const auto bf16 = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const at::Tensor a = at::randn({tokens, inner}, bf16), b = at::randn({inner, columns}, bf16);
  at::Tensor c = at::empty({tokens, columns}, bf16);
  const Timing t = time_cuda([&] { at::matmul_out(c, a, b); }, o.warmup, o.repeats);
  const double done = 2.0 * tokens * inner * columns;
  const double tflops = done / (t.best_ms * 1e-3) / 1e12;
  std::printf("moe dense   bf16 matmul [%ld, %ld] x [%ld, %ld] (%.1f GFLOP): best %8.3f ms  %6.1f TFLOP/s\n",
              static_cast<long>(tokens), static_cast<long>(inner), static_cast<long>(inner),
              static_cast<long>(columns), done / 1e9, t.best_ms, tflops);
  return tflops;
}

// The routing kernels alone on the layer's shapes, each against its LibTorch reference.
void bench_moe_routing(const KernelsBenchOptions& o, const model::MoeOptions& mo, int64_t tokens) {
  const auto f32 = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  const at::Tensor scores = at::sigmoid(at::randn({tokens, mo.num_experts}, f32));
  const at::Tensor bias = at::randn({mo.num_experts}, f32) * 0.05;
  const Timing topk = time_cuda([&] { kernels::moe_router_topk(scores, bias, mo.top_k); }, o.warmup, o.repeats);
  const at::Tensor selected = kernels::moe_router_topk(scores, bias, mo.top_k).ids;
  const Timing permutation =
      time_cuda([&] { kernels::moe_permutation(selected, mo.num_experts); }, o.warmup, o.repeats);
  model::QuantileBalancerOptions bo;
  bo.num_experts = mo.num_experts;
  bo.top_k = mo.top_k;
  model::QuantileBalancer balancer(bo);
  const auto [lo, hi] = balancer.histogram_range();
  const Timing histogram = time_cuda(
      [&] { kernels::moe_quantile_histogram(scores, bias, mo.top_k, bo.histogram_bins, lo, hi, false); },
      o.warmup, o.repeats);
  std::printf("moe routing m=%ld n=%ld k=%ld: top-k + p %.3f ms, permutation %.3f ms, quantile histogram "
              "(%ld bins) %.3f ms\n",
              static_cast<long>(tokens), static_cast<long>(mo.num_experts), static_cast<long>(mo.top_k),
              topk.best_ms, permutation.best_ms, static_cast<long>(bo.histogram_bins), histogram.best_ms);
  if (o.reference) {
    const Timing ref_topk = time_cuda(
        [&] {
          const at::Tensor ids = model::select_experts(scores, bias, mo.top_k);
          const at::Tensor chosen = scores.gather(1, ids);
          (void)(chosen / chosen.sum(-1, true));
        },
        1, o.reference_repeats);
    const Timing ref_permutation =
        time_cuda([&] { model::permute_tokens(selected, mo.num_experts); }, 1, o.reference_repeats);
    std::printf("moe routing references: select_experts + p %.3f ms (%.1fx), permute_tokens %.3f ms (%.1fx)\n",
                ref_topk.best_ms, ref_topk.best_ms / topk.best_ms, ref_permutation.best_ms,
                ref_permutation.best_ms / permutation.best_ms);
  }
  std::fflush(stdout);
}

void bench_moe(const KernelsBenchOptions& o, KernelsBenchResult& r) {
  const model::MoeOptions mo = small_moe_options();
  const int64_t tokens = o.moe_tokens;
  const auto bf16 = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  model::Moe layer(mo);
  layer->to(at::kCUDA, at::kBFloat16);
  layer->router->to(at::kFloat);  // W_r and b in fp32 (model/moe.h)
  layer->set_expert_bias(at::randn({mo.num_experts}) * 0.05);
  const at::Tensor x = at::randn({tokens, mo.hidden}, bf16);
  const at::Tensor dy = at::randn({tokens, mo.hidden}, bf16);
  const bool grouped = kernels::moe_grouped_mm_applies(
      x.new_empty({tokens * mo.top_k, mo.latent}), layer->experts->gate_proj, layer->experts->up_proj,
      layer->experts->down_proj);
  std::printf("moe layer   m=%ld d=%ld E=%ld k=%ld L=%ld F=%ld shared %ldx%ld bf16; expert GEMMs: %s\n",
              static_cast<long>(tokens), static_cast<long>(mo.hidden), static_cast<long>(mo.num_experts),
              static_cast<long>(mo.top_k), static_cast<long>(mo.latent), static_cast<long>(mo.expert_ffn),
              static_cast<long>(mo.num_shared), static_cast<long>(mo.shared_ffn),
              grouped ? "at::_grouped_mm" : "per-expert loop (at::_grouped_mm not available here)");
  std::fflush(stdout);
  bench_moe_routing(o, mo, tokens);

  // One training step's layer work: forward recorded, backward of <y, dy>; every gradient
  // (x and the parameters) reset to none first so nothing accumulates.
  auto step = [&](bool kernels, bool backward) {
    const c10::AutoGradMode grad(backward);
    const at::Tensor input = backward ? x.detach().requires_grad_(true) : x;
    for (auto& p : layer->parameters()) p.mutable_grad() = at::Tensor();
    const model::MoeOutput out = kernels ? layer->forward(input) : layer->forward_reference(input);
    if (backward) out.y.backward(dy);
  };
  const double flops = moe_forward_flops(mo, tokens);
  const Timing forward = time_cuda([&] { step(true, false); }, o.warmup, o.repeats);
  const Timing train = time_cuda([&] { step(true, true); }, o.warmup, o.repeats);
  r.moe_forward_ms = forward.best_ms;
  r.moe_train_ms = train.best_ms;
  r.moe_forward_tflops = flops / (forward.best_ms * 1e-3) / 1e12;
  r.moe_train_tflops = 3 * flops / (train.best_ms * 1e-3) / 1e12;
  std::printf("moe layer   forward            best %8.3f ms  median %8.3f ms  %6.1f TFLOP/s (%.1f GFLOP)\n",
              forward.best_ms, forward.median_ms, r.moe_forward_tflops, flops / 1e9);
  std::printf("moe layer   forward + backward best %8.3f ms  median %8.3f ms  %6.1f TFLOP/s (%.1f GFLOP)\n",
              train.best_ms, train.median_ms, r.moe_train_tflops, 3 * flops / 1e9);
  std::fflush(stdout);
  const double dense_forward = dense_tflops(o, tokens, flops);
  r.moe_dense_tflops = dense_tflops(o, tokens, 3 * flops);
  r.moe_vs_dense = r.moe_train_tflops / r.moe_dense_tflops;
  std::printf("moe layer   vs dense matmul of the same FLOPs: forward %.2f, forward + backward %.2f (goal >= 0.7)\n",
              r.moe_forward_tflops / dense_forward, r.moe_vs_dense);
  if (o.reference) {
    const Timing ref_forward = time_cuda([&] { step(false, false); }, 1, o.reference_repeats);
    const Timing ref_train = time_cuda([&] { step(false, true); }, 1, o.reference_repeats);
    r.moe_reference_forward_ms = ref_forward.best_ms;
    r.moe_reference_train_ms = ref_train.best_ms;
    std::printf("moe layer   reference (MoeImpl::forward_reference: loop over experts): forward %.3f ms "
                "(kernels %.1fx faster), forward + backward %.3f ms (%.1fx)\n",
                ref_forward.best_ms, ref_forward.best_ms / forward.best_ms, ref_train.best_ms,
                ref_train.best_ms / train.best_ms);
  }
  std::printf("moe_forward_ms: %.3f\n", r.moe_forward_ms);
  std::printf("moe_train_ms: %.3f\n", r.moe_train_ms);
  std::printf("moe_vs_dense: %.3f\n", r.moe_vs_dense);
  std::fflush(stdout);
}
}  // namespace

Result<KernelsBenchResult> run_kernels_bench(const KernelsBenchOptions& options) {
  if (!torch::cuda::is_available()) {
    return make_status(StatusCode::kFailedPrecondition, "bench kernels: no CUDA device");
  }
  const bool kda = options.suite == "kda" || options.suite == "all";
  const bool moe = options.suite == "moe" || options.suite == "all";
  if (!kda && !moe) {
    return make_status(StatusCode::kInvalidArgument, "bench kernels: --suite must be kda, moe or all, got '{}'",
                       options.suite);
  }
  try {
    const c10::NoGradGuard no_grad;
    at::manual_seed(0);
    std::printf("bench kernels (suite %s) on %s; warm-up %d, best/median of %d (references: best of %d)\n",
                options.suite.c_str(), at::cuda::getCurrentDeviceProperties()->name, options.warmup,
                options.repeats, options.reference_repeats);
    KernelsBenchResult r;
    // moe first: with `all`, kda's `kda_forward_ms` stays the very last line.
    if (moe) bench_moe(options, r);
    if (!kda) return r;
    r.copy_gb_per_s = measure_copy_gb_per_s(options);
    // The same without the L2 prefetch of the next group's inputs (KdaChunkedOptions::prefetch).
    r.kda_forward_no_prefetch_ms =
        bench_forward(options, 2, 16384, 64, r.copy_gb_per_s, 0, /*reference=*/false,
                      /*prefetch=*/false)
            .kernel_ms;
    const ForwardRow main = bench_forward(options, 2, 16384, 64, r.copy_gb_per_s);
    r.kda_forward_ms = main.kernel_ms;
    r.kda_forward_reference_ms = main.reference_ms;
    // Few heads, one long sequence: the serial walk (8 CTAs) and the automatic choice, which
    // is context parallel here (segments, transitions, scan, forward from the segment states).
    r.kda_forward_long_serial_ms =
        bench_forward(options, 1, 65536, 4, r.copy_gb_per_s, /*segment_length=*/-1,
                      /*reference=*/false)
            .kernel_ms;
    r.kda_forward_long_ms = bench_forward(options, 1, 65536, 4, r.copy_gb_per_s).kernel_ms;
    std::printf("kda forward B=1 T=65536 H=4: context parallel %.3f ms vs serial %.3f ms -> %.1fx\n",
                r.kda_forward_long_ms, r.kda_forward_long_serial_ms,
                r.kda_forward_long_serial_ms / r.kda_forward_long_ms);
    r.kda_backward_ms = bench_backward(options, 2, 16384, 64, r.kda_forward_ms);
    r.kda_decode_ms = bench_decode(options, 256, 64, r.copy_gb_per_s);
    std::printf("kda_backward_ms: %.3f (%.2fx the forward)\n", r.kda_backward_ms,
                r.kda_backward_ms / r.kda_forward_ms);
    std::printf("kda_forward_ms: %.3f\n", r.kda_forward_ms);
    std::fflush(stdout);
    return r;
  } catch (const c10::Error& e) {
    return make_status(StatusCode::kInternal, "bench kernels: {}", e.what_without_backtrace());
  }
}

}  // namespace odyssey::bench

#else  // !ODYSSEY_WITH_CUDA_KERNELS

namespace odyssey::bench {

Result<KernelsBenchResult> run_kernels_bench(const KernelsBenchOptions&) {
  return make_status(StatusCode::kFailedPrecondition,
                     "bench kernels needs the CUDA build (cmake -DODYSSEY_CUDA=ON)");
}

}  // namespace odyssey::bench

#endif  // ODYSSEY_WITH_CUDA_KERNELS
