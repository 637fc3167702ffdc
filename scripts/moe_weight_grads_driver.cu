// A standalone timing of the routed experts' weight gradients (kernels/moe_experts_backward.cu) on
// the small config's expert shapes, 8K tokens x top-16 (not part of the CMake build):
//   nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr [-Ivariant] -I. scripts/moe_weight_grads_driver.cu \
//        kernels/moe_experts_sm90.cu -o /tmp/moe_wgrad
//   /tmp/moe_wgrad [tokens top_k experts L F]
// Rows per expert as in scripts/moe_experts_driver.cu (random distinct top_k per token, fixed
// seed; and the same rows spread evenly). Prints the best and median of 20 launches, TFLOP/s of
// the three products and the bytes a launch must move at least (X, dG, dU, dY, H in once, the
// three gradients out), and a spot check: 256 sampled elements of each gradient against fp64 sums
// on the host (largest relative error); the same for dX (moe_experts_dx). Both kernels (mma.sync, and
// wgmma on sm_90), the wgmma one compared with the mma.sync one element by element, outputs filled
// with NaN first (an element left unwritten shows); last lines `weight_grads_check: ok` and
// `dx_check: ok`. -Ivariant first: a folder holding a modified
// kernels/moe_experts_backward.cu is used instead (timing experiments); the parity is
// kernels_tests' job.
#include "kernels/moe_experts_backward.cu"
#include "scripts/driver_timing.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

using namespace odyssey::kernels;

namespace {

double f(const __nv_bfloat16& x) { return static_cast<double>(__bfloat162float(x)); }

}  // namespace

int main(int argc, char** argv) {
  const int64_t tokens = argc > 1 ? atoll(argv[1]) : 8192, top_k = argc > 2 ? atoll(argv[2]) : 16;
  const int64_t experts = argc > 3 ? atoll(argv[3]) : 896, L = argc > 4 ? atoll(argv[4]) : 384;
  const int64_t F = argc > 5 ? atoll(argv[5]) : 192;
  const int64_t rows = tokens * top_k;
  std::mt19937 rng(7);
  const std::vector<int64_t> counts = uniform_routing_counts(tokens, top_k, experts, rng);
  // Skewed: every row picks an expert with probability proportional to exp(1.5 z), z normal (an
  // untrained router's imbalance: a few experts with ten times the mean, some with none).
  std::vector<double> popularity(experts);
  std::normal_distribution<double> z(0.0, 1.0);
  for (auto& p : popularity) p = std::exp(1.5 * z(rng));
  std::discrete_distribution<int64_t> pick_skewed(popularity.begin(), popularity.end());
  std::vector<int64_t> skewed_counts(experts, 0);
  for (int64_t r = 0; r < rows; ++r) ++skewed_counts[pick_skewed(rng)];
  std::vector<int32_t> routed(experts), even(experts), skewed(experts);
  int64_t sum = 0, most = 0, skewed_sum = 0, skewed_most = 0;
  for (int64_t e = 0; e < experts; ++e) {
    sum += counts[e];
    most = std::max(most, counts[e]);
    routed[e] = static_cast<int32_t>(sum);
    even[e] = static_cast<int32_t>((e + 1) * rows / experts);
    skewed_sum += skewed_counts[e];
    skewed_most = std::max(skewed_most, skewed_counts[e]);
    skewed[e] = static_cast<int32_t>(skewed_sum);
  }
  const HostDevice x = random_bf16(rows * L, 1.f, rng), dg = random_bf16(rows * F, 0.1f, rng);
  const HostDevice du = random_bf16(rows * F, 0.1f, rng), dy = random_bf16(rows * L, 0.1f, rng);
  const HostDevice h = random_bf16(rows * F, 1.f, rng);
  void *wg = nullptr, *wu = nullptr, *wd = nullptr;
  int32_t* ends = nullptr;
  cudaMalloc(&wg, experts * F * L * 2);
  cudaMalloc(&wu, experts * F * L * 2);
  cudaMalloc(&wd, experts * L * F * 2);
  cudaMalloc(&ends, experts * 4);
  const double flops = 3.0 * 2 * rows * L * F;
  const double bytes = 2.0 * (2.0 * rows * L + 3.0 * rows * F + 3.0 * experts * F * L);
  std::printf("moe expert weight gradients: %ld rows (%ld tokens x %ld), %ld experts (most rows %ld), "
              "L=%ld F=%ld: %.1f GFLOP, at least %.0f MB\n",
              static_cast<long>(rows), static_cast<long>(tokens), static_cast<long>(top_k),
              static_cast<long>(experts), static_cast<long>(most), static_cast<long>(L),
              static_cast<long>(F), flops / 1e9, bytes / 1e6);
  std::printf("  skewed: most rows %ld\n", static_cast<long>(skewed_most));
  bool all_ok = true;
  std::vector<__nv_bfloat16> first_g, first_u, first_d;  // the mma.sync kernel's, for the wgmma one to match
  for (const auto& [name, host_ends] : {std::make_pair("routed", &routed), std::make_pair("even", &even),
                                        std::make_pair("skewed", &skewed)}) {
    cudaMemcpy(ends, host_ends->data(), experts * 4, cudaMemcpyHostToDevice);
    for (const MoeExpertsKernel kernel : {MoeExpertsKernel::kMmaSync, MoeExpertsKernel::kWgmma}) {
      const bool wgmma = kernel == MoeExpertsKernel::kWgmma;
      if (wgmma && !moe_experts_weight_grads_wgmma_supported(L, F, experts)) {
        std::printf("  %-6s wgmma: not supported here\n", name);
        continue;
      }
      for (void* p : {wg, wu, wd}) cudaMemset(p, 0xFF, experts * F * L * 2);  // NaN: unwritten shows
      cudaError_t error = moe_experts_weight_grads(x.device, dg.device, du.device, dy.device, h.device, ends, wg, wu,
                                                   wd, rows, experts, L, F, nullptr, kernel);
      cudaError_t sync = cudaDeviceSynchronize();
      std::vector<__nv_bfloat16> got_g(experts * F * L), got_u(experts * F * L), got_d(experts * L * F);
      cudaMemcpy(got_g.data(), wg, got_g.size() * 2, cudaMemcpyDeviceToHost);
      cudaMemcpy(got_u.data(), wu, got_u.size() * 2, cudaMemcpyDeviceToHost);
      cudaMemcpy(got_d.data(), wd, got_d.size() * 2, cudaMemcpyDeviceToHost);
      const std::vector<float> ms = time_launches([&] {
        const cudaError_t e = moe_experts_weight_grads(x.device, dg.device, du.device, dy.device, h.device, ends, wg,
                                                       wu, wd, rows, experts, L, F, nullptr, kernel);
        if (error == cudaSuccess) error = e;
      });
      if (sync == cudaSuccess) sync = cudaDeviceSynchronize();
      int64_t unwritten = 0;
      for (const auto* v : {&got_g, &got_u, &got_d}) {
        for (const auto& value : *v) unwritten += std::isnan(__bfloat162float(value)) ? 1 : 0;
      }
      // Spot check against fp64 sums over the expert's rows (an expert without rows: exact zeros).
      double worst = 0.0;
      std::uniform_int_distribution<int64_t> pick_e(0, experts - 1), pick_f(0, F - 1), pick_l(0, L - 1);
      for (int s = 0; s < 256; ++s) {
        const int64_t e = pick_e(rng), fi = pick_f(rng), li = pick_l(rng);
        const int64_t r0 = e > 0 ? (*host_ends)[e - 1] : 0, r1 = (*host_ends)[e];
        double sg = 0, su = 0, sd = 0, scale_g = 1e-30, scale_u = 1e-30, scale_d = 1e-30;
        for (int64_t r = r0; r < r1; ++r) {
          sg += f(dg.host[r * F + fi]) * f(x.host[r * L + li]);
          su += f(du.host[r * F + fi]) * f(x.host[r * L + li]);
          sd += f(dy.host[r * L + li]) * f(h.host[r * F + fi]);
          scale_g += std::fabs(f(dg.host[r * F + fi]) * f(x.host[r * L + li]));
          scale_u += std::fabs(f(du.host[r * F + fi]) * f(x.host[r * L + li]));
          scale_d += std::fabs(f(dy.host[r * L + li]) * f(h.host[r * F + fi]));
        }
        worst = std::max(worst, std::fabs(f(got_g[(e * F + fi) * L + li]) - sg) / scale_g);
        worst = std::max(worst, std::fabs(f(got_u[(e * F + fi) * L + li]) - su) / scale_u);
        worst = std::max(worst, std::fabs(f(got_d[(e * L + li) * F + fi]) - sd) / scale_d);
      }
      // Against the mma.sync kernel, every element: how many differ, and the largest difference over
      // the largest magnitude of that gradient.
      int64_t differ = 0;
      double most = 0.0;
      if (wgmma) {
        for (const auto& [mine, theirs] : {std::make_pair(&got_g, &first_g), std::make_pair(&got_u, &first_u),
                                           std::make_pair(&got_d, &first_d)}) {
          double diff = 0.0, size = 1e-30;
          for (size_t i = 0; i < mine->size(); ++i) {
            const double a = f((*mine)[i]), b = f((*theirs)[i]);
            differ += a != b ? 1 : 0;
            diff = std::max(diff, std::fabs(a - b));
            size = std::max(size, std::fabs(b));
          }
          most = std::max(most, diff / size);
        }
      } else {
        first_g = got_g, first_u = got_u, first_d = got_d;
      }
      const bool ok = error == cudaSuccess && sync == cudaSuccess && unwritten == 0 && worst < 1e-2 && most < 1e-2;
      all_ok = all_ok && ok;
      std::printf("  %-6s %-8s best %.3f ms  median %.3f ms  %6.1f TFLOP/s  %5.0f GB/s of the least bytes  "
                  "spot check: max |err| / sum |terms| %.2e  unwritten %ld",
                  name, wgmma ? "wgmma" : "mma.sync", ms[0], ms[10], flops / (ms[0] * 1e-3) / 1e12,
                  bytes / (ms[0] * 1e-3) / 1e9, worst, static_cast<long>(unwritten));
      if (wgmma) std::printf("  vs mma.sync: %ld differ, max |diff| / max |value| %.2e", static_cast<long>(differ), most);
      std::printf("  %s %s\n", cudaGetErrorName(error != cudaSuccess ? error : sync), ok ? "ok" : "FAILED");
    }
  }
  std::printf("weight_grads_check: %s\n", all_ok ? "ok" : "FAILED");
  const bool grads_ok = all_ok;
  // dX = dG W_gate + dU W_up (moe_experts_dx) on the same rows, with random weights.
  const HostDevice gate_proj = random_bf16(experts * F * L, 0.05f, rng), up_proj = random_bf16(experts * F * L, 0.05f, rng);
  void* dx = nullptr;
  cudaMalloc(&dx, rows * L * 2);
  const double dx_flops = 2.0 * 2 * rows * L * F;
  const double dx_bytes = 2.0 * (2.0 * rows * F + 2.0 * experts * F * L + rows * L);
  std::vector<__nv_bfloat16> first(rows * L);  // the mma.sync kernel's dX, for the wgmma kernel to match
  all_ok = true;
  for (const auto& [name, host_ends] : {std::make_pair("routed", &routed), std::make_pair("even", &even),
                                        std::make_pair("skewed", &skewed)}) {
    cudaMemcpy(ends, host_ends->data(), experts * 4, cudaMemcpyHostToDevice);
    for (const MoeExpertsKernel kernel : {MoeExpertsKernel::kMmaSync, MoeExpertsKernel::kWgmma}) {
      const bool wgmma = kernel == MoeExpertsKernel::kWgmma;
      if (wgmma && !moe_experts_dx_wgmma_supported(L, F, experts)) {
        std::printf("  dX %-6s wgmma: not supported here\n", name);
        continue;
      }
      cudaMemset(dx, 0xFF, rows * L * 2);  // NaN: a row the kernel leaves unwritten shows
      cudaError_t error = moe_experts_dx(dg.device, du.device, gate_proj.device, up_proj.device, ends, dx, rows,
                                         experts, L, F, nullptr, kernel);
      cudaError_t sync = cudaDeviceSynchronize();
      std::vector<__nv_bfloat16> got(rows * L);
      cudaMemcpy(got.data(), dx, got.size() * 2, cudaMemcpyDeviceToHost);
      const std::vector<float> ms = time_launches([&] {
        const cudaError_t e = moe_experts_dx(dg.device, du.device, gate_proj.device, up_proj.device, ends, dx,
                                             rows, experts, L, F, nullptr, kernel);
        if (error == cudaSuccess) error = e;
      });
      if (sync == cudaSuccess) sync = cudaDeviceSynchronize();
      double worst = 0.0;
      int64_t unwritten = 0;
      const int64_t covered = static_cast<int64_t>(host_ends->back()) * L;
      for (int64_t i = 0; i < covered; ++i) unwritten += std::isnan(__bfloat162float(got[i])) ? 1 : 0;
      std::uniform_int_distribution<int64_t> pick_r(0, rows - 1), pick_l(0, L - 1);
      for (int s = 0; s < 1024; ++s) {
        const int64_t r = pick_r(rng), li = pick_l(rng);
        const int64_t e = std::upper_bound(host_ends->begin(), host_ends->end(), static_cast<int32_t>(r)) - host_ends->begin();
        if (e >= experts) continue;  // rows past the last expert's: not written
        double sum = 0, scale = 1e-30;
        for (int64_t fi = 0; fi < F; ++fi) {
          const double a = f(dg.host[r * F + fi]) * f(gate_proj.host[(e * F + fi) * L + li]);
          const double b = f(du.host[r * F + fi]) * f(up_proj.host[(e * F + fi) * L + li]);
          sum += a + b, scale += std::fabs(a) + std::fabs(b);
        }
        worst = std::max(worst, std::fabs(f(got[r * L + li]) - sum) / scale);
      }
      // Against the mma.sync kernel, every element: how many differ, and by how much (in bf16 ulps of
      // the larger).
      int64_t differ = 0;
      double most_ulps = 0.0;
      if (wgmma) {
        for (int64_t i = 0; i < covered; ++i) {
          const double a = f(got[i]), b = f(first[i]);
          if (a != b) {
            ++differ;
            const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(a), std::fabs(b))) - 7);
            most_ulps = std::max(most_ulps, std::fabs(a - b) / ulp);
          }
        }
      } else {
        first = got;
      }
      const bool ok = error == cudaSuccess && sync == cudaSuccess && unwritten == 0 && worst < 1e-2 &&
                      (!wgmma || most_ulps <= 2.0);
      all_ok = all_ok && ok;
      std::printf("  dX %-6s %-8s best %.3f ms  median %.3f ms  %6.1f TFLOP/s  %5.0f GB/s of the least bytes  "
                  "spot check: max |err| / sum |terms| %.2e  unwritten %ld",
                  name, wgmma ? "wgmma" : "mma.sync", ms[0], ms[10], dx_flops / (ms[0] * 1e-3) / 1e12,
                  dx_bytes / (ms[0] * 1e-3) / 1e9, worst, static_cast<long>(unwritten));
      if (wgmma) std::printf("  vs mma.sync: %ld differ, at most %.1f ulps", static_cast<long>(differ), most_ulps);
      std::printf("  %s %s\n", cudaGetErrorName(error != cudaSuccess ? error : sync), ok ? "ok" : "FAILED");
    }
  }
  std::printf("dx_check: %s\n", all_ok ? "ok" : "FAILED");
  return grads_ok && all_ok ? 0 : 1;
}
