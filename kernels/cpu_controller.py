"""CPU kernels for the histogram threshold controller: Numba ``@njit`` on NumPy buffers.

One kernel, ``accumulate_select_hist``: the step's single pass (``acc = residual + grad``, select
``|acc| >= thr`` in the owned range, count non-finite values) that also histograms a range of the
vector, and ``hist_range``, a histogram alone (used at step 0 only, to refine the first threshold).

Bucket semantics (exact, integer-only, so every rank and a CUDA port produce the same counts):
``bits`` is the IEEE bit pattern of ``acc[i]`` as a signed integer of the same width (int32 for
float32, int64 for float64); ``key = (bits & SIGN_OFF) >> shift`` where ``SIGN_OFF`` clears the
sign bit; the bucket is ``clamp(key - key0, 0, len(hist) - 1)``. With ``shift = mantissa_bits - s``
each octave of ``|acc|`` is cut into ``2**s`` equal-width buckets; bucket ``j`` holds the values
with ``edge(j) <= |acc| < edge(j + 1)``, where ``edge(j)`` is the float whose bits are
``(key0 + j) << shift`` (the first and last buckets also hold everything below / above). NaN and
inf land in the last bucket (the step is refused anyway).

With ``predict`` the histogram is of the next step's accumulator as this rank foresees it, over the
range ``[flo, fhi)`` of the partition it will own next step: ``p = (selected ? 0 : acc) +
grad[i + 1]``. Error feedback piles unselected mass just under the threshold, so how many elements
cross next step depends on that pile and on the gradient's size, which ``|acc|`` alone does not show
(after a 10x drop of gradient scale ``|acc|`` barely changes while far fewer elements cross). The
neighbour's gradient stands in for the next one (same layer, same scale, but not the gradient already
in ``acc``: that would count it twice). The next owner forecasts, not the current one: a rank's
residual in a partition it does not own is never thresholded, so it holds elements already above the
threshold that the current owner's freshly cleaned residual does not show. ``p`` is written to a
one-element scratch ``pbuf`` whose integer view ``pbits`` gives its bit pattern.

``hist_f`` (may be empty) is a second histogram of the same values with its own ``shift_f`` and
``key0_f``, same rule: a fine window around the threshold, where error feedback can make the count
change twofold for a 1 % change of threshold.
"""
import numpy as np
from numba import njit

from .cpu import _add_count_nonfinite, _add_select

@njit(cache=True, nogil=True)
def _add_select_hist(r, g, gn, g_end, acc, bits, thr, idx, base, sign_off, shift, key0, hist, shift_f, key0_f,
                     hist_f, predict, pbuf, pbits):
    # ``bits`` is ``acc`` viewed as integers (the same memory): the value just written is read
    # back as its bit pattern, which gives the bucket with two integer ops and no log.
    # ``gn[i]`` is element i's neighbour gradient (the next element's); past its end (the vector's
    # last element) it is ``g_end``, the gradient before it.
    n = acc.shape[0]
    top = hist.shape[0] - 1
    top_f = hist_f.shape[0] - 1
    bad = 0
    c = 0
    for i in range(n):
        v = r[i] + g[i]
        acc[i] = v
        if v - v != 0:
            bad += 1
        sel = abs(v) >= thr
        if sel:
            idx[c] = base + i
            c += 1
        if predict:
            nbv = gn[i] if i < gn.shape[0] else g_end
            pbuf[0] = nbv if sel else v + nbv
            b = pbits[0]
        else:
            b = bits[i]
        j = ((b & sign_off) >> shift) - key0
        if j < 0:
            j = 0
        elif j > top:
            j = top
        hist[j] += 1
        if top_f >= 0:
            j = ((b & sign_off) >> shift_f) - key0_f
            if j < 0:
                j = 0
            elif j > top_f:
                j = top_f
            hist_f[j] += 1
    return c, bad


@njit(cache=True, nogil=True)
def _hist(bits, sign_off, shift, key0, hist):
    top = hist.shape[0] - 1
    for i in range(bits.shape[0]):
        j = ((bits[i] & sign_off) >> shift) - key0
        if j < 0:
            j = 0
        elif j > top:
            j = top
        hist[j] += 1


@njit(cache=True, nogil=True)
def accumulate_select_hist(residual, grad, acc, bits, lo, hi, flo, fhi, thr, idx, sign_off, shift, key0, hist,
                           shift_f, key0_f, hist_f, predict, pbuf, pbits):
    """``accumulate_select`` of kernels/cpu.py (select in ``[lo, hi)``) plus histograms over ``[flo, fhi)``.

    Without ``predict`` the histograms are of ``|acc|``; with it, of ``|p|``, ``p = (selected ? 0 :
    acc) + grad[i + 1]`` (the last element of the vector takes ``grad[i - 1]``). ``bits`` must be
    ``acc.view(int32)`` (float32) or ``acc.view(int64)`` (float64). Returns ``(count, nonfinite)``
    exactly as ``accumulate_select``; ``hist`` and ``hist_f`` (int64) are added to, not reset.
    """
    n = acc.shape[0]
    pts = np.sort(np.array([0, lo, hi, flo, fhi, n]))
    inf = acc.dtype.type(np.inf)
    c = 0
    bad = 0
    for s in range(pts.shape[0] - 1):
        a = pts[s]
        b = pts[s + 1]
        if a >= b:
            continue
        sel = lo <= a and b <= hi
        if flo <= a and b <= fhi:
            cc, bb = _add_select_hist(residual[a:b], grad[a:b], grad[a + 1:min(b + 1, n)], grad[max(n - 2, 0)],
                                      acc[a:b], bits[a:b],
                                      thr if sel else inf, idx[c:], a, sign_off, shift, key0, hist,
                                      shift_f, key0_f, hist_f, predict, pbuf, pbits)
        elif sel:
            cc, bb = _add_select(residual[a:b], grad[a:b], acc[a:b], thr, idx[c:], a)
        else:
            cc, bb = 0, _add_count_nonfinite(residual[a:b], grad[a:b], acc[a:b])
        c += cc
        bad += bb
    return c, bad


@njit(cache=True, nogil=True)
def hist_range(bits, lo, hi, sign_off, shift, key0, hist):
    """``hist += histogram(|x[lo:hi]|)`` where ``bits`` is ``x`` viewed as integers (read only)."""
    _hist(bits[lo:hi], sign_off, shift, key0, hist)


# ---------------------------------------------------------------------------- host wrappers
def int_view(x):
    """``x`` (float32 / float64) viewed as same-width signed integers, and the sign-clearing mask."""
    if x.dtype == np.float32:
        return x.view(np.int32), np.int32(0x7FFFFFFF)
    return x.view(np.int64), np.int64(0x7FFFFFFFFFFFFFFF)


def host_accumulate_select_hist(residual, grad, acc, lo, hi, thr, idx, shift, key0, hist, predict=False,
                                fine=None, forecast=None):
    """HostOps-style wrapper: returns ``(count, nonfinite)`` as Python ints; fills ``hist``.

    ``fine``: optional ``(shift_f, key0_f, hist_f)`` for the second histogram. ``forecast``: the
    ``(flo, fhi)`` range the histograms cover (default: the selected range ``[lo, hi)``).
    """
    bits, sign_off = int_view(acc)
    pbuf = np.zeros(1, acc.dtype)
    pbits, _ = int_view(pbuf)
    shift_f, key0_f, hist_f = fine if fine is not None else (0, 0, np.zeros(0, np.int64))
    flo, fhi = forecast if forecast is not None else (lo, hi)
    ity = bits.dtype.type
    c, bad = accumulate_select_hist(residual, grad, acc, bits, lo, hi, flo, fhi, thr, idx, sign_off, ity(shift),
                                    ity(key0), hist, ity(shift_f), ity(key0_f), hist_f, bool(predict), pbuf, pbits)
    return int(c), int(bad)


def host_hist_range(x, lo, hi, shift, key0, hist):
    bits, sign_off = int_view(x)
    hist_range(bits, lo, hi, sign_off, bits.dtype.type(shift), bits.dtype.type(key0), hist)
