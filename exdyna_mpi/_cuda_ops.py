"""Arrays layer, CUDA side: ``CudaOps``, the ``HostOps`` interface on CuPy buffers.

Every per-element operation is a Numba CUDA kernel (``kernels/cuda.py``) launched on CuPy's current
stream, so the kernels order correctly with whatever the user's framework queued there and the host
never waits, except for the two count words ``accumulate_select`` / ``select_range`` /
``count_range`` return (one small device->host copy each), and for the histogram controller's
``accumulate_select_hist`` / ``hist_range`` (module functions, called by exdyna_mpi/_controller_ops.py),
the same words followed by the histograms (one copy of ``2 + buckets`` int64 words).

Under the Numba CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) CuPy cannot allocate, so ``xp`` is NumPy
and the buffers are NumPy arrays that the simulator runs the same kernels on. CI exercises the whole
device path (kernels, ``CudaOps``, ``DeviceExchange`` staging) this way without a GPU.
"""
import numpy as np

from .kernels import cuda as _k

SIMULATOR = _k.SIMULATOR

if SIMULATOR:
    _xp = np
else:  # pragma: no cover - real GPU only
    try:
        import cupy as _xp
    except ImportError:  # ops_for("cuda") is only reached when gpu_available() said yes
        _xp = None

_scratch = {}  # device id -> kernels.cuda.Scratch, reused every step
_streams = {}  # CuPy stream pointer -> Numba external stream


def _stream():
    """The Numba view of CuPy's current stream (0 under the simulator)."""
    if SIMULATOR:
        return 0
    ptr = _xp.cuda.get_current_stream().ptr
    s = _streams.get(ptr)
    if s is None:
        from numba import cuda

        s = _streams[ptr] = cuda.external_stream(ptr)
    return s


def _scratch_here():
    key = -1 if SIMULATOR else _xp.cuda.Device().id
    s = _scratch.get(key)
    if s is None:
        s = _scratch[key] = _k.Scratch(CudaOps.zeros(_k.Scratch.size(), np.int64))
    return s


def _totals(scratch):
    """``[count, nonfinite]`` as host ints: the one device->host read of a selection."""
    t = scratch.totals
    if SIMULATOR:
        return int(t[0]), int(t[1])
    host = t.get(stream=_xp.cuda.get_current_stream())  # waits for this stream only
    return int(host[0]), int(host[1])


def _words(scratch, nw):
    """``[count, nonfinite, hist[:nw]]`` as one host int64 array: a single device->host read."""
    w = scratch.totals_hist[: 2 + nw]
    if SIMULATOR:
        return np.array(w, dtype=np.int64)
    return w.get(stream=_xp.cuda.get_current_stream()).astype(np.int64, copy=False)


class CudaOps:
    """Per-element ops on CUDA buffers; the same static methods as ``HostOps``.

    Example::

        >>> from exdyna_mpi._cuda_ops import CudaOps
        >>> acc = CudaOps.empty(n, np.float32)
        >>> count, bad = CudaOps.accumulate_select(residual, grad, acc, lo, hi, thr, idx)
    """

    device = "cuda"
    xp = _xp

    @staticmethod
    def empty(n, dtype):
        return _xp.empty(n, dtype=dtype)

    @staticmethod
    def zeros(n, dtype):
        return _xp.zeros(n, dtype=dtype)

    @staticmethod
    def fill_zero(x):
        x.fill(0)  # CuPy: a kernel on the current stream

    @staticmethod
    def accumulate_select(residual, grad, acc, lo, hi, thr, idx):
        """``acc = residual + grad``; select ``|acc| >= thr`` in [lo, hi) into idx; return (count, nonfinite)."""
        s = _scratch_here()
        _k.accumulate_select_async(residual, grad, acc, int(lo), int(hi), thr, idx, s, _stream())
        return _totals(s)

    @staticmethod
    def select_range(x, lo, hi, thr, idx):
        s = _scratch_here()
        _k.select_range_async(x, int(lo), int(hi), thr, idx, s, _stream())
        return _totals(s)[0]

    @staticmethod
    def count_range(x, lo, hi, thr):
        s = _scratch_here()
        _k.count_range_async(x, int(lo), int(hi), thr, s, _stream())
        return _totals(s)[0]

    @staticmethod
    def gather(src, idx, out):
        _k.gather(src, idx, out, _stream())

    @staticmethod
    def scatter(out, idx, vals):
        _k.scatter(out, idx, vals, _stream())

    @staticmethod
    def zero_at(x, idx):
        _k.zero_at(x, idx, _stream())

    @staticmethod
    def scatter_mean_zero(out, residual, idx, sums, p):
        _k.scatter_mean_zero(out, residual, idx, sums, p, _stream())

    @staticmethod
    def to_host(x):
        """A NumPy copy of ``x`` (user-facing reads such as ``residual``; never on the step path)."""
        return np.asarray(x) if SIMULATOR else _xp.asnumpy(x)

    @staticmethod
    def from_host(a):
        return np.array(a, copy=True) if SIMULATOR else _xp.asarray(a)

    @staticmethod
    def synchronize():
        """Wait for CuPy's current stream: call once before a device buffer goes to MPI."""
        if not SIMULATOR:
            _xp.cuda.get_current_stream().synchronize()


def accumulate_select_hist(residual, grad, acc, lo, hi, thr, idx, shift, key0, hist, predict=False, fine=None,
                           forecast=None, stride=1):
    """``CudaOps.accumulate_select`` plus the histogram controller's histograms (host int64 ``hist``
    and ``fine[2]``, added to), as ``kernels.cpu_controller.host_accumulate_select_hist``: one fused
    pass, one device->host copy of ``[count, nonfinite, hist..., fine...]``. A module function, not a
    ``CudaOps`` method: ``CudaOps`` keeps exactly ``HostOps``'s interface (exdyna_mpi/_controller_ops.py
    dispatches on ``ops.device``)."""
    s = _scratch_here()
    shift_f, key0_f, hist_f = fine if fine is not None else (0, 0, np.zeros(0, np.int64))
    nh, nf = hist.shape[0], hist_f.shape[0]
    _k.accumulate_select_hist_async(residual, grad, acc, int(lo), int(hi), thr, idx, shift, key0, nh, s, _stream(),
                                    None, predict, (shift_f, key0_f, nf), forecast, stride)
    w = _words(s, nh + nf)
    hist += w[2:2 + nh]
    hist_f += w[2 + nh:2 + nh + nf]
    return int(w[0]), int(w[1])


def hist_range(x, lo, hi, shift, key0, hist):
    """``hist`` (host int64) ``+=`` the histogram of ``|x[lo:hi]|``, as ``host_hist_range``."""
    s = _scratch_here()
    nh = hist.shape[0]
    _k.hist_range_async(x, int(lo), int(hi), shift, key0, nh, s, _stream())
    hist += _words(s, nh)[2:2 + nh]
