#!/usr/bin/env bash
# The test suite: builds, then runs every ctest except the fuzz smoke test, the multi-GPU tests and
# the compute-sanitizer runs (label sanitize); GPU tests skip with a reason where there is no GPU.
# rapidcheck's seed is pinned at configure time (MOE_RC_SEED) and printed here; for a random seed:
# MOE_CMAKE_ARGS=-DMOE_RC_SEED=$RANDOM.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
build=${MOE_BUILD_DIR:-build}
grep -E '^MOE_RC_(SEED|CASES)' "$build/CMakeCache.txt" | sed 's/^/rapidcheck: /'
ctest --test-dir "$build" -LE 'fuzz|multi_gpu|sanitize' -j "$(nproc)" --output-on-failure --timeout 900 "$@"
