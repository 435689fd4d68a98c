#!/usr/bin/env bash
# scripts/gpu_kit.sh without a GPU or a build: bad usage exits 2 naming the argument; `link` of a
# hand-made kit (the layout `pack` writes) builds the base from the kit's archive and object, and
# each variant with its own archive member or object in place of the base's, which the linked
# programs then print.
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
under_test=$here/scripts/gpu_kit.sh
source "$here/tests/scripts/expect.sh"
expect 2 "usage: scripts/gpu_kit.sh pack" build
expect 2 "unknown argument '--variants'" pack --variants 109
expect 2 "--variant 99999: no tests/mutants/99999_\*.patch" pack --variant 99999
expect 2 "--variant x=/nonexistent.patch: no patch file" pack --variant x=/nonexistent.patch
expect 2 "--variant base=.*not 'base'" pack --variant "base=$here/README.md"
expect 2 "--variant x: expected NAME=PATCH or a mutant number" pack --variant x
expect 2 "--jobs: expected a positive count, got '0'" pack --jobs 0
expect 2 "link: /nonexistent is not a kit" link /nonexistent

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
k=$tmp/kit
mkdir -p "$k/link" "$k/base" "$k/sys" "$k/var/arch/libval.a" "$k/var/obj"
cat >"$tmp/main.cpp" <<'EOF'
#include <cstdio>
int value();
int main() { std::printf("value %d\n", value()); }
EOF
cat >"$tmp/main2.cpp" <<'EOF'
#include <cstdio>
int value();
int main() { std::printf("value %d from the variant's main\n", value()); }
EOF
printf 'int value() { return 1; }\n' >"$tmp/val.cpp"
printf 'int value() { return 2; }\n' >"$tmp/val2.cpp"
(cd "$tmp" && c++ -c main.cpp -o "$k/base/main.o" && c++ -c val.cpp -o val.o &&
  ar rc "$k/base/libval.a" val.o && c++ -c val2.cpp -o "$k/var/arch/libval.a/val.o" &&
  c++ -c main2.cpp -o "$k/var/obj/main.o") || { echo "FAIL: cannot build the fixture"; exit 1; }
printf 'prog\n' >"$k/targets"
printf '%s\n' c++ -O1 @base/main.o -o @out @base/libval.a >"$k/link/prog.txt"
export MOE_KIT_CUDA_LIB=$tmp  # no CUDA here: any directory for -L and the rpath
expect 0 "linked .*/bin/base/prog" link "$k" base
expect 0 "linked .*/bin/arch/prog" link "$k" arch
expect 0 "linked .*/bin/obj/prog" link "$k" obj
expect 2 "link: no variant 'other'" link "$k" other
run() {  # program, expected line
  local got
  got=$("$1" 2>&1)
  [[ $got == "$2" ]] || { echo "FAIL: $1 printed '$got', want '$2'"; fail=1; }
}
run "$k/bin/base/prog" "value 1"
run "$k/bin/arch/prog" "value 2"
run "$k/bin/obj/prog" "value 1 from the variant's main"
# The base archive itself is untouched by a variant's link.
[[ $(ar p "$k/base/libval.a" val.o | cmp -s - "$tmp/val.o" && echo same) == same ]] ||
  { echo "FAIL: a variant's link changed the base archive"; fail=1; }
# No names: the base and every variant.
rm -rf "$k/bin"
expect 0 "linked .*/bin/obj/prog" link "$k"
[[ -x $k/bin/base/prog && -x $k/bin/arch/prog ]] || { echo "FAIL: link with no names"; fail=1; }
[[ $fail -eq 0 ]] && echo "gpu_kit: all checks passed"
exit $fail
