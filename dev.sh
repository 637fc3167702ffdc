#!/usr/bin/env bash
# The two commands a new user needs on a fresh Debian 12 machine (see README.md):
#   ./dev.sh run     install what is missing, build, run the default job
#   ./dev.sh test    install what is missing, build, run every test
# Both are idempotent; BUILD_DIR (default build) and JOBS (default nproc) may be set.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libtorch-dev libgloo-dev
  libopenblas0-openmp  # OpenBLAS behind libblas.so.3: LibTorch's CPU matmuls ~4x faster than the reference BLAS
  librocksdb-dev libzmq3-dev cppzmq-dev libcapnp-dev capnproto
  libspdlog-dev libfmt-dev libgtest-dev libgmock-dev nlohmann-json3-dev
  libtomlplusplus-dev libcli11-dev libxxhash-dev zlib1g-dev python3
  json-schema-test-suite  # the official JSON Schema test suite, run by envs_tests
)

install_packages() {
  local missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "dev.sh: installing ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
}

# Node.js and npm run the MCP servers the tests use (tests/envs/mcp/); Debian's when missing.
install_node() {
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    local PACKAGES=(nodejs npm)
    install_packages
  fi
}

# The MCP servers pinned in tests/envs/mcp/package-lock.json, into $BUILD_DIR/npm (the envs
# tests look there; ODYSSEY_NPM_DIR overrides). Skips the network when that lock is installed.
install_mcp_servers() {
  local dir="$BUILD_DIR/npm" src=tests/envs/mcp
  if [ -d "$dir/node_modules" ] && cmp -s "$src/package-lock.json" "$dir/package-lock.json"; then
    return
  fi
  echo "dev.sh: installing MCP test servers into $dir"
  mkdir -p "$dir"
  cp "$src/package.json" "$src/package-lock.json" "$dir/"
  (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
}

BUILD_DIR="${BUILD_DIR:-build}"
JOBS="${JOBS:-$(nproc)}"

build() {
  export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}"
  # Paths relative to the checkout, so another clone on this machine (CI's) reuses the cache.
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}" CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
  cmake --build "$BUILD_DIR" -j "$JOBS"
}

case "${1:-}" in
  run)
    shift
    install_packages
    build
    # The default job: RL on arith with the tiny model (configs/tiny.toml), pretraining its
    # stage checkpoint first when out/pretrain-tiny/stage-4K is missing. Each run gets its own
    # folder (odyssey run never overwrites one); extra arguments go to `odyssey run`.
    out="${ODYSSEY_OUT:-out/tiny-$(date +%Y%m%d-%H%M%S)}"
    if "$BUILD_DIR/cli/odyssey" run configs/tiny.toml --out "$out" "$@"; then
      "$BUILD_DIR/cli/odyssey" plot "$out"
      echo "run folder: $out (metrics.jsonl, curves.png, checkpoints, replay store)"
    else
      exit $?
    fi
    ;;
  test)
    shift
    install_packages
    install_node
    build
    install_mcp_servers
    ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS" "$@"
    ;;
  *)
    echo "usage: ./dev.sh run | test" >&2
    exit 2
    ;;
esac
