#include "bench/kernels_bench.h"

#ifdef ODYSSEY_WITH_CUDA_KERNELS

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/core/GradMode.h>
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>
#include <torch/autograd.h>
#include <torch/cuda.h>

#include "kernels/kda.h"
#include "kernels/grouped_gemm.h"
#include "kernels/kda_autograd.h"
#include "kernels/moe_autograd.h"
#include "kernels/moe_experts_sm90.h"
#include "kernels/norm_autograd.h"
#include "kernels/torch_bindings.h"
#include "model/attn_res.h"
#include "model/balancing.h"
#include "model/kda.h"
#include "model/moe.h"
#include "model/precision.h"

namespace odyssey::bench {
namespace {

// An NVTX range for the profilers' timelines (nsys: `--capture-range=nvtx --nvtx-capture=NAME`, or
// the `nvtx_kern_sum` report's kernels per range); free when no profiler is attached.
class NvtxRange {
 public:
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

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

// FLOPs of the backward's products per chunk of 16 tokens per head, as kernels/README.md counts them
// ("What the 3x goal needs"), with a = 2CCK, b = 2CCV, s = 2CKV: pass 1 (the
// states and V') P, W, U (2a + b), V' = U - W S and the state step (2s); pass 2 Aqk, P, W (3a),
// Aqk^T dO (b), K_ dS', Q^^T dO, W^T dV' (3s); pass 3 with V' and dV' given: P, Aqk, W again, M^T dW,
// H and the anchored products' four (9a), dAqk, M^T dU, G (3b), dQ^, dK_, dW and half a state step
// (3.5s), dL (4C^3). states_given: the forward kept the states, no pass 1.
double backward_flops(int64_t batch, int64_t length, int64_t heads, int64_t key, int64_t value, bool states_given) {
  const double c = 16, chunks = std::ceil(length / c);
  const double a = 2 * c * c * key, b = 2 * c * c * value, s = 2.0 * c * key * value;
  const double pass1 = 2 * a + b + 2 * s, pass2 = 3 * a + b + 3 * s, pass3 = 9 * a + 3 * b + 3.5 * s + 4 * c * c * c;
  return batch * heads * chunks * ((states_given ? 0.0 : pass1) + pass2 + pass3);
}

// Bytes in and out of the forward: q, k, v, beta (bf16), g (fp32) in, o (bf16) out.
double chunked_bytes(int64_t batch, int64_t length, int64_t heads, int64_t key, int64_t value) {
  return static_cast<double>(batch) * length * heads * (2 * key * 2 + key * 4 + value * 2 + 2 + value * 2);
}

// Bytes the backward (kernels/kda.h, kda_chunked_backward; bf16 K = V = 128, pass 3 by 32-token
// blocks) moves through memory, pass by pass as kernels/JOURNAL.md's traffic table counts them
// ("Eighteenth session"): pass 1 reads k, v, g, beta and writes every second chunk's state (every
// fourth one's and V' with values: kda_backward_state_interval); pass 2 reads q, k, dO, g, beta and
// writes every second dS' (and dV'); pass 3 reads both states, q, k, v, dO, g, beta (and V', dV')
// and writes dq, dk, dv, dg, dbeta. values: V' and dV' kept (KdaBackwardOptions::keep_values);
// states_given: the forward kept the states (and V'), no pass 1.
// block_tokens: pass 3's block with V' (64: passes 1 and 2 store every fourth chunk's state
// gradient; 32: every second one's).
double backward_bytes(int64_t batch, int64_t length, int64_t heads, int64_t key, int64_t value, bool values,
                      bool states_given, int block_tokens = 64) {
  const double n = static_cast<double>(batch) * length * heads;
  const double keys = n * key * 2, vals = n * value * 2, gates = n * key * 4, beta = n * 2;
  auto stored = [&](int64_t interval) {  // bytes of the states kept at one chunk in every `interval`
    return static_cast<double>(batch) * heads * (((length + 15) / 16 + interval - 1) / interval) * key * value * 2;
  };
  const double states = stored(values ? 4 : 2), d_states = stored(values && block_tokens == 64 ? 4 : 2);
  const double kept_values = values ? vals : 0.0;
  const double pass1 = keys + vals + gates + beta + states + kept_values;
  const double pass2 = 2 * keys + vals + gates + beta + d_states + kept_values;
  const double pass3 = states + d_states + 2 * keys + 2 * vals + gates + beta + 2 * kept_values  // reads
                       + 2 * keys + vals + gates + n * 4;                                       // writes
  return (states_given ? 0.0 : pass1) + pass2 + pass3;
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
                         bool reference = true, bool head_walk = true) {
  const int64_t key = 128, value = 128;
  const KdaInputs in = make_inputs(batch, length, heads, key, value);
  const Timing kernel = time_cuda(
      [&] {
        kernels::kda_chunked(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), in.scale,
                             at::Tensor(), segment_length, /*prefetch=*/true, head_walk);
      },
      o.warmup, o.repeats);
  ForwardRow row{kernel.best_ms, 0};
  const double flops = chunked_flops(batch, length, heads, key, value);
  const double bytes = chunked_bytes(batch, length, heads, key, value);
  const double floor_ms = bytes / (copy_gb_per_s * 1e9) * 1e3;
  const char* path = !head_walk ? "64-col CTAs" : segment_length < 0 ? "serial" : "auto";
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
                      double forward_ms, double copy_gb_per_s) {
  const int64_t key = 128, value = 128;
  const KdaInputs in = make_inputs(batch, length, heads, key, value);
  const auto f32 = in.q.options().dtype(at::kFloat);
  const at::Tensor d_o = at::randn(in.v.sizes(), f32).to(at::kBFloat16);
  // dq, dk, dv in the inputs' bf16 (kernels/kda.h), dg and dbeta in fp32.
  at::Tensor dq = at::empty_like(in.q), dk = at::empty_like(in.q);
  at::Tensor dg = at::empty(in.q.sizes(), f32), dv = at::empty_like(in.v);
  at::Tensor dbeta = at::empty(in.beta.sizes(), f32);
  at::Tensor d_state = at::empty({batch, heads, key, value}, f32);
  const size_t workspace_bytes = kernels::kda_chunked_backward_workspace_bytes(
      kernels::KdaDtype::kBFloat16, batch, length, heads, key, value, /*states_given=*/false, {});
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(workspace_bytes)}, in.q.options().dtype(at::kByte));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  cudaError_t error = cudaSuccess;
  const Timing kernel = time_cuda(
      [&] {
        const cudaError_t e = kernels::kda_chunked_backward(
            kernels::KdaDtype::kBFloat16, in.q.data_ptr(), in.k.data_ptr(), in.v.data_ptr(),
            in.g.data_ptr<float>(), in.beta.data_ptr(), nullptr, d_o.data_ptr(), nullptr,
            dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
            dg.data_ptr<float>(), dbeta.data_ptr<float>(), d_state.data_ptr<float>(), batch,
            length, heads, key, value, static_cast<float>(in.scale), /*chunk_states=*/nullptr, workspace.data_ptr(),
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
  // The memory floor of this design (the bytes its passes must move, at the copy rate): the least
  // time any implementation of it could take, in multiples of the forward.
  {
    const double moved = backward_bytes(batch, length, heads, key, value, /*values=*/true, /*states_given=*/false);
    const double recompute = backward_bytes(batch, length, heads, key, value, false, false);
    const double kept = backward_bytes(batch, length, heads, key, value, true, /*states_given=*/true);
    const double blocks32 = backward_bytes(batch, length, heads, key, value, true, false, /*block_tokens=*/32);
    auto floor_ms = [&](double bytes) { return bytes / (copy_gb_per_s * 1e9) * 1e3; };
    std::printf("kda backward memory floor: %.2f GB moved -> %.3f ms at the copy rate, %.0f%% of it reached; the"
                " floor is %.2fx the forward (%.2fx recomputing V' and dV', %.2fx from kept states and V', %.2fx"
                " by 32-token blocks)\n",
                moved / 1e9, floor_ms(moved), 100.0 * floor_ms(moved) / kernel.best_ms,
                floor_ms(moved) / forward_ms, floor_ms(recompute) / forward_ms, floor_ms(kept) / forward_ms,
                floor_ms(blocks32) / forward_ms);
    // The same goal in products: the backward's (backward_flops) against the forward's, and the
    // share of the forward's rate of products that 3x the forward's time would take.
    const double forward_flops = chunked_flops(batch, length, heads, key, value);
    const double flops = backward_flops(batch, length, heads, key, value, /*states_given=*/false);
    const double kept_flops = backward_flops(batch, length, heads, key, value, /*states_given=*/true);
    const double forward_rate = forward_flops / (forward_ms * 1e-3) / 1e12;
    const double rate = flops / (kernel.best_ms * 1e-3) / 1e12;
    std::printf("kda backward products: %.0f GFLOP, %.2fx the forward's (%.2fx from kept states): %.1f TFLOP/s, %.0f%%"
                " of the forward's %.1f TFLOP/s; 3x the forward's time needs %.0f%% of its rate (%.0f%% from kept"
                " states)\n",
                flops / 1e9, flops / forward_flops, kept_flops / forward_flops,
                rate, 100.0 * rate / forward_rate,
                forward_rate, 100.0 * flops / forward_flops / 3.0, 100.0 * kept_flops / forward_flops / 3.0);
  }
  // The backward with other options, its own workspace, against the default above in the same run.
  auto time_variant = [&](const kernels::KdaBackwardOptions& options, size_t& bytes) {
    bytes = kernels::kda_chunked_backward_workspace_bytes(kernels::KdaDtype::kBFloat16, batch, length, heads, key,
                                                          value, /*states_given=*/false, options);
    const at::Tensor scratch = at::empty({static_cast<int64_t>(bytes)}, in.q.options().dtype(at::kByte));
    const Timing t = time_cuda(
        [&] {
          const cudaError_t e = kernels::kda_chunked_backward(
              kernels::KdaDtype::kBFloat16, in.q.data_ptr(), in.k.data_ptr(), in.v.data_ptr(),
              in.g.data_ptr<float>(), in.beta.data_ptr(), nullptr, d_o.data_ptr(), nullptr, dq.data_ptr(),
              dk.data_ptr(), dv.data_ptr(), dg.data_ptr<float>(), dbeta.data_ptr<float>(), d_state.data_ptr<float>(),
              batch, length, heads, key, value, static_cast<float>(in.scale), /*chunk_states=*/nullptr,
              scratch.data_ptr(), bytes, stream, options);
          if (e != cudaSuccess) error = e;
        },
        o.warmup, o.repeats);
    TORCH_CHECK(error == cudaSuccess, "kda_chunked_backward (variant): ", cudaGetErrorString(error));
    return t;
  };
  auto report_variant = [&](const char* label, const char* default_label, const kernels::KdaBackwardOptions& options) {
    size_t bytes = 0;
    const Timing t = time_variant(options, bytes);
    std::printf("kda backward, %s: kernel best %8.3f ms  median %8.3f ms  -> %.2fx the forward; the default%s %.3f ms"
                " is %.3fx of it; workspace %.2f GB\n",
                label, t.best_ms, t.median_ms, t.best_ms / forward_ms, default_label, kernel.best_ms,
                kernel.best_ms / t.best_ms, bytes / 1e9);
  };
  // Pass 3 by 16-token chunks (KdaBackwardOptions::pass3_blocks = false; the default until the
  // seventeenth session: passes 1 and 2 store every chunk's state and state gradient, twice the
  // workspace).
  kernels::KdaBackwardOptions chunks;
  chunks.pass3_blocks = false;
  report_variant("pass 3 by 16-token chunks", " (64-token blocks)", chunks);
  // Pass 3 by blocks recomputing V' and dV' (KdaBackwardOptions::keep_values = false; the default
  // until the eighteenth session: passes 1 and 2 keep neither).
  kernels::KdaBackwardOptions values;
  values.keep_values = false;
  report_variant("V' and dV' recomputed in pass 3 (by 32-token blocks)", " (kept by the walks)", values);
  // Pass 3 by 32-token blocks with V' (KdaBackwardOptions::pass3_block_tokens = 32; the default until
  // the thirty-second session): pass 2 stores every second chunk's state gradient, and pass 3 makes
  // every second block's entering state from the one before.
  kernels::KdaBackwardOptions blocks32;
  blocks32.pass3_block_tokens = 32;
  report_variant("pass 3 by 32-token blocks", " (64-token blocks)", blocks32);
  // The 64-token pass's copies by a producer warp (KdaBackwardOptions::pass3_block_producer).
  kernels::KdaBackwardOptions producer;
  producer.pass3_block_producer = true;
  report_variant("pass 3 by 64-token blocks, producer warp", " (compute threads' copies)", producer);
  // A training step's forward keeping the chunk states (KdaChunkedOptions::chunk_states with o) and
  // the backward from them (no state recompute), against the forward and backward above.
  {
    at::Tensor out = at::empty_like(in.v), final_state = at::empty({batch, heads, key, value}, f32);
    // Every fourth chunk's with the default pass 3 by blocks (kda_backward_state_interval).
    const int interval = kernels::kda_backward_state_interval(kernels::KdaDtype::kBFloat16, key, value);
    const int64_t kept = ((length + 15) / 16 + interval - 1) / interval;
    at::Tensor states = at::empty({batch, heads, kept, value, key}, in.q.options().dtype(at::kBFloat16));
    // And V' where pass 3 by blocks reads it (as kda_chunked_autograd keeps it).
    at::Tensor new_values = at::empty_like(in.v);
    kernels::KdaChunkedOptions keep;
    keep.chunk_states = states.data_ptr();
    keep.chunk_state_interval = interval;
    kernels::KdaBackwardOptions given;
    given.chunk_states_interval = interval;
    if (interval >= 2) keep.new_values = new_values.data_ptr(), given.new_values = new_values.data_ptr();
    const Timing forward_keeping = time_cuda(
        [&] {
          const cudaError_t e = kernels::kda_chunked_forward(
              kernels::KdaDtype::kBFloat16, in.q.data_ptr(), in.k.data_ptr(), in.v.data_ptr(),
              in.g.data_ptr<float>(), in.beta.data_ptr(), nullptr, out.data_ptr(), final_state.data_ptr<float>(),
              nullptr, batch, length, heads, key, value, static_cast<float>(in.scale), keep, stream);
          if (e != cudaSuccess) error = e;
        },
        o.warmup, o.repeats);
    // The backward from the kept states with `options`, in the workspace above (its own size checked).
    auto from_kept_states = [&](const kernels::KdaBackwardOptions& options, size_t& bytes) {
      bytes = kernels::kda_chunked_backward_workspace_bytes(kernels::KdaDtype::kBFloat16, batch, length, heads, key,
                                                            value, /*states_given=*/true, options);
      TORCH_CHECK(bytes <= workspace_bytes, "bench: the backward from kept states needs more workspace");
      return time_cuda(
          [&] {
            const cudaError_t e = kernels::kda_chunked_backward(
                kernels::KdaDtype::kBFloat16, in.q.data_ptr(), in.k.data_ptr(), in.v.data_ptr(),
                in.g.data_ptr<float>(), in.beta.data_ptr(), nullptr, d_o.data_ptr(), nullptr, dq.data_ptr(),
                dk.data_ptr(), dv.data_ptr(), dg.data_ptr<float>(), dbeta.data_ptr<float>(), d_state.data_ptr<float>(),
                batch, length, heads, key, value, static_cast<float>(in.scale), states.data_ptr(),
                workspace.data_ptr(), bytes, stream, options);
            if (e != cudaSuccess) error = e;
          },
          o.warmup, o.repeats);
    };
    size_t given_bytes = 0;
    const Timing from_states = from_kept_states(given, given_bytes);
    TORCH_CHECK(error == cudaSuccess, "kda with kept chunk states: ", cudaGetErrorString(error));
    // The same from the kept states with pass 3 by 32-token blocks (its pass 2 stores every second
    // chunk's state gradient, so its own workspace).
    if (interval == 4) {
      kernels::KdaBackwardOptions given32 = given;
      given32.pass3_block_tokens = 32;
      size_t bytes32 = 0;
      const Timing from_states32 = from_kept_states(given32, bytes32);
      TORCH_CHECK(error == cudaSuccess, "kda with kept chunk states, 32-token blocks: ", cudaGetErrorString(error));
      std::printf("kda backward from kept chunk states, pass 3 by 32-token blocks: kernel best %8.3f ms (%.2fx the"
                  " forward's); the default (64-token blocks): %.3f ms\n",
                  from_states32.best_ms, from_states32.best_ms / forward_ms, from_states.best_ms);
    }
    std::printf("kda backward from kept chunk states B=%ld T=%ld H=%ld: kernel best %8.3f ms (%.2fx the forward's"
                " %.3f ms; workspace %.2f GB + %.2f GB of states and V'); the forward keeping them %.3f ms: forward +"
                " backward %.3f ms against %.3f ms recomputing them\n",
                static_cast<long>(batch), static_cast<long>(length), static_cast<long>(heads), from_states.best_ms,
                from_states.best_ms / forward_ms, forward_ms, given_bytes / 1e9,
                (states.nbytes() + (interval >= 2 ? new_values.nbytes() : 0)) / 1e9,
                forward_keeping.best_ms, forward_keeping.best_ms + from_states.best_ms, forward_ms + kernel.best_ms);
  }
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
    // The same step with the forward keeping the chunk states for the backward.
    const Timing kept_step = time_cuda(
        [&] {
          const c10::AutoGradMode grad(true);
          const at::Tensor q = in.q.detach().requires_grad_(true);
          const kernels::KdaChunkedOutput out = kernels::kda_chunked_autograd(
              q, in.k, in.v, in.g, in.beta, at::Tensor(), in.scale, /*keep_chunk_states=*/true);
          (out.o.to(at::kFloat) * d_o.to(at::kFloat)).sum().backward();
        },
        1, o.reference_repeats);
    std::printf("kda train step keeping the chunk states B=%ld T=%ld H=%ld: kernels best %8.3f ms (recomputing"
                " them: %.3f ms)\n",
                static_cast<long>(batch), static_cast<long>(length), static_cast<long>(heads), kept_step.best_ms,
                kernels_step.best_ms);
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


// The decay gate g = g_min sigmoid(exp(A) (z + dt_bias)) that feeds the KDA kernels its g, at the
// bench's shape with an fp32 z (what a training step has), fused (kernels/kda_gate.h) against the
// LibTorch formula (model::kda::gate_reference) on the same tensors: forward alone, and forward +
// backward through autograd (dz, dA_log, d dt_bias). The fused passes' bytes (forward: z in, g out;
// backward: z and dg in, dz out) against the copy rate measured in the same run.
void bench_gate(const KernelsBenchOptions& o, int64_t batch, int64_t length, int64_t heads, double copy_gb_per_s,
                KernelsBenchResult& r) {
  const int64_t key = 128;
  const at::AutoGradMode grad_mode(true);
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  const at::Tensor z = (at::randn({batch, length, heads, key}, cuda) * 2).requires_grad_(true);
  const at::Tensor a_log = (at::randn({heads}, cuda) * 0.5).requires_grad_(true);
  const at::Tensor dt_bias = at::randn({heads * key}, cuda).requires_grad_(true);
  const at::Tensor dg = at::randn(z.sizes(), cuda);
  const double g_min = -5.0;
  auto clear = [&] {
    for (const at::Tensor* t : {&z, &a_log, &dt_bias}) t->mutable_grad() = at::Tensor();
  };
  const Timing fused_forward = time_cuda(
      [&] {
        const at::NoGradGuard no_grad;
        kernels::kda_gate(z, a_log, dt_bias, g_min);
      },
      o.warmup, o.repeats);
  const Timing reference_forward = time_cuda(
      [&] {
        const at::NoGradGuard no_grad;
        kda::gate_reference(z, a_log, dt_bias, g_min);
      },
      o.warmup, o.repeats);
  const Timing fused_train = time_cuda(
      [&] {
        clear();
        kernels::kda_gate_autograd(z, a_log, dt_bias, g_min).backward(dg);
      },
      o.warmup, o.repeats);
  const Timing reference_train = time_cuda(
      [&] {
        clear();
        kda::gate_reference(z, a_log, dt_bias, g_min).backward(dg);
      },
      o.warmup, o.repeats);
  clear();
  const double element_bytes = static_cast<double>(z.numel()) * 4;
  auto rate = [&](double bytes, double ms) { return 100.0 * bytes / (ms * 1e-3) / 1e9 / copy_gb_per_s; };
  std::printf("kda gate    B=%ld T=%ld H=%ld K=128 fp32 z: forward fused best %8.3f ms (%.0f%% of copy) vs "
              "LibTorch %8.3f ms -> %.1fx\n",
              static_cast<long>(batch), static_cast<long>(length), static_cast<long>(heads), fused_forward.best_ms,
              rate(2 * element_bytes, fused_forward.best_ms), reference_forward.best_ms,
              reference_forward.best_ms / fused_forward.best_ms);
  std::printf("kda gate    forward + backward (dz, dA_log, d dt_bias): fused best %8.3f ms (%.0f%% of copy for "
              "its 5 passes over z's size) vs LibTorch autograd %8.3f ms -> %.1fx\n",
              fused_train.best_ms, rate(5 * element_bytes, fused_train.best_ms), reference_train.best_ms,
              reference_train.best_ms / fused_train.best_ms);
  std::fflush(stdout);
  r.kda_gate_train_ms = fused_train.best_ms;
  r.kda_gate_reference_train_ms = reference_train.best_ms;
}

// The short convolution on q (or k) at the bench's shape, fp32 (training's dtype): SiLU of the
// causal depthwise convolution (W = 4) and each head's L2 norm, fused (kernels/kda_conv.h) against
// the layer's LibTorch chain on the same tensors, forward + backward through autograd (dx, d
// conv_inputs, d weight). The fused passes' bytes (x in and y out; x and dy in, dx out) against the
// copy rate of the same run.
void bench_conv(const KernelsBenchOptions& o, int64_t batch, int64_t length, int64_t heads, double copy_gb_per_s) {
  const int64_t head = 128, channels = heads * head, width = 4;
  const at::AutoGradMode grad_mode(true);
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  const at::Tensor x = at::randn({batch, length, channels}, cuda).requires_grad_(true);
  const at::Tensor conv_inputs = at::zeros({batch, width - 1, channels}, cuda);
  const at::Tensor weight = (at::randn({channels, 1, width}, cuda) * 0.5).requires_grad_(true);
  const at::Tensor dy = at::randn(x.sizes(), cuda);
  auto reference = [&] { return kda::short_conv_reference(x, conv_inputs, weight, head, 1e-6); };
  auto clear = [&] {
    for (const at::Tensor* t : {&x, &weight}) t->mutable_grad() = at::Tensor();
  };
  const Timing fused = time_cuda(
      [&] {
        clear();
        kernels::kda_short_conv_autograd(x, conv_inputs, weight, head, 1e-6).backward(dy);
      },
      o.warmup, o.repeats);
  const Timing plain = time_cuda(
      [&] {
        clear();
        reference().backward(dy);
      },
      o.warmup, o.repeats);
  clear();
  const double bytes = 5.0 * static_cast<double>(x.numel()) * 4;
  std::printf("kda conv    B=%ld T=%ld D=%ld fp32, W=4, SiLU and per-head L2 norm: forward + backward fused best "
              "%8.3f ms (%.0f%% of copy for its 5 passes over x's size) vs LibTorch autograd %8.3f ms -> %.1fx\n",
              static_cast<long>(batch), static_cast<long>(length), static_cast<long>(channels), fused.best_ms,
              100.0 * bytes / (fused.best_ms * 1e-3) / 1e9 / copy_gb_per_s, plain.best_ms,
              plain.best_ms / fused.best_ms);
  std::fflush(stdout);
}

// One KDA layer (model::IncrementalAttention at configs/model/small.toml's sizes: hidden 1024, 8
// heads of K = V = 128, decay rank 128), forward + backward in fp32 (what the learner trains in) at
// B=2, T=16K, against its attention core alone (kda::chunked through autograd on inputs of the
// same shapes, fp32) in the same run: the share of the layer's step that is the core, the rest
// being the projections, the short convolutions, SiLU, the L2 norms, the gates and the output norm.
// The block attention residuals' mix (model/attn_res.h) at a learner chunk's shape: `count`
// fp32 sources of [tokens, 1024], forward + backward through autograd (every source's gradient
// and dw), fused (kernels/attn_res.h: one kernel forward, two backward) against the LibTorch
// reference's ~30 kernels, events around the whole call: at this size the reference's time is
// mostly its launches, which is what the fused form removes from the learner's step.
double bench_attn_res(const KernelsBenchOptions& o, int64_t tokens, int64_t count, double copy_gb_per_s) {
  const int64_t width = 1024;
  const at::AutoGradMode grad_mode(true);
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  std::vector<at::Tensor> sources;
  for (int64_t s = 0; s < count; ++s) sources.push_back(at::randn({tokens, width}, cuda).requires_grad_(true));
  const at::Tensor w = (at::randn({width}, cuda) * 0.1).requires_grad_(true);
  const at::Tensor dh = at::randn({tokens, width}, cuda);
  auto clear = [&] {
    for (at::Tensor& t : sources) t.mutable_grad() = at::Tensor();
    w.mutable_grad() = at::Tensor();
  };
  const Timing fused = time_cuda(
      [&] {
        clear();
        kernels::attn_res_mix_autograd(sources, w, 1e-6).backward(dh);
      },
      o.warmup, o.repeats);
  const Timing reference = time_cuda(
      [&] {
        clear();
        model::attn_res_mix_reference(sources, w, 1e-6).backward(dh);
      },
      o.warmup, o.repeats);
  clear();
  // Bytes the fused passes move: forward S rows in, h out; backward dh and 2 S rows in, S out.
  const double row_bytes = static_cast<double>(tokens * width) * 4;
  const double bytes = (count + 1 + 1 + 3 * count) * row_bytes;
  std::printf("attn res mix %ld sources x [%ld, %ld] fp32, forward + backward: fused best %8.3f ms (%.0f%% of copy) "
              "vs LibTorch autograd %8.3f ms -> %.1fx\n",
              static_cast<long>(count), static_cast<long>(tokens), static_cast<long>(width), fused.best_ms,
              100.0 * bytes / (fused.best_ms * 1e-3) / 1e9 / copy_gb_per_s, reference.best_ms,
              reference.best_ms / fused.best_ms);
  std::fflush(stdout);
  return reference.best_ms / fused.best_ms;
}

void bench_layer(const KernelsBenchOptions& o, int64_t batch, int64_t length) {
  const at::AutoGradMode grad_mode(true);
  model::IncrementalAttentionOptions lo;
  lo.hidden = 1024;
  lo.heads = 8;
  lo.decay_rank = 128;
  model::IncrementalAttention layer(lo);
  layer->to(at::kCUDA);
  const auto f32 = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  const at::Tensor x = at::randn({batch, length, lo.hidden}, f32);
  const at::Tensor dy = at::randn({batch, length, lo.hidden}, f32);
  const Timing step = time_cuda(
      [&] {
        for (auto& p : layer->parameters()) p.mutable_grad() = at::Tensor();
        layer->forward(x).backward(dy);
      },
      1, o.reference_repeats);
  KdaInputs in = make_inputs(batch, length, lo.heads, lo.head_k_dim, lo.head_v_dim);
  const at::Tensor q = in.q.to(at::kFloat).requires_grad_(true), k = in.k.to(at::kFloat).requires_grad_(true);
  const at::Tensor v = in.v.to(at::kFloat).requires_grad_(true), g = in.g.clone().requires_grad_(true);
  const at::Tensor beta = in.beta.to(at::kFloat).requires_grad_(true);
  const at::Tensor d_o = at::randn(v.sizes(), f32);
  const Timing core = time_cuda(
      [&] {
        for (const at::Tensor* t : {&q, &k, &v, &g, &beta}) t->mutable_grad() = at::Tensor();
        kda::chunked(q, k, v, g, beta, at::Tensor(), in.scale).o.backward(d_o);
      },
      1, o.reference_repeats);
  // At the other float32 matmul precisions the learner may set (model/precision.h): high, cuBLAS
  // TF32 for the projections; medium, that and the core's kernels on bf16 q, k, v, beta.
  auto layer_step = [&](model::Float32MatmulPrecision precision) {
    const model::Float32MatmulPrecisionScope scope(precision);
    return time_cuda(
        [&] {
          for (auto& p : layer->parameters()) p.mutable_grad() = at::Tensor();
          layer->forward(x).backward(dy);
        },
        1, o.reference_repeats);
  };
  const Timing step_high = layer_step(model::Float32MatmulPrecision::kHigh);
  const Timing step_medium = layer_step(model::Float32MatmulPrecision::kMedium);
  Timing core_medium;
  {
    const model::Float32MatmulPrecisionScope scope(model::Float32MatmulPrecision::kMedium);
    core_medium = time_cuda(
        [&] {
          for (const at::Tensor* t : {&q, &k, &v, &g, &beta}) t->mutable_grad() = at::Tensor();
          kda::chunked(q, k, v, g, beta, at::Tensor(), in.scale).o.backward(d_o);
        },
        1, o.reference_repeats);
  }
  std::printf("kda layer   B=%ld T=%ld hidden 1024, 8 heads of 128, fp32: forward + backward best %8.3f ms; "
              "its attention core alone %8.3f ms (%.0f%% of the layer)\n",
              static_cast<long>(batch), static_cast<long>(length), step.best_ms, core.best_ms,
              100.0 * core.best_ms / step.best_ms);
  std::printf("kda layer   the same at learner.float32_matmul_precision high (TF32 projections) %8.3f ms (%.2fx); "
              "medium (and the core on bf16 q, k, v, beta) %8.3f ms (%.2fx), its core alone %8.3f ms (%.2fx)\n",
              step_high.best_ms, step.best_ms / step_high.best_ms, step_medium.best_ms,
              step.best_ms / step_medium.best_ms, core_medium.best_ms, core.best_ms / core_medium.best_ms);
  std::fflush(stdout);
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

// ---- MoE per-stage breakdown ------------------------------------------------------------------------

// One row of a breakdown: a stage of the layer timed alone (CUDA events, best of N).
struct Stage {
  std::string name;
  double ms = 0;
  double flops = 0;     // matmul FLOPs (0: none counted)
  double bytes = 0;     // the bytes the stage has to move at least (0: not given)
  bool summed = true;   // false: a part of the row above or an extra, left out of the sum
};

double bytes_of(const at::Tensor& t) { return static_cast<double>(t.numel()) * t.element_size(); }

at::Tensor leaf(const at::Tensor& t) { return t.detach().requires_grad_(true); }

at::Tensor random_like(const at::Tensor& t) { return at::randn(t.sizes(), t.options()); }

// The layer's sizes as doubles, for the FLOP and byte counts: m tokens, d = hidden, e experts,
// top-k, l = latent, f = expert_ffn, rows = m k routed copies.
struct MoeSizes {
  double m, d, e, k, l, f, rows;
};
MoeSizes moe_sizes(const model::MoeOptions& mo, int64_t tokens) {
  const double m = static_cast<double>(tokens);
  return {m, static_cast<double>(mo.hidden), static_cast<double>(mo.num_experts),
          static_cast<double>(mo.top_k), static_cast<double>(mo.latent), static_cast<double>(mo.expert_ffn),
          m * mo.top_k};
}

std::string gemm_label(bool grouped) { return grouped ? " (at::_grouped_mm)" : " (loop over experts)"; }

// The sum of the summed rows.
double print_stages(const std::string& title, const std::vector<Stage>& stages,
                    const std::string& layer_name, double layer_ms) {
  std::printf("%s\n", title.c_str());
  std::printf("  %-66s %8s %7s %8s %6s\n", "stage (indented: a part of the row above or an extra, not summed)",
              "ms", "share", "TFLOP/s", "GB/s");
  double sum = 0;
  for (const Stage& s : stages) {
    if (s.summed) sum += s.ms;
    char tflops[32] = "", gb_per_s[32] = "";
    if (s.flops > 0 && s.ms > 0) std::snprintf(tflops, sizeof tflops, "%.1f", s.flops / (s.ms * 1e-3) / 1e12);
    if (s.bytes > 0 && s.ms > 0) std::snprintf(gb_per_s, sizeof gb_per_s, "%.0f", s.bytes / (s.ms * 1e-3) / 1e9);
    const std::string name = s.summed ? s.name : "  - " + s.name;
    std::printf("  %-66s %8.3f %6.1f%% %8s %6s\n", name.c_str(), s.ms,
                layer_ms > 0 ? 100.0 * s.ms / layer_ms : 0.0, tflops, gb_per_s);
  }
  std::printf("  %-66s %8.3f %6.1f%%\n", "sum of the stages", sum, layer_ms > 0 ? 100.0 * sum / layer_ms : 0.0);
  std::printf("  %-66s %8.3f %6.1f%%\n", layer_name.c_str(), layer_ms, 100.0);
  std::printf("  %-66s %8.3f %6.1f%%\n", "gap: launches, allocations, host and autograd overhead",
              layer_ms - sum, layer_ms > 0 ? 100.0 * (layer_ms - sum) / layer_ms : 0.0);
  std::fflush(stdout);
  return sum;
}

// The layer's values on one input as MoeImpl::forward computes them on CUDA (model/moe.cpp), without
// autograd: each stage of the breakdown is then timed alone on its real inputs.
struct MoeValues {
  at::Tensor tokens, scores, z, rows, gate, up, h, expert_out, u, normed, y_latent;
  kernels::MoeRouterTopk topk;
  kernels::MoePermutation perm;
  kernels::MoeExpertGroups groups;
  at::Tensor w_gate, w_up, w_down;  // the stacked expert weights as the forward's GEMMs take them
  int64_t shared_inner = 0;         // 0: no shared experts
  at::Tensor shared_gate, shared_up, shared_h;
};

// The shared experts' weights as MoeImpl::forward forms them (StackedExperts::sum_all as one MLP).
at::Tensor shared_gate_weight(model::MoeImpl& layer, int64_t inner) {
  return layer.shared_experts->gate_proj.reshape({inner, layer.options().hidden}).t();
}
at::Tensor shared_up_weight(model::MoeImpl& layer, int64_t inner) {
  return layer.shared_experts->up_proj.reshape({inner, layer.options().hidden}).t();
}
at::Tensor shared_down_weight(model::MoeImpl& layer, int64_t inner) {  // a copy, every forward
  return layer.shared_experts->down_proj.permute({1, 0, 2}).reshape({layer.options().hidden, inner}).t();
}

MoeValues moe_values(model::MoeImpl& layer, const at::Tensor& x, bool grouped) {
  const model::MoeOptions& mo = layer.options();
  MoeValues v;
  v.tokens = x.reshape({-1, mo.hidden});
  v.scores = layer.router->forward(v.tokens);
  v.topk = kernels::moe_router_topk(v.scores, layer.router->bias, mo.top_k);
  v.z = layer.latent_down->forward(v.tokens).contiguous();
  v.perm = kernels::moe_permutation(v.topk.ids, mo.num_experts);
  v.rows = kernels::moe_gather_rows(v.z, v.perm.token);
  v.groups = kernels::moe_expert_groups(v.perm.tokens_per_expert, v.perm.group_ends, grouped);
  v.w_gate = layer.experts->gate_proj.transpose(1, 2);
  v.w_up = layer.experts->up_proj.transpose(1, 2);
  v.w_down = layer.experts->down_proj.transpose(1, 2);
  v.gate = kernels::moe_expert_rows_times(v.rows, v.w_gate, v.groups);
  v.up = kernels::moe_expert_rows_times(v.rows, v.w_up, v.groups);
  v.h = kernels::situ_glu(v.gate, v.up, mo.situ_beta1, mo.situ_beta2);
  v.expert_out = kernels::moe_expert_rows_times(v.h, v.w_down, v.groups);
  v.u = kernels::moe_unpermute(v.expert_out, v.perm, v.topk.weights, at::kFloat);
  v.normed = layer.latent_norm->forward(v.u).to(x.scalar_type());
  v.y_latent = layer.latent_up->forward(v.normed);
  if (!layer.shared_experts.is_empty()) {
    v.shared_inner = layer.shared_experts->count() * layer.shared_experts->gate_proj.size(1);
    v.shared_gate = at::matmul(v.tokens, shared_gate_weight(layer, v.shared_inner)).contiguous();
    v.shared_up = at::matmul(v.tokens, shared_up_weight(layer, v.shared_inner)).contiguous();
    v.shared_h = kernels::situ_glu(v.shared_gate, v.shared_up, mo.situ_beta1, mo.situ_beta2);
  }
  return v;
}

// The forward (no autograd, as moe_forward_ms runs it), stage by stage.
std::vector<Stage> moe_forward_stages(const KernelsBenchOptions& o, model::MoeImpl& layer,
                                      const MoeValues& v, bool grouped) {
  const model::MoeOptions& mo = layer.options();
  const auto [m, d, e, k, l, f, rows] = moe_sizes(mo, v.tokens.size(0));
  const double b1 = mo.situ_beta1, b2 = mo.situ_beta2;
  auto best = [&](const std::function<void()>& fn) { return time_cuda(fn, o.warmup, o.repeats).best_ms; };
  const std::string gemm = gemm_label(grouped);
  std::vector<Stage> s;
  s.push_back({"router: x W_r^T (fp32 result; on the GPU one bf16 GEMM of W_r's 3 parts along K), sigmoid", best([&] { layer.router->forward(v.tokens); }),
               2 * m * d * e, 0});
  s.push_back({"top-k with the bias + p (moe_router_topk)",
               best([&] { kernels::moe_router_topk(v.scores, layer.router->bias, mo.top_k); }), 0,
               bytes_of(v.scores) + rows * (8 + 4)});
  {
    model::QuantileBalancerOptions bo;
    bo.num_experts = mo.num_experts;
    bo.top_k = mo.top_k;
    const model::QuantileBalancer balancer(bo);
    const std::pair<double, double> range = balancer.histogram_range();
    if (kernels::moe_quantile_histogram_supported(v.scores, mo.top_k)) {
      s.push_back({"quantile histogram (the balancer's, once a step; not in the layer)",
                   best([&] {
                     kernels::moe_quantile_histogram(v.scores, layer.router->bias, mo.top_k, bo.histogram_bins,
                                                     range.first, range.second, bo.literal_alpha);
                   }),
                   0, bytes_of(v.scores), /*summed=*/false});
    }
  }
  s.push_back({"latent down z = x W_down^T", best([&] { layer.latent_down->forward(v.tokens).contiguous(); }),
               2 * m * d * l, 0});
  s.push_back({"permutation: count, scan, place (moe_permutation)",
               best([&] { kernels::moe_permutation(v.topk.ids, mo.num_experts); }), 0, rows * 8 * 5});
  s.push_back({"gather rows z[token] (moe_gather_rows)", best([&] { kernels::moe_gather_rows(v.z, v.perm.token); }),
               0, 2 * bytes_of(v.rows) + rows * 8});
  // The routed experts: fused where MoeGemm::kAuto takes it (the four unfused rows are then the
  // chain it replaced, not summed), else the grouped / loop GEMMs and SiTU-GLU.
  const bool fused = kernels::moe_experts_fused_applies(v.rows, layer.experts->gate_proj, layer.experts->up_proj,
                                                        layer.experts->down_proj);
  if (fused) {
    s.push_back({"routed experts fused: G, U, SiTU-GLU, Y per tile (moe_experts_forward; G, U stored)",
                 best([&] {
                   kernels::moe_experts_fused_forward(v.rows, layer.experts->gate_proj, layer.experts->up_proj,
                                                      layer.experts->down_proj, v.perm, b1, b2, true);
                 }),
                 3 * 2 * rows * l * f, 0});
    s.push_back({"the same without storing G and U (inference)",
                 best([&] {
                   kernels::moe_experts_fused_forward(v.rows, layer.experts->gate_proj, layer.experts->up_proj,
                                                      layer.experts->down_proj, v.perm, b1, b2, false);
                 }),
                 3 * 2 * rows * l * f, 0, /*summed=*/false});
  }
  s.push_back({"experts gate GEMM X W_gate^T" + gemm,
               best([&] { kernels::moe_expert_rows_times(v.rows, v.w_gate, v.groups); }), 2 * rows * l * f, 0, !fused});
  s.push_back({"experts up GEMM X W_up^T" + gemm,
               best([&] { kernels::moe_expert_rows_times(v.rows, v.w_up, v.groups); }), 2 * rows * l * f, 0, !fused});
  s.push_back({"experts SiTU-GLU (fused kernel)", best([&] { kernels::situ_glu(v.gate, v.up, b1, b2); }), 0,
               3 * bytes_of(v.gate), !fused});
  s.push_back({"experts down GEMM H W_down^T" + gemm,
               best([&] { kernels::moe_expert_rows_times(v.h, v.w_down, v.groups); }), 2 * rows * f * l, 0, !fused});
  s.push_back({"un-permute u = sum_k p out (moe_unpermute, fp32 out)",
               best([&] { kernels::moe_unpermute(v.expert_out, v.perm, v.topk.weights, at::kFloat); }), 0,
               bytes_of(v.expert_out) + bytes_of(v.u) + rows * (8 + 4)});
  s.push_back({"latent RMSNorm (fp32) + cast", best([&] { layer.latent_norm->forward(v.u).to(v.tokens.scalar_type()); }),
               0, bytes_of(v.u) + bytes_of(v.normed)});
  s.push_back({"latent up W_up RMSNorm(u)", best([&] { layer.latent_up->forward(v.normed); }), 2 * m * l * d, 0});
  if (v.shared_inner > 0) {
    const double inner = static_cast<double>(v.shared_inner);
    const at::Tensor gate_w = shared_gate_weight(layer, v.shared_inner), up_w = shared_up_weight(layer, v.shared_inner);
    s.push_back({"shared gate and up GEMMs (two)",
                 best([&] {
                   at::matmul(v.tokens, gate_w).contiguous();
                   at::matmul(v.tokens, up_w).contiguous();
                 }),
                 2 * 2 * m * d * inner, 0});
    s.push_back({"shared SiTU-GLU (fused kernel)",
                 best([&] { kernels::situ_glu(v.shared_gate, v.shared_up, b1, b2); }), 0,
                 3 * bytes_of(v.shared_gate)});
    s.push_back({"shared down GEMM, y added in its epilogue (addmm; weight permuted by a copy)",
                 best([&] { (void)at::addmm(v.y_latent, v.shared_h, shared_down_weight(layer, v.shared_inner)); }),
                 2 * m * inner * d, 0});
  }
  return s;
}

// Times autograd's backward of a recorded graph (retained, so it runs again and again); the
// gradients are returned, not accumulated into .grad.
double time_backward(const KernelsBenchOptions& o, const std::vector<at::Tensor>& outputs,
                     const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& grads) {
  return time_cuda(
             [&] {
               torch::autograd::grad(outputs, inputs, grads, /*retain_graph=*/true, /*create_graph=*/false,
                                     /*allow_unused=*/true);
             },
             o.warmup, o.repeats)
      .best_ms;
}

// The backward, stage by stage: each stage's forward recorded once on leaves made of its real
// inputs (the same ops MoeImpl::forward records), then its backward alone, with a random gradient
// of its output's shape. Then the routed experts' backward step by step (no autograd).
std::vector<Stage> moe_backward_stages(const KernelsBenchOptions& o, model::MoeImpl& layer,
                                       const MoeValues& v, const at::Tensor& dy, bool grouped) {
  const model::MoeOptions& mo = layer.options();
  const auto [m, d, e, k, l, f, rows] = moe_sizes(mo, v.tokens.size(0));
  const double b1 = mo.situ_beta1, b2 = mo.situ_beta2;
  auto best = [&](const std::function<void()>& fn) { return time_cuda(fn, o.warmup, o.repeats).best_ms; };
  const std::string gemm = gemm_label(grouped);
  const at::Tensor dy2d = dy.reshape({-1, mo.hidden});
  std::vector<Stage> s;
  const c10::AutoGradMode grad_mode(true);
  if (v.shared_inner > 0) {
    const double inner = static_cast<double>(v.shared_inner);
    {
      const at::Tensor h = leaf(v.shared_h);
      const at::Tensor y = at::matmul(h, shared_down_weight(layer, v.shared_inner));
      s.push_back({"shared down GEMM backward: d H, d W (and the weight copy's)",
                   time_backward(o, {y}, {h, layer.shared_experts->down_proj}, {dy2d}), 2 * 2 * m * inner * d, 0});
    }
    {
      const at::Tensor g = leaf(v.shared_gate), u = leaf(v.shared_up);
      const at::Tensor h = kernels::situ_glu_autograd(g, u, b1, b2);
      s.push_back({"shared SiTU-GLU backward (fused kernel)", time_backward(o, {h}, {g, u}, {random_like(h)}), 0,
                   5 * bytes_of(v.shared_gate)});
    }
    {
      const at::Tensor t = leaf(v.tokens);
      const at::Tensor g = at::matmul(t, shared_gate_weight(layer, v.shared_inner)).contiguous();
      const at::Tensor u = at::matmul(t, shared_up_weight(layer, v.shared_inner)).contiguous();
      s.push_back({"shared gate and up GEMMs backward: d x (two, added), d W_gate, d W_up",
                   time_backward(o, {g, u}, {t, layer.shared_experts->gate_proj, layer.shared_experts->up_proj},
                                 {random_like(g), random_like(u)}),
                   2 * 2 * 2 * m * d * inner, 0});
    }
  }
  {
    const at::Tensor n = leaf(v.normed);
    const at::Tensor y = layer.latent_up->forward(n);
    s.push_back({"latent up backward: d RMSNorm(u), d W_up",
                 time_backward(o, {y}, {n, layer.latent_up->weight}, {dy2d}), 2 * 2 * m * l * d, 0});
  }
  {
    const at::Tensor u = leaf(v.u);
    const at::Tensor n = layer.latent_norm->forward(u).to(v.tokens.scalar_type());
    s.push_back({"latent RMSNorm + cast backward (fp32)",
                 time_backward(o, {n}, {u, layer.latent_norm->weight}, {random_like(n)}), 0,
                 2 * bytes_of(v.u) + bytes_of(v.normed)});
  }
  {
    const at::Tensor out = leaf(v.expert_out), p = leaf(v.topk.weights);
    const at::Tensor u = kernels::moe_unpermute_autograd(out, v.perm, p);
    s.push_back({"un-permute backward: d copies, d p (one pass)",
                 time_backward(o, {u}, {out, p}, {random_like(u)}), 0,
                 bytes_of(v.u) + 2 * bytes_of(v.expert_out) + rows * (8 + 4 + 4)});
  }
  {
    const at::Tensor x = leaf(v.rows);
    const at::Tensor y = kernels::moe_experts_autograd(x, layer.experts->gate_proj, layer.experts->up_proj,
                                                       layer.experts->down_proj, v.perm, b1, b2);
    s.push_back({"routed experts backward (MoeExpertsFunction, all below)",
                 time_backward(o, {y}, {x, layer.experts->gate_proj, layer.experts->up_proj, layer.experts->down_proj},
                               {random_like(y)}),
                 2 * 3 * 2 * rows * l * f, 0});
  }
  {  // The experts' backward step by step, as MoeExpertsFunction::backward runs it.
    const c10::NoGradGuard no_grad;
    const kernels::MoeExpertGroups& g = v.groups;
    const at::Tensor d_out = random_like(v.expert_out);
    const at::Tensor dh = kernels::moe_expert_rows_times(d_out, layer.experts->down_proj, g);
    const kernels::SituGluBackwardWithH ds = kernels::situ_glu_backward_with_h(v.gate, v.up, dh, b1, b2);
    // What the Function runs when its forward ran fused (kAuto here): dX and the weight gradients
    // as one kernel each; the grouped GEMMs they replaced are listed after them.
    const bool one_kernel = kernels::moe_experts_fused_applies(v.rows, layer.experts->gate_proj,
                                                               layer.experts->up_proj, layer.experts->down_proj);
    s.push_back({"dH = dY W_down" + gemm,
                 best([&] { kernels::moe_expert_rows_times(d_out, layer.experts->down_proj, g); }),
                 2 * rows * l * f, 0, false});
    s.push_back({"SiTU-GLU backward, recomputing H in the same pass",
                 best([&] { kernels::situ_glu_backward_with_h(v.gate, v.up, dh, b1, b2); }), 0,
                 6 * bytes_of(v.gate), false});
    s.push_back({"the two passes it replaced: situ_glu (H), then situ_glu_backward",
                 best([&] {
                   kernels::situ_glu(v.gate, v.up, b1, b2);
                   kernels::situ_glu_backward(v.gate, v.up, dh, b1, b2);
                 }),
                 0, 8 * bytes_of(v.gate), false});
    if (one_kernel) {
      s.push_back({"dX = dG W_gate + dU W_up in one kernel (moe_experts_dx)",
                   best([&] {
                     kernels::moe_experts_dx(ds.d_gate, ds.d_up, layer.experts->gate_proj, layer.experts->up_proj,
                                             v.perm.group_ends);
                   }),
                   2 * 2 * rows * f * l, 0, false});
    }
    s.push_back({std::string(one_kernel ? "the GEMMs it replaced: " : "") +
                     "dX = dG W_gate + dU W_up (two GEMMs, added in place)" + gemm,
                 best([&] {
                   at::Tensor dx = kernels::moe_expert_rows_times(ds.d_gate, layer.experts->gate_proj, g);
                   dx.add_(kernels::moe_expert_rows_times(ds.d_up, layer.experts->up_proj, g));
                 }),
                 2 * 2 * rows * f * l, 0, false});
    if (one_kernel) {
      s.push_back({"dW_gate, dW_up, dW_down in one kernel, empty experts zeroed (moe_experts_weight_grads)",
                   best([&] {
                     kernels::moe_experts_weight_grads(v.rows, ds.d_gate, ds.d_up, d_out, ds.h, v.perm.group_ends,
                                                       true, true);
                   }),
                   3 * 2 * rows * l * f, 0, false});
    }
    s.push_back({std::string(one_kernel ? "the GEMMs it replaced: " : "") +
                     "dW_gate, dW_up, dW_down (2d x 2d, empty experts zeroed)" + gemm,
                 best([&] {
                   kernels::moe_expert_weight_grad(ds.d_gate, v.rows, g);
                   kernels::moe_expert_weight_grad(ds.d_up, v.rows, g);
                   kernels::moe_expert_weight_grad(d_out, ds.h, g);
                 }),
                 3 * 2 * rows * l * f, 0, false});
  }
  {
    const at::Tensor z = leaf(v.z);
    const at::Tensor r = kernels::moe_permute_autograd(z, v.perm);
    s.push_back({"gather backward: each token's copies summed (moe_unpermute)",
                 time_backward(o, {r}, {z}, {random_like(r)}), 0, bytes_of(v.rows) + bytes_of(v.z) + rows * 8});
  }
  {
    const at::Tensor t = leaf(v.tokens);
    const at::Tensor z = layer.latent_down->forward(t).contiguous();
    s.push_back({"latent down backward: d x, d W_down",
                 time_backward(o, {z}, {t, layer.latent_down->weight}, {random_like(z)}), 2 * 2 * m * d * l, 0});
  }
  {
    // What the layer runs (kernels::router_weights_autograd): p as one Function of x and W_r.
    const at::Tensor t = leaf(v.tokens);
    const at::Tensor weight = layer.router->weight.detach().requires_grad_(true);
    const at::Tensor p = kernels::router_weights_autograd(t, weight, v.scores, v.topk.ids, &v.perm);
    s.push_back({"router backward through p, sparse: the k selected logits' gradients, d x and d W_r from them",
                 time_backward(o, {p}, {t, weight}, {random_like(p)}), 2 * 2 * m * d * e, 0});
    // Its three steps alone (what RouterWeightsFunction's backward runs).
    const at::Tensor dp = random_like(p);
    const at::Tensor d_logits = kernels::moe_router_logit_gradient(v.scores, v.topk.ids, dp);
    s.push_back({"the selected logits' gradient through p and the sigmoid (moe_router_logit_gradient)",
                 best([&] { kernels::moe_router_logit_gradient(v.scores, v.topk.ids, dp); }), 0, rows * 24, false});
    s.push_back({"d x: W_r's rows of the selection, fp32 sums (moe_router_dx)",
                 best([&] { kernels::moe_router_dx(d_logits, v.topk.ids, weight); }), 0, rows * 12 + m * d * 2,
                 false});
    s.push_back({"d W_r: each expert's rows of x in permuted order, fp32 sums (moe_router_dw)",
                 best([&] { kernels::moe_router_dw(d_logits, v.tokens, v.perm, weight.scalar_type()); }), 0,
                 rows * d * 2, false});
    // The autograd chain it replaced: p on the tape, then the sigmoid and RouterLogitsFunction.
    const at::Tensor scores = leaf(v.scores);
    const at::Tensor chosen = scores.gather(/*dim=*/1, v.topk.ids);
    const at::Tensor p_tape = chosen / chosen.sum(/*dim=*/{-1}, /*keepdim=*/true);
    s.push_back({"the chain it replaced: p on the autograd tape backward (gather, sum, divide)",
                 time_backward(o, {p_tape}, {scores}, {random_like(p_tape)}), 0, bytes_of(v.scores), false});
    const at::Tensor router_scores = layer.router->forward(t);
    s.push_back({"and the router's backward: sigmoid, casts and splits, d x and d W_r",
                 time_backward(o, {router_scores}, {t, layer.router->weight}, {random_like(router_scores)}),
                 2 * 2 * m * d * e, 0, false});
  }
  return s;
}

// The routed experts' GEMMs on their exact grouped shapes (tokens per expert as routed; and the
// same rows spread evenly over the experts) against one dense matmul of the same shape and FLOPs.
void moe_grouped_gemm_comparison(const KernelsBenchOptions& o, model::MoeImpl& layer, const MoeValues& v,
                                 bool grouped) {
  const c10::NoGradGuard no_grad;
  const model::MoeOptions& mo = layer.options();
  const int64_t experts = mo.num_experts, rows = v.rows.size(0);
  const double l = mo.latent, f = mo.expert_ffn, r = static_cast<double>(rows);
  auto best = [&](const std::function<void()>& fn) { return time_cuda(fn, o.warmup, o.repeats).best_ms; };
  const at::Tensor counts = v.perm.tokens_per_expert.cpu();
  const int64_t fewest = counts.min().item<int64_t>(), most = counts.max().item<int64_t>();
  const int64_t empty = (counts == 0).sum().item<int64_t>();
  // Even groups: rows / E each, the first rows % E experts one more.
  at::Tensor even = at::full({experts}, rows / experts, at::kLong);
  even.narrow(0, 0, rows % experts).add_(1);
  const at::Tensor even_counts = even.to(v.rows.device());
  const at::Tensor even_ends = at::cumsum(even, 0).to(at::kInt).to(v.rows.device());
  const kernels::MoeExpertGroups balanced = kernels::moe_expert_groups(even_counts, even_ends, grouped);
  std::printf("moe expert GEMMs on their grouped shapes: %s, %ld groups, rows per expert as routed min %ld / mean "
              "%.1f / max %ld, %ld experts without rows; vs one dense at::mm of the same shape and FLOPs\n",
              grouped ? "at::_grouped_mm" : "per-expert loop (at::_grouped_mm does not apply here)",
              static_cast<long>(experts), static_cast<long>(fewest), r / experts, static_cast<long>(most),
              static_cast<long>(empty));
  std::printf("  %-40s %22s %22s %22s %7s\n", "product", "grouped as routed", "grouped, even rows", "dense",
              "ratio");
  const at::Tensor d_out = random_like(v.expert_out);
  const at::Tensor dh = kernels::moe_expert_rows_times(d_out, layer.experts->down_proj, v.groups);
  const kernels::SituGluBackwardWithH ds =
      kernels::situ_glu_backward_with_h(v.gate, v.up, dh, mo.situ_beta1, mo.situ_beta2);
  struct Product {
    std::string name;
    std::function<void(const kernels::MoeExpertGroups&)> run_grouped;
    std::function<void()> dense;
    double flops;
  };
  const at::Tensor& gate_proj = layer.experts->gate_proj;
  const at::Tensor& down_proj = layer.experts->down_proj;
  const std::vector<Product> products = {
      {"X W_gate^T [R, L] x [E: L, F] (fwd)",
       [&](const kernels::MoeExpertGroups& g) { kernels::moe_expert_rows_times(v.rows, v.w_gate, g); },
       [&] { at::mm(v.rows, v.w_gate.select(0, 0)); }, 2 * r * l * f},
      {"H W_down^T [R, F] x [E: F, L] (fwd)",
       [&](const kernels::MoeExpertGroups& g) { kernels::moe_expert_rows_times(v.h, v.w_down, g); },
       [&] { at::mm(v.h, v.w_down.select(0, 0)); }, 2 * r * f * l},
      {"dY W_down [R, L] x [E: L, F] (bwd dH)",
       [&](const kernels::MoeExpertGroups& g) { kernels::moe_expert_rows_times(d_out, down_proj, g); },
       [&] { at::mm(d_out, down_proj.select(0, 0)); }, 2 * r * l * f},
      {"dG W_gate [R, F] x [E: F, L] (bwd dX)",
       [&](const kernels::MoeExpertGroups& g) { kernels::moe_expert_rows_times(ds.d_gate, gate_proj, g); },
       [&] { at::mm(ds.d_gate, gate_proj.select(0, 0)); }, 2 * r * f * l},
      {"dG^T X [E: F, R_e] x [R_e, L] (bwd dW)",
       [&](const kernels::MoeExpertGroups& g) { kernels::moe_expert_weight_grad(ds.d_gate, v.rows, g); },
       [&] { at::mm(ds.d_gate.t(), v.rows); }, 2 * r * f * l},
      {"dY^T H [E: L, R_e] x [R_e, F] (bwd dW)",
       [&](const kernels::MoeExpertGroups& g) { kernels::moe_expert_weight_grad(d_out, ds.h, g); },
       [&] { at::mm(d_out.t(), ds.h); }, 2 * r * l * f},
  };
  auto cell = [](double ms, double flops) {
    char text[64];
    std::snprintf(text, sizeof text, "%.3f ms %6.1f TF/s", ms, flops / (ms * 1e-3) / 1e12);
    return std::string(text);
  };
  for (const Product& p : products) {
    const double routed_ms = best([&] { p.run_grouped(v.groups); });
    const double even_ms = best([&] { p.run_grouped(balanced); });
    const double dense_ms = best([&] { p.dense(); });
    std::printf("  %-40s %22s %22s %22s %7.2f\n", p.name.c_str(), cell(routed_ms, p.flops).c_str(),
                cell(even_ms, p.flops).c_str(), cell(dense_ms, p.flops).c_str(), dense_ms / routed_ms);
  }
  std::printf("  (ratio: the dense matmul's time over the grouped one's as routed; 1 = as fast as dense)\n");
  if (kernels::moe_experts_fused_applies(v.rows, layer.experts->gate_proj, layer.experts->up_proj, down_proj)) {
    // The fused forward does all three forward products (and SiTU-GLU) in one kernel: against the
    // three dense matmuls of the same shapes.
    kernels::MoePermutation even_perm = v.perm;
    even_perm.group_ends = even_ends;
    const double dense_ms = best([&] {
      at::mm(v.rows, v.w_gate.select(0, 0));
      at::mm(v.rows, v.w_up.select(0, 0));
      at::mm(v.h, v.w_down.select(0, 0));
    });
    const double flops = 3 * 2 * r * l * f;
    const bool wgmma = kernels::moe_experts_forward_wgmma_supported(mo.latent, mo.expert_ffn, mo.num_experts);
    for (const auto kernel : {kernels::MoeExpertsKernel::kMmaSync, kernels::MoeExpertsKernel::kWgmma}) {
      if (kernel == kernels::MoeExpertsKernel::kWgmma && !wgmma) continue;
      auto fused = [&](const kernels::MoePermutation& p) {
        kernels::moe_experts_fused_forward(v.rows, gate_proj, layer.experts->up_proj, down_proj, p, mo.situ_beta1,
                                           mo.situ_beta2, true, kernel);
      };
      const double routed_ms = best([&] { fused(v.perm); });
      const double even_ms = best([&] { fused(even_perm); });
      std::printf("  %-40s %22s %22s %22s %7.2f\n",
                  kernel == kernels::MoeExpertsKernel::kWgmma ? "fused forward, wgmma (sm_90)"
                                                              : "fused forward, mma.sync (+ G, U)",
                  cell(routed_ms, flops).c_str(), cell(even_ms, flops).c_str(), cell(dense_ms, flops).c_str(),
                  dense_ms / routed_ms);
    }
    std::printf("  (fused: moe_experts_forward, one kernel: G, U, SiTU-GLU, Y, storing G and U, against the three\n"
                "   dense matmuls of its products; the layer runs the wgmma kernel where it applies)\n");
  }
  if (kernels::moe_experts_dx_applies(ds.d_gate, gate_proj)) {
    // dX = dG W_gate + dU W_up in one kernel, against the two dense matmuls of the same shapes.
    const double dense_ms = best([&] {
      at::mm(ds.d_gate, gate_proj.select(0, 0));
      at::mm(ds.d_up, layer.experts->up_proj.select(0, 0));
    });
    const double flops = 2 * 2 * r * l * f;
    const bool wgmma = kernels::moe_experts_dx_wgmma_supported(mo.latent, mo.expert_ffn, mo.num_experts);
    for (const auto kernel : {kernels::MoeExpertsKernel::kMmaSync, kernels::MoeExpertsKernel::kWgmma}) {
      if (kernel == kernels::MoeExpertsKernel::kWgmma && !wgmma) continue;
      auto dx = [&](const at::Tensor& ends) {
        kernels::moe_experts_dx(ds.d_gate, ds.d_up, gate_proj, layer.experts->up_proj, ends, kernel);
      };
      const double routed_ms = best([&] { dx(v.perm.group_ends); });
      const double even_ms = best([&] { dx(even_ends); });
      std::printf("  %-40s %22s %22s %22s %7.2f\n",
                  kernel == kernels::MoeExpertsKernel::kWgmma ? "dX: dG W_gate + dU W_up, wgmma" : "dX: dG W_gate + dU W_up, mma.sync",
                  cell(routed_ms, flops).c_str(), cell(even_ms, flops).c_str(), cell(dense_ms, flops).c_str(),
                  dense_ms / routed_ms);
    }
  }
  if (kernels::moe_experts_weight_grads_applies(v.rows, gate_proj)) {
    // The three weight gradients in one kernel, against the three dense matmuls of the same shapes.
    const double dense_ms = best([&] {
      at::mm(ds.d_gate.t(), v.rows);
      at::mm(ds.d_up.t(), v.rows);
      at::mm(d_out.t(), ds.h);
    });
    const double flops = 3 * 2 * r * l * f;
    const bool wgmma = kernels::moe_experts_weight_grads_wgmma_supported(mo.latent, mo.expert_ffn, mo.num_experts);
    for (const auto kernel : {kernels::MoeExpertsKernel::kMmaSync, kernels::MoeExpertsKernel::kWgmma}) {
      if (kernel == kernels::MoeExpertsKernel::kWgmma && !wgmma) continue;
      auto grads = [&](const at::Tensor& ends) {
        kernels::moe_experts_weight_grads(v.rows, ds.d_gate, ds.d_up, d_out, ds.h, ends, true, true, kernel);
      };
      const double routed_ms = best([&] { grads(v.perm.group_ends); });
      const double even_ms = best([&] { grads(even_ends); });
      std::printf("  %-40s %22s %22s %22s %7.2f\n",
                  kernel == kernels::MoeExpertsKernel::kWgmma ? "weight grads: dG^T X, dU^T X, dY^T H, wgmma"
                                                              : "weight grads: dG^T X, dU^T X, dY^T H, mma.sync",
                  cell(routed_ms, flops).c_str(), cell(even_ms, flops).c_str(), cell(dense_ms, flops).c_str(),
                  dense_ms / routed_ms);
    }
    std::printf("  (dX: moe_experts_dx, weight grads: moe_experts_weight_grads, one kernel each, against the dense "
                "matmuls of their products)\n");
  }
  std::fflush(stdout);
}

// The router's matmul as an fp32 GEMM on CUDA cores (the reference's) against the same product in
// bf16: what the split bf16 GEMMs the layer runs on the GPU (kernels::router_logits_autograd) save.
void moe_router_precision(const KernelsBenchOptions& o, model::MoeImpl& layer, const MoeValues& v) {
  const c10::NoGradGuard no_grad;
  const double flops = 2.0 * v.tokens.size(0) * v.tokens.size(1) * layer.router->weight.size(0);
  const at::Tensor x32 = v.tokens.to(at::kFloat), w32 = layer.router->weight.to(at::kFloat);
  const at::Tensor w16 = w32.to(v.tokens.scalar_type());
  const double fp32_ms = time_cuda([&] { at::matmul(x32, w32.t()); }, o.warmup, o.repeats).best_ms;
  const double bf16_ms = time_cuda([&] { at::matmul(v.tokens, w16.t()); }, o.warmup, o.repeats).best_ms;
  std::printf("moe router matmul [%ld, %ld] x [%ld, %ld] (%.1f GFLOP; the backward has two more): one fp32 "
              "GEMM (the reference) %.3f ms (%.1f TFLOP/s), one bf16 GEMM %.3f ms (%.1f TFLOP/s): %.1fx; the layer "
              "runs three bf16 GEMMs with fp32 results (W_r in 3 bf16 parts; x is bf16: exact products)\n",
              static_cast<long>(v.tokens.size(0)), static_cast<long>(v.tokens.size(1)),
              static_cast<long>(v.tokens.size(1)), static_cast<long>(layer.router->weight.size(0)), flops / 1e9,
              fp32_ms, flops / (fp32_ms * 1e-3) / 1e12, bf16_ms, flops / (bf16_ms * 1e-3) / 1e12, fp32_ms / bf16_ms);
  std::fflush(stdout);
}

// Runs one part of the breakdown; a failure is printed and the bench goes on (the final lines stay).
void breakdown_part(const char* what, const std::function<void()>& part) {
  try {
    part();
  } catch (const c10::Error& e) {
    std::printf("moe breakdown: %s failed: %s\n", what, e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::printf("moe breakdown: %s failed: %s\n", what, e.what());
  }
  std::fflush(stdout);
}

// Where the layer's time goes: forward and backward stage by stage on the same inputs, each against
// the layer's measured time, the grouped GEMMs against dense matmuls, the router's precision.
void bench_moe_breakdown(const KernelsBenchOptions& o, model::MoeImpl& layer, const at::Tensor& x,
                         const at::Tensor& dy, bool grouped, KernelsBenchResult& r) {
  const c10::NoGradGuard no_grad;
  MoeValues v;
  breakdown_part("the layer's values", [&] { v = moe_values(layer, x, grouped); });
  if (!v.y_latent.defined()) return;
  double tape_ms = 0;
  breakdown_part("forward", [&] {
    const std::vector<Stage> stages = moe_forward_stages(o, layer, v, grouped);
    char title[200];
    std::snprintf(title, sizeof title,
                  "moe breakdown: forward (no autograd), each stage alone on the layer's inputs, best of %d",
                  o.repeats);
    r.moe_forward_stages_ms = print_stages(title, stages, "layer forward (moe_forward_ms above)", r.moe_forward_ms);
    tape_ms = time_cuda(
                  [&] {
                    const at::Tensor chosen = v.scores.gather(/*dim=*/1, v.topk.ids);
                    (void)(chosen / chosen.sum(/*dim=*/{-1}, /*keepdim=*/true));
                  },
                  o.warmup, o.repeats)
                  .best_ms;
  });
  breakdown_part("backward", [&] {
    {  // The layer's backward alone: autograd's backward of one recorded forward, retained.
      const c10::AutoGradMode grad_mode(true);
      const at::Tensor input = leaf(x);
      const model::MoeOutput out = layer.forward(input);
      std::vector<at::Tensor> inputs = {input};
      for (const at::Tensor& p : layer.parameters()) inputs.push_back(p);
      r.moe_backward_ms = time_backward(o, {out.y}, inputs, {dy});
    }
    const std::vector<Stage> stages = moe_backward_stages(o, layer, v, dy, grouped);
    char title[200];
    std::snprintf(title, sizeof title,
                  "moe breakdown: backward, each stage's autograd backward alone (its forward recorded once), "
                  "best of %d",
                  o.repeats);
    r.moe_backward_stages_ms =
        print_stages(title, stages, "layer backward (autograd of one recorded forward)", r.moe_backward_ms);
    const double stages_ms = r.moe_forward_stages_ms + tape_ms + r.moe_backward_stages_ms;
    std::printf("moe breakdown: forward + backward: forward stages %.3f + p on the autograd tape %.3f + backward "
                "stages %.3f = %.3f ms vs the layer's %.3f ms (moe_train_ms; gap %.3f ms); layer forward %.3f + "
                "backward %.3f = %.3f ms\n",
                r.moe_forward_stages_ms, tape_ms, r.moe_backward_stages_ms, stages_ms, r.moe_train_ms,
                r.moe_train_ms - stages_ms, r.moe_forward_ms, r.moe_backward_ms,
                r.moe_forward_ms + r.moe_backward_ms);
  });
  breakdown_part("grouped GEMMs vs dense", [&] { moe_grouped_gemm_comparison(o, layer, v, grouped); });
  breakdown_part("router precision", [&] { moe_router_precision(o, layer, v); });
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
    const NvtxRange range(!kernels ? "moe reference step" : backward ? "moe train step" : "moe forward");
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
  {
    // The host's side of the same step: the wall time to enqueue it (the autograd engine returns once
    // the backward's kernels are issued), from an idle GPU. Close to the step's GPU time: the step is
    // bound by the host (launches, dispatch, autograd), and the GPU waits between kernels.
    std::vector<double> host_ms;
    for (int i = 0; i < std::max(1, o.repeats); ++i) {
      at::cuda::getCurrentCUDAStream().synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      step(true, true);
      host_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(host_ms.begin(), host_ms.end());
    at::cuda::getCurrentCUDAStream().synchronize();
    std::printf("moe layer   forward + backward: the host enqueues it in best %.3f ms, median %.3f ms (GPU best %.3f ms)\n",
                host_ms.front(), host_ms[host_ms.size() / 2], train.best_ms);
  }
  double graph_ms = 0;  // the step as a CUDA graph, where it could be captured
  {
    // The same step captured once as a CUDA graph and replayed: the GPU's time for the step's
    // kernels without the host between them (launch gaps, allocations, autograd's dispatch). What
    // the layer would take where the host cannot keep up (the line above), and what graph capture
    // of the training step would buy. The capture runs on a side stream (the legacy stream cannot
    // capture); a step that cannot be captured (an op that syncs with the host) is reported.
    try {
      at::cuda::CUDAGraph graph;
      const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
      const c10::cuda::CUDAStreamGuard on_side(side);
      step(true, true);  // allocations and autograd's first-use work outside the capture
      side.synchronize();
      graph.capture_begin();
      step(true, true);
      graph.capture_end();
      const Timing replay = time_cuda([&] { graph.replay(); }, o.warmup, o.repeats);
      graph_ms = replay.best_ms;
      std::printf("moe layer   forward + backward as one CUDA graph: replay best %8.3f ms  median %8.3f ms "
                  "(launched: %.3f ms)\n",
                  replay.best_ms, replay.median_ms, train.best_ms);
    } catch (const std::exception& e) {
      std::printf("moe layer   forward + backward as one CUDA graph: not captured (%s)\n", e.what());
    }
  }
  std::fflush(stdout);
  const double dense_forward = dense_tflops(o, tokens, flops);
  r.moe_dense_tflops = dense_tflops(o, tokens, 3 * flops);
  r.moe_vs_dense = r.moe_train_tflops / r.moe_dense_tflops;
  std::printf("moe layer   vs dense matmul of the same FLOPs: forward %.2f, forward + backward %.2f (goal >= 0.7)",
              r.moe_forward_tflops / dense_forward, r.moe_vs_dense);
  if (graph_ms > 0) {
    std::printf("; forward + backward as one CUDA graph %.2f", 3 * flops / (graph_ms * 1e-3) / 1e12 / r.moe_dense_tflops);
  }
  std::printf("\n");
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
  {
    // The layer as the learner trains it (fp32 parameters and activations, model/precision.h): at
    // highest its routed experts have only a loop over the experts; at medium they run the fused
    // bf16 kernels on rounded copies. Timed with the same step, best of a few.
    model::Moe fp32(mo);
    fp32->to(at::kCUDA, at::kFloat);
    fp32->set_expert_bias(layer->router->bias);
    const at::Tensor x32 = x.to(at::kFloat), dy32 = dy.to(at::kFloat);
    auto fp32_step = [&](model::Float32MatmulPrecision precision) {
      const model::Float32MatmulPrecisionScope scope(precision);
      const c10::AutoGradMode grad(true);
      return time_cuda(
          [&] {
            const at::Tensor input = x32.detach().requires_grad_(true);
            for (auto& p : fp32->parameters()) p.mutable_grad() = at::Tensor();
            fp32->forward(input).y.backward(dy32);
          },
          1, std::max(1, o.reference_repeats));
    };
    const Timing highest = fp32_step(model::Float32MatmulPrecision::kHighest);
    const Timing medium = fp32_step(model::Float32MatmulPrecision::kMedium);
    std::printf("moe layer   fp32 (the learner's dtype) forward + backward: highest %8.3f ms, "
                "learner.float32_matmul_precision medium %8.3f ms (%.1fx; bf16 layer above %.3f ms)\n",
                highest.best_ms, medium.best_ms, highest.best_ms / medium.best_ms, train.best_ms);
    // The routed experts alone in fp32 at highest, forward + backward on the same rows and
    // permutation: cuBLAS's grouped GEMMs (what kAuto takes for fp32) against one at::mm an expert
    // (the loop the layer ran before them).
    const at::Tensor rows32 = at::randn({tokens * mo.top_k, mo.latent}, x32.options());
    if (kernels::cublas_grouped_gemm_applies(rows32, fp32->experts->gate_proj)) {
      const model::Float32MatmulPrecisionScope scope(model::Float32MatmulPrecision::kHighest);
      const at::Tensor scores = fp32->router->forward(x32);
      const kernels::MoePermutation perm = kernels::moe_permutation(
          kernels::moe_router_topk(scores, fp32->router->bias, mo.top_k).ids, mo.num_experts);
      const at::Tensor dy_rows = at::randn_like(rows32);
      auto experts_step = [&](kernels::MoeGemm gemm) {
        const c10::AutoGradMode grad(true);
        return time_cuda(
            [&] {
              const at::Tensor input = rows32.detach().requires_grad_(true);
              for (auto& p : fp32->experts->parameters()) p.mutable_grad() = at::Tensor();
              kernels::moe_experts_autograd(input, fp32->experts->gate_proj, fp32->experts->up_proj,
                                            fp32->experts->down_proj, perm, mo.situ_beta1, mo.situ_beta2, gemm)
                  .backward(dy_rows);
            },
            1, std::max(1, o.reference_repeats));
      };
      const Timing cublas = experts_step(kernels::MoeGemm::kCublas);
      const Timing loop = experts_step(kernels::MoeGemm::kLoop);
      std::printf("moe experts fp32 at highest, forward + backward: grouped GEMMs (kernels/grouped_gemm.h, kAuto) %8.3f ms, one at::mm an "
                  "expert %8.3f ms (%.1fx)\n",
                  cublas.best_ms, loop.best_ms, loop.best_ms / cublas.best_ms);

      // The fp32 grouped GEMMs alone, on the routed experts' shapes at a learner chunk's tokens and at
      // the bench's: our CUDA-core kernels (both thread forms; kAuto takes one for fp32) against cuBLAS's grouped
      // GEMM (kCublas, the baseline), the same operands in the same run. Six products: the forward's
      // gate, up and down, and the three weight gradients (dX's products are the forward's kind).
      for (const int64_t chunk_tokens : {std::min<int64_t>(2048, tokens), tokens}) {
        const at::Tensor chunk_scores = scores.narrow(0, 0, chunk_tokens);
        const kernels::MoePermutation chunk_perm = kernels::moe_permutation(
            kernels::moe_router_topk(chunk_scores, fp32->router->bias, mo.top_k).ids, mo.num_experts);
        const at::Tensor counts_host = chunk_perm.tokens_per_expert.to(at::kCPU).contiguous();
        const std::vector<int64_t> counts(counts_host.data_ptr<int64_t>(),
                                          counts_host.data_ptr<int64_t>() + counts_host.numel());
        const int64_t R = chunk_tokens * mo.top_k;
        const at::Tensor xr = rows32.narrow(0, 0, R), hr = at::randn({R, mo.expert_ffn}, xr.options());
        const at::Tensor dg = at::randn({R, mo.expert_ffn}, xr.options()), dyr = dy_rows.narrow(0, 0, R);
        const at::Tensor& gate_w = fp32->experts->gate_proj;  // [E, F, L]
        const at::Tensor& down_w = fp32->experts->down_proj;  // [E, L, F]
        auto products = [&](kernels::GroupedGemmBackend backend) {
          return time_cuda(
              [&] {
                kernels::grouped_rows_times(xr, gate_w.transpose(1, 2), counts, backend);
                kernels::grouped_rows_times(xr, fp32->experts->up_proj.transpose(1, 2), counts, backend);
                kernels::grouped_rows_times(hr, down_w.transpose(1, 2), counts, backend);
                kernels::grouped_weight_grad(dg, xr, counts, backend);
                kernels::grouped_weight_grad(dg, xr, counts, backend);
                kernels::grouped_weight_grad(dyr, hr, counts, backend);
              },
              o.warmup, o.repeats);
        };
        const Timing simt8 = products(kernels::GroupedGemmBackend::kSimt8x8);
        const Timing simt4 = products(kernels::GroupedGemmBackend::kSimt4x4);
        const Timing cublas_gemms = products(kernels::GroupedGemmBackend::kCublas);
        const double tflop = 12.0 * static_cast<double>(R) * static_cast<double>(mo.latent) *
                             static_cast<double>(mo.expert_ffn) / 1e12;
        auto rate = [&](const Timing& t) { return tflop / (t.best_ms * 1e-3); };
        std::printf("moe experts fp32 grouped GEMMs, %ld tokens (%.0f rows an expert), 6 products: CUDA-core kernels "
                    "8x8 a thread %8.3f ms (%.1f TFLOP/s), 4x4 a thread %8.3f ms (%.1f TFLOP/s); cuBLAS grouped GEMM "
                    "%8.3f ms (%.1f TFLOP/s): %.2fx / %.2fx\n",
                    static_cast<long>(chunk_tokens), static_cast<double>(R) / static_cast<double>(mo.num_experts),
                    simt8.best_ms, rate(simt8), simt4.best_ms, rate(simt4), cublas_gemms.best_ms, rate(cublas_gemms),
                    cublas_gemms.best_ms / simt8.best_ms, cublas_gemms.best_ms / simt4.best_ms);
      }
    }
  }
  bench_moe_breakdown(o, *layer, x, dy, grouped, r);
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
  const bool attn_res_only = options.suite == "attn_res";
  if (!kda && !moe && !attn_res_only) {
    return make_status(StatusCode::kInvalidArgument,
                       "bench kernels: --suite must be kda, moe, attn_res or all, got '{}'", options.suite);
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
    if (attn_res_only) {
      r.copy_gb_per_s = measure_copy_gb_per_s(options);
      const double speedup = bench_attn_res(options, 2048, 4, r.copy_gb_per_s);
      bench_attn_res(options, 16384, 4, r.copy_gb_per_s);
      std::printf("attn_res_mix_speedup: %.2f\n", speedup);
      std::fflush(stdout);
      return r;
    }
    if (!kda) return r;
    r.copy_gb_per_s = measure_copy_gb_per_s(options);
    // The layer around the attention core: its decay gate and short convolutions fused, and one
    // layer's training step against its core alone.
    bench_gate(options, 2, 16384, 64, r.copy_gb_per_s, r);
    bench_conv(options, 2, 16384, 64, r.copy_gb_per_s);
    bench_attn_res(options, 2048, 4, r.copy_gb_per_s);
    bench_attn_res(options, 16384, 4, r.copy_gb_per_s);
    bench_layer(options, 2, 16384);
    // The same with two CTAs of 4 warps per head, 64 value columns each, instead of one CTA of
    // 16 specialized warps (KdaChunkedOptions::head_walk, on by default): what the whole-head
    // walk is worth, measured in the same run (bit for bit the same results).
    r.kda_forward_column_tiles_ms =
        bench_forward(options, 2, 16384, 64, r.copy_gb_per_s, 0, /*reference=*/false,
                      /*head_walk=*/false)
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
    r.kda_backward_ms = bench_backward(options, 2, 16384, 64, r.kda_forward_ms, r.copy_gb_per_s);
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
