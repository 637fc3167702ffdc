#!/usr/bin/env bash
# Builds the replay message fuzzer and runs it:
#   fuzz/run.sh [SECONDS]      (default 120)
# Installs clang-14 and libfuzzer-14-dev with apt-get when missing (idempotent, as dev.sh),
# configures build-fuzz/ (clang-14, Ninja, ccache, -DODYSSEY_FUZZ=ON -DODYSSEY_TESTS=OFF),
# builds only replay_messages_fuzz, regenerates the seeds into the working corpus
# (build-fuzz/corpus, kept between runs; the committed regression inputs in fuzz/corpus/ are
# read as well), and fuzzes for SECONDS with fuzz/replay_messages.dict. Crashes land in
# build-fuzz/artifacts/; replay one with build-fuzz/fuzz/replay_messages_fuzz FILE
# (ODYSSEY_FUZZ_VERBOSE=1 prints each store operation's outcome).
# BUILD_DIR (default build-fuzz), JOBS (default nproc) and FUZZ_ARGS (extra libFuzzer flags)
# may be set.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

SECONDS_TO_RUN="${1:-120}"
BUILD_DIR="${BUILD_DIR:-build-fuzz}"
JOBS="${JOBS:-$(nproc)}"
PACKAGES=(clang-14 libfuzzer-14-dev)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "fuzz/run.sh: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
  -DODYSSEY_FUZZ=ON -DODYSSEY_TESTS=OFF >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS" --target replay_messages_fuzz

FUZZER="$BUILD_DIR/fuzz/replay_messages_fuzz"
CORPUS="$BUILD_DIR/corpus"
ARTIFACTS="$BUILD_DIR/artifacts"
# The fuzz store's temporary directory lives here, so one left by a crashed run is removed.
FUZZ_TMP="$PWD/$BUILD_DIR/tmp"
rm -rf "$FUZZ_TMP"
mkdir -p "$CORPUS" "$ARTIFACTS" "$FUZZ_TMP"
ODYSSEY_FUZZ_WRITE_SEEDS="$CORPUS" "$FUZZER"
SEEDS=()
[ -d fuzz/corpus ] && SEEDS+=(fuzz/corpus)

LOG="$BUILD_DIR/fuzz.log"
echo "fuzz/run.sh: fuzzing for ${SECONDS_TO_RUN}s (log: $LOG)"
set +e
# shellcheck disable=SC2086  # FUZZ_ARGS is a list of flags
TMPDIR="$FUZZ_TMP" "$FUZZER" -max_len=65536 -max_total_time="$SECONDS_TO_RUN" -print_final_stats=1 \
  -dict=fuzz/replay_messages.dict -artifact_prefix="$ARTIFACTS/" ${FUZZ_ARGS:-} \
  "$CORPUS" "${SEEDS[@]}" 2>&1 | tee "$LOG" | grep --line-buffered -E '^#[0-9]+[[:space:]]+(INITED|pulse|DONE)'
rc=${PIPESTATUS[0]}
set -e
echo "--- final stats"
grep -E '^(#[0-9]+[[:space:]]+DONE|stat::|Done [0-9]+ runs)' "$LOG" || true
if ((rc != 0)); then
  echo "fuzz/run.sh: the fuzzer stopped with status $rc; the end of $LOG:" >&2
  tail -n 60 "$LOG" >&2
  exit "$rc"
fi
