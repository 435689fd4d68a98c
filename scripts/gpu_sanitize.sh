#!/usr/bin/env bash
# compute-sanitizer memcheck (with leak check), racecheck, initcheck and synccheck over the GPU
# tests of one family of GPU ops (or all of them). Exits nonzero when a tool reports any error or
# a test fails under it.
#
#   scripts/gpu_sanitize.sh [--family F] [--tools T1,T2] [--skip-code N] [BUILD_DIR] [LOG_DIR]
#
# Families and what runs (tests/gpu/*; RegistryGpu/<op> is the registry suite's random and named
# cases of that op):
#   router    GpuRouterWide, GpuRouterRegression, GpuRouterErrors, GpuRouterLimits.TooManyExperts,
#             RegistryGpu/{topk_router, aux_loss_scores, moe_aux_loss}            (the default)
#   dispatch  DispatchGpu{Ep,Regression,Errors,Determinism}, RegistryGpu/ of the ten permutation
#             and EP ops
#   gemm      GroupedGemmGpu, the GemmGpu tail-row cases, ChunkedGemmGpu small chunks, the sm90
#             random shapes, pairings (folded tails) and wgrad kernel, GemmGpuErrors,
#             RegistryGpu/{grouped_gemm, swiglu_expert_ffn}
#   block     MoeBlockGpuRegression, InProcessCommunicatorGpu, MoeBlockGpu.GateGradients*,
#             RegistryGpu/moe_block random cases
#   all       every family above, one after another
# Tools default to all four. Left out everywhere: the >2^31-element tests (tens of GiB of shadow
# memory), the 100k-row aux-loss test, the benchmarks and the fill-the-GPU determinism suite
# (GpuDeterminism: the sanitizers check every kernel and launch path, not sizes; rapidcheck runs
# a few small cases per property). SANITIZE_FILTER and SANITIZE_RC_PARAMS override the filter and
# rapidcheck's parameters; SANITIZE_PRINT_LIMIT the reports printed in full (20; the summary line
# counts all). On a failure it lists where the printed reports point, by kernel, counted.
#
# BUILD_DIR defaults to build-gpu (it must hold moe_gpu_tests); logs go to LOG_DIR (default
# BUILD_DIR/sanitize-FAMILY). Without a GPU or compute-sanitizer it exits 2, or the --skip-code
# (the ctests of cmake/sanitize.cmake pass 77, their SKIP_RETURN_CODE).
set -uo pipefail

family=router
tools=memcheck,racecheck,initcheck,synccheck
skip_code=2
pos=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --family) family=$2; shift 2 ;;
    --tools) tools=$2; shift 2 ;;
    --skip-code) skip_code=$2; shift 2 ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    *) pos+=("$1"); shift ;;
  esac
done
build=${pos[0]:-build-gpu}
logs=${pos[1]:-$build/sanitize-$family}

if [[ $family == all ]]; then
  status=0
  for f in router dispatch gemm block; do
    echo "== $f"
    "$0" --family "$f" --tools "$tools" --skip-code "$skip_code" "$build" "$logs/$f"
    rc=$?
    [[ $rc -ne 0 ]] && status=$rc
  done
  exit $status
fi

router_ops="topk_router aux_loss_scores moe_aux_loss"
dispatch_ops="token_dispatch token_combine sort_chunks_by_index routing_map_to_selected_experts
argsort_token_dispatch argsort_token_combine ragged_a2a_params ragged_all_to_all
local_permute_after_a2a local_unpermute_before_a2a"
registry() {  # the registry suite's cases of the named ops
  local f="" op
  for op in $2; do f+=":AllGpuOps/RegistryGpu.$1/$op"; done
  echo "$f"
}
case $family in
  router)
    default="GpuRouterWide.*:GpuRouterRegression.*:GpuRouterErrors.*:GpuRouterLimits.TooManyExperts*"
    default+=$(registry '*' "$router_ops")
    rc_params="seed=20261122 max_success=8 max_size=16" ;;
  dispatch)
    default="DispatchGpuEp.*:DispatchGpuRegression.*:DispatchGpuErrors.*:DispatchGpuDeterminism.*"
    default+=$(registry '*' "$dispatch_ops")
    rc_params="seed=20261122 max_success=6 max_size=12" ;;
  gemm)
    default="GroupedGemmGpu.*:*/GemmGpu.TailRowsAndEmptyGroupsAreExactlyZero/*"
    default+=":ChunkedGemmGpu.SmallChunksMatchTheReference"
    default+=":Sm90GemmGpu.RandomShapesRunOnTheKernelAndMatchTheReference:GemmGpuErrors.*"
    default+=":Sm90GemmGpu.WgradMatchesTheFp64SumsEverywhere"
    # the panel wgrad kernel: a_g's slots reused across runs (its own ring of barriers)
    default+=":Sm90GemmGpu.WgradPanelMatchesTheFp64SumsAndTheStreamingKernel"
    default+=":Sm90GemmGpu.EveryPairingMatchesTheFp64SumsEverywhere"
    # the row kernel's TMA-store epilogue, at once and deferred (async-proxy stores, staging reuse)
    default+=":Sm90GemmGpu.RowTmaEpilogueMatchesTheWarpStoresBitwise"
    # split: the sm90 kernel on a high-priority stream beside cuBLAS, joined by an event.
    default+=":Sm90GemmGpu.SplitMatchesTheFp64SumsEverywhere"
    default+=$(registry '*' "grouped_gemm swiglu_expert_ffn")
    rc_params="seed=20261122 max_success=4 max_size=8" ;;
  block)
    # Racecheck covers moe_block's own kernels (per-expert column counts, casts, ordered sums)
    # only through runs of the whole block, so small cases: the registry's random ones.
    default="MoeBlockGpuRegression.*:InProcessCommunicatorGpu.*"
    # The gate gradients' tensor-core path (moe_gate_grads: split_bf16x3_kernel,
    # repeat3_cols_kernel and the cuBLAS products between them).
    default+=":MoeBlockGpu.GateGradients*"
    default+=$(registry 'RandomCasesMatchReference' moe_block)
    rc_params="seed=20261122 max_success=4 max_size=8" ;;
  *)
    echo "gpu_sanitize: unknown family '$family' (router, dispatch, gemm, block, all)" >&2
    exit 2 ;;
esac

bin="$build/moe_gpu_tests"
if [[ ! -x "$bin" ]]; then
  echo "gpu_sanitize: $bin not found (build the moe_gpu_tests target first)" >&2
  exit 2
fi
sanitizer=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
if [[ ! -x "$sanitizer" ]]; then
  echo "gpu_sanitize: SKIPPED, compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2
  exit "$skip_code"
fi
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  echo "gpu_sanitize: SKIPPED, no CUDA GPU visible (nvidia-smi -L lists none)" >&2
  exit "$skip_code"
fi
filter=${SANITIZE_FILTER:-$default}
export RC_PARAMS=${SANITIZE_RC_PARAMS:-$rc_params}
# Plain cudaMalloc/cudaFree (gpu/runtime.cu's buffer cache off), so initcheck sees every fresh
# buffer and the leak check sees real frees.
export MOE_GPU_NO_CACHE=1
mkdir -p "$logs"

status=0
for tool in ${tools//,/ }; do
  args=(--tool "$tool" --error-exitcode 86 --print-limit "${SANITIZE_PRINT_LIMIT:-20}")
  [[ $tool == memcheck ]] && args+=(--leak-check full)
  # initcheck does not see global memory written by bulk copies (cp.async.bulk from shared memory:
  # docs/experiments/bulk-initcheck-probe.cu), so the rows the dispatch and combine forwards'
  # bulk kernels write read as uninitialized wherever a kernel or a copy reads them (the block
  # family: 2016 false reports, session 46). Under initcheck those two run their twins of
  # ordinary stores (same bits: DispatchGpuKnobs); the other tools check the bulk kernels.
  # Nor does it see cuBLAS's stores (docs/experiments/cublas-initcheck-probe.cu: one report per
  # element of C), so the fp32 accumulators and chunked's slabs would read as uninitialised (the
  # gemm family: 810,490 false reports, session 47): MOE_CUBLAS_PREFILL=zero zeroes exactly the
  # bytes each cuBLAS call overwrites just before it (same bits: GemmGpuKnobs).
  # Nor TMA tensor stores (docs/experiments/tma-store-initcheck-probe.cu: 4096 reports, session 48,
  # H200), so the sm90 kernels' TMA epilogues give way to their warps' stores (row products: same
  # bits, Sm90GemmGpu.RowTmaEpilogueMatchesTheWarpStoresBitwise; wgrad: against fp64 sums,
  # Sm90GemmGpu.WgradWritesTheEmptyGroupsZerosOnEveryKernel).
  knobs=()
  [[ $tool == initcheck ]] && knobs=(MOE_DISPATCH_ROWS=lsu MOE_GATHER_SUM=lsu MOE_CUBLAS_PREFILL=zero
    MOE_SM90_ROW_STORE=sync MOE_SM90_WGRAD_STORE=sync)
  log="$logs/$tool.log"
  start=$(date +%s)
  env "${knobs[@]}" "$sanitizer" "${args[@]}" "$bin" --gtest_filter="$filter" >"$log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | grep -v "not printed" | tail -1)
  tests=$(grep -E "^\[  (PASSED|FAILED)  \]" "$log" | tr '\n' ' ')
  echo "$family/$tool: exit $rc, $(($(date +%s) - start)) s, ${summary:-no summary}; ${tests:-no PASSED line}"
  # A run with no test at all (a filter that matches nothing) proves nothing.
  if [[ $rc -eq 0 ]] && ! grep -qE "^\[  PASSED  \] [1-9]" "$log"; then
    echo "$family/$tool: no test ran (filter: $filter)"
    rc=1
  fi
  if [[ $rc -ne 0 ]]; then
    status=1
    # A test binary that died (a signal, an abort) leaves its last test without an OK / FAILED
    # line: name it, so the next run can take that test alone.
    unfinished=$(awk '/^\[ RUN      \]/ { t = $4 } /^\[ +(OK|FAILED) +\]/ { if ($4 == t) t = "" }
                      END { print t }' "$log")
    [[ -n $unfinished ]] && echo "$family/$tool: the test binary ended during $unfinished"
    echo "$family/$tool: the printed reports by kernel:"
    grep -E "^=========     at " "$log" | sed -E 's/^=========     at //; s/\+0x[0-9a-f]+//' |
      sort | uniq -c | sort -rn | head -10
    grep -E "^=========" "$log" | head -40
    grep -E "^\[  FAILED  \]" "$log" | head -20
  fi
done
exit $status
