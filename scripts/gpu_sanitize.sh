#!/usr/bin/env bash
# compute-sanitizer memcheck (with leak check), racecheck and initcheck over the GPU tests of the
# router family: tests/gpu/test_router_gpu.cpp and the registry suite's cases of topk_router,
# aux_loss_scores and moe_aux_loss (tests/gpu/test_registry_gpu.cpp). Exits nonzero when a tool
# reports any error or a test fails under it.
#
#   scripts/gpu_sanitize.sh [BUILD_DIR] [LOG_DIR]
#
# BUILD_DIR defaults to build-gpu (it must hold moe_gpu_tests); logs go to LOG_DIR (default
# BUILD_DIR/sanitize-router). Left out: the T*E > 2^31 test (tens of GiB, and the shadow memory of
# memcheck on top) and the 100k-row aux-loss test; rapidcheck runs few cases per property, since
# the tools check every kernel and launch path rather than the sample size. SANITIZE_FILTER and
# SANITIZE_RC_PARAMS override the defaults.
set -uo pipefail

build=${1:-build-gpu}
logs=${2:-$build/sanitize-router}
bin="$build/moe_gpu_tests"
if [[ ! -x "$bin" ]]; then
  echo "gpu_sanitize: $bin not found (build the moe_gpu_tests target first)" >&2
  exit 2
fi
sanitizer=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
if [[ ! -x "$sanitizer" ]]; then
  echo "gpu_sanitize: compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2
  exit 2
fi
default="GpuRouterWide.*:GpuRouterRegression.*:GpuRouterErrors.*:GpuRouterLimits.TooManyExperts*"
for op in topk_router aux_loss_scores moe_aux_loss; do default+=":AllGpuOps/RegistryGpu.*/$op"; done
filter=${SANITIZE_FILTER:-$default}
export RC_PARAMS=${SANITIZE_RC_PARAMS:-"seed=20261122 max_success=8 max_size=16"}
# Plain cudaMalloc/cudaFree (gpu/runtime.cu's buffer cache off), so the leak check sees real frees.
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
  passed=$(grep -E "^\[  PASSED  \]" "$log" | tail -1)
  echo "$tool: exit $rc, $(($(date +%s) - start)) s, ${summary:-no summary}; ${passed:-no PASSED line}"
  if [[ $rc -ne 0 ]]; then
    status=1
    grep -E "^=========" "$log" | head -40
    grep -E "^\[  FAILED  \]" "$log" | head -20
  fi
done
exit $status
