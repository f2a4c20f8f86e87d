"""Element-wise kernels on an index list (gather, scatter, their fused forms) and the zeroing of a
run of words, with their launchers."""
from numba import cuda

from .launch import _elementwise


@cuda.jit
def _zero_words(w, nw):
    k = cuda.grid(1)
    while k < nw:
        w[k] = 0
        k += cuda.gridsize(1)


@cuda.jit
def _gather(src, idx, out):
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    while j < idx.shape[0]:
        out[j] = src[idx[j]]
        j += stride


@cuda.jit
def _scatter(out, idx, vals):
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    while j < idx.shape[0]:
        out[idx[j]] = vals[j]
        j += stride


@cuda.jit
def _zero_at(x, idx):
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    while j < idx.shape[0]:
        x[idx[j]] = 0
        j += stride


@cuda.jit
def _scatter_mean_zero(out, residual, idx, sums, p):
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    while j < idx.shape[0]:
        i = idx[j]
        out[i] = sums[j] / p
        residual[i] = 0
        j += stride


def gather(src, idx, out, stream=0):
    """``out[j] = src[idx[j]]``."""
    _elementwise(_gather, idx.shape[0], stream, src, idx, out)


def scatter(out, idx, vals, stream=0):
    """``out[idx[j]] = vals[j]``."""
    _elementwise(_scatter, idx.shape[0], stream, out, idx, vals)


def zero_at(x, idx, stream=0):
    """``x[idx[j]] = 0``."""
    _elementwise(_zero_at, idx.shape[0], stream, x, idx)


def scatter_mean_zero(out, residual, idx, sums, p, stream=0):
    """``out[idx[j]] = sums[j] / p`` and ``residual[idx[j]] = 0``; ``p`` in out's dtype."""
    _elementwise(_scatter_mean_zero, idx.shape[0], stream, out, residual, idx, sums, p)


def zero_words(w, nw, stream=0):
    """``w[:nw] = 0`` (a hit mask's words, histogram words), queued on ``stream``.

    Args:
        w: a device array (NumPy under the simulator) of at least ``nw`` elements.
        nw: how many leading elements to zero; 0 launches nothing.
        stream: the stream to queue on.

    Returns:
        None.

    Raises:
        Nothing of its own (Numba's, for an array the kernel does not accept).
    """
    _elementwise(_zero_words, nw, stream, w, nw)
