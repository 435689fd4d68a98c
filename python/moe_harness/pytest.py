"""pytest plugin for moe_harness (registered through the `pytest11` entry point when the package
is installed; or `pytest_plugins = ["moe_harness.pytest"]` in a conftest.py).

Options:
    --moe-cases N    random cases per op (default 20), on top of the named ones
    --moe-seed S     seed of the random cases (default 1)
    --moe-case LINE  run only this case (the replay of a failure)
    --moe-runs N     moe_check's calls of the implementation per case (default 2; more hunts
                     races that show now and then)
    --moe-case-timeout S  moe_check's seconds per call (default none): a call past it prints the
                     case (to the terminal, past pytest's capture) and ends the session with
                     status 1.

Parametrize a test over an op's named and random cases:

    @pytest.mark.moe_op("topk_router", score_function="sigmoid")   # fixed params optional
    def test_router(moe_case):
        outputs = my_router(moe_case.inputs(framework="torch", device="cuda"))
        report = moe_case.compare(outputs)
        assert report, str(report)   # a failure prints the mismatch report and the replay

or check an implementation (all cases in one test, shrinking included):

    def test_router_check(moe_check):
        moe_check("topk_router", my_impl, framework="torch", device="cuda")
"""
import os
import shlex
import sys

import pytest

import moe_harness
from moe_harness import _core

DEFAULT_CASES = 20
DEFAULT_SEED = 1


def pytest_addoption(parser):
    g = parser.getgroup("moe_harness", "moe-harness cases")
    g.addoption("--moe-cases", type=int, default=None, metavar="N",
                help="random cases per op, besides the named ones (default %d)" % DEFAULT_CASES)
    g.addoption("--moe-seed", type=int, default=None, metavar="S",
                help="seed of the random cases (default %d)" % DEFAULT_SEED)
    g.addoption("--moe-case", default=None, metavar="LINE",
                help="run only this case line (replays a failure)")
    g.addoption("--moe-runs", type=int, default=None, metavar="N",
                help="moe_check: calls per case, each bitwise equal to the first (default 2)")
    g.addoption("--moe-case-timeout", type=float, default=None, metavar="S",
                help="moe_check: seconds one call may take; past it the case is printed and the "
                "session ends with status 1 (default: no limit)")


_message_fd = None


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "moe_op(op, cases=None, seed=None, named=True, **fixed_params): parametrize "
        "the test's `moe_case` argument over the op's named and random cases")
    # A crash or a case timeout ends the process with pytest's captured output unprinted: check's
    # message goes to a copy of the terminal's stderr, taken before capture replaces descriptor 2
    # (as pytest's faulthandler plugin does).
    global _message_fd
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):
        fd = sys.__stderr__.fileno() if sys.__stderr__ is not None else -1
    if fd >= 0 and _message_fd is None:
        _message_fd = os.dup(fd)
        _core._set_message_fd(_message_fd)


def pytest_unconfigure(config):
    global _message_fd
    if _message_fd is not None:
        _core._set_message_fd(2)
        os.close(_message_fd)
        _message_fd = None


def _options(config):
    n = config.getoption("moe_cases", default=None)
    s = config.getoption("moe_seed", default=None)
    return (DEFAULT_CASES if n is None else n, DEFAULT_SEED if s is None else s,
            config.getoption("moe_case", default=None))


def cases_for(config, op, cases=None, seed=None, named=True, **fixed_params):
    """The cases a test over op runs under this session's options (--moe-case: that one case,
    when it is of op)."""
    n, s, line = _options(config)
    if line:
        c = moe_harness.Case(line)
        return [c] if c.op == op else []
    return moe_harness.cases(op, n=n if cases is None else cases, seed=s if seed is None else seed,
                             named=named, **fixed_params)


def _replay(nodeid, line, runs=None):
    return "pytest %s --moe-case %s%s" % (shlex.quote(nodeid), shlex.quote(line),
                                          "" if runs in (None, 2) else " --moe-runs %d" % runs)


def pytest_generate_tests(metafunc):
    if "moe_case" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("moe_op")
    if marker is None or not marker.args:
        raise pytest.UsageError("%s uses moe_case without @pytest.mark.moe_op(op, ...)" %
                                metafunc.definition.nodeid)
    cs = cases_for(metafunc.config, marker.args[0], **marker.kwargs)
    nodeid = metafunc.definition.nodeid
    for c in cs:
        c.replay_hint = _replay(nodeid, c.line)
    ids = []
    seen = {}
    for c in cs:
        i = c.id
        seen[i] = seen.get(i, 0) + 1
        ids.append(i if seen[i] == 1 else "%s-%d" % (i, seen[i]))
    metafunc.parametrize("moe_case", cs, ids=ids)


@pytest.fixture
def moe_check(request):
    """moe_check(op, impl, **kw): moe_harness.check with this session's --moe-cases,
    --moe-seed, --moe-case, --moe-runs and --moe-case-timeout; a failure's replay names this test
    too."""
    n, s, line = _options(request.config)
    runs = request.config.getoption("moe_runs", default=None)
    case_timeout = request.config.getoption("moe_case_timeout", default=None)
    nodeid = request.node.nodeid

    def run(op, impl, **kw):
        kw.setdefault("cases", n)
        kw.setdefault("seed", s)
        if runs is not None:
            kw.setdefault("runs", runs)
        if case_timeout is not None:
            kw.setdefault("case_timeout", case_timeout)
        if line and "case" not in kw:
            c = moe_harness.Case(line)
            if c.op != op:
                pytest.skip("--moe-case is a case of %s, not %s" % (c.op, op))
            kw["case"] = line
        prev = moe_harness._replay_hook
        moe_harness._replay_hook = lambda l: _replay(nodeid, l, kw.get("runs"))
        try:
            return moe_harness.check(op, impl, **kw)
        finally:
            moe_harness._replay_hook = prev

    return run
