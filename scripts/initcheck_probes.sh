#!/usr/bin/env bash
# Which stores compute-sanitizer's initcheck does not see on this machine. Compiles the probes of
# docs/experiments (bulk copies, TMA tensor stores, cuBLAS with and without NVTX marks) and runs
# each case under initcheck: one line per case with its report count and whether the probe's own
# result was right. scripts/gpu_sanitize.sh's initcheck knobs (MOE_DISPATCH_ROWS=lsu,
# MOE_GATHER_SUM=lsu, MOE_CUBLAS_PREFILL=zero, MOE_SM90_ROW_STORE=sync, MOE_SM90_WGRAD_STORE=sync)
# stand in for the blind spots found; rerun this after a CUDA or driver upgrade to see whether
# they still must.
#
#   scripts/initcheck_probes.sh [--skip-code N] [OUT_DIR]     (OUT_DIR default: a temp dir)
#
# Exits 1 when a control (ordinary stores) draws a report or a probe's result is wrong, else 0:
# a blind spot is a finding, not a failure. Without a GPU, nvcc or compute-sanitizer: 2, or the
# --skip-code.
set -uo pipefail

skip_code=2
out=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --skip-code) skip_code=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) out=$1; shift ;;
  esac
done
root=$(cd "$(dirname "$0")/.." && pwd)
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
sanitizer=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
for tool in "$nvcc" "$sanitizer"; do
  if [[ ! -x "$tool" ]]; then
    echo "initcheck_probes: SKIPPED, $(basename "$tool") not found" >&2
    exit "$skip_code"
  fi
done
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  echo "initcheck_probes: SKIPPED, no CUDA GPU visible (nvidia-smi -L lists none)" >&2
  exit "$skip_code"
fi
[[ -z $out ]] && out=$(mktemp -d)
mkdir -p "$out"

ex="$root/docs/experiments"
build() {  # build NAME SOURCE [LIBS...]
  local name=$1 src=$2
  shift 2
  if ! "$nvcc" -O2 -arch=sm_90a "$ex/$src" -o "$out/$name" "$@" >"$out/$name.build.txt" 2>&1; then
    echo "initcheck_probes: $src did not compile (an sm_90 toolchain is needed):" >&2
    tail -5 "$out/$name.build.txt" >&2
    exit 1
  fi
}
build bulk bulk-initcheck-probe.cu
build tma tma-store-initcheck-probe.cu
build cublas cublas-initcheck-probe.cu -lcublas -ldl

status=0
# probe NAME CASE CONTROL: one line; a control must draw no report.
probe() {
  local name=$1 case=$2 control=$3 log="$out/$1-${2:-all}.log"
  "$sanitizer" --tool initcheck --print-limit 1 "$out/$name" $case >"$log" 2>&1
  local rc=$?
  local n
  # The first summary line counts every report; a second one counts those not printed.
  n=$(grep -m1 -oE "ERROR SUMMARY: [0-9]+ error" "$log" | grep -oE "[0-9]+")
  local verdict="result right"
  [[ $rc -ne 0 ]] && verdict="RESULT WRONG (exit $rc)" && status=1
  if [[ -z $n ]]; then
    verdict="no initcheck summary (see $log)"
    status=1
  elif [[ $control == control && $n -ne 0 ]]; then
    verdict+=", CONTROL REPORTED"
    status=1
  fi
  printf '%-8s %-26s %9s reports  %s\n' "$name" "${case:-(bulk and plain buffers)}" "${n:-?}" "$verdict"
}
probe bulk "" finding
probe tma plain control
probe tma tma finding
probe cublas plain control
for c in gemm batched gemm_marked batched_marked gemm_marked_stream gemm_marked_async \
         gemm_marked_stream_async; do
  probe cublas "$c" finding
done
echo "initcheck_probes: logs in $out"
exit $status
