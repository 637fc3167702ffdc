// `odyssey bench kernels` (GPU build, -DODYSSEY_CUDA=ON): the CUDA kernels of kernels/ against
// their plain LibTorch references, measured in the same run with CUDA events (warm-up, then
// best and median of N). Rows:
//   copy        device-to-device copy bandwidth (the memory floor's yardstick)
//   kda forward B=2, T=16K, H=64, K=V=128 bf16 and B=1, T=64K, H=4: kernel vs
//               kda::chunked_reference (ratio), TFLOP/s, fraction of the memory floor (bytes of
//               q, k, v, g, beta in and o out at the measured copy bandwidth); B=1, T=64K, H=4
//               twice: the serial walk and the automatic (context-parallel) path; the main shape
//               also without the L2 prefetch of the next group's inputs
//   kda backward B=2, T=16K, H=64, K=V=128 bf16: the backward kernel (preallocated outputs and
//               workspace) as a multiple of the forward's time (goal <= 3x); with references, a
//               training step (forward + backward) of the kernels vs autograd of
//               kda::chunked_reference
//   kda decode  batch 256, H=64, K=V=128: kernel vs kda::step_reference, state GB/s
// Last lines: `kda_forward_ms: X` (the kernel's best time at B=2, T=16K, H=64) and
// `kda_backward_ms: Y (Rx the forward)`.
// On a CPU build the command fails with kFailedPrecondition (it needs the CUDA build).
#pragma once

#include <cstdint>

#include "core/status.h"

namespace odyssey::bench {

struct KernelsBenchOptions {
  int warmup = 3;
  int repeats = 20;           // kernel timings: best and median of this many
  int reference_repeats = 3;  // LibTorch reference timings (slow): best of this many
  bool reference = true;      // time the references (the ratio column)
};

struct KernelsBenchResult {
  double copy_gb_per_s = 0;
  double kda_forward_ms = 0;            // B=2, T=16K, H=64, K=V=128, bf16, best
  double kda_forward_reference_ms = 0;  // kda::chunked_reference on the same inputs, best
  double kda_forward_no_prefetch_ms = 0;  // the kernel without the L2 prefetch, best
  double kda_forward_long_ms = 0;       // B=1, T=64K, H=4 (automatic: context parallel)
  double kda_forward_long_serial_ms = 0;  // the same, serial walk (8 CTAs)
  double kda_backward_ms = 0;           // B=2, T=16K, H=64, K=V=128, bf16, best
  double kda_decode_ms = 0;             // batch 256, H=64
};

Result<KernelsBenchResult> run_kernels_bench(const KernelsBenchOptions& options);

}  // namespace odyssey::bench
