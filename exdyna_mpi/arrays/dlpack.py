"""Arrays layer: which array namespace a buffer lives in, DLPack in and out, dtype rules.

The sparsifiers work on NumPy (host) or CuPy (CUDA) arrays only. ``Input`` wraps whatever the user
passed: the backend array it views without a copy, and how to hand a result back as the same kind
of object on the same device (NumPy in, NumPy out; torch in, torch out).
"""
import numpy as np

from .._errors import InputCode

#: Every dtype name a gradient may arrive with, by the code that travels in the step's words (the
#: code names the dtype in a refusal on every rank); 0: a dtype outside this table.
DTYPE_NAMES = {0: "unknown", 1: "float32", 2: "float64", 3: "float16", 4: "bfloat16", 5: "int8",
               6: "int16", 7: "int32", 8: "int64", 9: "uint8", 10: "uint16", 11: "uint32", 12: "uint64",
               13: "bool", 14: "complex64", 15: "complex128", 16: "float128", 17: "complex256"}
NAME_CODES = {name: code for code, name in DTYPE_NAMES.items() if code}
#: The dtypes of the full-precision path (and of the averagers): they are computed in as they come.
FULL_DTYPES = ("float32", "float64")
#: The half dtypes: accepted by the sparsifiers on the host, computed in float32 (``arrays.half``).
HALF_DTYPES = ("float16", "bfloat16")
#: What the sparsifiers accept, in the order a refusal lists them.
ACCEPTED_DTYPES = ("float16", "bfloat16", "float32", "float64")


def dtype_code(name):
    """The code of dtype ``name`` (0 for one outside ``DTYPE_NAMES``)."""
    return NAME_CODES.get(name, 0)


def compute_dtype(name):
    """The dtype a gradient of dtype ``name`` is computed in: float32 for the half dtypes."""
    return np.dtype(np.float32) if name in HALF_DTYPES else np.dtype(name)

# DLPack device types (dlpack.h): 1 CPU, 2 CUDA, 3 CUDA host (pinned), 13 CUDA managed.
_DL_CPU = (1, 3)
_DL_CUDA = (2, 13)


class Input:
    """A user's gradient seen as a backend array.

    ``array`` is a NumPy or CuPy array sharing memory with the user's object; ``device`` is
    ``"cpu"`` or ``"cuda"``; ``error`` is ``(InputCode, detail)`` when the object cannot be used.
    ``dtype`` is the name of the user's dtype: ``array.dtype``'s, except for bfloat16, which NumPy
    lacks: then ``array`` is a uint16 view of the bits (``arrays.half`` converts them).
    """

    __slots__ = ("array", "device", "error", "dtype", "_wrap")

    def __init__(self, array, device, wrap, error=None, dtype=None):
        self.array = array
        self.device = device
        self._wrap = wrap
        self.error = error
        self.dtype = dtype if dtype is not None or array is None else np.dtype(array.dtype).name

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


def _torch_bf16_wrap(out):
    """uint16 bits of bfloat16 values as a torch.bfloat16 tensor (zero-copy)."""
    import torch

    return torch.from_dlpack(out.view(np.int16)).view(torch.bfloat16)


def _ml_bf16_wrap(dtype):
    """uint16 bits as a NumPy array of ``dtype`` (ml_dtypes' bfloat16), zero-copy."""
    return lambda out: out.view(dtype)


def _jax_wrap(out):
    # Zero-copy when the buffer is 64-byte aligned (JAX's CPU requirement), else one copy.
    # JAX arrays are immutable: JAX users take the returned array, never ``out=``.
    import jax.dlpack

    return jax.dlpack.from_dlpack(_aligned_host(out))


def _jax_bf16_wrap(out):
    """uint16 bits of bfloat16 values as a JAX bfloat16 array."""
    import jax

    return jax.lax.bitcast_convert_type(_jax_wrap(out.view(np.uint16)), "bfloat16")


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


def _tf_bf16_wrap(out):
    """uint16 bits of bfloat16 values as a TensorFlow bfloat16 tensor."""
    import tensorflow as tf

    return tf.bitcast(_tf_wrap(out.view(np.uint16)), tf.bfloat16)


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


def _export_error(exc, dtype=0):
    """Map a ``from_dlpack`` failure to the InputCode every rank will report (``dtype``: the code
    of the producer's dtype where known, for a dtype refusal)."""
    text = str(exc).lower()
    if "dtype" in text or "data type" in text:
        # an accepted dtype this producer cannot export to NumPy/CuPy: no name, "unsupported"
        return _refuse(InputCode.DTYPE, 0 if DTYPE_NAMES.get(dtype) in ACCEPTED_DTYPES else dtype)
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
        if obj.dtype.name == "bfloat16":   # ml_dtypes' bfloat16: its bits as uint16
            return Input(obj.view(np.uint16), "cpu", _ml_bf16_wrap(obj.dtype), dtype="bfloat16")
        return Input(obj, "cpu", _identity)
    root = _module_root(obj)
    if root == "cupy":
        return Input(obj, "cuda", _cupy_wrap)
    if root == "torch" and getattr(obj, "requires_grad", False):
        # DLPack refuses these anyway; name the fix instead of a generic export error.
        return _refuse(InputCode.REQUIRES_GRAD)
    wrap = _WRAPS.get(root, _identity)
    src = obj
    name = None
    dt_code = dtype_code(str(getattr(obj, "dtype", "")).rsplit(".", 1)[-1])
    if root == "torch" and dt_code == NAME_CODES["bfloat16"]:
        # DLPack has bfloat16 but NumPy has not: take the same memory as int16 (a view, no copy)
        try:
            src, wrap, name = obj.view(_torch_int16()), _torch_bf16_wrap, "bfloat16"
        except Exception as exc:
            return _export_error(exc, dt_code)
    if root in ("jax", "jaxlib") and dt_code == NAME_CODES["bfloat16"]:
        # the bits as uint16 (JAX arrays are immutable: a bitcast is a new array either way)
        try:
            import jax

            src, wrap, name = jax.lax.bitcast_convert_type(obj, "uint16"), _jax_bf16_wrap, "bfloat16"
        except Exception as exc:
            return _export_error(exc, dt_code)
    if root == "tensorflow":
        try:
            if getattr(getattr(obj, "dtype", None), "name", "") == "bfloat16":
                import tensorflow as tf

                obj, wrap, name = tf.bitcast(obj, tf.uint16), _tf_bf16_wrap, "bfloat16"
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
            a = np.from_dlpack(src)
        except Exception as exc:
            return _export_error(exc, dt_code)
        return Input(a.view(np.uint16) if name else a, "cpu", wrap, dtype=name)
    if dev_type in _DL_CUDA:
        try:
            import cupy
        except ImportError:
            return _refuse(InputCode.DEVICE, 2)
        try:
            a = cupy.from_dlpack(src)
        except Exception as exc:
            return _export_error(exc, dt_code)
        return Input(a.view(np.uint16) if name else a, "cuda", wrap, dtype=name)
    return _refuse(InputCode.DEVICE, dev_type)


def _torch_int16():
    import torch

    return torch.int16


def check_vector(inp, numel, dtype, device, accepted=FULL_DTYPES):
    """Return ``(InputCode, detail)`` for the first problem with ``inp`` as a gradient, or None.

    ``dtype`` is the dtype (or its name) earlier steps fixed (None before the first step fixes it);
    ``device`` the sparsifier's (None while still free); ``accepted`` the dtype names the caller
    takes (``FULL_DTYPES``, or the sparsifiers' ``ACCEPTED_DTYPES``).
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
    name = inp.dtype
    if name not in accepted:
        return (InputCode.DTYPE, dtype_code(name))
    if dtype is not None and name != (dtype if isinstance(dtype, str) else np.dtype(dtype).name):
        return (InputCode.DTYPE_MISMATCH, dtype_code(name))
    if a.strides[0] != a.dtype.itemsize:
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
