#!/usr/bin/env python3
"""Per warp and phase, the cycles of work in pass 3 of the KDA backward (kda_chunk_gradient_kernel):
which warp holds up which barrier. On the GPU machine, from the repository root:

  python3 scripts/kda_pass3_phases.py [B T H [K V]]        (defaults 2 16384 64 128 128)
  python3 scripts/kda_pass3_phases.py --kernel variant/kernels/kda_backward.cu --build OUT
      (instrument a variant of the kernel and only build OUT, e.g. on a machine with nvcc but no
      GPU; then `OUT B T H [K V]` on the GPU machine prints the same table)

Writes an instrumented copy of kernels/kda_backward.cu into a temporary folder (each warp's lane
0 adds clock64() since the last barrier's exit to a per-CTA, per-warp, per-phase counter just
before every __syncthreads; thread 0 also adds each whole interval), builds
scripts/kda_backward_driver.cu against it (`nvcc`, or $NVCC; ~1.5 min), runs it and prints a
table: phase i is the work before the i-th __syncthreads of the kernel's source (0: the wait for
the first loads), one column a warp, averaged over the chunks, and the largest. The counters'
atomics slow the pass by ~10%; read the table for shares and imbalance, time with the driver.
A phase's time is its slowest warp's: where one column stands out, that warp is the critical path.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MACROS = """
// ---- inserted by scripts/kda_pass3_phases.py ----
constexpr int kProfileCtas = 1024;
__device__ unsigned long long g_phase_cycles[16];
__device__ unsigned long long g_warp_phase[kProfileCtas][16][16];
#define PHASE(n) do { if (threadIdx.x == 0) { long long now_ = clock64(); atomicAdd(&g_phase_cycles[n], (unsigned long long)(now_ - last_clock)); last_clock = now_; } } while (0)
#define WSTART() do { warp_start = clock64(); } while (0)
#define WEND(n) do { if ((threadIdx.x & 31) == 0 && blockIdx.x < kProfileCtas) atomicAdd(&g_warp_phase[blockIdx.x][threadIdx.x >> 5][n], (unsigned long long)(clock64() - warp_start)); } while (0)
"""

REPORT = r"""
    static unsigned long long zeros[kProfileCtas][16][16] = {}, counts[kProfileCtas][16][16];
    cudaMemcpyToSymbol(g_warp_phase, zeros, sizeof(zeros));
    check(pass3(), "pass 3");
    cudaMemcpyFromSymbol(counts, g_warp_phase, sizeof(counts));
    {
      const double per = static_cast<double>(B * H * chunks);
      std::printf("pass 3: cycles of work per chunk, phase (before the i-th __syncthreads) x warp\n");
      for (int p = 0; p < 16; ++p) {
        double total = 0, most = 0, row[16];
        for (int w = 0; w < 16; ++w) {
          double t = 0;
          for (int b = 0; b < kProfileCtas; ++b) t += counts[b][w][p];
          row[w] = t / per, total += row[w], most = row[w] > most ? row[w] : most;
        }
        if (total == 0) continue;
        std::printf("  phase %2d:", p);
        for (int w = 0; w < 16; ++w) std::printf(" %5.0f", row[w]);
        std::printf("  | max %5.0f\n", most);
      }
    }
"""


def instrument(kernel_source):
    start = kernel_source.index("kda_chunk_gradient_kernel(const ChunkGradientArgs a) {")
    end = kernel_source.index("\nstruct BackwardLayout", start)
    body = kernel_source[start:end]
    body = body.replace("Shared& sh = *reinterpret_cast<Shared*>(shared_raw);",
                        "Shared& sh = *reinterpret_cast<Shared*>(shared_raw);\n"
                        "  long long last_clock = clock64(), warp_start = clock64();", 1)
    parts = body.split("__syncthreads();")
    out = parts[0]
    for i, part in enumerate(parts[1:]):
        out += f"WEND({i}); __syncthreads(); PHASE({i}); WSTART();" + part
    source = kernel_source[:start] + out + kernel_source[end:]
    anchor = source.rindex("template <typename T, int K, int V>", 0, source.index("kda_chunk_gradient_kernel(const ChunkGradientArgs a)"))
    return source[:anchor] + MACROS + source[anchor:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shape", nargs="*", default=["2", "16384", "64"], help="B T H [K V]")
    parser.add_argument("--kernel", default=os.path.join(ROOT, "kernels", "kda_backward.cu"),
                        help="the kda_backward.cu to instrument (default: the repository's)")
    parser.add_argument("--build", metavar="OUT", help="only build the instrumented driver as OUT")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="kda_pass3_phases_")
    os.makedirs(os.path.join(work, "kernels"))
    with open(args.kernel) as f:
        kernel = instrument(f.read())
    with open(os.path.join(work, "kernels", "kda_backward.cu"), "w") as f:
        f.write(kernel)
    with open(os.path.join(ROOT, "scripts", "kda_backward_driver.cu")) as f:
        driver = f.read()
    hook = '    check(pass3(), "pass 3");\n    cudaMemcpyFromSymbol(cycles, g_phase_cycles, sizeof(cycles));'
    if hook not in driver:
        sys.exit("scripts/kda_backward_driver.cu: the KDA_PHASE_PROFILE block this script extends was not found")
    driver = driver.replace(hook, hook + REPORT, 1)
    # Quoted includes resolve next to the including file first: the driver copy sits in `work`,
    # so "kernels/kda_backward.cu" is the instrumented one; the rest comes from -I ROOT.
    driver_path = os.path.join(work, "driver.cu")
    with open(driver_path, "w") as f:
        f.write(driver)
    binary = os.path.abspath(args.build) if args.build else os.path.join(work, "driver")
    nvcc = os.environ.get("NVCC", "nvcc")
    command = [nvcc, "-O3", "-std=c++17", "-arch=sm_90", "--expt-relaxed-constexpr", "-DKDA_PHASE_PROFILE", f"-I{work}", f"-I{ROOT}",
               driver_path, os.path.join(ROOT, "kernels", "kda.cu"), "-o", binary]
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True)
    if not args.build:
        subprocess.run([binary] + args.shape, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
