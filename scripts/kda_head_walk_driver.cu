// A standalone check of the whole-head walk (kernels/kda.cu, kda_head_kernel) against the
// 64-column CTAs, bit for bit, and its time (not part of the CMake build; ~20 s to compile):
//   nvcc -O3 -std=c++17 -arch=sm_90 [-Ivariant] -I. scripts/kda_head_walk_driver.cu -o /tmp/kda_head
//   /tmp/kda_head                                   the default cases (below)
//   /tmp/kda_head B T H seg lead timing states init repeats
//   /tmp/kda_head sweep B T H seg:lead ...          head walk only: best / median ms of each plan
//   /tmp/kda_head check B T H seg:lead ...          context parallel (whole heads) against the serial walk,
//                                                   with slow gates (g in [-0.002, 0]) so that the state
//                                                   carries across segments: max |difference| / max |o|
//   /tmp/kda_head phases B T H seg:lead ...         head walk only: median ms of each context-parallel
//                                                   pass alone (transitions, scan, forward)
// -Ivariant first: a folder holding a modified kernels/kda.cu (and kda_chunk.cuh) is used instead.
// The two paths compute every value with the same operations in the same order, so any change
// to one (a variant's walk, barriers, staging) must keep the outputs, chunk states and final
// states byte for byte the other's: each case prints EQUALS or DIFFERS, and with `timing` the
// best and median of 20 launches of each. The parity against the fp64 reference is
// kernels_tests' job; this is the quick check between its runs.
#include "kernels/kda.cu"
#include "scripts/kda_driver_inputs.cuh"
#include "scripts/driver_timing.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using namespace odyssey::kernels;

namespace {

// Returns 1 where the two paths differ or a launch fails.
int run_case(int64_t B, int64_t T, int64_t H, int64_t seg, int64_t lead, bool timing, bool states, bool with_init,
             int paths = 2) {
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
    opt.lead_length = lead;
    opt.head_walk = path == 0;
    opt.chunk_states = st[path];
    return kda_chunked_forward(KdaDtype::kBFloat16, q, k, v, g, beta, init, st[path] ? nullptr : o[path], fs[path],
                               nullptr, B, T, H, K, V, 0.088f, opt, 0);
  };
  int bad = 0;
  for (int path = 0; path < paths; ++path) {
    cudaMemset(o[path], 0, n * V * 2);
    const cudaError_t launched = run(path), done = cudaDeviceSynchronize();
    if (launched != cudaSuccess || done != cudaSuccess) {
      std::printf("path %d: %s / %s\n", path, cudaGetErrorString(launched), cudaGetErrorString(done));
      return 1;
    }
  }
  if (paths == 2) {
    const size_t bytes = states ? state_bytes : static_cast<size_t>(n * V * 2);
    std::vector<char> a(std::max<size_t>(bytes, B * H * K * V * 4)), b(a.size());
    cudaMemcpy(a.data(), states ? st[0] : static_cast<void*>(o[0]), bytes, cudaMemcpyDeviceToHost);
    cudaMemcpy(b.data(), states ? st[1] : static_cast<void*>(o[1]), bytes, cudaMemcpyDeviceToHost);
    bool same = std::memcmp(a.data(), b.data(), bytes) == 0;
    cudaMemcpy(a.data(), fs[0], B * H * K * V * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(b.data(), fs[1], B * H * K * V * 4, cudaMemcpyDeviceToHost);
    same = same && std::memcmp(a.data(), b.data(), B * H * K * V * 4) == 0;
    std::printf("B=%ld T=%ld H=%ld seg=%ld lead=%ld states=%d init=%d: head walk %s the 64-column CTAs\n", (long)B,
                (long)T, (long)H, (long)seg, (long)lead, (int)states, (int)with_init, same ? "EQUALS" : "DIFFERS FROM");
    bad |= same ? 0 : 1;
  }
  if (timing) {
    const char* names[2] = {"head walk", "64-col"};
    if (paths == 1) std::printf("B=%ld T=%ld H=%ld seg=%ld lead=%ld:", (long)B, (long)T, (long)H, (long)seg, (long)lead);
    for (int path = 0; path < paths; ++path) {
      const std::vector<float> ms = time_launches([&] { run(path); });
      std::printf("  %-10s best %.3f ms  median %.3f ms\n", names[path], ms[0], ms[10]);
      std::fflush(stdout);
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

// The context-parallel passes of the whole-head forward one by one (as run_chunked launches them),
// each timed alone: median of 20.
void time_phases(int64_t B, int64_t T, int64_t H, int64_t seg, int64_t lead) {
  const int64_t K = 128, V = 128, n = B * T * H;
  bf16 *q, *k, *v, *beta, *o;
  float *g, *fs;
  cudaMalloc(&q, n * K * 2), cudaMalloc(&k, n * K * 2), cudaMalloc(&v, n * V * 2), cudaMalloc(&beta, n * 2);
  cudaMalloc(&g, n * K * 4), cudaMalloc(&o, n * V * 2), cudaMalloc(&fs, B * H * K * V * 4);
  fill_bf16<<<1024, 256>>>(q, n * K, 1, 0.09f);
  fill_bf16<<<1024, 256>>>(k, n * K, 2, 0.09f);
  fill_bf16<<<1024, 256>>>(v, n * V, 3, 1.0f);
  fill_bf16<<<1024, 256>>>(beta, n, 4, 0.5f);
  fill_f32<<<1024, 256>>>(g, n * K, 5, -0.3f, 0.0f);
  KdaChunkedOptions opt;
  opt.segment_length = seg, opt.lead_length = lead;
  const SegmentPlan plan = plan_segments(false, B, T, H, K, V, opt, walks_whole_heads(KdaDtype::kBFloat16, K, V, opt));
  const WorkspaceLayout layout(plan, B, H, K, V);
  unsigned char* ws = nullptr;
  cudaMalloc(&ws, layout.bytes + 16);
  ChunkedArgs a{};
  a.q = q, a.k = k, a.v = v, a.beta = beta, a.g = g, a.o = o, a.final_state = fs, a.length = T;
  a.heads = static_cast<int>(H), a.value_dim = static_cast<int>(V), a.scale = 0.088f;
  a.prefetch = true, a.head_walk = true;
  a.segment_length = plan.segment_length, a.first_segment_length = plan.first_segment_length;
  a.segments = static_cast<int>(plan.segments), a.lead = plan.lead;
  float* states = reinterpret_cast<float*>(ws + layout.states);
  a.lead_states = plan.lead ? states : nullptr;
  a.transition_a = reinterpret_cast<float*>(ws + layout.transition_a);
  a.transition_b = reinterpret_cast<float*>(ws + layout.transition_b);
  const unsigned h = static_cast<unsigned>(H), nb = static_cast<unsigned>(B), p = static_cast<unsigned>(plan.segments);
  auto median = [](auto launch) { return time_launches(launch)[10]; };
  const float t1 = median([&] {
    if (plan.lead) launch_head<128, 128, Pass::kTransition, Pass::kForward>(a, dim3(2, h, nb * (p - 1)), 0);
    else launch_head<128, 128, Pass::kTransition>(a, dim3(2, h, nb * (p - 1)), 0);
  });
  const float t2 = median([&] { launch_segment_scan<128>(a, states, B, 0); });
  const float t2_2 = median([&] { launch_segment_scan_with<128, 2>(a, states, B, 0); });
  std::printf("  scan: the launcher's %.4f ms; with two buffers of A %.4f ms\n", t2, t2_2);
  ChunkedArgs f = a;
  f.segment_states = states;
  const float t3 = median([&] { launch_head<128, 128, Pass::kForward>(f, dim3(1, h, nb * (plan.lead ? p - 1 : p)), 0); });
  const cudaError_t e = cudaDeviceSynchronize();
  std::printf("B=%ld T=%ld H=%ld seg=%ld lead=%ld: P=%ld segments of %ld, first %ld, lead %d: transitions "
              "%.3f scan %.3f forward %.3f sum %.3f ms (%s)\n",
              (long)B, (long)T, (long)H, (long)seg, (long)lead, (long)plan.segments, (long)plan.segment_length,
              (long)plan.first_segment_length, (int)plan.lead, t1, t2, t3, t1 + t2 + t3, cudaGetErrorString(e));
  std::fflush(stdout);
  cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(beta), cudaFree(g), cudaFree(o), cudaFree(fs), cudaFree(ws);
}

void check_against_serial(int64_t B, int64_t T, int64_t H, int64_t seg, int64_t lead) {
  const int64_t K = 128, V = 128, n = B * T * H;
  bf16 *q, *k, *v, *beta, *o[2];
  float *g, *fs[2], *init;
  cudaMalloc(&q, n * K * 2), cudaMalloc(&k, n * K * 2), cudaMalloc(&v, n * V * 2), cudaMalloc(&beta, n * 2);
  cudaMalloc(&g, n * K * 4), cudaMalloc(&init, B * H * K * V * 4);
  for (int i = 0; i < 2; ++i) cudaMalloc(&o[i], n * V * 2), cudaMalloc(&fs[i], B * H * K * V * 4);
  fill_bf16<<<1024, 256>>>(q, n * K, 11, 0.09f);
  fill_bf16<<<1024, 256>>>(k, n * K, 12, 0.09f);
  fill_bf16<<<1024, 256>>>(v, n * V, 13, 1.0f);
  fill_bf16<<<1024, 256>>>(beta, n, 14, 0.5f);
  fill_f32<<<1024, 256>>>(g, n * K, 15, -0.002f, 0.0f);
  fill_f32<<<1024, 256>>>(init, B * H * K * V, 16, -0.5f, 0.5f);
  for (int path = 0; path < 2; ++path) {
    KdaChunkedOptions opt;
    opt.segment_length = path == 0 ? -1 : seg;
    opt.lead_length = lead;
    const cudaError_t e = kda_chunked_forward(KdaDtype::kBFloat16, q, k, v, g, beta, init, o[path], fs[path], nullptr,
                                              B, T, H, K, V, 0.088f, opt, 0);
    if (e != cudaSuccess) std::printf("launch: %s\n", cudaGetErrorString(e));
  }
  const cudaError_t done = cudaDeviceSynchronize();
  std::vector<uint16_t> a(n * V), b(n * V);
  cudaMemcpy(a.data(), o[0], n * V * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(b.data(), o[1], n * V * 2, cudaMemcpyDeviceToHost);
  auto to_f = [](uint16_t x) { uint32_t u = static_cast<uint32_t>(x) << 16; float f; std::memcpy(&f, &u, 4); return f; };
  double diff = 0, mag = 0;
  for (int64_t i = 0; i < n * V; ++i) diff = std::max(diff, (double)std::fabs(to_f(a[i]) - to_f(b[i]))), mag = std::max(mag, (double)std::fabs(to_f(a[i])));
  std::vector<float> fa(B * H * K * V), fb(fa.size());
  cudaMemcpy(fa.data(), fs[0], fa.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(fb.data(), fs[1], fb.size() * 4, cudaMemcpyDeviceToHost);
  double sdiff = 0, smag = 0;
  for (size_t i = 0; i < fa.size(); ++i) sdiff = std::max(sdiff, (double)std::fabs(fa[i] - fb[i])), smag = std::max(smag, (double)std::fabs(fa[i]));
  KdaChunkedOptions opt;
  opt.segment_length = seg, opt.lead_length = lead;
  const SegmentPlan plan = plan_segments(false, B, T, H, K, V, opt, walks_whole_heads(KdaDtype::kBFloat16, K, V, opt));
  std::printf("check B=%ld T=%ld H=%ld seg=%ld lead=%ld (P=%ld of %ld, first %ld, lead %d): o %.3g of %.3g "
              "(%.2e), final state %.3g of %.3g (%.2e) %s\n",
              (long)B, (long)T, (long)H, (long)seg, (long)lead, (long)plan.segments, (long)plan.segment_length,
              (long)plan.first_segment_length, (int)plan.lead, diff, mag, diff / mag, sdiff, smag,
              sdiff / smag, cudaGetErrorString(done));
  std::fflush(stdout);
  for (int i = 0; i < 2; ++i) cudaFree(o[i]), cudaFree(fs[i]);
  cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(beta), cudaFree(g), cudaFree(init);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 5 && std::strcmp(argv[1], "check") == 0) {
    for (int i = 5; i < argc; ++i) {
      check_against_serial(std::atol(argv[2]), std::atol(argv[3]), std::atol(argv[4]), std::atol(argv[i]),
                           std::atol(std::strchr(argv[i], ':') + 1));
    }
    return 0;
  }
  if (argc >= 5 && std::strcmp(argv[1], "phases") == 0) {
    for (int i = 5; i < argc; ++i) {
      time_phases(std::atol(argv[2]), std::atol(argv[3]), std::atol(argv[4]), std::atol(argv[i]),
                  std::atol(std::strchr(argv[i], ':') + 1));
    }
    return 0;
  }
  if (argc >= 5 && std::strcmp(argv[1], "sweep") == 0) {
    for (int i = 5; i < argc; ++i) {
      const int64_t seg = std::atol(argv[i]), lead = std::atol(std::strchr(argv[i], ':') + 1);
      run_case(std::atol(argv[2]), std::atol(argv[3]), std::atol(argv[4]), seg, lead, true, false, false, 1);
    }
    return 0;
  }
  if (argc == 10) {
    int bad = 0;
    for (int r = 0; r < std::atoi(argv[9]); ++r) {
      bad |= run_case(std::atol(argv[1]), std::atol(argv[2]), std::atol(argv[3]), std::atol(argv[4]),
                      std::atol(argv[5]), std::atoi(argv[6]), std::atoi(argv[7]), std::atoi(argv[8]));
    }
    return bad;
  }
  int bad = 0;
  bad |= run_case(1, 37, 3, -1, 0, false, false, false);        // one partial chunk group
  bad |= run_case(2, 1000, 5, -1, 0, false, false, true);       // the ring of slots many times over
  bad |= run_case(1, 160, 2, -1, 0, false, false, false);       // whole chunks only
  bad |= run_case(1, 5000, 4, 1024, -1, false, false, true);    // context parallel
  bad |= run_case(1, 5000, 4, 1024, 1600, false, false, true);  // ... with a lead (and a partial last segment)
  bad |= run_case(1, 5000, 4, 512, 4608, false, false, true);   // ... a lead and one segment (P = 2: no scan)
  bad |= run_case(2, 5000, 3, 416, 848, false, true, true);     // the states pass with a lead
  bad |= run_case(1, 3000, 4, -1, 0, false, true, false);       // the states pass
  bad |= run_case(2, 16384, 64, -1, 0, true, false, false);     // the bench's main shape
  bad |= run_case(2, 16384, 64, -1, 0, true, true, false);      // its states pass (backward pass 1)
  bad |= run_case(1, 65536, 4, 0, -1, true, false, false);      // few heads: context parallel, no lead
  bad |= run_case(1, 65536, 4, 0, 0, true, false, false);       // ... the automatic lead
  return bad;
}
