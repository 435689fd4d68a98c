"""moe_harness.golden: files written from NumPy that `moe-harness golden verify` accepts, and
ours read back. The foreign files here are what a user writing from NumPy or PyTorch produces:
no x-case, null optional parameters, forward-only, without output.saved_scores.
"""
import json
import os
import subprocess

import numpy as np
import pytest

import moe_harness
import numpy_impls as ni
from moe_harness import golden

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def outputs_of(impl, case, inputs=None):
    ref = case.reference()
    outs = {k: np.empty_like(v) for k, v in ref.items()}
    impl(case, inputs if inputs is not None else case.inputs(), outs)
    return outs


def split(outs):
    o = {k[len("output."):]: v for k, v in outs.items() if k.startswith("output.")}
    g = {k[len("grad."):]: v for k, v in outs.items() if k.startswith("grad.")}
    return o, g


def verify_cli(cli, path, *extra):
    r = subprocess.run([cli, "golden", "verify"] + list(extra) + [str(path)],
                       capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def small_case(op, **fixed):
    cs = [c for c in moe_harness.cases(op, n=30, seed=2, named=False, **fixed)
          if c.regime == "uniform" and all(v.size > 1 for k, v in c.inputs().items()
                                           if k.startswith("input."))]
    assert cs, "no uniform case of %s" % op
    return min(cs, key=lambda c: sum(v.size for v in c.inputs().values()))


@pytest.mark.parametrize("op", sorted(ni.CORRECT))
def test_own_case_round_trip(cli, tmp_path, op):
    case = small_case(op)
    o, g = split(outputs_of(ni.CORRECT[op], case))
    path = tmp_path / ("%s.safetensors" % op)
    golden.write(path, case, outputs=o, grads=g)
    f = golden.read(path)
    assert f.metadata["x-case"] == case.line and f.case == case
    assert f.op == op and f.dtype == case.dtype and f.seed == case.seed
    assert f.params == case.spec_params
    assert set(f.cotangents) and set(f.grads) == set(g)
    rc, out = verify_cli(cli, path)
    assert rc == 0, out
    assert golden.verify(path)
    # The implementation itself against the file, in-process.
    assert golden.verify(path, impl=ni.CORRECT[op])


def foreign_router_file(path, case, *, forward_only, saved_scores, nulls):
    ins = case.inputs()
    o, g = split(outputs_of(ni.topk_router, case, ins))
    if not saved_scores:
        del o["saved_scores"]
    params = case.spec_params
    if nulls:
        assert params["group_topk"] == 0
        params["num_groups"] = None
        params["group_topk"] = None
    golden.write(path, op="topk_router", dtype=case.dtype, seed=case.seed, params=params,
                 inputs={k: v for k, v in ins.items() if k.startswith("input.")}, outputs=o,
                 cotangents=None if forward_only else {"probs": ins["cotangent.probs"]},
                 grads=None if forward_only else g, metadata={"x-generator": "numpy"})
    return path


@pytest.mark.parametrize("forward_only", [False, True], ids=["backward", "forward_only"])
@pytest.mark.parametrize("saved_scores", [True, False], ids=["saved", "no_saved_scores"])
def test_foreign_router_file_verifies(cli, tmp_path, forward_only, saved_scores):
    case = small_case("topk_router", score_function="softmax", use_pre_softmax=True,
                      num_groups=0, group_topk=0)
    path = foreign_router_file(tmp_path / "router.safetensors", case, forward_only=forward_only,
                               saved_scores=saved_scores, nulls=True)
    f = golden.read(path)
    assert "x-case" not in f.metadata
    assert f.params["num_groups"] is None and f.params["group_topk"] is None
    assert bool(f.grads) == (not forward_only)
    rc, out = verify_cli(cli, path)
    assert rc == 0, out
    assert "PASS" in out


def test_foreign_file_failure_replays_as_verify(cli, tmp_path):
    case = small_case("topk_router", score_function="softmax", num_groups=0, group_topk=0)
    path = foreign_router_file(tmp_path / "bad.safetensors", case, forward_only=True,
                               saved_scores=True, nulls=False)
    f = golden.read(path)
    t = dict(f.tensors)
    probs = t["output.probs"].copy()
    i = np.flatnonzero(probs.astype(np.float64))[0]
    probs.flat[i] = probs.flat[i] * 1.5
    t["output.probs"] = probs
    golden.write(path, op=f.op, dtype=f.dtype, seed=f.seed, params=f.params,
                 inputs={k: v for k, v in t.items() if k.startswith("input.")},
                 outputs={k: v for k, v in t.items() if k.startswith("output.")})
    rc, out = verify_cli(cli, path)
    assert rc == 1, out
    assert "output.probs" in out
    assert "replay: moe-harness golden verify --impl reference %s" % path in out, out
    assert "check --impl" not in out and "--case" not in out, out


def test_foreign_dispatch_file_with_null_align(cli, tmp_path):
    case = small_case("token_dispatch", align_size=0, drop_overflow=False)
    ins = case.inputs()
    o, g = split(outputs_of(ni.token_dispatch, case, ins))
    params = case.spec_params
    params["align_size"] = None       # TE-JAX: None for off
    params["drop_overflow"] = None    # absent optional mode
    path = tmp_path / "dispatch.safetensors"
    golden.write(path, op="token_dispatch", dtype=case.dtype, seed=case.seed, params=params,
                 inputs={k: v for k, v in ins.items() if k.startswith("input.")}, outputs=o)
    rc, out = verify_cli(cli, path)
    assert rc == 0, out


def sigmoid_router_from_numpy(path):
    """A topk_router file as a NumPy user writes it: float32, sigmoid, K=4 of E=8, T=16, logits
    up to |x| ~ 6 (scores near 1, where 1 - s magnifies a 1-ulp score difference), correctly
    rounded fp32 sigmoid scores, the backward from those scores (SPEC §1.3)."""
    rng = np.random.default_rng(17)
    T, E, K = 16, 8, 4
    logits = (rng.standard_normal((T, E)) * 3.0).astype(np.float32)
    ct = rng.standard_normal((T, E)).astype(np.float32)
    x = logits.astype(np.float64)
    s = (1.0 / (1.0 + np.exp(-x))).astype(np.float32)          # correctly rounded fp32 sigmoid
    sel = np.argsort(-s, axis=1, kind="stable")[:, :K]
    routed = np.zeros((T, E), dtype=bool)
    np.put_along_axis(routed, sel, True, axis=1)
    v = np.where(routed, s.astype(np.float64), 0.0)
    probs = (v / (v.sum(axis=1, keepdims=True) + 1e-20)).astype(np.float32)
    a = s.astype(np.float64)
    gp = ct.astype(np.float64)
    A = (a * routed).sum(axis=1, keepdims=True)
    B = (gp * a * routed).sum(axis=1, keepdims=True)
    gg = np.where(routed, gp / (A + 1e-20) - B / (A + 1e-20) ** 2, 0.0)
    grad = (gg * a * (1.0 - a)).astype(np.float32)
    params = {"topk": K, "score_function": "sigmoid", "use_pre_softmax": False,
              "num_groups": None, "group_topk": None, "scaling_factor": 1.0,
              "routing_map_format": "bytemap"}
    golden.write(path, op="topk_router", dtype="float32", seed=0, params=params,
                 inputs={"logits": logits}, cotangents={"probs": ct},
                 outputs={"probs": probs, "routing_map": routed, "saved_scores": s},
                 grads={"logits": grad})
    return path


def test_numpy_sigmoid_router_file_verifies(cli, tmp_path):
    """SPEC §1.4: two implementations' fp32 scores may differ by a few ulps; a NumPy file with
    correctly rounded sigmoid scores must verify (issue 17, foreign-file fix 4)."""
    path = sigmoid_router_from_numpy(tmp_path / "sigmoid.safetensors")
    rc, out = verify_cli(cli, path)
    assert rc == 0, out


def test_read_committed_file():
    d = os.path.join(REPO, "golden", "data")
    names = sorted(n for n in os.listdir(d) if n.startswith("topk_router__") and "bfloat16" in n)
    f = golden.read(os.path.join(d, names[0]))
    assert f.op == "topk_router" and f.dtype == "bfloat16"
    assert str(f.tensors["input.logits"].dtype) == "bfloat16"
    assert f.tensors["output.saved_scores"].dtype == np.float32
    assert f.case is not None and f.case.op == "topk_router"
    assert json.loads(f.metadata["params"]) == f.params


def test_write_rejects_what_verify_would(tmp_path):
    case = small_case("moe_aux_loss")
    o, g = split(outputs_of(ni.moe_aux_loss, case))
    with pytest.raises(ValueError, match="output.nonsense"):
        golden.write(tmp_path / "x.safetensors", case, outputs=dict(o, nonsense=o["aux_loss"]))
    with pytest.raises(ValueError, match="params"):
        golden.write(tmp_path / "x.safetensors", case, outputs=o, params={"no_such": 1})
    assert not (tmp_path / "x.safetensors").exists()
