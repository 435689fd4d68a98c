#!/bin/sh
# ctests of the plugin route (cmake/plugins.cmake). Usage: test_plugin.sh MODE MOE_HARNESS PLUGIN
#   passes   every op of the correct example plugin passes `check --plugin`
#   buggy    every op of the planted-bug build fails, and each op's replay line reproduces it
#   abi      a plugin of another ABI version is refused: exit 2 and the reason
#   usage    bad case lines and names are usage errors (exit 2) naming what is wrong
#   reports  --json, --junit and --save-failures of a failing run
#   flaky    the build whose sort_chunks_by_index changes a bit on a case's 4th call in a row:
#            passes with check's two calls a case, fails with --runs 5 (a replay line that carries
#            --runs and reproduces it), and --runs outside 2..10000 is a usage error
#   faulty   the build that crashes (MOE_EXAMPLE_FAULT=crash) or hangs (=hang) on some cases: the
#            process dies of SIGSEGV after naming the case, a hang under --case-timeout 1 exits 1
#            naming it, each replay line reproduces it; bad --case-timeout values exit 2
#   cuda_passes, cuda_buggy   the device-memory plugin on a GPU (exit 77 without one)
#   cuda_bench   `bench --impl` times the device-memory plugin next to moe-gpu (exit 77 without a
#                GPU): a verified fwd+bwd row of impl example-cuda with GB/s > 0 in the JSON
#   bench_usage  `bench --impl` / `--plugin` usage errors (exit 2 naming the value; no GPU needed);
#                PLUGIN is the host example plugin, an optional 4th argument the device-memory one
set -u
mode=$1 bin=$2 so=$3 so2=${4:-}
ops="topk_router moe_aux_loss sort_chunks_by_index"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAILED: $*"; exit 1; }

# expect_status WANT CMD...: runs CMD, output to $tmp/out, fails unless it exits WANT.
expect_status() {
  want=$1; shift
  "$@" >"$tmp/out" 2>&1; got=$?
  [ "$got" -eq "$want" ] || { cat "$tmp/out"; fail "exit $got, expected $want: $*"; }
}

case $mode in
passes)
  expect_status 0 "$bin" check --plugin "$so" --cases 30 -j 2
  cat "$tmp/out"
  for op in $ops; do
    grep -Eq "^$op .* Passed" "$tmp/out" || fail "no Passed row for $op"
  done
  ;;
buggy)
  expect_status 1 "$bin" check --plugin "$so" --cases 30
  cat "$tmp/out"
  for op in $ops; do
    grep -Eq "^$op .* Incorrect" "$tmp/out" || fail "$op: planted bug not caught"
    replay=$(grep "replay: .*'op=$op " "$tmp/out" | head -n 1 | sed 's/^ *replay: moe-harness //')
    [ -n "$replay" ] || fail "$op: no replay line"
    echo "replaying $op: $replay"
    eval "\"\$bin\" $replay" >"$tmp/replay" 2>&1; st=$?
    cat "$tmp/replay"
    [ "$st" -eq 1 ] || fail "$op: the replay line exited $st, expected 1"
    grep -q "^FAIL op=$op " "$tmp/replay" || fail "$op: the replay did not reproduce the failure"
  done
  ;;
abi)
  expect_status 2 "$bin" check --plugin "$so"
  cat "$tmp/out"
  grep -q "built for plugin ABI version 99, this moe-harness speaks version 1" "$tmp/out" ||
    fail "no ABI mismatch message"
  ;;
usage)
  base="op=topk_router dtype=float32 seed=1 T=4 E=8 topk=2 score_function=sigmoid"
  expect_status 2 "$bin" check --impl reference --case "$base bogus=1"
  grep -q "unknown key 'bogus' for topk_router" "$tmp/out" || fail "unknown key: $(cat "$tmp/out")"
  expect_status 2 "$bin" check --impl reference --case "$base T=5"
  grep -q "key 'T' repeated" "$tmp/out" || fail "repeated key: $(cat "$tmp/out")"
  expect_status 2 "$bin" check --impl reference --case "op=topk_router dtype=float32 seed=1 T=4 E=8 topk=2 score_function=softplus"
  grep -q "score_function=softplus is not allowed (allowed: sigmoid, softmax, sqrtsoftplus)" "$tmp/out" ||
    fail "enum value: $(cat "$tmp/out")"
  expect_status 2 "$bin" check --impl reference --case "op=topk_router dtype=float32 seed=1 T=x E=8 topk=2"
  grep -q "T=x is not an integer" "$tmp/out" || fail "integer value: $(cat "$tmp/out")"
  expect_status 2 "$bin" check --impl reference --case "op=topk_router dtype=float32 seed=1 T=4 E=8 topk=9 score_function=sigmoid num_groups=0 group_topk=0 scaling_factor=1.0 use_pre_softmax=false expert_bias=false routing_map_format=bytemap"
  grep -qi "topk" "$tmp/out" || fail "invalid topk: $(cat "$tmp/out")"
  expect_status 2 "$bin" check --case "op=no_such_op seed=1"
  grep -q "unknown op 'no_such_op'" "$tmp/out" || fail "unknown op: $(cat "$tmp/out")"
  expect_status 2 "$bin" check --impl no_such_impl
  grep -q "no implementation named 'no_such_impl'" "$tmp/out" || fail "unknown impl"
  expect_status 2 "$bin" check --plugin "$tmp/missing.so"
  grep -q "cannot load" "$tmp/out" || fail "missing plugin: $(cat "$tmp/out")"
  expect_status 2 "$bin" check --plugin "$so" --op no_such_op
  grep -q "unknown op 'no_such_op'" "$tmp/out" || fail "unknown --op"
  echo "usage errors: all exit 2 with the expected messages"
  ;;
reports)
  expect_status 1 "$bin" check --plugin "$so" --op sort_chunks_by_index --cases 10 \
    --json "$tmp/r.json" --junit "$tmp/r.xml" --save-failures "$tmp/saved"
  grep -q '"impl": "example"' "$tmp/r.json" || fail "json: no impl"
  grep -q '"verdict": "failed"' "$tmp/r.json" || fail "json: no failed case"
  grep -q '"replay": "moe-harness check --impl example --plugin ' "$tmp/r.json" ||
    fail "json: no replay"
  if command -v python3 >/dev/null; then
    python3 -c "import json,sys; json.load(open(sys.argv[1]))" "$tmp/r.json" || fail "json: invalid"
    python3 -c "import sys,xml.dom.minidom as m; m.parse(sys.argv[1])" "$tmp/r.xml" ||
      fail "junit: invalid XML"
  fi
  grep -q '<failure message=' "$tmp/r.xml" || fail "junit: no failure"
  grep -q 'replay: moe-harness check --impl example' "$tmp/r.xml" || fail "junit: no replay"
  ! grep -q '"interrupted"' "$tmp/r.json" || fail "json: a finished run still says interrupted"
  ! grep -q 'the process ended during this op' "$tmp/r.xml" ||
    fail "junit: a finished run still says interrupted"
  ref=$(ls "$tmp"/saved/*.safetensors | grep -v '\.example\.safetensors$' | head -n 1)
  mine=$(echo "$ref" | sed 's/\.safetensors$/.example.safetensors/')
  [ -f "$ref" ] && [ -f "$mine" ] || fail "save-failures: no pair of files in $tmp/saved"
  expect_status 0 "$bin" golden verify "$ref"
  expect_status 1 "$bin" golden diff "$ref" "$mine"
  echo "reports: JSON, JUnit and saved golden files as expected"
  ;;
flaky)
  args="--plugin $so --op sort_chunks_by_index --cases 10 -j 1"
  expect_status 0 "$bin" check $args
  expect_status 1 "$bin" check $args --runs 5 --json "$tmp/f.json"
  cat "$tmp/out"
  grep -q "determinism: output.sorted differs between runs 1 and 4 (of 5)" "$tmp/out" ||
    fail "--runs 5: the 4th call's bits were not caught"
  grep -q '"runs_per_case": 5' "$tmp/f.json" || fail "json: no runs_per_case"
  replay=$(grep "replay: .*'op=sort_chunks_by_index " "$tmp/out" | head -n 1 |
    sed 's/^ *replay: moe-harness //')
  echo "$replay" | grep -q -- "--runs 5 " || fail "the replay line does not carry --runs 5: $replay"
  eval "\"\$bin\" $replay" >"$tmp/replay" 2>&1; st=$?
  cat "$tmp/replay"
  [ "$st" -eq 1 ] || fail "the replay line exited $st, expected 1"
  grep -q "differs between runs 1 and 4 (of 5)" "$tmp/replay" || fail "the replay did not reproduce it"
  for n in 1 10001 x; do
    expect_status 2 "$bin" check $args --runs $n
    grep -q -- "--runs" "$tmp/out" || fail "--runs $n: the message does not name --runs: $(cat "$tmp/out")"
  done
  echo "flaky: passes 2 calls a case, caught by --runs 5, replayed; bad --runs values exit 2"
  ;;
faulty)
  args="--plugin $so --op sort_chunks_by_index --cases 10 -j 1"
  expect_status 0 "$bin" check $args --case-timeout 60  # no fault planted without the variable
  export MOE_EXAMPLE_FAULT=crash
  "$bin" check $args >"$tmp/out" 2>&1; st=$?
  cat "$tmp/out"
  [ "$st" -gt 128 ] || fail "crash: exit $st, expected death by a signal"
  grep -q "moe-harness: SIGSEGV in a call of implementation 'example' for this case" "$tmp/out" ||
    fail "crash: the case was not named"
  replay=$(grep -A 3 "SIGSEGV in a call" "$tmp/out" | grep "moe-harness check " | head -n 1 |
    sed 's/^ *moe-harness //')
  [ -n "$replay" ] || fail "crash: no replay line"
  eval "\"\$bin\" $replay" >"$tmp/replay" 2>&1; st=$?
  [ "$st" -gt 128 ] && grep -q "SIGSEGV in a call" "$tmp/replay" ||
    fail "crash: the replay exited $st: $(cat "$tmp/replay")"
  # The reports a crash leaves: written as the op started, with the op marked interrupted.
  "$bin" check $args --json "$tmp/crash.json" --junit "$tmp/crash.xml" >"$tmp/out" 2>&1
  grep -q '"interrupted"' "$tmp/crash.json" && grep -q '"op": "sort_chunks_by_index"' "$tmp/crash.json" ||
    fail "crash: the JSON report does not mark the op interrupted: $(cat "$tmp/crash.json")"
  grep -q '<failure message="the process ended while this op ran' "$tmp/crash.xml" ||
    fail "crash: the JUnit report has no failure for the interrupted op"
  export MOE_EXAMPLE_FAULT=hang
  t0=$(date +%s)
  expect_status 1 "$bin" check $args --case-timeout 1
  cat "$tmp/out"
  [ $(($(date +%s) - t0)) -lt 60 ] || fail "hang: --case-timeout 1 took over a minute"
  grep -q "a call of implementation 'example' ran past the case timeout (1 s)" "$tmp/out" ||
    fail "hang: the case was not named"
  replay=$(grep -A 3 "ran past the case timeout" "$tmp/out" | grep "moe-harness check " |
    head -n 1 | sed 's/^ *moe-harness //')
  echo "$replay" | grep -q -- "--case-timeout 1 " || fail "hang: the replay lacks --case-timeout: $replay"
  eval "\"\$bin\" $replay" >"$tmp/replay" 2>&1; st=$?
  [ "$st" -eq 1 ] && grep -q "ran past the case timeout" "$tmp/replay" ||
    fail "hang: the replay exited $st: $(cat "$tmp/replay")"
  # The reports a hang leaves: the cases before it, and the hung one failed with its replay.
  expect_status 1 "$bin" check $args --case-timeout 1 --json "$tmp/hang.json" --junit "$tmp/hang.xml"
  grep -q '"stopped": "case timeout' "$tmp/hang.json" || fail "hang: the JSON report does not say the run stopped"
  grep -q '"verdict": "passed"' "$tmp/hang.json" || fail "hang: the JSON report lacks the cases before the hang"
  grep -q 'did not return within the case timeout (1 s)' "$tmp/hang.json" ||
    fail "hang: the JSON report lacks the hung case"
  grep -q '<failure message="the call did not return within the case timeout (1 s)' "$tmp/hang.xml" ||
    fail "hang: the JUnit report lacks the hung case"
  grep -q -- "--case-timeout 1 --case" "$tmp/hang.xml" || fail "hang: the JUnit failure lacks the replay"
  unset MOE_EXAMPLE_FAULT
  for v in -1 x 86401; do
    expect_status 2 "$bin" check $args --case-timeout $v
    grep -q -- "--case-timeout" "$tmp/out" || fail "--case-timeout $v: not named: $(cat "$tmp/out")"
  done
  echo "faulty: a crash and a hang named with replay lines that reproduce them, the reports each" \
    "leaves; bad values exit 2"
  ;;
cuda_passes | cuda_buggy)
  "$bin" list | grep -q "no GPU here" && { echo "SKIPPED: no GPU"; exit 77; }
  want=0
  [ "$mode" = cuda_buggy ] && want=1
  expect_status $want "$bin" check --plugin "$so" --cases 30
  cat "$tmp/out"
  grep -Eq "^sort_chunks_by_index .* $([ $want = 0 ] && echo Passed || echo Incorrect)" "$tmp/out" ||
    fail "unexpected disposition"
  ;;
cuda_bench)
  "$bin" list | grep -q "no GPU here" && { echo "SKIPPED: no GPU"; exit 77; }
  expect_status 0 "$bin" bench --op sort_chunks_by_index --case ep8_l32 --samples 20 \
    --impl example-cuda --plugin "$so" --json "$tmp/b.json"
  cat "$tmp/out"
  grep -Eq "^sort_chunks_by_index +ep8_l32 +fwd\+bwd +yes .* example-cuda$" "$tmp/out" ||
    fail "no verified fwd+bwd row of example-cuda in the table"
  grep -Eq "^sort_chunks_by_index +ep8_l32 +fwd\+bwd +yes .* moe-gpu$" "$tmp/out" ||
    fail "no composed fwd+bwd row of moe-gpu in the table"
  if command -v python3 >/dev/null; then
    python3 - "$tmp/b.json" <<'PY' || fail "json: $(cat "$tmp/b.json")"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["complete"], "not complete"
rows = [r for r in j["results"] if r["impl"] == "example-cuda"]
assert rows, "no example-cuda row"
for r in rows:
    assert r["dir"] == "fwd+bwd" and r["verified"] and r["gbps"] > 0 and r["pct_copy"] > 0, r
    assert r["bytes"] > 0 and r["median_us"] > 0 and r["samples"] >= 20, r
gpu = [r for r in j["results"] if r["impl"] == "moe-gpu"]
assert {r["dir"] for r in gpu} == {"fwd", "bwd", "fwd+bwd"}, gpu
fwd, bwd, both = ([r for r in gpu if r["dir"] == d][0] for d in ("fwd", "bwd", "fwd+bwd"))
assert both["composed"] == "fwd median + bwd median", both
assert abs(both["median_us"] - fwd["median_us"] - bwd["median_us"]) < 1e-6, both
assert "composed" not in fwd and "composed" not in bwd
print("json: example-cuda fwd+bwd %.0f GB/s (%.1f%% of copy); moe-gpu fwd+bwd (composed) %.0f GB/s"
      % (rows[0]["gbps"], rows[0]["pct_copy"], both["gbps"]))
PY
  else
    grep -q '"impl": "example-cuda"' "$tmp/b.json" || fail "json: no example-cuda row"
    grep -q '"composed": "fwd median + bwd median"' "$tmp/b.json" || fail "json: no composed row"
  fi
  ;;
bench_usage)
  expect_status 2 "$bin" bench --impl no_such_impl
  grep -q "no implementation named 'no_such_impl'" "$tmp/out" || fail "unknown impl: $(cat "$tmp/out")"
  expect_status 2 "$bin" bench --plugin "$so" --impl example
  grep -q "impl example: no CUDA (device-memory) implementation" "$tmp/out" ||
    fail "host impl: $(cat "$tmp/out")"
  expect_status 2 "$bin" bench --impl reference
  grep -q "impl reference: no CUDA (device-memory) implementation" "$tmp/out" ||
    fail "reference: $(cat "$tmp/out")"
  expect_status 2 "$bin" bench --plugin "$tmp/missing.so" --impl example
  grep -q "cannot load" "$tmp/out" || fail "missing plugin: $(cat "$tmp/out")"
  if [ -n "$so2" ]; then
    # The device-memory plugin implements sort_chunks_by_index only.
    expect_status 2 "$bin" bench --plugin "$so2" --impl example-cuda --op topk_router
    grep -q "impl example-cuda: no CUDA (device-memory) implementation of a selected op" \
      "$tmp/out" || fail "op not implemented: $(cat "$tmp/out")"
  fi
  echo "bench usage errors: all exit 2 with the expected messages"
  ;;
*) fail "unknown mode $mode" ;;
esac
echo "OK: $mode"
