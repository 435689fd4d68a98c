#!/usr/bin/env bash
# `moe-harness bench-compare`'s exit codes and messages (ctest bench_compare_cli; no GPU):
# 0 for the same report, 1 for a row slower beyond --max-slowdown (and 0 with a wider one, or
# with a second baseline as slow; 1 by the fastest samples with --by min), 2 for an unreadable
# file, a file that is not a report (the field named), a bad option and an --impl filter that
# matches no row.
# Usage: bench_compare_cli.sh PATH/TO/moe-harness
set -u
bin=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
row() {  # name median min pct_copy
  printf '{"op":"token_combine","name":"%s","dir":"fwd","impl":"moe-gpu","kind":"memory",' "$1"
  printf '"case":"op=token_combine %s","verified":true,"median_us":%s,"min_us":%s,' "$1" "$2" "$3"
  printf '"bytes":2.1e9,"flops":0,"pct_copy":%s}' "$4"
}
printf '{"device":"H100","complete":true,"results":[%s,%s]}' "$(row a 800 795 90)" \
  "$(row b 800 795 90)" >"$dir/old.json"
printf '{"device":"H100","complete":true,"results":[%s,%s]}' "$(row a 900 890 80)" \
  "$(row b 800 795 90)" >"$dir/new.json"
printf '{"results":[{"op":1}]}' >"$dir/bad.json"
fail=0
expect() {  # rc pattern args...
  local want=$1 pattern=$2
  shift 2
  local got rc
  got=$("$bin" bench-compare "$@" 2>&1)
  rc=$?
  if [[ $rc -ne $want ]] || ! grep -qE -- "$pattern" <<<"$got"; then
    echo "FAIL: bench-compare $*: rc $rc (want $want), output:"
    echo "$got" | head -12
    fail=1
  fi
}
expect 0 '2 rows: 0 slower, 0 faster, 2 same.*: ok$' "$dir/old.json" "$dir/old.json"
expect 1 'SLOWER token_combine a fwd \(moe-gpu\): 12\.5% more time' "$dir/old.json" "$dir/new.json"
expect 0 '0 slower, 0 faster, 2 same.*: ok$' "$dir/old.json" "$dir/new.json" --max-slowdown 20
expect 1 'token_combine +a +fwd +moe-gpu +time +800\.0us +900\.0us +1\.125 +SLOWER' "$dir/old.json" \
  "$dir/new.json" --by time --json "$dir/cmp.json"
grep -q '"failed": true' "$dir/cmp.json" || { echo "FAIL: --json has no failed: true"; fail=1; }
expect 2 'nope\.json: cannot be read' "$dir/old.json" "$dir/nope.json"
expect 2 'bad\.json: results\[0\]\.op: expected a string' "$dir/old.json" "$dir/bad.json"
expect 2 'max-slowdown' "$dir/old.json" "$dir/new.json" --max-slowdown -1
expect 2 'by' "$dir/old.json" "$dir/new.json" --by speed
# --by min: row a's fastest sample 795 -> 890 us.
expect 1 'SLOWER token_combine a fwd \(moe-gpu\): 11\.9% more time than OLD at the fastest samples$' \
  "$dir/old.json" "$dir/new.json" --by min
expect 2 'REPORTS' "$dir/old.json"
expect 2 '--impl nobody: no row of the reports has it' "$dir/old.json" "$dir/new.json" --impl nobody
expect 0 '2 rows: 0 slower.*: ok$' "$dir/old.json" "$dir/new.json" --op token_combine --impl moe-gpu \
  --max-slowdown 20
# Two baselines, the second as slow as NEW: no row is slower than both.
expect 0 'a +fwd +moe-gpu +pct_copy +80\.0% +80\.0% +1\.000 +12\.5% +same' "$dir/old.json" \
  "$dir/new.json" "$dir/new.json"
[[ $fail -eq 0 ]] && echo "bench_compare_cli: all passed"
exit $fail
