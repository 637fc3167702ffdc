#!/usr/bin/env bash
# Bits and time of the working tree's KDA backward against a git revision's, in one GPU-machine call
# (kernels_tests is the real parity test; this is the quick check of a kernel change between them).
#
#   source .gpu/env.sh && scripts/kda_backward_check.sh REV [MODE]
#
# REV: a git revision, or a folder holding that revision's kernels/ and scripts/ (for machines whose
# copy of the tree has no .git: `git archive REV kernels scripts | tar -x -C scratch/old` here first).
# MODE: "blocks" or "chunks" (pass 3 by 32-token blocks or 16-token chunks); empty: each driver's
# default. scripts/kda_backward_ab.sh with REV as the base and the working tree as its one candidate,
# strict: it builds both drivers (one object of the forward when their forward sources agree), compares
# the gradients on $SHAPES, times every pass at $TIMING, and exits non-zero when a build fails or a
# gradient differs.
set -euo pipefail
rev=${1:?usage: scripts/kda_backward_check.sh REV [blocks|chunks]}
export MODE=${2:-} STRICT=1 ROUNDS=${ROUNDS:-1} LINES=${LINES:-backward|pass}
exec "$(dirname "${BASH_SOURCE[0]}")/kda_backward_ab.sh" "$rev" .
