#!/usr/bin/env bash
# Binaries for the GPU machine compiled here and linked there, so device time is spent running
# them, not building them, and several variants fit one carry (64 MiB with the tree). A kit holds
# the link inputs of each target (objects and static libraries, debug sections stripped), each
# target's link line with those inputs as kit paths, and per variant only the objects that differ
# from the base's. Session 39 did this by hand (a mutant and knob build per variant); this is
# that, kept.
#
#   scripts/gpu_kit.sh pack [--kit DIR] [--work DIR] [--out FILE] [--targets "T ..."] [--jobs N]
#                           [--variant NAME=PATCH | --variant MUTANT_ID]...
#   scripts/gpu_kit.sh link KIT [NAME ...]          # on the GPU machine (or here, to test)
#
# pack: syncs this tree (tracked and untracked non-ignored files as they are) into a scratch tree
# (WORK/tree, default /tmp/gpu-kit-work: configured once, Release, MOE_CUDA_ARCHITECTURES (90) and
# MOE_CMAKE_ARGS as scripts/mutation_score.sh does; later packs rebuild only what changed), builds
# TARGETS (default moe-harness moe_gpu_tests) and writes KIT (default /tmp/gpu-kit, emptied first)
# from that build. Each variant is the same tree with a patch applied (git apply; a bare number names
# tests/mutants/NNN_*.patch, its name then the number), built incrementally; the kit keeps the
# archive members and objects it changed (the code of another revision: `git diff HEAD REV -- gpu
# >old.patch`, then --variant old=old.patch). A variant that changes a link line (a new source
# file or library) is refused. --out also packs KIT into FILE (tar, xz) to carry.
# link: links every target for the base ("base") and each NAME (default: every variant of the kit)
# into KIT/bin/NAME/, against the CUDA libraries it finds on that machine (MOE_KIT_CUDA_LIB, else
# the directory of libcudart.so under /usr/local/cuda) and the kit's copies of the Debian static
# libraries (rapidcheck, GoogleTest), which the GPU machine does not have.
#
# On the GPU machine, with FILE carried as .snap/kit.txz (KIT /tmp/gpu-kit packs as gpu-kit/):
#   tar xJf .snap/kit.txz -C /tmp && bash /tmp/gpu-kit/link.sh base 109
#   /tmp/gpu-kit/bin/109/moe-harness check --op topk_router ...
# (link.sh is this script with the kit's own directory as KIT: link.sh [NAME ...].)
# Exit: 0 done; 1 a build, patch or link failed (named); 2 usage.
set -uo pipefail

die() { echo "gpu_kit: $1" >&2; exit "${2:-1}"; }
usage() {
  echo "usage: scripts/gpu_kit.sh pack [--kit DIR] [--work DIR] [--out FILE] [--targets \"T ...\"]" \
    "[--jobs N] [--variant NAME=PATCH | --variant MUTANT_ID]... | link KIT [NAME ...]" >&2
  exit 2
}

# ---- link (runs on the GPU machine: bash, c++ and binutils) -------------------------------------
# KIT/targets lists the targets; KIT/link/T.txt is T's link line, one token a line, the compiler
# driver first, inputs as "@base/PATH" (an object or archive of the kit) or "@sys/NAME" (a Debian
# static library), the output as "@out".
link_kit() {
  local kit=$1; shift
  [[ -f $kit/targets ]] || die "link: $kit is not a kit (no $kit/targets)" 2
  local names=("$@") cuda=${MOE_KIT_CUDA_LIB:-}
  if [[ ${#names[@]} -eq 0 ]]; then
    names=(base)
    for v in "$kit"/var/*/; do [[ -d $v ]] && names+=("$(basename "$v")"); done
  fi
  if [[ -z $cuda ]]; then
    cuda=$(find -L /usr/local/cuda/ -name libcudart.so 2>/dev/null | head -1)
    [[ -n $cuda ]] || die "link: no libcudart.so under /usr/local/cuda (set MOE_KIT_CUDA_LIB)"
    cuda=$(dirname "$cuda")
  fi
  local name t tok path rc=0
  for name in "${names[@]}"; do
    [[ $name == base || -d $kit/var/$name ]] || die "link: no variant '$name' in $kit" 2
    local tmp=$kit/tmp/$name out=$kit/bin/$name
    rm -rf "$tmp" && mkdir -p "$tmp" "$out"
    while read -r t; do
      local args=()
      while read -r tok; do
        case $tok in
          @base/*)
            path=${tok#@base/}
            if [[ $name != base && $path == *.a && -d $kit/var/$name/$path ]]; then
              # The base archive with this variant's members in place of its own.
              mkdir -p "$(dirname "$tmp/$path")" && cp "$kit/base/$path" "$tmp/$path" &&
                ar r "$tmp/$path" "$kit/var/$name/$path"/* || die "link: $name: ar r $path"
              args+=("$tmp/$path")
            elif [[ $name != base && -f $kit/var/$name/$path ]]; then
              args+=("$kit/var/$name/$path")
            else
              args+=("$kit/base/$path")
            fi ;;
          @sys/*) args+=("$kit/sys/${tok#@sys/}") ;;
          @out) args+=("$out/$t") ;;
          *) args+=("$tok") ;;
        esac
      done <"$kit/link/$t.txt"
      # args[0] is the compiler driver of the link line (c++).
      if "${args[@]}" "-L$cuda" "-Wl,-rpath,$cuda"; then
        echo "gpu_kit: linked $out/$t"
      else
        echo "gpu_kit: link of $t for $name failed" >&2
        rc=1
      fi
    done <"$kit/targets"
  done
  return $rc
}

[[ $# -ge 1 ]] || usage
cmd=$1; shift
if [[ $cmd == link ]]; then
  [[ $# -ge 1 ]] || usage
  link_kit "$@"
  exit $?
fi
[[ $cmd == pack ]] || usage

# ---- pack (runs here) ---------------------------------------------------------------------------
root=$(cd "$(dirname "$0")/.." && pwd)
kit=/tmp/gpu-kit work=/tmp/gpu-kit-work out="" targets="moe-harness moe_gpu_tests"
jobs=$(nproc 2>/dev/null || echo 2)
variants=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --kit|--work|--out|--targets|--jobs|--variant)
      [[ $# -ge 2 ]] || usage
      case $1 in
        --kit) kit=$2 ;; --work) work=$2 ;; --out) out=$2 ;; --targets) targets=$2 ;;
        --jobs) jobs=$2 ;; --variant) variants+=("$2") ;;
      esac
      shift 2 ;;
    *) echo "gpu_kit: unknown argument '$1'" >&2; usage ;;
  esac
done
[[ $jobs =~ ^[1-9][0-9]*$ ]] || die "--jobs: expected a positive count, got '$jobs'" 2
[[ -n $targets ]] || die "--targets: empty" 2
# Variant names and patches, checked before any build.
vnames=() vpatches=()
for v in "${variants[@]}"; do
  if [[ $v =~ ^[0-9]+$ ]]; then
    p=$(ls "$root"/tests/mutants/"$(printf %03d "$((10#$v))")"_*.patch 2>/dev/null | head -1)
    [[ -n $p ]] || die "--variant $v: no tests/mutants/$(printf %03d "$((10#$v))")_*.patch" 2
    vnames+=("$(printf %03d "$((10#$v))")") vpatches+=("$p")
  elif [[ $v == *=* ]]; then
    n=${v%%=*} p=${v#*=}
    [[ $n =~ ^[A-Za-z0-9_.-]+$ && $n != base ]] || die "--variant $v: a name of letters, digits, _ . - (not 'base')" 2
    [[ -f $p ]] || die "--variant $v: no patch file '$p'" 2
    vnames+=("$n") vpatches+=("$(cd "$(dirname "$p")" && pwd)/$(basename "$p")")
  else
    die "--variant $v: expected NAME=PATCH or a mutant number" 2
  fi
done
[[ $(printf '%s\n' "${vnames[@]}" | sort | uniq -d) == "" ]] || die "--variant: a name given twice" 2
command -v ninja >/dev/null || die "ninja not found" 2
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH

# The scratch tree, synced as scripts/mutation_score.sh syncs its own.
# shellcheck source=scripts/scratch_tree.sh
source "$root/scripts/scratch_tree.sh"
tree=$work/tree bd=$work/tree/build-kit stage=$work/stage
mkdir -p "$work" && stage_tree "$root" "$stage" || die "staging the tree failed"
sync_tree "$stage" "$tree" build-kit
if [[ ! -f $bd/build.ninja ]]; then
  # shellcheck disable=SC2086
  cmake -S "$tree" -B "$bd" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DMOE_CUDA_ARCHITECTURES="${MOE_CUDA_ARCHITECTURES:-90}" ${MOE_CMAKE_ARGS:-} \
    >"$work/configure.log" 2>&1 || { tail -20 "$work/configure.log"; die "configure failed"; }
fi
build() {  # log
  # shellcheck disable=SC2086
  ninja -C "$bd" -j "$jobs" $targets >"$1" 2>&1 || { grep -m5 -A5 error "$1"; return 1; }
}
echo "gpu_kit: building $targets in $bd"
build "$work/build-base.log" || die "the base build failed ($work/build-base.log)"

# The link is the command of ninja's last edge for a target that starts with the compiler driver:
# the edge may chain a post-build step (gtest_discover_tests: `cd ... && cmake -P ...`) after it.
link_line() {
  ninja -C "$bd" -t commands "$1" | tail -1 | sed 's/ && /\n/g' | grep -m1 -E '^[^ ]*(c|g)\+\+ '
}
# Each target's link line (ninja's last command for it) with its inputs as kit tokens: objects
# and archives of the build dir (@base/), static libraries outside CUDA (@sys/: Debian's), CUDA
# libraries as -l (found again at link time), CUDA -L and rpath dropped.
rm -rf "$kit" && mkdir -p "$kit/link" "$kit/base" "$kit/sys"
: >"$kit/inputs"
for t in $targets; do
  line=$(link_line "$t")
  [[ -n $line ]] || die "no link command for $t"
  echo "$line" >"$work/link-$t.base"
  out_next=0
  : >"$kit/link/$t.txt"
  # shellcheck disable=SC2086
  for tok in $line; do
    if [[ $out_next -eq 1 ]]; then echo @out >>"$kit/link/$t.txt"; out_next=0; continue; fi
    case $tok in
      -o) echo "$tok" >>"$kit/link/$t.txt"; out_next=1 ;;
      */c++|*/g++) echo c++ >>"$kit/link/$t.txt" ;;
      -L*cuda*|-Wl,-rpath,*) ;;
      /*cuda*/lib*.so|/*cuda*/lib*.a)
        n=$(basename "$tok"); n=${n#lib}; echo "-l${n%%.*}" >>"$kit/link/$t.txt" ;;
      /*.a)
        cp "$tok" "$kit/sys/" && strip --strip-debug "$kit/sys/$(basename "$tok")"
        echo "@sys/$(basename "$tok")" >>"$kit/link/$t.txt" ;;
      *.o|*.a)
        [[ -f $bd/$tok ]] || die "$t: link input $tok is not in $bd"
        echo "@base/$tok" >>"$kit/link/$t.txt"
        echo "$tok" >>"$kit/inputs" ;;
      *) echo "$tok" >>"$kit/link/$t.txt" ;;
    esac
  done
  echo "$t" >>"$kit/targets"
done
sort -u -o "$kit/inputs" "$kit/inputs"
# The base inputs, and a checksum of every object (an archive's members one by one) to tell
# which ones a variant changed.
sums() {  # dir of a build -> "path[/member] sha1" lines, over the kit's inputs
  local p m
  while read -r p; do
    if [[ $p == *.a ]]; then
      for m in $(ar t "$1/$p"); do echo "$p/$m $(ar p "$1/$p" "$m" | sha1sum | cut -c1-40)"; done
    else
      echo "$p $(sha1sum <"$1/$p" | cut -c1-40)"
    fi
  done <"$kit/inputs"
}
while read -r p; do
  mkdir -p "$(dirname "$kit/base/$p")" && cp "$bd/$p" "$kit/base/$p" &&
    strip --strip-debug "$kit/base/$p" || die "copying $p"
done <"$kit/inputs"
for p in $(grep '\.a$' "$kit/inputs"); do
  [[ -z $(ar t "$bd/$p" | sort | uniq -d) ]] || die "$p has two members of one name: ar r cannot replace one"
done
sums "$bd" >"$work/base.sums"

# Variants: the patch applied to the scratch tree, built, the changed objects kept, the tree
# restored. nvcc's objects differ from build to build (module ids), so before the next variant
# the restored tree is rebuilt and its checksums become the reference; after the last one the
# next pack rebuilds what the restore touched.
status=0
last=$((${#vnames[@]} - 1))
for i in "${!vnames[@]}"; do
  n=${vnames[$i]} p=${vpatches[$i]}
  files=$(cd "$tree" && git apply --numstat "$p" 2>/dev/null | cut -f3)
  [[ -n $files ]] || { echo "gpu_kit: variant $n: $p touches no file" >&2; status=1; continue; }
  rm -rf "$work/orig" && mkdir -p "$work/orig"
  for f in $files; do
    [[ -f $tree/$f ]] && mkdir -p "$(dirname "$work/orig/$f")" && cp "$tree/$f" "$work/orig/$f"
  done
  restore() {  # the patched files as they were; those the patch created removed
    for f in $files; do
      if [[ -f $work/orig/$f ]]; then cp "$work/orig/$f" "$tree/$f"; else rm -f "$tree/$f"; fi
    done
  }
  if ! (cd "$tree" && GIT_CEILING_DIRECTORIES=$(dirname "$tree") git apply "$p") \
      >"$work/apply-$n.log" 2>&1; then
    echo "gpu_kit: variant $n: $p does not apply ($work/apply-$n.log)" >&2
    restore; status=1; continue
  fi
  echo "gpu_kit: building variant $n ($files)"
  if ! build "$work/build-$n.log"; then
    echo "gpu_kit: variant $n does not build ($work/build-$n.log)" >&2
    restore; status=1; continue
  fi
  # A variant links with the base's line: one that adds a source file or a library (a new link
  # input) cannot be put together from the base's inputs.
  relinks=""
  for t in $targets; do
    [[ $(link_line "$t") == "$(cat "$work/link-$t.base")" ]] || relinks+=" $t"
  done
  if [[ -n $relinks ]]; then
    echo "gpu_kit: variant $n changes the link line of$relinks (a new source file or library):" \
      "not supported" >&2
    restore; status=1; continue
  fi
  sums "$bd" | sort >"$work/$n.sums"
  changed=$(sort "$work/base.sums" | comm -13 - "$work/$n.sums" | cut -d' ' -f1)
  for c in $changed; do
    d=$kit/var/$n/$c
    mkdir -p "$(dirname "$d")"
    if [[ $c == *.a/* ]]; then
      ar p "$bd/${c%/*}" "${c##*/}" >"$d"
    else
      cp "$bd/$c" "$d"
    fi
    strip --strip-debug "$d"
  done
  echo "gpu_kit: variant $n: $(wc -w <<<"$changed") changed object(s)"
  [[ -n $changed ]] || mkdir -p "$kit/var/$n"  # a patch that changes no code still links
  restore
  if [[ $i -lt $last ]]; then
    build "$work/build-restore-$n.log" || die "the tree restored after $n does not build"
    sums "$bd" >"$work/base.sums"
  fi
done

cp "$0" "$kit/link.sh"  # the same script: link.sh NAME... runs `link` on its own kit
sed -i '0,/^set -uo pipefail$/s//set -uo pipefail\nif [[ ${1:-} != link \&\& ${1:-} != pack ]]; then set -- link "$(cd "$(dirname "$0")" \&\& pwd)" "$@"; fi/' \
  "$kit/link.sh"
du -sh "$kit" | sed 's/^/gpu_kit: kit /'
if [[ -n $out ]]; then
  (cd "$(dirname "$kit")" && tar -cf - "$(basename "$kit")") | xz -6 -T"$jobs" >"$out" ||
    die "packing $out failed"
  ls -l "$out" | awk '{print "gpu_kit: " $NF ", " $5 " bytes"}'
fi
exit $status
