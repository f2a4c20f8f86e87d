"""Arrays layer: which array namespace a buffer lives in, DLPack in and out, dtype rules.

The sparsifiers work on NumPy (host) or CuPy (CUDA) arrays only. ``Input`` wraps whatever the user
passed: the backend array it views without a copy, and how to hand a result back as the same kind
of object on the same device (NumPy in, NumPy out; torch in, torch out).
"""
import numpy as np

from ._errors import InputCode

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
DTYPE_CODES = {np.dtype(np.float32): 1, np.dtype(np.float64): 2}
DTYPE_NAMES = {0: "unknown", 1: "float32", 2: "float64"}

# DLPack device types (dlpack.h): 1 CPU, 2 CUDA, 3 CUDA host (pinned), 13 CUDA managed.
_DL_CPU = (1, 3)
_DL_CUDA = (2, 13)


class Input:
    """A user's gradient seen as a backend array.

    ``array`` is a NumPy or CuPy array sharing memory with the user's object; ``device`` is
    ``"cpu"`` or ``"cuda"``; ``error`` is ``(InputCode, detail)`` when the object cannot be used.
    """

    __slots__ = ("array", "device", "error", "_wrap")

    def __init__(self, array, device, wrap, error=None):
        self.array = array
        self.device = device
        self._wrap = wrap
        self.error = error

    def wrap(self, out):
        """Return backend array ``out`` as an object of the kind the user passed."""
        return self._wrap(out)


def _identity(x):
    return x


def _module_root(obj):
    return type(obj).__module__.split(".", 1)[0]


def _torch_wrap(out):
    import torch

    return torch.from_dlpack(out)


def _jax_wrap(out):
    import jax.dlpack

    return jax.dlpack.from_dlpack(out)


def _cupy_wrap(out):
    return out


class _Capsule:
    """Gives a bare DLPack capsule (TensorFlow's export) the ``__dlpack__`` protocol."""

    def __init__(self, capsule, device):
        self._capsule = capsule
        self._device = device

    def __dlpack__(self, *args, **kwargs):
        return self._capsule

    def __dlpack_device__(self):
        return self._device


def _tf_wrap(out):
    import tensorflow as tf

    return tf.experimental.dlpack.from_dlpack(out.__dlpack__())


def as_input(obj):
    """View ``obj`` as a backend array without copying. Never raises: errors go in ``Input.error``."""
    if isinstance(obj, np.ndarray):
        return Input(obj, "cpu", _identity)
    root = _module_root(obj)
    if root == "torch" and getattr(obj, "requires_grad", False):
        return Input(None, "cpu", _identity, (InputCode.REQUIRES_GRAD, 0))
    if root == "cupy":
        return Input(obj, "cuda", _cupy_wrap)
    wrap = {"torch": _torch_wrap, "jax": _jax_wrap, "jaxlib": _jax_wrap}.get(root, _identity)
    src = obj
    if root == "tensorflow" and not hasattr(obj, "__dlpack__"):
        try:
            import tensorflow as tf

            dev = (2, 0) if "GPU" in (obj.device or "") else (1, 0)
            src = _Capsule(tf.experimental.dlpack.to_dlpack(obj), dev)
            wrap = _tf_wrap
        except Exception:
            return Input(None, "cpu", _identity, (InputCode.NOT_ARRAY, 0))
    if not hasattr(src, "__dlpack__"):
        return Input(None, "cpu", _identity, (InputCode.NOT_ARRAY, 0))
    try:
        dev_type = int(src.__dlpack_device__()[0])
    except Exception:
        return Input(None, "cpu", _identity, (InputCode.NOT_ARRAY, 0))
    try:
        if dev_type in _DL_CPU:
            return Input(np.from_dlpack(src), "cpu", wrap)
        if dev_type in _DL_CUDA:
            import cupy

            return Input(cupy.from_dlpack(src), "cuda", wrap)
    except BufferError:
        # Non-contiguous or otherwise unexportable views end here.
        return Input(None, "cpu", _identity, (InputCode.NOT_CONTIGUOUS, 0))
    except Exception:
        return Input(None, "cpu", _identity, (InputCode.NOT_ARRAY, 0))
    return Input(None, "cpu", _identity, (InputCode.DEVICE, dev_type))


def check_vector(inp, numel, dtype, device):
    """Return ``(InputCode, detail)`` for the first problem with ``inp`` as a gradient, or None.

    ``dtype`` is the residual's dtype (None before the first step fixes it); ``device`` the
    sparsifier's (None while still free).
    """
    if inp.error is not None:
        return inp.error
    a = inp.array
    if device is not None and inp.device != device:
        return (InputCode.DEVICE, 2 if inp.device == "cuda" else 1)
    if a.ndim != 1:
        return (InputCode.NDIM, a.ndim)
    if a.shape[0] != numel:
        return (InputCode.LENGTH, a.shape[0])
    dt = np.dtype(a.dtype)
    if dt not in SUPPORTED_DTYPES:
        return (InputCode.DTYPE, 0)
    if dtype is not None and dt != dtype:
        return (InputCode.DTYPE_MISMATCH, DTYPE_CODES[dt])
    if a.strides[0] != dt.itemsize:
        return (InputCode.NOT_CONTIGUOUS, 0)
    return None


def threshold_for(thr, dtype):
    """The smallest value of ``dtype`` that is >= ``thr``.

    ``|x| >= threshold_for(thr, dtype)`` in ``dtype`` is then exactly ``|x| >= thr`` in float64 for
    every ``x`` of ``dtype``, so the kernels compare in the array's own dtype without rounding error.
    """
    t = dtype.type(thr)
    if float(t) < thr:
        t = np.nextafter(t, dtype.type(np.inf))
    return t
