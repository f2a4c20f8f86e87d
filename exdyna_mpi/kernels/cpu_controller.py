"""CPU kernels of the measured threshold controller: Numba ``@njit`` on NumPy buffers.

``accumulate_measure``: the step's single pass (``acc = residual + grad`` everywhere, the non-finite
check) that also histograms ``|acc|`` over the owned range and keeps the marks (the elements at or
above the fine window's first edge) for the select that follows; ``hist_range``, a histogram alone
(a zoom); ``select_marks`` / ``hist_marks``, the select and a zoom from the marks.

Bucket semantics (exact, integer-only, so every rank and a CUDA port produce the same counts):
``bits`` is the IEEE bit pattern of ``acc[i]`` as a signed integer of the same width (int32 for
float32, int64 for float64); ``key = (bits & SIGN_OFF) >> shift`` where ``SIGN_OFF`` clears the
sign bit; the bucket is ``clamp(key - key0, 0, len(hist) - 1)``. With ``shift = mantissa_bits - s``
each octave of ``|acc|`` is cut into ``2**s`` equal-width buckets; bucket ``j`` holds the values
with ``edge(j) <= |acc| < edge(j + 1)``, where ``edge(j)`` is the float whose bits are
``(key0 + j) << shift`` (the first and last buckets also hold everything below / above). NaN and
inf land in the last bucket (the step is refused anyway).

``stride`` > 1 makes the coarse histogram a sample: only elements whose index is a multiple of
``stride`` (the controller scales its counts back up). It steers only the large jumps; the fine
window, which decides near the threshold, counts every element.

``hist_f`` (may be empty) is a second histogram of the same values with its own ``shift_f`` and
``key0_f``, same rule: a fine window around the threshold, where error feedback can make the count
change twofold for a 1 % change of threshold.
"""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit, uint64
from numba.cpython.unsafe.numbers import trailing_zeros

from .cpu_stream import add_mask_groups, group_aligned, store_fence, stream_add_copy, stream_add_max

_CHUNK = 4096  # elements per inner block: a chunk and its buckets are read back from L1


@njit(cache=True, nogil=True, inline="always")
def _hist_every(bits, first, m, stride, sign_off, shift, key0, hist):
    """The clamped histogram of ``bits[first:m:stride]`` (the coarse window's sample of a chunk)."""
    top = hist.shape[0] - 1
    for i in range(first, m, stride):
        j = ((bits[i] & sign_off) >> shift) - key0
        if j < 0:
            j = 0
        elif j > top:
            j = top
        hist[j] += 1


@njit(cache=True, nogil=True)
def _hist(bits, sign_off, shift, key0, hist):
    # _hist_every(bits, 0, n, 1, ...) computes the same, but measured 17 % slower over 2**24 elements
    top = hist.shape[0] - 1
    for i in range(bits.shape[0]):
        j = ((bits[i] & sign_off) >> shift) - key0
        if j < 0:
            j = 0
        elif j > top:
            j = top
        hist[j] += 1


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


@njit(cache=True, nogil=True)
def hist_band(bits, lo, hi, sign_off, shift, key0, hist, scratch):
    """``hist_range`` for a narrow window (a zoom): the values below bucket 1 (nearly all) are only
    counted; the others are compacted per chunk into ``scratch`` and bucketed. Same counts."""
    top = hist.shape[0] - 1
    low = (key0 + 1) << shift
    below = 0
    for s in range(lo, hi, _CHUNK):
        e = min(s + _CHUNK, hi)
        bs = bits[s:e]
        c = 0
        for i in range(e - s):
            if (bs[i] & sign_off) >= low:
                scratch[c] = i
                c += 1
        for q in range(c):
            j = ((bs[scratch[q]] & sign_off) >> shift) - key0
            hist[j if j < top else top] += 1
        below += (e - s) - c
    hist[0] += below


def host_hist_range(x, lo, hi, shift, key0, hist):
    bits, sign_off = int_view(x)
    ity = bits.dtype.type
    mb = 23 if x.dtype == np.float32 else 52
    narrow = hist.shape[0] <= (2 << max(mb - int(shift), 0))     # the window spans at most 2 octaves
    if narrow and hist.shape[0] > 1 and (int(key0) + 1) << int(shift) > 0:
        hist_band(bits, lo, hi, sign_off, ity(shift), ity(key0), hist, np.empty(_CHUNK, np.int32))
    else:
        hist_range(bits, lo, hi, sign_off, ity(shift), ity(key0), hist)


# ---------------------------------------------------------------------------- the measuring pass
@njit(cache=True, nogil=True)
def _add_max(r, g, acc, bits, sign_off):
    # acc = r + g (streamed past the cache), and the largest |acc| bit pattern (>= the exponent
    # mask: a non-finite value), taken from the sums in registers
    return stream_add_max(r, g, acc, bits, sign_off)


_GROUP = 64  # elements per max-test group of the measuring pass's owned range


@njit(cache=True, nogil=True)
def accumulate_measure(residual, grad, acc, bits, lo, hi, sign_off, shift, key0, hist, stride, shift_f, key0_f,
                       hist_f, low_f, scratch, marks, vals):
    """The measuring pass: ``acc = residual + grad`` everywhere, and over the owned range ``[lo, hi)``
    the histograms of ``|acc|`` (the bucket rule above): ``hist``
    counts every ``stride``-th element (global index), ``hist_f`` every element (bucket 0: all below
    its first edge, bit pattern ``low_f``; an empty ``hist_f``: none). Returns the largest
    ``|acc|`` bit pattern outside the owned range and among its marked elements (with ``low_f``
    at most the exponent mask, every non-finite value is marked: non-finite values exist iff it
    reaches the exponent mask) and the number of elements at or above ``low_f``, whose indices go to
    ``marks`` in ascending order when it is not empty (capacity ``hi - lo``: the select and the
    zooms that follow read only those).

    ``acc`` is written with nontemporal stores (``cpu_stream``: no read of the old ``acc``). Over the
    owned range, where a chunk of ``acc`` starts on 64 bytes, the compare runs on the sums in
    registers (``_chunk_fused``); elsewhere on an L1 copy of the chunk (``_chunk_copied``), where per
    chunk the add vectorises; then per group of 64 elements a vectorised compare builds a
    64-bit mask whose set bits are the marks (on error-feedback streams the fine window holds 6-24x
    k values, so most groups hold one: a rescan of those groups cost more than the add); the marks
    touch the fine histogram; the coarse one reads one element in ``stride``.
    """
    # measure_part(..., 0, 1, hi - lo, ...) computes the same, but measured 4 % slower (serial, 10M)
    mx = _add_max(residual[:lo], grad[:lo], acc[:lo], bits[:lo], sign_off)
    m2 = _add_max(residual[hi:], grad[hi:], acc[hi:], bits[hi:], sign_off)
    mx = m2 if m2 > mx else mx
    m3, n_f = _measure_range(residual, grad, acc, bits, lo, hi, sign_off, shift, key0, hist, stride, shift_f,
                             key0_f, hist_f, low_f, scratch, marks, vals)
    return (m3 if m3 > mx else mx), n_f


@njit(cache=True, nogil=True, inline="always")
def _take_marks(w, at, out, c):
    """The set bits of the 64-bit group mask ``w`` as ``at + bit`` into ``out[c:]``; the new ``c``.
    A group holds about one mark: the first two without a branch (``trailing_zeros(0)`` is 64,
    written but not counted: two spare words); a loop over the set bits mispredicted once a group
    and cost more than the add."""
    one = uint64(1)
    zero = uint64(0)
    out[c] = at + trailing_zeros(w)
    c += w != zero
    w &= w - one
    out[c] = at + trailing_zeros(w)
    c += w != zero
    w &= w - one
    while w:
        out[c] = at + trailing_zeros(w)
        c += 1
        w &= w - one
    return c


@njit(cache=True, nogil=True)
def _chunk_fused(residual, grad, acc, bits, s0, m, sign_off, low_f, gmask, out, base, mv, stride, samples):
    """One chunk of the owned range where acc's chunk starts on 64 bytes: one vector loop adds,
    streams acc past the cache and compares the sums in registers, a 64-bit word per group of 64
    (``cpu_stream.add_mask_groups``); the few sums read again (the marks', into ``mv``; the coarse
    sample's, into ``samples``) are recomputed from residual and grad, still in cache. Returns
    (marks, samples)."""
    full = m - m % _GROUP
    add_mask_groups(residual, grad, acc, gmask, s0, full // _GROUP, sign_off, low_f)
    for i in range(full, m):   # the tail: plain stores, read back below
        acc[s0 + i] = residual[s0 + i] + grad[s0 + i]
    c = 0
    for gi in range(full // _GROUP):
        c = _take_marks(gmask[gi], base + gi * _GROUP, out, c)
    for i in range(full, m):
        if (bits[s0 + i] & sign_off) >= low_f:    # on the bits: NaN goes to the top, as on CUDA
            out[c] = base + i
            c += 1
    for q in range(c):
        i = out[q] - base + s0
        mv[q] = residual[i] + grad[i]
    ns = 0
    for i in range((stride - s0 % stride) % stride, m, stride):
        samples[ns] = residual[s0 + i] + grad[s0 + i]
        ns += 1
    return c, ns


@njit(cache=True, nogil=True)
def _chunk_copied(residual, grad, acc, s0, m, sign_off, low_f, chunk, bs, out, base, mv):
    """One chunk of the owned range elsewhere: acc streamed past the cache and the chunk's sums
    copied to ``chunk`` (L1, ``bs`` its integer view), a 64-bit mask per group from those (the
    select form vectorises), the marks' values into ``mv``. Returns the marks."""
    stream_add_copy(residual[s0:s0 + m], grad[s0:s0 + m], acc[s0:s0 + m], chunk)
    one = uint64(1)
    zero = uint64(0)
    c = 0
    full = m - m % _GROUP
    for g0 in range(0, full, _GROUP):
        bg = bs[g0:g0 + _GROUP]
        w = zero
        for i in range(_GROUP):
            w |= (one << uint64(i)) if (bg[i] & sign_off) >= low_f else zero
        c = _take_marks(w, base + g0, out, c)
    for i in range(full, m):
        if (bs[i] & sign_off) >= low_f:
            out[c] = base + i
            c += 1
    for q in range(c):
        mv[q] = chunk[out[q] - base]
    return c


@njit(cache=True, nogil=True)
def _measure_range(residual, grad, acc, bits, lo, hi, sign_off, shift, key0, hist, stride, shift_f, key0_f,
                   hist_f, low_f, scratch, marks, vals):
    # the owned-range part of ``accumulate_measure`` over [lo, hi): marks go to marks[0:], their
    # values to vals[0:]
    if scratch.shape[0] < _CHUNK + 2:   # the mark extraction writes up to two words past a chunk
        scratch = np.empty(_CHUNK + 2, np.int64)
    mx = 0
    top_f = hist_f.shape[0] - 1
    keep = marks.shape[0] > 0
    n_f = 0
    chunk = np.empty(_CHUNK, acc.dtype)       # the copy path's sums; the fused path's coarse sample
    chunk_bits = chunk.view(bits.dtype)
    mv = np.empty(_CHUNK, acc.dtype)          # this chunk's marks' values
    mv_bits = mv.view(bits.dtype)
    gmask = np.empty(_CHUNK // _GROUP, np.uint64)
    for s0 in range(lo, hi, _CHUNK):
        e0 = min(s0 + _CHUNK, hi)
        m = e0 - s0
        if top_f < 0:   # no fine window: no marks; the largest pattern over the whole chunk
            stream_add_copy(residual[s0:e0], grad[s0:e0], acc[s0:e0], chunk)
            for i in range(m):
                b = chunk_bits[i] & sign_off
                mx = b if b > mx else mx
            _hist_every(chunk_bits[:m], (stride - s0 % stride) % stride, m, stride, sign_off, shift, key0, hist)
            continue
        # the marks go straight to ``marks`` (global indices) while it has room for the whole
        # chunk (a copy from the scratch cost 0.3 ms per 5M elements), else to the scratch (chunk
        # offsets) and are copied. The two spare writes of a group stay inside that room: they
        # land at c and c + 1 with c <= (groups before this one) * 64 <= m - 64. (A run's slice of
        # ``marks`` on threads must not be written past its end.)
        direct = keep and marks.shape[0] - n_f >= m
        out = marks[n_f:] if direct else scratch
        base = s0 if direct else 0
        if m >= _GROUP and group_aligned(residual, grad, acc, s0):
            c, ns = _chunk_fused(residual, grad, acc, bits, s0, m, sign_off, low_f, gmask, out, base, mv, stride,
                                 chunk)
            _hist_every(chunk_bits, 0, ns, 1, sign_off, shift, key0, hist)
        else:
            c = _chunk_copied(residual, grad, acc, s0, m, sign_off, low_f, chunk, chunk_bits, out, base, mv)
            _hist_every(chunk_bits[:m], (stride - s0 % stride) % stride, m, stride, sign_off, shift, key0, hist)
        for q in range(c):
            b = mv_bits[q] & sign_off
            mx = b if b > mx else mx
            j = (b >> shift_f) - key0_f
            hist_f[j if j < top_f else top_f] += 1
        if keep:
            # the select and the zooms that follow read these, not acc, which the streaming stores
            # left out of the cache (78k marks read from acc took 0.43-0.47 ms per 5M elements,
            # about 10 % of a step at P=2)
            for q in range(c):
                vals[n_f + q] = mv[q]
            if not direct:
                for q in range(c):
                    marks[n_f + q] = s0 + scratch[q]
        n_f += c
    store_fence()
    if top_f >= 0:
        hist_f[0] += (hi - lo) - n_f
    return mx, n_f


@njit(cache=True, nogil=True)
def measure_part(residual, grad, acc, bits, lo, hi, t, nparts, per, sign_off, shift, key0, hist, stride, shift_f,
                 key0_f, hist_f, low_f, marks, vals):
    """Part ``t`` of ``nparts`` of ``accumulate_measure`` (``nogil``: parts run on threads at once): the
    run ``[lo + t per, lo + (t + 1) per)`` of the owned range (``per``: whole chunks) into its own
    ``hist``/``hist_f``, its marks into ``marks`` (that run's slice of the marks buffer, or empty),
    and piece ``t`` of the rest of the vector. Returns (largest bit pattern, marks)."""
    n = acc.shape[0]
    oa, ob = (t * lo) // nparts, ((t + 1) * lo) // nparts
    m1 = _add_max(residual[oa:ob], grad[oa:ob], acc[oa:ob], bits[oa:ob], sign_off)
    ua, ub = hi + (t * (n - hi)) // nparts, hi + ((t + 1) * (n - hi)) // nparts
    m2 = _add_max(residual[ua:ub], grad[ua:ub], acc[ua:ub], bits[ua:ub], sign_off)
    a, b = min(lo + t * per, hi), min(lo + (t + 1) * per, hi)
    scratch = np.empty(_CHUNK + 2, np.int64)   # (two spare words: see _measure_range)
    m3, nf = _measure_range(residual, grad, acc, bits, a, b, sign_off, shift, key0, hist, stride, shift_f, key0_f,
                            hist_f, low_f, scratch, marks, vals)
    m = m1 if m1 > m2 else m2
    return (m3 if m3 > m else m), nf


@njit(cache=True, nogil=True)
def select_marks(vals, marks, thr, idx):
    """``idx[:count] = marks[|vals| >= thr]`` in order (``vals``: ``x[marks]``, kept by the pass;
    ``idx`` may be ``marks`` itself)."""
    c = 0
    for q in range(marks.shape[0]):
        i = marks[q]
        if abs(vals[q]) >= thr:
            idx[c] = i
            c += 1
    return c


@njit(cache=True, nogil=True)
def hist_marks(vbits, sign_off, shift, key0, hist):
    """``hist += histogram(|x[marks]|)`` (``vbits``: the marks' values ``x[marks]`` viewed as integers)."""
    top = hist.shape[0] - 1
    for q in range(vbits.shape[0]):
        j = ((vbits[q] & sign_off) >> shift) - key0
        hist[0 if j < 0 else (j if j < top else top)] += 1


@njit(cache=True, nogil=True)
def count_nonfinite(x):
    bad = 0
    for i in range(x.shape[0]):
        if x[i] - x[i] != 0:
            bad += 1
    return bad


#: the threaded pass only from this many elements per thread (below, dispatch costs more)
PARALLEL_MIN = 1 << 18
_POOL: dict[int, ThreadPoolExecutor] = {}   # threads -> a ThreadPoolExecutor (made on first use)


def accumulate_measure_threads(residual, grad, acc, bits, lo, hi, sign_off, shift, key0, hist, stride, shift_f,
                               key0_f, hist_f, low_f, marks, vals, nparts):
    """``accumulate_measure`` on ``nparts`` threads, the same bits: Python threads running the
    ``nogil`` kernel ``measure_part`` (not Numba's parallel layer, which would share, and resize, the
    OpenMP pool of a torch in the same process). The owned range is cut into runs of whole chunks
    (the serial pass's chunks); each part fills its own histograms and writes its marks into its
    run's slice of ``marks``; after, the histograms are summed and the marks moved together, in order."""
    pool = _POOL.get(nparts)
    if pool is None:
        pool = _POOL[nparts] = ThreadPoolExecutor(max_workers=nparts, thread_name_prefix="exdyna-pass")
    per = (((hi - lo + _CHUNK - 1) // _CHUNK + nparts - 1) // nparts) * _CHUNK
    hs = np.zeros((nparts, hist.shape[0]), np.int64)
    hfs = np.zeros((nparts, hist_f.shape[0]), np.int64)
    keep = marks.shape[0] > 0
    starts = [min(t * per, hi - lo) for t in range(nparts + 1)]
    futs = [pool.submit(measure_part, residual, grad, acc, bits, lo, hi, t, nparts, per, sign_off, shift, key0, hs[t],
                        stride, shift_f, key0_f, hfs[t], low_f, marks[starts[t]:starts[t + 1]] if keep else marks,
                        vals[starts[t]:starts[t + 1]] if keep else vals)
            for t in range(nparts)]
    got = [f.result() for f in futs]
    hist += hs.sum(axis=0)
    hist_f += hfs.sum(axis=0)
    pos = 0
    for t, (_, nf) in enumerate(got):
        if keep and t:   # each run's marks start at its own offset, never before pos
            marks[pos:pos + nf] = marks[starts[t]:starts[t] + nf]
            vals[pos:pos + nf] = vals[starts[t]:starts[t] + nf]
        pos += int(nf)
    return max(int(m) for m, _ in got), pos


def host_accumulate_measure(residual, grad, acc, lo, hi, coarse, fine, stride, marks=None, threads=1, vals=None):
    """HostOps wrapper: fills the host histograms ``coarse = (shift, key0, hist)`` and ``fine`` (or
    None); returns ``(nonfinite, n_marks)``: the number of non-finite values of ``acc`` and of
    elements of ``[lo, hi)`` at or above the fine window's bucket-1 edge, whose indices go to
    ``marks[:n_marks]`` when given (capacity ``hi - lo``), and their values to ``vals[:n_marks]``
    (acc's dtype, the same capacity; required with ``marks``). ``threads`` > 1: the pass on up to
    that many threads (the same bits)."""
    bits, sign_off = int_view(acc)
    ity = bits.dtype.type
    shift, key0, hist = coarse
    if fine is not None:
        shift_f, key0_f, hist_f = fine
        low_f = ity((int(key0_f) + 1) << int(shift_f))
    else:
        shift_f, key0_f, hist_f, low_f = 0, 0, np.zeros(0, np.int64), sign_off
    if marks is None or fine is None:
        marks, vals = np.empty(0, np.int64), np.empty(0, acc.dtype)
    elif vals is None or vals.dtype != acc.dtype or vals.shape[0] < marks.shape[0]:
        raise ValueError("host_accumulate_measure: marks need vals of acc's dtype and at least their length")
    nparts = min(int(threads), acc.shape[0] // PARALLEL_MIN)
    if nparts > 1:
        mx, n_f = accumulate_measure_threads(residual, grad, acc, bits, lo, hi, sign_off, ity(shift), ity(key0),
                                             hist, int(stride), ity(shift_f), ity(key0_f), hist_f, low_f, marks,
                                             vals, nparts)
    else:
        scratch = np.empty(_CHUNK + 2, np.int64)   # (two spare words: see _measure_range)
        mx, n_f = accumulate_measure(residual, grad, acc, bits, lo, hi, sign_off, ity(shift), ity(key0), hist,
                                     int(stride), ity(shift_f), ity(key0_f), hist_f, low_f, scratch, marks, vals)
    exp_mask = 0x7F800000 if acc.dtype == np.float32 else 0x7FF0000000000000
    # (a window whose first edge lies above the finite range does not mark inf: count them all)
    return (int(count_nonfinite(acc)) if int(mx) >= exp_mask or int(low_f) > exp_mask else 0), int(n_f)
