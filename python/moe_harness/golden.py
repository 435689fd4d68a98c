"""Golden files (SPEC §14, moe-golden/1 safetensors) from Python: write files that
`moe-harness golden verify` accepts, read ours and anyone's, verify in-process.

    case = moe_harness.cases("topk_router", n=1)[0]
    outs = my_router(case.inputs())                         # NumPy / torch / JAX arrays
    moe_harness.golden.write("router.safetensors", case, outputs=outs, grads={"logits": gl})
    f = moe_harness.golden.read("router.safetensors")       # f.tensors, f.params, f.metadata

A file may be forward-only (no grads: no cotangent.* and grad.* are written) and may hold only
the outputs an implementation has (topk_router without output.saved_scores, as TE's public
router returns). Optional parameters may be null (params={"num_groups": None, ...}).
"""
import json

from . import _core
from ._frameworks import to_numpy


def _prefixed(d, prefix):
    return {(k if "." in k else prefix + k): to_numpy(v) for k, v in (d or {}).items()}


class GoldenFile:
    """A golden file as read: metadata (strings), tensors (NumPy, keyed by SPEC §14 name)."""

    def __init__(self, path, metadata, tensors):
        self.path = path
        self.metadata = dict(metadata)
        self.tensors = dict(tensors)

    op = property(lambda self: self.metadata.get("op"))
    dtype = property(lambda self: self.metadata.get("dtype"))

    @property
    def seed(self):
        s = self.metadata.get("seed")
        return int(s) if s is not None else None

    @property
    def params(self):
        """The `params` object (None for null parameters)."""
        p = self.metadata.get("params")
        return json.loads(p) if p is not None else None

    @property
    def case(self):
        """The exact Case of a file written by the harness (its x-case), else None."""
        from . import Case
        line = self.metadata.get("x-case")
        return Case(line) if line else None

    def _group(self, prefix):
        return {k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)}

    inputs = property(lambda self: self._group("input."))
    outputs = property(lambda self: self._group("output."))
    cotangents = property(lambda self: self._group("cotangent."))
    grads = property(lambda self: self._group("grad."))

    def __repr__(self):
        return "<moe_harness.golden.GoldenFile %s op=%s dtype=%s: %s>" % (
            self.path, self.op, self.dtype, ", ".join(sorted(self.tensors)))


def read(path):
    """Reads any safetensors file with the harness's strict reader (ValueError on a malformed
    one); BF16 tensors as ml_dtypes.bfloat16."""
    r = _core.golden_read(str(path))
    return GoldenFile(str(path), r["metadata"], r["tensors"])


def write(path, case=None, outputs=None, grads=None, *, inputs=None, cotangents=None, op=None,
          dtype=None, seed=None, params=None, metadata=None, x_case=None):
    """Writes one moe-golden/1 file.

    case: a moe_harness.Case giving op, dtype, seed, params (its SPEC §14 params) and, unless
    given, the inputs (input.*) and, when grads are given, the cotangents (cotangent.*).
    Without a case, op, dtype, seed, params and inputs are required.
    outputs / grads / inputs / cotangents: dicts of arrays of any framework; bare names get
    their prefix (probs -> output.probs). grads=None writes a forward-only file.
    params: the SPEC §14 params object, or with a case a dict of overrides (None = null).
    metadata: extra x-* keys. x_case: store the case line as x-case (default: when the file
    holds the case's own inputs and params), so `golden verify` rebuilds the exact case.
    The file is checked against the schema before it is written (ValueError naming the fault).
    """
    tensors = {}
    if case is not None:
        op = op or case.op
        dtype = dtype or case.dtype
        seed = case.seed if seed is None else seed
        p = case.spec_params
        own = inputs is None and params is None
        if params:
            unknown = set(params) - set(p)
            if unknown:
                raise ValueError("params: %s not params of %s (%s)" % (
                    sorted(unknown), op, sorted(p)))
            p.update(params)
        params = p
        case_in = case.inputs()
        if inputs is None:
            inputs = {k: v for k, v in case_in.items() if k.startswith("input.")}
        if grads is not None and cotangents is None:
            cotangents = {k: v for k, v in case_in.items() if k.startswith("cotangent.")}
        if x_case is None:
            x_case = own
    else:
        missing = [n for n, v in (("op", op), ("dtype", dtype), ("seed", seed), ("params", params),
                                  ("inputs", inputs)) if v is None]
        if missing:
            raise ValueError("write without a case needs %s" % ", ".join(missing))
    tensors.update(_prefixed(inputs, "input."))
    tensors.update(_prefixed(outputs, "output."))
    if grads is not None:
        tensors.update(_prefixed(cotangents, "cotangent."))
        tensors.update(_prefixed(grads, "grad."))
    extra = {"x-generator": "moe_harness-python %s" % _core.version}
    if x_case and case is not None:
        extra["x-case"] = case.line
    for k, v in (metadata or {}).items():
        if not k.startswith("x-"):
            raise ValueError("metadata: extra keys must start with 'x-' (got %r)" % k)
        extra[k] = str(v)
    _core.golden_write(str(path), tensors, op, str(dtype), int(seed),
                       json.dumps(params, allow_nan=False), extra)
    return str(path)


class VerifyResult:
    def __init__(self, r):
        self.path, self.op, self.dtype = r["path"], r["op"], r["dtype"]
        self.verdict = r["verdict"]        # PASS, FAIL, ERROR
        self.worst_pct = r["worst_pct"]
        self.report = r["report"]
        self.replay = r["replay"]

    def __bool__(self):
        return self.verdict == "PASS"

    def __str__(self):
        s = "%s %s (%s, %s), worst %.1f%% of tolerance\n" % (
            self.verdict, self.path, self.op, self.dtype, self.worst_pct)
        if self.verdict != "PASS":
            s += self.report + "  replay: " + self.replay + "\n"
        return s

    __repr__ = __str__


def verify(path, impl="reference", ties="canonical", framework="numpy", device=None,
           provides=None):
    """Verifies one file as `moe-harness golden verify --impl` does: the implementation runs
    on the file's inputs and is compared with the file's outputs. impl: a registered name
    ("reference") or a Python implementation (as for moe_harness.check). Returns a
    VerifyResult (truthy when it passed)."""
    if isinstance(impl, str):
        return VerifyResult(_core.golden_verify(str(path), impl, ties))
    from . import _register
    op = read(path).op
    pyimpl = _register(op, impl, framework, device, None, True, provides)
    try:
        return VerifyResult(_core.golden_verify(str(path), pyimpl.name, ties))
    finally:
        pyimpl.release()
