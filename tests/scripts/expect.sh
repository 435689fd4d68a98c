# shellcheck shell=bash disable=SC2154,SC2034  # under_test, fail: the sourcing test's
# Sourced by the script tests (gpu_ab_usage.sh, gpu_detach.sh). expect RC PATTERN ARGS... runs
# `bash $under_test ARGS` (in $expect_dir when set, with OUT empty) and sets fail=1, printing the
# first lines of its output, unless it exits RC and PATTERN (grep -E) matches a line of its
# stdout + stderr.
fail=0
expect() {
  local want=$1 pattern=$2
  shift 2
  local got rc
  got=$(cd "${expect_dir:-.}" && OUT='' bash "$under_test" "$@" 2>&1)
  rc=$?
  if [[ $rc -ne $want ]] || ! grep -qE -- "$pattern" <<<"$got"; then
    echo "FAIL: $(basename "$under_test") $*: rc $rc (want $want), output:"
    echo "$got" | head -8
    fail=1
  fi
}
