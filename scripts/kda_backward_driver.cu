// A standalone timing driver for kernels/kda_backward.cu (not part of the CMake build): includes
// the backward's source (so its passes can be launched and timed one by one) and links the
// forward's (pass 1 is kda_chunked_forward):
//   nvcc -O3 -std=c++17 -arch=sm_90 [-Ivariant] -I. scripts/kda_backward_driver.cu kernels/kda.cu \
//       -o /tmp/kda_bwd
//   /tmp/kda_bwd B T H [K V [save.bin | compare.bin [blocks | chunks | blocks64 | blocks64p]]]
//   (defaults 2 16384 64 128 128)
// -Ivariant first: a folder holding a modified kernels/kda_backward.cu is used instead.
// On the GPU machine kernels/kda.cu takes twice as long to compile as the backward: build it once
// (nvcc ... -c kernels/kda.cu -o /tmp/kda.o, in parallel with the drivers' -c) and link each
// variant's driver against it, when only the backward differs.
// Random inputs (bf16 q, k, v, beta, d_o; g in [-0.3, 0]; a d final state); prints the best and
// median of the whole backward and of pass 1 (states), pass 2 (reverse walk) and pass 3 (chunk
// gradients) alone, and at K = V = 128 passes 1 and 2 storing every second state and pass 3 by
// 32-token blocks (kda_block_gradient.cuh), then passes 1 and 2 keeping V' and dV' as well and
// pass 3 reading them (the default since the eighteenth session; its gradients against the
// recompute's in the same run), and pass 1 storing every fourth state with pass 3 in chained pairs
// (the default since the twentieth). With -DKDA_PHASE_PROFILE: pass 3's cycles per block between
// barriers, and each compute warp's work before each barrier (which warp every barrier waits for).
// `save.bin` writes the gradients; a later run (another build) given the same
// file as `compare.bin` prints each gradient's largest difference relative to its largest
// magnitude: a quick check of a variant between parity-test runs (kernels_tests is the real one).
#include "kernels/kda_backward.cu"
#include "scripts/kda_driver_inputs.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

using namespace odyssey::kernels;

static void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) { std::printf("%s: %s\n", what, cudaGetErrorString(e)); std::exit(1); }
}

int main(int argc, char** argv) {
  const int64_t B = argc > 1 ? atoll(argv[1]) : 2, T = argc > 2 ? atoll(argv[2]) : 16384,
                H = argc > 3 ? atoll(argv[3]) : 64, K = argc > 4 ? atoll(argv[4]) : 128,
                V = argc > 5 ? atoll(argv[5]) : 128;
  const std::string file = argc > 6 ? argv[6] : "";
  // After the file, "chunks": the whole backward with pass 3 by 16-token chunks; "blocks" (the
  // default): by 32-token blocks; "blocks64": by fused 64-token blocks (KdaBackwardOptions::
  // pass3_block_tokens), "blocks64p" with their producer warp. The whole backward's line and the
  // saved or compared gradients follow it; the passes timed alone stay the 32-token ones.
  KdaBackwardOptions options;
  const std::string mode = argc > 7 ? argv[7] : "blocks";
  options.pass3_blocks = mode != "chunks";
  options.pass3_block_tokens = mode == "blocks64" || mode == "blocks64p" ? 64 : 32;
  options.pass3_block_producer = mode == "blocks64p";
  const int64_t n = B * T * H, chunks = (T + kChunk - 1) / kChunk;
  bf16 *q, *k, *v, *beta, *d_o, *dq, *dk, *dv; float *g, *d_final, *dg, *dbeta, *d_init;
  cudaMalloc(&q, n * K * 2); cudaMalloc(&k, n * K * 2); cudaMalloc(&v, n * V * 2);
  cudaMalloc(&d_o, n * V * 2); cudaMalloc(&beta, n * 2); cudaMalloc(&g, n * K * 4);
  cudaMalloc(&d_final, B * H * K * V * 4); cudaMalloc(&d_init, B * H * K * V * 4);
  cudaMalloc(&dq, n * K * 2); cudaMalloc(&dk, n * K * 2); cudaMalloc(&dg, n * K * 4);  // dq, dk, dv: bf16
  cudaMalloc(&dv, n * V * 2); cudaMalloc(&dbeta, n * 4);
  fill_bf16<<<1024, 256>>>(q, n * K, 1, 0.09f); fill_bf16<<<1024, 256>>>(k, n * K, 2, 0.09f);
  fill_bf16<<<1024, 256>>>(v, n * V, 3, 1.0f); fill_bf16<<<1024, 256>>>(beta, n, 4, 0.5f);
  fill_f32<<<1024, 256>>>(g, n * K, 5, -0.3f, 0.0f); fill_bf16<<<1024, 256>>>(d_o, n * V, 6, 1.0f);
  fill_f32<<<1024, 256>>>(d_final, B * H * K * V, 7, -1.0f, 1.0f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(K));
  const size_t bytes = kda_chunked_backward_workspace_bytes(B, T, H, K, V);
  unsigned char* workspace;
  check(cudaMalloc(&workspace, bytes), "workspace");
  check(cudaDeviceSynchronize(), "inputs");

  auto backward = [&] {
    return kda_chunked_backward(KdaDtype::kBFloat16, q, k, v, g, beta, nullptr, d_o, d_final, dq, dk, dv,
                                dg, dbeta, d_init, B, T, H, K, V, scale, /*chunk_states=*/nullptr, workspace, bytes, 0,
                                options);
  };
  // The passes alone, on the workspace the whole backward fills (as kda_chunked_backward lays it out).
  const BackwardLayout layout(B, T, H, K, V);
  bf16* states = reinterpret_cast<bf16*>(workspace + layout.states);
  bf16* d_states = reinterpret_cast<bf16*>(workspace + layout.d_states);
  float* final_state = reinterpret_cast<float*>(workspace + layout.final_state);
  // interval: the state entering one chunk in every `interval` (2: what pass 3 by blocks reads).
  auto pass1_every = [&](int interval) {
    KdaChunkedOptions options;
    options.chunk_states = states;
    options.chunk_state_interval = interval;
    return kda_chunked_forward(KdaDtype::kBFloat16, q, k, v, g, beta, nullptr, nullptr, final_state,
                               nullptr, B, T, H, K, V, scale, options, 0);
  };
  auto pass1 = [&] { return pass1_every(1); };
  StateGradientArgs sa{};
  sa.forward.q = q, sa.forward.k = k, sa.forward.v = v, sa.forward.beta = beta, sa.forward.g = g;
  sa.forward.length = T, sa.forward.heads = static_cast<int>(H), sa.forward.value_dim = static_cast<int>(V);
  sa.forward.scale = scale, sa.forward.segment_length = T, sa.forward.first_segment_length = T;
  sa.forward.segments = 1;
  if (layout.reverse.segments > 1) {  // the reverse walk's context parallelism, as kda_chunked_backward sets it
    sa.forward.segment_length = layout.reverse.segment_length, sa.forward.segments = layout.reverse.segments;
    sa.forward.segment_states = reinterpret_cast<float*>(workspace + layout.segment_states);
    sa.forward.transition_a = reinterpret_cast<float*>(workspace + layout.transition_a);
    sa.forward.transition_b = reinterpret_cast<float*>(workspace + layout.transition_b);
    std::printf("reverse walk: %d segments of %ld tokens\n", layout.reverse.segments, (long)layout.reverse.segment_length);
  }
  sa.d_o = d_o, sa.d_final_state = d_final, sa.d_initial_state = d_init, sa.chunk_d_states = d_states;
  sa.forward.state_interval = 1;
  ChunkGradientArgs ca{};
  ca.states_interval = ca.d_states_interval = 1;
  ca.q = q, ca.k = k, ca.v = v, ca.beta = beta, ca.d_o = d_o, ca.g = g;
  ca.chunk_states = states, ca.chunk_d_states = d_states;
  ca.dq = dq, ca.dk = dk, ca.dv = dv, ca.dg = dg, ca.dbeta = dbeta;
  ca.length = T, ca.heads = static_cast<int>(H), ca.scale = scale;
  auto pass2 = [&]() -> cudaError_t {
    return with_walk_types(KdaDtype::kBFloat16, K, V, [&](auto type, auto key, auto tile) {
      return launch_state_gradients<typename decltype(type)::type, key(), tile()>(sa, B, V, 0);
    });
  };
  // Passes 1, 2 and 3 as pass3_blocks runs them: every second state and state gradient stored.
  auto every_second = [&](bool on) {
    sa.forward.state_interval = ca.states_interval = ca.d_states_interval = on ? 2 : 1;
  };
  auto pass1_second = [&] { return pass1_every(2); };
  auto pass2_second = [&]() -> cudaError_t {
    every_second(true);
    const cudaError_t e = pass2();
    every_second(false);
    return e;
  };
  auto pass3 = [&]() -> cudaError_t {
    return with_head_width(K, [&](auto key) {
      return with_head_width(V, [&](auto value) {
        return launch_chunk_gradients<bf16, key(), value()>(ca, B, chunks, 0);
      });
    });
  };

  // Pass 3 by 32-token blocks (kda_block_gradient.cuh, KdaBackwardOptions::pass3_blocks), bf16 K = V
  // = 128; with the loads issued at the top of every block, and by a producer warp (kProducer).
  auto pass3_blocks = [&]() -> cudaError_t {
    every_second(true);
    const cudaError_t e = launch_block_gradients<128, 128, BlockLoads::kTop>(ca, B, 0);
    every_second(false);
    return e;
  };
  auto pass3_blocks_tma = [&]() -> cudaError_t {
    every_second(true);
    const cudaError_t e = launch_block_gradients<128, 128, BlockLoads::kTma>(ca, B, 0);
    every_second(false);
    return e;
  };
  auto pass3_blocks_producer = [&]() -> cudaError_t {
    every_second(true);
    const cudaError_t e = launch_block_gradients<128, 128, BlockLoads::kProducer>(ca, B, 0);
    every_second(false);
    return e;
  };
  // What kda_chunked_backward runs by default since the eighteenth session: pass 1 keeping V' as
  // well, pass 2 keeping dV', and pass 3 by blocks reading both (kGiven) instead of recomputing them.
  bf16 *new_values = nullptr, *d_new_values = nullptr;
  check(cudaMalloc(&new_values, n * V * 2), "V'");
  check(cudaMalloc(&d_new_values, n * V * 2), "dV'");
  // Pass 1 keeping V' and the state entering one chunk in every `interval`.
  auto pass1_values_every = [&](int interval) {
    KdaChunkedOptions options;
    options.chunk_states = states;
    options.chunk_state_interval = interval;
    options.new_values = new_values;
    return kda_chunked_forward(KdaDtype::kBFloat16, q, k, v, g, beta, nullptr, nullptr, final_state, nullptr, B, T,
                               H, K, V, scale, options, 0);
  };
  auto pass1_values = [&] { return pass1_values_every(2); };
  auto pass2_values = [&]() -> cudaError_t {
    sa.d_new_values = d_new_values;
    const cudaError_t e = pass2_second();
    sa.d_new_values = nullptr;
    return e;
  };
  auto given = [&](bool on) {
    every_second(on);
    ca.new_values = on ? new_values : nullptr;
    ca.d_new_values = on ? d_new_values : nullptr;
  };
  auto pass3_given_top = [&]() -> cudaError_t {
    given(true);
    const cudaError_t e = launch_block_gradients<128, 128, BlockLoads::kTop, true, true>(ca, B, 0);
    given(false);
    return e;
  };
  // V' alone given (dV' recomputed in pass 3 as without it).
  auto pass3_v_given = [&]() -> cudaError_t {
    given(true);
    const cudaError_t e = launch_block_gradients<128, 128, BlockLoads::kProducer, true, false>(ca, B, 0);
    given(false);
    return e;
  };
  auto pass3_given_producer = [&]() -> cudaError_t {
    given(true);
    const cudaError_t e = launch_block_gradients<128, 128, BlockLoads::kProducer, true, true>(ca, B, 0);
    given(false);
    return e;
  };
  // Since the twentieth session, what kda_chunked_backward runs: pass 1 storing every fourth state
  // (with V'), and pass 3 taking its blocks in pairs and making the state entering each pair's second
  // block from the first's (ChunkGradientArgs::states_interval 4). Timed last: pass 1 at interval 4
  // leaves the states in that layout.
  auto pass1_fourth = [&] { return pass1_values_every(4); };
  auto pass3_chained = [&]() -> cudaError_t {
    given(true);
    ca.states_interval = 4;
    const cudaError_t e = launch_block_gradients<128, 128, BlockLoads::kProducer, true, true>(ca, B, 0);
    given(false);
    return e;
  };
  check(backward(), "backward");
  check(cudaDeviceSynchronize(), "backward (sync)");
  cudaEvent_t a, b;
  cudaEventCreate(&a); cudaEventCreate(&b);
  auto time = [&](const char* name, const std::function<cudaError_t()>& f) {
    std::vector<float> ms;
    for (int r = 0; r < 10; ++r) {
      cudaEventRecord(a); check(f(), name); cudaEventRecord(b); cudaEventSynchronize(b);
      float t; cudaEventElapsedTime(&t, a, b); ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    std::printf("  %-28s best %8.3f ms  median %8.3f ms\n", name, ms[0], ms[5]);
  };
  std::printf("kda backward B=%ld T=%ld H=%ld K=%ld V=%ld bf16 (workspace %.2f GB)\n", (long)B, (long)T,
              (long)H, (long)K, (long)V, bytes / 1e9);
  time("whole backward", backward);
  time("pass 1 (states)", pass1);
  time("pass 2 (reverse walk)", pass2);
  time("pass 3 (chunk gradients)", pass3);
  if (K == 128 && V == 128) {
    time("pass 1 (every 2nd state)", pass1_second);
    time("pass 2 (every 2nd dS')", pass2_second);
    time("pass 3 (32-token blocks)", pass3_blocks);
    time("pass 3 (blocks, producer warp)", pass3_blocks_producer);
    time("pass 3 (blocks, TMA)", pass3_blocks_tma);
    time("pass 1 (2nd state, V')", pass1_values);
    time("pass 2 (2nd dS', dV')", pass2_values);
    time("pass 3 (V' dV' given, top)", pass3_given_top);
    time("pass 3 (V' dV' given, producer)", pass3_given_producer);
    time("pass 3 (V' given, producer)", pass3_v_given);
    time("pass 1 (4th state, V')", pass1_fourth);
    time("pass 3 (chained pairs)", pass3_chained);
  }
  if (K == 128 && V == 128) {  // the load variants of pass 3 by blocks give the same bits
    // The states, dS', V' and dVb that every variant below reads, made afresh: the timed runs above
    // end with pass 1 storing every fourth state (for the chained pairs) in the same buffer, which
    // a pass 3 reading every second state would take for its own (until the thirtieth session the
    // comparisons "against recomputed" below read them so, and differed by up to 2e-2).
    check(pass1_values(), "pass 1 (2nd state, V')");
    check(pass2_values(), "pass 2 (2nd dS', dVb)");
    const size_t bytes_q = n * K * 2, bytes_g = n * K * 4;
    std::vector<char> first(3 * bytes_q + bytes_g + n * 4), again(first.size());
    auto snapshot = [&](std::vector<char>& out) {
      char* p = out.data();
      for (auto [src, len] : {std::pair<const void*, size_t>{dq, bytes_q}, {dk, bytes_q}, {dv, n * V * 2},
                              {dg, bytes_g}, {dbeta, n * 4}}) {
        cudaMemcpy(p, src, len, cudaMemcpyDeviceToHost);
        p += len;
      }
    };
    check(pass3_blocks(), "blocks (top)");
    snapshot(first);
    for (const auto& [name, run] : {std::pair<const char*, std::function<cudaError_t()>>{"producer warp",
                                                                                        pass3_blocks_producer},
                                    {"TMA", pass3_blocks_tma}}) {
      check(run(), name);
      snapshot(again);
      std::printf("  pass 3 by blocks, %s against loads at the top: %s\n", name,
                  first == again ? "bit for bit" : "DIFFERENT");
    }
    // V' and dV' given (the states and both kept by pass1_values and pass2_values, the last passes
    // timed): the two load variants bit for bit, and against the recompute within bf16 rounding.
    check(pass3_given_top(), "given (top)");
    std::vector<char> given_top(first.size());
    snapshot(given_top);
    check(pass3_given_producer(), "given (producer)");
    snapshot(again);
    std::printf("  pass 3 by blocks with V' and dV' given, producer warp against loads at the top: %s\n",
                given_top == again ? "bit for bit" : "DIFFERENT");
    check(pass3_v_given(), "V' given");
    std::vector<char> v_given(first.size());
    snapshot(v_given);
    const char* names[] = {"dq", "dk", "dv", "dg", "dbeta"};
    const size_t counts[] = {static_cast<size_t>(n * K), static_cast<size_t>(n * K), static_cast<size_t>(n * V),
                             static_cast<size_t>(n * K), static_cast<size_t>(n)};
    for (const auto& [label, variant] : {std::pair<const char*, const std::vector<char>*>{"V' dV' given", &again},
                                         {"V' given", &v_given}}) {
    size_t at = 0;
    for (int x = 0; x < 5; ++x) {
      double worst = 0, largest = 0;
      for (size_t i = 0; i < counts[x]; ++i) {
        double a, b;
        if (x < 3) {
          uint16_t ra, rb;
          std::memcpy(&ra, &(*variant)[at + 2 * i], 2), std::memcpy(&rb, &first[at + 2 * i], 2);
          const uint32_t ba = static_cast<uint32_t>(ra) << 16, bb = static_cast<uint32_t>(rb) << 16;
          float fa, fb;
          std::memcpy(&fa, &ba, 4), std::memcpy(&fb, &bb, 4);
          a = fa, b = fb;
        } else {
          float fa, fb;
          std::memcpy(&fa, &(*variant)[at + 4 * i], 4), std::memcpy(&fb, &first[at + 4 * i], 4);
          a = fa, b = fb;
        }
        worst = std::max(worst, std::fabs(a - b));
        largest = std::max(largest, std::fabs(b));
      }
      at += counts[x] * (x < 3 ? 2 : 4);
      std::printf("  %s against recomputed: %-5s max |diff| %.3e of max |ref| %.3e: %.3e\n", label, names[x], worst,
                  largest, worst / std::max(largest, 1e-30));
    }
    }
  }
  check(backward(), "backward");
  check(cudaDeviceSynchronize(), "backward (sync)");
#ifdef KDA_PHASE_PROFILE
  {  // -DKDA_PHASE_PROFILE: g_phase_cycles[16] (kda_block_gradient.cuh; clock64 between its barriers,
     // thread 0), for pass 3 by 32-token blocks with its loads at the top, then by a producer warp;
     // then each compute warp's work before each barrier (g_warp_phase_cycles), the slowest marked.
     // Each variant after the pass 1 that stores what it reads (every second state, or every fourth
     // for the chained pairs).
    const double items = static_cast<double>(B * H * ((T + kBlock - 1) / kBlock));
    struct Variant {
      const char* name;
      std::function<cudaError_t()> prepare, run;
    };
    const Variant variants[] = {{"loads at the top", pass1_second, pass3_blocks},
                                {"producer warp", pass1_second, pass3_blocks_producer},
                                {"TMA", pass1_second, pass3_blocks_tma},
                                {"V' dV' given, producer", pass1_values, pass3_given_producer},
                                {"V' given, producer", pass1_values, pass3_v_given},
                                {"chained pairs", pass1_fourth, pass3_chained}};
    for (const Variant& variant : variants) {
      check(variant.prepare(), "pass 1");
      unsigned long long zero[16] = {}, cycles[16];
      static unsigned long long warp_zero[kGradientWarps][16] = {}, warp_cycles[kGradientWarps][16];
      cudaMemcpyToSymbol(g_phase_cycles, zero, sizeof(zero));
      cudaMemcpyToSymbol(g_warp_phase_cycles, warp_zero, sizeof(warp_zero));
      check(variant.run(), "pass 3");
      cudaMemcpyFromSymbol(cycles, g_phase_cycles, sizeof(cycles));
      cudaMemcpyFromSymbol(warp_cycles, g_warp_phase_cycles, sizeof(warp_cycles));
      for (int i = 0; i < 16; ++i) {
        if (cycles[i]) std::printf("  pass 3 (%s) phase mark %2d: %8.0f cycles per 32-token block\n", variant.name, i, cycles[i] / items);
      }
      std::printf("  pass 3 (%s) work before each barrier, cycles per block (warps 0-15; * the slowest):\n", variant.name);
      for (int p = 0; p < 16; ++p) {
        int slowest = 0;
        for (int w = 1; w < kGradientWarps; ++w) slowest = warp_cycles[w][p] > warp_cycles[slowest][p] ? w : slowest;
        if (warp_cycles[slowest][p] == 0) continue;
        std::printf("    %s %d:", p == 0 ? "top  " : "phase", p == 0 ? 0 : p - 1);
        for (int w = 0; w < kGradientWarps; ++w) {
          std::printf(" %5.0f%s", warp_cycles[w][p] / items, w == slowest ? "*" : " ");
        }
        std::printf("\n");
      }
    }
  }
#endif

  struct Out { const char* name; const void* p; int64_t count; bool bf16; };
  const std::vector<Out> outs = {{"dq", dq, n * K, true},    {"dk", dk, n * K, true},
                                 {"dv", dv, n * V, true},    {"dg", dg, n * K, false},
                                 {"dbeta", dbeta, n, false}, {"d_init", d_init, B * H * K * V, false}};
  if (file.empty()) return 0;
  FILE* f = std::fopen(file.c_str(), "rb");
  const bool compare = f != nullptr;
  if (!compare) f = std::fopen(file.c_str(), "wb");
  for (const Out& o : outs) {
    std::vector<float> mine(o.count), ref(o.count);
    if (o.bf16) {
      std::vector<uint16_t> raw(o.count);
      cudaMemcpy(raw.data(), o.p, o.count * 2, cudaMemcpyDeviceToHost);
      for (int64_t i = 0; i < o.count; ++i) {
        const uint32_t bits = static_cast<uint32_t>(raw[i]) << 16;
        std::memcpy(&mine[i], &bits, 4);
      }
    } else {
      cudaMemcpy(mine.data(), o.p, o.count * 4, cudaMemcpyDeviceToHost);
    }
    if (!compare) { std::fwrite(mine.data(), 4, o.count, f); continue; }
    if (std::fread(ref.data(), 4, o.count, f) != static_cast<size_t>(o.count)) { std::printf("short file\n"); return 1; }
    double worst = 0, largest = 0; bool finite = true;
    for (int64_t i = 0; i < o.count; ++i) {
      finite = finite && std::isfinite(mine[i]);
      worst = std::max(worst, std::fabs(static_cast<double>(mine[i]) - ref[i]));
      largest = std::max(largest, std::fabs(static_cast<double>(ref[i])));
    }
    std::printf("  %-7s max |diff| %.3e of max |ref| %.3e: %.3e%s\n", o.name, worst, largest,
                worst / std::max(largest, 1e-30), finite ? "" : " (NOT FINITE)");
  }
  std::fclose(f);
  std::printf(compare ? "compared with %s\n" : "saved %s\n", file.c_str());
  return 0;
}
