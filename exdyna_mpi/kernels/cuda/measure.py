"""The measured controller's device work: the measuring pass and the zoom's histogram.

The measuring pass (``accumulate_measure_async``, ``_acc_measure*``): ``acc = residual + grad``
over the whole vector, the non-finite count, two histograms of ``|acc|`` over ``[lo, hi)`` (coarse
``nh`` buckets counting every ``stride``-th element, fine ``nf``, possibly 0) and a mark in the hit
mask on every element with ``|acc| >= mark``, which ``select_marked_async`` and the finish read
instead of the vector. A bucket is the key ``((bits(x) & SIGN_OFF) >> shift) - key0`` clamped to
the window (exdyna_mpi/kernels/cpu_controller.py gives the exact semantics, bit for bit). The zoom
(``hist_range``) histograms a range again with another window, from the marks where they cover it.

``bits(x)`` is the IEEE pattern of a value held in a register. On a GPU that is libdevice's bitcast
(``float_as_int`` / ``double_as_longlong``: a register move, no memory); the simulator has no
libdevice, so there it is NumPy's view of the same scalar. Both are the bit pattern itself, NaN
payloads included, so no float arithmetic can round it differently. Every other line of the kernels
is shared; the GPU bitcast is compiled to PTX in the tests.
"""
import math

import numpy as np
from numba import cuda

from .blocks import _block_total2, _mark
from .config import CONFIG, FULL_MASK, HIST_MAX, HIST_SPARE, SIMULATOR, check_variant
from .launch import _round32, chunk_size, device_view, grid_shape, launch_kernel
from .scatter_gather import _zero_words
from .scratch import new_scratch
from .select import scan_async

if SIMULATOR:
    @cuda.jit(device=True)
    def _bits32(x):
        return int(np.float32(x).view(np.int32))

    @cuda.jit(device=True)
    def _bits64(x):
        return int(np.float64(x).view(np.int64))
else:
    from numba.cuda import libdevice as _libdevice

    @cuda.jit(device=True)
    def _bits32(x):
        return _libdevice.float_as_int(x)

    @cuda.jit(device=True)
    def _bits64(x):
        return _libdevice.double_as_longlong(x)


@cuda.jit(device=True)
def _zero_shared_hist(sh, nw):
    k = cuda.threadIdx.x
    while k < nw:
        sh[k] = 0
        k += cuda.blockDim.x
    cuda.syncthreads()


@cuda.jit(device=True)
def _flush_hist(sh, nh, nf, low, low_f, hist):
    """Add this thread's bucket-0 counts to the block's, then the block's counts to ``hist``.

    Every thread of the block must call it (two barriers). Bucket 0 (everything below the window,
    most of the vector for the fine window) is counted in registers: one shared atomic per thread
    instead of one per element on a single hot address. The block's histogram is int32 (native
    shared-memory atomics; int64 ones are CAS spin loops on sm_90): a block visits fewer than 2**31
    elements of any vector up to 2**40 elements. ``hist`` (global) stays int64.
    """
    if low != 0:
        cuda.atomic.add(sh, 0, np.int32(low))
    if low_f != 0:
        cuda.atomic.add(sh, nh, np.int32(low_f))
    cuda.syncthreads()
    k = cuda.threadIdx.x
    while k < nh + nf:
        c = sh[k]
        if c != 0:
            cuda.atomic.add(hist, k, np.int64(c))
        k += cuda.blockDim.x


@cuda.jit(device=True)
def _bucket(key, key0, top):
    j = key - key0
    if j < 0:
        j = 0
    elif j > top:
        j = top
    return j


def _make_hist_range(bits, sign_off):
    """The zoom's two histogram kernels for one float width (``bits`` its bitcast, ``sign_off`` its
    mask)."""

    @cuda.jit(device=True)
    def _put(x, sh, shift, key0, nh, low):
        """Count ``x`` in the block's histogram; returns the updated bucket-0 register count."""
        j = _bucket((bits(x) & sign_off) >> shift, key0, nh - 1)
        if j == 0:
            low += 1
        else:
            cuda.atomic.add(sh, j, np.int32(1))
        return low

    @cuda.jit
    def hist_range(x, lo, hi, shift, key0, nh, hist):
        """``hist[:nh] +=`` the histogram of ``|x[lo:hi]|`` (zeroed before); x only read."""
        sh = cuda.shared.array(HIST_MAX, np.int32)
        _zero_shared_hist(sh, nh)
        low = 0
        i = lo + cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < hi:
            low = _put(x[i], sh, shift, key0, nh, low)
            i += stride
        _flush_hist(sh, nh, 0, low, 0, hist)

    @cuda.jit
    def hist_marked(x, lo, hi, mask, shift, key0, nh, hist):
        """``hist_range`` over the marked elements of [lo, hi) only (the mask is read, not changed):
        the same counts in buckets 1.. when every element at or above bucket 1's edge is marked;
        bucket 0 is then the range's length minus the rest (the caller's sum)."""
        sh = cuda.shared.array(HIST_MAX, np.int32)
        _zero_shared_hist(sh, nh)
        low = 0
        q = cuda.grid(1)
        w1 = (hi - lo + 31) >> 5
        while q < w1:
            rest = np.int64(mask[q])
            at = lo + (q << 5)
            while rest != 0:
                lowbit = rest & -rest
                low = _put(x[at + cuda.popc(lowbit - 1)], sh, shift, key0, nh, low)
                rest ^= lowbit
            q += cuda.gridsize(1)
        _flush_hist(sh, nh, 0, low, 0, hist)

    return hist_range, hist_marked


_hist_range32, _hist_marked32 = _make_hist_range(_bits32, 0x7FFFFFFF)
_hist_range64, _hist_marked64 = _make_hist_range(_bits64, 0x7FFFFFFFFFFFFFFF)


def _make_measure(bits, sign_off, warp):
    """The measuring pass for one float width; ``warp``: marks by warp ballot (real GPUs)."""

    @cuda.jit(device=True)
    def _measure(v, ok, i, lo, mark, mask, sh, win_c, win_f, counts):
        """One element of the measuring pass: non-finite, the mark, the fine bucket (every element)
        and the coarse one; returns the updated ``counts = (cnt, bad, low, low_f)``. A window,
        coarse ``win_c`` or fine ``win_f``, is ``(shift, key0, lo_*, at_*, top_*)``, set once per
        thread (one tuple each: Numba passes a tuple as its scalars, so this costs nothing). Below
        a window's bucket 1 (``b < lo_*``, nearly every element) it is a register count: no shared
        atomic, no clamp; ``_bucket`` gives the same bucket (``b >= (key0 + 1) << shift`` is ``key -
        key0 >= 1`` for the non-negative ``b``). A window this thread does not fill (no fine window;
        a coarse one it does not sample) has ``lo_*`` at the top of the int64 range, buckets
        ``at_*`` in a spare shared word and a register count dropped at the end: no test per
        element. ``ok``: ``i`` lies in the chunk (a lane past its end still takes part in the
        warp's ballot, and counts nothing). ``warp``: marks by ballot (a GPU: the 32 lanes of a warp
        are the consecutive elements of one mask word, and the kernel's loops keep them together);
        else one atomic or per mark (the simulator, which has no warp intrinsics)."""
        shift, key0, lo_c, at_c, top_c = win_c
        shift_f, key0_f, lo_f, at_f, top_f = win_f
        cnt, bad, low, low_f = counts
        hit = ok and abs(v) >= mark
        if warp:   # the 32 lanes of a warp hold the elements of one mask word: one ballot, one store
            # All 32 lanes reach every ballot (the loops' conditions are the warp's, not the lane's),
            # so lane 0 holds the whole word and owns it: a plain store, no atomic. A ballot over
            # whatever lanes happen to be active would not do: a split warp's upper lanes would
            # store without lane 0, or overwrite its word.
            word = cuda.ballot_sync(FULL_MASK, hit)
            if word != 0 and cuda.laneid == 0:
                mask[(i - lo) >> 5] = word
        elif hit:
            _mark(mask, i, lo)
        if not ok:
            return cnt, bad, low, low_f
        if v - v != 0:  # inf and NaN give NaN; the CPU kernel uses the same test
            bad += 1
        if hit:
            cnt += 1
        b = bits(v) & sign_off
        if b >= lo_f:
            j = (b >> shift_f) - key0_f
            cuda.atomic.add(sh, at_f + (j if j < top_f else top_f), np.int32(1))
        else:
            low_f += 1
        if b >= lo_c:
            j = (b >> shift) - key0
            cuda.atomic.add(sh, at_c + (j if j < top_c else top_c), np.int32(1))
        else:
            low += 1
        return cnt, bad, low, low_f

    @cuda.jit
    def acc_measure(r, g, acc, lo, hi, mark, cs, block_counts, block_bad, mask, shift, key0, nh, shift_f, key0_f,
                    nf, hist, cstride):
        """The pass: ``acc = r + g`` over the whole vector; per block, the marks ``|acc| >= mark``
        in its chunk of [lo, hi) (counted as hits), the non-finite count, and ``hist[:nh + nf] +=``
        the chunk's two histograms (zeroed before). The coarse sample is one test per thread
        (``cstride``, a power of two, divides ``blockDim``: a thread's elements keep their index mod
        ``cstride``), four elements in flight per thread (their eight loads issued before any use),
        and a bucket below bucket 1 costs a compare and a register add. Every count is an integer
        sum, so how the elements are spread over threads and blocks changes no bit."""
        sh = cuda.shared.array(HIST_SPARE, np.int32)   # 2 spare words: see _measure
        _zero_shared_hist(sh, nh + nf)
        t = cuda.threadIdx.x
        b = cuda.blockIdx.x
        bd = cuda.blockDim.x
        n = acc.shape[0]
        e = min(lo + (b + 1) * cs, hi)
        i = lo + b * cs + t
        never = np.int64(0x7FFFFFFFFFFFFFFF)
        fine = nf > 0
        coarse = (i & (cstride - 1)) == 0
        lo_f = ((np.int64(key0_f) + 1) << shift_f) if fine else never
        at_f = nh if fine else HIST_MAX
        top_f = nf - 1 if fine else 0
        lo_c = ((np.int64(key0) + 1) << shift) if coarse else never
        at_c = 0 if coarse else HIST_MAX + 1
        top_c = nh - 1 if coarse else 0
        win_c = (shift, key0, lo_c, at_c, top_c)
        win_f = (shift_f, key0_f, lo_f, at_f, top_f)
        cnt = 0
        bad = 0
        low = 0
        low_f = 0
        # The loops test the warp's first or last element (``w0`` = this lane's index minus its lane),
        # not the lane's own, so a warp never splits between them: the ballot needs all 32 lanes.
        # A chunk starts on a mask word and ``bd`` is a multiple of 32 (a GPU's launch), so
        # ``w0`` is the warp's first element; under the simulator (any ``bd``) the tests only
        # widen or narrow which loop takes an element, never drop or repeat one.
        w0 = i - (t & 31)
        # indices are cast to uint64 where they index: a signed index costs a wrap-around of negative
        # values (shift, and, add) on every access
        while w0 + 31 + 3 * bd < e:
            i1 = i + bd
            i2 = i1 + bd
            i3 = i2 + bd
            u0, u1, u2, u3 = np.uint64(i), np.uint64(i1), np.uint64(i2), np.uint64(i3)
            v0 = r[u0] + g[u0]
            v1 = r[u1] + g[u1]
            v2 = r[u2] + g[u2]
            v3 = r[u3] + g[u3]
            acc[u0] = v0
            acc[u1] = v1
            acc[u2] = v2
            acc[u3] = v3
            cnt, bad, low, low_f = _measure(v0, True, i, lo, mark, mask, sh, win_c, win_f, (cnt, bad, low, low_f))
            cnt, bad, low, low_f = _measure(v1, True, i1, lo, mark, mask, sh, win_c, win_f, (cnt, bad, low, low_f))
            cnt, bad, low, low_f = _measure(v2, True, i2, lo, mark, mask, sh, win_c, win_f, (cnt, bad, low, low_f))
            cnt, bad, low, low_f = _measure(v3, True, i3, lo, mark, mask, sh, win_c, win_f, (cnt, bad, low, low_f))
            i += 4 * bd
            w0 += 4 * bd
        while w0 < e:   # the chunk's last words; the lanes past its end only take part in the ballot
            ok = i < e
            u0 = np.uint64(i if ok else w0)   # past the end: a load the warp makes anyway, not kept
            v0 = r[u0] + g[u0]
            if ok:
                acc[u0] = v0
            cnt, bad, low, low_f = _measure(v0, ok, i, lo, mark, mask, sh, win_c, win_f, (cnt, bad, low, low_f))
            i += bd
            w0 += bd
        if not fine:
            low_f = 0
        if not coarse:
            low = 0
        # the rest of the vector, [0, lo) then [hi, n): acc and the non-finite count only
        m = hi - lo
        stride = cuda.gridDim.x * bd
        j = b * bd + t
        while j + stride < n - m:
            j1 = j + stride
            k0 = np.uint64(j if j < lo else j + m)
            k1 = np.uint64(j1 if j1 < lo else j1 + m)
            v0 = r[k0] + g[k0]
            v1 = r[k1] + g[k1]
            acc[k0] = v0
            acc[k1] = v1
            if v0 - v0 != 0:
                bad += 1
            if v1 - v1 != 0:
                bad += 1
            j += 2 * stride
        if j < n - m:
            k0 = np.uint64(j if j < lo else j + m)
            v0 = r[k0] + g[k0]
            acc[k0] = v0
            if v0 - v0 != 0:
                bad += 1
        _flush_hist(sh, nh, nf, low, low_f, hist)
        _block_total2(cnt, bad, block_counts, block_bad)

    return acc_measure


_acc_measure32 = _make_measure(_bits32, 0x7FFFFFFF, False)
_acc_measure64 = _make_measure(_bits64, 0x7FFFFFFFFFFFFFFF, False)
_acc_measure32_warp = _make_measure(_bits32, 0x7FFFFFFF, True)
_acc_measure64_warp = _make_measure(_bits64, 0x7FFFFFFFFFFFFFFF, True)


# ---------------------------------------------------------------------------- launchers
def measure_kernel(dtype, variant=None):
    """The measuring pass's kernel for ``dtype``: marks by warp ballot with the ``fast`` variant (a
    GPU), by atomic or with ``safe`` (the simulator; a GPU fallback). For ``launch_kernel`` where a
    benchmark times the pass alone; ``accumulate_measure_async`` launches it for the library.

    Args:
        dtype: float32 or float64 (anything ``np.dtype`` takes).
        variant: ``"safe"``, ``"fast"`` or None for ``CONFIG.variant``.

    Returns:
        The ``@cuda.jit`` kernel; its arguments are those ``accumulate_measure_async`` passes.

    Raises:
        TypeError: another dtype.
        RuntimeError: ``"fast"`` under the simulator.
    """
    warp = check_variant(variant) == "fast"
    if np.dtype(dtype) == np.float32:
        return _acc_measure32_warp if warp else _acc_measure32
    if np.dtype(dtype) == np.float64:
        return _acc_measure64_warp if warp else _acc_measure64
    raise TypeError(f"histograms need float32 or float64, not {dtype}")


def _hist_range_kernel(dtype, marked=False):
    if np.dtype(dtype) == np.float32:
        return _hist_marked32 if marked else _hist_range32
    if np.dtype(dtype) == np.float64:
        return _hist_marked64 if marked else _hist_range64
    raise TypeError(f"histograms need float32 or float64, not {dtype}")


def _hist_words(scratch, nw):
    if nw > HIST_MAX:
        raise ValueError(f"{nw} histogram buckets: at most HIST_MAX = {HIST_MAX}")
    if scratch.hist.shape[0] < nw:
        raise ValueError("scratch has no histogram region (allocate Scratch.size() words)")
    return scratch.hist


def _measure_pass(residual, grad, acc, lo, hi, mark, shift, key0, nh, scratch, stream, fine, stride, variant):
    """Zero the histogram words and launch ``_acc_measure*``; returns the number of blocks.

    The kernel tests the coarse sample once per thread, which needs ``stride`` (a power of two, as
    the controller makes it) to divide the block: a larger one (the simulator's 32-thread blocks,
    strides up to 64) widens the block to it."""
    if stride < 1 or stride & (stride - 1):
        raise ValueError(f"the coarse stride must be a power of two, not {stride}")
    m = hi - lo
    shift_f, key0_f, nf = fine
    hw = _hist_words(scratch, nh + nf)
    block = CONFIG.block
    nb, bd = grid_shape(acc.shape[0], block * stride // math.gcd(block, stride))
    cs = chunk_size(m, nb, bd)
    mask = scratch.mask_for(m)
    launch_kernel(_zero_words, 1, max(1, min(block, _round32(nh + nf))), stream, hw, nh + nf)
    launch_kernel(measure_kernel(acc.dtype, variant), nb, bd, stream, residual, grad, acc, lo, hi, mark, cs,
                  scratch.block_counts, scratch.block_bad, mask, int(shift), int(key0), int(nh), int(shift_f),
                  int(key0_f), int(nf), hw, int(stride))
    return nb


def accumulate_measure_async(residual, grad, acc, lo, hi, mark, shift, key0, nh, scratch, stream=0,
                             fine=(0, 0, 0), stride=1, variant=None):
    """The measuring pass: ``acc = residual + grad``, the histograms of ``|acc|`` over [lo, hi)
    (window ``(shift, key0)`` of ``nh`` buckets, sampling every ``stride``-th element, and ``fine =
    (shift_f, key0_f, nf)``, ``nf`` possibly 0) and, instead of a selection, a mark in the hit mask
    on every element with ``|acc| >= mark`` (``mark`` NaN: none), kept for ``select_marked_async``.
    ``scratch.totals_hist`` holds ``[marked, nonfinite, coarse[0:nh], fine[0:nf], ...]`` (int64,
    this call's counts only) when it completes. Three launches: zero the words, the pass, the scan
    (for the totals); the histograms cost no extra pass over memory (see docs/gpu.md)."""
    nb = _measure_pass(residual, grad, acc, lo, hi, mark, shift, key0, nh, scratch, stream, fine, stride, variant)
    scan_async(scratch, nb, stream)
    if mark == mark and hi > lo:
        scratch.marked = (lo, hi, mark, stream)


def _marks_cover(scratch, x, lo, hi, shift, key0):
    """True when the measuring pass's marks over [lo, hi) hold every element at or above bucket 1's
    edge of the window ``(shift, key0)``: the edge's bits are at or above the mark's."""
    marked = scratch.marked
    if marked is None or marked[:2] != (lo, hi):
        return False
    ity = np.int32 if np.dtype(x.dtype) == np.float32 else np.int64
    mark_bits = int(np.array([abs(marked[2])], x.dtype).view(ity)[0])
    return (int(key0) + 1) << int(shift) >= mark_bits


def hist_range_async(x, lo, hi, shift, key0, nh, scratch, stream=0):
    """Launch ``hist_range``; ``scratch.hist[:nh]`` holds the counts when it completes. Returns True
    when it read only the measuring pass's marks (``_marks_cover``): bucket 0 then holds only the
    marked elements below bucket 1, and the caller sets it to ``hi - lo`` minus the other buckets."""
    marks = _marks_cover(scratch, x, lo, hi, shift, key0)
    khist = _hist_range_kernel(x.dtype, marks)
    hw = _hist_words(scratch, nh)
    launch_kernel(_zero_words, 1, max(1, min(CONFIG.block, _round32(nh))), stream, hw, nh)
    if marks:  # a zoom inside the fine window: O(range / 32 + marks) instead of O(range)
        nw = (hi - lo + 31) // 32
        nb, bd = grid_shape(max(nw * 4, 1))
        launch_kernel(khist, nb, bd, stream, x, int(lo), int(hi), scratch.mask_for(hi - lo, keep_marks=True),
                      int(shift), int(key0), int(nh), hw)
        return True
    nb, bd = grid_shape(max(hi - lo, 1))
    launch_kernel(khist, nb, bd, stream, x, int(lo), int(hi), int(shift), int(key0), int(nh), hw)
    return False


def read_totals_hist(scratch, nw, stream=0):
    """``[count, nonfinite, hist words[:nw]]`` as one host int64 array (one device->host copy)."""
    w = scratch.totals_hist[: 2 + nw]
    if isinstance(w, np.ndarray):
        return w.astype(np.int64, copy=True)
    host = device_view(w).copy_to_host(stream=stream)
    if stream:
        stream.synchronize()
    return host.astype(np.int64, copy=False)


def hist_range(x, lo, hi, shift, key0, hist, scratch=None, stream=0):
    """Like ``kernels.cpu_controller.host_hist_range``: ``hist`` (host int64) ``+=`` the histogram."""
    scratch = scratch or new_scratch()
    nh = hist.shape[0]
    marks = hist_range_async(x, lo, hi, shift, key0, nh, scratch, stream)
    w = read_totals_hist(scratch, nh, stream)[2:2 + nh]
    if marks:
        w[0] = (hi - lo) - w[1:].sum()
    hist += w
