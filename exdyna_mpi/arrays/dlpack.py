"""Arrays layer: which array namespace a buffer lives in, DLPack in and out, dtype rules.

The sparsifiers work on NumPy (host) or CuPy (CUDA) arrays only. ``Input`` wraps whatever the user
passed: the backend array it views without a copy, and how to hand a result back as the same kind
of object on the same device (NumPy in, NumPy out; torch in, torch out).
"""
import numpy as np

from .._errors import InputCode

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
    # torch.from_dlpack shares memory with NumPy (CPU) and CuPy (CUDA) buffers: zero-copy.
    import torch

    return torch.from_dlpack(out)


def _jax_wrap(out):
    # Zero-copy when the buffer is 64-byte aligned (JAX's CPU requirement), else one copy.
    # JAX arrays are immutable: JAX users take the returned array, never ``out=``.
    import jax.dlpack

    return jax.dlpack.from_dlpack(_aligned_host(out))


def _cupy_wrap(out):
    return out


class _Capsule:
    """Gives a bare DLPack capsule (TensorFlow's export) the ``__dlpack__`` protocol.

    A capsule can be consumed once; ``as_input`` hands it to exactly one ``from_dlpack``.
    """

    def __init__(self, capsule, device):
        self._capsule = capsule
        self._device = device

    def __dlpack__(self, *args, **kwargs):
        return self._capsule

    def __dlpack_device__(self):
        return self._device


# JAX and TensorFlow want host buffers aligned to 64 bytes: JAX copies an unaligned one, TensorFlow
# accepts it and then aborts the process in its kernels (tensor.h "Check failed: IsAligned()").
_HOST_ALIGN = 64


def _aligned_host(a):
    """``a`` itself when 64-byte aligned (zero-copy), else an aligned copy. CuPy memory always is."""
    if not isinstance(a, np.ndarray) or a.ctypes.data % _HOST_ALIGN == 0:
        return a
    raw = np.empty(a.nbytes + _HOST_ALIGN, dtype=np.uint8)
    off = -raw.ctypes.data % _HOST_ALIGN
    b = raw[off:off + a.nbytes].view(a.dtype)
    b[...] = a
    return b


def _tf_wrap(out):
    import tensorflow as tf

    return tf.experimental.dlpack.from_dlpack(_aligned_host(out).__dlpack__())


def _tf_source(obj):
    """A TensorFlow tensor as a DLPack producer (TF exports capsules, not the protocol)."""
    if hasattr(obj, "__dlpack__"):
        return obj
    import tensorflow as tf

    dev = (2, 0) if "GPU" in (getattr(obj, "device", "") or "") else (1, 0)
    return _Capsule(tf.experimental.dlpack.to_dlpack(obj), dev)


_WRAPS = {"torch": _torch_wrap, "jax": _jax_wrap, "jaxlib": _jax_wrap, "tensorflow": _tf_wrap}


def _refuse(code, detail=0):
    return Input(None, "cpu", _identity, (code, detail))


def _export_error(exc):
    """Map a ``from_dlpack`` failure to the InputCode every rank will report."""
    text = str(exc).lower()
    if "dtype" in text or "data type" in text:
        return _refuse(InputCode.DTYPE)
    if "gradient" in text:
        return _refuse(InputCode.REQUIRES_GRAD)
    if "contiguous" in text or "stride" in text:
        return _refuse(InputCode.NOT_CONTIGUOUS)
    return _refuse(InputCode.NOT_ARRAY)


def as_input(obj):
    """View ``obj`` as a backend array without copying. Never raises: errors go in ``Input.error``.

    Accepts NumPy and CuPy arrays and any DLPack producer (``__dlpack__``/``__dlpack_device__``:
    PyTorch, JAX, ...), and TensorFlow tensors through their DLPack capsules. A CPU producer becomes a
    NumPy view, a CUDA one a CuPy view; ``Input.wrap`` turns the result back into the caller's kind
    (torch in, torch out), again without a copy. Strided views import fine and are refused later by
    ``check_vector`` (NOT_CONTIGUOUS), so every rank reports the same cause.

    Example::

        >>> inp = as_input(torch.zeros(8))
        >>> inp.array.ctypes.data == inp.wrap(inp.array).data_ptr()
        True
    """
    if isinstance(obj, np.ndarray):
        return Input(obj, "cpu", _identity)
    root = _module_root(obj)
    if root == "cupy":
        return Input(obj, "cuda", _cupy_wrap)
    if root == "torch" and getattr(obj, "requires_grad", False):
        # DLPack refuses these anyway; name the fix instead of a generic export error.
        return _refuse(InputCode.REQUIRES_GRAD)
    wrap = _WRAPS.get(root, _identity)
    src = obj
    if root == "tensorflow":
        try:
            src = _tf_source(obj)
        except Exception as exc:
            return _export_error(exc)
    if not (hasattr(src, "__dlpack__") and hasattr(src, "__dlpack_device__")):
        return _refuse(InputCode.NOT_ARRAY)
    try:
        dev_type = int(src.__dlpack_device__()[0])
    except Exception:
        # e.g. torch's "meta" device has no DLPack device type.
        return _refuse(InputCode.DEVICE, 0)
    if dev_type in _DL_CPU:
        try:
            return Input(np.from_dlpack(src), "cpu", wrap)
        except Exception as exc:
            return _export_error(exc)
    if dev_type in _DL_CUDA:
        try:
            import cupy
        except ImportError:
            return _refuse(InputCode.DEVICE, 2)
        try:
            return Input(cupy.from_dlpack(src), "cuda", wrap)
        except Exception as exc:
            return _export_error(exc)
    return _refuse(InputCode.DEVICE, dev_type)


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
