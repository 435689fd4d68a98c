"""moe_harness: check PyTorch, JAX, CuPy and NumPy Mixture-of-Experts implementations against the
moe-harness reference (docs/SPEC.md), from Python and pytest.

    import moe_harness

    moe_harness.ops()                                   # the registered ops
    for case in moe_harness.cases("topk_router", n=20, seed=1, score_function="sigmoid"):
        inputs = case.inputs(framework="torch", device="cuda")   # input.*, cotangent.*
        outputs = my_router(case, inputs)                # {"output.probs": ..., ...}
        report = case.compare(outputs)                   # bool(report): the verdict
        assert report, str(report)                       # str(report): the CLI's report

    moe_harness.check("topk_router", impl, cases=100, seed=1, framework="torch", device="cuda")

An implementation is a callable impl(case, inputs, outputs): inputs and outputs are dicts keyed by
SPEC §14 names (input.logits, cotangent.probs; output.probs, grad.logits) of arrays of the
framework on the device; it writes the outputs in place (NumPy, PyTorch, CuPy) or returns a dict
of them (any framework; JAX must). The outputs start poisoned (NaN, 0xFF), so anything left
unwritten fails. docs/python.md is the guide.
"""
import json

from . import _core
from ._frameworks import FRAMEWORKS, to_framework, to_numpy

__version__ = _core.version
__all__ = ["ops", "cases", "Case", "Report", "CheckResult", "check", "NotSupported", "golden",
           "to_numpy", "FRAMEWORKS"]


class NotSupported(Exception):
    """Raised by an implementation for a case it does not support: the case is reported
    not supported, not failed."""


def ops():
    """The names of the registered ops (SPEC names), in registry order."""
    return list(_core.ops())


def _prefixed(d, prefix):
    out = {}
    for k, v in (d or {}).items():
        out[k if "." in k else prefix + k] = v
    return out


class Case:
    """One fully specified run of one op (its `line` replays it)."""

    __slots__ = ("_c", "_spec_params_json", "replay_hint")

    def __init__(self, line):
        if isinstance(line, _core.Case):
            self._c = line
        else:
            self._c = _core.Case.parse(str(line))
        self._spec_params_json = None
        self.replay_hint = None

    @classmethod
    def _wrap(cls, core_case, spec_params_json=None):
        c = cls(core_case)
        c._spec_params_json = spec_params_json
        return c

    op = property(lambda self: self._c.op, doc="the SPEC op name")
    dtype = property(lambda self: self._c.dtype, doc="the activation dtype (float32, bfloat16, float16)")
    regime = property(lambda self: self._c.regime, doc="the input regime (uniform, near_ties, ...)")
    seed = property(lambda self: self._c.seed, doc="the input generator's seed")
    line = property(lambda self: self._c.line, doc="the one-line case; Case(line) rebuilds it")
    params = property(lambda self: self._c.params,
                      doc="the case's parameters (shapes and options), typed: {'T': 64, ...}")

    @property
    def name(self):
        """The named case's name (SPEC R* regressions, the catalogue), else None."""
        return self._c.params.get("name")

    @property
    def spec_params(self):
        """The SPEC §14 `params` object of the case (what a golden file stores)."""
        if self._spec_params_json is None:
            self._spec_params_json = self._c.spec_params_json
        return json.loads(self._spec_params_json)

    @property
    def id(self):
        """A short id for test names: the case's name, or regime-seed."""
        return self.name or "%s-%s-%d" % (self.dtype, self.regime, self.seed)

    def with_params(self, **params):
        """A copy with some parameters changed (not checked for validity beyond the key kinds)."""
        return Case(self._c.with_params(params))

    def inputs(self, framework="numpy", device=None):
        """input.* and cotangent.* of the case (fresh arrays) in a framework on a device."""
        ins = self._c.make_inputs()
        if framework == "numpy":
            return dict(ins)
        return {k: to_framework(v, framework, device) for k, v in ins.items()}

    def reference(self):
        """The reference's output.* and grad.* (saved residuals included), NumPy arrays."""
        return dict(self._c.reference())

    def compare(self, outputs, grads=None, ties="canonical"):
        """Compares outputs (and grads) with the reference under SPEC §12's bounds and the tie
        policy. Keys are SPEC §14 names; bare names mean output.<n> / grad.<n>. Keys not given
        are not compared. Arrays of any framework. Returns a Report (truthy when it passed)."""
        got = _prefixed(outputs, "output.")
        got.update(_prefixed(grads, "grad."))
        got = {k: to_numpy(v) for k, v in got.items()}
        r = _core.compare(self._c, got, ties)
        replay = self.replay_hint or "moe_harness.Case(%r)" % self.line
        return Report(r, replay)

    def __repr__(self):
        return "moe_harness.Case(%r)" % self.line

    def __str__(self):
        return self.line

    def __eq__(self, other):
        return isinstance(other, Case) and self.line == other.line

    def __hash__(self):
        return hash(self.line)


def cases(op, n=20, seed=1, named=True, **fixed_params):
    """The op's named cases (named=True) and n random ones drawn from seed, exactly those
    check(op, impl, cases=n, seed=seed) runs. fixed_params override the generated parameters
    (e.g. score_function="sigmoid", E=64); cases that become invalid are skipped."""
    return [Case(c) for c in _core.cases(op, int(n), int(seed), bool(named), fixed_params)]


class Report:
    """The verdict on one case: truthy when it passed; str() is the CLI's report."""

    def __init__(self, r, replay):
        self.case = Case(r["case"])
        self.verdict = r["verdict"]          # passed, failed, not_supported
        self.report = r["report"]            # the mismatch report / failure lines
        self.notes = list(r["notes"])
        self.original = r["original"]        # the case before shrinking ("" if not shrunk)
        self.worst_pct = r["worst_pct"]      # worst |got - want| / bound, percent
        self.seconds = r["seconds"]
        self.named = r["named"]
        self.replay = replay

    @property
    def passed(self):
        return self.verdict == "passed"

    def __bool__(self):
        return self.verdict != "failed"

    def __str__(self):
        line = self.case.line
        if self.verdict == "passed":
            s = "PASS %s (worst %.1f%% of tolerance)\n" % (line, self.worst_pct)
        elif self.verdict == "not_supported":
            s = "NOT SUPPORTED %s: %s\n" % (line, self.report)
        else:
            s = "FAIL %s\n" % line
            if self.original:
                s += "  shrunk from: %s\n" % self.original
            s += self.report
        for n in self.notes:
            s += "  note: %s\n" % n
        if self.verdict == "failed":
            s += "  replay: %s\n" % self.replay
        return s

    def __repr__(self):
        return "<moe_harness.Report %s: %s>" % (self.verdict, self.case.line)


class CheckResult:
    """What check() ran: per-case Reports and the counts."""

    def __init__(self, r, replay_fn):
        self.op = r["op"]
        self.impl = r["impl"]
        self.reports = [Report(c, replay_fn(c["case"].line)) for c in r["cases"]]
        self.passed = r["passed"]
        self.failed = r["failed"]
        self.not_supported = r["not_supported"]
        self.worst_pct = r["worst_pct"]
        self.seconds = r["seconds"]

    @property
    def failures(self):
        return [x for x in self.reports if x.verdict == "failed"]

    @property
    def disposition(self):
        if self.failed:
            return "Incorrect"
        if self.passed == 0 and self.not_supported:
            return "NotSupported"
        return "Passed"

    def __bool__(self):
        return self.failed == 0

    def summary(self):
        return ("%s %s: %d cases, %d passed, %d failed, %d not supported, worst %.1f%% of "
                "tolerance, %.2f s" % (self.op, self.impl, len(self.reports), self.passed,
                                      self.failed, self.not_supported, self.worst_pct,
                                      self.seconds))

    def __str__(self):
        s = self.summary() + "\n"
        for f in self.failures:
            s += "\n" + str(f)
        return s

    __repr__ = __str__


_replay_hook = None  # set by moe_harness.pytest: extra replay text for a case line


def _impl_label(impl):
    return getattr(impl, "__qualname__", None) or getattr(impl, "__name__", None) or type(impl).__name__


def _register(op, impl, framework, device, name, deterministic, provides, unwritten="zeros"):
    from ._frameworks import make_runner
    if op not in _core.ops():
        raise ValueError("unknown op %r (ops: %s)" % (op, ", ".join(_core.ops())))
    provides = list(provides or [])
    for k in provides:
        if not (k.startswith("output.") or k.startswith("grad.")):
            raise ValueError("provides: %r is not an output.* or grad.* name" % k)
    label = name or "python-" + "".join(ch if ch.isalnum() or ch in "_-" else "_"
                                         for ch in _impl_label(impl))
    runner = make_runner(impl, framework, device, Case._wrap, NotSupported)
    return _core.register_python(op, runner, NotSupported, label, bool(deterministic), provides,
                                 unwritten)


def check(op, impl, cases=100, seed=1, ties="canonical", framework="numpy", device=None,
          named=True, provides=None, deterministic=True, name=None, case=None, shrink=True,
          unwritten="zeros", runs=2, case_timeout=0, **fixed_params):
    """Checks impl on every named case of op and `cases` random ones (seed), as `moe-harness
    check --impl` checks a C++ implementation: poisoned outputs, guard bytes, two runs bitwise
    equal (unless deterministic=False), the tie policy `ties` (canonical, te, any), failing random
    cases shrunk. impl(case, inputs, outputs) gets framework arrays on device (numpy: the host
    buffers themselves). provides: the output.*/grad.* keys it computes (default: all).
    case: check this one case line only (a replay). unwritten="te": the rows SPEC §0 lets
    TransformerEngine leave uninitialised (unpadded dispatch tail and row_id_map past each
    token's count, combine's unowned grad.permuted rows) are not compared; "zeros" (default):
    SPEC's zeros are demanded. runs: calls per case, each bitwise equal to the first (2 to
    10000; more hunts races that show now and then). case_timeout: seconds one call of impl may
    take (0: no limit): a call past it prints the case line and ends the process with status 1 (a
    hung call cannot be abandoned); a call that dies of a fatal signal (a crash in an extension)
    prints the case line before the process dies. fixed_params: as for cases().
    Returns a CheckResult; raises AssertionError with every failing case's report and replay."""
    pyimpl = _register(op, impl, framework, device, name, deterministic, provides, unwritten)
    try:
        r = _core.check(pyimpl, int(cases), int(seed), ties, bool(named), fixed_params,
                        None if case is None else str(case), bool(shrink), int(runs),
                        float(case_timeout))
    finally:
        pyimpl.release()
    args = ""
    if framework != "numpy":
        args += ", framework=%r" % framework
    if device is not None:
        args += ", device=%r" % (device if isinstance(device, (str, int)) else str(device))
    if ties != "canonical":
        args += ", ties=%r" % ties
    if provides:
        args += ", provides=%r" % list(provides)
    if unwritten != "zeros":
        args += ", unwritten=%r" % unwritten
    if runs != 2:
        args += ", runs=%d" % int(runs)
    if case_timeout:
        args += ", case_timeout=%g" % float(case_timeout)

    def replay(line):
        s = "moe_harness.check(%r, %s, case=%r%s)" % (op, _impl_label(impl), line, args)
        if _replay_hook is not None:
            extra = _replay_hook(line)
            if extra:
                s += "\n          " + extra
        return s

    result = CheckResult(r, replay)
    if not result.reports:
        raise ValueError("check(%r): no case to run (every case was invalid with %r)" %
                         (op, fixed_params))
    if result.failed:
        msg = "moe_harness.check(%r, %s): %d of %d cases failed\n" % (
            op, _impl_label(impl), result.failed, len(result.reports))
        for f in result.failures:
            msg += "\n" + str(f)
        raise AssertionError(msg)
    return result


from . import golden  # noqa: E402  (uses Case and _register)
