#!/usr/bin/env bash
# scripts/gpu_ab.sh without a GPU: bad usage exits 2 naming the argument and its value, before
# anything is built; --dry-run lists the interleaved runs; a patch that does not apply is refused.
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
under_test=$here/scripts/gpu_ab.sh
source "$here/tests/scripts/expect.sh"
expect 2 "--rounds: expected 1..99, got '0'" --rounds 0 --env-b A=1
expect 2 "--timeout: expected seconds, got 'soon'" --timeout soon --env-b A=1
expect 2 "expected K=V, got 'RELEASE'" --env-b RELEASE
expect 2 "both are 'A=1'" --env-a A=1 --env-b A=1
expect 2 "unknown argument '--round'" --round 3
expect 2 "--cases needs a value" --cases
expect 2 "--patch: no readable file '/nonexistent.patch'" --patch /nonexistent.patch
expect 2 "--summary: no readable file" --summary /nonexistent.txt
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf -- '--- a/no/such/file.cu\n+++ b/no/such/file.cu\n@@ -1 +1 @@\n-x\n+y\n' >"$tmp/bad.patch"
expect 2 "does not apply to this tree" --patch "$tmp/bad.patch"
expect 0 "round 2 side a: MOE_SM90_RELEASE=late MOE_GEMM_BENCH=1 MOE_GEMM_BENCH_CASES=x MOE_GEMM_BENCH_IMPLS=sm90w .*ab_a/moe_gpu_tests" \
  --dry-run --rounds 2 --cases x --env-a MOE_SM90_RELEASE=late --env-b MOE_SM90_RELEASE=early
# A patch that applies (README's first line changed; --dry-run applies nothing): side b is its own
# binary.
mkdir -p "$tmp/a" "$tmp/b"
cp "$here/README.md" "$tmp/a/README.md"
sed '1s/$/ (changed)/' "$here/README.md" >"$tmp/b/README.md"
(cd "$tmp" && diff -u a/README.md b/README.md >"$tmp/good.patch")
expect 0 "round 1 side b: MOE_GEMM_BENCH=1 .*ab_b/moe_gpu_tests" --dry-run --rounds 1 \
  --patch "$tmp/good.patch"
cmp -s "$here/README.md" "$tmp/a/README.md" || { echo "FAIL: --dry-run changed README.md"; fail=1; }
exit $fail
