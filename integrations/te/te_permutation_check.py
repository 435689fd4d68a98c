#!/usr/bin/env python3
"""Judges TransformerEngine's Triton mask-map permutation kernels (te_permutation.py) with
moe_harness.check -- every named case plus N random ones per op -- and times TE's forward and
backward on a GPU. Writes one JSON file.

    python integrations/te/te_permutation_check.py --device cuda --cases 200 --seed 1 \
        --json te_permutation.json
    TRITON_INTERPRET=1 python integrations/te/te_permutation_check.py --device cpu --cases 3 \
        --no-timing --json /tmp/te_cpu.json            # Triton's interpreter, no GPU

Options: --cases N (random cases per op, default 20) --seed S (default 1) --device cuda|cpu
--json OUT --ops a,b (default: all of token_dispatch, token_combine, sort_chunks_by_index)
--no-timing --timing-runs R (default 20) --unwritten te|zeros (default te: the rows SPEC §0
lets TE leave uninitialised are not compared) --ties canonical|te|any (these ops have no top-k; the
policy is recorded) --no-shrink (failing random cases reported as drawn) --no-classify
--case LINE (one case: a replay) --max-elems M (CPU only: cases with a tensor of more than M elements are skipped and counted as
skipped; the Triton interpreter is slow).

JSON: {"env": {...}, "ops": {op: {"passed", "failed", "not_supported", "skipped",
"not_provided", "failure_classes", "failures": [{"case", "name", "report", "replay",
"shrunk_from", "notes", "classification", "classification_detail"}], "not_supported_reasons",
"cases": [[verdict, line], ...], "timing": [...]}}, "copy": {...}}.
Each failing case is rerun outside check() to label it (the verdict stays failed):
te_empty_input_shape (TE's empty-input short-circuit returns another shape), te_unwritten_rows
(passes once the rows no routed slot owns are masked, SPEC §0), or unclassified.
Timing: median of R runs (CUDA events) per representative size, bytes by the formula stored
with it, GB/s, and % of a device-to-device copy of a 1 GiB buffer timed in the same run.
MOE_TE_TIMING_SMOKE=1 with --device cpu runs the timing code on tiny shapes under the
interpreter (a code-path test; its numbers mean nothing).

Exit: 0 every op ran (failing cases are findings, in the JSON), 1 the runner itself broke (TE or
torch missing, an exception outside the implementation), 2 usage error.
"""
import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

OPS = ("token_dispatch", "token_combine", "sort_chunks_by_index")


# ----------------------------------------------------------------------------- checking

SKIP_PREFIX = "skipped: "


def _capped(impl, max_elems, NotSupported):
    """impl, refusing (as 'skipped: ...' NotSupported) cases with a tensor over max_elems."""
    def run(case, inputs, outputs):
        big = max([t.numel() for t in list(inputs.values()) + list(outputs.values())] or [0])
        if big > max_elems:
            raise NotSupported("%sa tensor has %d elements > --max-elems %d (Triton interpreter)"
                               % (SKIP_PREFIX, big, max_elems))
        return impl(case, inputs, outputs)
    run.__name__ = run.__qualname__ = getattr(impl, "__name__", "impl")
    return run


def _result_of(check, op, impl, kw):
    """moe_harness.check's CheckResult without the AssertionError it raises on a failure: the
    result object check() built is taken from its frame; if that ever fails, the message is
    parsed (counts and per-case FAIL blocks)."""
    import moe_harness
    try:
        return check(op, impl, **kw), None
    except AssertionError as e:
        tb = e.__traceback__
        while tb is not None:
            fr = tb.tb_frame
            if fr.f_code is moe_harness.check.__code__:
                r = fr.f_locals.get("result")
                if isinstance(r, moe_harness.CheckResult):
                    return r, None
            tb = tb.tb_next
        return None, str(e)


def _parse_assertion(msg):
    """Fallback: the failures of an AssertionError message of moe_harness.check."""
    m = re.search(r"(\d+) of (\d+) cases failed", msg)
    failed, total = (int(m.group(1)), int(m.group(2))) if m else (None, None)
    blocks = re.split(r"\n(?=FAIL )", msg)
    fails = []
    for b in blocks[1:]:
        line = b.split("\n", 1)[0][len("FAIL "):]
        rep = re.search(r"\n  replay: (.*)", b, re.S)
        fails.append({"case": line, "name": None, "report": b, "replay": rep.group(1).strip()
                      if rep else None, "shrunk_from": None, "notes": []})
    return failed, total, fails


def summarize(result, parsed_msg):
    out = {}
    if result is None:
        failed, total, fails = _parse_assertion(parsed_msg)
        out.update(passed=None if total is None else total - failed, failed=failed,
                   not_supported=None, skipped=None, failures=fails,
                   note="result parsed from check()'s AssertionError text")
        return out
    ns_reasons = {}
    skipped = 0
    cases = []
    notes = {}
    fails = []
    for r in result.reports:
        cases.append([r.verdict, r.case.line])
        for n in r.notes:
            notes[n] = notes.get(n, 0) + 1
        if r.verdict == "not_supported":
            if r.report.startswith(SKIP_PREFIX):
                skipped += 1
            else:
                ns_reasons[r.report.strip()] = ns_reasons.get(r.report.strip(), 0) + 1
        elif r.verdict == "failed":
            fails.append({"case": r.case.line, "name": r.case.name, "report": r.report,
                          "replay": r.replay, "shrunk_from": r.original or None,
                          "notes": list(r.notes)})
    out.update(passed=result.passed, failed=result.failed,
               not_supported=result.not_supported - skipped, skipped=skipped,
               worst_pct=result.worst_pct, seconds=round(result.seconds, 3), failures=fails,
               not_supported_reasons=ns_reasons, notes=notes, cases=cases)
    return out


# What SPEC §0 ("Unwritten rows") says a comparison against TE must mask, per op: the rows of
# these outputs that no routed (t, e) slot owns.
_UNOWNED_KEYS = {"token_dispatch": ("output.permuted", "output.permuted_probs"),
                 "token_combine": ("grad.permuted",)}


def _owned_rows(op, ins, ref):
    import numpy as np
    if op == "token_dispatch":
        rim, pad = ref["output.row_id_map"], ref.get("output.pad_offsets")
    else:
        rim, pad = ins["input.row_id_map"], ins.get("input.pad_offsets")
    T = rim.shape[0]
    E = (rim.shape[1] - 1) // 2 if rim.ndim == 2 else 0
    rows = set()
    for t in range(T):
        for k in range(int(rim[t, 2 * E])):
            e = int(rim[t, E + k])
            rows.add(int(rim[t, k]) + (int(pad[e]) if pad is not None else 0))
    return np.array(sorted(rows), dtype=np.int64)


def classify(op, line, device, impl, provided):
    """A label for one failing case (the verdict stays 'failed'; this only sorts findings):
    'te_empty_input_shape' -- TE's empty-input short-circuit returned another shape (SPEC §0
    zero sizes: TE-PyTorch returns inp.clone()); 'te_unwritten_rows' -- with the rows no routed
    slot owns replaced by the reference's (SPEC §0: a comparison against TE must mask the rows TE
    leaves unwritten) the case passes and two runs agree on the owned rows; else 'unclassified'."""
    import numpy as np
    import moe_harness
    from moe_harness import to_numpy
    import te_permutation as tp
    case = moe_harness.Case(line)
    ref = case.reference()
    ins_np = case.inputs()

    def run_once():
        ins = case.inputs(framework="torch", device=device)
        outs = {}
        for k, v in ref.items():
            if provided and k not in provided:
                continue
            t = moe_harness._frameworks.to_framework(v, "torch", device)
            outs[k] = t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1)
        try:
            impl(case, ins, outs)
        except tp.TEResultMismatch as e:
            return str(e)
        return {k: to_numpy(v).copy() for k, v in outs.items()}

    try:
        a = run_once()
        if isinstance(a, str):
            empty = any(int(np.prod(v.shape)) == 0 for k, v in ins_np.items()
                        if k in ("input.x", "input.permuted"))
            return ("te_empty_input_shape" if empty else "te_shape"), a
        b = run_once()
        if op not in _UNOWNED_KEYS:
            return "unclassified", None
        owned = _owned_rows(op, ins_np, ref)
        for got in (a, b):
            for k in _UNOWNED_KEYS[op]:
                if k in got:
                    keep = np.zeros(got[k].shape[0], dtype=bool)
                    keep[owned[owned < got[k].shape[0]]] = True
                    got[k][~keep] = ref[k][~keep]
        for k in a:
            if a[k].tobytes() != b[k].tobytes():
                return "unclassified", "%s differs between two runs on the owned rows" % k
        rep = case.compare({k: v for k, v in a.items()})
        if rep:
            return "te_unwritten_rows", ("passes with the rows no routed slot owns masked in %s"
                                         % ", ".join(_UNOWNED_KEYS[op]))
        return "unclassified", str(rep)
    except Exception:
        return "unclassified", "classification failed: " + traceback.format_exc(limit=3)


def check_op(op, args):
    import moe_harness
    import te_permutation as tp
    impl = tp.IMPLS[op]
    if args.max_elems:
        impl = _capped(impl, args.max_elems, moe_harness.NotSupported)
    kw = dict(cases=args.cases, seed=args.seed, framework="torch", device=args.device,
              ties=args.ties, named=True, provides=tp.provides(op), name="te_triton_" + op,
              shrink=args.shrink, unwritten=args.unwritten)
    if args.case:
        kw["case"] = args.case
    t0 = time.time()
    result, msg = _result_of(moe_harness.check, op, impl, kw)
    s = summarize(result, msg)
    classes = {}
    for f in s.get("failures") or []:
        f["replay_cli"] = ("python integrations/te/te_permutation_check.py --device %s "
                           "--no-timing --json replay.json --case '%s'" % (args.device, f["case"]))
        if args.classify:
            f["classification"], f["classification_detail"] = classify(
                op, f["case"], args.device, tp.IMPLS[op], tp.provides(op))
        else:
            f["classification"] = "not classified (--no-classify)"
        classes[f["classification"]] = classes.get(f["classification"], 0) + 1
    s["failure_classes"] = classes
    s["wall_seconds"] = round(time.time() - t0, 2)
    s["provides"] = tp.provides(op) or "all"
    s["not_provided"] = tp.NOT_PROVIDED[op]
    return s


# ----------------------------------------------------------------------------- timing

def _median_ms(torch, fn, runs, warmup=3):
    """Median, min, max in ms of fn over `runs` calls, CUDA events around each call (after
    `warmup` calls: the first call of a hidden size runs TE's autotuner). Under the smoke test
    (CPU, MOE_TE_TIMING_SMOKE=1) a wall clock stands in for the events."""
    for _ in range(warmup):
        fn()
    ts = []
    if not torch.cuda.is_available():
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts), min(ts), max(ts)
    torch.cuda.synchronize()
    for _ in range(runs):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts), min(ts), max(ts)


def _routing_map(torch, T, E, K, dev, gen):
    idx = torch.rand(T, E, device=dev, generator=gen).topk(K, dim=1).indices
    return torch.zeros(T, E, dtype=torch.bool, device=dev).scatter_(1, idx, True)


def _rows(N, E, a):
    return N if a == 0 else (N + E * (a - 1)) // a * a  # SPEC §4.1 R_out (N_out = N)


def _esize(torch, dt):
    return torch.empty((), dtype=dt).element_size()


DISPATCH_FWD_FORMULA = ("T*E (routing_map, bool) + T*(2E+1)*4 (row_id_map written) + T*H*d "
                        "(x read) + R*H*d (permuted written: N routed rows, R-N zero rows) "
                        "[+ T*E*p (probs read) + R*p (permuted_probs written)]")
DISPATCH_BWD_FORMULA = ("T*(2E+1)*4 (row_id_map) + N*H*d (routed cotangent rows read) + T*H*d "
                        "(grad x written) [+ N*p + T*E*p (probs cotangent read, grad written)]")
COMBINE_FWD_FORMULA = ("T*(2E+1)*4 (row_id_map) + N*H*d (routed rows read) + T*H*d (combined "
                       "written) [+ T*E*p (merging probs)]")
COMBINE_BWD_FORMULA = ("T*(2E+1)*4 + T*H*d (cotangent read) + R*H*d (grad permuted written, "
                       "zero rows included) [+ N*H*d (saved permuted read) + 2*T*E*p (merging "
                       "probs read, grad written)]")
SORT_FWD_FORMULA = ("2*Nr*H*d (rows read and written) + 2*Nr*4 (row_id_map written and read) "
                    "[+ 2*Nr*p]")
SORT_BWD_FORMULA = "2*Nr*H*d + Nr*4 (row_id_map read) [+ 2*Nr*p]"


def time_ops(ops, args, smoke=False):
    """Timing on the CUDA device. smoke=True (MOE_TE_TIMING_SMOKE=1 with --device cpu): the same
    code on tiny shapes on the CPU under Triton's interpreter, to test the code path only; its
    numbers mean nothing."""
    import torch
    import te_permutation as tp
    dev = "cpu" if smoke else "cuda"
    te = tp.load(dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)
    bf16 = torch.bfloat16
    d = _esize(torch, bf16)
    out = {}

    # Device-to-device copy of 1 GiB, the bandwidth yardstick (read + write = 2 GiB moved).
    buf = torch.empty(1 << (20 if smoke else 30), dtype=torch.uint8, device=dev)
    cmed, cmin, cmax = _median_ms(torch, lambda b=buf: torch.empty_like(b).copy_(b),
                                  args.timing_runs)
    copy_gbs = 2 * buf.numel() / (cmed * 1e-3) / 1e9
    copy = {"what": "torch.empty_like(x).copy_(x), x = %d MiB uint8" % (buf.numel() >> 20),
            "bytes": 2 * buf.numel(),
            "median_ms": cmed, "min_ms": cmin, "max_ms": cmax, "GBps": copy_gbs}
    del buf

    def entry(name, shape, fwd_ms, bwd_ms, fwd_bytes, bwd_bytes, ffm, bfm):
        e = {"case": name, "shape": shape}
        for tag, ms, b, fm in (("fwd", fwd_ms, fwd_bytes, ffm), ("bwd", bwd_ms, bwd_bytes, bfm)):
            gbs = b / (ms[0] * 1e-3) / 1e9
            e[tag] = {"median_ms": ms[0], "min_ms": ms[1], "max_ms": ms[2], "bytes": int(b),
                      "bytes_formula": fm, "GBps": gbs, "pct_of_copy": 100.0 * gbs / copy_gbs}
        return e

    shapes = [dict(T=4096, H=4096, E=64, K=8, probs=None, a=0),
              dict(T=4096, H=4096, E=64, K=8, probs=torch.float32, a=0),
              dict(T=4096, H=4096, E=64, K=8, probs=torch.float32, a=16),
              dict(T=16384, H=7168, E=256, K=8, probs=torch.float32, a=0),
              dict(T=16384, H=7168, E=256, K=8, probs=torch.float32, a=128)]
    if smoke:
        shapes = [dict(T=16, H=8, E=4, K=2, probs=None, a=0),
                  dict(T=16, H=8, E=4, K=2, probs=torch.float32, a=4)]
    for op in ops:
        rows_out = []
        for sh in shapes:
            T, H, E, K, pdt, a = sh["T"], sh["H"], sh["E"], sh["K"], sh["probs"], sh["a"]
            if op == "sort_chunks_by_index" and a:
                continue
            name = "T%d_H%d_E%d_K%d_bf16_%s_a%d" % (T, H, E, K,
                                                   "probs_f32" if pdt else "no_probs", a)
            shape = dict(T=T, H=H, E=E, K=K, dtype="bfloat16",
                         probs=str(pdt).replace("torch.", "") if pdt else None, align_size=a)
            try:
                rmap = _routing_map(torch, T, E, K, dev, gen)
                N = T * K
                R = _rows(N, E, a)
                p = _esize(torch, pdt) if pdt else 0
                x = torch.randn(T, H, dtype=bf16, device=dev, generator=gen)
                probs = (torch.rand(T, E, device=dev, generator=gen) * 0.9 + 0.1).to(pdt) \
                    if pdt else None
                rim = T * (2 * E + 1) * 4
                if op == "token_dispatch":
                    st = tp.dispatch_forward(te, x, rmap, probs, N, a, R)
                    ct = torch.randn(R, H, dtype=bf16, device=dev, generator=gen)
                    ctp = torch.randn(R, device=dev, generator=gen).to(pdt) if pdt else None
                    f = _median_ms(torch, lambda: tp.dispatch_forward(te, x, rmap, probs, N, a, R),
                                   args.timing_runs)
                    b = _median_ms(torch, lambda: tp.dispatch_backward(te, st, ct, ctp,
                                                                       pdt is not None),
                                   args.timing_runs)
                    fb = T * E + rim + T * H * d + R * H * d + (T * E * p + R * p if pdt else 0)
                    bb = rim + N * H * d + T * H * d + (N * p + T * E * p if pdt else 0)
                    rows_out.append(entry(name, shape, f, b, fb, bb, DISPATCH_FWD_FORMULA,
                                          DISPATCH_BWD_FORMULA))
                    del st, ct, ctp
                elif op == "token_combine":
                    ds = tp.dispatch_forward(te, x, rmap, None, N, a, R)
                    permuted = torch.randn(R, H, dtype=bf16, device=dev, generator=gen)
                    rid, pad = ds["row_id_map"], ds["pad_offsets"]
                    mp = (probs * rmap) if pdt else None  # merging probs: routed entries only
                    st = tp.combine_forward(te, permuted, rid, mp, pad, T)
                    ct = torch.randn(T, H, dtype=bf16, device=dev, generator=gen)
                    f = _median_ms(torch, lambda: tp.combine_forward(te, permuted, rid, mp, pad, T),
                                   args.timing_runs)
                    b = _median_ms(torch, lambda: tp.combine_backward(te, st, ct, pdt is not None),
                                   args.timing_runs)
                    fb = rim + N * H * d + T * H * d + (T * E * p if pdt else 0)
                    bb = rim + T * H * d + R * H * d + (N * H * d + 2 * T * E * p if pdt else 0)
                    rows_out.append(entry(name, shape, f, b, fb, bb, COMBINE_FWD_FORMULA,
                                          COMBINE_BWD_FORMULA))
                    del ds, permuted, st, ct
                else:  # sort_chunks_by_index: the EP local permute of N = T*K rows in E chunks
                    Nr = T * K
                    split = torch.bincount(torch.randint(0, E, (Nr,), device=dev, generator=gen),
                                           minlength=E).to(torch.int32)
                    order = torch.randperm(E, device=dev, generator=gen).to(torch.int32)
                    xs = torch.randn(Nr, H, dtype=bf16, device=dev, generator=gen)
                    ps = torch.rand(Nr, device=dev, generator=gen).to(pdt) if pdt else None
                    st = tp.sort_chunks_forward(te, xs, split, order, ps)
                    ct = torch.randn(Nr, H, dtype=bf16, device=dev, generator=gen)
                    ctp = torch.randn(Nr, device=dev, generator=gen).to(pdt) if pdt else None
                    f = _median_ms(torch, lambda: tp.sort_chunks_forward(te, xs, split, order, ps),
                                   args.timing_runs)
                    b = _median_ms(torch, lambda: tp.sort_chunks_backward(te, st, ct, ctp,
                                                                          pdt is not None),
                                   args.timing_runs)
                    fb = 2 * Nr * H * d + 2 * Nr * 4 + (2 * Nr * p if pdt else 0)
                    bb = 2 * Nr * H * d + Nr * 4 + (2 * Nr * p if pdt else 0)
                    shape = dict(rows=Nr, H=H, chunks=E, dtype="bfloat16",
                                 probs=shape["probs"])
                    rows_out.append(entry("rows%d_H%d_C%d_bf16_%s" % (
                        Nr, H, E, "probs_f32" if pdt else "no_probs"), shape, f, b, fb, bb,
                        SORT_FWD_FORMULA, SORT_BWD_FORMULA))
                    del xs, st, ct
            except Exception:
                rows_out.append({"case": name, "error": traceback.format_exc()})
            if not smoke:
                torch.cuda.empty_cache()
        out[op] = rows_out
    return out, copy


# ----------------------------------------------------------------------------- main

def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--json", default="te_permutation.json")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--timing-runs", type=int, default=20)
    ap.add_argument("--ties", choices=("canonical", "te", "any"), default="canonical")
    # SPEC §0: a comparison against TE masks the rows TE leaves uninitialised; --unwritten zeros
    # demands this project's zeros there instead (every such row then fails).
    ap.add_argument("--unwritten", choices=("te", "zeros"), default="te")
    ap.add_argument("--max-elems", type=int, default=0)
    ap.add_argument("--case", default=None, metavar="LINE",
                    help="check only this case line (a replay; its op is taken from the line)")
    ap.add_argument("--no-shrink", dest="shrink", action="store_false",
                    help="report failing random cases as drawn (no shrinking to a minimal case)")
    ap.add_argument("--no-classify", dest="classify", action="store_false",
                    help="do not rerun failing cases to label them")
    args = ap.parse_args(argv)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        ap.error("--ops: unknown %s (ops: %s)" % (", ".join(bad) or "(none)", ", ".join(OPS)))
    args.ops = ops
    if args.case:
        m = re.match(r"op=(\S+)", args.case.strip())
        if not m or m.group(1) not in OPS:
            ap.error("--case: not a case line of %s" % ", ".join(OPS))
        args.ops = [m.group(1)]
    if args.cases < 0 or args.timing_runs < 1:
        ap.error("--cases must be >= 0 and --timing-runs >= 1")
    if args.max_elems and args.device == "cuda":
        ap.error("--max-elems is for the CPU interpreter only; the GPU run uses every case")
    if args.device == "cpu":
        if os.environ.get("TRITON_INTERPRET", "1") != "1":
            ap.error("--device cpu needs TRITON_INTERPRET=1 (Triton's interpreter)")
        os.environ["TRITON_INTERPRET"] = "1"  # before TE's kernels are defined
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    report = {"env": {"argv": sys.argv, "python": platform.python_version(),
                      "device": args.device, "cases": args.cases, "seed": args.seed,
                      "ties": args.ties, "max_elems": args.max_elems or None,
                      "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1"},
              "ops": {}}
    rc = 0
    try:
        import torch
        import triton
        import moe_harness
        import te_permutation as tp
        report["env"].update(torch=torch.__version__, triton=triton.__version__,
                             moe_harness=moe_harness.__version__, te_version=tp.te_version(),
                             te_python=str(tp.te_python_dir()))
        if args.device == "cuda":
            if not torch.cuda.is_available():
                raise tp.TEUnavailable("--device cuda but torch sees no CUDA device")
            report["env"]["gpu"] = torch.cuda.get_device_name(0)
        tp.load(args.device)
    except Exception as e:
        report["error"] = "".join(traceback.format_exception_only(type(e), e)).strip()
        print("te_permutation_check: %s" % report["error"], file=sys.stderr)
        _write(args.json, report)
        return 1
    for op in args.ops:
        try:
            s = check_op(op, args)
        except Exception:
            s = {"error": traceback.format_exc()}
            rc = 1
        report["ops"][op] = s
        if "error" in s:
            print("%-22s RUNNER ERROR\n%s" % (op, s["error"]), file=sys.stderr)
        else:
            print("%-22s passed %s, failed %s, not supported %s, skipped %s (%.1f s)%s" % (
                op, s["passed"], s["failed"], s["not_supported"], s["skipped"],
                s.get("wall_seconds", 0), "; failures: " + ", ".join(
                    "%s %d" % kv for kv in sorted(s["failure_classes"].items()))
                if s.get("failure_classes") else ""))
        _write(args.json, report)
    if args.no_timing:
        report["timing"] = "skipped (--no-timing)"
    elif args.device != "cuda" and os.environ.get("MOE_TE_TIMING_SMOKE") != "1":
        report["timing"] = "skipped (CPU: Triton's interpreter is no measure of the kernels)"
    else:
        try:
            smoke = args.device != "cuda"
            timing, copy = time_ops(args.ops, args, smoke=smoke)
            if smoke:
                report["timing_note"] = "MOE_TE_TIMING_SMOKE: code-path test on CPU, no measure"
            report["copy"] = copy
            for op, rows in timing.items():
                report["ops"].setdefault(op, {})["timing"] = rows
                for r in rows:
                    if "error" in r:
                        print("%-22s timing %s: ERROR\n%s" % (op, r["case"], r["error"]),
                              file=sys.stderr)
                    else:
                        print("%-22s %-40s fwd %8.3f ms %7.1f GB/s (%5.1f%% of copy)  bwd "
                              "%8.3f ms %7.1f GB/s (%5.1f%%)" % (
                                  op, r["case"], r["fwd"]["median_ms"], r["fwd"]["GBps"],
                                  r["fwd"]["pct_of_copy"], r["bwd"]["median_ms"],
                                  r["bwd"]["GBps"], r["bwd"]["pct_of_copy"]))
            print("copy (%s): %.3f ms, %.1f GB/s" % (copy["what"], copy["median_ms"],
                                                    copy["GBps"]))
        except Exception:
            report["timing_error"] = traceback.format_exc()
            print(report["timing_error"], file=sys.stderr)
            rc = 1
    _write(args.json, report)
    print("wrote %s" % args.json)
    return rc


def _write(path, report):
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(p)


if __name__ == "__main__":
    sys.exit(main())
