#!/bin/sh
# ctest te_router_conformance (cmake/te.cmake). Usage:
#   test_te_plugin.sh run MOE_HARNESS PLUGIN TE_LIB   `moe-harness check` over TE's router-family
#       kernels through the plugin (exit 77 when there is no GPU or no TE library file; TE_LIB is
#       overridden by $MOE_TE_LIB)
#   test_te_plugin.sh skip REASON                     prints "skipped: REASON" and exits 77
set -u
mode=${1:-}
case $mode in
skip)
  shift
  echo "skipped: $*"
  exit 77
  ;;
run)
  [ $# -eq 4 ] || { echo "usage: $0 run MOE_HARNESS PLUGIN TE_LIB"; exit 2; }
  ;;
*)
  echo "usage: $0 run MOE_HARNESS PLUGIN TE_LIB | skip REASON"
  exit 2
  ;;
esac
bin=$2 so=$3 lib=${MOE_TE_LIB:-$4}
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  echo "skipped: no GPU (nvidia-smi -L lists none)"
  exit 77
fi
if [ ! -f "$lib" ]; then
  echo "skipped: no TransformerEngine library at $lib (unpack it with .te/unpack_te.sh .te, or set MOE_TE_LIB)"
  exit 77
fi
export MOE_TE_LIB="$lib"
echo "TransformerEngine library: $MOE_TE_LIB"
exec "$bin" check --plugin "$so" --op topk_router --op aux_loss_scores --op moe_aux_loss \
  --cases 20 --ties te
