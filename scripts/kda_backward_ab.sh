#!/usr/bin/env bash
# Several versions of the KDA backward against one base, in a single GPU-machine call: their bits
# and their time, each measured beside the base on the same card (what the thirtieth session's
# calls did by hand; scripts/kda_backward_check.sh is the one-candidate form against the working tree).
#
#   source .gpu/env.sh && scripts/kda_backward_ab.sh BASE CANDIDATE...
#   MODE=blocks64 STRICT=1 ROUNDS=3 NCU=1 NCU_OUT=$OUT scripts/kda_backward_ab.sh BASE CANDIDATE   (bits, time, where)
#
# Each argument is a git revision, a folder holding a revision's kernels/ and scripts/, or "." (the
# working tree). A GPU machine's copy of the tree has no .git: there, pass folders made here first
# (`git archive REV kernels scripts | tar -x -C scratch/t_NAME`) and carry them.
#
# Builds scripts/kda_backward_driver.cu from each version, all at once (one object of
# kernels/kda.cu per distinct forward). Then, on each shape of $SHAPES (default "2 4133 2 128 128;
# 1 2000 3 128 128"), prints every candidate's gradients against the base's ("max |diff|
# 0.000e+00" on every line: the same bits; a candidate may change them on purpose, so a difference
# is reported, not an error, unless STRICT=1). $MODE, when set, goes to every driver after the file:
# "blocks" or "chunks" (pass 3 by 32-token blocks or 16-token chunks; drivers before the
# seventeenth session know only "blocks"), or on branch b64's drivers "blocks64" / "blocks64p" (the
# fused 64-token pass, by the compute warps' copies or a producer warp; it also goes to the timing
# runs then, whose whole-backward line follows it). Then times them at $TIMING (default "2 16384 64 128 128") in the
# order base, candidates..., for $ROUNDS rounds (default 2), printing the driver's lines that
# match $LINES (default: the whole backward and pass 3 with V' and dV' given and by chained pairs).
# PROFILE=1 also builds each version's -DKDA_PHASE_PROFILE driver and prints its pass-3 phase table
# (chained pairs). NCU=1 also profiles each version's pass 3 once at $TIMING with Nsight Compute
# (`--set full`; the kernel that $MODE runs) and prints, for each, the launch's duration, issue
# slots busy, warp cycles an issued instruction and instructions executed, then its table by phase
# (scripts/ncu_phases.py, counts per item): where a change's cycles went, in the same call that
# timed it. The reports and SASS exports go to $NCU_OUT when set (e.g. $OUT on the GPU machine).
# Exits non-zero when an argument is not a version or a build or run fails, and with STRICT=1
# when a candidate's gradients differ from the base's.
set -euo pipefail

[ "$#" -ge 2 ] || { echo "usage: scripts/kda_backward_ab.sh BASE CANDIDATE..." >&2; exit 2; }
IFS=';' read -r -a shapes <<<"${SHAPES:-2 4133 2 128 128;1 2000 3 128 128}"
timing=${TIMING:-2 16384 64 128 128}
rounds=${ROUNDS:-2}
lines=${LINES:-whole backward|given, producer|chained pairs}
mode=${MODE:-}
differ=0
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
flags=(-O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
forward_sources=(kernels/kda.cu kernels/kda.h kernels/kda_chunk.cuh kernels/mma.cuh)

# Each version's kernels/ and scripts/ into $work/vN; its label is the argument.
labels=()
n=0
for version in "$@"; do
  dir="$work/v$n"
  mkdir -p "$dir"
  if [ -d "$version/kernels" ] && [ -d "$version/scripts" ]; then
    cp -r "$version/kernels" "$version/scripts" "$dir/"
  elif ! git archive "$version" kernels scripts 2>/dev/null | tar -x -C "$dir" 2>/dev/null; then
    echo "kda_backward_ab: '$version' is neither a git revision here nor a folder with kernels/ and scripts/" >&2
    exit 2
  fi
  labels+=("$version")
  n=$((n + 1))
done

# One object of the forward per distinct set of forward sources, every driver, in parallel.
pids=()
declare -A forward_of=()  # version -> the object its driver links
for ((i = 0; i < n; i++)); do
  key=$(cd "$work/v$i" && cat "${forward_sources[@]}" | md5sum | cut -c1-12)
  forward_of[$i]="$work/kda_$key.o"
  if [ ! -e "$work/kda_$key.started" ]; then
    touch "$work/kda_$key.started"
    (cd "$work/v$i" && "$nvcc" "${flags[@]}" -I. -c kernels/kda.cu -o "$work/kda_$key.o") >"$work/kda_$key.log" 2>&1 &
    pids+=($!)
  fi
  (cd "$work/v$i" && "$nvcc" "${flags[@]}" -I. -c scripts/kda_backward_driver.cu -o "$work/drv$i.o") \
    >"$work/drv$i.log" 2>&1 &
  pids+=($!)
  if [ "${PROFILE:-0}" = 1 ]; then
    (cd "$work/v$i" && "$nvcc" "${flags[@]}" -DKDA_PHASE_PROFILE -I. -c scripts/kda_backward_driver.cu \
      -o "$work/prof$i.o") >"$work/prof$i.log" 2>&1 &
    pids+=($!)
  fi
done
failed=0
for p in "${pids[@]}"; do wait "$p" || failed=1; done
if [ "$failed" = 1 ]; then
  grep -h -E "error" "$work"/*.log | head -20
  echo "kda_backward_ab: a build failed (errors above)" >&2
  exit 1
fi
for ((i = 0; i < n; i++)); do
  "$nvcc" -arch=sm_90a "$work/drv$i.o" "${forward_of[$i]}" -o "$work/driver$i"
  [ "${PROFILE:-0}" = 1 ] && "$nvcc" -arch=sm_90a "$work/prof$i.o" "${forward_of[$i]}" -o "$work/profile$i"
done
echo "built $n drivers at ${SECONDS} s ($(ls "$work"/kda_*.o | wc -l) forward objects)"

for shape in "${shapes[@]}"; do
  # shellcheck disable=SC2086  # a shape is five numbers; mode one word or none
  "$work/driver0" $shape "$work/g.bin" $mode >"$work/run.log" 2>&1 ||
    { tail -3 "$work/run.log"; echo "kda_backward_ab: ${labels[0]}'s driver failed on $shape" >&2; exit 1; }
  for ((i = 1; i < n; i++)); do
    # shellcheck disable=SC2086
    "$work/driver$i" $shape "$work/g.bin" $mode >"$work/run.log" 2>&1 ||
      { tail -3 "$work/run.log"; echo "kda_backward_ab: ${labels[$i]}'s driver failed on $shape" >&2; exit 1; }
    out=$(grep -E "max \|diff\|" "$work/run.log" | grep -v "against recomputed" || true)
    if [ -z "$out" ]; then
      same="no comparison printed (does this driver take compare.bin?)"
      differ=1
    elif echo "$out" | grep -v -q "max |diff| 0.000e+00"; then
      same="differ"
      differ=1
    else
      same="the same bits"
    fi
    echo "== $shape${mode:+ $mode}: ${labels[$i]} against ${labels[0]}: $same"
    [ "$same" = "the same bits" ] || echo "$out"
  done
  rm -f "$work/g.bin"
done

echo "== timing at $timing (ms; best and median of the driver's repeats), $rounds rounds"
for ((r = 1; r <= rounds; r++)); do
  for ((i = 0; i < n; i++)); do
    echo "  -- ${labels[$i]} (round $r)"
    # shellcheck disable=SC2086
    "$work/driver$i" $timing ${mode:+"" $mode} | grep -E "$lines" | sed 's/^/  /'
  done
done

if [ "${PROFILE:-0}" = 1 ]; then
  for ((i = 0; i < n; i++)); do
    echo "== phase profile: ${labels[$i]}"
    "$work/profile$i" | sed -n '/chained pairs) phase mark/,$p' | head -30
  done
fi
if [ "${NCU:-0}" = 1 ]; then
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  read -r b t h _ <<<"$timing"
  case "$mode" in  # pass 3's kernel and its tokens an item
    blocks64 | blocks64p) kernel=kda_block64_gradient tokens=64 ;;
    chunks) kernel=kda_chunk_gradient tokens=16 ;;
    *) kernel=kda_block_gradient tokens=32 ;;
  esac
  items=$((b * ((t + tokens - 1) / tokens) * h))
  for ((i = 0; i < n; i++)); do
    echo "== Nsight Compute: ${labels[$i]}, $kernel at $timing ($items items)"
    # shellcheck disable=SC2086
    "$ncu" --set full --import-source yes -k "regex:$kernel" -c 1 -f -o "$work/ncu$i" \
      "$work/driver$i" $timing "" $mode >"$work/ncu$i.log" 2>&1 ||
      { tail -5 "$work/ncu$i.log"; echo "kda_backward_ab: Nsight Compute failed on ${labels[$i]}" >&2; exit 1; }
    "$ncu" --import "$work/ncu$i.ncu-rep" --page details --csv >"$work/ncu$i.details.csv"
    "$ncu" --import "$work/ncu$i.ncu-rep" --page source --csv --print-source sass >"$work/ncu$i.sass.csv"
    python3 "$(dirname "${BASH_SOURCE[0]}")/ncu_phases.py" "$work/ncu$i.sass.csv" --details "$work/ncu$i.details.csv" \
      --per "$items" --top 0 | sed 's/^/  /'
    if [ -n "${NCU_OUT:-}" ]; then
      mkdir -p "$NCU_OUT"
      cp "$work/ncu$i.ncu-rep" "$NCU_OUT/ncu_v$i.ncu-rep"
      cp "$work/ncu$i.sass.csv" "$NCU_OUT/ncu_v$i.sass.csv"
      cp "$work/ncu$i.details.csv" "$NCU_OUT/ncu_v$i.details.csv"
    fi
  done
fi
if [ "${STRICT:-0}" = 1 ] && [ "$differ" = 1 ]; then
  echo "kda_backward_ab: GRADIENTS DIFFER" >&2
  exit 1
fi
