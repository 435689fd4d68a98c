#!/usr/bin/env bash
# integrations/te/test_te_plugin.sh (ctest te_router_conformance) without a GPU or TE: a fake
# nvidia-smi and a fake moe-harness that writes a `check --json` report and exits as told. TE's
# triaged departures (tests/scripts/data/te_router_te_sample.json, cut from the H200 run of
# session 34) pass; an untriaged failure, a check that did not run (exit 3) and an empty report
# fail; no GPU skips (77).
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
under_test=$here/integrations/te/test_te_plugin.sh
source "$here/tests/scripts/expect.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/bin"
printf '#!/bin/sh\necho "GPU 0: fake (UUID: GPU-0)"\n' >"$tmp/bin/nvidia-smi"
# The fake check: copies $FAKE_JSON to the path after --json, prints an op table, exits $FAKE_RC.
cat >"$tmp/moe-harness" <<'FAKE'
#!/bin/sh
while [ $# -gt 0 ]; do
  if [ "$1" = --json ]; then cp "$FAKE_JSON" "$2"; fi
  shift
done
printf 'op    cases passed failed\ntopk_router 3 1 2\n\n'
exit "$FAKE_RC"
FAKE
chmod +x "$tmp/bin/nvidia-smi" "$tmp/moe-harness"
touch "$tmp/libtransformer_engine.so" "$tmp/plugin.so"
sample=$here/tests/scripts/data/te_router_te_sample.json
run() { PATH="$tmp/bin:$PATH" FAKE_JSON=$1 FAKE_RC=$2 expect "$3" "$4" run "$tmp/moe-harness" \
  "$tmp/plugin.so" "$tmp/libtransformer_engine.so" "$here"; }

run "$sample" 1 0 "every failing case matches a triaged finding"
# The same report with one failure no finding explains (a wrong value, not a tie or a refusal).
sed '0,/"report": "exception: plugin/s//"report": "output.probs: 3 of 8 elements mismatch; plugin/' \
  "$sample" >"$tmp/untriaged.json"
cmp -s "$sample" "$tmp/untriaged.json" && { echo "FAIL: the untriaged sample is unchanged"; fail=1; }
run "$tmp/untriaged.json" 1 1 "UNTRIAGED"
run "$sample" 3 1 "moe-harness check exited 3"
echo '{"ops": []}' >"$tmp/empty.json"
run "$tmp/empty.json" 0 1 "no check results"
# No GPU: nvidia-smi lists none.
printf '#!/bin/sh\nexit 9\n' >"$tmp/bin/nvidia-smi"
run "$sample" 1 77 "skipped: no GPU"
expect 2 "usage:" run only-two-args x
exit $fail
