#!/usr/bin/env python3
"""The committed golden files (golden/data/*.safetensors) read and re-derived in NumPy.

Every file is loaded with safetensors.numpy, its raw layout and moe-golden/1 metadata are checked
against SPEC §14, and the outputs of these ops are recomputed from the stored inputs, independently
of the C++ code, within the SPEC §12 tolerances:

  topk_router      probs, routing_map (selection in fp32, near ties per §1.4), saved_scores
  aux_loss_scores  scores, routing_map (exact top-K of the stored fp32 scores), saved_scores
  moe_aux_loss     aux_loss, const_buf, grad.probs
  token_dispatch   permuted, permuted_probs, row_id_map, pad_offsets, tokens_per_expert (all
                   bitwise), grad.x, grad.probs

Run: python3 tests/python/test_golden.py [GOLDEN_DIR]     (ctest: python_golden)
numpy, ml_dtypes and safetensors are pip-installed into $MOE_PYDEPS (default .deps/python) when
missing. Exit status 77 (ctest: skipped) only when that is impossible.
"""
import importlib
import json
import math
import os
import struct
import subprocess
import sys
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPS = os.environ.get("MOE_PYDEPS", os.path.join(REPO, ".deps", "python"))
GOLDEN_DIR = os.path.join(REPO, "golden", "data")
SKIP = 77
PACKAGES = ["numpy", "ml_dtypes", "safetensors"]


def ensure_packages():
    """Returns None when numpy, ml_dtypes and safetensors import, else why they cannot."""
    if os.path.isdir(DEPS):
        sys.path.insert(0, DEPS)
    try:
        import ml_dtypes  # noqa: F401
        import numpy  # noqa: F401
        import safetensors.numpy  # noqa: F401
        return None
    except ImportError as e:
        missing = str(e)
    pip = [sys.executable, "-m", "pip"]
    try:
        if subprocess.run(pip + ["--version"], capture_output=True).returncode != 0:
            return "pip is not available for %s (%s)" % (sys.executable, missing)
        os.makedirs(DEPS, exist_ok=True)
        print("python_golden: %s; installing %s into %s" % (missing, " ".join(PACKAGES), DEPS))
        r = subprocess.run(pip + ["install", "--quiet", "--disable-pip-version-check",
                                  "--target", DEPS] + PACKAGES, capture_output=True, text=True)
    except OSError as e:
        return "cannot run pip: %s" % e
    if r.returncode != 0:
        return "pip install failed (no package index reachable?): %s" % r.stderr.strip()[-800:]
    if DEPS not in sys.path:
        sys.path.insert(0, DEPS)
    importlib.invalidate_caches()
    try:
        import ml_dtypes  # noqa: F401
        import numpy  # noqa: F401
        import safetensors.numpy  # noqa: F401
    except ImportError as e:
        return "installed, but still cannot import: %s" % e
    return None


# SPEC §14 params keys per op (the ops whose files may be committed).
PARAMS = {
    "topk_router": ["group_topk", "num_groups", "routing_map_format", "scaling_factor",
                    "score_function", "topk", "use_pre_softmax"],
    "aux_loss_scores": ["routing_map_format", "score_function", "topk"],
    "moe_aux_loss": ["coeff", "num_experts", "topk", "total_num_tokens"],
    "token_dispatch": ["align_size", "drop_overflow", "num_out_tokens"],
    "token_combine": [],
    "permute_index_map": ["num_out_tokens"],
    "unpermute_index_map": ["num_tokens", "topk"],
    "sort_chunks_by_index": [],
    "routing_map_to_selected_experts": ["topk"],
    "argsort_token_dispatch": ["align_size", "num_experts", "roll_to_expert_id", "topk"],
    "argsort_token_combine": ["num_real_tokens", "padding_size", "topk"],
    "ragged_a2a_params": ["direction", "num_ep"],
    "ragged_all_to_all": ["num_ep"],
    "local_permute_after_a2a": ["num_ep"],
    "local_unpermute_before_a2a": ["num_ep"],
    "grouped_gemm": [],
    "swiglu_expert_ffn": ["activation"],
    "moe_block": ["activation", "align_size", "aux_loss_coeff", "backend", "dp_size", "ep_size",
                  "group_topk", "num_experts", "num_groups", "probs_dtype", "router_logits_dtype",
                  "scaling_factor", "score_function", "topk", "use_pre_softmax"],
}
FLOAT_PARAMS = {"scaling_factor", "coeff", "aux_loss_coeff"}
DTYPES = {"F64", "F32", "BF16", "F16", "I64", "I32", "U8", "BOOL"}


def no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    dup = {k for k in keys if keys.count(k) > 1}
    if dup:
        raise ValueError("duplicate JSON keys %s" % sorted(dup))
    return dict(pairs)


def raw_header(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    text = data[8:8 + n].decode("utf-8")
    return n, text, json.loads(text, object_pairs_hook=no_duplicates), len(data) - 8 - n


def load(path):
    """Tensors as NumPy arrays (BF16 as ml_dtypes.bfloat16) and the metadata."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy; safetensors needs it for BF16)
    import safetensors
    import safetensors.numpy
    tensors = safetensors.numpy.load_file(path)
    with safetensors.safe_open(path, framework="numpy") as f:
        meta = f.metadata() or {}
    return tensors, meta


# ---------------------------------------------------------------- numerics (SPEC §0, §12)

def np_mods():
    import ml_dtypes
    import numpy as np
    return np, ml_dtypes


FORMATS = {"float32": (24, -126), "bfloat16": (8, -126), "float16": (11, -14), "float64": (53, -1022)}


def ulp(dtype_name, x):
    """Spacing of dtype at |x| (ulp of the binade; smallest subnormal step at 0), as moe::ulp."""
    np, _ = np_mods()
    p, emin = FORMATS[dtype_name]
    x = np.abs(np.asarray(x, dtype=np.float64))
    _, e = np.frexp(np.where(np.isfinite(x) & (x > 0), x, 1.0))
    e = np.where(np.isfinite(x) & (x > 0), e, emin + 1)
    return np.ldexp(1.0, np.maximum(e - 1, emin) - (p - 1))


def reduction_bound(out_dtype, ref, n, abs_sum=None):
    """SPEC §12 reduction row: 1 ulp_d(|ref|) + 2 n 2^-24 sum|x_i| (|ref| when terms unknown)."""
    np, _ = np_mods()
    ref = np.asarray(ref, dtype=np.float64)
    s = np.abs(ref) if abs_sum is None else abs_sum
    return ulp(out_dtype, ref) + 2.0 * n * 2.0 ** -24 * s


def dtype_of(arr):
    np, ml = np_mods()
    if arr.dtype == ml.bfloat16:
        return "bfloat16"
    return {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
            np.dtype(np.float64): "float64"}[arr.dtype]


def round_to(name, x):
    np, ml = np_mods()
    t = {"float32": np.float32, "bfloat16": ml.bfloat16, "float16": np.float16,
         "float64": np.float64}[name]
    return np.asarray(x, dtype=np.float64).astype(t).astype(np.float64)


def canonical_topk(values, k):
    """Indices of the k largest values, ties to the lower index (SPEC §0, IEEE equality)."""
    return sorted(range(len(values)), key=lambda e: (-float(values[e]), e))[:k]


def sigmoid64(x):
    np, _ = np_mods()
    return 1.0 / (1.0 + np.exp(-x))


def sqrtsoftplus64(x):
    np, _ = np_mods()
    return np.sqrt(np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))))


def routing_bool(rmap, E):
    """routing_map as bool [T, E] from a bytemap or an LSB-first bitmap_u8."""
    np, _ = np_mods()
    if rmap.dtype == np.bool_:
        return rmap
    bits = np.unpackbits(rmap, axis=1, bitorder="little")
    return bits[:, :E].astype(bool)


class Checker:
    def __init__(self, tc, path):
        self.tc = tc
        self.path = os.path.basename(path)

    def within(self, name, got, want, bound):
        """got (the file) within bound of want (NumPy); reports the worst element."""
        np, _ = np_mods()
        got = np.asarray(got, dtype=np.float64)
        want = np.asarray(want, dtype=np.float64)
        self.tc.assertEqual(got.shape, want.shape, "%s: %s shape" % (self.path, name))
        same_inf = (got == want) | (np.isnan(got) & np.isnan(want))
        with np.errstate(invalid="ignore"):  # inf - inf where both are the same infinity
            err = np.where(same_inf, 0.0, np.abs(got - want))
        bad = ~(err <= bound)
        if bad.any():
            i = np.unravel_index(np.argmax(np.where(bad, err / np.maximum(bound, 1e-300), 0)),
                                 got.shape)
            self.tc.fail("%s: %s: %d of %d elements outside the SPEC §12 bound; worst at %s: "
                         "file %r, numpy %r, bound %r" % (self.path, name, int(bad.sum()),
                                                          got.size, tuple(int(v) for v in i),
                                                          got[i], want[i], bound[i]))

    def exact(self, name, got, want):
        np, _ = np_mods()
        got, want = np.asarray(got), np.asarray(want)
        self.tc.assertEqual(got.shape, want.shape, "%s: %s shape" % (self.path, name))
        if got.dtype.kind == "f":
            same = got.view(np.uint8).reshape(-1) == want.astype(got.dtype).view(
                np.uint8).reshape(-1)
            ok = bool(same.all())
        else:
            ok = bool((got == want).all())
        if not ok:
            diff = np.argwhere(np.asarray(got != want).reshape(got.shape) if got.ndim else
                               np.array([got != want]))
            first = tuple(int(v) for v in diff[0]) if len(diff) else ()
            self.tc.fail("%s: %s differs from NumPy (exact comparison); first at %s: file %r, "
                         "numpy %r" % (self.path, name, first, got[first] if first else got,
                                       want[first] if first else want))


# ---------------------------------------------------------------- per-op recomputation

def check_topk_router(c, t, params):
    np, _ = np_mods()
    x = t["input.logits"]
    d = dtype_of(x)
    x64 = x.astype(np.float64)
    T, E = x.shape
    K, sf = params["topk"], params["score_function"]
    pre, scale = params["use_pre_softmax"], params["scaling_factor"]
    G, gk = params["num_groups"], params["group_topk"]
    bias = t.get("input.expert_bias")
    b32 = bias.astype(np.float32) if bias is not None else np.zeros(E, np.float32)
    stored = routing_bool(t["output.routing_map"], E)
    c.tc.assertTrue((stored.sum(axis=1) == K).all(), "%s: routing_map rows must hold topk" % c.path)

    probs = np.zeros((T, E))
    saved = np.zeros((T, E))
    near_rows = 0
    for r in range(T):
        xr = x64[r]
        # fp32 scores and selection scores (SPEC §1.2 steps 1-2), correctly rounded from double.
        if sf == "softmax":
            ex = np.exp(xr - xr.max())
            s_all = ex / ex.sum()
            s32 = (s_all if pre else xr).astype(np.float32)
        elif sf == "sigmoid":
            s32 = sigmoid64(xr).astype(np.float32)
        else:
            s32 = sqrtsoftplus64(xr).astype(np.float32)
        z = (s32 + b32) if bias is not None else s32
        zc = z.copy()
        delta = 0.0
        gmargin = math.inf
        if gk > 0:
            per, kg = E // G, K // gk
            gscore = []
            for g in range(G):
                part = z[g * per:(g + 1) * per]
                acc = np.float32(0)
                for i in canonical_topk(part, kg):
                    acc = np.float32(acc + part[i])
                gscore.append(acc)
            order = canonical_topk(gscore, G)
            for g in order[gk:]:
                zc[g * per:(g + 1) * per] = -np.inf
            if gk < G:
                a, b = float(gscore[order[gk - 1]]), float(gscore[order[gk]])
                gmargin = a - b
                delta = 16 * float(ulp("float32", max(abs(a), abs(b))))
        mine = canonical_topk(zc, K)
        margin = math.inf
        if K < E:
            allk = canonical_topk(zc, K + 1)
            kth, nxt = allk[K - 1], allk[K]
            margin = float(zc[kth]) - float(zc[nxt])
            if math.isnan(margin):
                margin = math.inf
            mag = abs(float(zc[kth]))
            if bias is not None:
                mag = max(mag, abs(float(b32[kth])), abs(float(b32[nxt])))
            delta = max(delta, 16 * float(ulp("float32", mag)))
        S = [int(e) for e in np.nonzero(stored[r])[0]]
        if sorted(mine) != S:
            # SPEC §1.4: another selection is acceptable only on a near-tie row.
            c.tc.assertTrue(margin <= delta or gmargin <= delta,
                            "%s: routing_map row %d is %s, NumPy selects %s, margin %g > delta %g"
                            % (c.path, r, S, sorted(mine), margin, delta))
            near_rows += 1
        # §1.2 steps 4-6 in double under the stored selection.
        if sf == "softmax":
            if pre:
                pe = s_all[S]
                saved[r] = s_all
            else:
                ex = np.exp(xr[S] - xr[S].max())
                pe = ex / ex.sum()
                saved[r] = -np.inf
                saved[r, S] = pe
        else:
            saved[r] = sigmoid64(xr) if sf == "sigmoid" else xr
            v = s32[S].astype(np.float64)
            if bias is not None:
                v = ((s32[S] + b32[S]) - b32[S]).astype(np.float64)  # fp32 unbias (§1.2 step 4)
            pe = v / (v.sum() + float(np.float32(1e-20))) if K > 1 else v
        probs[r, S] = scale * pe
    n = (E if (sf == "softmax" and pre) else K) + 2
    c.within("output.probs", t["output.probs"], probs, reduction_bound(d, round_to(d, probs), n))
    c.tc.assertTrue((np.asarray(t["output.probs"], np.float64)[~stored] == 0).all(),
                    "%s: non-zero probs outside the routing map" % c.path)
    c.within("output.saved_scores", t["output.saved_scores"], saved,
             reduction_bound("float32", round_to("float32", saved), n))
    return near_rows


def check_aux_loss_scores(c, t, params):
    np, _ = np_mods()
    x64 = t["input.logits"].astype(np.float64)
    T, E = x64.shape
    K, sf = params["topk"], params["score_function"]
    eps = float(np.float32(1e-20))
    if sf == "softmax":
        ex = np.exp(x64 - x64.max(axis=1, keepdims=True)) if T else x64
        sc = ex / ex.sum(axis=1, keepdims=True) if T else x64
        saved = sc
    elif sf == "sigmoid":
        u = sigmoid64(x64)
        sc = u / (u.sum(axis=1, keepdims=True) + eps)
        saved = u
    else:
        y = sqrtsoftplus64(x64)
        sc = y / (y.sum(axis=1, keepdims=True) + eps)
        saved = x64
    scores = t["output.scores"]
    c.within("output.scores", scores, sc, reduction_bound("float32", round_to("float32", sc), E + 2))
    c.within("output.saved_scores", t["output.saved_scores"], saved,
             reduction_bound("float32", round_to("float32", saved), E + 2))
    # routing_map is the canonical top-K of exactly the stored fp32 scores (§2): bitwise.
    want = np.zeros((T, E), dtype=bool)
    for r in range(T):
        want[r, canonical_topk(scores[r], K)] = True
    c.exact("output.routing_map", routing_bool(t["output.routing_map"], E), want)


def check_moe_aux_loss(c, t, params):
    np, _ = np_mods()
    probs = t["input.probs"]
    d = dtype_of(probs)
    p64 = probs.astype(np.float64)
    tpe = t["input.tokens_per_expert"]
    R, C = p64.shape
    E = params["num_experts"] if params["num_experts"] is not None else C
    T_tot = params["total_num_tokens"] if params["total_num_tokens"] is not None else R
    f = np.float32
    kappa = f(f(E) * f(params["coeff"]))  # every step in fp32, in this order (§3)
    kappa = f(kappa / f(params["topk"]))
    kappa = f(kappa / f(T_tot))
    kappa = f(kappa / f(T_tot))
    tpe32 = tpe.astype(np.float32).astype(np.float64)
    col = p64.sum(axis=0)
    loss = float(kappa) * float((tpe32 * col).sum())
    abs_sum = abs(float(kappa)) * float((np.abs(tpe32) * np.abs(p64).sum(axis=0)).sum())
    n = R * C
    c.within("output.aux_loss", t["output.aux_loss"], np.float64(loss),
             reduction_bound(d, round_to(d, loss), n, abs_sum))
    c.exact("output.const_buf[0] (kappa)", t["output.const_buf"][:1], np.array([kappa]))
    c.within("output.const_buf[1]", t["output.const_buf"][1:], np.array([loss]),
             reduction_bound("float32", round_to("float32", np.array([loss])), n,
                             np.array([abs_sum])))
    if "cotangent.aux_loss" in t:
        g = float(np.asarray(t["cotangent.aux_loss"], np.float64))
        kt = (kappa * tpe.astype(np.float32)).astype(np.float32).astype(np.float64)
        want = np.broadcast_to(kt * g, (R, C))
        dg = dtype_of(t["grad.probs"])
        c.within("grad.probs", t["grad.probs"], want, ulp(dg, round_to(dg, want)))


def check_token_dispatch(c, t, params):
    np, _ = np_mods()
    x = t["input.x"]
    rmap = t["input.routing_map"].astype(bool)
    probs = t.get("input.probs")
    T, H = x.shape
    E = rmap.shape[1]
    a = params["align_size"] or 0
    n_out = params["num_out_tokens"]
    drop = bool(params["drop_overflow"])
    count = rmap.sum(axis=0).astype(np.int64)
    ustart = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
    kept = np.clip(n_out - ustart, 0, count) if drop else count
    aligned = -(-kept // a) * a if a >= 1 else kept
    pad_off = np.concatenate([[0], np.cumsum(aligned - kept)[:-1]]).astype(np.int64)
    R_out = (n_out + E * (a - 1)) // a * a if a >= 1 else n_out
    permuted = np.zeros((R_out, H), dtype=x.dtype)
    pprobs = np.zeros(R_out, dtype=probs.dtype) if probs is not None else None
    row_id_map = np.full((T, 2 * E + 1), -1, dtype=np.int32)
    rank = np.zeros(E, dtype=np.int64)
    slots_of = []
    for r in range(T):
        slots = []
        for e in range(E):
            if not rmap[r, e]:
                continue
            u = ustart[e] + rank[e]
            rank[e] += 1
            if u >= n_out:
                continue  # dropped (drop_overflow only)
            dst = u + pad_off[e]
            slots.append((e, u, dst))
            if probs is not None:
                pprobs[dst] = probs[r, e]
                if float(probs[r, e]) == 0.0:
                    continue  # TE quirk (R12): a zero prob writes a zero row
            permuted[dst] = x[r]
        slots = slots[::-1]  # descending expert
        for k, (e, u, _) in enumerate(slots):
            row_id_map[r, k] = u
            row_id_map[r, E + k] = e
        row_id_map[r, 2 * E] = len(slots)
        slots_of.append(slots)
    c.exact("output.permuted", t["output.permuted"], permuted)
    c.exact("output.row_id_map", t["output.row_id_map"], row_id_map)
    c.exact("output.tokens_per_expert", t["output.tokens_per_expert"], aligned.astype(np.int32))
    if a >= 1:
        c.exact("output.pad_offsets", t["output.pad_offsets"], pad_off.astype(np.int32))
    else:
        c.tc.assertNotIn("output.pad_offsets", t)
    if probs is not None:
        c.exact("output.permuted_probs", t["output.permuted_probs"], pprobs)
    if "cotangent.permuted" in t:
        ct = t["cotangent.permuted"].astype(np.float64)
        gx = np.zeros((T, H))
        abs_sum = np.zeros((T, H))
        for r, slots in enumerate(slots_of):
            for (_, _, dst) in slots:
                gx[r] += ct[dst]
                abs_sum[r] += np.abs(ct[dst])
        dg = dtype_of(t["grad.x"])
        n = max(1, max((len(s) for s in slots_of), default=1))
        c.within("grad.x", t["grad.x"], gx, reduction_bound(dg, round_to(dg, gx), n, abs_sum))
        if probs is not None:
            ctp = t["cotangent.permuted_probs"]
            gp = np.zeros((T, E), dtype=ctp.dtype)
            for r, slots in enumerate(slots_of):
                for (e, _, dst) in slots:
                    gp[r, e] = ctp[dst]
            c.exact("grad.probs", t["grad.probs"], gp)


CHECKS = {
    "topk_router": check_topk_router,
    "aux_loss_scores": check_aux_loss_scores,
    "moe_aux_loss": check_moe_aux_loss,
    "token_dispatch": check_token_dispatch,
}


class GoldenFiles(unittest.TestCase):
    files = []

    def test_files_exist(self):
        self.assertTrue(self.files, "no .safetensors files under %s" % GOLDEN_DIR)
        ops = {json.loads(json.dumps(load(p)[1]))["op"] for p in self.files}
        for op in ("topk_router", "aux_loss_scores"):
            self.assertIn(op, ops, "the committed set must hold %s files" % op)

    def test_layout_and_schema(self):
        np, ml = np_mods()
        for path in self.files:
            with self.subTest(file=os.path.basename(path)):
                n, text, header, data_len = raw_header(path)
                self.assertEqual(n % 8, 0, "header padded to a multiple of 8")
                self.assertTrue(text.startswith("{") and text.rstrip(" ").endswith("}"))
                names = sorted((k for k in header if k != "__metadata__"),
                               key=lambda s: s.encode("utf-8"))
                off = 0
                for name in names:  # ascending byte-wise name order, from 0, no holes
                    e = header[name]
                    self.assertIn(e["dtype"], DTYPES)
                    self.assertEqual(e["data_offsets"][0], off, name)
                    off = e["data_offsets"][1]
                self.assertEqual(off, data_len)

                tensors, meta = load(path)
                self.assertEqual(meta.get("format"), "moe-golden/1")
                op = meta["op"]
                self.assertIn(op, PARAMS)
                self.assertIn(meta["dtype"], ("float32", "bfloat16", "float16"))
                self.assertTrue(meta["seed"].isdigit())
                params = json.loads(meta["params"], object_pairs_hook=no_duplicates)
                self.assertEqual(sorted(params), PARAMS[op])
                self.assertEqual(json.dumps(params, sort_keys=True, separators=(",", ":")),
                                 meta["params"], "params compact with sorted keys")
                for k in FLOAT_PARAMS & set(params):
                    self.assertTrue(params[k] is None or isinstance(params[k], float), k)
                for k in ("x-generator", "x-git", "x-backend", "x-case"):
                    self.assertIn(k, meta)
                for name, arr in tensors.items():
                    prefix = name.split(".", 1)[0]
                    self.assertIn(prefix, ("input", "output", "cotangent", "grad"), name)
                    if arr.dtype == np.bool_:
                        continue
                    if name.startswith("grad."):
                        self.assertIn("input." + name[5:], tensors)
                    if name.startswith("cotangent."):
                        self.assertIn("output." + name[10:], tensors)
                # The activation dtype is the dtype of the op's first float input.
                floats = [a for k, a in sorted(tensors.items())
                          if k.startswith("input.") and a.dtype.kind == "f" or
                          (k.startswith("input.") and a.dtype == ml.bfloat16)]
                self.assertTrue(any(dtype_of(a) == meta["dtype"] for a in floats) or not floats)

    def test_recompute_in_numpy(self):
        done = {}
        for path in self.files:
            tensors, meta = load(path)
            op = meta["op"]
            if op not in CHECKS:
                continue
            with self.subTest(file=os.path.basename(path)):
                CHECKS[op](Checker(self, path), tensors, json.loads(meta["params"]))
                done[op] = done.get(op, 0) + 1
        print("\nrecomputed in NumPy: %s" % ", ".join("%s %d" % kv for kv in sorted(done.items())))
        for op in ("topk_router", "aux_loss_scores"):
            self.assertGreater(done.get(op, 0), 0, "no %s file was recomputed" % op)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    global GOLDEN_DIR
    if args:
        GOLDEN_DIR = os.path.abspath(args[0])
    why = ensure_packages()
    if why:
        print("python_golden: SKIPPED: %s" % why)
        return SKIP
    files = []
    for root, _, names in os.walk(GOLDEN_DIR):
        files += [os.path.join(root, n) for n in names if n.endswith(".safetensors")]
    GoldenFiles.files = sorted(files)
    print("python_golden: %d files under %s" % (len(files), GOLDEN_DIR))
    suite = unittest.defaultTestLoader.loadTestsFromTestCase(GoldenFiles)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
