# shellcheck shell=bash
# Sourced by scripts/mutation_score.sh and scripts/gpu_kit.sh: a scratch copy of this tree that
# ninja then rebuilds incrementally.

# stage_tree ROOT STAGE [head]: empties STAGE and copies ROOT's files into it. In a git work tree:
# the tracked and untracked non-ignored files as they are, a tracked file deleted from the work
# tree left out (head: git HEAD's instead); elsewhere everything but build* and .git.
stage_tree() {
  local root=$1 stage=$2 head=${3:-}
  rm -rf "$stage" && mkdir -p "$stage" || return 1
  if git -C "$root" rev-parse --git-dir >/dev/null 2>&1; then
    if [[ $head == head ]]; then
      git -C "$root" archive HEAD | tar -x -C "$stage"
    else
      (cd "$root" && git ls-files -z -co --exclude-standard |
        tar --null --ignore-failed-read -cf - -T - 2>/dev/null) |
        tar -xf - -C "$stage"
    fi
  else
    tar -C "$root" --exclude='./build*' --exclude='./.git' -cf - . | tar -xf - -C "$stage"
  fi
}

# sync_tree STAGE TREE KEEP: copies into TREE only the files whose content differs from STAGE's
# (new mtime, so ninja rebuilds what they touch and nothing else) and removes the files STAGE no
# longer has, except under TREE/KEEP (its build directory).
sync_tree() {
  local stage=$1 t=$2 keep=$3 f
  mkdir -p "$t"
  (cd "$stage" && find . -type f) | while read -r f; do
    if ! cmp -s "$stage/$f" "$t/$f"; then mkdir -p "$(dirname "$t/$f")" && cp "$stage/$f" "$t/$f"; fi
  done
  (cd "$t" && find . -type f ! -path "./$keep/*") | while read -r f; do
    [[ -e $stage/$f ]] || rm -f "$t/$f"
  done
}
