"""Arrays layer: the per-element operations a sparsifier calls, bound to one array namespace.

``HostOps`` runs the ``@njit`` kernels on NumPy buffers. ``CudaOps`` (``_cuda_ops``) offers the
same methods on CuPy buffers. Sparsifiers call these methods only, never a kernel directly, so one
sparsifier body serves both devices.
"""
import numpy as np

from .kernels import cpu as _k


class HostOps:
    device = "cpu"
    xp = np

    @staticmethod
    def empty(n, dtype):
        return np.empty(n, dtype=dtype)

    @staticmethod
    def zeros(n, dtype):
        return np.zeros(n, dtype=dtype)

    @staticmethod
    def fill_zero(x):
        x.fill(0)

    @staticmethod
    def accumulate_select(residual, grad, acc, lo, hi, thr, idx):
        """``acc = residual + grad``; select ``|acc| >= thr`` in [lo, hi) into idx; return (count, nonfinite)."""
        c, bad = _k.accumulate_select(residual, grad, acc, lo, hi, thr, idx)
        return int(c), int(bad)

    @staticmethod
    def select_range(x, lo, hi, thr, idx):
        return int(_k.select_range(x, lo, hi, thr, idx))

    @staticmethod
    def count_range(x, lo, hi, thr):
        return int(_k.count_range(x, lo, hi, thr))

    @staticmethod
    def gather(src, idx, out):
        _k.gather(src, idx, out)

    @staticmethod
    def scatter(out, idx, vals):
        _k.scatter(out, idx, vals)

    @staticmethod
    def zero_at(x, idx):
        _k.zero_at(x, idx)

    @staticmethod
    def scatter_mean_zero(out, residual, idx, sums, p):
        _k.scatter_mean_zero(out, residual, idx, sums, p)

    @staticmethod
    def to_host(x):
        return x

    @staticmethod
    def from_host(a):
        return a

    @staticmethod
    def synchronize():
        pass


def ops_for(device):
    if device == "cpu":
        return HostOps
    from ._cuda_ops import CudaOps

    return CudaOps


def gpu_available():
    """True when CuPy can allocate on a CUDA device (a successful import is not enough)."""
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False
