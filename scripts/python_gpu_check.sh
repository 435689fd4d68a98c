#!/usr/bin/env bash
# PyTorch eager implementations on CUDA tensors checked through the moe_harness Python package
# (issue 17): topk_router with torch.topk, token_dispatch as an index-based permute, both through
# moe_harness.check(..., framework="torch", device="cuda"); which tie policy (ties=) torch.topk
# needs; and the same plumbing for JAX and CuPy when they are installed.
#
# On a machine with PyPI (this one), once:
#   scripts/python_gpu_check.sh --prepare        # -> .whl/: a cp312 wheel of moe_harness built
#                                                #    here (CPU-only, libstdc++ static) and the
#                                                #    build tools (nanobind, scikit-build-core)
# On the GPU machine (Python 3.12 with torch, JAX, CuPy; no internet), with .whl/ carried along:
#   scripts/python_gpu_check.sh [--cases N] [--seed S]
#     installs .whl/moe_harness-*-cp312-*.whl when its tag fits this Python, else builds the
#     package from ./python with the carried nanobind/scikit-build-core (needs the C++ deps the
#     CMake build needs: Eigen, nlohmann-json, rapidcheck, CLI11, dlpack), into a directory on
#     PYTHONPATH (the machine's python3 and its torch, jax, cupy); then runs the checks.
#   scripts/python_gpu_check.sh --install-only   # only the install (into build-py/gpu-site)
# Exit: 0 every check passed (under the tie policy reported), 1 a check failed, 2 setup failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHL=$ROOT/.whl
CASES=30
SEED=1
PREPARE=0
INSTALL_ONLY=0
while [ $# -gt 0 ]; do
  case $1 in
    --prepare) PREPARE=1 ;;
    --install-only) INSTALL_ONLY=1 ;;
    --cases) CASES=$2; shift ;;
    --seed) SEED=$2; shift ;;
    *) echo "usage: $0 [--prepare | --install-only] [--cases N] [--seed S]" >&2; exit 2 ;;
  esac
  shift
done

if [ $PREPARE = 1 ]; then
  if [ -z "${PY312:-}" ]; then
    for c in $(command -v python3.12) /root/.pyenv/versions/3.12*/bin/python3.12 \
             /usr/bin/python3.12 /usr/local/bin/python3.12; do
      if [ -x "$c" ] && "$c" -c 'import venv' >/dev/null 2>&1; then PY312=$c; break; fi
    done
  fi
  [ -n "${PY312:-}" ] || { echo "--prepare: no working python3.12 here (set PY312=...)" >&2; exit 2; }
  echo "building the cp312 wheel with $PY312"
  mkdir -p "$WHL"
  "$PY312" -m pip download --quiet --only-binary=:all: --dest "$WHL" \
    nanobind scikit-build-core pathspec packaging || exit 2
  "$PY312" -m venv "$ROOT/build-py/prep312" && "$ROOT/build-py/prep312/bin/pip" install --quiet \
    --no-index --find-links "$WHL" nanobind scikit-build-core || exit 2
  "$ROOT/build-py/prep312/bin/pip" wheel --quiet --no-build-isolation --no-deps -w "$WHL" \
    --config-settings=build-dir="$ROOT/build-py/wheel312" ./python || exit 2
  ls -l "$WHL"
  echo "carry .whl to the GPU machine (run tool: carry=[\".whl\"]) and run $0 there"
  exit 0
fi

PY=${PYTHON:-python3}
echo "python: $($PY --version 2>&1) at $(command -v $PY)"
# Installed into a target directory on PYTHONPATH, not a venv: the machine's python3 is itself a
# venv (/opt/torch/.venv) whose torch/JAX/CuPy/numpy a nested venv would not see.
SITE=$ROOT/build-py/gpu-site
mkdir -p "$SITE"
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
VPY=$PY
TAG=$($VPY -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
WHEEL=$(ls "$WHL"/moe_harness-*-"$TAG"-*.whl 2>/dev/null | head -1)
if [ -n "$WHEEL" ]; then
  echo "installing $WHEEL (built on the prepare machine)"
  $VPY -m pip install --quiet --no-index --no-deps --upgrade --target "$SITE" "$WHEEL" || exit 2
else
  echo "no $TAG wheel in .whl/: building ./python here (CPU-only C++ build, a few minutes)"
  $VPY -m pip install --quiet --no-index --no-deps --upgrade --target "$SITE" "$WHL"/*.whl || exit 2
  $VPY -m pip install --quiet --no-index --no-deps --no-build-isolation --target "$SITE" \
    --config-settings=build-dir="$ROOT/build-py/gpu-ext" ./python || exit 2
fi
if [ $INSTALL_ONLY = 1 ]; then  # scripts/te_conformance.sh: the package, then its own checks
  echo "installed into $SITE (PYTHONPATH)"
  exit 0
fi
cd "$ROOT/build-py" || exit 2
MOE_CASES=$CASES MOE_SEED=$SEED exec "$VPY" - <<'EOF'
import os
import sys
import time

import moe_harness

CASES = int(os.environ["MOE_CASES"])
SEED = int(os.environ["MOE_SEED"])
print("moe_harness", moe_harness.__version__, "from", moe_harness.__file__)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

if not torch.cuda.is_available():
    print("torch sees no CUDA device")
    sys.exit(2)
print("torch", torch.__version__, "on", torch.cuda.get_device_name(0))
DEV = "cuda"


# sqrt(softplus(x)) with the gradient sigmoid(x) / (2 sqrt(softplus(x))) kept finite. Plain
# autograd of torch.sqrt(F.softplus(x)) gives NaN where softplus underflows to 0 in fp32 (x below
# about -104, the large_magnitude cases): sqrt's derivative there is inf, and inf times the zero
# gradient of an unselected expert is NaN, which the harness reports (session 34, on an H200).
# Where softplus is 0 the derivative's limit exp(x / 2) / 2 is used instead.
class SqrtSoftplus(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        s = torch.sqrt(F.softplus(x, beta=1.0, threshold=20.0))
        ctx.save_for_backward(x, s)
        return s

    @staticmethod
    def backward(ctx, g):
        x, s = ctx.saved_tensors
        d = torch.where(s > 0, torch.sigmoid(x) / (2 * s), 0.5 * torch.exp(0.5 * x))
        return g * d


# ---- topk_router, PyTorch eager (SPEC §1): torch.topk for selection, autograd for the backward
def torch_router(case, inputs, outputs):
    p = case.spec_params
    K, sf, pre = p["topk"], p["score_function"], p["use_pre_softmax"]
    G, gk, scale = p["num_groups"] or 0, p["group_topk"] or 0, p["scaling_factor"]
    x = inputs["input.logits"].float().detach().requires_grad_(True)
    T, E = x.shape
    b = inputs.get("input.expert_bias")
    b = b.float() if b is not None else None
    if sf == "softmax":
        s = torch.softmax(x, dim=-1) if pre else x
    elif sf == "sigmoid":
        s = torch.sigmoid(x)
    else:
        s = SqrtSoftplus.apply(x)
    with torch.no_grad():
        z = s + b if b is not None else s.clone()
        if gk > 0:
            per, kg = E // G, K // gk
            gscore = z.view(T, G, per).topk(kg, dim=-1).values.sum(-1)
            keep = torch.zeros(T, G, dtype=torch.bool, device=x.device)
            keep.scatter_(1, gscore.topk(gk, dim=-1).indices, True)
            z = z.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
        idx = torch.topk(z, K, dim=-1).indices if K > 0 else z[:, :0].long()
    routed = torch.zeros(T, E, dtype=torch.bool, device=x.device).scatter_(1, idx, True)
    if sf == "softmax" and not pre:
        pk = torch.softmax(x.gather(1, idx), dim=-1)
        saved = torch.full((T, E), float("-inf"), device=x.device).scatter(1, idx, pk.detach())
    else:
        v = s.gather(1, idx)
        if b is not None and sf != "softmax":
            bb = b[idx]
            v = v + ((v.detach() + bb) - bb - v.detach())  # fl(fl(s+b)-b), gradient of s
        if sf != "softmax" and K > 1:
            v = v / (v.sum(-1, keepdim=True) + 1e-20)
        pk = v
        saved = (s if sf != "sqrtsoftplus" else x).detach()
    probs = torch.zeros(T, E, device=x.device).scatter(1, idx, scale * pk)
    outputs["output.probs"].copy_(probs.detach())
    if p["routing_map_format"] == "bitmap_u8":
        nb = (E + 7) // 8
        bits = F.pad(routed.to(torch.int32), (0, nb * 8 - E)).view(T, nb, 8)
        shifts = torch.arange(8, device=x.device, dtype=torch.int32)
        outputs["output.routing_map"].copy_((bits << shifts).sum(-1).to(torch.uint8))
    else:
        outputs["output.routing_map"].copy_(routed)
    outputs["output.saved_scores"].copy_(saved)
    if "grad.logits" in outputs and T > 0:
        (g,) = torch.autograd.grad(probs, x, grad_outputs=inputs["cotangent.probs"].float())
        outputs["grad.logits"].copy_(g)
    elif "grad.logits" in outputs:
        outputs["grad.logits"].zero_()


# ---- token_dispatch, PyTorch eager (SPEC §4): index-based permute
def torch_dispatch(case, inputs, outputs):
    p = case.spec_params
    if p["drop_overflow"]:
        raise moe_harness.NotSupported("drop_overflow")
    a = p["align_size"] or 0
    x = inputs["input.x"]
    m = inputs["input.routing_map"].bool()
    probs = inputs.get("input.probs")
    T, E = m.shape
    c = m.sum(0)
    chat = (c + a - 1) // a * a if a >= 1 else c
    excl = lambda v: torch.cumsum(v, 0) - v  # noqa: E731
    pad_off = excl(chat - c)
    u = excl(c)[None, :] + torch.cumsum(m.long(), 0) - 1
    dst = u + pad_off[None, :]
    t_idx, e_idx = m.nonzero(as_tuple=True)
    d = dst[t_idx, e_idx]
    rows = x[t_idx]
    perm = outputs["output.permuted"]
    perm.zero_()
    if probs is not None:
        pv = probs[t_idx, e_idx]
        rows = torch.where((pv.double() == 0)[:, None], torch.zeros_like(rows), rows)
        outputs["output.permuted_probs"].zero_()
        outputs["output.permuted_probs"][d] = pv
    perm[d] = rows
    # row_id_map: slot k of token t = its k-th routed expert in descending order.
    k = (m.flip(1).long().cumsum(1).flip(1) - 1)[t_idx, e_idx]
    rim = torch.full((T, 2 * E + 1), -1, dtype=torch.int32, device=x.device)
    rim[t_idx, k] = u[t_idx, e_idx].int()
    rim[t_idx, E + k] = e_idx.int()
    rim[:, 2 * E] = m.sum(1).int()
    outputs["output.row_id_map"].copy_(rim)
    if "output.pad_offsets" in outputs:
        outputs["output.pad_offsets"].copy_(pad_off.int())
    outputs["output.tokens_per_expert"].copy_(chat.int())
    if "grad.x" in outputs:
        ct = inputs["cotangent.permuted"]
        full = torch.zeros(T, E, x.shape[1], dtype=torch.float32, device=x.device)
        full[t_idx, e_idx] = ct[d].float()
        acc = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
        for e in range(E - 1, -1, -1):  # slot order (descending expert), fp32, deterministic
            acc = acc + full[:, e]
        outputs["grad.x"].copy_(acc.to(outputs["grad.x"].dtype))
    if "grad.probs" in outputs:
        gp = outputs["grad.probs"]
        gp.zero_()
        gp[t_idx, e_idx] = inputs["cotangent.permuted_probs"][d]


status = 0


def run(label, op, impl, **kw):
    global status
    t0 = time.time()
    try:
        r = moe_harness.check(op, impl, cases=CASES, seed=SEED, **kw)
        print("PASS %-44s %s (%.1f s)" % (label, r.summary(), time.time() - t0))
        return True
    except AssertionError as e:
        msg = str(e)
        print("FAIL %-44s (%.1f s)\n%s" % (label, time.time() - t0, msg[:6000]))
        return False


print("\n== topk_router: torch.topk on CUDA; which tie policy does it need?")
needed = None
for ties in ("canonical", "te", "any"):
    if run("topk_router torch ties=%s" % ties, "topk_router", torch_router, framework="torch",
           device=DEV, ties=ties):
        needed = ties
        break
print("topk_router with torch.topk needs ties=%s" % needed)
if needed is None:
    status = 1

print("\n== token_dispatch: index-based permute on CUDA")
if not run("token_dispatch torch", "token_dispatch", torch_dispatch, framework="torch", device=DEV):
    status = 1


# ---- the other frameworks' plumbing: sort_chunks_by_index as a gather on the device
def sort_chunks_xp(xp):
    def impl(case, inputs, outputs):
        x, split = inputs["input.x"], inputs["input.split_sizes"].astype(xp.int64)
        order = inputs["input.sorted_indices"].astype(xp.int64)
        N, C = x.shape[0], split.shape[0]
        P = xp.cumsum(split) - split
        pos = xp.zeros(C, dtype=xp.int64).at[order].set(xp.arange(C)) if xp.__name__.startswith("jax") \
            else _scatter(xp, order, C)
        new_off = xp.cumsum(split[order]) - split[order]
        i = xp.arange(N)
        chunk = xp.searchsorted(xp.cumsum(split), i, side="right")
        inside = i < xp.sum(split)
        chunk_c = xp.minimum(chunk, C - 1)
        dst = xp.where(inside, new_off[pos[chunk_c]] + i - P[chunk_c], i)
        out = {"output.row_id_map": dst.astype(xp.int32)}
        inv = xp.argsort(dst)
        out["output.sorted"] = x[inv]
        if "input.probs" in inputs:
            out["output.sorted_probs"] = inputs["input.probs"][inv]
        if "cotangent.sorted" in inputs:
            out["grad.x"] = inputs["cotangent.sorted"][dst]
        if "cotangent.sorted_probs" in inputs:
            out["grad.probs"] = inputs["cotangent.sorted_probs"][dst]
        return out
    return impl


def _scatter(xp, order, C):
    pos = xp.zeros(C, dtype=xp.int64)
    pos[order] = xp.arange(C)
    return pos


print("\n== sort_chunks_by_index through the other frameworks (returned dicts)")
for fw, mod in (("torch", None), ("jax", "jax.numpy"), ("cupy", "cupy")):
    if mod is None:
        continue
    try:
        xp = __import__(mod, fromlist=["x"])
    except Exception as e:  # not installed
        print("SKIP %s: %s" % (fw, e))
        continue
    if fw == "jax":
        import jax
        print("jax", jax.__version__, jax.devices())
        jax.config.update("jax_enable_x64", True)
    if not run("sort_chunks_by_index %s" % fw, "sort_chunks_by_index", sort_chunks_xp(xp),
               framework=fw, device="cuda"):
        status = 1
print("\nresult:", "PASSED" if status == 0 else "FAILED",
      "| topk_router with torch.topk needs ties=%s" % needed)
sys.exit(status)
EOF
