#!/usr/bin/env bash
# The GPU machine's gate, in one call: build (with the carried Debian packages in .deps when
# present), `check --impl moe-gpu` over every op, golden verify through moe-gpu, the ctest suite
# (cpu + gpu labels), and optionally the sanitize label. Logs and JSON/JUnit reports go to
# LOG_DIR (default: $OUT when set, else build-gpu/gate).
#
#   scripts/gpu_gate.sh [--sanitize REGEX] [--cases N] [LOG_DIR]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
sanitize="" cases=20
while [[ $# -gt 0 ]]; do
  case $1 in
    --sanitize) sanitize=$2; shift 2 ;;
    --cases) cases=$2; shift 2 ;;
    *) break ;;
  esac
done
logs=${1:-${OUT:-build-gpu/gate}}
build=${MOE_BUILD_DIR:-/tmp/moe-build-gpu}
mkdir -p "$logs"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source scripts/gpu_deps.sh
moe_unpack_deps || { echo "gpu_gate: unpacking .deps failed"; exit 2; }
prefix=$moe_prefix
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$logs/gpu.txt"
t0=$SECONDS
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release ${prefix:+-DCMAKE_PREFIX_PATH=$prefix} \
  >"$logs/configure.log" 2>&1 || { tail -30 "$logs/configure.log"; exit 2; }
cmake --build "$build" -j "$(nproc)" >"$logs/build.log" 2>&1 || { grep -B2 -A12 -m3 error "$logs/build.log"; exit 2; }
echo "build: $((SECONDS - t0)) s"
status=0
# check and golden first, the gate's core: the ctest suite takes minutes and may run into the
# device call's limit (session 8's did), and then only the tests it reached are in its log.
t0=$SECONDS
"$build/moe-harness" check --impl moe-gpu --cases "$cases" -j 8 --json "$logs/check_gpu.json" \
  --junit "$logs/check_gpu.xml" >"$logs/check_gpu.log" 2>&1 || status=1
sed -n '/^op /,/^$/p' "$logs/check_gpu.log"; tail -3 "$logs/check_gpu.log"
echo "check: $((SECONDS - t0)) s"
"$build/moe-harness" golden verify --impl moe-gpu golden/data >"$logs/golden_gpu.log" 2>&1 || status=1
tail -1 "$logs/golden_gpu.log"
t0=$SECONDS
ctest --test-dir "$build" -LE 'fuzz|multi_gpu|sanitize' -j 8 --timeout 900 --output-on-failure \
  >"$logs/ctest.log" 2>&1 || status=1
grep -E "tests passed|tests failed|Failed|\*\*\*" "$logs/ctest.log" | tail -25
echo "ctest: $((SECONDS - t0)) s"
if [[ -n $sanitize ]]; then
  t0=$SECONDS
  ctest --test-dir "$build" -L sanitize -R "$sanitize" --timeout 900 --output-on-failure \
    >"$logs/sanitize.log" 2>&1 || status=1
  grep -E "tests passed|tests failed|Failed|Passed|Skipped" "$logs/sanitize.log" | tail -20
  echo "sanitize: $((SECONDS - t0)) s"
fi
exit $status
