#!/usr/bin/env bash
# TransformerEngine conformance (issue 18): TE's shipped MoE kernels through every check the
# harness has, on the GPU machine, and docs/te-conformance.md regenerated from the results.
#
#   scripts/te_conformance.sh [--te DIR] [--cases N] [--seed S] [--out DIR] [--build DIR]
#                             [--no-bench] [--no-python] [--no-build] [--jobs N]
#
#   router family   integrations/te/te_router_plugin.cpp (TE's C API, libtransformer_engine.so)
#                   through `moe-harness check --plugin`: every named case and N random cases of
#                   topk_router, aux_loss_scores and moe_aux_loss, forward and backward, under
#                   --ties canonical and --ties te
#   permutation     integrations/te/te_permutation_check.py (TE's Triton kernels through the
#                   moe_harness Python package and torch): every named and N random cases
#   speed           `moe-harness bench --impl te`: TE's router kernels next to ours, GB/s and % of
#                   the copy bandwidth measured in the same run; the permutation runner times
#                   TE's Triton kernels the same way
#   report          scripts/te_report.py: per op passed / failed / unsupported, one finding per
#                   distinct departure (integrations/te/findings.json classifies them), written
#                   to docs/te-conformance.md and DIR/te-conformance.json
#
# Needs: DIR (default .te) from ../shared/gpu-deps/te/fetch_te.sh; the Debian build deps
# (CMAKE_PREFIX_PATH, or .deps from scripts/fetch_gpu_deps.sh); for the permutation part
# python3 with torch and triton, and .whl (scripts/python_gpu_check.sh --prepare).
# Exit: 0 the run completed (failures are findings, in the report), 1 a part could not run,
# 2 usage or setup error.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
root=$PWD
te=.te cases=20 seed=1 out=${OUT:-build-te/conformance} build=${MOE_BUILD_DIR:-build-te}
bench=1 python=1 do_build=1 jobs=8
while [[ $# -gt 0 ]]; do
  case $1 in
    --te) te=$2; shift 2 ;;
    --cases) cases=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --no-bench) bench=0; shift ;;
    --no-python) python=0; shift ;;
    --no-build) do_build=0; shift ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "te_conformance: unknown argument $1 (--help)" >&2; exit 2 ;;
  esac
done
[[ -f $te/include/transformer_engine/fused_router.h ]] ||
  { echo "te_conformance: --te $te: no TE headers (run ../shared/gpu-deps/te/fetch_te.sh $te)" >&2; exit 2; }
te=$(cd "$te" && pwd)
mkdir -p "$out" && out=$(cd "$out" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
log() { echo "[te $SECONDS s] $*"; }
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$out/gpu.txt" 2>&1 ||
  { echo "te_conformance: no GPU (nvidia-smi)" >&2; exit 2; }
cat "$te/TE_VERSION" "$out/gpu.txt" 2>/dev/null
# The Python package builds (CPU-only C++) while the harness and the plugin build.
py_install=""
if [[ $python -eq 1 ]]; then
  bash scripts/python_gpu_check.sh --install-only >"$out/python-install.log" 2>&1 &
  py_install=$!
fi
if [[ $do_build -eq 1 ]]; then
  prefix=${CMAKE_PREFIX_PATH:-}
  [[ -z $prefix && -d .deps/debs ]] && prefix=$(bash .deps/unpack.sh .deps)
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_BUILD_TESTS=ON \
    -DMOE_TE_ROOT="$te" ${prefix:+-DCMAKE_PREFIX_PATH=$prefix} >"$out/configure.log" 2>&1 ||
    { tail -20 "$out/configure.log"; exit 2; }
  cmake --build "$build" -j "$(nproc)" --target moe-harness moe_te_plugin >"$out/build.log" 2>&1 ||
    { grep -B2 -A10 -m3 error "$out/build.log"; exit 2; }
  log "built"
fi
harness=$build/moe-harness
plugin=$build/libmoe_te_plugin.so
[[ -x $harness && -f $plugin ]] || { echo "te_conformance: $harness or $plugin missing" >&2; exit 2; }
LD_LIBRARY_PATH=$(bash "$te/unpack_te.sh" "$te") || exit 2
export LD_LIBRARY_PATH MOE_TE_LIB=$te/lib/libtransformer_engine.so

# ---- router family through the C API --------------------------------------------------------
for ties in canonical te; do
  "$harness" check --plugin "$plugin" --impl te --op topk_router --op aux_loss_scores \
    --op moe_aux_loss --cases "$cases" --seed "$seed" --ties "$ties" -j "$jobs" \
    --json "$out/router-$ties.json" >"$out/router-$ties.log" 2>&1
  rc=$?
  [[ $rc -le 1 ]] || { status=1; tail -5 "$out/router-$ties.log"; }
  log "router family, --ties $ties: exit $rc"
  sed -n '/^op /,/^$/p' "$out/router-$ties.log"
done
if [[ $bench -eq 1 ]]; then
  # --ties te: bench verifies TE first; its exact ties follow TE's rule, not the canonical one.
  "$harness" bench --impl te --plugin "$plugin" --ties te --op topk_router --op aux_loss_scores \
    --op moe_aux_loss --json "$out/bench.json" >"$out/bench.log" 2>&1 || status=1
  log "bench --impl te"
  grep -E "^(op|topk_router|aux_loss_scores|moe_aux_loss) " "$out/bench.log"
fi

# ---- permutation family through the Python package (TE's Triton kernels) ----------------------
if [[ $python -eq 1 ]]; then
  if wait "$py_install"; then
    export PYTHONPATH=$root/build-py/gpu-site${PYTHONPATH:+:$PYTHONPATH}
    # Failing random cases are reported as drawn (--no-shrink): TE's unwritten rows fail many of
    # them, and shrinking each would take minutes of autotuned Triton launches.
    MOE_TE_PYTHON=$te/python PYTHONUNBUFFERED=1 python3 integrations/te/te_permutation_check.py \
      --cases "$cases" --seed "$seed" --device cuda --no-shrink --json "$out/permutation.json" \
      >"$out/permutation.log" 2>&1 || status=1
    log "permutation family: $(tail -1 "$out/permutation.log")"
  else
    status=1
    tail -5 "$out/python-install.log"
  fi
fi

# ---- the report ---------------------------------------------------------------------------------
python3 scripts/te_report.py --results "$out" --findings integrations/te/findings.json \
  --md docs/te-conformance.md --json "$out/te-conformance.json" || status=1
cp docs/te-conformance.md "$out/" 2>/dev/null
log "done (status $status)"
exit $status
