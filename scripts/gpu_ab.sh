#!/usr/bin/env bash
# A/B of the grouped GEMM benchmark in one device call: side a is the tree as it is, side b the
# same tree with a patch applied (a kernel change) or the same binary under other variables (a
# knob). GemmBench (tests/gpu/test_gemm_gpu.cpp) runs the two sides interleaved, a b a b ..., so
# clock and power drift fall on both; then a table of every row's times per side.
#
#   scripts/gpu_ab.sh [--patch FILE] [--env-a 'K=V ...'] [--env-b 'K=V ...'] [--rounds N]
#                     [--cases LIST] [--impls LIST] [--build DIR] [--out DIR] [--timeout S]
#                     [--dry-run]
#   scripts/gpu_ab.sh --kit KIT [--sides LIST] [--rounds N] [--cases LIST] [--impls LIST]
#                     [--build DIR] [--out DIR] [--dry-run]
#   scripts/gpu_ab.sh --summary FILE     # the table again, from ab.txt (of any number of sides)
#
# --kit: no build on the GPU machine. KIT is a scripts/gpu_kit.sh kit, packed (the .txz of
# `gpu_kit.sh pack --out`, unpacked into --build) or a directory; its link.sh links the sides'
# moe_gpu_tests. --sides: comma-separated, each a kit name (base, or a variant) with any K=V
# settings after colons (bp:MOE_SM90_WGRAD_BPANEL=off: variant bp's binary under that variable),
# default base and every variant of the kit. Any number of sides, interleaved in the order given,
# the first the table's reference. Session 41 ran three such A/Bs by hand.
#
# Defaults: 3 rounds, --cases deepseek_uniform,deepseek_skewed, --impls sm90w, --build
# /tmp/moe-ab (a directory of its own: a machine may hold another session's build elsewhere),
# --out $OUT or build-gpu/ab, --timeout 900 (seconds for each build; a run gets 60). The build
# log of each side goes to the out dir, and a build that fails or runs out stops the script
# with its last lines. With --patch, side b is built in the same directory after `patch -p1` (or
# `git apply` where patch is missing): only what the patch touches is rebuilt; the patch is
# reverted at the end. Without --patch, --env-a or --env-b must differ from the other.
#
# Out dir: build_a.log, build_b.log (--kit: link.log), ab.txt (each GemmBench line, tagged
# "<side> <round>"), summary.txt (the table). Needs a GPU and, to build, the CUDA toolkit and the
# Debian deps unpacked as scripts/gpu_gate.sh does (.deps/debs) or installed; --kit needs neither.
set -uo pipefail
from=$PWD  # relative --patch / --summary paths are the caller's
cd "$(dirname "$0")/.." || exit 2

usage() {
  echo "gpu_ab.sh: $1" >&2
  echo "usage: scripts/gpu_ab.sh [--patch FILE | --kit KIT [--sides LIST]] [--env-a 'K=V ...']" \
    "[--env-b 'K=V ...'] [--rounds N] [--cases LIST] [--impls LIST] [--build DIR] [--out DIR]" \
    "[--timeout S] [--dry-run] | --summary FILE" >&2
  exit 2
}

# The table: for each GemmBench row (case, impl, and what it times), its times on each side, in
# round order, then the ratio of each later side's median to the first side's. The sides are the
# lines' first words in order of first appearance: a and b here, any names in an ab.txt written
# by hand from more runs (e.g. session 29's four binaries: main, two settings of one branch,
# another branch).
summary() {
  awk '
    function median(list,   n, v, i, j, t) {
      n = split(list, v, " ")
      for (i = 1; i <= n; ++i)
        for (j = i + 1; j <= n; ++j)
          if (v[j] + 0 < v[i] + 0) { t = v[i]; v[i] = v[j]; v[j] = t }
      return n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
    }
    function add(key, side, value) {
      if (!(key in seen)) { seen[key] = 1; order[++keys] = key }
      if (!(side in side_seen)) { side_seen[side] = 1; sides[++nsides] = side }
      times[key, side] = times[key, side] " " value
    }
    # GEMM rows: case impl fwd_ms TFLOP/s dense ratio GB/s | dgrad wgrad | fb ... | fwd+read
    $5 ~ /^[0-9.]+$/ && $10 == "|" {
      add($3 " " $4 " fwd", $1, $5); add($3 " " $4 " dgrad", $1, $11)
      add($3 " " $4 " wgrad", $1, $12); add($3 " " $4 " fwd+bwd", $1, $14)
      next
    }
    # The dense cuBLAS baseline of a case: case dense fwd_ms TFLOP/s dgrad ... (drift shows here)
    $4 == "dense" && $5 ~ /^[0-9.]+$/ { add($3 " dense fwd", $1, $5); next }
    # FFN rows: case impl fwd_ms TFLOP/s | fb_ms TFLOP/s
    $5 ~ /^[0-9.]+$/ && $7 == "|" {
      add($3 " " $4 " ffn fwd", $1, $5); add($3 " " $4 " ffn fwd+bwd", $1, $8)
    }
    END {
      if (keys == 0) { print "gpu_ab.sh: no GemmBench rows" > "/dev/stderr"; exit 1 }
      head = sprintf("%-36s", "row (ms)")
      for (i = 1; i <= nsides; ++i) head = head sprintf(" | %-26s", sides[i])
      for (i = 2; i <= nsides; ++i) head = head sprintf(" | %s/%s", sides[i], sides[1])
      print head (nsides > 1 ? " (medians)" : "")
      for (k = 1; k <= keys; ++k) {
        key = order[k]; line = sprintf("%-36s", key)
        for (i = 1; i <= nsides; ++i) line = line sprintf(" |%-27s", times[key, sides[i]])
        base = times[key, sides[1]]
        for (i = 2; i <= nsides; ++i) {
          t = times[key, sides[i]]
          line = line " | " ((base != "" && t != "") ? sprintf("%.3f", median(t) / median(base)) : "-")
        }
        print line
      }
    }' "$1"
}

# apply_patch [-R] [--check]: the patch on the tree, through patch(1) or else git apply.
apply_patch() {
  if command -v patch >/dev/null; then
    local args=(-p1 -s)
    for a in "$@"; do [[ $a == --check ]] && args+=(--dry-run) || args+=("$a"); done
    patch "${args[@]}" <"$patch_file" >/dev/null
  else
    git apply "$@" "$patch_file"
  fi
}

patch_file="" env_a="" env_b="" rounds=3 cases="deepseek_uniform,deepseek_skewed" impls="sm90w"
build=/tmp/moe-ab out=${OUT:-build-gpu/ab} limit=900 dry=0 kit="" side_list=
while [[ $# -gt 0 ]]; do
  case $1 in
    --summary) [[ $# -ge 2 ]] || usage "--summary needs a file"
      f=$2; [[ $f == /* ]] || f=$from/$f
      [[ -r $f ]] || usage "--summary: no readable file '$2'"
      summary "$f"; exit $? ;;
    --patch|--env-a|--env-b|--rounds|--cases|--impls|--build|--out|--timeout|--kit|--sides)
      [[ $# -ge 2 ]] || usage "$1 needs a value"
      case $1 in
        --patch) patch_file=$2 ;; --env-a) env_a=$2 ;; --env-b) env_b=$2 ;;
        --kit) kit=$2 ;; --sides) side_list=$2 ;;
        --rounds) rounds=$2 ;; --cases) cases=$2 ;; --impls) impls=$2 ;;
        --build) build=$2 ;; --out) out=$2 ;; --timeout) limit=$2 ;;
      esac
      shift 2 ;;
    --dry-run) dry=1; shift ;;
    *) usage "unknown argument '$1'" ;;
  esac
done
[[ $rounds =~ ^[1-9][0-9]?$ ]] || usage "--rounds: expected 1..99, got '$rounds'"
[[ $limit =~ ^[1-9][0-9]*$ ]] || usage "--timeout: expected seconds, got '$limit'"
for kv in $env_a $env_b; do
  [[ $kv =~ ^[A-Za-z_][A-Za-z0-9_]*=.*$ ]] || usage "--env-a / --env-b: expected K=V, got '$kv'"
done
if [[ -n $kit ]]; then
  [[ -z $patch_file && -z $env_a && -z $env_b ]] ||
    usage "--kit: its sides are kit names with settings (--sides), not --patch / --env-a / --env-b"
  [[ $kit == /* ]] || kit=$from/$kit
  # The kit's names: base and each variant (var/NAME/ in the directory or the archive).
  if [[ -d $kit ]]; then
    [[ -f $kit/targets ]] || usage "--kit: '$kit' is not a kit (no targets file)"
    names=$(cd "$kit" && ls -d var/*/ 2>/dev/null | cut -d/ -f2)
  elif [[ -r $kit ]]; then
    listing=$(tar tJf "$kit" 2>/dev/null) && grep -qx gpu-kit/targets <<<"$listing" ||
      usage "--kit: '$kit' is not a packed kit"
    names=$(sed -n 's|^gpu-kit/var/\([^/]*\)/$|\1|p' <<<"$listing" | sort -u)
  else
    usage "--kit: no kit at '$kit'"
  fi
  [[ -n $side_list ]] || side_list=$(echo base $names | tr ' ' ',')
  declare -A bin envs
  sides=()
  IFS=, read -r -a given <<<"$side_list"
  for side in "${given[@]}"; do
    name=${side%%:*} settings=""
    [[ $side == *:* ]] && settings=${side#*:}
    [[ $name == base ]] || grep -qx -- "$name" <<<"$names" ||
      usage "--sides: no '$name' in the kit (base${names:+,$(echo $names | tr ' ' ',')})"
    for kv in ${settings//:/ }; do
      [[ $kv =~ ^[A-Za-z_][A-Za-z0-9_]*=.*$ ]] || usage "--sides: expected NAME:K=V, got '$side'"
    done
    [[ -z ${envs[$side]+x} ]] || usage "--sides: '$side' twice"
    sides+=("$side")
    bin[$side]=$build/gpu-kit/bin/$name/moe_gpu_tests envs[$side]=${settings//:/ }
  done
  [[ ${#sides[@]} -ge 2 ]] || usage "--sides: at least two, got '$side_list'"
  mapfile -t link_names < <(printf '%s\n' "${sides[@]%%:*}" | sort -u)  # what link.sh links
elif [[ -n $side_list ]]; then
  usage "--sides needs --kit"
elif [[ -n $patch_file ]]; then
  [[ $patch_file == /* ]] || patch_file=$from/$patch_file
  [[ -r $patch_file ]] || usage "--patch: no readable file '$patch_file'"
  apply_patch --check ||
    usage "--patch: '$patch_file' does not apply to this tree"
elif [[ $env_a == "$env_b" ]]; then
  usage "without --patch the sides differ only by --env-a / --env-b, and both are '$env_a'"
fi

# The two binaries, and each side's variables (--kit: set above, any number of sides).
if [[ -z $kit ]]; then
  bin_a=$build/ab_a/moe_gpu_tests bin_b=$build/ab_a/moe_gpu_tests
  [[ -n $patch_file ]] && bin_b=$build/ab_b/moe_gpu_tests
  declare -A bin=([a]=$bin_a [b]=$bin_b) envs=([a]=$env_a [b]=$env_b)
  sides=(a b)
fi
filter='GemmBench.GroupedVsDense*'
if [[ $dry -eq 1 ]]; then
  if [[ -n $kit ]]; then
    echo "kit: $kit -> $build/gpu-kit (linked there: ${link_names[*]})"
  else
    echo "build: $build (moe_gpu_tests) -> $bin_a${patch_file:+; patch $patch_file -> $bin_b}"
  fi
  for r in $(seq "$rounds"); do
    for s in "${sides[@]}"; do
      echo "round $r side $s: ${envs[$s]:+${envs[$s]} }MOE_GEMM_BENCH=1" \
        "MOE_GEMM_BENCH_CASES=$cases MOE_GEMM_BENCH_IMPLS=$impls ${bin[$s]} --gtest_filter=$filter"
    done
  done
  exit 0
fi

nvidia-smi -L >/dev/null 2>&1 || { echo "gpu_ab.sh: no GPU here (nvidia-smi -L failed)" >&2; exit 2; }
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# build SIDE: moe_gpu_tests into $build, copied to $build/ab_SIDE.
build_side() {
  local t0=$SECONDS
  timeout "$limit" cmake --build "$build" --target moe_gpu_tests -j "$(nproc)" \
    >"$out/build_$1.log" 2>&1
  local rc=$?
  echo "build $1: rc $rc, $((SECONDS - t0)) s"
  if [[ $rc -ne 0 ]]; then
    tail -15 "$out/build_$1.log"
    return 1
  fi
  mkdir -p "$build/ab_$1" && cp "$build/moe_gpu_tests" "$build/ab_$1/"
}
if [[ -n $kit ]]; then
  # No build: the kit's link.sh links the sides' names into $build/gpu-kit/bin.
  mkdir -p "$build"
  if [[ -d $kit ]]; then
    [[ $kit -ef $build/gpu-kit ]] || { rm -rf "$build/gpu-kit" && cp -r "$kit" "$build/gpu-kit"; }
  else
    { rm -rf "$build/gpu-kit" && tar xJf "$kit" -C "$build"; } ||
      { echo "gpu_ab.sh: unpacking $kit failed"; exit 2; }
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
  bash "$build/gpu-kit/link.sh" "${link_names[@]}" >"$out/link.log" 2>&1 ||
    { tail -15 "$out/link.log"; exit 1; }
else
  command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
  source scripts/gpu_deps.sh
  moe_unpack_deps || { echo "gpu_ab.sh: unpacking .deps failed"; exit 2; }
  prefix=$moe_prefix
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release ${prefix:+-DCMAKE_PREFIX_PATH=$prefix} \
    >"$out/configure.log" 2>&1 || { tail -20 "$out/configure.log"; exit 2; }
  build_side a || exit 1
  if [[ -n $patch_file ]]; then
    apply_patch || { echo "gpu_ab.sh: the patch failed"; exit 1; }
    build_side b
    rc=$?
    apply_patch -R || echo "gpu_ab.sh: reverting the patch failed"
    [[ $rc -eq 0 ]] || exit 1
  fi
fi

: >"$out/ab.txt"
for r in $(seq "$rounds"); do
  i=0
  for s in "${sides[@]}"; do
    i=$((i + 1))
    log=$out/run_${i}_$r.log  # by position: a side's name may hold any K=V
    # shellcheck disable=SC2086  # the K=V list splits into env's arguments
    env ${envs[$s]} MOE_GEMM_BENCH=1 MOE_GEMM_BENCH_CASES="$cases" MOE_GEMM_BENCH_IMPLS="$impls" \
      timeout 60 "${bin[$s]}" --gtest_filter="$filter" >"$log" 2>&1
    echo "round $r side $s: rc $?"
    grep -E '^[a-z0-9_]+ +[a-z0-9_]+ +[0-9.]+ ' "$log" | awk -v tag="$s $r" '{ print tag " " $0 }' \
      >>"$out/ab.txt"
    grep -m3 -E 'Failure|FAILED' "$log"
  done
done
rm -f "$out"/run_*.log
summary "$out/ab.txt" | tee "$out/summary.txt"
