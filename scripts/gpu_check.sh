#!/usr/bin/env bash
# Everything the GPU machine checks, in one pass (the machine: ../shared/gpu/README.md):
#   1. build with -DODYSSEY_CUDA=ON (kernels_tests, model_tests, odyssey)
#   2. the kernel parity tests (ctest label gpu: kernels_tests) and the model's GPU-only tests
#   3. odyssey bench kernels (KDA forward/backward/decode, MoE layer; ratios against LibTorch)
#   4. one learner step on a 64K-token and on a 1M-token trajectory (time, peak GPU memory)
# Logs and results go to $OUT (default gpu-out/); each step has its own time limit, so a slow one
# still leaves the others' results. Run from the repository root, after `source .gpu/env.sh` on
# the GPU machine. SKIP_LONG=1 leaves out step 4.
set -uo pipefail
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
BUILD="${BUILD_DIR:-build-gpu}"

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, log to $OUT/NAME.log, show its tail
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $((SECONDS - t0)) s"
  return $rc
}

step cmake 120 cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DODYSSEY_CUDA=ON || { tail -30 "$OUT/cmake.log"; exit 1; }
step build 400 cmake --build "$BUILD" -j"$(nproc)" --target kernels_tests model_tests odyssey ||
  { grep -E -A12 "error|Error" "$OUT/build.log" | head -120; exit 1; }

step kernels_tests 300 "$BUILD/tests/kernels_tests"
grep -E "^\[  (FAILED|PASSED) |^\[  FAILED  \]|Failure|max" "$OUT/kernels_tests.log" | tail -80
step model_gpu_tests 120 "$BUILD/tests/model_tests" --gtest_filter='BlockwiseAttention.*:*Gpu*:*Cuda*:*CUDA*'
grep -E "^\[  (FAILED|PASSED) |^\[  FAILED  \]|Failure|GPU tiles|fused vs" "$OUT/model_gpu_tests.log" | tail -20

step bench_kernels 240 "$BUILD/cli/odyssey" bench kernels
tail -40 "$OUT/bench_kernels.log"

if [ "${SKIP_LONG:-0}" != 1 ]; then
  step learner_64k 120 "$BUILD/cli/odyssey" bench learner --long 65536 --device cuda --chunk-tokens 16384
  tail -4 "$OUT/learner_64k.log"
  step learner_1m "${LONG_LIMIT_S:-300}" "$BUILD/cli/odyssey" bench learner --long 1000000 --device cuda --chunk-tokens 16384
  tail -4 "$OUT/learner_1m.log"
fi
