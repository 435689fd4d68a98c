#!/usr/bin/env bash
# scripts/gpu_detach.sh without a GPU: a job started by one call outlives it and a later call
# collects its exit status, log and files; --new starts over; a different command under the same
# state dir, a call with nothing started and bad values exit 2 naming them.
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
under_test=$here/scripts/gpu_detach.sh
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
expect_dir=$tmp
source "$here/tests/scripts/expect.sh"
s=$tmp/state
expect 2 "--wait: expected seconds, got 'soon'" --state "$s" --wait soon -- true
expect 2 "--tail: expected a line count, got '-1'" --state "$s" --tail -1 -- true
expect 2 "unknown argument 'make'" --state "$s" make
expect 2 "nothing after --" --state "$s" --
expect 2 "no job started under --state $s" --state "$s"
# The job: prints, writes a file in the caller's directory, sleeps past the first call, exits 5.
job=(bash -c 'echo first; echo made >made.txt; sleep 3; echo last; exit 5')
expect 3 "running for [0-9]+ s" --state "$s" --wait 0 -- "${job[@]}"
expect 2 "already ran .*another --state" --state "$s" --wait 0 -- bash -c 'exit 0'
expect 5 "ended, exit status 5, [0-9]+ s after it started" --state "$s" --wait 30 --out "$tmp/out" \
  --copy "$tmp/made.txt"
[[ -f $tmp/out/log.txt && -f $tmp/out/made.txt ]] ||
  { echo "FAIL: the log and the --copy file are not in the out dir"; fail=1; }
if ! { grep -q first "$tmp/out/log.txt" && grep -q last "$tmp/out/log.txt"; }; then
  echo "FAIL: the log lacks the job's lines"
  fail=1
fi
# The same command again starts nothing: the status stays, the file is not written twice.
rm "$tmp/made.txt"
expect 5 "ended, exit status 5" --state "$s" --wait 0 -- "${job[@]}"
[[ ! -e $tmp/made.txt ]] || { echo "FAIL: the repeated command ran again"; fail=1; }
expect 0 "ended, exit status 0" --state "$tmp/s2" --wait 30 --tail 0 -- true
# --new clears an ended job's state and runs the command again; it refuses while a job runs.
expect 5 "ended, exit status 5" --state "$s" --wait 30 --new -- "${job[@]}"
[[ -e $tmp/made.txt ]] || { echo "FAIL: --new did not run the command again"; fail=1; }
expect 2 "--new needs the command" --state "$s" --new
# A job killed before it could write its status.
expect 3 "running" --state "$tmp/s3" --wait 0 -- sleep 30
expect 2 "--new: the job under --state .* still runs" --state "$tmp/s3" --wait 0 --new -- sleep 30
kill "$(cat "$tmp/s3/pid")"
sleep 1
expect 1 "died without an exit status" --state "$tmp/s3" --wait 5
# A job that writes more files into the out dir than a device call sends back: left alone while
# it runs, packed once it has ended.
many=(bash -c 'mkdir -p "$0/sub" && for i in 1 2 3 4 5 6 7 8 9; do echo $i >"$0/f$i.txt"; done
  echo x >"$0/sub/y"; sleep 2' "$tmp/out4")
expect 3 "not all will come back" --state "$tmp/s4" --wait 1 --out "$tmp/out4" -- "${many[@]}"
[[ -f $tmp/out4/f9.txt ]] || { echo "FAIL: a running job's files were moved"; fail=1; }
expect 0 "packed all but log.txt into out.tgz" --state "$tmp/s4" --wait 30 --out "$tmp/out4"
got=$(cd "$tmp/out4" && find . -type f | sort | tr '\n' ' ')
[[ $got == "./log.txt ./out.tgz " ]] || { echo "FAIL: the out dir holds '$got'"; fail=1; }
n=$(tar tzf "$tmp/out4/out.tgz" | grep -c -v '/$')
[[ $n -eq 10 ]] || { echo "FAIL: out.tgz holds $n files, not 10"; fail=1; }
[[ $fail -eq 0 ]] && echo "gpu_detach: all checks passed"
exit $fail
