#!/usr/bin/env python3
"""Summarises Nsight Compute raw-page CSV exports (scripts/gpu_profile.sh, issue 20).

Input: one or more TARGET=FILE arguments, FILE the output of
    ncu --import REPORT.ncu-rep --csv --page raw [--print-units base]
whose layout is: a header row ("ID", "Process ID", "Process Name", "Host Name", "Kernel Name",
"Context", "Stream", "Block Size", "Grid Size", "Device", "CC", then one column per metric), a
row of units (empty under the identity columns), then one row per profiled launch. Lines before
the header (==PROF== / ==WARNING== chatter) are skipped; numbers may carry thousands separators.

Per target and kernel (demangled name) the launches are aggregated by their median, and only the
launches of the kernel's largest grid are kept (a smaller grid is a verification-sized launch
that slipped past --launch-skip; the note column says how many were dropped). Reported:
    duration (us)                      gpu__time_duration.sum
    DRAM bytes read / written          dram__bytes_read.sum, dram__bytes_write.sum
    DRAM throughput (% of peak)        dram__throughput.avg.pct_of_peak_sustained_elapsed
    DRAM GB/s                          (read + written bytes) / duration
    SM throughput (% of peak)          sm__throughput.avg.pct_of_peak_sustained_elapsed
    achieved occupancy (%)             sm__warps_active.avg.pct_of_peak_sustained_active
    registers per thread               launch__registers_per_thread
    top 3 warp-stall reasons by share  the first family of stall metrics the report holds, of
        smsp__average_warps_issue_stalled_<r>_per_issue_active.ratio  (WarpStateStats section)
        smsp__average_warp_latency_issue_stalled_<r>.ratio / .pct
        smsp__warp_issue_stalled_<r>_per_warp_active.pct
        smsp__pcsamp_warps_issue_stalled_<r>                          (sampling, SourceCounters)
      share = the reason's value / the sum over all reasons of that family, "selected" (issuing,
      not a stall) left out.

Writes --csv (one row per target and kernel, raw numbers) and --txt (the table), prints the
table to stdout. Exit status: 0 when every target has at least one kernel row, 1 otherwise, 2 on
bad usage or an unreadable file.
"""
import argparse
import csv
import io
import re
import statistics
import sys

DURATION = "gpu__time_duration.sum"
DRAM_READ = "dram__bytes_read.sum"
DRAM_WRITE = "dram__bytes_write.sum"
DRAM_PCT = "dram__throughput.avg.pct_of_peak_sustained_elapsed"
SM_PCT = "sm__throughput.avg.pct_of_peak_sustained_elapsed"
OCCUPANCY = "sm__warps_active.avg.pct_of_peak_sustained_active"
REGISTERS = "launch__registers_per_thread"
GRID = "launch__grid_size"
BLOCK = "launch__block_size"

# Stall-metric families, in order of preference: (name, regex with the reason as group 1).
STALL_FAMILIES = [
    ("warps_issue_stalled_per_issue_active",
     re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")),
    ("warp_latency_issue_stalled.ratio",
     re.compile(r"^smsp__average_warp_latency_issue_stalled_(\w+?)\.ratio$")),
    ("warp_latency_issue_stalled.pct",
     re.compile(r"^smsp__average_warp_latency_issue_stalled_(\w+?)\.pct$")),
    ("warp_issue_stalled_per_warp_active",
     re.compile(r"^smsp__warp_issue_stalled_(\w+?)_per_warp_active\.pct$")),
    ("pcsamp_warps_issue_stalled",
     re.compile(r"^smsp__pcsamp_warps_issue_stalled_(\w+?)(?:\.sum)?$")),
]
NOT_A_STALL = {"selected"}

TIME_UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3,
              "ms": 1e3, "second": 1e6, "s": 1e6}
BYTE_UNITS = {"byte": 1.0, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,
              "kibyte": 1024.0, "mibyte": 1024.0 ** 2, "gibyte": 1024.0 ** 3,
              "tibyte": 1024.0 ** 4, "b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 1024.0,
              "mib": 1024.0 ** 2, "gib": 1024.0 ** 3}


class UsageError(Exception):
    pass


def number(text):
    """A CSV cell as a float (thousands separators dropped), or None."""
    if text is None:
        return None
    t = text.strip().replace(",", "")
    if t in ("", "n/a", "N/A", "-", "nan"):
        return None
    try:
        return float(t)
    except ValueError:
        return None


def scaled(value, unit, table, what, notes):
    """value in `unit` converted with `table`; None (and a note) when the unit is unknown: a
    value is never guessed."""
    if value is None:
        return None
    u = (unit or "").strip().lower()
    if u not in table:
        note = "unexpected unit '%s' for %s: left out" % (unit, what)
        if note not in notes:
            notes.append(note)
        return None
    return value * table[u]


def read_raw(path):
    """(header, units, rows) of an ncu raw-page CSV; rows as dicts keyed by header."""
    try:
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        raise UsageError("cannot read %s: %s" % (path, e))
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"') or l.startswith("ID,")),
                 None)
    if start is None:
        return [], {}, []
    table = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header = table[0]
    units, body = {}, table[1:]
    # The units row: the identity columns ("ID" first) are empty there.
    if body and body[0] and body[0][0].strip() == "":
        units = dict(zip(header, body[0]))
        body = body[1:]
    rows = [dict(zip(header, r)) for r in body if r and len(r) >= 2 and r[0].strip() != ""]
    return header, units, rows


def short_name(name, width):
    """A demangled kernel name without return type, parameter list and the moe::gpu:: and
    anonymous namespaces, bf16 / f16 / bool template arguments abbreviated, cut to `width`
    characters."""
    n = name.strip()
    if n.startswith("void "):
        n = n[5:]
    if n.endswith(")"):  # drop the parameter list: the ( that matches the final )
        depth = 0
        for i in range(len(n) - 1, -1, -1):
            if n[i] == ")":
                depth += 1
            elif n[i] == "(":
                depth -= 1
                if depth == 0:
                    if i > 0:
                        n = n[:i]
                    break
    n = n.replace("(anonymous namespace)::", "").replace("moe::gpu::", "")
    for long_form, short in (("__nv_bfloat16", "bf16"), ("__half", "f16"), ("(bool)0", "false"),
                             ("(bool)1", "true")):
        n = n.replace(long_form, short)
    if len(n) > width:
        n = n[: max(1, width - 1)] + "~"
    return n


def stall_top(row, header, k=3):
    """(family, [(reason, share %), ...] top k) from the first stall family with data."""
    for family, rx in STALL_FAMILIES:
        values = {}
        for col in header:
            m = rx.match(col)
            if not m or m.group(1) in NOT_A_STALL or m.group(1).endswith("_not_issued"):
                continue
            v = number(row.get(col))
            if v is not None:
                values[m.group(1)] = values.get(m.group(1), 0.0) + v
        total = sum(values.values())
        if values and total > 0:
            top = sorted(values.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
            return family, [(r, 100.0 * v / total) for r, v in top]
    return "", []


def median(values):
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None


def summarise(target, path, width):
    """One dict per kernel of the target's raw CSV."""
    header, units, rows = read_raw(path)
    kernels = {}
    for r in rows:
        kernels.setdefault(r.get("Kernel Name", "?"), []).append(r)
    out = []
    for name, launches in kernels.items():
        grid = [number(r.get(GRID)) for r in launches]
        if any(g is None for g in grid):  # the identity column "Grid Size" is "(x, y, z)"
            grid = [None] * len(launches)
        notes = []
        if grid[0] is not None:
            big = max(grid)
            kept = [r for r, g in zip(launches, grid) if g == big]
            if len(kept) < len(launches):
                notes.append("dropped %d launch(es) of a smaller grid (verification-sized?)"
                             % (len(launches) - len(kept)))
            launches = kept

        def col(metric, table=None, what=None):
            vals = []
            for r in launches:
                v = number(r.get(metric))
                if table is not None:
                    v = scaled(v, units.get(metric, ""), table, what or metric, notes)
                vals.append(v)
            return vals

        durs = col(DURATION, TIME_UNITS, "duration")
        dur = median(durs)
        d = [x for x in durs if x]
        if len(d) > 1 and max(d) > 2 * min(d):
            notes.append("durations vary %.1fx between launches" % (max(d) / min(d)))
        rd = median(col(DRAM_READ, BYTE_UNITS, "DRAM bytes read"))
        wr = median(col(DRAM_WRITE, BYTE_UNITS, "DRAM bytes written"))
        gbps = None
        if dur and rd is not None and wr is not None:
            gbps = (rd + wr) / (dur * 1e-6) / 1e9
        # Stall shares: of the launch with the median duration (all launches are alike).
        ranked = sorted(launches, key=lambda r: number(r.get(DURATION)) or 0.0)
        family, top = stall_top(ranked[len(ranked) // 2], header)
        first = launches[0]
        out.append({
            "target": target,
            "kernel": short_name(name, width),
            "kernel_demangled": name,
            "launches": len(launches),
            "grid": first.get("Grid Size", ""),
            "block": first.get("Block Size", ""),
            "duration_us": dur,
            "dram_read_bytes": rd,
            "dram_write_bytes": wr,
            "dram_pct_peak": median(col(DRAM_PCT)),
            "dram_gbps": gbps,
            "sm_pct_peak": median(col(SM_PCT)),
            "achieved_occupancy_pct": median(col(OCCUPANCY)),
            "registers_per_thread": median(col(REGISTERS)),
            "stall_family": family,
            "stalls": top,
            "note": "; ".join(notes),
        })
    return out


def fmt(v, f):
    return "-" if v is None else f % v


def stall_text(top):
    return ", ".join("%s %.0f%%" % (r, s) for r, s in top) if top else "-"


def table(results, width):
    head = ("%-18s %-*s %10s %9s %9s %6s %7s %5s %5s %4s  %s"
            % ("target", width, "kernel", "dur_us", "DRAM_rdMB", "DRAM_wrMB", "DRAM%", "GB/s",
               "SM%", "occ%", "regs", "top warp stalls (share of stalled warps)"))
    lines = [head]
    for r in results:
        if r.get("missing"):
            lines.append("%-18s %-*s %s" % (r["target"], width, "(no kernel profiled)",
                                            r["missing"]))
            continue
        mb = lambda b: None if b is None else b / 1e6  # noqa: E731
        lines.append("%-18s %-*s %10s %9s %9s %6s %7s %5s %5s %4s  %s" % (
            r["target"], width, r["kernel"], fmt(r["duration_us"], "%.1f"),
            fmt(mb(r["dram_read_bytes"]), "%.1f"), fmt(mb(r["dram_write_bytes"]), "%.1f"),
            fmt(r["dram_pct_peak"], "%.1f"), fmt(r["dram_gbps"], "%.0f"),
            fmt(r["sm_pct_peak"], "%.1f"), fmt(r["achieved_occupancy_pct"], "%.1f"),
            fmt(r["registers_per_thread"], "%.0f"), stall_text(r["stalls"])))
        if r["note"]:
            lines.append("%-18s %-*s   note: %s" % ("", width, "", r["note"]))
    return "\n".join(lines) + "\n"


CSV_FIELDS = ["target", "kernel", "kernel_demangled", "launches", "grid", "block", "duration_us",
              "dram_read_bytes", "dram_write_bytes", "dram_pct_peak", "dram_gbps", "sm_pct_peak",
              "achieved_occupancy_pct", "registers_per_thread", "stall_1", "stall_1_pct",
              "stall_2", "stall_2_pct", "stall_3", "stall_3_pct", "stall_family", "note"]


def csv_row(r):
    row = {k: r.get(k, "") for k in CSV_FIELDS}
    if r.get("missing"):
        row["note"] = r["missing"]
    for i in range(3):
        top = r.get("stalls") or []
        row["stall_%d" % (i + 1)] = top[i][0] if i < len(top) else ""
        row["stall_%d_pct" % (i + 1)] = "%.1f" % top[i][1] if i < len(top) else ""
    for k, v in row.items():
        if v is None:
            row[k] = ""
        elif isinstance(v, float):
            row[k] = "%.6g" % v
    return row


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="+", metavar="TARGET=RAW_CSV")
    ap.add_argument("--csv", help="write one row per target and kernel here")
    ap.add_argument("--txt", help="write the table here")
    ap.add_argument("--width", type=int, default=44, help="kernel name column width")
    a = ap.parse_args(argv)
    results, ok = [], True
    try:
        for spec in a.inputs:
            if "=" not in spec:
                raise UsageError("input '%s': expected TARGET=RAW_CSV" % spec)
            target, path = spec.split("=", 1)
            rows = summarise(target, path, a.width)
            if not rows:
                ok = False
                rows = [{"target": target, "missing": "no profiled kernel in " + path}]
            results.extend(rows)
    except UsageError as e:
        print("ncu_summary.py: %s" % e, file=sys.stderr)
        return 2
    text = table(results, a.width)
    sys.stdout.write(text)
    if a.txt:
        with open(a.txt, "w") as f:
            f.write(text)
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_FIELDS, lineterminator="\n")
            w.writeheader()
            for r in results:
                w.writerow(csv_row(r))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
