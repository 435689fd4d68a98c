#!/usr/bin/env bash
# Installs the Debian packages moe-harness builds against when they are missing (as root), or
# names them and exits 1 otherwise. Sourced by scripts/check.sh and scripts/test.sh.
set -euo pipefail
moe_pkgs=(cmake ninja-build g++ libeigen3-dev librapidcheck-dev nlohmann-json3-dev libgtest-dev
          libgmock-dev libcli11-dev libbenchmark-dev libdlpack-dev python3 python3-pip)
missing=()
for p in "${moe_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then
    echo "moe-harness: installing ${missing[*]}" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "moe-harness: missing Debian packages: ${missing[*]}" >&2
    echo "  run as root, or: sudo apt-get install ${missing[*]}" >&2
    exit 1
  fi
fi
