#!/usr/bin/env bash
# Runs, under `moe-harness launch` with one rank per GPU: the multi-GPU NCCL suite
# (moe_multi_gpu_tests), `moe-harness check --backend gpu --ep N` (moe_block over NCCL) and the
# ragged all-to-all benchmark (`moe-harness bench --op ragged_all_to_all`), and keeps the logs
# (plus the benchmark rows as JSON).
#
#   scripts/multi_gpu.sh [NRANKS]        default: every visible GPU
#
# Environment: MOE_BUILD_DIR (default build; moe-harness and moe_multi_gpu_tests are built there
# when missing), MOE_LOG_DIR (default $MOE_BUILD_DIR/multi_gpu_logs), MOE_BENCH_ARGS (extra
# benchmark flags, e.g. "--max-tokens 1024 --iters 10"), MOE_TIMEOUT (seconds per launch, 600).
# MOE_CHECK_CASES: random cases of `check --ep` (default 10).
# Exit status: 0 when all three pass, 1 otherwise, 77 when fewer than 2 GPUs are visible.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${MOE_BUILD_DIR:-build}
logs=${MOE_LOG_DIR:-$build/multi_gpu_logs}
timeout=${MOE_TIMEOUT:-600}
# Multicast objects are never created on these machines (the launcher sets these for the ranks
# too).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
n=${1:-$gpus}
if [ "${n:-0}" -lt 2 ] || [ "$gpus" -lt "$n" ]; then
  echo "multi_gpu.sh: SKIPPED, needs 2 or more GPUs for $n ranks, $gpus visible"
  exit 77
fi
if [ ! -x "$build/moe-harness" ] || [ ! -x "$build/moe_multi_gpu_tests" ]; then
  cmake --build "$build" --target moe-harness moe_multi_gpu_tests || exit 1
fi
mkdir -p "$logs"
echo "multi_gpu.sh: $n ranks; logs in $logs"
nvidia-smi -L | tee "$logs/gpus.txt"

"$build/moe-harness" launch -n "$n" --timeout "$timeout" -- "$build/moe_multi_gpu_tests" \
  2>&1 | tee "$logs/tests.log"
tests_rc=${PIPESTATUS[0]}

"$build/moe-harness" launch -n "$n" --timeout "$timeout" -- "$build/moe-harness" check \
  --backend gpu --ep "$n" --cases "${MOE_CHECK_CASES:-10}" 2>&1 | tee "$logs/check.log"
check_rc=${PIPESTATUS[0]}

# shellcheck disable=SC2086  # MOE_BENCH_ARGS is a list of flags
"$build/moe-harness" launch -n "$n" --timeout "$timeout" -- "$build/moe-harness" bench \
  --op ragged_all_to_all --json "$logs/bench.json" ${MOE_BENCH_ARGS:-} 2>&1 | tee "$logs/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "multi_gpu.sh: tests exit $tests_rc, check exit $check_rc, bench exit $bench_rc (logs in $logs)"
[ "$tests_rc" -eq 0 ] && [ "$check_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
