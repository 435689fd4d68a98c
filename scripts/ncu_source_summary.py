#!/usr/bin/env python3
"""Where a kernel's warps stall, instruction by instruction (scripts/gpu_profile.sh --source).

Input: FILE, the output of
    ncu --import REPORT.ncu-rep --csv --page source --print-source sass
for a report taken with the SourceCounters section. Its layout: a line naming the kernel
("Kernel Name","<name>"), a header row ("Address", "Source", "Warp Stall Sampling (All
Samples)", ..., then one "stall_<reason>" column per reason and the same again with a
" (Not Issued)" suffix), then one row per SASS instruction. Several kernels follow each other,
each with its own name line and header. Numbers may carry thousands separators.

Per kernel it prints (a block whose name and rows repeat the one before it, as ncu prints for
each profiled launch of a kernel, is named once more but not summarised again):
  - the samples in all, and each stall reason's share of them (the first --reasons), from the
    "stall_<reason>" columns (all samples, issued or not);
  - the --top instructions by their samples: address (last 5 hex digits), share, times executed,
    the instruction, and its two largest reasons. Samples of reasons the page has no column for
    (ncu 2025: gmma) show as "other". A branch right after an mbarrier try_wait is
    marked "(waits on the mbarrier at +ADDR)": in a TMA pipeline that is a consumer waiting for
    a stage to land, or a producer waiting for one to be freed.
  - the --loops execution counts with the most samples: the instructions executed exactly that
    many times (a loop body's instructions all run equally often), how many there are, and their
    share of the samples. Session 35 found the sm90 forward's producer this way: 170 instructions
    run once per k-block by one thread (458752 times), busy for nearly all of the kernel.

Exit status: 0 when at least one kernel with samples was read; 1 when none was; 2 on bad usage or
an unreadable file.
"""
import argparse
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def number(text):
    text = text.replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return 0.0


def kernels(lines):
    """Yields (kernel name, header, rows) for each kernel block of the export."""
    name, header, rows = None, None, []
    for rec in csv.reader(lines):
        if not rec:
            continue
        if rec[0] == "Kernel Name":
            if header is not None:
                yield name, header, rows
            name, header, rows = (rec[1] if len(rec) > 1 else "?"), None, []
        elif header is None and "Address" in rec and "Source" in rec:
            header = rec
        elif header is not None and len(rec) == len(header):
            rows.append(rec)
    if header is not None:
        yield name, header, rows


def summarise(name, header, rows, top, reasons, loops, out):
    ix = {h: i for i, h in enumerate(header)}
    if SAMPLES not in ix or "Source" not in ix:
        out.write(f"kernel {name}: no '{SAMPLES}' column (was SourceCounters collected?)\n")
        return False
    stall_cols = [h for h in header if h.startswith("stall_") and not h.endswith("(Not Issued)")]
    samples = [number(r[ix[SAMPLES]]) for r in rows]
    total = sum(samples)
    out.write(f"kernel {name}\n  {int(total)} samples over {len(rows)} instructions\n")
    if total <= 0:
        return False
    by_reason = sorted(((sum(number(r[ix[c]]) for r in rows), c[6:]) for c in stall_cols),
                       reverse=True)
    # The page has no column for some reasons (ncu 2025's has none for gmma, the wait for wgmma
    # operands): what the columns leave is printed as "other".
    other = total - sum(v for v, _ in by_reason)
    out.write("  by reason: " + ", ".join(
        f"{r} {100 * v / total:.1f}%" for v, r in by_reason[:reasons] if v > 0) +
        (f"; other {100 * other / total:.1f}%" if other > 0.0005 * total else "") + "\n")
    if EXECUTED in ix and loops > 0:
        # Instructions executed equally often: the bodies of the kernel's loops.
        groups = {}
        for r, n in zip(rows, samples):
            times = int(number(r[ix[EXECUTED]]))
            if times > 0:
                count, got = groups.get(times, (0, 0.0))
                groups[times] = (count + 1, got + n)
        best = sorted(groups.items(), key=lambda kv: -kv[1][1])[:loops]
        out.write("  by times executed: " + "; ".join(
            f"x{times} {count} instruction{'s' if count != 1 else ''} {100 * got / total:.1f}%"
            for times, (count, got) in best) + "\n")
    order = sorted(range(len(rows)), key=lambda i: -samples[i])[:top]
    src = [r[ix["Source"]].strip() for r in rows]
    for i in order:
        if samples[i] <= 0:
            break
        r = rows[i]
        main = sorted(((number(r[ix[c]]), c[6:]) for c in stall_cols), reverse=True)[:2]
        rest = samples[i] - sum(number(r[ix[c]]) for c in stall_cols)
        why = ", ".join(f"{n} {int(v)}" for v, n in main if v > 0)
        if rest > 0.5 * samples[i]:
            why = f"other {int(rest)}" + (", " + why if why else "")
        note = ""
        # A branch that loops back on a failed try_wait: the wait, not the branch, is the cost.
        if "BRA" in src[i]:
            for j in range(i - 1, max(-1, i - 12), -1):
                if "TRYWAIT" in src[j] or "try_wait" in src[j]:
                    note = f" (waits on the mbarrier at +{rows[j][ix['Address']][-5:]})"
                    break
        executed = r[ix[EXECUTED]] if EXECUTED in ix else "-"
        out.write(f"  {r[ix['Address']][-5:]:>5} {100 * samples[i] / total:5.1f}% "
                  f"x{executed:>10}  {src[i][:60]:60}  {why}{note}\n")
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=15, help="instructions to list (default 15)")
    ap.add_argument("--reasons", type=int, default=8, help="reasons to list (default 8)")
    ap.add_argument("--loops", type=int, default=4,
                    help="execution counts to list (default 4; 0: none)")
    args = ap.parse_args()
    if args.top < 1 or args.reasons < 1 or args.loops < 0:
        print("ncu_source_summary.py: --top and --reasons must be >= 1, --loops >= 0",
              file=sys.stderr)
        return 2
    try:
        with open(args.file, newline="") as f:
            lines = f.read().splitlines()
    except OSError as e:
        print(f"ncu_source_summary.py: {args.file}: {e.strerror}", file=sys.stderr)
        return 2
    ok = False
    last = None
    for name, header, rows in kernels(lines):
        # ncu can print one block per profiled launch with the same rows in each (seen on the
        # H100, session 27): say so once instead of repeating the block.
        if last == (name, header, rows):
            print(f"kernel {name}: the same rows as the block above (another launch), not repeated")
            continue
        last = (name, header, rows)
        ok = summarise(name, header, rows, args.top, args.reasons, args.loops,
                        sys.stdout) or ok
    if not ok:
        print(f"ncu_source_summary.py: {args.file}: no kernel with stall samples", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
