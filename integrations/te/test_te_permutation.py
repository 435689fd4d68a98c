"""pytest: TransformerEngine's Triton mask-map permutation kernels (te_permutation.py) judged by
moe_harness through its pytest plugin's `moe_check` fixture, one test per op (every named case
plus --moe-cases random ones, seed --moe-seed; --moe-case LINE replays one case).

    pytest integrations/te/test_te_permutation.py --moe-cases 50          # CUDA device
    MOE_TE_DEVICE=cpu TRITON_INTERPRET=1 MOE_TE_MAX_ELEMS=20000 \
        pytest integrations/te/test_te_permutation.py --moe-cases 3        # Triton interpreter

Skips (with the reason) when torch or triton is missing, TE's Triton sources are not found
(MOE_TE_PYTHON, default <repo>/.te/python), or there is no CUDA device -- unless MOE_TE_DEVICE=cpu
with TRITON_INTERPRET=1. MOE_TE_MAX_ELEMS (CPU only) skips cases with a larger tensor.
A failing case is a finding about TE (or the mapping): its report and replay line are printed.
"""
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

pytest_plugins = ["moe_harness.pytest"]

OPS = ("token_dispatch", "token_combine", "sort_chunks_by_index")
DEVICE = "cpu" if os.environ.get("MOE_TE_DEVICE") == "cpu" else "cuda"


def _skip_reason():
    try:
        import torch  # noqa: F401
        import triton  # noqa: F401
    except ImportError as e:
        return "torch and triton are needed (%s)" % e
    import te_permutation as tp
    f = tp.te_python_dir() / "transformer_engine" / "common" / "triton" / "permutation.py"
    if not f.is_file():
        return "TE's Triton sources are missing: %s (set MOE_TE_PYTHON or run " \
               "../shared/gpu-deps/te/fetch_te.sh .te)" % f
    if DEVICE == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "MOE_TE_DEVICE=cpu needs TRITON_INTERPRET=1 (Triton's interpreter)"
    elif not torch.cuda.is_available():
        return "no CUDA device (MOE_TE_DEVICE=cpu with TRITON_INTERPRET=1 runs the interpreter)"
    try:
        tp.load(DEVICE)
    except tp.TEUnavailable as e:
        return str(e)
    return None


_REASON = _skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


@pytest.mark.parametrize("op", OPS)
def test_te_permutation(moe_check, op):
    import moe_harness
    import te_permutation as tp
    impl = tp.IMPLS[op]
    cap = int(os.environ.get("MOE_TE_MAX_ELEMS", "0") or 0)
    if cap and DEVICE == "cpu":
        from te_permutation_check import _capped
        impl = _capped(impl, cap, moe_harness.NotSupported)
    r = moe_check(op, impl, framework="torch", device=DEVICE, provides=tp.provides(op),
                  name="te_triton_" + op, unwritten="te")
    print(r.summary())
    for k, why in tp.NOT_PROVIDED[op].items():
        print("not provided: %s: %s" % (k, why))
