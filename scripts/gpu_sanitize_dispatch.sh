#!/usr/bin/env bash
# compute-sanitizer memcheck (with leak check), racecheck, initcheck and synccheck over the GPU
# tests of the permutation and EP twins: tests/gpu/test_dispatch_gpu.cpp and the registry suite's
# cases of those ten ops. Kept for its callers; it is `scripts/gpu_sanitize.sh --family dispatch`
# (see there for what runs and the SANITIZE_* overrides).
#
#   scripts/gpu_sanitize_dispatch.sh [BUILD_DIR] [LOG_DIR]
#
# BUILD_DIR defaults to build-gpu (it must hold moe_gpu_tests). Logs go to LOG_DIR (default
# BUILD_DIR/sanitize).
build=${1:-build-gpu}
exec bash "$(dirname "$0")/gpu_sanitize.sh" --family dispatch "$build" "${2:-$build/sanitize}"
