// The fused 64-token pass 3 (KdaBackwardOptions::pass3_block_tokens = 64) against the 32-token one,
// framework-free: the whole kda_chunked_backward with each option on the same inputs, the gradients
// compared (max |64 - 32| over the largest |32| of each), then both timed. A quick check that needs
// no LibTorch on the GPU machine; kernels_tests' KdaKernel.*SixtyFour* are the tests.
//   nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -I. -c kernels/kda.cu -o kda.o
//   nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -I. scripts/kda_block64_check.cu kda.o -o check64
//   ./check64 [B T H]     (default: 2 4133 2, 1 100 3 at g = -5, 1 2000 2, then 2 16384 64 timed)
// Built with -DKDA_PHASE_PROFILE it also prints each option's pass 3 phase cycles at the timed shape.
#include "kernels/kda_backward.cu"
#include "scripts/kda_driver_inputs.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using namespace odyssey::kernels;

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::printf("%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

std::vector<float> to_host(const void* p, int64_t n, bool bf16_data) {
  std::vector<float> out(n);
  if (bf16_data) {
    std::vector<__nv_bfloat16> raw(n);
    check(cudaMemcpy(raw.data(), p, n * 2, cudaMemcpyDeviceToHost), "copy");
    for (int64_t i = 0; i < n; ++i) out[i] = __bfloat162float(raw[i]);
  } else {
    check(cudaMemcpy(out.data(), p, n * 4, cudaMemcpyDeviceToHost), "copy");
  }
  return out;
}

// Returns false where any gradient differs by more than `tolerance` of its largest magnitude.
bool run(int64_t B, int64_t T, int64_t H, bool timed, float g_lo) {
  const int64_t K = 128, V = 128, n = B * T * H;
  bf16 *q, *k, *v, *beta, *d_o;
  float *g, *d_final;
  cudaMalloc(&q, n * K * 2), cudaMalloc(&k, n * K * 2), cudaMalloc(&v, n * V * 2), cudaMalloc(&d_o, n * V * 2);
  cudaMalloc(&beta, n * 2), cudaMalloc(&g, n * K * 4), cudaMalloc(&d_final, B * H * K * V * 4);
  fill_bf16<<<1024, 256>>>(q, n * K, 1, 0.09f), fill_bf16<<<1024, 256>>>(k, n * K, 2, 0.09f);
  fill_bf16<<<1024, 256>>>(v, n * V, 3, 1.0f), fill_bf16<<<1024, 256>>>(beta, n, 4, 0.5f);
  fill_f32<<<1024, 256>>>(g, n * K, 5, g_lo, 0.0f), fill_bf16<<<1024, 256>>>(d_o, n * V, 6, 1.0f);
  fill_f32<<<1024, 256>>>(d_final, B * H * K * V, 7, -1.0f, 1.0f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(K));
  struct Out {
    bf16 *dq, *dk, *dv;
    float *dg, *dbeta, *d_init;
  } out[3];  // 32-token blocks, 64, 64 with the producer warp
  for (Out& o : out) {
    cudaMalloc(&o.dq, n * K * 2), cudaMalloc(&o.dk, n * K * 2), cudaMalloc(&o.dv, n * V * 2);
    cudaMalloc(&o.dg, n * K * 4), cudaMalloc(&o.dbeta, n * 4), cudaMalloc(&o.d_init, B * H * K * V * 4);
  }
  const size_t bytes = kda_chunked_backward_workspace_bytes(B, T, H, K, V);
  unsigned char* workspace;
  check(cudaMalloc(&workspace, bytes), "workspace");
  check(cudaDeviceSynchronize(), "inputs");
  // tokens: 32, 64, or -64 for 64 with the producer warp.
  auto backward = [&](int tokens, const Out& o) {
    KdaBackwardOptions options;
    options.pass3_block_tokens = tokens < 0 ? -tokens : tokens;
    options.pass3_block_producer = tokens < 0;
    return kda_chunked_backward(KdaDtype::kBFloat16, q, k, v, g, beta, nullptr, d_o, d_final, o.dq, o.dk, o.dv, o.dg,
                                o.dbeta, o.d_init, B, T, H, K, V, scale, nullptr, workspace, bytes, 0, options);
  };
  check(backward(32, out[0]), "backward, 32-token blocks");
  check(backward(64, out[1]), "backward, 64-token blocks");
  check(backward(-64, out[2]), "backward, 64-token blocks, producer warp");
  check(cudaDeviceSynchronize(), "backward");
  std::printf("B=%ld T=%ld H=%ld g in [%.1f, 0]%s\n", (long)B, (long)T, (long)H, g_lo,
              timed ? "" : ": 64-token blocks against 32 (max |diff| / max |32|)");
  bool ok = true;
  struct Field {
    const char* name;
    int64_t count;
    bool bf16_data;
    const void* p[2];
  };
  auto fields_of = [&](const Out& x, const Out& y) {
    return std::vector<Field>{{"dq", n * K, true, {x.dq, y.dq}},
                              {"dk", n * K, true, {x.dk, y.dk}},
                              {"dv", n * V, true, {x.dv, y.dv}},
                              {"dg", n * K, false, {x.dg, y.dg}},
                              {"dbeta", n, false, {x.dbeta, y.dbeta}},
                              {"dS0", B * H * K * V, false, {x.d_init, y.d_init}}};
  };
  const std::vector<Field> fields = fields_of(out[0], out[1]);
  for (const Field& f : fields) {
    if (timed) break;  // the timed shape: times only (its copies and sums take longer than the runs)
    const std::vector<float> a = to_host(f.p[0], f.count, f.bf16_data), b = to_host(f.p[1], f.count, f.bf16_data);
    double largest = 0, diff = 0;
    int64_t worst = 0, bad = 0;
    for (int64_t i = 0; i < f.count; ++i) {
      largest = std::max(largest, (double)std::fabs(a[i]));
      if (!std::isfinite(b[i])) ++bad;
      const double d = std::fabs((double)a[i] - b[i]);
      if (d > diff) diff = d, worst = i;
    }
    const double relative = diff / std::max(1e-6, largest);
    const bool pass = bad == 0 && relative <= 2e-2;
    ok = ok && pass;
    std::printf("  %-6s %.3e of %.3e (%.2e) at %ld: %g against %g%s%s\n", f.name, diff, largest, relative,
                (long)worst, b[worst], a[worst], bad ? " NOT FINITE" : "", pass ? "" : "  DIFFER");
    if (!pass && f.count == n * (f.count / n) && f.count != B * H * K * V) {
      // Where the difference lies, so that one run names the phase or warp at fault: the largest
      // |diff| / largest by 16-token sub-chunk of the 64-token block, by 16-column tile (the warps'
      // column tiles), and in the sequence's last (partial) block against the rest.
      const int64_t width = f.count / n;  // K, V or 1 (dbeta)
      double by_sub[4] = {}, by_tile[8] = {}, last_block = 0, other_blocks = 0;
      for (int64_t i = 0; i < f.count; ++i) {
        const int64_t col = i % width, t = (i / (width * H)) % T;
        const double d = std::fabs((double)a[i] - b[i]) / std::max(1e-6, largest);
        by_sub[(t % 64) / 16] = std::max(by_sub[(t % 64) / 16], d);
        if (width > 1) by_tile[col / 16] = std::max(by_tile[col / 16], d);
        double& block = t / 64 == (T - 1) / 64 ? last_block : other_blocks;
        block = std::max(block, d);
      }
      std::printf("         by sub-chunk:");
      for (double x : by_sub) std::printf(" %.2e", x);
      if (width > 1) {
        std::printf("  by column tile:");
        for (double x : by_tile) std::printf(" %.2e", x);
      }
      std::printf("  last block %.2e, the others %.2e\n", last_block, other_blocks);
    }
  }
  if (!timed) {  // the producer warp's copies change no arithmetic: the same bits as 64 without it
    for (const Field& f : fields_of(out[1], out[2])) {
      const std::vector<float> a = to_host(f.p[0], f.count, f.bf16_data), b = to_host(f.p[1], f.count, f.bf16_data);
      int64_t differ = 0;
      for (int64_t i = 0; i < f.count; ++i) differ += std::memcmp(&a[i], &b[i], 4) != 0;
      ok = ok && differ == 0;
      std::printf("  %-6s producer warp against 64: %ld values differ%s\n", f.name, (long)differ, differ ? "  DIFFER" : "");
    }
  }
  if (timed) {
    cudaEvent_t start, stop;
    cudaEventCreate(&start), cudaEventCreate(&stop);
    for (int tokens : {32, 64, -64, 32, 64, -64}) {
      float best = 1e30f;
      for (int r = 0; r < 6; ++r) {
        cudaEventRecord(start);
        check(backward(tokens, out[tokens == 32 ? 0 : tokens == 64 ? 1 : 2]), "timed backward");
        cudaEventRecord(stop);
        cudaEventSynchronize(stop);
        float ms = 0;
        cudaEventElapsedTime(&ms, start, stop);
        best = std::min(best, ms);
      }
      std::printf("  whole backward, %d-token blocks%s: best %.3f ms\n", tokens < 0 ? -tokens : tokens,
                  tokens < 0 ? ", producer warp" : "", best);
    }
  }
#ifdef KDA_PHASE_PROFILE
  // -DKDA_PHASE_PROFILE: pass 3's cycles between barriers per item (thread 0) and each warp's work
  // before each barrier, for each option (items of 32 and 64 tokens).
  if (timed) {
    for (int tokens : {32, 64, -64}) {
      unsigned long long zero[16] = {}, cycles[16];
      static unsigned long long warp_zero[kGradientWarps][16] = {}, warp_cycles[kGradientWarps][16];
      cudaMemcpyToSymbol(g_phase_cycles, zero, sizeof(zero));
      cudaMemcpyToSymbol(g_warp_phase_cycles, warp_zero, sizeof(warp_zero));
      check(backward(tokens, out[tokens == 32 ? 0 : tokens == 64 ? 1 : 2]), "profiled backward");
      check(cudaDeviceSynchronize(), "profiled backward (sync)");
      cudaMemcpyFromSymbol(cycles, g_phase_cycles, sizeof(cycles));
      cudaMemcpyFromSymbol(warp_cycles, g_warp_phase_cycles, sizeof(warp_cycles));
      const int size = tokens < 0 ? -tokens : tokens;
      const double items = static_cast<double>(B * H * ((T + size - 1) / size));
      double total = 0;
      for (int i = 0; i < 16; ++i) {
        if (!cycles[i]) continue;
        total += cycles[i] / items;
        std::printf("  pass 3 (%d) mark %2d: %8.0f cycles per item\n", tokens, i, cycles[i] / items);
      }
      std::printf("  pass 3 (%d; -64: the producer warp): %.0f cycles per item, %.0f per 64 tokens\n", tokens, total,
                  total * 64 / size);
      for (int p = 0; p < 16; ++p) {
        int slowest = 0;
        for (int w = 1; w < kGradientWarps; ++w) slowest = warp_cycles[w][p] > warp_cycles[slowest][p] ? w : slowest;
        if (warp_cycles[slowest][p] == 0) continue;
        std::printf("    %s %d:", p == 0 ? "top  " : "phase", p == 0 ? 0 : p - 1);
        for (int w = 0; w < kGradientWarps; ++w) std::printf(" %5.0f%s", warp_cycles[w][p] / items, w == slowest ? "*" : " ");
        std::printf("\n");
      }
    }
  }
#endif
  for (Out& o : out) cudaFree(o.dq), cudaFree(o.dk), cudaFree(o.dv), cudaFree(o.dg), cudaFree(o.dbeta), cudaFree(o.d_init);
  cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(d_o), cudaFree(beta), cudaFree(g), cudaFree(d_final), cudaFree(workspace);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  bool ok = true;
  if (argc > 3) {
    ok = run(atoll(argv[1]), atoll(argv[2]), atoll(argv[3]), true, -0.3f);
  } else {
    ok = run(2, 4133, 2, false, -0.3f) && ok;
    ok = run(1, 100, 3, false, -5.0f) && ok;
    ok = run(1, 2000, 2, false, -1.0f) && ok;
    ok = run(2, 16384, 64, true, -0.3f) && ok;
  }
  std::printf(ok ? "64-token blocks: SAME within bf16\n" : "64-token blocks: GRADIENTS DIFFER\n");
  return ok ? 0 : 1;
}
