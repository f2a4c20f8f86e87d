"""CPU kernels: Numba ``@njit`` on NumPy buffers.

Each kernel is a single pass with the loop variable running from 0 over a slice, which lets Numba
drop wraparound checks and vectorise (measured on this project's machines: a runtime-offset ``range(s, e)``
index was 3.5x slower). Comparisons are IEEE exact: no fastmath, so every rank and the CUDA kernels
produce the same bits.
"""
from numba import njit

_CHUNK = 4096  # elements per inner block: small enough that a re-read stays in L1/L2


@njit(cache=True, nogil=True)
def _add_count_nonfinite(r, g, acc):
    # acc = r + g; the non-finite test reads acc back from cache, chunk by chunk.
    n = acc.shape[0]
    bad = 0
    for s in range(0, n, _CHUNK):
        e = min(s + _CHUNK, n)
        rs = r[s:e]
        gs = g[s:e]
        a = acc[s:e]
        for i in range(e - s):
            a[i] = rs[i] + gs[i]
        for i in range(e - s):
            # x - x is 0 for every finite x and NaN for inf and NaN.
            if a[i] - a[i] != 0:
                bad += 1
    return bad


@njit(cache=True, nogil=True)
def _add_select(r, g, acc, thr, idx, base):
    n = acc.shape[0]
    bad = 0
    c = 0
    for i in range(n):
        v = r[i] + g[i]
        acc[i] = v
        if v - v != 0:
            bad += 1
        if abs(v) >= thr:
            idx[c] = base + i
            c += 1
    return c, bad


@njit(cache=True, nogil=True)
def accumulate_select(residual, grad, acc, lo, hi, thr, idx):
    """``acc = residual + grad`` everywhere; select ``|acc| >= thr`` inside ``[lo, hi)``.

    Writes the selected element offsets in ascending order to ``idx[:count]`` (capacity >= hi - lo)
    and returns ``(count, nonfinite)`` where ``nonfinite`` counts non-finite ``acc`` values over
    the whole vector. ``residual`` and ``grad`` are only read, so a refused step loses nothing.
    ``thr`` has the dtype of ``acc`` (the caller rounds it up so the compare is exact).
    """
    bad = _add_count_nonfinite(residual[:lo], grad[:lo], acc[:lo])
    count, bad_mid = _add_select(residual[lo:hi], grad[lo:hi], acc[lo:hi], thr, idx, lo)
    bad += bad_mid
    bad += _add_count_nonfinite(residual[hi:], grad[hi:], acc[hi:])
    return count, bad


@njit(cache=True, nogil=True)
def select_range(x, lo, hi, thr, idx):
    """Write offsets ``i`` in ``[lo, hi)`` with ``|x[i]| >= thr`` to ``idx`` (ascending); return the count."""
    xs = x[lo:hi]
    c = 0
    for i in range(xs.shape[0]):
        if abs(xs[i]) >= thr:
            idx[c] = lo + i
            c += 1
    return c


@njit(cache=True, nogil=True)
def count_range(x, lo, hi, thr):
    """Number of ``i`` in ``[lo, hi)`` with ``|x[i]| >= thr``."""
    xs = x[lo:hi]
    c = 0
    for i in range(xs.shape[0]):
        if abs(xs[i]) >= thr:
            c += 1
    return c


@njit(cache=True, nogil=True)
def gather(src, idx, out):
    """``out[j] = src[idx[j]]``."""
    for j in range(idx.shape[0]):
        out[j] = src[idx[j]]


@njit(cache=True, nogil=True)
def scatter(out, idx, vals):
    """``out[idx[j]] = vals[j]``."""
    for j in range(idx.shape[0]):
        out[idx[j]] = vals[j]


@njit(cache=True, nogil=True)
def zero_at(x, idx):
    """``x[idx[j]] = 0``."""
    for j in range(idx.shape[0]):
        x[idx[j]] = 0


@njit(cache=True, nogil=True)
def scatter_mean_zero(out, residual, idx, sums, p):
    """``out[idx[j]] = sums[j] / p`` and ``residual[idx[j]] = 0`` in one pass over the union.

    ``p`` (the number of ranks) is passed in the dtype of ``out`` so the division is done in it.
    """
    for j in range(idx.shape[0]):
        i = idx[j]
        out[i] = sums[j] / p
        residual[i] = 0
