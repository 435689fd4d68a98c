"""Moving tensors between NumPy (the harness's host buffers) and PyTorch, JAX and CuPy.

bfloat16 is ml_dtypes.bfloat16 in NumPy and torch.bfloat16 / jnp.bfloat16 in the frameworks; CuPy
has no bfloat16, so bf16 tensors reach CuPy as uint16 arrays of the raw bit patterns (and may be
returned so).
"""
import traceback

import numpy as np

FRAMEWORKS = ("numpy", "torch", "jax", "cupy")


def _bf16():
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


def framework_of(x):
    """'numpy', 'torch', 'jax', 'cupy' or None, from the array's type (no framework import)."""
    if isinstance(x, np.ndarray):
        return "numpy"
    mod = type(x).__module__ or ""
    if mod.startswith("torch"):
        return "torch"
    if mod.startswith("jax") or mod.startswith("jaxlib"):
        return "jax"
    if mod.startswith("cupy"):
        return "cupy"
    return None


def _jax_device(device):
    import jax
    if device is None or not isinstance(device, str):
        return device
    kind, _, idx = device.partition(":")
    kind = {"cuda": "gpu", "rocm": "gpu"}.get(kind, kind)
    devs = jax.devices(kind)
    return devs[int(idx) if idx else 0]


def to_framework(arr, framework, device=None):
    """A new array of `framework` on `device` holding a copy of the NumPy array arr."""
    if framework == "numpy":
        return np.array(arr, copy=True)
    if framework == "torch":
        import torch
        if arr.dtype == _bf16():
            t = torch.from_numpy(np.ascontiguousarray(arr).view(np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.array(arr, copy=True))
        return t.to(device) if device is not None else t
    if framework == "jax":
        import jax
        dev = _jax_device(device)
        return jax.device_put(np.array(arr, copy=True), dev) if dev is not None else jax.numpy.asarray(arr)
    if framework == "cupy":
        import cupy
        host = arr.view(np.uint16) if arr.dtype == _bf16() else arr
        if device is None:
            return cupy.asarray(host)
        idx = int(str(device).partition(":")[2] or 0) if not isinstance(device, int) else device
        with cupy.cuda.Device(idx):
            return cupy.asarray(host)
    raise ValueError("framework must be one of %s, not %r" % (", ".join(FRAMEWORKS), framework))


def to_numpy(x):
    """A NumPy array (on the host) from a NumPy, PyTorch, JAX or CuPy array, or anything with
    __array__; bfloat16 as ml_dtypes.bfloat16."""
    fw = framework_of(x)
    if fw == "numpy":
        return x
    if fw == "torch":
        import torch
        t = x.detach()
        if t.is_conj():
            t = t.resolve_conj()
        t = t.to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(_bf16())
        return t.numpy()
    if fw == "cupy":
        return x.get()
    return np.asarray(x)


def store(key, value, host):
    """Copies an implementation's result into the harness's host buffer `host` (NumPy view),
    requiring its dtype and shape."""
    arr = to_numpy(value)
    if arr.dtype == np.uint16 and host.dtype == _bf16():
        arr = arr.view(_bf16())  # CuPy's raw bf16
    if arr.dtype != host.dtype or tuple(arr.shape) != tuple(host.shape):
        raise TypeError("%s: got %s%s, the case's output is %s%s" % (
            key, arr.dtype, list(arr.shape), host.dtype, list(host.shape)))
    np.copyto(host, arr)


class ImplementationError(RuntimeError):
    """An exception raised by an implementation under check(); its message is the traceback."""


def make_runner(impl, framework, device, wrap_case, not_supported=()):
    """The function the C++ Impl calls: (case, params_json, inputs, outputs, dtypes) with
    zero-copy NumPy views of the call's host buffers (outputs poisoned)."""
    if framework not in FRAMEWORKS:
        raise ValueError("framework must be one of %s, not %r" % (", ".join(FRAMEWORKS), framework))

    def runner(core_case, params_json, ins, outs, dtypes):
        try:
            run(core_case, params_json, ins, outs)
        except not_supported:
            raise
        except Exception as e:  # the traceback from the implementation's call down
            tb = traceback.format_exception(type(e), e, e.__traceback__)
            raise ImplementationError("".join(tb).rstrip() + "\n") from None

    def run(core_case, params_json, ins, outs):
        case = wrap_case(core_case, params_json)
        if framework == "numpy":
            fin, fout = ins, outs
        else:
            fin = {k: to_framework(v, framework, device) for k, v in ins.items()}
            # Output tensors start as copies of the poisoned host buffers, so an element the
            # implementation leaves unwritten still fails.
            fout = {k: to_framework(v, framework, device) for k, v in outs.items()}
        ret = impl(case, fin, fout)
        returned = set()
        if ret is not None:
            if not isinstance(ret, dict):
                raise TypeError("the implementation returned %s; return None (outputs written "
                                "in place) or a dict of outputs" % type(ret).__name__)
            for k, v in ret.items():
                if k not in outs:
                    raise KeyError("the implementation returned %r, which is not an output of "
                                   "this case (its outputs: %s)" % (k, ", ".join(sorted(outs))))
                store(k, v, outs[k])
                returned.add(k)
        elif framework == "jax":
            raise TypeError("a JAX implementation must return a dict of its outputs (JAX arrays "
                            "are immutable)")
        if framework != "numpy":
            for k in outs:
                if k not in returned:
                    store(k, fout[k], outs[k])
    return runner
