#!/usr/bin/env bash
# Nsight Compute profile of the kernels `moe-harness bench` times, for the speed issue (#20): per
# target, ncu over one bench case limited to a few launches of that case's timed kernels, then a
# compact summary (scripts/ncu_summary.py): kernel, duration, DRAM bytes read / written, DRAM
# throughput (% of peak, GB/s), SM throughput %, achieved occupancy, registers per thread and the
# top 3 warp-stall reasons by share.
#
#   scripts/gpu_profile.sh [--build DIR] [--out DIR] [--set NAME ...] [--keep-rep] [--count N]
#                          [--skip N] [--timeout S] [--full] [--source] [--ncu-arg ARG]...
#                          [--list] [--dry-run]
#
# Run from the repo root on a GPU machine with DIR/moe-harness built (CUDA backend):
#   export PATH=/usr/local/cuda/bin:$PATH   # (the script also prepends it when it exists)
#   scripts/gpu_profile.sh                  # every target, out/profile
#   scripts/gpu_profile.sh --set router_ds_fwd --set gemm_sm90_ds_fwd --keep-rep
#
# Targets (--set NAME, repeatable, comma lists and several names after one --set allowed;
# default and `all`: every one but the GemmBench targets below). Case names are `moe-harness
# bench` cases (the ops' bench_cases in harness/ops; `moe-harness bench --op OP --case NAME`
# rejects an unknown one):
#   router_ds_fwd       topk_router     deepseek_v3       fwd  rowk::fwd_kernel / fwd8_kernel
#   router_mixtral_fwd  topk_router     mixtral           fwd  rowk::fwd_kernel / fwd8_kernel
#   aux_mixtral_fwd     aux_loss_scores mixtral           fwd  rowk::fwd_kernel / fwd8_kernel
#   aux_mixtral_bwd     aux_loss_scores mixtral           bwd  rowk::bwd_kernel
#   aux_ds_fwd          aux_loss_scores deepseek_v3       fwd  rowk::fwd_kernel / fwd8_kernel
#   dispatch_ds_fwd     token_dispatch  deepseek_v3       fwd  dispatch_rows(_bulk)?_kernel (the
#                                                              row copies, not the layout kernels)
#   combine_ds_fwd      token_combine   deepseek_v3       fwd  gather_sum(_bulk)?_kernel
#   dispatch_ds_bwd     token_dispatch  deepseek_v3       bwd  gather_sum(_bulk)?_kernel +
#                                                              dispatch_bwd_probs_kernel
#   gemm_sm90_ds_fwd    grouped_gemm    deepseek_uniform  fwd  sm90 grouped_rows_kernel
#                       (MOE_GEMM_IMPL=sm90: gpu/grouped_gemm.cu's default_gemm_impl; where the
#                       kernel cannot run, sm90 falls back to cuBLAS and nothing is profiled)
#   gemm_sm90_mixtral_fwd grouped_gemm  mixtral_uniform   fwd  the same kernel, compute-bound shape
#   gemm_sm90_even_fwd  grouped_gemm    deepseek_even     fwd  the same kernel on 256 groups of
#                       exactly 256 rows (no tails; MOE_SM90_TAIL=kernel in the caller's
#                       environment runs the folding variant on that same work)
#   gemm_sm90_ds_wgrad  grouped_gemm    deepseek_uniform  fwd+bwd sm90 grouped_cols_panel_kernel (the
#                       wgrad kernel `auto` picks for groups of <= 2048 rows; the panel one where
#                       all are <= 384; MOE_SM90_WGRAD_PANEL=off in the caller's environment
#                       profiles grouped_cols_kernel there; 7.5 GB of gradient writes)
#   gemm_sm90_ds_dgrad  grouped_gemm    deepseek_uniform  fwd+bwd sm90 grouped_rows_kernel with K-major
#                       weights (dgrad: the forward's bytes and FLOPs, 28 column tiles of 32
#                       k-blocks instead of 8 of 112)
# GemmBench targets (`gemmbench` in the op column): the test binary's full-size GemmBench
# (DIR/moe_gpu_tests, MOE_GEMM_BENCH=1 MOE_GEMM_BENCH_IMPLS=auto MOE_GEMM_BENCH_CASES=case, ~55
# GB of GPU memory), whose shapes `bench` lacks. The regex picks the role's kernel; GemmBench
# calls each role once at full size to verify it, then times it, so every matching launch is
# full size. Not in `all` (nor the default): name them. The layout pair (session 43: same shapes,
# same kernel, weight MN- or K-major):
#   gb_down_fwd         gemmbench       deepseek_down     fwd   grouped_rows_kernel, MN-major
#                       weight (65536 x 7168 out, K = 2048: uniform dgrad's shape)
#   gb_uniform_dgrad    gemmbench       deepseek_uniform  dgrad grouped_rows_kernel, K-major
#   gb_uniform_fwd      gemmbench       deepseek_uniform  fwd   MN-major (65536 x 2048, K = 7168)
#   gb_down_dgrad       gemmbench       deepseek_down     dgrad K-major (uniform fwd's shape)
#
# What is profiled: `moe-harness bench --op OP --case NAME --samples 20` (GemmBench targets: the
# test binary as above) under
#   ncu --target-processes all --kernel-name-base demangled --kernel-name regex:RE
#       --launch-skip SKIP --launch-count N*K --kill yes --section ... --metrics ...
# The regex selects the direction's kernels by their demangled names; bench first verifies the
# case (check_gpu: the op at a small size, twice) and builds its inputs (one untimed full-size
# call per input set), so the first SKIP matching launches (--skip, default 8) are skipped: what
# is profiled are full-size launches (bench's calibration and timed launches, or its setup calls
# of the same size). N (--count, default 2) calls of the op are profiled, K kernels a call, and
# ncu then kills bench (--kill), so the dense cuBLAS baseline and the other direction never run.
# The summary keeps, per kernel, only the launches of its largest grid and says so when it drops
# one (a verification-sized launch: raise --skip).
# Sections: SpeedOfLight, MemoryWorkloadAnalysis, Occupancy, WarpStateStats, LaunchStats,
# SchedulerStats (--full: ncu's `--set full`, ~40 replay passes a kernel, several times slower),
# plus --metrics gpu__time_duration.sum, dram__bytes_read.sum, dram__bytes_write.sum,
# dram__throughput.avg.pct_of_peak_sustained_elapsed, sm__throughput.avg.pct_of_peak_sustained_
# elapsed, sm__warps_active.avg.pct_of_peak_sustained_active, launch__registers_per_thread,
# launch__grid_size, lts__t_bytes.sum (L2 traffic: in raw.csv, not the summary) (if ncu rejects
# a metric name, the target is rerun with the sections alone).
# ncu's defaults stay: caches flushed and clocks locked to base before each kernel
# (--ncu-arg --clock-control=none to profile at the boost clocks bench times at), so durations
# read a little above bench's medians.
#
# --source adds the SourceCounters section (warp-stall samples per SASS instruction), exports them
# (ncu --import ... --csv --page source --print-source sass: T/sass.csv) and summarises them with
# scripts/ncu_source_summary.py into T/source.txt (the reasons' shares, the loop bodies by times
# executed, the most-sampled instructions; a branch after an mbarrier try_wait is marked as that
# wait), printed after the target's line. Session 26's use: the sm90 forward's consumers spend half their samples waiting
# for a stage to land (docs/perf.md).
# Output under --out (default out/profile), per target T: T/ncu.log (ncu and bench output),
# T/T.ncu-rep (only with --keep-rep), T/raw.csv (ncu --import ... --csv --page raw), T/summary.csv
# and T/summary.txt; for the run: summary.csv, summary.txt and the table on stdout.
#
# Each target runs under `timeout` (--timeout, default 120 s). Measured (session 9): the default
# set of 7 targets in 38 s on an H200, 4-7 s a target (the per-target times are printed).
#
# Exit status: 0 every target profiled; 1 a target failed (bench error, no kernel matched,
# timeout); 2 bad usage (the bad argument is named) or no DIR/moe-harness (DIR/moe_gpu_tests for a
# GemmBench target); 3 ncu has no
# permission for the GPU's performance counters (ERR_NVGPUCTRPERM); 77 no GPU, no ncu or no
# python3.
set -uo pipefail

usage() { sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "gpu_profile.sh: $1" >&2; exit "${2:-2}"; }

here=$(cd "$(dirname "$0")" && pwd)
summary_py=$here/ncu_summary.py

# name;op;case;direction;environment;kernel regex (demangled names);kernels per call
targets=(
  "router_ds_fwd;topk_router;deepseek_v3;fwd;;rowk::fwd8?_kernel;1"
  "router_mixtral_fwd;topk_router;mixtral;fwd;;rowk::fwd8?_kernel;1"
  "aux_mixtral_fwd;aux_loss_scores;mixtral;fwd;;rowk::fwd8?_kernel;1"
  "aux_mixtral_bwd;aux_loss_scores;mixtral;bwd;;rowk::bwd_kernel;1"
  "aux_ds_fwd;aux_loss_scores;deepseek_v3;fwd;;rowk::fwd8?_kernel;1"
  "dispatch_ds_fwd;token_dispatch;deepseek_v3;fwd;;dispatch_rows(_bulk)?_kernel;1"
  "combine_ds_fwd;token_combine;deepseek_v3;fwd;;gather_sum(_bulk)?_kernel;1"
  "dispatch_ds_bwd;token_dispatch;deepseek_v3;bwd;;gather_sum(_bulk)?_kernel|dispatch_bwd_probs_kernel;2"
  "gemm_sm90_ds_fwd;grouped_gemm;deepseek_uniform;fwd;MOE_GEMM_IMPL=sm90;grouped_rows_kernel;1"
  "gemm_sm90_mixtral_fwd;grouped_gemm;mixtral_uniform;fwd;MOE_GEMM_IMPL=sm90;grouped_rows_kernel;1"
  "gemm_sm90_even_fwd;grouped_gemm;deepseek_even;fwd;MOE_GEMM_IMPL=sm90;grouped_rows_kernel;1"
  "gemm_sm90_ds_wgrad;grouped_gemm;deepseek_uniform;fwd+bwd;;grouped_cols_(panel_)?kernel;1"
  "gemm_sm90_ds_dgrad;grouped_gemm;deepseek_uniform;fwd+bwd;MOE_GEMM_IMPL=sm90;grouped_rows_kernel<[^,]+, .bool.1,;1"
  "gb_down_fwd;gemmbench;deepseek_down;fwd;;grouped_rows_kernel<[^,]+, .bool.0,;1"
  "gb_uniform_dgrad;gemmbench;deepseek_uniform;dgrad;;grouped_rows_kernel<[^,]+, .bool.1,;1"
  "gb_uniform_fwd;gemmbench;deepseek_uniform;fwd;;grouped_rows_kernel<[^,]+, .bool.0,;1"
  "gb_down_dgrad;gemmbench;deepseek_down;dgrad;;grouped_rows_kernel<[^,]+, .bool.1,;1"
)
target_names=()
for t in "${targets[@]}"; do target_names+=("${t%%;*}"); done

sections=(SpeedOfLight MemoryWorkloadAnalysis Occupancy WarpStateStats LaunchStats SchedulerStats)
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
metrics+=,dram__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,sm__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,sm__warps_active.avg.pct_of_peak_sustained_active
metrics+=,launch__registers_per_thread,launch__grid_size,lts__t_bytes.sum

build=${MOE_BUILD_DIR:-build}
out=out/profile
keep_rep=0 count=2 skip=8 timeout_s=120 full=0 source=0 list=0 dry=0
chosen=()
ncu_extra=()

need_value() {  # option, remaining argument count
  [[ $2 -ge 2 ]] || die "$1: missing value (see --help)"
}
need_int() {  # option, value, minimum
  if ! [[ $2 =~ ^[0-9]+$ ]] || [[ $2 -lt $3 ]]; then die "$1: '$2' is not an integer >= $3"; fi
}
add_sets() {  # comma- or space-separated names
  local n
  for n in ${1//,/ }; do chosen+=("$n"); done
}

while [[ $# -gt 0 ]]; do
  case $1 in
    --build) need_value "$1" $#; build=$2; shift 2 ;;
    --build=*) build=${1#*=}; shift ;;
    --out) need_value "$1" $#; out=$2; shift 2 ;;
    --out=*) out=${1#*=}; shift ;;
    --set)
      [[ $# -ge 2 && $2 != -* ]] || die "--set: missing target name (see --list)"
      shift
      while [[ $# -gt 0 && $1 != -* ]]; do add_sets "$1"; shift; done ;;
    --set=*) add_sets "${1#*=}"; shift ;;
    --keep-rep) keep_rep=1; shift ;;
    --count) need_value "$1" $#; need_int "$1" "$2" 1; count=$2; shift 2 ;;
    --skip) need_value "$1" $#; need_int "$1" "$2" 0; skip=$2; shift 2 ;;
    --timeout) need_value "$1" $#; need_int "$1" "$2" 1; timeout_s=$2; shift 2 ;;
    --full) full=1; shift ;;
    --source) source=1; shift ;;
    --ncu-arg) need_value "$1" $#; ncu_extra+=("$2"); shift 2 ;;
    --ncu-arg=*) ncu_extra+=("${1#*=}"); shift ;;
    --list) list=1; shift ;;
    --dry-run) dry=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ -n $build ]] || die "--build: empty directory name"
[[ -n $out ]] || die "--out: empty directory name"

# The selected targets, in table order, each once.
selected=()
if [[ ${#chosen[@]} -eq 0 ]]; then chosen=(all); fi
for n in "${chosen[@]}"; do
  if [[ $n == all ]]; then continue; fi
  known=0
  for k in "${target_names[@]}"; do [[ $k == "$n" ]] && known=1; done
  [[ $known -eq 1 ]] || die "--set: unknown target '$n' (known: all ${target_names[*]})"
done
for t in "${targets[@]}"; do
  name=${t%%;*}
  for n in "${chosen[@]}"; do
    # `all` (and the default) leaves the GemmBench targets out: they need the test binary.
    if [[ ($n == all && $t != *";gemmbench;"*) || $n == "$name" ]]; then selected+=("$t"); break; fi
  done
done

if [[ $list -eq 1 ]]; then
  printf '%-20s %-16s %-18s %-4s %-20s %s\n' target op case dir environment "kernel regex"
  for t in "${targets[@]}"; do
    IFS=';' read -r name op bcase dir envs re k <<<"$t"
    printf '%-20s %-16s %-18s %-4s %-20s %s\n' "$name" "$op" "$bcase" "$dir" "${envs:--}" "$re"
  done
  exit 0
fi

if [[ -d /usr/local/cuda/bin ]]; then PATH=/usr/local/cuda/bin:$PATH; fi
ncu=${NCU:-ncu}
bin=$build/moe-harness
tests_bin=$build/moe_gpu_tests

# The ncu command line of one target (into the array `cmd`); with_metrics=0 leaves --metrics out.
make_cmd() {  # target spec, directory, with_metrics
  local name op bcase dir envs re k
  IFS=';' read -r name op bcase dir envs re k <<<"$1"
  cmd=(env)
  if [[ $op == gemmbench ]]; then
    cmd+=(MOE_GEMM_BENCH=1 MOE_GEMM_BENCH_IMPLS=auto "MOE_GEMM_BENCH_CASES=$bcase")
  fi
  if [[ -n $envs ]]; then cmd+=("$envs"); fi
  cmd+=(timeout -k 15 "$timeout_s" "$ncu" --target-processes all
        --kernel-name-base demangled --kernel-name "regex:$re"
        --launch-skip "$skip" --launch-count $((count * k)) --kill yes)
  if [[ $full -eq 1 ]]; then
    cmd+=(--set full)
  else
    local s
    for s in "${sections[@]}"; do cmd+=(--section "$s"); done
  fi
  if [[ $source -eq 1 && $full -eq 0 ]]; then cmd+=(--section SourceCounters); fi
  if [[ $3 -eq 1 ]]; then cmd+=(--metrics "$metrics"); fi
  cmd+=("${ncu_extra[@]}" --force-overwrite -o "$2/$name")
  if [[ $op == gemmbench ]]; then
    cmd+=("$tests_bin" --gtest_filter=GemmBench.GroupedVsDenseCublasAtEqualFlops)
  else
    cmd+=("$bin" bench --op "$op" --case "$bcase" --samples 20)
  fi
}

if [[ $dry -eq 1 ]]; then
  for t in "${selected[@]}"; do
    make_cmd "$t" "$out/${t%%;*}" 1
    printf '%q ' "${cmd[@]}"
    printf '\n'
  done
  exit 0
fi

# Environment: ncu, a GPU, python3 (77: cannot profile here), then the binary (2: usage).
command -v "$ncu" >/dev/null 2>&1 ||
  die "ncu not found (NCU=$ncu; add /usr/local/cuda/bin to PATH): cannot profile here" 77
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi -L 2>/dev/null | grep -q '^GPU ' ||
    die "no GPU visible (nvidia-smi -L lists none): cannot profile here" 77
elif [[ ! -e /dev/nvidia0 ]]; then
  die "no GPU (no nvidia-smi, no /dev/nvidia0): cannot profile here" 77
fi
command -v python3 >/dev/null 2>&1 || die "python3 not found (the summary needs it)" 77
for t in "${selected[@]}"; do
  IFS=';' read -r _ op _ <<<"$t"
  need=$bin
  if [[ $op == gemmbench ]]; then need=$tests_bin; fi
  [[ -x $need ]] ||
    die "--build $build: no executable $need (build it first: MOE_BUILD_DIR=$build scripts/build.sh)"
done
mkdir -p "$out" || die "--out $out: cannot create the directory"

echo "gpu_profile.sh: $(nvidia-smi -L 2>/dev/null | head -n 1); $("$ncu" --version 2>/dev/null |
  tail -n 1)"
echo "gpu_profile.sh: ${#selected[@]} target(s), $count call(s) each after $skip matching" \
  "launches, timeout ${timeout_s}s each; output in $out"

status=0
inputs=()
failed=()
start_all=$SECONDS
i=0
for t in "${selected[@]}"; do
  i=$((i + 1))
  IFS=';' read -r name op bcase dir envs re k <<<"$t"
  tdir=$out/$name
  mkdir -p "$tdir"
  rm -f "$tdir/$name.ncu-rep" "$tdir/raw.csv" "$tdir/summary.csv" "$tdir/summary.txt"
  log=$tdir/ncu.log
  printf '[%d/%d] %-20s %s %s %s%s ... ' "$i" "${#selected[@]}" "$name" "$op" "$bcase" "$dir" \
    "${envs:+ ($envs)}"
  t0=$SECONDS
  make_cmd "$t" "$tdir" 1
  { printf '$ '; printf '%q ' "${cmd[@]}"; printf '\n'; } >"$log"
  "${cmd[@]}" >>"$log" 2>&1
  rc=$?
  if grep -Eq '^==ERROR==.*[Mm]etric' "$log"; then
    # A metric name this ncu does not know: the sections alone carry the same metrics.
    make_cmd "$t" "$tdir" 0
    { printf '\n(rerun without --metrics)\n$ '; printf '%q ' "${cmd[@]}"; printf '\n'; } >>"$log"
    "${cmd[@]}" >>"$log" 2>&1
    rc=$?
  fi
  secs=$((SECONDS - t0))
  if grep -q 'ERR_NVGPUCTRPERM' "$log"; then
    echo "FAILED"
    grep -m 3 'ERR_NVGPUCTRPERM' "$log" >&2
    die "ncu has no permission to read the GPU performance counters (ERR_NVGPUCTRPERM): run as \
root or set the nvidia module option NVreg_RestrictProfilingToAdminUsers=0 (see \
https://developer.nvidia.com/ERR_NVGPUCTRPERM); log: $log" 3
  fi
  profiled=$(grep -c '^==PROF== Profiling' "$log")
  rep=$tdir/$name.ncu-rep
  why=""
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then why="timed out after ${timeout_s}s"; fi
  if [[ -f $rep ]]; then
    if ! "$ncu" --import "$rep" --csv --page raw --print-units base >"$tdir/raw.csv" \
      2>"$tdir/import.err"; then
      "$ncu" --import "$rep" --csv --page raw >"$tdir/raw.csv" 2>"$tdir/import.err" ||
        why="${why:+$why; }ncu --import failed: $(head -c 300 "$tdir/import.err")"
    fi
    if [[ $source -eq 1 ]]; then
      "$ncu" --import "$rep" --csv --page source --print-source sass >"$tdir/sass.csv" \
        2>"$tdir/source.err" &&
        python3 "$here/ncu_source_summary.py" "$tdir/sass.csv" >"$tdir/source.txt" \
          2>>"$tdir/source.err"
    fi
    [[ $keep_rep -eq 1 ]] || rm -f "$rep"
  elif [[ $profiled -eq 0 && -z $why ]]; then
    why="no kernel matched regex:$re after $skip skipped matching launches (ncu exit $rc)"
  else
    why="${why:+$why; }no report written (ncu exit $rc)"
  fi
  # bench's own complaints: a case it does not know, a verification or benchmark failure.
  bench_msg=$(grep -m 1 -E '^(VERIFY FAIL|BENCH ERROR|BENCH FAULT|bench: |--case: |--op: |.*: Failure$)' "$log")
  if [[ -s $tdir/raw.csv ]] &&
    python3 "$summary_py" --csv "$tdir/summary.csv" --txt "$tdir/summary.txt" \
      "$name=$tdir/raw.csv" >/dev/null 2>"$tdir/summary.err"; then
    echo "${secs}s, $profiled launch(es) profiled${bench_msg:+ (bench said: $bench_msg)}"
    inputs+=("$name=$tdir/raw.csv")
    if [[ $source -eq 1 && -s $tdir/source.txt ]]; then
      sed 's/^/    /' "$tdir/source.txt"
    elif [[ $source -eq 1 ]]; then
      echo "    no source summary: $(head -c 300 "$tdir/source.err" 2>/dev/null)"
    fi
  else
    [[ -n $why ]] || why="no kernel matched regex:$re after $skip skipped launches"
    if [[ -n $bench_msg ]]; then why="bench said: $bench_msg; $why"; fi
    echo "FAILED (${secs}s): $why"
    echo "  last lines of $log:"
    grep -v -e '^==PROF== Profiling' -e '^\$ ' "$log" | tail -n 12 | sed 's/^/    /'
    if [[ -s $tdir/summary.err ]]; then sed 's/^/    /' "$tdir/summary.err"; fi
    failed+=("$name: $why")
    status=1
  fi
  for f in "$tdir/import.err" "$tdir/summary.err" "$tdir/source.err"; do
    [[ -s $f ]] || rm -f "$f"
  done
done
echo "gpu_profile.sh: ${#selected[@]} target(s) in $((SECONDS - start_all))s"
echo
if [[ ${#inputs[@]} -gt 0 ]]; then
  python3 "$summary_py" --csv "$out/summary.csv" --txt "$out/summary.txt" "${inputs[@]}" ||
    status=1
  echo
  echo "summary: $out/summary.txt, $out/summary.csv (raw: $out/<target>/raw.csv)"
fi
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "FAILED targets (see their ncu.log):"
  printf '  %s\n' "${failed[@]}"
fi
exit "$status"
