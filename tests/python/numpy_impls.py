"""NumPy implementations of four MoE ops, written from docs/SPEC.md alone (not from the C++ code),
as a kernel developer would write them for moe_harness.check, and one planted bug per op.

Each implementation is impl(case, inputs, outputs): inputs and outputs are dicts of NumPy arrays
keyed by SPEC §14 names; it writes every output (the buffers arrive poisoned). Scores are
computed the way a kernel computes them (fp32 steps, fp32 selection) but with NumPy's own
exp/log1p (correctly rounded through float64), not the project's score functions: SPEC §1.4
allows two implementations' fp32 scores to differ by a few ulps.
"""
import numpy as np
import ml_dtypes

import moe_harness

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.float32
EPS = 1e-20  # SPEC §0 epsilon


def round_to(x, dtype):
    """x (float64) rounded once (RNE) to dtype; bfloat16 through a round-to-odd float32."""
    dtype = np.dtype(dtype)
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        if dtype != BF16:
            return x.astype(dtype)
        f = x.astype(F32)
        back = f.astype(np.float64)
        inexact = np.isfinite(x) & (back != x)
        over = inexact & (np.abs(back) > np.abs(x))
        f[over] = np.nextafter(f[over], F32(0))
        bits = f.view(np.uint32)
        bits[inexact] |= np.uint32(1)
    return f.astype(BF16)


# ---------------------------------------------------------------- topk_router (SPEC §1)

def _scores(x, score_function, use_pre_softmax):
    """fp32 scores s of fp32 logits x [T, E] (§1.2 step 1), correctly rounded."""
    xd = x.astype(np.float64)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        if score_function == "softmax":
            if not use_pre_softmax:
                return x.copy()
            e = np.exp(xd - xd.max(axis=1, keepdims=True))
            return (e / e.sum(axis=1, keepdims=True)).astype(F32)
        if score_function == "sigmoid":
            return (1.0 / (1.0 + np.exp(-xd))).astype(F32)
        if score_function == "sqrtsoftplus":
            sp = np.where(xd > 20, xd, np.log1p(np.exp(np.minimum(xd, 20))))
            return np.sqrt(sp).astype(F32)
    raise ValueError(score_function)


def _topk(z, k):
    """Canonical top-k per row: value descending, index ascending (stable sort of -z)."""
    return np.argsort(-z, axis=1, kind="stable")[:, :k]


def _select(z, K, num_groups, group_topk, group_score="sum"):
    T, E = z.shape
    if group_topk > 0:
        G = num_groups
        per, kg = E // G, K // group_topk
        zg = z.reshape(T, G, per)
        order = np.argsort(-zg, axis=2, kind="stable")[:, :, :kg]
        if group_score == "sum":
            acc = np.zeros((T, G), dtype=F32)
            for i in range(kg):  # fp32, in selection order
                acc = (acc + np.take_along_axis(zg, order[:, :, i:i + 1], axis=2)[:, :, 0]).astype(F32)
        else:  # planted bug: the group's best score instead of the sum of its top k'
            acc = zg.max(axis=2)
        keep_groups = _topk(acc, group_topk)
        keep = np.zeros((T, G), dtype=bool)
        np.put_along_axis(keep, keep_groups, True, axis=1)
        z = np.where(np.repeat(keep, per, axis=1), z, F32(-np.inf))
    return _topk(z, K)


def _router(case, inputs, outputs, bug=None):
    p = case.spec_params
    K, sf, pre = p["topk"], p["score_function"], p["use_pre_softmax"]
    G, gk = p["num_groups"] or 0, p["group_topk"] or 0
    scale = p["scaling_factor"]
    logits = inputs["input.logits"]
    x = logits.astype(F32)
    T, E = x.shape
    bias = inputs.get("input.expert_bias")
    s = _scores(x, sf, pre)
    b = bias.astype(F32) if bias is not None else None
    z = (s + b).astype(F32) if b is not None else s
    S = _select(z, K, G, gk, "max" if bug == "group_max" else "sum")
    routed = np.zeros((T, E), dtype=bool)
    np.put_along_axis(routed, S, True, axis=1)

    probs = np.zeros((T, E), dtype=np.float64)
    if sf == "softmax" and not pre:
        xs = np.where(routed, x.astype(np.float64), -np.inf)
        if bug == "softmax_all":  # planted bug: softmax over all experts
            xs = x.astype(np.float64)
        with np.errstate(invalid="ignore"):
            e = np.exp(xs - xs.max(axis=1, keepdims=True))
            pe = e / e.sum(axis=1, keepdims=True)
        pe = np.where(routed, pe, 0.0)
        saved = np.where(routed, pe, -np.inf).astype(F32)
        probs = pe
    elif sf == "softmax":
        saved = s
        probs = np.where(routed, s.astype(np.float64), 0.0)
    else:
        saved = s if sf == "sigmoid" else x
        v = ((s + b).astype(F32) - b).astype(F32) if b is not None else s
        v = np.where(routed, v.astype(np.float64), 0.0)
        if K > 1:
            v = v / (v.sum(axis=1, keepdims=True) + EPS)
        probs = v
    out_probs = outputs["output.probs"]
    out_probs[...] = round_to(np.where(routed, scale * probs, 0.0), out_probs.dtype)
    if p["routing_map_format"] == "bitmap_u8":
        outputs["output.routing_map"][...] = np.packbits(routed, axis=1, bitorder="little")
    else:
        outputs["output.routing_map"][...] = routed
    if "output.saved_scores" in outputs:
        outputs["output.saved_scores"][...] = saved

    if "grad.logits" not in outputs:
        return
    # §1.3 from this implementation's own saved scores, in float64.
    g = inputs["cotangent.probs"].astype(np.float64) * scale
    a = saved.astype(np.float64)
    r = routed.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        if sf in ("sigmoid", "sqrtsoftplus"):
            if sf == "sigmoid":
                y, c = a, a * (1.0 - a)
            else:
                sp = np.where(a > 20, a, np.log1p(np.exp(np.minimum(a, 20))))
                y = np.sqrt(sp)
                sig = 1.0 / (1.0 + np.exp(-a))
                c = np.where(a > 20, 1.0, sig) / (2.0 * y + EPS)
            if K > 1:
                A = (y * r).sum(axis=1, keepdims=True)
                B = (g * y * r).sum(axis=1, keepdims=True)
                g = np.where(routed, g / (A + EPS) - B / ((A + EPS) ** 2), 0.0)
            else:
                g = g * r
            grad = g * c
        elif pre:
            g = g * r
            dot = (g * a).sum(axis=1, keepdims=True)
            grad = a * (g - dot)
        else:
            aa = np.where(routed, a, 0.0)
            dot = (g * aa * r).sum(axis=1, keepdims=True)
            grad = np.where(routed, aa * (g - dot), 0.0)
    out = outputs["grad.logits"]
    out[...] = round_to(grad, out.dtype)


def topk_router(case, inputs, outputs):
    _router(case, inputs, outputs)


def topk_router_bug_group_max(case, inputs, outputs):
    _router(case, inputs, outputs, bug="group_max")


def topk_router_bug_softmax_all(case, inputs, outputs):
    _router(case, inputs, outputs, bug="softmax_all")


# ---------------------------------------------------------------- token_dispatch (SPEC §4)

def _dispatch_layout(routing_map, align):
    m = routing_map.astype(bool)
    T, E = m.shape
    c = m.sum(axis=0).astype(np.int64)
    chat = -(-c // align) * align if align >= 1 else c
    pad_off = np.concatenate([[0], np.cumsum(chat - c)[:-1]]).astype(np.int64)
    base = np.concatenate([[0], np.cumsum(c)[:-1]]).astype(np.int64)
    rank = np.cumsum(m, axis=0) - 1  # rank(t, e) where routed
    u = base[None, :] + rank          # unpadded row id
    return m, c, chat, pad_off, u


def _token_dispatch(case, inputs, outputs, bug=None):
    p = case.spec_params
    if p["drop_overflow"]:
        raise moe_harness.NotSupported("drop_overflow (SPEC §4.5's optional mode)")
    align = p["align_size"] or 0
    x = inputs["input.x"]
    probs = inputs.get("input.probs")
    m, c, chat, pad_off, u = _dispatch_layout(inputs["input.routing_map"], align)
    T, E = m.shape
    dst = u + (0 if bug == "no_pad_offset" else pad_off[None, :])
    ts, es = np.nonzero(m)
    d = dst[ts, es]
    permuted = outputs["output.permuted"]
    permuted[...] = 0
    rows = x[ts]
    if probs is not None:
        zero = probs[ts, es].astype(np.float64) == 0.0  # SPEC §4.3 quirk: zero row
        rows = np.where(zero[:, None], np.zeros_like(rows), rows)
        pp = outputs["output.permuted_probs"]
        pp[...] = 0
        pp[d] = probs[ts, es]
    permuted[d] = rows
    rim = np.full((T, 2 * E + 1), -1, dtype=np.int32)
    for t in range(T):
        ex = np.nonzero(m[t])[0][::-1]  # descending expert
        n = len(ex)
        rim[t, :n] = u[t, ex]
        rim[t, E:E + n] = ex
        rim[t, 2 * E] = n
    outputs["output.row_id_map"][...] = rim
    if "output.pad_offsets" in outputs:
        outputs["output.pad_offsets"][...] = pad_off.astype(np.int32)
    outputs["output.tokens_per_expert"][...] = chat.astype(np.int32)

    if "grad.x" in outputs:
        ct = inputs["cotangent.permuted"]
        acc = np.zeros((T, x.shape[1]), dtype=F32)
        for t in range(T):
            for e in np.nonzero(m[t])[0][::-1]:  # slot order, fp32
                acc[t] = (acc[t] + ct[dst[t, e]].astype(F32)).astype(F32)
        gx = outputs["grad.x"]
        gx[...] = round_to(acc.astype(np.float64), gx.dtype)
    if "grad.probs" in outputs:
        ctp = inputs["cotangent.permuted_probs"]
        gp = outputs["grad.probs"]
        gp[...] = 0
        gp[ts, es] = ctp[d]


def token_dispatch(case, inputs, outputs):
    _token_dispatch(case, inputs, outputs)


def token_dispatch_bug_no_pad_offset(case, inputs, outputs):
    _token_dispatch(case, inputs, outputs, bug="no_pad_offset")


# ---------------------------------------------------------------- sort_chunks_by_index (SPEC §7)

def _sort_chunks(case, inputs, outputs, bug=None):
    x = inputs["input.x"]
    split = inputs["input.split_sizes"].astype(np.int64)
    order = inputs["input.sorted_indices"].astype(np.int64)
    N = x.shape[0]
    C = len(split)
    V = int(split.sum())
    P = np.concatenate([[0], np.cumsum(split)[:-1]]).astype(np.int64)
    pos = np.empty(C, dtype=np.int64)
    pos[order] = np.arange(C)
    if bug == "no_inverse":  # planted bug: the permutation used where its inverse belongs
        pos = order.copy()
    new_off = np.concatenate([[0], np.cumsum(split[order])[:-1]]).astype(np.int64)
    dst = np.arange(N, dtype=np.int64)
    chunk = np.repeat(np.arange(C), split)
    i = np.arange(V)
    dst[:V] = new_off[pos[chunk]] + (i - P[chunk])
    outputs["output.row_id_map"][...] = dst.astype(np.int32)
    s = outputs["output.sorted"]
    s[dst] = x
    probs = inputs.get("input.probs")
    if probs is not None:
        outputs["output.sorted_probs"][dst] = probs
    if "grad.x" in outputs:
        outputs["grad.x"][...] = inputs["cotangent.sorted"][dst]
    if "grad.probs" in outputs:
        outputs["grad.probs"][...] = inputs["cotangent.sorted_probs"][dst]


def sort_chunks_by_index(case, inputs, outputs):
    _sort_chunks(case, inputs, outputs)


def sort_chunks_by_index_bug_no_inverse(case, inputs, outputs):
    _sort_chunks(case, inputs, outputs, bug="no_inverse")


# ---------------------------------------------------------------- moe_aux_loss (SPEC §3)

def _aux_loss(case, inputs, outputs, bug=None):
    p = case.spec_params
    probs = inputs["input.probs"]
    tpe = inputs["input.tokens_per_expert"]
    R, C = probs.shape
    E = p["num_experts"] or C
    T = p["total_num_tokens"] or R
    if bug == "rows_for_tokens":  # planted bug: R where total_num_tokens belongs
        T = R
    with np.errstate(divide="ignore", invalid="ignore"):  # T = 0 (planted bug): inf, NaN
        k = F32(F32(E) * F32(p["coeff"]))
        k = F32(k / F32(p["topk"]))
        k = F32(k / F32(T))
        k = F32(k / F32(T))
    col = probs.astype(np.float64).sum(axis=0)
    loss = float(k) * float((tpe.astype(F32).astype(np.float64) * col).sum())
    outputs["output.aux_loss"][...] = round_to(np.array(loss), outputs["output.aux_loss"].dtype)
    outputs["output.const_buf"][...] = np.array([k, loss], dtype=F32)
    if "grad.probs" in outputs:
        g = float(inputs["cotangent.aux_loss"].astype(np.float64))
        with np.errstate(invalid="ignore"):
            kt = (k * tpe.astype(F32)).astype(F32).astype(np.float64)
        gp = outputs["grad.probs"]
        gp[...] = round_to(np.broadcast_to(kt * g, (R, C)), gp.dtype)


def moe_aux_loss(case, inputs, outputs):
    _aux_loss(case, inputs, outputs)


def moe_aux_loss_bug_rows_for_tokens(case, inputs, outputs):
    _aux_loss(case, inputs, outputs, bug="rows_for_tokens")


_in_a_row = {"line": None, "n": 0}


def moe_aux_loss_flaky_4th_call(case, inputs, outputs):
    """A race that shows now and then: the 4th call in a row with one case is one ulp off."""
    _aux_loss(case, inputs, outputs)
    same = _in_a_row["line"] == case.line
    _in_a_row["n"] = _in_a_row["n"] + 1 if same else 1
    _in_a_row["line"] = case.line
    if _in_a_row["n"] == 4:
        cb = outputs["output.const_buf"]
        cb[0] = np.nextafter(cb[0], np.float32(np.inf))


def moe_aux_loss_hangs(case, inputs, outputs):
    """A call that never returns (a deadlock, a kernel that spins)."""
    import time
    time.sleep(600)


CORRECT = {
    "topk_router": topk_router,
    "token_dispatch": token_dispatch,
    "sort_chunks_by_index": sort_chunks_by_index,
    "moe_aux_loss": moe_aux_loss,
}
BUGGY = {
    "topk_router": [topk_router_bug_group_max, topk_router_bug_softmax_all],
    "token_dispatch": [token_dispatch_bug_no_pad_offset],
    "sort_chunks_by_index": [sort_chunks_by_index_bug_no_inverse],
    "moe_aux_loss": [moe_aux_loss_bug_rows_for_tokens],
}
