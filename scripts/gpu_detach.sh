#!/usr/bin/env bash
# A long job over several device calls. One call may run 600 s at most; a machine kept warm (the
# next call within 30 s) keeps /tmp and the processes started in a session of their own. The first
# call starts COMMAND that way (setsid, its output in STATE/log.txt); every call, the first
# included, then waits up to --wait seconds for it to end, says whether it ended and how, prints
# the log's last lines and copies the log and each --copy file into the out dir. Session 29 ran a
# build, the gate, an A/B and the sanitizers (~800 s) over two calls with a hand-made script of
# this pattern.
#
#   scripts/gpu_detach.sh [--wait S] [--state DIR] [--out DIR] [--copy FILE]... [--tail N] \
#                         [--new] -- COMMAND [ARG...]   # the first call; a later one may repeat it
#   scripts/gpu_detach.sh [--wait S] [--state DIR] [--out DIR] [--copy FILE]... [--tail N]
#
# Defaults: --wait 540, --state /tmp/moe-detach, --out $OUT (else STATE/out), --tail 30. Where the
# job has ended and the out dir holds more than 8 files (the most a device call sends back;
# MOE_DETACH_FILES_MAX), all but log.txt are packed into out.tgz there. The job
# runs in the caller's directory. A state dir left by an earlier job (a machine lent again may
# keep /tmp) would answer for it: --new clears an ended job's state first (and refuses while one
# runs). Exit status: the job's when it has ended (0 included; the printed line tells a job's own
# 3 from "running"); 3 while it runs; 1 when it died without one (killed); 2 on bad usage, also
# for a command that differs from the one started under that state dir, or no command where none
# was started.
set -uo pipefail

usage() {
  echo "gpu_detach.sh: $1" >&2
  echo "usage: scripts/gpu_detach.sh [--wait S] [--state DIR] [--out DIR] [--copy FILE]..." \
    "[--tail N] [--new] [-- COMMAND [ARG...]]" >&2
  exit 2
}

wait_s=540 state=/tmp/moe-detach out="" tail_n=30 copies=() cmd=() new=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --wait|--state|--out|--copy|--tail)
      [[ $# -ge 2 ]] || usage "$1 needs a value"
      case $1 in
        --wait) wait_s=$2 ;; --state) state=$2 ;; --out) out=$2 ;;
        --copy) copies+=("$2") ;; --tail) tail_n=$2 ;;
      esac
      shift 2 ;;
    --new) new=1; shift ;;
    --) shift; cmd=("$@"); [[ ${#cmd[@]} -gt 0 ]] || usage "nothing after --"; break ;;
    *) usage "unknown argument '$1' (the command goes after --)" ;;
  esac
done
[[ $wait_s =~ ^[0-9]+$ ]] || usage "--wait: expected seconds, got '$wait_s'"
[[ $tail_n =~ ^[0-9]+$ ]] || usage "--tail: expected a line count, got '$tail_n'"
[[ -n $state ]] || usage "--state: empty"
out=${out:-${OUT:-$state/out}}

# Whether the job's shell still runs. A zombie does not: an init that reaps no orphans (this
# machine's) leaves the ended job's pid behind, and kill -0 would still find it.
alive() {
  local pid st
  [[ -e $state/pid ]] || return 1
  pid=$(cat "$state/pid")
  [[ -r /proc/$pid/stat ]] || return 1
  st=$(sed 's/.*) //' "/proc/$pid/stat" | cut -d' ' -f1)
  [[ $st != Z && $st != X ]]
}

# The command as one line (each word quoted), to tell a repeat from another job.
line=""
[[ ${#cmd[@]} -gt 0 ]] && line=$(printf '%q ' "${cmd[@]}")
if [[ $new -eq 1 && -e $state/cmd ]]; then
  [[ -n $line ]] || usage "--new needs the command after --"
  if [[ ! -e $state/rc ]] && alive; then
    usage "--new: the job under --state $state still runs (pid $(cat "$state/pid"))"
  fi
  rm -rf "$state"
fi
if [[ -e $state/cmd ]]; then
  if [[ -n $line && $line != "$(cat "$state/cmd")" ]]; then
    usage "--state $state already ran '$(cat "$state/cmd")'; a different job needs another --state"
  fi
elif [[ -z $line ]]; then
  usage "no job started under --state $state: give its command after --"
else
  mkdir -p "$state" || usage "--state: cannot create '$state'"
  printf '%s' "$line" >"$state/cmd"
  date +%s >"$state/started"
  # The job's shell writes its own pid (setsid may fork) and, once the command ends, its exit
  # status, each through a rename, so a reader never sees half a file.
  # shellcheck disable=SC2016  # expanded by the job's shell
  setsid nohup bash -c 'echo $$ >"$0/pid.part" && mv "$0/pid.part" "$0/pid"
    "$@" >"$0/log.txt" 2>&1; echo $? >"$0/rc.part"; mv "$0/rc.part" "$0/rc"' \
    "$state" "${cmd[@]}" </dev/null >/dev/null 2>&1 &
  for _ in $(seq 50); do [[ -e $state/pid ]] && break; sleep 0.1; done
  echo "gpu_detach: started: $line"
fi

end=$((SECONDS + wait_s))
while [[ ! -e $state/rc ]] && alive && [[ $SECONDS -lt $end ]]; do sleep 1; done
started=$(cat "$state/started")
if [[ -e $state/rc ]]; then
  status=$(cat "$state/rc")
  echo "gpu_detach: ended, exit status $status, $(($(stat -c %Y "$state/rc") - started)) s after it started"
elif alive; then
  status=3
  echo "gpu_detach: running for $(($(date +%s) - started)) s; call again within 30 s to wait on"
else
  status=1
  echo "gpu_detach: the job died without an exit status (killed?)"
fi
if [[ $tail_n -gt 0 && -e $state/log.txt ]]; then
  echo "--- last $tail_n lines of $state/log.txt"
  tail -n "$tail_n" "$state/log.txt"
fi
mkdir -p "$out" || echo "gpu_detach: cannot create the out dir '$out'" >&2
[[ -e $state/log.txt ]] && cp "$state/log.txt" "$out/" 2>/dev/null
for f in "${copies[@]}"; do
  if [[ -e $f ]]; then
    cp -r "$f" "$out/" || echo "gpu_detach: copying '$f' failed" >&2
  else
    echo "gpu_detach: --copy '$f': no such file (yet)" >&2
  fi
done
# The device sends back at most 8 files of the out dir (docs: ../.library/device/README.md) and
# drops the rest; an ended job that wrote more there (session 42 lost a call's timings that way)
# gets them packed: every file but log.txt into out.tgz, the originals removed. A running job's
# files are left alone (it may still write them), with a warning.
files_max=${MOE_DETACH_FILES_MAX:-8}
files=$(find "$out" -type f | wc -l)
if [[ $files -gt $files_max && $status -eq 3 ]]; then
  echo "gpu_detach: over $files_max files in $out while the job runs: not all will come back" >&2
elif [[ $files -gt $files_max ]]; then
  if (cd "$out" && find . -type f ! -path ./log.txt ! -path ./out.tgz -print0 |
    tar czf /tmp/gpu_detach_out.$$.tgz --null -T - --remove-files); then
    mv /tmp/gpu_detach_out.$$.tgz "$out/out.tgz"
    find "$out" -mindepth 1 -type d -empty -delete
    echo "gpu_detach: over $files_max files in $out: packed all but log.txt into out.tgz"
  else
    echo "gpu_detach: packing $out into out.tgz failed" >&2
  fi
fi
exit "$status"
