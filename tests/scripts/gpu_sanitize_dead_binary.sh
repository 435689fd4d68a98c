#!/usr/bin/env bash
# gpu_sanitize.sh on a test binary that dies mid-test (session 27: racecheck's run ended inside
# one test with no OK / FAILED line): it must fail and name that test. No GPU: a fake nvidia-smi
# and a fake compute-sanitizer that prints such a log and exits 11.
set -u
repo=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/bin" "$tmp/build"
printf '#!/bin/sh\necho "GPU 0: fake"\n' >"$tmp/bin/nvidia-smi"
cat >"$tmp/bin/compute-sanitizer" <<'LOG'
#!/bin/sh
echo "[ RUN      ] GemmGpuErrors.Fine"
echo "[       OK ] GemmGpuErrors.Fine (0 ms)"
echo "[ RUN      ] Ffn/GemmGpu.TailRowsAndEmptyGroupsAreExactlyZero/swiglu_expert_ffn_loop"
echo "========= Error: process didn't terminate successfully"
echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
exit 11
LOG
printf '#!/bin/sh\nexit 0\n' >"$tmp/build/moe_gpu_tests"
chmod +x "$tmp/bin/"* "$tmp/build/moe_gpu_tests"
out=$(PATH="$tmp/bin:$PATH" COMPUTE_SANITIZER="$tmp/bin/compute-sanitizer" \
  bash "$repo/scripts/gpu_sanitize.sh" --family gemm --tools racecheck "$tmp/build" "$tmp/logs")
rc=$?
echo "$out"
[[ $rc -eq 1 ]] || { echo "expected exit 1, got $rc"; exit 1; }
grep -q "^gemm/racecheck: the test binary ended during Ffn/GemmGpu.TailRowsAndEmptyGroupsAreExactlyZero/swiglu_expert_ffn_loop$" <<<"$out" ||
  { echo "the unfinished test is not named"; exit 1; }
echo "gpu_sanitize_dead_binary: ok"
