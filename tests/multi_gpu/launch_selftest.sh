#!/bin/sh
# The contract of `moe-harness launch` (tools/launch_cmd.cpp) with shell ranks, no GPU needed:
# environment, "[rank r]" prefixes, exit codes, and teardown without a hang when a rank fails,
# dies from a signal, cannot be executed, or the timeout passes.
# Usage: launch_selftest.sh path/to/moe-harness
set -u
exe=${1:?usage: launch_selftest.sh path/to/moe-harness}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0

if ! "$exe" launch --help >/dev/null 2>&1; then
  echo "FAIL: '$exe launch' is not a subcommand (tools/cli.cpp must call add_launch_command)"
  exit 1
fi

# expect NAME WANT_RC MAX_SECONDS PATTERN... -- ARGS: runs launch ARGS, checks the exit status,
# the wall time and that every PATTERN (grep -E) occurs in the combined output.
expect() {
  name=$1 want=$2 max_s=$3
  shift 3
  pats=""
  while [ "$1" != "--" ]; do
    pats="$pats
$1"
    shift
  done
  shift
  start=$(date +%s)
  "$exe" launch "$@" >"$tmp/out" 2>&1
  rc=$?
  took=$(($(date +%s) - start))
  ok=1
  [ "$rc" = "$want" ] || { echo "FAIL $name: exit status $rc, want $want"; ok=0; }
  [ "$took" -le "$max_s" ] || { echo "FAIL $name: took ${took}s, limit ${max_s}s"; ok=0; }
  echo "$pats" | while IFS= read -r p; do
    [ -z "$p" ] && continue
    grep -Eq -- "$p" "$tmp/out" || { echo "FAIL $name: no line matching '$p'"; echo x >>"$tmp/bad"; }
  done
  [ -f "$tmp/bad" ] && { ok=0; rm -f "$tmp/bad"; }
  if [ $ok = 1 ]; then
    echo "PASS $name (${took}s)"
  else
    fails=$((fails + 1))
    sed 's/^/    | /' "$tmp/out"
  fi
}

expect env 0 10 \
  '^\[rank 0\] r=0 w=3 l=0 nvls=0 mc=1 shm=1 id=/.+$' \
  '^\[rank 2\] r=2 w=3 l=2 nvls=0 mc=1 shm=1 id=/.+$' \
  '^\[rank 1\] to stderr$' '^\[rank 1\] no newline at the end$' -- \
  -n 3 -- sh -c 'echo "r=$MOE_RANK w=$MOE_WORLD_SIZE l=$MOE_LOCAL_RANK nvls=$NCCL_NVLS_ENABLE mc=$TORCH_SYMM_MEM_DISABLE_MULTICAST shm=$NVSHMEM_DISABLE_NVLS id=$MOE_NCCL_ID_FILE"; echo "to stderr" >&2; printf "no newline at the end"'

expect rank_fails_others_killed 1 10 \
  'rank 1 .*failed with exit status 3' 'FAILED: rank 1 ' 'rank 0: signal 15' -- \
  -n 2 --grace 2 -- sh -c 'if [ "$MOE_RANK" = 1 ]; then sleep 0.2; exit 3; fi; exec sleep 100'

expect rank_signal 1 10 'rank 0 .*failed with signal 11' -- \
  -n 2 --grace 2 -- sh -c 'if [ "$MOE_RANK" = 0 ]; then kill -SEGV $$; fi; exec sleep 100'

expect timeout_then_sigkill 1 10 'timeout after 1 s' 'rank 0: signal 9' -- \
  -n 2 --timeout 1 --grace 1 -- sh -c 'trap "" TERM; while :; do sleep 1; done'

expect not_executable 1 10 "cannot execute 'moe-no-such-command'" 'exit status 127' -- \
  -n 2 -- moe-no-such-command

expect multi_node_offsets 0 10 '^\[rank 5\] 5 8 1$' -- \
  -n 2 --rank-offset 4 --world-size 8 --id-file "$tmp/id" -- \
  sh -c 'echo "$MOE_RANK $MOE_WORLD_SIZE $MOE_LOCAL_RANK"'

expect bad_offsets 2 10 'exceeds --world-size' -- -n 2 --rank-offset 1 --world-size 2 \
  --id-file "$tmp/id" -- true

if [ $fails -ne 0 ]; then
  echo "$fails launcher check(s) failed"
  exit 1
fi
echo "all launcher checks passed"
