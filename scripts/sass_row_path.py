#!/usr/bin/env python3
"""SASS instructions one warp issues per row of a row kernel, along one chosen path (no GPU).

    scripts/sass_row_path.py --rules scripts/sass_row_path_router.rules [--src .] [-v]
    scripts/sass_row_path.py --rules R --dis SAVED   # a saved `nvdisasm -g -c` output instead

Builds a one-kernel cubin (the instantiation named in the rules file's `instantiate`, sm_90,
the build's device flags) from the tree at --src, disassembles it with nvdisasm (line info) and
walks the row loop, taken to be the backward branch that spans the most instructions, from its
head to that branch. Each conditional branch on the way is decided by the first rule whose source
text occurs in the source line ptxas attributes the branch to: True (taken), False (not taken) or
a list consumed in order (a loop's iterations). BRA.DIV is never taken (a converged warp); an
undecided branch stops the walk. Prints the count and the opcodes by frequency.

Static: it counts one path, not samples; data-dependent branches are fixed by the rules (each
says which way it assumes). nvcc and nvdisasm must be on PATH (nvdisasm: /usr/local/cuda/bin on
the GPU machine; here `pip download nvidia-cuda-nvdisasm` and unpack its wheel). The router's
variant 2 measured 626 before session 38's cut and 492 after.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter


def compile_and_disassemble(src, instantiate, include):
    with tempfile.TemporaryDirectory(prefix="sass_row_path.") as work:
        cu, cubin = os.path.join(work, "one.cu"), os.path.join(work, "one.cubin")
        with open(cu, "w") as f:
            f.write(f'#include "{include}"\n{instantiate}\n')
        subprocess.run(["nvcc", "-DMOE_WITH_CUDA=1", "-I" + os.path.join(src, "include"),
                        "-I" + src, "-O3", "-DNDEBUG", "-arch=sm_90", "--fmad=false", "-lineinfo",
                        "--expt-relaxed-constexpr", "-std=c++17", "-cubin", cu, "-o", cubin],
                       check=True)
        return subprocess.run(["nvdisasm", "-g", "-c", cubin], check=True, capture_output=True,
                              text=True).stdout.splitlines()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rules", required=True)
    ap.add_argument("--src", default=".")
    ap.add_argument("--dis", help="a saved `nvdisasm -g -c` output (no compile)")
    ap.add_argument("-v", action="store_true", help="print the walked instructions")
    args = ap.parse_args()
    spec = {}
    exec(open(args.rules).read(), spec)
    if args.dis:
        lines = open(args.dis).read().splitlines()
    else:
        lines = compile_and_disassemble(os.path.abspath(args.src), spec["instantiate"],
                                        spec["include"])
    ins, labels, cur, src = [], {}, None, {}
    for line in lines:
        m = re.match(r'\s*//## File "(.*?)", line (\d+)', line)
        if m:
            cur = (m.group(1), int(m.group(2)))
            continue
        m = re.match(r"^(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), cur))

    def text(loc):
        if loc is None:
            return ""
        f, n = loc
        if f not in src:
            path = f
            if not os.path.exists(path) and args.dis:  # a saved file's sources beside it
                path = os.path.join(os.path.dirname(args.dis), os.path.basename(f))
            src[f] = open(path).read().split("\n") if os.path.exists(path) else []
        return src[f][n - 1].strip() if 0 < n <= len(src[f]) else ""

    def target(t):
        m = re.search(r"BRA(?:\.DIV)?\s+(?:UR\d+,\s*)?`\((\.L_x_\d+)\)", t)
        return labels[m.group(1)] if m else None

    best = None  # the row loop: the backward branch spanning the most instructions
    for i, (_, t, _) in enumerate(ins):
        if "BRA" in t and "DIV" not in t:
            j = target(t)
            if j is not None and j < i and (best is None or i - j > best[1] - best[0]):
                best = (j, i)
    if best is None:
        sys.exit("sass_row_path: no backward branch (no row loop) in the kernel")
    start, end = best
    rules = [(s, list(d) if isinstance(d, list) else d) for s, d in spec["rules"]]
    i, n, ops, used = start, 0, Counter(), set()
    while True:
        a, t, loc = ins[i]
        n += 1
        ops[re.sub(r"^@!?U?P[T0-9]+\s+", "", t).split()[0].split(".")[0]] += 1
        if args.v:
            print(hex(a), t, "   //", loc[1] if loc else "", text(loc)[:60])
        if i == end:
            break
        if "BRA" in t and "DIV" not in t and t.startswith("@"):
            d = None
            for k, (s, dd) in enumerate(rules):
                if s in text(loc):
                    used.add(k)
                    if isinstance(dd, list):
                        if not dd:
                            sys.exit(f"sass_row_path: rule exhausted: {s}")
                        d = dd.pop(0)
                    else:
                        d = dd
                    break
            if d is None:
                sys.exit(f"sass_row_path: undecided branch at {hex(a)} ({t}), source line "
                         f"{loc}: '{text(loc)}'; {n} instructions so far")
            i = target(t) if d else i + 1
            continue
        if "BRA" in t and "DIV" not in t:
            i = target(t)
            continue
        i += 1
    print("instructions per row:", n)
    unused = [rules[k][0] for k in range(len(rules)) if k not in used]
    if unused:
        print("rules not met on the path:", unused)
    print(" ".join(f"{k}:{v}" for k, v in sorted(ops.items(), key=lambda x: -x[1])))


if __name__ == "__main__":
    main()
