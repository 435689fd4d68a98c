#!/usr/bin/env bash
# Mutation score of the harness: applies each planted bug of tests/mutants/ (INDEX + NNN_*.patch)
# in turn to a scratch copy of the tree, rebuilds incrementally and runs the gates; prints a table
# (mutant, class, check, golden, ctest, sanitize, caught) and the score. docs/mutation.md.
#
#   scripts/mutation_score.sh [--out DIR] [--work DIR] [--cpu-only|--gpu-only] [--compile-only]
#                             [--only ID,..] [--shard I/N] [--jobs N] [--deadline S] [--fast] [--prepare]
#                             [--rerun] [--head] [--cases N] [--sanitize-tools T1,T2]
#
# Gates, each over what the mutated file affects (ops, test names, sanitizer family):
#   check     moe-harness check --op OP --backend gpu|reference --cases N (plus the named cases)
#   golden    moe-harness golden verify [--backend gpu] golden/data/OP__*.safetensors
#   ctest     ctest -L gpu (gpu/ mutants) or -L cpu [and gpu] (reference/, harness/, tools/)
#             -R <tests>
#   sanitize  the ctest label sanitize for the family (or scripts/gpu_sanitize.sh); GPU only
# A gate "catches" a mutant when it fails (exit 2, a usage error, is reported as "err"). A gate
# that fails on some mutant is also run on the unmutated tree (once per family, cached): if it
# fails there too it is reported "broken" and catches nothing. A mutant that does not apply or
# build is "invalid".
#
#   --work DIR       scratch trees, builds, results (default /tmp/mutation). Results persist:
#                    a later call skips mutants already tested (--rerun to redo them), so a
#                    budgeted run continues over several calls.
#   --out DIR        also write mutation.tsv / mutation.md and the gate logs there
#   --jobs N         N scratch trees, mutants of one file stay in one tree (default 1)
#   --deadline S     start no mutant after S seconds; the rest are listed as untested
#   --fast           stop at the first gate that catches a mutant (others: "skip")
#   --cpu-only       only mutants of reference/, harness/ and tools/, CPU gates
#   --gpu-only       only mutants of gpu/ (their reference/harness part runs with --cpu-only)
#   --compile-only   apply and build each mutant, no gates (every CUDA mutant must compile)
#   --prepare        sync, configure and build the trees and run the baselines, then stop
#   --head           copy git HEAD (default: tracked and untracked non-ignored files as they are)
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
work=/tmp/mutation
out=""
cpu_only=0
gpu_only=0
compile_only=0
only=""
shard=""
jobs=1
deadline=0
fast=0
prepare=0
rerun=0
head=0
cases=${MUT_CASES:-6}
san_tools=memcheck,racecheck
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    --cpu-only) cpu_only=1; shift ;;
    --gpu-only) gpu_only=1; shift ;;
    --compile-only) compile_only=1; shift ;;
    --only) only=$2; shift 2 ;;
    --shard) shard=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --deadline) deadline=$2; shift 2 ;;
    --fast) fast=1; shift ;;
    --prepare) prepare=1; shift ;;
    --rerun) rerun=1; shift ;;
    --head) head=1; shift ;;
    --cases) cases=$2; shift 2 ;;
    --sanitize-tools) san_tools=$2; shift 2 ;;
    -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
    *) echo "mutation_score: unknown argument $1 (--help)" >&2; exit 2 ;;
  esac
done
[[ $work = /* ]] || work="$root/$work"
[[ -z $out || $out = /* ]] || out="$PWD/$out"
t0=$(date +%s)
mkdir -p "$work/logs"
log() { echo "[mutation $(($(date +%s) - t0))s] $*"; }

if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
has_nvcc=0; command -v nvcc >/dev/null && has_nvcc=1
has_gpu=0
if [[ $cpu_only -eq 0 && $compile_only -eq 0 ]] && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  has_gpu=1
fi
ncpu=$(nproc)

# ---- what a mutated file affects: family, ops, ctest name regex, sanitizer family ---------------
family_of() {
  case $1 in
    gpu/router_row.cuh|gpu/topk_router.cu|reference/topk_router.cpp) echo router ;;
    gpu/aux_loss.cu|reference/aux_loss.cpp) echo aux ;;
    gpu/dispatch.cu|gpu/perm_detail.cuh|reference/dispatch.cpp) echo dispatch ;;
    gpu/argsort.cu|reference/argsort.cpp) echo argsort ;;
    gpu/sort_chunks.cu|reference/sort_chunks.cpp) echo sortchunks ;;
    gpu/ep.cu|gpu/comm.cu|reference/ep.cpp) echo ep ;;
    gpu/grouped_gemm.cu|gpu/grouped_gemm_sm90.cu|reference/grouped_gemm.cpp) echo gemm ;;
    gpu/swiglu_ffn.cu|reference/swiglu_ffn.cpp) echo ffn ;;
    gpu/moe_block.cu|reference/moe_block.cpp) echo block ;;
    harness/core/*) echo core ;;
    tools/bench_compare.cpp) echo benchcmp ;;
    integrations/te/test_te_plugin.sh) echo tegate ;;
    harness/ops/ep_family.cpp) echo groupsizes ;;  # the group sizes and EP counts of cases
    *) echo other ;;
  esac
}
ops_of() {
  case $1 in
    router) echo "topk_router aux_loss_scores" ;;
    aux) echo "aux_loss_scores moe_aux_loss" ;;
    dispatch) echo "token_dispatch token_combine" ;;
    argsort) echo "routing_map_to_selected_experts argsort_token_dispatch argsort_token_combine" ;;
    sortchunks) echo "sort_chunks_by_index local_permute_after_a2a local_unpermute_before_a2a" ;;
    ep) echo "ragged_a2a_params ragged_all_to_all local_permute_after_a2a local_unpermute_before_a2a" ;;
    gemm) echo "grouped_gemm swiglu_expert_ffn" ;;
    ffn) echo "swiglu_expert_ffn" ;;
    block) echo "moe_block" ;;
    groupsizes) echo "grouped_gemm swiglu_expert_ffn ragged_a2a_params local_permute_after_a2a" ;;
    core) echo "topk_router token_dispatch token_combine moe_aux_loss swiglu_expert_ffn" ;;
    *) echo "" ;;
  esac
}
# ctest -R: the op's suites in tests/cpu and tests/gpu, and its registry/determinism instances.
tests_of() {
  local reg="/($(ops_of "$1" | tr ' ' '|'))\$"
  case $1 in
    router) echo "Router|ScoreFn|TieAware|Regression\.R(2|10|13|15)_|$reg" ;;
    aux) echo "AuxLoss|Regression\.R10_|GpuRouterWide\.AuxLoss|$reg" ;;
    dispatch) echo "TokenDispatch|TokenCombine|Regression\.R(4|6|8|11|12)_|DispatchGpu|ArgsortProps\.CrossBackend|$reg" ;;
    argsort) echo "Argsort|RoutingMapToSelected|Regression\.R9_|DispatchGpu|$reg" ;;
    sortchunks) echo "SortChunks|Regression\.R(1|14)_|DispatchGpu|EpPipeline|$reg" ;;
    ep) echo "EpSizing|RaggedA2A|RaggedAllToAll|LocalPermute|LocalUnpermute|EpPipeline|Regression\.R(3|14)_|DispatchGpuEp|InProcessCommunicator|$reg" ;;
    gemm) echo "GroupedGemm|SwigluFfn|FfnBound|GemmGpu|ChunkedGemm|Sm90Gemm|GemmImpl|$reg" ;;
    ffn) echo "SwigluFfn|FfnBound|GemmGpu|$reg" ;;
    block) echo "MoeBlock|Regression\.R(3|4|5|7|14)_|$reg" ;;
    benchcmp) echo "BenchCompare|bench_compare_cli" ;;  # no op: check and golden skip
    tegate) echo "te_plugin_gate" ;;  # the gate script, with a fake check: no op, no build needed
    groupsizes) echo "GroupSizes|GroupedGemm|SwigluFfn|EpSizing|RaggedA2A|LocalPermute|$reg" ;;
    *) echo "" ;;  # core: every test of the label
  esac
}
sanitize_family_of() {
  case $1 in
    router|aux) echo router ;;
    dispatch|argsort|sortchunks|ep) echo dispatch ;;
    gemm|ffn) echo gemm ;;
    block) echo block ;;
    *) echo "" ;;
  esac
}

# ---- the mutants ---------------------------------------------------------------------------------
mutants=()  # "id<TAB>class<TAB>file"
while IFS=$'\t' read -r id cls file desc; do
  [[ -z $id || $id == \#* ]] && continue
  if [[ -n $only ]] && [[ ",$only," != *",$id,"* ]]; then continue; fi
  if [[ $cpu_only -eq 1 && $file == gpu/* ]]; then continue; fi
  if [[ $gpu_only -eq 1 && $file != gpu/* ]]; then continue; fi
  mutants+=("$id"$'\t'"$cls"$'\t'"$file")
done <"$root/tests/mutants/INDEX"
if [[ -n $shard ]]; then
  si=${shard%/*}; sn=${shard#*/}; sel=(); k=0
  for m in "${mutants[@]}"; do
    [[ $((k % sn)) -eq $si ]] && sel+=("$m")
    k=$((k + 1))
  done
  mutants=("${sel[@]}")
fi
patch_of() { ls "$root/tests/mutants/$1"_*.patch 2>/dev/null | head -1; }
mode=gpu
[[ $has_gpu -eq 0 ]] && mode=cpu
[[ $compile_only -eq 1 ]] && mode=compile
results="$work/results-$mode"  # per mode: a CPU result says nothing about the GPU gates
mkdir -p "$results"
log "${#mutants[@]} mutants; mode $mode; nvcc $has_nvcc; gpu $has_gpu; jobs $jobs; work $work"

# ---- scratch trees ------------------------------------------------------------------------------
# shellcheck source=scripts/scratch_tree.sh
source "$root/scripts/scratch_tree.sh"
stage="$work/src"
stage_tree "$root" "$stage" "$([[ $head -eq 1 ]] && echo head)"
src_hash=$(cd "$stage" && find . -type f ! -path './tests/mutants/*' | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12)

# moe_cpu_tests (a third of the build) only serves reference/ and harness/ mutants: the ctest
# gate of a gpu/ mutant runs the gpu label alone.
host_mutants=0
for m in "${mutants[@]}"; do [[ $(cut -f3 <<<"$m") == gpu/* ]] || host_mutants=1; done
targets() {  # build dir
  local t="moe-harness" x all
  [[ $host_mutants -eq 1 || $mode != gpu ]] && t+=" moe_cpu_tests"
  [[ $mode == gpu ]] && t+=" moe_gpu_tests"
  # The CLI ctests of cmake/plugins.cmake load the example plugins: unbuilt, they fail on every
  # tree, the unmutated one included, and break the ctest gate of the harness/core mutants.
  if [[ $host_mutants -eq 1 ]]; then
    all=$(ninja -C "$1" -t targets all 2>/dev/null)  # not piped into grep -q: pipefail, SIGPIPE
    for x in moe_example_plugin moe_example_plugin_buggy moe_example_plugin_abi99 \
      moe_example_cuda_plugin moe_example_cuda_plugin_buggy; do
      grep -q "^$x:" <<<"$all" && t+=" $x"
    done
  fi
  echo "$t"
}
build_tree() {  # tree, parallelism, log
  local bd="$1/build-mut" cargs=()
  [[ $has_nvcc -eq 0 ]] && cargs+=(-DMOE_WITH_CUDA=OFF)
  if [[ ! -f $bd/build.ninja ]]; then
    cmake -S "$1" -B "$bd" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DMOE_CUDA_ARCHITECTURES="${MOE_CUDA_ARCHITECTURES:-90}" "${cargs[@]}" ${MOE_CMAKE_ARGS:-} >"$3" 2>&1 || return 1
  fi
  # shellcheck disable=SC2046
  cmake --build "$bd" -j "$2" --target $(targets "$bd") >>"$3" 2>&1
}
tree_of() { if [[ $1 -eq 0 ]]; then echo "$work/tree"; else echo "$work/tree-$1"; fi; }
[[ $jobs -lt 1 ]] && jobs=1
[[ ${#mutants[@]} -lt $jobs ]] && jobs=$(( ${#mutants[@]} > 0 ? ${#mutants[@]} : 1 ))
per=$(( ncpu / jobs > 0 ? ncpu / jobs : 1 ))
log "syncing and building $jobs tree(s) (source $src_hash, -j $per each)"
pids=()
for ((j = 0; j < jobs; ++j)); do
  (sync_tree "$stage" "$(tree_of $j)" build-mut && build_tree "$(tree_of $j)" "$per" "$work/logs/build-tree$j.log") &
  pids+=($!)
done
fail=0
for ((j = 0; j < jobs; ++j)); do
  if ! wait "${pids[$j]}"; then
    fail=1
    echo "tree $j: the unmutated build failed; last lines of $work/logs/build-tree$j.log:"
    tail -20 "$work/logs/build-tree$j.log"
  fi
done
[[ $fail -eq 1 ]] && exit 2
log "trees built"

# ---- gates --------------------------------------------------------------------------------------
# Each prints one word: caught | - (passed: not caught) | err (exit 2: usage) | skip.
verdict() {  # exit status of a gate command
  case $1 in
    0) echo "-" ;;
    2) echo "err" ;;
    124|137) echo "caught" ;;  # a hang counts: the harness stopped the mutant
    *) echo "caught" ;;
  esac
}
gate_check() {  # tree family file log
  local bin="$1/build-mut/moe-harness" be=reference rc worst=0 op shrink=()
  [[ $fast -eq 1 ]] && shrink=(--no-shrink)  # the verdict is all --fast needs
  [[ $3 == gpu/* && $mode == gpu ]] && be=gpu
  [[ -z $(ops_of "$2") ]] && { echo skip; return; }  # tools/: no op to check
  for op in $(ops_of "$2"); do
    timeout 600 "$bin" check --op "$op" --backend "$be" --cases "$cases" --seed 1 -j 4 \
      "${shrink[@]}" >>"$4" 2>&1
    rc=$?
    echo "check --op $op --backend $be: exit $rc" >>"$4"
    if [[ $rc -ne 0 ]]; then worst=$rc; [[ $rc -ne 2 && $fast -eq 1 ]] && break; fi
  done
  verdict $worst
}
gate_golden() {
  local bin="$1/build-mut/moe-harness" args=(golden verify) files=() op f
  [[ $3 == gpu/* ]] && args+=(--backend gpu)
  for op in $(ops_of "$2"); do
    for f in "$1"/golden/data/"$op"__*.safetensors; do [[ -e $f ]] && files+=("$f"); done
  done
  [[ $2 == core ]] && files=("$1/golden/data")
  [[ ${#files[@]} -eq 0 ]] && { echo skip; return; }
  timeout 600 "$bin" "${args[@]}" "${files[@]}" >>"$4" 2>&1
  verdict $?
}
gate_ctest() {
  local labels='^cpu$' re rc
  if [[ $3 == gpu/* ]]; then labels='^gpu$'; elif [[ $mode == gpu ]]; then labels='^(cpu|gpu)$'; fi
  re=$(tests_of "$2")
  # mutants_apply fails on any mutated tree (the applied patch no longer applies): not a catch.
  timeout 1200 ctest --test-dir "$1/build-mut" -L "$labels" ${re:+-R "$re"} \
    -E 'golden_verify|python_golden|launch_selftest|bench_unknown|bench_impl_plugin|fuzz|multi_gpu|sanitize|GemmBench|mutants_apply' \
    -j "$per" --timeout 600 --output-on-failure >>"$4" 2>&1
  rc=$?
  if grep -q "No tests were found" "$4"; then echo skip; return; fi
  [[ $rc -eq 2 ]] && rc=1  # ctest's 2 is not a usage error of ours
  verdict $rc
}
gate_sanitize() {
  local fam; fam=$(sanitize_family_of "$2")
  [[ $mode != gpu || $3 != gpu/* || -z $fam ]] && { echo skip; return; }
  local bd="$1/build-mut" rc
  if ctest --test-dir "$bd" -N -L sanitize 2>/dev/null | grep -q "sanitize_${fam}_"; then
    timeout 2400 ctest --test-dir "$bd" -L sanitize -R "sanitize_${fam}_(${san_tools//,/|})\$" \
      --output-on-failure >>"$4" 2>&1
    rc=$?
    [[ $rc -eq 0 ]] && grep -q "Skipped" "$4" && { echo skip; return; }
  else
    timeout 2400 bash "$1/scripts/gpu_sanitize.sh" --family "$fam" --tools "$san_tools" \
      --skip-code 77 "$bd" "$bd/sanitize-mut/$fam" >>"$4" 2>&1
    rc=$?
    [[ $rc -eq 77 ]] && { echo skip; return; }
  fi
  [[ $rc -eq 2 ]] && rc=1
  verdict $rc
}
gates=(check golden ctest sanitize)

# Baselines: a gate that fails on the unmutated tree catches nothing. One line per family, kind
# and gate ("router|gpu<TAB>check<TAB>-"), cached per source. --prepare runs every gate of every
# family in play; otherwise a baseline is run after the mutants, only where some mutant's gate
# failed (a sanitizer baseline costs minutes and most mutants fall to `check`), on tree 0 once
# every mutated file is restored and rebuilt. The families run in parallel.
baseline="$work/baseline-$src_hash-$mode-c$cases.tsv"
touch "$baseline"
base_of() {  # key gate -> the baseline verdict, empty when not run
  awk -F'\t' -v k="$1" -v g="$2" '$1==k && $2==g {v=$3} END {print v}' "$baseline"
}
run_baselines() {  # "key gate" pairs on stdin; runs the missing ones, one job per family and kind
  declare -A want=()
  local key g
  while read -r key g; do
    [[ -z $key || -n $(base_of "$key" "$g") ]] && continue
    want[$key]+="$g "
  done
  [[ ${#want[@]} -eq 0 ]] && return 0
  # shellcheck disable=SC2046
  cmake --build "$(tree_of 0)/build-mut" -j "$ncpu" --target $(targets "$(tree_of 0)/build-mut") >"$work/logs/baseline-build.log" 2>&1 ||
    { log "tree 0 does not rebuild unmutated ($work/logs/baseline-build.log)"; return 1; }
  local pids=() fam kind file v lg
  for key in "${!want[@]}"; do
    (
      fam=${key%|*}; kind=${key#*|}
      file=reference/x; [[ $kind == gpu ]] && file=gpu/x
      for g in ${want[$key]}; do
        lg="$work/logs/baseline-$fam-$kind-$g.log"; : >"$lg"
        v=$("gate_$g" "$(tree_of 0)" "$fam" "$file" "$lg")
        printf '%s\t%s\t%s\n' "$key" "$g" "$v" >>"$work/baseline-new.$BASHPID"
        [[ $v == caught || $v == err ]] && log "baseline $fam ($kind) $g: FAILS on the unmutated tree ($lg); this gate is ignored for it"
        log "baseline $key $g: $v"
      done
    ) &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  cat "$work"/baseline-new.* >>"$baseline" 2>/dev/null
  rm -f "$work"/baseline-new.*
}
key_of() { echo "$(family_of "$1")|$([[ $1 == gpu/* ]] && echo gpu || echo ref)"; }
if [[ $mode != compile && $prepare -eq 1 ]]; then
  declare -A fams=()
  for m in "${mutants[@]}"; do
    IFS=$'\t' read -r id cls file <<<"$m"
    fams["$(key_of "$file")"]=1
  done
  for key in "${!fams[@]}"; do
    [[ $mode == cpu && $key == *\|gpu ]] && continue
    for g in "${gates[@]}"; do echo "$key $g"; done
  done | run_baselines
fi
[[ $prepare -eq 1 ]] && { log "prepared (--prepare)"; exit 0; }

# ---- the workers ----------------------------------------------------------------------------------
# Mutants sorted by file so consecutive ones rebuild the same object. Those still to run (a
# resumed call skips the rest) are dealt to the trees in contiguous runs of equal length: one
# file's mutants spread over several trees only where they outnumber the others (moe_block's).
mapfile -t sorted < <(printf '%s\n' "${mutants[@]}" | sort -t$'\t' -k3,3 -k1,1)
done_before() {  # id -> whether an earlier call tested it
  local res="$results/$1.tsv" c4 c8
  [[ $rerun -eq 0 && -s $res ]] || return 1
  c4=$(cut -f4 "$res"); c8=$(cut -f8 "$res")
  [[ $c4 == invalid* || $c4 == built || $c8 == yes || $c8 == no ]]
}
todo=()
for m in "${sorted[@]}"; do done_before "$(cut -f1 <<<"$m")" || todo+=("$m"); done
declare -A bin_of=()
chunk=$(( (${#todo[@]} + jobs - 1) / jobs )); [[ $chunk -lt 1 ]] && chunk=1
for ((k = 0; k < ${#todo[@]}; ++k)); do bin_of[$(cut -f1 <<<"${todo[$k]}")]=$((k / chunk)); done

run_mutant() {  # job tree id class file
  local j=$1 t=$2 id=$3 cls=$4 file=$5 p res="$results/$3.tsv" lg="$work/logs/$3"
  p=$(patch_of "$id")
  rm -rf "$lg"; mkdir -p "$lg"
  local start; start=$(date +%s)
  local row=("$id" "$cls" "$file")
  cp "$t/$file" "$work/orig-$j"
  # GIT_CEILING_DIRECTORIES: the tree is never taken for part of an enclosing repository (where
  # git apply would skip paths outside the current directory and succeed doing nothing).
  if ! (cd "$t" && GIT_CEILING_DIRECTORIES=$(dirname "$t") git apply "$p") >"$lg/apply.log" 2>&1 ||
    cmp -s "$t/$file" "$work/orig-$j"; then
    cp "$work/orig-$j" "$t/$file"
    printf '%s\t%s\t%s\tinvalid(apply)\t\t\t\t\t0\n' "${row[@]}" >"$res"
    log "[$j] $id $file: patch does not apply ($lg/apply.log)"
    return
  fi
  # --compile-only builds the mutated library alone (no links): enough to prove it compiles.
  local tg; tg=$(targets "$t/build-mut")
  if [[ $mode == compile ]]; then
    case $file in
      gpu/*) tg=moe_gpu ;; reference/*) tg=moe_reference ;; harness/core/*) tg=moe_core ;;
      tools/*|integrations/*) tg=moe-harness ;;
    esac
  fi
  if ! cmake --build "$t/build-mut" -j "$per" --target $tg >"$lg/build.log" 2>&1; then
    cp "$work/orig-$j" "$t/$file"
    printf '%s\t%s\t%s\tinvalid(build)\t\t\t\t\t%s\n' "${row[@]}" $(($(date +%s) - start)) >"$res"
    log "[$j] $id $file: INVALID, does not build ($lg/build.log)"
    return
  fi
  if [[ $mode == compile ]]; then
    cp "$work/orig-$j" "$t/$file"
    printf '%s\t%s\t%s\tbuilt\t\t\t\t\t%s\n' "${row[@]}" $(($(date +%s) - start)) >"$res"
    log "[$j] $id $file: builds ($(($(date +%s) - start)) s)"
    return
  fi
  local fam kind caught=no cells=() g v b
  fam=$(family_of "$file"); kind=ref; [[ $file == gpu/* ]] && kind=gpu
  for g in "${gates[@]}"; do
    if [[ $fast -eq 1 && $caught == yes ]]; then cells+=(skip); continue; fi
    b=$(base_of "$fam|$kind" "$g")
    if [[ $b == caught || $b == err ]]; then cells+=(broken); continue; fi
    v=$("gate_$g" "$t" "$fam" "$file" "$lg/$g.log")
    cells+=("$v")
    [[ $v == caught ]] && caught=yes
  done
  cp "$work/orig-$j" "$t/$file"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "${row[@]}" "${cells[@]}" "$caught" \
    $(($(date +%s) - start)) >"$res"
  log "[$j] $id ($cls, $file): check ${cells[0]}, golden ${cells[1]}, ctest ${cells[2]}, sanitize ${cells[3]} -> caught: $caught ($(($(date +%s) - start)) s)"
}

worker() {
  local j=$1 t m id cls file
  t=$(tree_of "$j")
  for m in "${todo[@]}"; do
    IFS=$'\t' read -r id cls file <<<"$m"
    [[ ${bin_of[$id]} -eq $j ]] || continue
    if [[ $mode == cpu && $file == gpu/* ]]; then
      printf '%s\t%s\t%s\tuntested(no GPU)\t\t\t\t\t0\n' "$id" "$cls" "$file" >"$results/$id.tsv"
      continue
    fi
    if [[ $deadline -gt 0 && $(($(date +%s) - t0)) -ge $deadline ]]; then
      printf '%s\t%s\t%s\tuntested(deadline)\t\t\t\t\t0\n' "$id" "$cls" "$file" >"$results/$id.tsv"
      continue
    fi
    run_mutant "$j" "$t" "$id" "$cls" "$file"
  done
}
pids=()
for ((j = 0; j < jobs; ++j)); do worker "$j" & pids+=($!); done
for p in "${pids[@]}"; do wait "$p"; done

# Baselines of every gate that failed on some mutant, then those cells re-judged: a failure the
# unmutated tree shares is "broken"; a mutant left with no catch but gates --fast skipped after it
# is dropped from the results, to be rerun without the broken gate.
if [[ $mode != compile ]]; then
  for m in "${mutants[@]}"; do
    IFS=$'\t' read -r id cls file <<<"$m"
    res="$results/$id.tsv"
    [[ -s $res ]] || continue
    IFS=$'\t' read -r -a row <"$res"
    for i in 0 1 2 3; do
      [[ ${row[$((3 + i))]:-} == caught || ${row[$((3 + i))]:-} == err ]] && echo "$(key_of "$file") ${gates[$i]}"
    done
  done | sort -u | run_baselines
  for m in "${mutants[@]}"; do
    IFS=$'\t' read -r id cls file <<<"$m"
    res="$results/$id.tsv"
    [[ -s $res ]] || continue
    IFS=$'\t' read -r -a row <"$res"
    [[ ${row[7]:-} == yes || ${row[7]:-} == no ]] || continue
    changed=0 caught=no skipped=0
    for i in 0 1 2 3; do
      c=${row[$((3 + i))]}
      b=$(base_of "$(key_of "$file")" "${gates[$i]}")
      if [[ ($c == caught || $c == err) && ($b == caught || $b == err) ]]; then row[$((3 + i))]=broken; changed=1; fi
      [[ ${row[$((3 + i))]} == caught ]] && caught=yes
      [[ ${row[$((3 + i))]} == skip ]] && skipped=1
    done
    [[ $changed -eq 0 ]] && continue
    if [[ $caught == no && $fast -eq 1 && $skipped -eq 1 ]]; then
      rm -f "$res"; log "$id: its catch was a broken gate; rerun it (the broken gate is skipped)"
      continue
    fi
    row[7]=$caught
    (IFS=$'\t'; echo "${row[*]}") >"$res"
  done
fi

# ---- the table -----------------------------------------------------------------------------------
tsv=$(mktemp)
printf 'mutant\tclass\tfile\tcheck\tgolden\tctest\tsanitize\tcaught\tseconds\n' >"$tsv"
for m in "${mutants[@]}"; do
  id=${m%%	*}
  if [[ -s $results/$id.tsv ]]; then cat "$results/$id.tsv" >>"$tsv"
  else printf '%s\tuntested\t\t\t\t\t\t\t0\n' "$m" >>"$tsv"; fi
done
tested=$(awk -F'\t' 'NR>1 && ($8=="yes"||$8=="no")' "$tsv" | wc -l)
caught=$(awk -F'\t' 'NR>1 && $8=="yes"' "$tsv" | wc -l)
invalid=$(awk -F'\t' 'NR>1 && $4 ~ /^invalid/' "$tsv" | wc -l)
untested=$(awk -F'\t' 'NR>1 && ($4 ~ /^untested/ || $2=="untested")' "$tsv" | wc -l)
built=$(awk -F'\t' 'NR>1 && $4=="built"' "$tsv" | wc -l)
echo
column -t -s $'\t' "$tsv" 2>/dev/null || cat "$tsv"
echo
if [[ $mode == compile ]]; then
  summary="compile-only: $built of ${#mutants[@]} mutants build, $invalid invalid, $untested untested"
else
  pct=0; [[ $tested -gt 0 ]] && pct=$((100 * caught / tested))
  summary="score: $caught of $tested caught ($pct%); $invalid invalid, $untested untested; mode $mode, --cases $cases"
  survivors=$(awk -F'\t' 'NR>1 && $8=="no" {printf "%s ", $1}' "$tsv")
  [[ -n $survivors ]] && summary+=$'\n'"survivors: $survivors"
fi
echo "$summary"
cp "$tsv" "$work/mutation.tsv"
{
  echo "| mutant | class | file | check | golden | ctest | sanitize | caught | s |"
  echo "|---|---|---|---|---|---|---|---|---|"
  tail -n +2 "$tsv" | awk -F'\t' '{printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n",$1,$2,$3,$4,$5,$6,$7,$8,$9}'
  echo
  echo "$summary"
} >"$work/mutation.md"
if [[ -n $out ]]; then
  mkdir -p "$out"
  cp "$work/mutation.tsv" "$work/mutation.md" "$out/"
  cp -r "$work/logs" "$out/logs" 2>/dev/null
fi
rm -f "$tsv"
[[ $untested -gt 0 ]] && exit 3
exit 0
