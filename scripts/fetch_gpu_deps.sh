#!/usr/bin/env bash
# Run here, before a device call: the Debian packages the GPU machine builds against, into .deps
# (git-ignored; carry it, and scripts/gpu_deps.sh unpacks it there). ../shared/gpu-deps/fetch.sh
# brings all but libdlpack-dev, which CMake needs (cmake/moe_find_dlpack.cmake); without it the
# first configure on the GPU fails (session 31 lost a device call to that).
#
#   scripts/fetch_gpu_deps.sh [SHARED_GPU_DEPS_DIR]     # default ../shared/gpu-deps
set -euo pipefail
cd "$(dirname "$0")/.."
shared=${1:-../shared/gpu-deps}
if [[ ! -f $shared/fetch.sh ]]; then
  echo "fetch_gpu_deps.sh: no fetch.sh in '$shared'" >&2
  exit 2
fi
bash "$shared/fetch.sh" .deps
(cd .deps/debs && apt-get download libdlpack-dev >/dev/null)
ls .deps/debs/libdlpack-dev_*.deb >/dev/null
echo "fetch_gpu_deps.sh: $(find .deps/debs -name "*.deb" | wc -l) packages in .deps/debs"
