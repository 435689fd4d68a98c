# shellcheck shell=bash disable=SC2034  # moe_prefix is read by the sourcing script
# Sourced by the GPU machine's scripts (gpu_gate.sh, gpu_ab.sh): the carried Debian packages
# (.deps/debs, from scripts/fetch_gpu_deps.sh) unpack once per machine, outside the working tree:
# each call lays the tree anew, and a re-unpack gives their headers new mtimes, which rebuilds a
# kept build from scratch. moe_unpack_deps sets moe_prefix to their usr/ (MOE_DEPS_DIR, default
# /tmp/moe-deps), or to "" without .deps/debs; it returns 1 when unpacking fails.
moe_unpack_deps() {
  moe_prefix=""
  [[ -d .deps/debs ]] || return 0
  local deps=${MOE_DEPS_DIR:-/tmp/moe-deps}
  if [[ ! -d $deps/root/usr ]]; then
    { rm -rf "$deps" && mkdir -p "$deps" && cp -r .deps/debs .deps/unpack.sh "$deps/" &&
      bash "$deps/unpack.sh" "$deps" >/dev/null; } || return 1
  fi
  moe_prefix=$deps/root/usr
}
