#!/usr/bin/env bash
# `moe-harness bench-targets`'s exit codes and messages (ctest bench_targets_cli; no GPU): issue
# #20's targets (docs/bench/issue20-targets.json) on the kept H100 report of session 40 (1: five
# met, eleven missed), on an H200 report (2: another board; 1 with --any-device), a target met
# exactly at its floor (0), a missing row (1), and targets files that are not (2, the field named).
# Usage: bench_targets_cli.sh PATH/TO/moe-harness REPO_ROOT
set -u
bin=$1
root=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
t20=$root/docs/bench/issue20-targets.json
h100=$root/docs/bench/s40-h100-08283eb.json
h200=$root/docs/bench/s39-h200-7729ad5.json
fail=0
expect() {  # rc pattern args...
  local want=$1 pattern=$2
  shift 2
  local got rc
  got=$("$bin" bench-targets "$@" 2>&1)
  rc=$?
  if [[ $rc -ne $want ]] || ! grep -qE -- "$pattern" <<<"$got"; then
    echo "FAIL: bench-targets $*: rc $rc (want $want), output:"
    echo "$got" | head -24
    fail=1
  fi
}
expect 1 '16 targets: 5 met, 11 missed, 0 missing, 0 unverified, 0 without a value: FAIL$' "$t20" "$h100"
expect 1 'MET topk_router deepseek_v3 fwd \(moe-gpu\): 78\.2% of copy >= 75\.0% of copy' "$t20" "$h100"
expect 1 'MISSED grouped_gemm deepseek_uniform fwd \(moe-gpu\): 87\.7% of roofline < 88\.0% of roofline \(99\.6% of the target\)' "$t20" "$h100"
expect 1 'MISSED moe_block deepseek_like fwd\+bwd \(moe-gpu\): 206533 tokens/s < 230000 tokens/s' "$t20" "$h100"
expect 2 "sets targets for a board named 'H100'; .*s39-h200-7729ad5\.json is from 'NVIDIA H200" "$t20" "$h200"
expect 1 'another board than the targets' "$t20" "$h200" --any-device
# Exactly at the floor is met (a report row at 92.5% of copy, its target 92.5); a row the report
# lacks is missing.
printf '{"device":"H100","results":[{"op":"token_combine","name":"ds","dir":"fwd","impl":"moe-gpu",%s' \
  '"kind":"memory","case":"op=token_combine","verified":true,"median_us":800,"min_us":795,"bytes":2.1e9,"flops":0,"pct_copy":92.5}]}' \
  >"$dir/report.json"
printf '{"targets":[{"op":"token_combine","name":"ds","dir":"fwd","metric":"pct_copy","min":92.5}]}' >"$dir/exact.json"
expect 0 '1 targets: 1 met, 0 missed.*: ok$' "$dir/exact.json" "$dir/report.json" --json "$dir/v.json"
grep -q '"verdict": "MET"' "$dir/v.json" || { echo "FAIL: --json has no MET verdict"; fail=1; }
printf '{"targets":[{"op":"token_combine","name":"nope","dir":"fwd","metric":"pct_copy","min":1}]}' >"$dir/missing.json"
expect 1 'MISSING token_combine nope fwd \(moe-gpu\): no such row' "$dir/missing.json" "$h100"
printf '{"targets":[{"op":"token_combine","name":"deepseek_v3","dir":"fwd","metric":"gbps","min":1}]}' >"$dir/bad1.json"
expect 2 'bad1\.json: targets\[0\]\.metric: expected pct_copy, pct_roof or tokens_per_s, got "gbps"' "$dir/bad1.json" "$h100"
printf '{"targets":[{"op":"token_combine","name":"deepseek_v3","dir":"fwd","metric":"pct_copy","min":-5}]}' >"$dir/bad2.json"
expect 2 'bad2\.json: targets\[0\]\.min: expected a positive number, got -5' "$dir/bad2.json" "$h100"
expect 2 'nope\.json: cannot be read' "$dir/nope.json" "$h100"
expect 2 'REPORT' "$t20"
[[ $fail -eq 0 ]] && echo "bench_targets_cli: all passed"
exit $fail
