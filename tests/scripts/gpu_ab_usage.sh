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
# --kit: sides are a kit's names (a directory, or packed as gpu_kit.sh packs it) with settings.
mkdir -p "$tmp/kit/var/zero" "$tmp/kit/var/bp" "$tmp/packed"
touch "$tmp/kit/targets"
cp -r "$tmp/kit" "$tmp/packed/gpu-kit"
tar cJf "$tmp/kit.txz" -C "$tmp/packed" gpu-kit
echo "no kit" >"$tmp/bad.txz"
expect 2 "--kit: no kit at '/nonexistent'" --kit /nonexistent
expect 2 "--kit: '$tmp/bad.txz' is not a packed kit" --kit "$tmp/bad.txz"
expect 2 "--kit: '$tmp' is not a kit" --kit "$tmp"
expect 2 "not --patch / --env-a / --env-b" --kit "$tmp/kit" --env-b A=1
expect 2 "--sides needs --kit" --sides base,zero --env-b A=1
expect 2 "--sides: no 'nope' in the kit \\(base,bp,zero\\)" --kit "$tmp/kit.txz" --sides base,nope
expect 2 "--sides: expected NAME:K=V, got 'bp:FAST'" --kit "$tmp/kit" --sides base,bp:FAST
expect 2 "--sides: 'bp' twice" --kit "$tmp/kit" --sides bp,base,bp
expect 2 "--sides: at least two, got 'base'" --kit "$tmp/kit" --sides base
expect 0 "round 1 side bp:MOE_SM90_WGRAD_BPANEL=off:B=2: MOE_SM90_WGRAD_BPANEL=off B=2 MOE_GEMM_BENCH=1 .*gpu-kit/bin/bp/moe_gpu_tests" \
  --kit "$tmp/kit.txz" --dry-run --rounds 1 --sides base,bp,bp:MOE_SM90_WGRAD_BPANEL=off:B=2
# Without --sides: base and every variant, in that order.
expect 0 "round 2 side zero: MOE_GEMM_BENCH=1 .*gpu-kit/bin/zero/moe_gpu_tests" --kit "$tmp/kit" \
  --dry-run --rounds 2
expect 0 "linked there: base bp zero" --kit "$tmp/kit.txz" --dry-run --rounds 1
exit $fail
