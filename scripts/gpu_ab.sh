#!/usr/bin/env bash
# A same-machine A/B of the GPU learner step: an earlier commit against the working tree, built side
# by side on one GPU machine and timed alternately, so that neither the machine nor the card type
# differs between the two figures (the lent machines' hosts and cards vary: kernels/JOURNAL.md, "The
# host's side").
#
#   scripts/gpu_ab.sh prepare REV      on the CPU machine: REV's tracked files into gpu-base/
#                                      (git-ignored), then carry [".gpu", "gpu-base"] to the device
#   scripts/gpu_ab.sh run [PRECISIONS] on the GPU machine, after `source .gpu/env.sh`: builds
#                                      gpu-base/ (build-gpu-base/) and the working tree (build-gpu/),
#                                      then the small model's learner step at each precision
#                                      (default "highest medium"), base and new alternately, twice
#
# Results go to $OUT (default gpu-out/): one log a run, and ab.txt with the table of the steps'
# best times. ROUNDS (default 2) and TOKENS (default 4096) may be set; each run has a time limit, so
# a slow one still leaves the others' results.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

case "${1:-}" in
  prepare)
    rev="${2:?usage: scripts/gpu_ab.sh prepare REV}"
    git rev-parse --verify --quiet "$rev^{commit}" >/dev/null || { echo "gpu_ab: no commit '$rev'" >&2; exit 2; }
    rm -rf gpu-base && mkdir gpu-base && git archive "$rev" | tar -x -C gpu-base || exit 1
    git rev-parse "$rev" >gpu-base/.gpu_ab_rev
    echo "gpu_ab: $(cat gpu-base/.gpu_ab_rev) in gpu-base/; carry [\".gpu\", \"gpu-base\"] and run: source .gpu/env.sh && scripts/gpu_ab.sh run"
    ;;
  run)
    [ -d gpu-base ] || { echo "gpu_ab: no gpu-base/: run 'scripts/gpu_ab.sh prepare REV' on the CPU machine and carry it" >&2; exit 2; }
    OUT="${OUT:-gpu-out}"
    mkdir -p "$OUT"
    precisions="${2:-highest medium}"
    rounds="${ROUNDS:-2}" tokens="${TOKENS:-4096}"
    jobs=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))
    config=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DODYSSEY_CUDA=ON)
    t0=$SECONDS
    ( cmake -S gpu-base -B build-gpu-base "${config[@]}" >"$OUT/ab_cmake_base.log" 2>&1 &&
        cmake --build build-gpu-base -j"$jobs" --target odyssey >"$OUT/ab_build_base.log" 2>&1
      echo "== base build: exit $? at $((SECONDS - t0)) s" ) &
    ( cmake -S . -B build-gpu "${config[@]}" >"$OUT/ab_cmake_new.log" 2>&1 &&
        cmake --build build-gpu -j"$jobs" --target odyssey >"$OUT/ab_build_new.log" 2>&1
      echo "== new build: exit $? at $((SECONDS - t0)) s" ) &
    wait
    base_bin=build-gpu-base/cli/odyssey new_bin=build-gpu/cli/odyssey
    for bin in "$base_bin" "$new_bin"; do
      [ -x "$bin" ] || {
        echo "gpu_ab: $bin was not built; see $OUT/ab_cmake_*.log and $OUT/ab_build_*.log" >&2
        grep -s -E -A8 "error|Error" "$OUT"/ab_cmake_*.log "$OUT"/ab_build_*.log | head -60
        exit 1
      }
    done
    table="$OUT/ab.txt"
    echo "learner step, small model, $tokens tokens in chunks of 2048 ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)); base $(cat gpu-base/.gpu_ab_rev 2>/dev/null || echo '?')" >"$table"
    for round in $(seq 1 "$rounds"); do
      for precision in $precisions; do
        for side in base new; do
          bin=$base_bin config_file=gpu-base/configs/model/small.toml  # each side its own config
          [ "$side" = new ] && bin=$new_bin config_file=configs/model/small.toml
          log="$OUT/ab_${side}_${precision}_${round}.log"
          timeout 150 "$bin" bench learner --device cuda --model-config "$config_file" --long "$tokens" \
            --chunk-tokens 2048 --repeats 3 --float32-matmul-precision "$precision" >"$log" 2>&1
          step=$(grep -oE "one learner step in [0-9.]+ s" "$log" | grep -oE "[0-9.]+ s" | head -1)
          phases=$(grep -oE "policy gradient \(forward and backward\) [0-9.]+ s" "$log" | grep -oE "[0-9.]+ s" | head -1)
          printf "round %s  %-8s %-4s step %-8s policy gradient %s\n" "$round" "$precision" "$side" "${step:-failed}" \
            "${phases:--}" | tee -a "$table"
        done
      done
    done
    echo "== done in $((SECONDS - t0)) s; $table"
    ;;
  *)
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
