#!/usr/bin/env bash
# compute-sanitizer memcheck (with leak check), racecheck and initcheck over the GPU tests of the
# permutation and EP twins: tests/gpu/test_dispatch_gpu.cpp and the registry suite's cases of
# those ten ops (tests/gpu/test_registry_gpu.cpp). Exits nonzero when any tool reports an error or
# a test fails under it.
#
#   scripts/gpu_sanitize_dispatch.sh [BUILD_DIR] [LOG_DIR]
#
# BUILD_DIR defaults to build-gpu (it must hold moe_gpu_tests). Logs go to LOG_DIR (default
# BUILD_DIR/sanitize). The >2^31-element test is left out (tens of GiB of shadow memory), and
# rapidcheck runs a few cases per property: the sanitizers check every kernel and launch path,
# not the sample size. SANITIZE_FILTER and SANITIZE_RC_PARAMS override the defaults.
set -uo pipefail

build=${1:-build-gpu}
logs=${2:-$build/sanitize}
bin="$build/moe_gpu_tests"
if [[ ! -x "$bin" ]]; then
  echo "gpu_sanitize_dispatch: $bin not found (build the moe_gpu_tests target first)" >&2
  exit 2
fi
sanitizer=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
if [[ ! -x "$sanitizer" ]]; then
  echo "gpu_sanitize_dispatch: compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2
  exit 2
fi
ops="token_dispatch token_combine sort_chunks_by_index routing_map_to_selected_experts
argsort_token_dispatch argsort_token_combine ragged_a2a_params ragged_all_to_all
local_permute_after_a2a local_unpermute_before_a2a"
default="DispatchGpuEp.*:DispatchGpuRegression.*:DispatchGpuErrors.*:DispatchGpuDeterminism.*"
for op in $ops; do default+=":AllGpuOps/RegistryGpu.*/$op"; done
filter=${SANITIZE_FILTER:-$default}
export RC_PARAMS=${SANITIZE_RC_PARAMS:-"seed=20261122 max_success=6 max_size=12"}
# Plain cudaMalloc/cudaFree (gpu/runtime.cu): initcheck and the leak check see every buffer.
export MOE_GPU_NO_CACHE=1
mkdir -p "$logs"

status=0
for tool in memcheck racecheck initcheck; do
  args=(--tool "$tool" --error-exitcode 86 --print-limit 20)
  [[ $tool == memcheck ]] && args+=(--leak-check full)
  log="$logs/$tool.log"
  start=$(date +%s)
  "$sanitizer" "${args[@]}" "$bin" --gtest_filter="$filter" >"$log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1)
  tests=$(grep -E "^\[  (PASSED|FAILED)  \]" "$log" | tr '\n' ' ')
  echo "$tool: exit $rc, $(($(date +%s) - start)) s, ${summary:-no summary}; $tests"
  if [[ $rc -ne 0 ]]; then
    status=1
    grep -E "^=========" "$log" | head -40
    grep -E "^\[  FAILED  \]" "$log" | head -20
  fi
done
exit $status
