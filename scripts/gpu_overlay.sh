#!/usr/bin/env bash
# A branch's files on the GPU machine without checking the branch out here.
#
# A device call copies this checkout's working tree as it is when the call starts (tracked files,
# untracked ones git does not ignore, and the ignored paths named in the call's `carry`). A tree
# being edited, rebased or switched at that moment is sent half-done (a call once built a file with
# conflict markers in it). So keep the checkout the calls copy still, do a branch's work in a second
# worktree (`git worktree add ../wt BRANCH`), and send the branch's files as an overlay:
#
#   scripts/gpu_overlay.sh prepare REV [DIR]  on the CPU machine: every file REV changes since it
#                                             left HEAD's history (git diff HEAD...REV), as it is in
#                                             REV, into DIR (default scratch/overlay, git-ignored);
#                                             the files REV deletes are listed in DIR/.deleted. What
#                                             HEAD changed since then stays; a file both changed
#                                             is taken from REV, with a warning (rebase REV first)
#   scripts/gpu_overlay.sh apply [DIR]        on the GPU machine, before building: DIR's files over
#                                             the tree, the listed ones removed
#
# The call then carries [".gpu", "scratch/overlay"] (and its own script, if that is ignored too) and
# runs `scripts/gpu_overlay.sh apply && ...`. A build of HEAD and one of the overlay in a single call
# measure both on the same card: build, run, apply, build again, run again.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

case "${1:-}" in
  prepare)
    rev="${2:?usage: scripts/gpu_overlay.sh prepare REV [DIR]}"
    dir="${3:-scratch/overlay}"
    git rev-parse --verify --quiet "$rev^{commit}" >/dev/null || { echo "gpu_overlay: no commit '$rev'" >&2; exit 2; }
    case "$(git check-ignore -q "$dir/x" && echo ignored)" in
      ignored) ;;
      *) echo "gpu_overlay: $dir is not git-ignored: a call would copy it into the tree anyway" >&2; exit 2 ;;
    esac
    base=$(git merge-base HEAD "$rev") || { echo "gpu_overlay: $rev shares no history with HEAD" >&2; exit 2; }
    rm -rf "$dir" && mkdir -p "$dir" || exit 1
    : >"$dir/.deleted"
    changed=0 deleted=0
    while IFS=$'\t' read -r status path; do
      git diff --quiet "$base" HEAD -- "$path" ||
        echo "gpu_overlay: warning: $path changed on HEAD too since $(git rev-parse --short "$base"): $rev's version wins (rebase $rev onto HEAD to merge them)" >&2
      case "$status" in
        D) echo "$path" >>"$dir/.deleted"; deleted=$((deleted + 1)) ;;
        *) mkdir -p "$dir/$(dirname "$path")" && git show "$rev:$path" >"$dir/$path" || exit 1
           [ "$(git ls-tree "$rev" -- "$path" | cut -d' ' -f1)" = 100755 ] && chmod +x "$dir/$path"
           changed=$((changed + 1)) ;;
      esac
    done < <(git diff --name-status --no-renames "$base" "$rev")
    git rev-parse "$rev" >"$dir/.rev"
    echo "gpu_overlay: $changed files of $(git rev-parse --short "$rev") ($deleted deleted) in $dir, for HEAD $(git rev-parse --short HEAD)"
    echo "gpu_overlay: carry [\".gpu\", \"$dir\"]; on the device: scripts/gpu_overlay.sh apply $dir"
    ;;
  apply)
    dir="${2:-scratch/overlay}"
    [ -f "$dir/.rev" ] || { echo "gpu_overlay: no overlay in $dir: run 'scripts/gpu_overlay.sh prepare REV' and carry it" >&2; exit 2; }
    (cd "$dir" && find . -type f ! -name .deleted ! -name .rev -print0) | while IFS= read -r -d '' f; do
      mkdir -p "$(dirname "$f")" && cp -p "$dir/$f" "$f" || exit 1
    done || exit 1
    while IFS= read -r path; do [ -n "$path" ] && rm -f -- "$path"; done <"$dir/.deleted"
    echo "gpu_overlay: applied $(cut -c1-12 "$dir/.rev") from $dir"
    ;;
  *)
    echo "usage: scripts/gpu_overlay.sh prepare REV [DIR] | apply [DIR]" >&2
    exit 2
    ;;
esac
