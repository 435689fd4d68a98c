#!/usr/bin/env bash
# The main job: builds if needed, then runs `moe-harness check` with the given arguments
# (default backend: gpu when a GPU is present, else the reference's self-checks).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh >&2
exec "${MOE_BUILD_DIR:-build}/moe-harness" check "$@"
