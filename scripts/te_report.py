#!/usr/bin/env python3
"""Writes docs/te-conformance.md from a scripts/te_conformance.sh run (issue 18).

Inputs in --results DIR: router-canonical.json and router-te.json (`moe-harness check --json`),
permutation.json (integrations/te/te_permutation_check.py, the same schema), bench.json
(`moe-harness bench --impl te --json`), gpu.txt. --findings: integrations/te/findings.json, the
triaged behaviours: each has a regular expression over a failing case's signature (op, tie
policy, and the report's first lines with numbers blanked) and says what it is (a TE bug, a SPEC
choice, a harness defect), the TE source line responsible and why. A failing behaviour that no
finding matches is listed as "untriaged", and the exit status is then 1, so a new departure
cannot slip into the document unexplained.
"""
import argparse
import datetime
import json
import os
import re
import sys


def load(path):
    """A result file's JSON; None when it is not there. A malformed one ends the run (exit 2)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as e:
        print(f"te_report: {path}: {e}", file=sys.stderr)
        sys.exit(2)


def signature(op, ties, report):
    """What kind of failure a case is, without its numbers: the first report lines, blanked."""
    lines = []
    for line in (report or "").splitlines():
        line = line.strip()
        if not line or line.startswith(("first at", "replay", "shrunk", "  ")):
            continue
        m = re.match(r"^([\w.]+): \d+ of \d+ elements? mismatch", line)
        if m:
            line = m.group(1) + ": mismatch"
        line = re.sub(r"0x[0-9a-fA-F]+", "#", line)
        line = re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "#", line)
        lines.append(line[:160])
        if len(lines) == 3:
            break
    return f"{op} [{ties}] " + " | ".join(lines)


# The repository root: file paths in reports (Python tracebacks) are written relative to it, so
# the document names no machine's directories (the GPU machine lays the tree out at the same path).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def relative(text):
    return text.replace(ROOT, "") if text else text


def op_runs(run):
    ops = _op_runs(run)
    for o in ops:
        for c in o.get("cases", []):
            for k in ("report", "replay"):
                if c.get(k):
                    c[k] = relative(c[k])
    return ops


def _op_runs(run):
    """The op results of a run in `moe-harness check --json`'s shape, from either that file or
    te_permutation_check.py's ({"ops": {op: {passed, failed, failures, not_supported_reasons}}})."""
    ops = run.get("ops", [])
    if isinstance(ops, list):
        return ops
    out = []
    for op, s in ops.items():
        if "error" in s:
            out.append({"op": op, "passed": 0, "failed": 0, "not_supported": 0,
                        "cases": [{"verdict": "failed", "case": "(runner)", "report":
                                   "runner error: " + s["error"].strip().splitlines()[-1]}]})
            continue
        cases = [{"verdict": "failed", "case": f["case"], "report": f.get("report", ""),
                  "replay": f.get("replay")} for f in s.get("failures", [])]
        for reason, n in (s.get("not_supported_reasons") or {}).items():
            cases += [{"verdict": "not_supported", "case": "", "report": reason}] * n
        out.append({"op": op, "passed": s.get("passed") or 0, "failed": s.get("failed") or 0,
                    "not_supported": s.get("not_supported") or 0,
                    "worst_pct_of_tolerance": s.get("worst_pct") or 0, "cases": cases})
    return out


def collect(results, findings):
    """Per (op, ties) counts, and failing cases grouped by finding (or signature when untriaged)."""
    rows, groups, unsupported = [], {}, {}
    sources = [("router-canonical.json", "canonical"), ("router-te.json", "te"),
               ("permutation.json", None)]
    for name, ties in sources:
        run = load(os.path.join(results, name))
        if not run:
            continue
        run_ties = ties or run.get("env", {}).get("ties") or run.get("ties", "canonical")
        for o in op_runs(run):
            rows.append({"op": o["op"], "ties": run_ties, "source": name, "passed": o["passed"],
                         "failed": o["failed"], "not_supported": o["not_supported"],
                         "worst": o.get("worst_pct_of_tolerance", 0),
                         "not_run": o.get("not_run", 0)})
            for c in o.get("cases", []):
                if c["verdict"] == "not_supported":
                    key = (o["op"], re.sub(r"\d+", "#", c.get("report", ""))[:200])
                    unsupported.setdefault(key, [0, c.get("report", ""), c["case"]])[0] += 1
                    continue
                if c["verdict"] != "failed":
                    continue
                sig = signature(o["op"], run_ties, c.get("report", ""))
                fid = None
                for f in findings:
                    if re.search(f["match"], sig):
                        fid = f["id"]
                        break
                g = groups.setdefault(fid or "untriaged: " + sig, {"cases": [], "finding": fid,
                                                                    "signature": sig})
                g["cases"].append(c)
    return rows, groups, unsupported


def bench_rows(results):
    b = load(os.path.join(results, "bench.json"))
    if not b:
        return []
    rows = b.get("rows", b.get("results", b if isinstance(b, list) else []))
    return [r for r in rows if isinstance(r, dict) and r.get("dir") == "fwd+bwd"]


def render(results, findings, rows, groups, unsupported, bench):
    by_id = {f["id"]: f for f in findings}
    gpu = ""
    try:
        gpu = open(os.path.join(results, "gpu.txt")).read().strip()
    except OSError:
        pass
    te_version = "TE 2.20.2"
    out = ["# TransformerEngine conformance",
           "",
           "Generated by `scripts/te_conformance.sh` (do not edit by hand: edit",
           "`integrations/te/findings.json` for the triage and rerun `scripts/te_report.py`).",
           "",
           f"- TE: {te_version} (`transformer-engine-cu13` wheel, cut by `../shared/gpu-deps/te`)",
           f"- GPU: {gpu or 'unknown'}",
           f"- generated: {datetime.date.today().isoformat()}",
           "- router family: `integrations/te/te_router_plugin.cpp` (TE's C API) through"
           " `moe-harness check --plugin`; permutation family: `integrations/te/te_permutation.py`"
           " (TE's Triton kernels) through the Python package",
           "",
           "## Per op", "",
           "| op | ties | passed | failed | unsupported | not run | worst % of tolerance (any case) |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['op']} | {r['ties']} | {r['passed']} | {r['failed']} | "
                   f"{r['not_supported']} | {r['not_run']} | {r['worst']:.1f} |")
    out += ["", "## Findings", "",
            "One per distinct behaviour where TE departs from SPEC (or SPEC from TE). Each was",
            "triaged against TE's source; the replay line reproduces the first case.", ""]
    n = 0
    for key, g in sorted(groups.items(), key=lambda kv: (kv[1]["finding"] is None, kv[0])):
        n += 1
        f = by_id.get(g["finding"])
        c = g["cases"][0]
        title = f["title"] if f else "UNTRIAGED: " + g["signature"]
        out.append(f"### F{n}. {title}")
        out.append("")
        if f:
            out.append(f"- **classification:** {f['classification']}")
            out.append(f"- **TE source:** {f['te_source']}")
            out.append(f"- **SPEC:** {f.get('spec', '-')}")
            out.append(f"- **what:** {f['what']}")
        out.append(f"- **cases:** {len(g['cases'])} (signature `{g['signature']}`)")
        out.append(f"- **replay:** `{c.get('replay', '')}`")
        rep = "\n".join((c.get("report") or "").splitlines()[:4])
        out += ["", "```", rep, "```", ""]
    if n == 0:
        out += ["No departures: every supported case passed.", ""]
    out += ["## Declared unsupported", "",
            "Cases SPEC allows that TE has no equivalent for (the implementation says so instead of",
            "emulating them).", "", "| op | cases | reason |", "|---|---:|---|"]
    for (op, _), (count, reason, _case) in sorted(unsupported.items()):
        out.append(f"| {op} | {count} | {reason.strip().splitlines()[0] if reason else ''} |")
    if bench:
        out += ["", "## Speed, TE next to moe-gpu (same run)", "",
                "`moe-harness bench --impl te`: forward + backward of one case (TE's run does both;",
                "moe-gpu's row is its fwd and bwd medians added), GB/s of the op's minimum bytes and",
                "% of a device-to-device copy measured in the same run.", "",
                "| op | case | impl | median us | GB/s | % copy |", "|---|---|---|---:|---:|---:|"]
        for r in bench:
            out.append(f"| {r.get('op')} | {r.get('name')} | {r.get('impl', 'moe-gpu')} | "
                       f"{r.get('median_us', 0):.1f} | {r.get('gbps', 0):.0f} | "
                       f"{r.get('pct_copy', 0):.1f}% |")
    perm = load(os.path.join(results, "permutation.json")) or {}
    timing = [(op, r) for op, s in (perm.get("ops") or {}).items() if isinstance(s, dict)
              for r in (s.get("timing") or []) if isinstance(r, dict)]
    if timing:
        out += ["", "TE's Triton permutation kernels (torch CUDA events, median of the runs, bf16;",
                "bytes by the formula in permutation.json; % of a 1 GiB device-to-device copy",
                "timed in the same run):", "",
                "| op | case | dir | median us | GB/s | % copy |", "|---|---|---|---:|---:|---:|"]
        for op, r in timing:
            for d in ("fwd", "bwd"):
                x = r.get(d) or {}
                if not isinstance(x, dict) or "median_ms" not in x and "median_us" not in x:
                    continue
                us = x.get("median_us", x.get("median_ms", 0) * 1000)
                out.append(f"| {op} | {r.get('case', r.get('name', ''))} | {d} | {us:.1f} | "
                           f"{x.get('GBps', 0):.0f} | {x.get('pct_of_copy', 0):.1f}% |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", required=True)
    ap.add_argument("--findings", required=True)
    ap.add_argument("--md", required=True)
    ap.add_argument("--json")
    ap.add_argument("--notes", help="a Markdown file appended as the run's notes")
    a = ap.parse_args()
    findings = load(a.findings)
    if findings is None:
        print(f"te_report: --findings {a.findings}: no such file", file=sys.stderr)
        return 2
    rows, groups, unsupported = collect(a.results, findings)
    if not rows:
        print(f"te_report: --results {a.results}: no check results in it", file=sys.stderr)
        return 2
    md = render(a.results, findings, rows, groups, unsupported, bench_rows(a.results))
    if a.notes:
        with open(a.notes) as f:
            md += "\n## Run notes\n\n" + f.read()
    with open(a.md, "w") as f:
        f.write(md)
    untriaged = [g for g in groups.values() if g["finding"] is None]
    summary = {"ops": rows,
               "findings": [{"finding": g["finding"], "signature": g["signature"],
                             "cases": len(g["cases"]), "replay": g["cases"][0].get("replay")}
                            for g in groups.values()],
               "untriaged": len(untriaged)}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    for g in groups.values():
        print(f"{len(g['cases']):4d}  {g['finding'] or 'UNTRIAGED'}  {g['signature']}")
    print(f"te_report: {len(rows)} op runs, {len(groups)} distinct behaviours, "
          f"{len(untriaged)} untriaged -> {a.md}")
    return 1 if untriaged else 0


if __name__ == "__main__":
    sys.exit(main())
