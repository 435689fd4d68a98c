#!/usr/bin/env bash
# The main job: builds the moe-harness target if needed (not the tests), then runs `moe-harness
# check` with the given arguments (default backend: gpu when a GPU is present, else the
# reference's self-checks).
set -euo pipefail
cd "$(dirname "$0")/.."
MOE_BUILD_TARGETS=${MOE_BUILD_TARGETS:-moe-harness} bash scripts/build.sh >&2
exec "${MOE_BUILD_DIR:-build}/moe-harness" check "$@"
