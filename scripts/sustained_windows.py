#!/usr/bin/env python3
"""SM clock and power over each sustained run of GemmBench or the joint yardstick (no GPU).

    scripts/sustained_windows.py RUNS.txt SMI.csv [--skip-ms 500]

RUNS.txt: the output of `MOE_GEMM_BENCH_SUSTAIN=s` GemmBench runs and `MOE_JOINT_PROBE_SECONDS=s`
yardstick runs, any prefix before `sustained` kept as the run's tag (a side's name, say). SMI.csv:
`nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader,nounits -lms 50`
logged on the same machine over those runs (its local-time stamps and the runs' epoch
milliseconds agree there). For each run: ms a launch, and the median SM clock and power of the
samples inside its window less its first --skip-ms (the clock's ramp), with their count. A run
with no sample in its window (a log from another machine or time zone, or stopped early) is
named on stderr and the exit status is 1. Session 41 did this by hand.
"""
import argparse
import datetime
import re
import statistics
import sys

# GemmBench: "sustained CASE IMPL ROLE: T0..T1 ms since epoch, N launches, X ms each"
# yardstick: "sustained ROLE mode M store S: T0..T1 ms since epoch, N launches"
RUN = re.compile(r"^(?P<tag>.*?)\s*sustained (?P<what>.+?): (?P<t0>\d+)\.\.(?P<t1>\d+) ms since "
                 r"epoch, (?P<n>\d+) launches")
YARD_MODES = {"0": "joint", "1": "mma", "2": "stream", "3": "store"}


def read_samples(path):
    samples = []
    with open(path) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 3:
                continue
            try:
                t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                samples.append((t * 1000.0, float(parts[1]), float(parts[2])))
            except ValueError:
                continue  # a header or a line cut short when the logger was stopped
    return samples


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs")
    ap.add_argument("smi")
    ap.add_argument("--skip-ms", type=float, default=500.0)
    args = ap.parse_args()
    samples = read_samples(args.smi)
    if not samples:
        sys.exit(f"sustained_windows: no samples in {args.smi}")
    print(f"{'run':<52} {'ms each':>8} {'SM MHz':>7} {'W':>6} {'n':>4}")
    uncovered = 0
    with open(args.runs) as f:
        for line in f:
            m = RUN.match(line.strip())
            if not m:
                continue
            t0, t1, n = int(m["t0"]), int(m["t1"]), int(m["n"])
            what = m["what"]
            y = re.match(r"(\w+) mode (\d) store (\d)", what)
            if y:  # the yardstick's mode by name
                what = f"yardstick {y[1]} {YARD_MODES.get(y[2], y[2])} store {y[3]}"
            inside = [s for s in samples if t0 + args.skip_ms <= s[0] <= t1]
            clock = statistics.median(s[1] for s in inside) if inside else float("nan")
            power = statistics.median(s[2] for s in inside) if inside else float("nan")
            name = (m["tag"] + " " + what).strip()
            print(f"{name:<52} {(t1 - t0) / n:8.3f} {clock:7.0f} {power:6.1f} {len(inside):4d}")
            if not inside:
                uncovered += 1
                print(f"sustained_windows: no sample of {args.smi} inside run '{name}' "
                      f"({t0}..{t1} ms since epoch)", file=sys.stderr)
    return 1 if uncovered else 0


if __name__ == "__main__":
    sys.exit(main())
