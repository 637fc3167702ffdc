#!/usr/bin/env bash
# Bits and time of the working tree's KDA backward against a git revision's, in one GPU-machine call
# (kernels_tests is the real parity test; this is the quick check of a kernel change between them).
#
#   source .gpu/env.sh && scripts/kda_backward_check.sh REV [MODE]
#
# REV: a git revision, or a folder holding that revision's kernels/ and scripts/ (for machines whose
# copy of the tree has no .git: `git archive REV kernels scripts | tar -x -C scratch/old` here first).
#
# Builds scripts/kda_backward_driver.cu twice, from REV's kernels/ and scripts/ and from the working
# tree, sharing one object of kernels/kda.cu when REV's forward sources are the working tree's (the
# forward takes twice as long to compile as the backward). Then, on each shape of $SHAPES (default
# "1 2000 3 128 128" and "2 4133 2 128 128"), REV's driver saves its gradients and the working tree's
# compares with them: every gradient's "max |diff| 0.000e+00" means the same bits. MODE, passed to
# both drivers after the file: "blocks" or "chunks" (pass 3 by 32-token blocks or 16-token chunks;
# drivers before the seventeenth session know only "blocks"); empty: each driver's default. Last,
# both drivers time the passes at $TIMING (default "2 16384 64 128 128"). Exits non-zero when a
# build fails or a gradient differs.
set -euo pipefail

rev=${1:?usage: scripts/kda_backward_check.sh REV [blocks|chunks]}
mode=${2:-}
IFS=';' read -r -a shapes <<<"${SHAPES:-1 2000 3 128 128;2 4133 2 128 128}"
timing=${TIMING:-2 16384 64 128 128}
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
flags=(-O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

mkdir -p "$work/old"
if [ -d "$rev/kernels" ] && [ -d "$rev/scripts" ]; then
  cp -r "$rev/kernels" "$rev/scripts" "$work/old/"
elif ! git archive "$rev" kernels scripts 2>/dev/null | tar -x -C "$work/old" 2>/dev/null; then
  echo "kda_backward_check: $rev is neither a git revision here nor a folder with kernels/ and scripts/"
  exit 1
fi
forward_sources=(kernels/kda.cu kernels/kda.h kernels/kda_chunk.cuh kernels/mma.cuh)
same_forward=1
for f in "${forward_sources[@]}"; do
  cmp -s "$f" "$work/old/$f" || same_forward=0
done

pids=()
"$nvcc" "${flags[@]}" -I. -c kernels/kda.cu -o "$work/kda_new.o" >"$work/kda_new.log" 2>&1 & pids+=($!)
if [ "$same_forward" = 0 ]; then
  "$nvcc" "${flags[@]}" -I"$work/old" -c "$work/old/kernels/kda.cu" -o "$work/kda_old.o" >"$work/kda_old.log" 2>&1 &
  pids+=($!)
fi
"$nvcc" "${flags[@]}" -I. -c scripts/kda_backward_driver.cu -o "$work/drv_new.o" >"$work/drv_new.log" 2>&1 & pids+=($!)
"$nvcc" "${flags[@]}" -I"$work/old" -c "$work/old/scripts/kda_backward_driver.cu" -o "$work/drv_old.o" \
  >"$work/drv_old.log" 2>&1 & pids+=($!)
failed=0
for p in "${pids[@]}"; do wait "$p" || failed=1; done
if [ "$failed" = 1 ]; then
  grep -h -E "error" "$work"/*.log | head -20
  echo "kda_backward_check: a build failed (logs above)"
  exit 1
fi
old_forward="$work/kda_new.o"
[ "$same_forward" = 1 ] || old_forward="$work/kda_old.o"
"$nvcc" -arch=sm_90a "$work/drv_new.o" "$work/kda_new.o" -o "$work/new"
"$nvcc" -arch=sm_90a "$work/drv_old.o" "$old_forward" -o "$work/old_driver"
echo "built at ${SECONDS} s ($( [ "$same_forward" = 1 ] && echo "one forward object" || echo "two forward objects"))"

status=0
for shape in "${shapes[@]}"; do
  # shellcheck disable=SC2086  # a shape is five numbers
  "$work/old_driver" $shape "$work/g.bin" $mode >"$work/run.log" 2>&1 ||
    { tail -3 "$work/run.log"; echo "kda_backward_check: $rev's driver failed on $shape"; exit 1; }
  # shellcheck disable=SC2086
  "$work/new" $shape "$work/g.bin" $mode >"$work/run.log" 2>&1 ||
    { tail -3 "$work/run.log"; echo "kda_backward_check: the working tree's driver failed on $shape"; exit 1; }
  out=$(grep -E "max \|diff\|" "$work/run.log")
  echo "== $shape ${mode:-default}: $rev against the working tree"
  echo "$out"
  # The driver's own lines comparing its variants ("... against recomputed") are not REV's against
  # the working tree's: they differ by design and do not count.
  if echo "$out" | grep -v "against recomputed" | grep -v -q "max |diff| 0.000e+00"; then status=1; fi
  rm -f "$work/g.bin"
done
echo "== timing at $timing: $rev"
# shellcheck disable=SC2086
"$work/old_driver" $timing | grep -E "backward|pass"
echo "== timing at $timing: the working tree"
# shellcheck disable=SC2086
"$work/new" $timing | grep -E "backward|pass"
[ "$status" = 0 ] && echo "kda_backward_check: the same bits on every shape" || echo "kda_backward_check: GRADIENTS DIFFER"
exit "$status"
