#!/usr/bin/env bash
# scripts/scratch_tree.sh (the scratch trees of mutation_score.sh and gpu_kit.sh): staging takes
# tracked and untracked files but not ignored ones, nor a tracked file deleted from the work tree;
# a sync copies only what changed, removes what the source lost and keeps the build directory.
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
source "$here/scripts/scratch_tree.sh"
fail=0
check() { [[ $1 == "$2" ]] || { echo "FAIL: $3: got '$1', want '$2'"; fail=1; }; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
r=$tmp/root
mkdir -p "$r/src" && cd "$r" && git init -q . || exit 1
printf 'a\n' >src/a.cpp; printf 'b\n' >src/b.cpp; printf 'gone\n' >src/gone.cpp
printf 'build*/\n' >.gitignore
git add -A && git -c user.name=t -c user.email=t@t commit -qm init || exit 1
printf 'new\n' >src/new.cpp         # untracked, not ignored
mkdir -p build-x && printf 'x\n' >build-x/out.o   # ignored
rm src/gone.cpp                     # tracked, deleted
stage_tree "$r" "$tmp/stage"
check "$(cd "$tmp/stage" && find . -type f | sort | tr '\n' ' ')" \
  "./.gitignore ./src/a.cpp ./src/b.cpp ./src/new.cpp " "staged files"
stage_tree "$r" "$tmp/stage-head" head
check "$(cd "$tmp/stage-head" && find . -type f | sort | tr '\n' ' ')" \
  "./.gitignore ./src/a.cpp ./src/b.cpp ./src/gone.cpp " "staged HEAD"

t=$tmp/tree
sync_tree "$tmp/stage" "$t" build-kit
mkdir -p "$t/build-kit" && printf 'o\n' >"$t/build-kit/a.o"
touch -d '2000-01-01' "$t/src/a.cpp" "$t/src/b.cpp"
printf 'b2\n' >"$tmp/stage/src/b.cpp"
rm "$tmp/stage/src/new.cpp"
sync_tree "$tmp/stage" "$t" build-kit
check "$(date -r "$t/src/a.cpp" +%Y)" 2000 "an unchanged file keeps its mtime"
check "$(cat "$t/src/b.cpp")" b2 "a changed file is copied"
check "$([[ -e $t/src/new.cpp ]] && echo present || echo removed)" removed "a file the source lost"
check "$(cat "$t/build-kit/a.o")" o "the build directory is kept"
[[ $fail -eq 0 ]] && echo "scratch_tree: all checks passed"
exit $fail
