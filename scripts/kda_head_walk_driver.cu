// A standalone check of the whole-head walk (kernels/kda.cu, kda_head_kernel) against the
// 64-column CTAs, bit for bit, and its time (not part of the CMake build; ~20 s to compile):
//   nvcc -O3 -std=c++17 -arch=sm_90 [-Ivariant] -I. scripts/kda_head_walk_driver.cu -o /tmp/kda_head
//   /tmp/kda_head                                   the default cases (below)
//   /tmp/kda_head B T H seg timing states init repeats
// -Ivariant first: a folder holding a modified kernels/kda.cu (and kda_chunk.cuh) is used instead.
// The two paths compute every value with the same operations in the same order, so any change
// to one (a variant's walk, barriers, staging) must keep the outputs, chunk states and final
// states byte for byte the other's: each case prints EQUALS or DIFFERS, and with `timing` the
// best and median of 20 launches of each. The parity against the fp64 reference is
// kernels_tests' job; this is the quick check between its runs.
#include "kernels/kda.cu"
#include "scripts/kda_driver_inputs.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using namespace odyssey::kernels;

namespace {

// Returns 1 where the two paths differ or a launch fails.
int run_case(int64_t B, int64_t T, int64_t H, int64_t seg, bool timing, bool states, bool with_init) {
  const int64_t K = 128, V = 128;
  const int64_t n = B * T * H;
  bf16 *q, *k, *v, *beta, *o[2];
  float *g, *fs[2], *init = nullptr;
  cudaMalloc(&q, n * K * 2);
  cudaMalloc(&k, n * K * 2);
  cudaMalloc(&v, n * V * 2);
  cudaMalloc(&beta, n * 2);
  cudaMalloc(&g, n * K * 4);
  for (int i = 0; i < 2; ++i) {
    cudaMalloc(&o[i], n * V * 2);
    cudaMalloc(&fs[i], B * H * K * V * 4);
  }
  if (with_init) {
    cudaMalloc(&init, B * H * K * V * 4);
    fill_f32<<<1024, 256>>>(init, B * H * K * V, 7, -0.5f, 0.5f);
  }
  fill_bf16<<<1024, 256>>>(q, n * K, 1, 0.09f);
  fill_bf16<<<1024, 256>>>(k, n * K, 2, 0.09f);
  fill_bf16<<<1024, 256>>>(v, n * V, 3, 1.0f);
  fill_bf16<<<1024, 256>>>(beta, n, 4, 0.5f);
  fill_f32<<<1024, 256>>>(g, n * K, 5, -0.3f, 0.0f);
  const int64_t chunks = (T + 15) / 16;
  const size_t state_bytes = static_cast<size_t>(B * H * chunks * V * K * 2);
  void* st[2] = {};
  if (states) {
    for (int i = 0; i < 2; ++i) cudaMalloc(&st[i], state_bytes);
  }
  // path 0: the whole-head walk; path 1: the 64-column CTAs.
  auto run = [&](int path) {
    KdaChunkedOptions opt;
    opt.segment_length = seg;
    opt.head_walk = path == 0;
    opt.chunk_states = st[path];
    return kda_chunked_forward(KdaDtype::kBFloat16, q, k, v, g, beta, init, st[path] ? nullptr : o[path], fs[path],
                               nullptr, B, T, H, K, V, 0.088f, opt, 0);
  };
  int bad = 0;
  for (int path = 0; path < 2; ++path) {
    cudaMemset(o[path], 0, n * V * 2);
    const cudaError_t launched = run(path), done = cudaDeviceSynchronize();
    if (launched != cudaSuccess || done != cudaSuccess) {
      std::printf("path %d: %s / %s\n", path, cudaGetErrorString(launched), cudaGetErrorString(done));
      return 1;
    }
  }
  const size_t bytes = states ? state_bytes : static_cast<size_t>(n * V * 2);
  std::vector<char> a(std::max<size_t>(bytes, B * H * K * V * 4)), b(a.size());
  cudaMemcpy(a.data(), states ? st[0] : static_cast<void*>(o[0]), bytes, cudaMemcpyDeviceToHost);
  cudaMemcpy(b.data(), states ? st[1] : static_cast<void*>(o[1]), bytes, cudaMemcpyDeviceToHost);
  bool same = std::memcmp(a.data(), b.data(), bytes) == 0;
  cudaMemcpy(a.data(), fs[0], B * H * K * V * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(b.data(), fs[1], B * H * K * V * 4, cudaMemcpyDeviceToHost);
  same = same && std::memcmp(a.data(), b.data(), B * H * K * V * 4) == 0;
  std::printf("B=%ld T=%ld H=%ld seg=%ld states=%d init=%d: head walk %s the 64-column CTAs\n", (long)B, (long)T,
              (long)H, (long)seg, (int)states, (int)with_init, same ? "EQUALS" : "DIFFERS FROM");
  bad |= same ? 0 : 1;
  if (timing) {
    const char* names[2] = {"head walk", "64-col"};
    for (int path = 0; path < 2; ++path) {
      cudaEvent_t start, stop;
      cudaEventCreate(&start);
      cudaEventCreate(&stop);
      std::vector<float> ms;
      for (int r = 0; r < 20; ++r) {
        cudaEventRecord(start);
        run(path);
        cudaEventRecord(stop);
        cudaEventSynchronize(stop);
        float t = 0.0f;
        cudaEventElapsedTime(&t, start, stop);
        ms.push_back(t);
      }
      std::sort(ms.begin(), ms.end());
      std::printf("  %-10s best %.3f ms  median %.3f ms\n", names[path], ms[0], ms[10]);
    }
  }
  for (int i = 0; i < 2; ++i) {
    cudaFree(o[i]);
    cudaFree(fs[i]);
    if (st[i]) cudaFree(st[i]);
  }
  cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(beta), cudaFree(g);
  if (init) cudaFree(init);
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 9) {
    int bad = 0;
    for (int r = 0; r < std::atoi(argv[8]); ++r) {
      bad |= run_case(std::atol(argv[1]), std::atol(argv[2]), std::atol(argv[3]), std::atol(argv[4]),
                      std::atoi(argv[5]), std::atoi(argv[6]), std::atoi(argv[7]));
    }
    return bad;
  }
  int bad = 0;
  bad |= run_case(1, 37, 3, -1, false, false, false);           // one partial chunk group
  bad |= run_case(2, 1000, 5, -1, false, false, true);          // the ring of slots many times over
  bad |= run_case(1, 160, 2, -1, false, false, false);          // whole chunks only
  bad |= run_case(1, 5000, 4, 1024, false, false, true);        // context parallel
  bad |= run_case(1, 3000, 4, -1, false, true, false);          // the states pass
  bad |= run_case(2, 16384, 64, -1, true, false, false);        // the bench's main shape
  bad |= run_case(2, 16384, 64, -1, true, true, false);         // its states pass (backward pass 1)
  bad |= run_case(1, 65536, 4, 0, true, false, false);          // few heads: context parallel
  return bad;
}
