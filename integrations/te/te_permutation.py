"""TransformerEngine's Triton mask-map permutation kernels as moe_harness implementations.

TE (2.20.2, the `transformer-engine-cu13` wheel that `../shared/gpu-deps/te/fetch_te.sh .te`
unpacks) ships the kernels in `transformer_engine/common/triton/permutation.py` and their PyTorch
launchers in `transformer_engine/pytorch/triton/permutation.py`. The autograd glue that calls
those launchers (`moe_permute`, `moe_permute_with_probs`, `moe_permute_and_pad_with_probs`,
`moe_unpermute`, `moe_sort_chunks_by_index[_with_probs]` and their `te_moe::*` custom ops) lives in
`transformer_engine/pytorch/permutation.py`, which needs TE's compiled PyTorch extension and is
not in the wheel. This module repeats only that glue's argument plumbing (and the few torch
calls it makes, so TE's op is judged as users run it), citing it as
"TE pytorch/permutation.py:LINE" (and "TE jax/permutation.py:LINE") -- line numbers of
NVIDIA/TransformerEngine at d0067d0 (the
mirror HEAD, 2.20.0.dev0; the wheel's launcher file is byte-identical to that commit's).
Launcher lines are cited as "TE pytorch/triton/permutation.py:LINE" and kernel lines as
"TE common/triton/permutation.py:LINE", both of the 2.20.2 wheel.

Harness ops implemented (SPEC §4, §5, §7):

    token_dispatch        make_row_id_map + permute_with_mask_map; backward unpermute_with_mask_map
    token_combine         unpermute_with_mask_map; backward
                          unpermute_with_mask_map_bwd_with_merging_probs (merging probs) or
                          permute_with_mask_map (no merging probs)
    sort_chunks_by_index  make_chunk_sort_map + sort_chunks_by_map(is_forward=True);
                          backward sort_chunks_by_map(is_forward=False)

IMPLS maps each op to (impl, provides); `NOT_PROVIDED` says why an output is left out.

Loading: TE's package `__init__` imports the compiled extension, so it is never run; stub package
modules (`transformer_engine`, `.common`, `.common.triton`, `.pytorch`, `.pytorch.triton`) are
registered in sys.modules and the two permutation files are loaded from MOE_TE_PYTHON (default
<repo>/.te/python) with importlib.

CPU (no GPU): with TRITON_INTERPRET=1 Triton's interpreter runs the kernels on CPU tensors.
TE's launchers allocate with device="cuda" literally, so for a CPU device the launcher module's
`torch` name is replaced by a proxy that turns device="cuda" into "cpu" (nothing else changes),
and the autotuned kernels are pinned to one BLOCK_SIZE (MOE_TE_INTERPRET_BLOCK, default 64): the
autotuner's benchmark needs a GPU driver, and TE's results do not depend on the block size.
On a CUDA device nothing is patched.
"""
import importlib.util
import os
import sys
import types
from pathlib import Path

import moe_harness

REPO = Path(__file__).resolve().parents[2]
TE_PYTHON_DEFAULT = REPO / ".te" / "python"

_AUTOTUNED = ("_permute_kernel", "_unpermute_kernel", "_unpermute_bwd_with_merging_probs_kernel",
              "_sort_chunks_by_map_kernel")


class TEUnavailable(RuntimeError):
    """TE's Triton sources, torch or triton are missing."""


class TEResultMismatch(RuntimeError):
    """TE produced a tensor whose shape (or float dtype) is not the SPEC's: a departure the
    harness cannot compare element by element, reported as a failure with this message."""


def te_python_dir():
    return Path(os.environ.get("MOE_TE_PYTHON", str(TE_PYTHON_DEFAULT)))


def te_version():
    """The wheel's version from <te_python>/../TE_VERSION (what fetch_te.sh writes), or None."""
    f = te_python_dir().parent / "TE_VERSION"
    try:
        for line in f.read_text().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_STATE = {}


class _CpuAllocTorch:
    """`torch` for TE's launcher module on a CPU device (Triton interpreter): device="cuda" in
    torch.empty / torch.zeros becomes "cpu"; every other attribute is torch's own."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        attr = getattr(self._torch, name)
        if name in ("empty", "zeros"):
            def alloc(*args, **kw):
                if kw.get("device") == "cuda":
                    kw["device"] = "cpu"
                return attr(*args, **kw)
            return alloc
        return attr


def _stub_package(name, path):
    m = sys.modules.get(name)
    if m is not None:
        if getattr(m, "__path__", None) and str(path) in list(m.__path__):
            return m
        raise TEUnavailable("module %s is already imported from %s; cannot load TE's Triton "
                            "permutation from %s" % (name, getattr(m, "__path__", m), path))
    m = types.ModuleType(name)
    m.__path__ = [str(path)]
    m.__package__ = name
    sys.modules[name] = m
    return m


def _load_file(name, path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, str(path))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


def load(device="cuda"):
    """TE's PyTorch Triton launcher module (transformer_engine.pytorch.triton.permutation),
    loaded once; for a non-CUDA device prepared for Triton's interpreter (see the module doc).
    Raises TEUnavailable when torch, triton or the TE sources are missing."""
    dev = str(device).split(":")[0]
    if "mod" in _STATE:
        if _STATE["dev"] != dev:
            raise TEUnavailable("TE permutation already loaded for device %r, not %r" %
                                (_STATE["dev"], dev))
        return _STATE["mod"]
    try:
        import torch
        import triton
    except ImportError as e:
        raise TEUnavailable("torch and triton are needed: %s" % e) from None
    te = te_python_dir() / "transformer_engine"
    common_f = te / "common" / "triton" / "permutation.py"
    launch_f = te / "pytorch" / "triton" / "permutation.py"
    for f in (common_f, launch_f):
        if not f.is_file():
            raise TEUnavailable("%s is missing (set MOE_TE_PYTHON, or run "
                                "../shared/gpu-deps/te/fetch_te.sh .te)" % f)
    if dev != "cuda" and not interpreting():
        raise TEUnavailable("device %r needs Triton's interpreter: set TRITON_INTERPRET=1 before "
                            "loading TE's kernels" % dev)
    _stub_package("transformer_engine", te)
    _stub_package("transformer_engine.common", te / "common")
    _stub_package("transformer_engine.common.triton", te / "common" / "triton")
    _stub_package("transformer_engine.pytorch", te / "pytorch")
    _stub_package("transformer_engine.pytorch.triton", te / "pytorch" / "triton")
    kernels = _load_file("transformer_engine.common.triton.permutation", common_f)
    mod = _load_file("transformer_engine.pytorch.triton.permutation", launch_f)
    if dev != "cuda":
        mod.torch = _CpuAllocTorch(torch)
        bs = int(os.environ.get("MOE_TE_INTERPRET_BLOCK", "64"))
        for k in _AUTOTUNED:
            tuner = getattr(kernels, k)
            if hasattr(tuner, "configs"):  # a triton.autotune'd kernel (TE wraps it in try)
                tuner.configs = [triton.Config({"BLOCK_SIZE": bs})]
    _STATE.update(mod=mod, kernels=kernels, dev=dev)
    return mod


# ----------------------------------------------------------------------------- result plumbing

def _put(outputs, key, t, where):
    """Copies TE's tensor t into the harness output `key`: the shape must be the SPEC's; a float
    dtype too (an integer index tensor may widen/narrow, values are compared exactly; an empty
    tensor has no values)."""
    dst = outputs[key]
    if tuple(t.shape) != tuple(dst.shape):
        raise TEResultMismatch("%s: TE returned shape %s, the SPEC's is %s (%s)" %
                               (key, list(t.shape), list(dst.shape), where))
    if t.dtype != dst.dtype and t.numel() and (t.dtype.is_floating_point or
                                                dst.dtype.is_floating_point):
        raise TEResultMismatch("%s: TE returned dtype %s, the SPEC's is %s (%s)" %
                               (key, t.dtype, dst.dtype, where))
    dst.copy_(t)


def _put_all(outputs, items):
    """_put for each (key, tensor, where) whose key the case has; every mismatch is reported."""
    bad = []
    for key, t, where in items:
        if key not in outputs:
            continue
        try:
            _put(outputs, key, t, where)
        except TEResultMismatch as e:
            bad.append(str(e))
    if bad:
        raise TEResultMismatch("; ".join(bad))


# ----------------------------------------------------------------------------- token_dispatch

def dispatch_forward(te, x, routing_map, probs, num_out_tokens, align_size, rows):
    """TE's mask-map permute forward as the autograd glue runs it.

    align_size == 0: moe_permute / moe_permute_with_probs -> te_moe::permute_mask_map_fwd with
    pad_offsets=None (TE pytorch/permutation.py:918-920, 957-959).
    align_size >= 1: moe_permute_and_pad_with_probs's torch arithmetic (TE
    pytorch/permutation.py:1004-1018) from the caller's tokens_per_expert = routing_map.sum(0)
    (its documented input, :987-988), then the same custom op with those pad_offsets.
    `rows` is the permuted buffer's row count handed to TE's launcher as num_out_tokens: the
    SPEC's R_out -- N_out, or with padding the worst case floor((N_out + E(a-1))/a)*a that TE-JAX
    allocates. TE-PyTorch's padded API instead passes the exact target_tokens_per_expert.sum()
    (:1021) <= R_out, and when no expert needs padding it passes pad_offsets=None (:1011-1012), so
    the launcher allocates with torch.empty (TE pytorch/triton/permutation.py:162). With the
    exact size that changes no row (every row is owned); with the harness's worst-case buffer it
    would leave the rows past sum(target) unwritten, rows TE-PyTorch never allocates. So the
    all-zero pad_offsets are passed as a tensor, as TE-JAX does whenever padding is on together
    with this worst-case size (TE jax/permutation.py:187-194, 295-309; its buffer then
    zero-initialised, jax/triton_extensions/permutation.py:515-525); the launcher then
    zero-allocates (:162). The guard of :314 is applied to the value TE-PyTorch would
    pass.
    Returns a dict: permuted, permuted_probs, row_id_map, pad_offsets, target_tokens_per_expert,
    empty_input."""
    import torch
    T, H = x.shape[0], x.shape[1]
    E = routing_map.shape[1]
    pad_offsets = None
    target = None
    te_num_out = num_out_tokens
    if align_size >= 1:
        tokens_per_expert = routing_map.sum(dim=0)  # the caller's counts (int64)
        # TE pytorch/permutation.py:1009-1018, verbatim torch calls
        target = (torch.ceil(tokens_per_expert / align_size) * align_size).long()
        # :1011-1012 (torch.equal -> pad_offsets None) not taken, see above; :1014-1018:
        pad_lengths = target - tokens_per_expert
        cum_pad = torch.cumsum(pad_lengths, dim=0)
        pad_offsets = torch.cat(
            [torch.zeros(1, dtype=cum_pad.dtype, device=x.device), cum_pad[:-1]])
        te_num_out = int(target.sum().item())  # TE pytorch/permutation.py:1021
    st = dict(pad_offsets=pad_offsets, target_tokens_per_expert=target, T=T, E=E, H=H)
    # te_moe::permute_mask_map_fwd, TE pytorch/permutation.py:292-293: empty input short-circuit
    if not x.numel():
        st.update(permuted=x.clone(), row_id_map=torch.tensor([], device=x.device),
                  permuted_probs=torch.tensor([], device=x.device), empty_input=True)
        return st
    if te_num_out <= 0:  # TE pytorch/permutation.py:314
        raise moe_harness.NotSupported(
            "TE's mask-map permute requires num_out_tokens > 0 (TE pytorch/permutation.py:314"
            "%s); this case's is %d" % (", passed as target_tokens_per_expert.sum() at :1021"
                                        if align_size >= 1 else "", te_num_out))
    row_id_map = te.make_row_id_map(routing_map, T, E)  # :321
    permuted, _, permuted_probs = te.permute_with_mask_map(  # :370-381 (no FP8: scale None)
        x, row_id_map, probs, None, pad_offsets, T, E, rows, H, None)
    st.update(permuted=permuted, row_id_map=row_id_map, permuted_probs=permuted_probs,
              empty_input=False)
    return st


def dispatch_backward(te, st, ct_permuted, ct_permuted_probs, needs_probs_grad):
    """_moe_permute_mask_map_backward_wrapper + te_moe::permute_mask_map_bwd (TE
    pytorch/permutation.py:526-563, 464-486). Returns (grad_x, grad_probs or None)."""
    import torch
    if st["empty_input"]:  # :530-539
        # TE's autograd hands back grad_output, which has the shape of TE's forward output
        # (x.clone(), zero elements); the harness's cotangent has the SPEC's shape.
        if ct_permuted.shape != st["permuted"].shape:
            ct_permuted = ct_permuted.new_empty(st["permuted"].shape)
        probs_grad = None
        if needs_probs_grad:
            probs_grad = torch.zeros((st["T"], st["E"]), dtype=ct_permuted_probs.dtype,
                                     device=ct_permuted_probs.device)
        return ct_permuted, probs_grad
    # :548 -- the permuted_probs cotangent only if it has content
    ctp = ct_permuted_probs if (ct_permuted_probs is not None and
                                ct_permuted_probs.numel() > 0) else None
    act_grad, probs_grad = te.unpermute_with_mask_map(  # :474-483
        ct_permuted, st["row_id_map"], None, ctp, st["pad_offsets"], st["T"], st["E"], st["H"])
    if not needs_probs_grad:  # :560-561
        probs_grad = None
    return act_grad, probs_grad


def token_dispatch(case, inputs, outputs):
    """SPEC §4 token_dispatch through TE's mask-map permute (see dispatch_forward)."""
    p = case.spec_params
    if p.get("drop_overflow"):
        raise moe_harness.NotSupported(
            "drop_overflow: TE's mask-map permute has no token dropping -- every routed slot "
            "gets a row (TE common/triton/permutation.py:266-303, no capacity check); SPEC §4.5 "
            "optional mode, upstream TE PR #3347 unmerged")
    te = load(inputs["input.x"].device.type)
    x = inputs["input.x"]
    rmap = inputs["input.routing_map"]
    probs = inputs.get("input.probs")
    a = int(p.get("align_size") or 0)
    rows = outputs["output.permuted"].shape[0]
    st = dispatch_forward(te, x, rmap, probs, int(p["num_out_tokens"]), a, rows)
    items = [("output.permuted", st["permuted"], "te_moe::permute_mask_map_fwd"),
             # compared on the first n_t entries of each half and the count: the rest TE leaves
             # stale (common/triton/permutation.py:186-201), masked by unwritten="te" (SPEC §4.2)
             ("output.row_id_map", st["row_id_map"], "make_row_id_map")]
    if probs is not None:
        items.append(("output.permuted_probs", st["permuted_probs"],
                      "te_moe::permute_mask_map_fwd"))
    if "output.pad_offsets" in outputs:
        items.append(("output.pad_offsets", st["pad_offsets"], "moe_permute_and_pad_with_probs"))
    gx, gp = dispatch_backward(te, st, inputs.get("cotangent.permuted"),
                               inputs.get("cotangent.permuted_probs"), probs is not None)
    items.append(("grad.x", gx, "te_moe::permute_mask_map_bwd"))
    if probs is not None:
        if gp is None:
            raise TEResultMismatch("grad.probs: TE returned None for probs given (TE "
                                   "pytorch/permutation.py:548, 560)")
        items.append(("grad.probs", gp, "te_moe::permute_mask_map_bwd"))
    _put_all(outputs, items)


# ----------------------------------------------------------------------------- token_combine

def combine_forward(te, permuted, row_id_map, merging_probs, pad_offsets, num_tokens):
    """moe_unpermute(map_type="mask", restore_shape=(T, H)) -> te_moe::unpermute_mask_map_fwd
    (TE pytorch/permutation.py:1088-1102, 576-601). Returns the state dict (combined, ...)."""
    H = permuted.shape[1]
    T = num_tokens
    E = (row_id_map.size(1) - 1) // 2 if row_id_map.dim() > 1 else 0  # :1092
    st = dict(T=T, E=E, H=H, permuted=permuted, row_id_map=row_id_map,
              merging_probs=merging_probs, pad_offsets=pad_offsets,
              empty_input=permuted.size(0) == 0)  # :798
    if not permuted.numel():  # :586-587
        st["combined"] = permuted.clone()
        return st
    combined, _ = te.unpermute_with_mask_map(  # :591-600
        permuted, row_id_map, merging_probs, None, pad_offsets, T, E, H)
    st["combined"] = combined
    return st


def combine_backward(te, st, ct_combined, needs_probs_grad):
    """_moe_unpermute_mask_map_backward_wrapper (TE pytorch/permutation.py:812-855): with merging
    probs te_moe::unpermute_mask_map_bwd_with_probs (:619-642) on the saved forward input,
    otherwise te_moe::unpermute_mask_map_bwd_no_probs (:672-774), i.e. permute_with_mask_map
    into num_permuted_tokens = the forward input's rows (:801). Returns (grad_permuted,
    grad_merging_probs or None)."""
    import torch
    mp = st["merging_probs"]
    if st["empty_input"]:  # :814-819
        # grad_output has the shape of TE's forward output (permuted.clone(), zero elements)
        if ct_combined.shape != st["combined"].shape:
            ct_combined = ct_combined.new_empty(st["combined"].shape)
        probs_grad = torch.zeros_like(mp) if (mp is not None and needs_probs_grad) else None
        return ct_combined, probs_grad
    R_in = st["permuted"].size(0)
    if mp is not None:
        act_grad, probs_grad = te.unpermute_with_mask_map_bwd_with_merging_probs(  # :631-641
            ct_combined, st["row_id_map"], st["permuted"], mp, st["pad_offsets"], st["T"],
            st["E"], R_in, st["H"])
    else:
        act_grad, _, _ = te.permute_with_mask_map(  # :725-736 (no FP8: scale None)
            ct_combined, st["row_id_map"], None, None, st["pad_offsets"], st["T"], st["E"],
            R_in, st["H"], None)
        probs_grad = None
    if not needs_probs_grad:  # :852-853
        probs_grad = None
    return act_grad, probs_grad


def token_combine(case, inputs, outputs):
    """SPEC §5 token_combine through TE's mask-map unpermute. The harness's row_id_map (−1 in
    the unused entries, SPEC §4.2) is passed as is: TE's kernels read only the first n_t entries
    of each half and the count (TE common/triton/permutation.py:374-384, 474-484)."""
    permuted = inputs["input.permuted"]
    te = load(permuted.device.type)
    rim = inputs["input.row_id_map"]
    mp = inputs.get("input.merging_probs")
    pad = inputs.get("input.pad_offsets")
    st = combine_forward(te, permuted, rim, mp, pad, rim.shape[0])
    items = [("output.combined", st["combined"], "te_moe::unpermute_mask_map_fwd")]
    if "cotangent.combined" in inputs:
        gperm, gmp = combine_backward(te, st, inputs["cotangent.combined"], mp is not None)
        items.append(("grad.permuted", gperm, "te_moe::unpermute_mask_map_bwd_*"))
        if mp is not None:
            items.append(("grad.merging_probs", gmp, "te_moe::unpermute_mask_map_bwd_with_probs"))
    _put_all(outputs, items)


# ----------------------------------------------------------------------------- sort_chunks_by_index

def sort_chunks_forward(te, x, split_sizes, sorted_indices, probs):
    """moe_sort_chunks_by_index[_with_probs] -> te_moe::chunk_sort_fwd (TE
    pytorch/permutation.py:1313, 1341-1343, 1110-1157)."""
    import torch
    N = x.shape[0]
    st = dict(N=N, H=x.shape[1], empty_input=N == 0)  # :1249
    if not x.numel():  # :1117-1119
        st.update(sorted=x.clone(),
                  sorted_probs=probs.clone() if probs is not None else
                  torch.empty(0, device=x.device),
                  row_id_map=torch.empty(0, device=x.device, dtype=torch.int32))
        return st
    num_tokens, hidden_size = x.shape  # :1121
    num_splits = split_sizes.size(0)  # :1122
    row_id_map = te.make_chunk_sort_map(split_sizes, sorted_indices, num_tokens, num_splits)
    out, sorted_probs = te.sort_chunks_by_map(x, row_id_map, probs, num_tokens, hidden_size,
                                              is_forward=True)  # :1137-1144
    st.update(sorted=out, sorted_probs=sorted_probs, row_id_map=row_id_map)
    return st


def sort_chunks_backward(te, st, ct_sorted, ct_sorted_probs, needs_probs_grad):
    """_moe_chunk_sort_backward_wrapper + te_moe::chunk_sort_bwd (TE
    pytorch/permutation.py:1256-1277, 1181-1217). Returns (grad_x, grad_probs or None)."""
    if st["empty_input"]:  # :1258-1260
        return ct_sorted, (ct_sorted_probs if needs_probs_grad else None)
    ctp = ct_sorted_probs if (ct_sorted_probs is not None and
                              ct_sorted_probs.numel() > 0) else None  # :1264
    act_grad, probs_grad = te.sort_chunks_by_map(ct_sorted, st["row_id_map"], ctp, st["N"],
                                                 st["H"], is_forward=False)  # :1196-1203
    if not needs_probs_grad:  # :1274-1275
        probs_grad = None
    return act_grad, probs_grad


def sort_chunks_by_index(case, inputs, outputs):
    """SPEC §7 sort_chunks_by_index through TE's make_chunk_sort_map + sort_chunks_by_map. TE's
    row_id_map is dst(i) per input row (TE common/triton/permutation.py:580-585), the SPEC's
    layout, so it is compared."""
    x = inputs["input.x"]
    te = load(x.device.type)
    probs = inputs.get("input.probs")
    st = sort_chunks_forward(te, x, inputs["input.split_sizes"], inputs["input.sorted_indices"],
                             probs)
    items = [("output.sorted", st["sorted"], "te_moe::chunk_sort_fwd"),
             ("output.row_id_map", st["row_id_map"], "make_chunk_sort_map")]
    if probs is not None:
        items.append(("output.sorted_probs", st["sorted_probs"], "te_moe::chunk_sort_fwd"))
    if "cotangent.sorted" in inputs:
        gx, gp = sort_chunks_backward(te, st, inputs["cotangent.sorted"],
                                      inputs.get("cotangent.sorted_probs"), probs is not None)
        items.append(("grad.x", gx, "te_moe::chunk_sort_bwd"))
        if probs is not None:
            if gp is None:
                raise TEResultMismatch("grad.probs: TE returned None for probs given (TE "
                                       "pytorch/permutation.py:1264, 1274)")
            items.append(("grad.probs", gp, "te_moe::chunk_sort_bwd"))
    _put_all(outputs, items)


# ----------------------------------------------------------------------------- registry

# Outputs the harness compares that these implementations do not provide, and why.
NOT_PROVIDED = {
    "token_dispatch": {
        "output.tokens_per_expert":
            "TE's mask-map permute returns no per-expert counts (moe_permute, "
            "moe_permute_with_probs: TE pytorch/permutation.py:918-921, 957-960); only the padded "
            "API returns target_tokens_per_expert, computed from counts the caller passes in "
            "(:1009, :1023). Its value is checked through output.pad_offsets and the padded "
            "layout of output.permuted",
    },
    "token_combine": {},
    "sort_chunks_by_index": {},
}

_ALL_OUTPUTS = {
    "token_dispatch": ["output.permuted", "output.permuted_probs", "output.row_id_map",
                       "output.pad_offsets", "output.tokens_per_expert", "grad.x", "grad.probs"],
    "token_combine": ["output.combined", "grad.permuted", "grad.merging_probs"],
    "sort_chunks_by_index": ["output.sorted", "output.row_id_map", "output.sorted_probs",
                             "grad.x", "grad.probs"],
}


def provides(op):
    """The provides= list of op (None: every output)."""
    if not NOT_PROVIDED[op]:
        return None
    return [k for k in _ALL_OUTPUTS[op] if k not in NOT_PROVIDED[op]]


IMPLS = {
    "token_dispatch": token_dispatch,
    "token_combine": token_combine,
    "sort_chunks_by_index": sort_chunks_by_index,
}
