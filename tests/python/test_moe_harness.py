"""moe_harness (python/): the registry from Python, NumPy implementations checked with
moe_harness.check (passing, and failing with a replay line for a planted bug per op), Case.compare
through the pytest plugin, framework plumbing, and golden files written from NumPy that
`moe-harness golden verify` accepts (null optional parameters, forward-only, no saved_scores,
no x-case).

Run: pytest tests/python  (ctest: python_package, which builds and installs the package first).
"""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import moe_harness
import numpy_impls as ni

HERE = os.path.dirname(os.path.abspath(__file__))


def run_outputs(impl, case):
    """Runs a NumPy impl outside the harness: outputs allocated like the reference's."""
    ref = case.reference()
    outs = {k: np.empty_like(v) for k, v in ref.items()}
    impl(case, case.inputs(), outs)
    return outs


# ---------------------------------------------------------------- registry

def test_ops_and_cases():
    ops = moe_harness.ops()
    for op in ni.CORRECT:
        assert op in ops
    a = moe_harness.cases("topk_router", n=5, seed=3)
    b = moe_harness.cases("topk_router", n=5, seed=3)
    assert [c.line for c in a] == [c.line for c in b]
    named = [c for c in a if c.name]
    assert len(a) == len(named) + 5 and named
    c = a[-1]
    assert moe_harness.Case(c.line) == c
    assert c.op == "topk_router" and c.dtype in ("float32", "bfloat16", "float16")
    assert isinstance(c.params["T"], int) and isinstance(c.params["expert_bias"], bool)
    assert set(c.spec_params) == {"topk", "score_function", "use_pre_softmax", "num_groups",
                                  "group_topk", "scaling_factor", "routing_map_format"}
    ins = c.inputs()
    assert "input.logits" in ins and "cotangent.probs" in ins
    ref = c.reference()
    assert {"output.probs", "output.routing_map", "output.saved_scores", "grad.logits"} <= set(ref)


def test_fixed_params_override_and_skip_invalid():
    cs = moe_harness.cases("topk_router", n=20, seed=1, named=False, score_function="sigmoid")
    assert cs and all(c.params["score_function"] == "sigmoid" for c in cs)
    # E=4 makes many generated cases invalid (topk > 4, groups not dividing 4): those are skipped.
    cs = moe_harness.cases("topk_router", n=10, seed=1, named=False, E=4)
    assert cs and all(c.params["E"] == 4 and c.params["topk"] <= 4 for c in cs)
    with pytest.raises(ValueError, match="no_such_key"):
        moe_harness.cases("topk_router", n=2, no_such_key=1)
    with pytest.raises(ValueError, match="unknown op"):
        moe_harness.cases("no_such_op", n=1)


# ---------------------------------------------------------------- check(): correct NumPy impls

@pytest.mark.parametrize("score_function", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_router_numpy_passes(moe_check, score_function):
    r = moe_check("topk_router", ni.topk_router, score_function=score_function)
    assert r.passed > 0 and r.failed == 0
    grouped = [x for x in r.reports if x.case.params.get("group_topk", 0) > 0]
    assert grouped, "no grouped case ran"
    if score_function == "softmax":
        assert any(x.case.params["use_pre_softmax"] for x in r.reports)
        assert any(not x.case.params["use_pre_softmax"] for x in r.reports)


def test_router_numpy_grouped_passes(moe_check):
    r = moe_check("topk_router", ni.topk_router, named=False, num_groups=4, group_topk=2,
                  score_function="sigmoid")
    assert r.passed > 0 and r.failed == 0
    assert all(x.case.params["group_topk"] == 2 for x in r.reports)


def test_dispatch_numpy_passes_with_padding(moe_check):
    r = moe_check("token_dispatch", ni.token_dispatch)
    assert r.failed == 0 and r.passed > 0
    # drop_overflow cases are NotSupported by this implementation, not failed.
    assert r.not_supported > 0
    padded = [x for x in r.reports if x.passed and x.case.params["align_size"] > 1]
    assert padded, "no case with alignment padding passed"
    r = moe_check("token_dispatch", ni.token_dispatch, named=False, align_size=16)
    assert r.failed == 0 and r.passed > 0


@pytest.mark.parametrize("op", ["sort_chunks_by_index", "moe_aux_loss"])
def test_numpy_passes(moe_check, op):
    r = moe_check(op, ni.CORRECT[op])
    assert r.failed == 0 and r.passed > 0


# ---------------------------------------------------------------- check(): planted bugs

BUGS = [(op, f) for op, fs in ni.BUGGY.items() for f in fs]


@pytest.mark.parametrize("op,impl", BUGS, ids=[f.__name__ for _, f in BUGS])
def test_planted_bug_fails_with_replay(op, impl):
    with pytest.raises(AssertionError) as ei:
        moe_harness.check(op, impl, cases=20, seed=1)
    msg = str(ei.value)
    assert "cases failed" in msg and "FAIL op=%s" % op in msg
    m = re.search(r"replay: moe_harness\.check\('%s', %s, case='([^']+)'\)" % (op, impl.__name__), msg)
    assert m, msg[:2000]
    # The replay line reproduces the failure, alone.
    with pytest.raises(AssertionError, match="1 of 1 cases failed"):
        moe_harness.check(op, impl, case=m.group(1))
    # ... and the correct implementation passes the same case.
    moe_harness.check(op, ni.CORRECT[op], case=m.group(1))


# ---------------------------------------------------------------- harness mechanics

def test_unwritten_output_is_caught_and_provides_skips_it():
    def lazy(case, inputs, outputs):  # writes everything but saved_scores
        tmp = dict(outputs)
        tmp["output.saved_scores"] = np.empty(outputs["output.probs"].shape, np.float32)
        ni.topk_router(case, inputs, tmp)
    with pytest.raises(AssertionError, match="output.saved_scores"):
        moe_harness.check("topk_router", lazy, cases=2, named=False)
    provides = ["output.probs", "output.routing_map", "grad.logits"]
    r = moe_harness.check("topk_router", lazy, cases=5, named=False, provides=provides)
    assert r.failed == 0
    assert any("not provided" in n for x in r.reports for n in x.notes)


def test_returned_dict_and_dtype_mismatch():
    def returns(case, inputs, outputs):
        outs = {k: np.empty_like(v) for k, v in outputs.items()}
        ni.sort_chunks_by_index(case, inputs, outs)
        return outs
    assert moe_harness.check("sort_chunks_by_index", returns, cases=5)

    def wrong_dtype(case, inputs, outputs):
        outs = returns(case, inputs, outputs)
        outs["output.row_id_map"] = outs["output.row_id_map"].astype(np.int64)
        return outs
    with pytest.raises(AssertionError, match=r"output.row_id_map: got int64"):
        moe_harness.check("sort_chunks_by_index", wrong_dtype, cases=1, named=False)


def test_nondeterminism_is_caught():
    calls = [0]

    def flaky(case, inputs, outputs):
        ni.sort_chunks_by_index(case, inputs, outputs)
        calls[0] += 1
        if calls[0] % 2 == 0 and outputs["output.row_id_map"].size:
            outputs["output.row_id_map"][0] += 1
    with pytest.raises(AssertionError, match="determinism"):
        moe_harness.check("sort_chunks_by_index", flaky, cases=3, named=False, shrink=False)


def test_more_runs_catch_a_race_that_shows_now_and_then():
    calls = {}

    def now_and_then(case, inputs, outputs):
        ni.sort_chunks_by_index(case, inputs, outputs)
        n = calls[case.line] = calls.get(case.line, 0) + 1
        if n == 4 and outputs["output.row_id_map"].size:  # a case's 4th call only
            outputs["output.row_id_map"][0] += 1
    moe_harness.check("sort_chunks_by_index", now_and_then, cases=3, named=False, shrink=False)
    calls.clear()
    with pytest.raises(AssertionError, match=r"differs between runs 1 and 4 \(of 5\)") as e:
        moe_harness.check("sort_chunks_by_index", now_and_then, cases=3, named=False,
                          shrink=False, runs=5)
    assert "runs=5)" in str(e.value)  # the replay line makes as many calls
    with pytest.raises(ValueError, match="runs: expected 2..10000 calls per case, got 1"):
        moe_harness.check("sort_chunks_by_index", now_and_then, cases=1, named=False, runs=1)


def _run_isolated(body):
    """Runs body (Python source, with moe_harness and ni importable) in a fresh interpreter."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    src = "import moe_harness, numpy_impls as ni\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", src], env=env, capture_output=True, text=True,
                          timeout=120, cwd=HERE)


def test_a_hang_or_a_crash_in_a_call_names_the_case():
    # A call past case_timeout ends the process with status 1, naming the case.
    r = _run_isolated("""
        import time
        def hangs(case, inputs, outputs):
            time.sleep(60)
        moe_harness.check("sort_chunks_by_index", hangs, cases=1, named=False, case_timeout=0.5)
    """)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "ran past the case timeout (0.5 s) for this case" in r.stderr, r.stderr
    assert "case: op=sort_chunks_by_index " in r.stderr, r.stderr
    # A call that dies of SIGSEGV (a crash in an extension) names the case, then dies of it.
    r = _run_isolated("""
        import ctypes
        def crashes(case, inputs, outputs):
            ctypes.string_at(0)
        moe_harness.check("sort_chunks_by_index", crashes, cases=1, named=False)
    """)
    assert r.returncode == -signal.SIGSEGV, (r.returncode, r.stderr)
    assert "SIGSEGV in a call of implementation" in r.stderr, r.stderr
    assert "case: op=sort_chunks_by_index " in r.stderr, r.stderr
    # Within the limit nothing changes; a bad value is a ValueError naming it.
    moe_harness.check("sort_chunks_by_index", ni.sort_chunks_by_index, cases=2, case_timeout=60)
    with pytest.raises(ValueError, match="case_timeout_s: expected 0"):
        moe_harness.check("sort_chunks_by_index", ni.sort_chunks_by_index, cases=1, named=False,
                          case_timeout=-1)


def test_torch_cpu_if_available():
    torch = pytest.importorskip("torch")

    def impl(case, inputs, outputs):
        assert all(isinstance(v, torch.Tensor) for v in inputs.values())
        outs = {k: np.empty(tuple(v.shape), dtype=moe_harness.to_numpy(v).dtype)
                for k, v in outputs.items()}
        ni.sort_chunks_by_index(case, {k: moe_harness.to_numpy(v) for k, v in inputs.items()}, outs)
        for k, v in outs.items():
            outputs[k].copy_(moe_harness.FRAMEWORKS and torch.from_numpy(v))
    moe_harness.check("sort_chunks_by_index", impl, cases=5, framework="torch", device="cpu")


# ---------------------------------------------------------------- pytest plugin: Case.compare

@pytest.mark.moe_op("sort_chunks_by_index")
def test_compare_sort_chunks(moe_case):
    outs = run_outputs(ni.sort_chunks_by_index, moe_case)
    report = moe_case.compare(outs)
    assert report, str(report)


@pytest.mark.moe_op("topk_router", score_function="sigmoid")
def test_compare_router_sigmoid(moe_case):
    outs = run_outputs(ni.topk_router, moe_case)
    grads = {"logits": outs.pop("grad.logits")}
    outs = {k[len("output."):]: v for k, v in outs.items()}
    report = moe_case.compare(outs, grads=grads)
    assert report, str(report)


def test_compare_reports_mismatch():
    case = moe_harness.cases("moe_aux_loss", n=1, named=False)[0]
    outs = run_outputs(ni.moe_aux_loss, case)
    outs["output.const_buf"] = outs["output.const_buf"] * 2
    r = case.compare(outs)
    assert not r
    text = str(r)
    assert text.startswith("FAIL op=moe_aux_loss")
    assert "output.const_buf" in text and "replay: moe_harness.Case(" in text


PLUGIN_TEST = """
import numpy as np
import pytest
import numpy_impls as ni

@pytest.mark.moe_op("moe_aux_loss")
def test_aux(moe_case):
    ref = moe_case.reference()
    outs = {k: np.empty_like(v) for k, v in ref.items()}
    ni.%s(moe_case, moe_case.inputs(), outs)
    report = moe_case.compare(outs)
    assert report, str(report)

def test_aux_check(moe_check):
    moe_check("moe_aux_loss", ni.%s)
"""


def run_pytest(tmp_path, impl, *args, timeout=None):
    (tmp_path / "test_plugin_example.py").write_text(PLUGIN_TEST % (impl, impl))
    env = dict(os.environ)
    env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "moe_harness.pytest", "-p", "no:cacheprovider",
           str(tmp_path / "test_plugin_example.py")] + list(args)
    return subprocess.run(cmd, capture_output=True, text=True, cwd=str(tmp_path), env=env,
                          timeout=timeout)


def test_plugin_passing_run(tmp_path):
    r = run_pytest(tmp_path, "moe_aux_loss", "--moe-cases", "3", "--moe-seed", "5")
    assert r.returncode == 0, r.stdout + r.stderr
    n_named = len([c for c in moe_harness.cases("moe_aux_loss", n=0) if c.name])
    assert "%d passed" % (n_named + 3 + 1) in r.stdout, r.stdout


def test_plugin_failing_run_prints_replay(tmp_path):
    r = run_pytest(tmp_path, "moe_aux_loss_bug_rows_for_tokens", "--moe-cases", "4")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL op=moe_aux_loss" in r.stdout
    m = re.search(r"replay: pytest (\S+) --moe-case '([^']+)'", r.stdout)
    assert m, r.stdout[-3000:]
    # The printed replay runs exactly that case (in the parametrized test and in moe_check).
    r2 = run_pytest(tmp_path, "moe_aux_loss_bug_rows_for_tokens", "--moe-case", m.group(2))
    assert r2.returncode == 1 and "2 failed" in r2.stdout, r2.stdout[-3000:]


def test_plugin_case_timeout_option_stops_a_hang(tmp_path):
    # moe_check only (-k): the parametrized test calls the implementation itself, unguarded.
    # pytest's default (fd) capture is on: the message must still reach the terminal's stderr.
    r = run_pytest(tmp_path, "moe_aux_loss_hangs", "-k", "check", "--moe-case-timeout", "0.5",
                   timeout=120)
    assert r.returncode == 1, (r.returncode, r.stdout[-3000:] + r.stderr)
    assert "ran past the case timeout (0.5 s) for this case" in r.stderr, r.stderr
    assert "case: op=moe_aux_loss " in r.stderr, r.stderr


def test_plugin_runs_option_hunts_races(tmp_path):
    impl = "moe_aux_loss_flaky_4th_call"  # a case's 4th call in a row is off
    r = run_pytest(tmp_path, impl, "--moe-cases", "2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    r = run_pytest(tmp_path, impl, "--moe-cases", "2", "--moe-runs", "5")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr
    assert "differs between runs 1 and 4 (of 5)" in r.stdout, r.stdout[-3000:]
    m = re.search(r"pytest (\S+) --moe-case '([^']+)' --moe-runs 5", r.stdout)
    assert m, r.stdout[-3000:]
    r2 = run_pytest(tmp_path, impl, "--moe-case", m.group(2), "--moe-runs", "5")
    assert r2.returncode == 1 and "1 failed" in r2.stdout, r2.stdout[-3000:]
