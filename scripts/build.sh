#!/usr/bin/env bash
# Configures and builds moe-harness into ${MOE_BUILD_DIR:-build} (CUDA backend when nvcc exists).
# MOE_BUILD_TARGETS: the targets to build (space-separated; default: all, the tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
build=${MOE_BUILD_DIR:-build}
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release ${MOE_CMAKE_ARGS:-} >/dev/null
targets=()
for t in ${MOE_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$build" -j "$(nproc)" "${targets[@]}"
