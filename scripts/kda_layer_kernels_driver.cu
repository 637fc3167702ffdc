// A standalone timing driver for the KDA layer's fused gate and short convolution
// (kernels/kda_gate.cu, kernels/kda_conv.cu; not part of the CMake build): links the two kernel
// sources directly, so a variant can be timed and compared bit for bit without LibTorch or a
// project build (~30 s):
//   nvcc -O3 -std=c++17 -arch=sm_90 --expt-relaxed-constexpr -I. scripts/kda_layer_kernels_driver.cu \
//     kernels/kda_conv.cu kernels/kda_gate.cu -o /tmp/layer_driver      (or a variant's .cu files)
//   /tmp/layer_driver [B T H [file]]          (defaults 2 16384 64; K = 128, W = 4, fp32)
// Prints each launch's best and median of 20 (CUDA events) and its bytes over the best time. With a
// file: the first run saves every output there, a later run (of another variant) compares its own
// against them and prints how many elements differ and by how much. Correctness against the
// references is the parity tests' job (kernels_tests).
#include "kernels/kda_conv.h"
#include "kernels/kda_gate.h"
#include "scripts/driver_timing.cuh"
#include "scripts/kda_driver_inputs.cuh"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

using namespace odyssey::kernels;

namespace {

struct Output {
  const char* name;
  const float* device;
  int64_t count;
};

void report(const char* what, const std::vector<float>& ms, double bytes) {
  std::printf("%-44s best %8.3f ms  median %8.3f ms  %6.0f GB/s\n", what, ms[0], ms[10], bytes / (ms[0] * 1e-3) / 1e9);
}

// Saves the outputs to `path` when it does not exist, else compares against it.
void save_or_compare(const std::string& path, const std::vector<Output>& outputs) {
  FILE* in = std::fopen(path.c_str(), "rb");
  for (const Output& o : outputs) {
    std::vector<float> mine(o.count);
    cudaMemcpy(mine.data(), o.device, o.count * sizeof(float), cudaMemcpyDeviceToHost);
    if (in == nullptr) {
      FILE* out = std::fopen(path.c_str(), "ab");
      std::fwrite(mine.data(), sizeof(float), mine.size(), out);
      std::fclose(out);
      continue;
    }
    std::vector<float> saved(o.count);
    if (std::fread(saved.data(), sizeof(float), saved.size(), in) != saved.size()) {
      std::printf("  %-12s: the saved file is shorter\n", o.name);
      return;
    }
    int64_t differ = 0;
    double worst = 0, largest = 0;
    for (int64_t i = 0; i < o.count; ++i) {
      differ += mine[i] != saved[i];
      worst = std::max(worst, static_cast<double>(std::fabs(mine[i] - saved[i])));
      largest = std::max(largest, static_cast<double>(std::fabs(saved[i])));
    }
    std::printf("  %-12s: %lld of %lld elements differ%s, max %.2e of the largest %.2e\n", o.name,
                static_cast<long long>(differ), static_cast<long long>(o.count), differ ? " (DIFFERENT)" : "", worst,
                largest);
  }
  if (in != nullptr) std::fclose(in);
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t B = argc > 1 ? atoll(argv[1]) : 2, T = argc > 2 ? atoll(argv[2]) : 16384,
                H = argc > 3 ? atoll(argv[3]) : 64, K = 128, W = 4;
  const int64_t D = H * K, n = B * T * D;
  float *x, *conv_inputs, *weight, *dy, *y, *dx, *d_conv, *d_weight, *a_log, *dt_bias, *g, *dz, *d_a, *d_b;
  void *conv_workspace, *gate_workspace;
  cudaMalloc(&x, n * 4), cudaMalloc(&dy, n * 4), cudaMalloc(&y, n * 4), cudaMalloc(&dx, n * 4);
  cudaMalloc(&conv_inputs, B * (W - 1) * D * 4), cudaMalloc(&d_conv, B * (W - 1) * D * 4);
  cudaMalloc(&weight, D * W * 4), cudaMalloc(&d_weight, D * W * 4);
  cudaMalloc(&a_log, H * 4), cudaMalloc(&d_a, H * 4), cudaMalloc(&dt_bias, D * 4), cudaMalloc(&d_b, D * 4);
  cudaMalloc(&g, n * 4), cudaMalloc(&dz, n * 4);
  cudaMalloc(&conv_workspace, kda_short_conv_backward_workspace_bytes(B, T, D, W));
  cudaMalloc(&gate_workspace, kda_gate_backward_workspace_bytes(B * T, H, K));
  fill_f32<<<1024, 256>>>(x, n, 1, -2.0f, 2.0f), fill_f32<<<1024, 256>>>(dy, n, 2, -1.0f, 1.0f);
  fill_f32<<<1024, 256>>>(conv_inputs, B * (W - 1) * D, 3, -2.0f, 2.0f);
  fill_f32<<<1024, 256>>>(weight, D * W, 4, -0.5f, 0.5f), fill_f32<<<1024, 256>>>(a_log, H, 5, -1.0f, 1.0f);
  fill_f32<<<1024, 256>>>(dt_bias, D, 6, -1.0f, 1.0f);
  const double f = 4.0 * n;  // bytes of one fp32 tensor of x's size

  auto conv_forward = [&] {
    return kda_short_conv_forward(x, conv_inputs, weight, y, B, T, D, W, 128, 1e-6f, nullptr);
  };
  auto conv_backward = [&] {
    return kda_short_conv_backward(x, conv_inputs, weight, dy, dx, d_conv, d_weight, conv_workspace, B, T, D, W, 128,
                                   1e-6f, nullptr);
  };
  auto gate_forward = [&] {
    return kda_gate_forward(KdaDtype::kFloat32, x, a_log, dt_bias, -5.0f, g, B * T, H, K, nullptr);
  };
  auto gate_backward = [&] {
    return kda_gate_backward(KdaDtype::kFloat32, x, a_log, dt_bias, -5.0f, dy, dz, d_a, d_b, gate_workspace, B * T,
                             H, K, nullptr);
  };
  cudaError_t e = conv_forward();
  if (e == cudaSuccess) e = conv_backward();
  if (e == cudaSuccess) e = gate_forward();
  if (e == cudaSuccess) e = gate_backward();
  cudaDeviceSynchronize();
  if (e != cudaSuccess || (e = cudaGetLastError()) != cudaSuccess) {
    std::printf("error %s\n", cudaGetErrorString(e));
    return 1;
  }
  std::printf("B=%lld T=%lld D=%lld fp32, conv W=%lld with heads of 128\n", static_cast<long long>(B),
              static_cast<long long>(T), static_cast<long long>(D), static_cast<long long>(W));
  report("conv forward (x in, y out)", time_launches(conv_forward), 2 * f);
  report("conv backward (x, dy in, dx out; d weight)", time_launches(conv_backward), 3 * f);
  report("gate forward (z in, g out)", time_launches(gate_forward), 2 * f);
  report("gate backward (z, dg in, dz out; dA, d dt_bias)", time_launches(gate_backward), 3 * f);
  if (argc > 4) {
    save_or_compare(argv[4], {{"conv y", y, n},
                              {"conv dx", dx, n},
                              {"conv d_conv", d_conv, B * (W - 1) * D},
                              {"conv d_w", d_weight, D * W},
                              {"gate g", g, n},
                              {"gate dz", dz, n},
                              {"gate dA", d_a, H},
                              {"gate d_bias", d_b, D}});
  }
  return 0;
}
