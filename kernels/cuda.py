"""CUDA kernels: Numba ``@cuda.jit`` on CUDA device buffers, bit-identical to ``kernels.cpu``.

Same semantics as the CPU kernels: ``acc = residual + grad`` (``residual`` and ``grad`` only read),
``|acc| >= thr`` selected inside ``[lo, hi)``, indices written in ascending order, non-finite values
counted over the whole vector with the same ``x - x != 0`` test, ``out[i] = sums[j] / p`` in out's
dtype. No fastmath anywhere, so every compare, add and divide is IEEE round-to-nearest as on the CPU.

The ordered selection is three launches (count, scan, compact: the stream-compaction pattern of Billeter et al. 2009):

1. ``_acc_count``: the fused accumulate. Block ``b`` owns the contiguous chunk
   ``[lo + b*cs, lo + (b+1)*cs) ∩ [lo, hi)`` of the selection range (threads stride through it in
   steps of ``blockDim``, so loads are coalesced) and a grid-stride share of the rest of the vector.
   It writes its selected count and its non-finite count per block.
2. ``_scan``: one block turns the block counts into block offsets and writes ``totals = [count,
   nonfinite]``, the only thing the host ever reads.
3. ``_compact``: each block walks its chunk again in tiles of ``blockDim * ipt`` elements; thread
   ``t`` counts the hits among its ``ipt`` consecutive elements, a block-wide exclusive scan of those
   counts (``tile_scan``) gives its write position after ``offsets[b]``, and it writes them in order.

Two variants of ``tile_scan``, chosen at import (``VARIANT``, env ``EXDYNA_CUDA_KERNELS=safe|fast``):

- ``"fast"`` (real GPUs): ``shfl_up_sync`` scan inside each warp, warp totals through shared memory.
- ``"safe"`` (the Numba CUDA simulator, which has no warp intrinsics, and any GPU as a fallback):
  shared memory and two ``syncthreads`` only. Every other line of the kernels is shared, so CI under
  the simulator tests the exact ordering logic the GPU runs; the fast scan is compiled to PTX in CI
  (tests/cudasim/ptx_check.py) but only runs on a GPU.

The histogram controller's pass (``accumulate_select_hist``, ``hist_range``: the launchers of
kernels/cpu_controller.py, bit-identical) swaps step 1 for ``_acc_count_hist{32,64}``, which also
builds the two histograms in shared memory from the values it visits; see the section
"histogram kernels" below.

Launchers (``accumulate_select``, ``select_range``, ``count_range``, ``gather``, ``scatter``,
``zero_at``, ``scatter_mean_zero``, ``accumulate_select_hist``, ``hist_range``) take arrays the
kernels accept (Numba device arrays, any object with ``__cuda_array_interface__`` such as CuPy
arrays, or NumPy arrays under the simulator), a ``stream`` and, for the selection, a ``Scratch`` of
small int64 buffers so nothing is allocated per step. The ``*_async`` forms leave the counts in
``scratch.totals`` (and histograms in ``scratch.hist``) on the device; the plain forms copy those
words to the host and return them, like ``kernels.cpu`` / ``kernels.cpu_controller``.
"""
import ctypes
import math
import os
import threading
import warnings

import numpy as np
from numba import cuda
from numba.core.errors import NumbaPerformanceWarning

try:  # numba-cuda (the NVIDIA package) keeps its config here; numba's built-in target elsewhere
    from numba.cuda.core import config as _config
except ImportError:  # pragma: no cover - numba's deprecated built-in CUDA target
    from numba.core import config as _config

#: True when the Numba CUDA simulator runs these kernels (NUMBA_ENABLE_CUDASIM=1 before import).
SIMULATOR = bool(_config.ENABLE_CUDASIM)

# Seen on an H100 node whose numba-cuda's import hook had not run: numba's deprecated built-in target
# fails on these kernels with "Signature mismatch" deep in type inference. Say what to install instead.
if getattr(cuda, "implementation", "NVIDIA") == "Built-in" and not SIMULATOR:
    raise ImportError("exdyna_mpi's CUDA kernels need NVIDIA's numba-cuda package, and numba.cuda is numba's "
                      "deprecated built-in target here: pip install 'numba-cuda[cu12]' (or [cu13]); if it is "
                      "installed, its .pth redirect did not run (a site dir added without site.addsitedir?)")

NB_MAX = 1024          # most blocks a selection uses; the scan runs one block of up to NB_MAX threads
HIST_MAX = 1024        # most buckets (coarse + fine) a histogram pass fills: one shared int64 array per block
HIST_SPARE = HIST_MAX + 2   # the measuring pass's shared words: the buckets and 2 spare words
WARPS_MAX = 32         # blockDim <= 1024
FULL_MASK = 0xFFFFFFFF

# Launch shapes. The simulator runs one OS thread per CUDA thread and each syncthreads is a Python
# barrier, so it gets tiny grids; the loops in every kernel cover any length with any grid.
# IPT: 32-element mask words per compaction thread per tile (a compile-time constant on a GPU).
if SIMULATOR:
    BLOCK, GRID_MAX, SCAN_THREADS, ITEMS, IPT = 32, 2, 8, 1, 2
else:
    BLOCK, GRID_MAX, SCAN_THREADS, ITEMS, IPT = 256, NB_MAX, NB_MAX, 8, 4


def _pick_variant():
    want = os.environ.get("EXDYNA_CUDA_KERNELS", "auto").strip().lower()
    if SIMULATOR:
        return "safe"  # ballot_sync does not exist in the simulator
    return want if want in ("safe", "fast") else "fast"


VARIANT = _pick_variant()


# ---------------------------------------------------------------------------- tile scans
# ``_tile_scan_*(c)``: c is this thread's count; returns (sum of c over the block's lower threads,
# sum over the block). Every thread of the block must call it: it holds two barriers.
@cuda.jit(device=True)
def _tile_scan_shared(c):
    """Shared memory only (no warp intrinsics): each thread reads the block's counts."""
    sh = cuda.shared.array(1024, np.int64)
    t = cuda.threadIdx.x
    sh[t] = c
    cuda.syncthreads()
    pre = 0
    tot = 0
    for q in range(cuda.blockDim.x):
        v = sh[q]
        if q < t:
            pre += v
        tot += v
    cuda.syncthreads()  # sh is rewritten by the next call
    return pre, tot


@cuda.jit(device=True)
def _tile_scan_warp(c):
    """Warp shuffles inside each warp, warp totals through shared memory (blockDim % 32 == 0)."""
    wt = cuda.shared.array(32, np.int64)
    t = cuda.threadIdx.x
    lane = t % 32
    w = t // 32
    v = c
    d = 1
    while d < 32:
        y = cuda.shfl_up_sync(FULL_MASK, v, d)
        if lane >= d:
            v += y
        d *= 2
    if lane == 31:
        wt[w] = v
    cuda.syncthreads()
    pre = v - c
    tot = 0
    for q in range(cuda.blockDim.x // 32):
        x = wt[q]
        if q < w:
            pre += x
        tot += x
    cuda.syncthreads()  # wt is rewritten by the next call
    return pre, tot


# ---------------------------------------------------------------------------- block helpers
@cuda.jit(device=True)
def _block_total2(a, b, out_a, out_b):
    """Sum ``a`` and ``b`` over the block; thread 0 stores them at ``out_*[blockIdx.x]``.

    int32 shared counters (native atomics; int64 ones are CAS loops on sm_90): a block visits
    fewer than 2**31 elements (1024 blocks up to 2**40 elements)."""
    sh = cuda.shared.array(2, np.int32)
    t = cuda.threadIdx.x
    if t == 0:
        sh[0] = 0
        sh[1] = 0
    cuda.syncthreads()
    if a != 0:
        cuda.atomic.add(sh, 0, np.int32(a))
    if b != 0:
        cuda.atomic.add(sh, 1, np.int32(b))
    cuda.syncthreads()
    if t == 0:
        out_a[cuda.blockIdx.x] = np.int64(sh[0])
        out_b[cuda.blockIdx.x] = np.int64(sh[1])


# ---------------------------------------------------------------------------- kernels
@cuda.jit(device=True)
def _mark(mask, i, lo):
    """Set the bit of element ``i`` in the hit mask (word ``(i - lo) // 32``, bit ``(i - lo) % 32``).

    Hits are rare (a density of 1e-3..1e-2 of the range), so one global atomic per hit costs less
    than building every word (a ballot per 32 elements, absent in the simulator); the compaction
    reads these words instead of re-reading ``x`` (1/32 of the bytes) and zeroes the ones it used.
    """
    d = i - lo
    cuda.atomic.or_(mask, d >> 5, np.uint32(1) << np.uint32(d & 31))


@cuda.jit
def _acc_count(r, g, acc, lo, hi, thr, cs, block_counts, block_bad, mask):
    """acc = r + g over the whole vector; per block: hits in its chunk of [lo, hi) (and their bits
    in ``mask``), non-finite acc."""
    t = cuda.threadIdx.x
    b = cuda.blockIdx.x
    bd = cuda.blockDim.x
    n = acc.shape[0]
    cnt = 0
    bad = 0
    e = min(lo + (b + 1) * cs, hi)
    i = lo + b * cs + t
    while i < e:
        v = r[i] + g[i]
        acc[i] = v
        if v - v != 0:  # inf and NaN give NaN; the CPU kernel uses the same test
            bad += 1
        if abs(v) >= thr:
            cnt += 1
            _mark(mask, i, lo)
        i += bd
    # The rest of the vector, [0, lo) then [hi, n), as one grid-stride range of n - m elements.
    m = hi - lo
    stride = cuda.gridDim.x * bd
    j = b * bd + t
    while j < n - m:
        i = j if j < lo else j + m
        v = r[i] + g[i]
        acc[i] = v
        if v - v != 0:
            bad += 1
        j += stride
    _block_total2(cnt, bad, block_counts, block_bad)


@cuda.jit
def _count(x, lo, hi, thr, cs, block_counts, block_bad, mask, marks):
    """Per block: hits ``|x| >= thr`` in its chunk of [lo, hi) (block_bad gets 0); their bits in
    ``mask`` when ``marks`` (``count_range`` needs only the count)."""
    t = cuda.threadIdx.x
    b = cuda.blockIdx.x
    bd = cuda.blockDim.x
    cnt = 0
    e = min(lo + (b + 1) * cs, hi)
    i = lo + b * cs + t
    while i < e:
        if abs(x[i]) >= thr:
            cnt += 1
            if marks:
                _mark(mask, i, lo)
        i += bd
    _block_total2(cnt, 0, block_counts, block_bad)


@cuda.jit(device=True)
def _filter(x, lo, hi, thr, cs, block_counts, block_bad, mask):
    t = cuda.threadIdx.x
    b = cuda.blockIdx.x
    s = b * cs
    e = min(s + cs, hi - lo)
    q = (s >> 5) + t
    w1 = (e + 31) >> 5 if e > s else s >> 5
    cnt = 0
    while q < w1:
        word = mask[q]
        if word != 0:
            keep = np.uint32(0)
            rest = np.int64(word)
            at = lo + (q << 5)
            while rest != 0:
                low = rest & -rest
                bit = cuda.popc(low - 1)
                if abs(x[at + bit]) >= thr:
                    keep |= np.uint32(1) << np.uint32(bit)
                rest ^= low
            mask[q] = keep
            cnt += cuda.popc(keep)
        q += cuda.blockDim.x
    _block_total2(cnt, 0, block_counts, block_bad)


@cuda.jit
def _filter_marks(x, lo, hi, thr, cs, block_counts, block_bad, mask):
    """Keep the marked elements of this block's chunk of [lo, hi) with ``|x| >= thr``, clear the
    others' bits, count the kept ones per block: the select of ``select_marked``, which reads the
    mask (1/32 of the bytes of ``x``) and ``x`` only where a bit is set."""
    _filter(x, lo, hi, thr, cs, block_counts, block_bad, mask)


@cuda.jit
def _filter_marks_at(x, lo, hi, thr_at, ctl, cs, block_counts, block_bad, mask, out):
    """``_filter_marks`` at the threshold ``_resolve_fine`` left on the device (``thr_at[0]``), then
    ``out[:] = 0``, when it settled one (``ctl[0]``); else nothing: the marks stay for the host's
    own select, and a refused step leaves the caller's buffer (possibly its gradient) as it was.
    One kernel, one launch fewer. The hope was that the bandwidth-bound zeroing would hide the
    filter's dependent loads (a mask word, then ``x`` at its bits); measured on an H100 at 100M
    elements it does not: 63 + 135 us as two kernels, 183 us as one."""
    if ctl[0] == 0:
        return
    _filter(x, lo, hi, thr_at[0], cs, block_counts, block_bad, mask)
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    n = out.shape[0]
    while i < n:
        out[i] = 0
        i += stride


@cuda.jit
def _resolve_fine(hist, nf, k, shift_f, key0_f, cap, tol, totals, ctl, thr_bits):
    """The measured controller's threshold from the fine window, on the device (one block, any
    size): ``MeasuredController.fine_pick`` to the bit. ``hist``: the pass's fine words (nf of them,
    bucket 0 below the window, nf - 1 at or above its top edge); ``totals[1]``: the pass's
    non-finite count. ``j``: the highest edge 1..nf-1 with at least ``k`` elements at or above it;
    inside the window (0 < j < nf - 1) the edge j or j + 1 nearer to k in ratio (``a * b <= k * k``,
    exact integers) settles it when its count misses k by at most ``tol``. Writes ``ctl = [settled,
    count]`` and the edge's bits (``(key0_f + j) << shift_f``, at least 1 << shift_f, at most
    ``cap``) into ``thr_bits[0]``, the int view of the threshold the next kernels read."""
    above = cuda.shared.array(HIST_MAX, np.int64)
    part = cuda.shared.array(1024, np.int64)
    nj = cuda.shared.array(1, np.int32)
    t = cuda.threadIdx.x
    bd = cuda.blockDim.x
    seg = (nf + bd - 1) // bd
    s = min(t * seg, nf)
    e = min(s + seg, nf)
    c = 0
    for q in range(s, e):
        c += hist[q]
    part[t] = c
    if t == 0:
        nj[0] = 0
    cuda.syncthreads()
    run = 0   # the words of the threads above this one: the count at or above edge e
    for q in range(t + 1, bd):
        run += part[q]
    q = e - 1
    while q >= s:
        run += hist[q]
        above[q] = run
        q -= 1
    cuda.syncthreads()
    n_ok = 0
    for q in range(max(s, 1), e):
        if above[q] >= k:
            n_ok += 1
    if n_ok != 0:
        cuda.atomic.add(nj, 0, np.int32(n_ok))
    cuda.syncthreads()
    if t == 0:
        j = np.int64(nj[0])   # above[] does not grow with j: edges 1..j hold k or more
        go = 0
        cnt = np.int64(0)
        if totals[1] == 0 and 0 < j and j < nf - 1:
            a = above[j]
            b2 = above[j + 1]
            if b2 == 0 or a * b2 <= k * k:
                cnt = a
            else:
                cnt = b2
                j += 1
            if abs(np.float64(cnt) / np.float64(k) - 1.0) <= tol:
                go = 1
                key = max(np.int64(key0_f) + j, np.int64(1))
                thr_bits[0] = min(key << shift_f, cap)
        ctl[0] = go
        ctl[1] = cnt


@cuda.jit
def _scan(block_counts, block_bad, nb, offsets, totals):
    """One block: exclusive scan of block_counts[:nb] into offsets; totals = [sum counts, sum bad]."""
    sh = cuda.shared.array(1024, np.int64)
    shb = cuda.shared.array(1, np.int64)
    t = cuda.threadIdx.x
    bd = cuda.blockDim.x
    seg = (nb + bd - 1) // bd
    s = t * seg
    e = min(s + seg, nb)
    c = 0
    bad = 0
    for k in range(s, e):
        c += block_counts[k]
        bad += block_bad[k]
    sh[t] = c
    if t == 0:
        shb[0] = 0
    cuda.syncthreads()
    if bad != 0:
        cuda.atomic.add(shb, 0, bad)
    cuda.syncthreads()
    d = 1
    while d < bd:  # Hillis-Steele inclusive scan of the per-thread sums
        v = sh[t - d] if t >= d else 0
        cuda.syncthreads()
        sh[t] = sh[t] + v
        cuda.syncthreads()
        d *= 2
    run = sh[t] - c
    for k in range(s, e):
        offsets[k] = run
        run += block_counts[k]
    if t == bd - 1:
        totals[0] = sh[t]
        totals[1] = shb[0]


def _make_compact(tile_scan, guarded=False):
    @cuda.jit(device=True)
    def _body(mask, lo, hi, cs, offsets, idx):
        """Write the hits of this block's chunk, ascending, at idx[offsets[b]:], from the hit mask.

        The chunk ``[lo + b*cs, ...)`` starts on a mask word (``cs`` is a multiple of 32). A tile is
        ``blockDim * IPT`` words; thread t takes the IPT consecutive words at t * IPT, counts their
        bits (``popc``), gets its rank in the tile from ``tile_scan`` (one block scan per
        ``32 * IPT * blockDim`` elements) and writes its hits lowest bit first; it zeroes every
        non-zero word it read, so the mask is all zero again for the next selection.
        """
        t = cuda.threadIdx.x
        b = cuda.blockIdx.x
        s = b * cs                      # offsets from lo
        e = min(s + cs, hi - lo)
        w0 = s >> 5
        w1 = (e + 31) >> 5 if e > s else w0
        tile = cuda.blockDim.x * IPT
        base = offsets[b]
        k = w0
        while k < w1:  # the same trip count on every thread of the block: tile_scan has barriers
            q0 = k + t * IPT
            c = 0
            for u in range(IPT):
                q = q0 + u
                if q < w1:
                    c += cuda.popc(mask[q])
            pre, tot = tile_scan(c)
            pos = base + pre
            if c > 0:
                for u in range(IPT):
                    q = q0 + u
                    if q < w1:
                        word = np.int64(mask[q])
                        if word != 0:
                            mask[q] = 0
                            at = lo + (q << 5)
                            while word != 0:
                                low = word & -word
                                idx[pos] = at + cuda.popc(low - 1)
                                pos += 1
                                word ^= low
            base += tot
            k += tile

    if guarded:
        @cuda.jit
        def _compact_at(mask, lo, hi, cs, offsets, idx, ctl):
            """``_compact`` when ``ctl[0]`` (``_resolve_fine`` settled), else nothing: the marks stay."""
            if ctl[0] == 0:
                return
            _body(mask, lo, hi, cs, offsets, idx)

        return _compact_at

    @cuda.jit
    def _compact(mask, lo, hi, cs, offsets, idx):
        _body(mask, lo, hi, cs, offsets, idx)

    return _compact


_compact_safe = _make_compact(_tile_scan_shared)
_compact_fast = _make_compact(_tile_scan_warp)
_compact_safe_at = _make_compact(_tile_scan_shared, guarded=True)
_compact_fast_at = _make_compact(_tile_scan_warp, guarded=True)


# ---------------------------------------------------------------------------- histogram kernels
# The histogram controller's pass (kernels/cpu_controller.py gives the exact semantics): the fused
# accumulate above, plus two histograms (coarse ``nh`` buckets, fine ``nf``, possibly 0) of the
# bucket key ``((bits(x) & SIGN_OFF) >> shift) - key0`` clamped to the window, over ``[flo, fhi)``.
# ``x`` is ``acc`` or, with ``predict``, the forecast ``p = (selected ? 0 : acc) + grad[nb]``
# (nb = i + 1, the vector's last element i - 1, a 1-element vector itself); only ``[lo, hi)``
# selects, so elsewhere ``p = acc + grad[nb]``.
#
# ``bits(x)`` is the IEEE pattern of a value held in a register (p is never stored). On a GPU that is
# libdevice's bitcast (``float_as_int`` / ``double_as_longlong``: a register move, no memory); the
# simulator has no libdevice, so there it is NumPy's view of the same scalar. Both are the bit
# pattern itself, NaN payloads included, so no float arithmetic can round it differently. Every
# other line of the kernels is shared; the GPU bitcast is compiled to PTX in the tests.
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


def _make_hist_kernels(bits, sign_off):
    """The two histogram kernels for one float width (``bits`` its bitcast, ``sign_off`` its mask)."""

    @cuda.jit(device=True)
    def _put(x, sh, shift, key0, nh, shift_f, key0_f, nf, low, low_f, coarse):
        """Count ``x`` in the block's histograms (the coarse one only if ``coarse``: its sample);
        returns the updated bucket-0 register counts."""
        b = bits(x) & sign_off
        if coarse:
            j = _bucket(b >> shift, key0, nh - 1)
            if j == 0:
                low += 1
            else:
                cuda.atomic.add(sh, j, np.int32(1))
        if nf > 0:
            j = _bucket(b >> shift_f, key0_f, nf - 1)
            if j == 0:
                low_f += 1
            else:
                cuda.atomic.add(sh, nh + j, np.int32(1))
        return low, low_f

    @cuda.jit(device=True)
    def _forecast(v, sel, i, g, n, predict):
        """The value histogrammed for element i: acc, or the forecast p (cpu_controller's rule)."""
        if not predict:
            return v
        if i + 1 < n:
            nbv = g[i + 1]
        elif i > 0:
            nbv = g[i - 1]
        else:
            nbv = g[i]
        if sel:
            return nbv
        return v + nbv

    @cuda.jit(device=True)
    def _visit(v, i, selecting, lo, thr, mask, f0, f1, g, n, predict, sh, shift, key0, nh, shift_f, key0_f, nf,
               rem, cnt, bad, low, low_f):
        """One element of the pass, after ``acc[i] = v``: non-finite, selection (and its mark) when
        ``selecting``, the histograms where i is in [f0, f1) (the coarse one when ``rem == 0``)."""
        if v - v != 0:  # inf and NaN give NaN; the CPU kernel uses the same test
            bad += 1
        sel = selecting and abs(v) >= thr
        if sel:
            cnt += 1
            _mark(mask, i, lo)
        if f0 <= i and i < f1:  # p needs sel, known only here
            low, low_f = _put(_forecast(v, sel, i, g, n, predict), sh, shift, key0, nh, shift_f, key0_f, nf,
                              low, low_f, rem == 0)
        return cnt, bad, low, low_f

    @cuda.jit(device=True)
    def _span(i, z, step_i, selecting, r, g, acc, n, lo, thr, mask, f0, f1, predict, sh, shift, key0, nh, shift_f,
              key0_f, nf, cstride, cnt, bad, low, low_f):
        """``acc = r + g`` for i, i + step_i, ... below z, each element ``_visit``ed.

        ``rem`` counts ``i % cstride`` down without a division per element. Two elements per trip,
        both loads issued before either is used: one element in flight per thread left the pass at
        half the copy bandwidth on an H100 (occupancy is register-bound)."""
        rem = i % cstride
        step = step_i % cstride
        while i + step_i < z:
            i2 = i + step_i
            v = r[i] + g[i]
            v2 = r[i2] + g[i2]
            acc[i] = v
            acc[i2] = v2
            cnt, bad, low, low_f = _visit(v, i, selecting, lo, thr, mask, f0, f1, g, n, predict, sh, shift, key0, nh,
                                          shift_f, key0_f, nf, rem, cnt, bad, low, low_f)
            rem += step
            if rem >= cstride:
                rem -= cstride
            cnt, bad, low, low_f = _visit(v2, i2, selecting, lo, thr, mask, f0, f1, g, n, predict, sh, shift, key0,
                                          nh, shift_f, key0_f, nf, rem, cnt, bad, low, low_f)
            rem += step
            if rem >= cstride:
                rem -= cstride
            i += 2 * step_i
        if i < z:
            v = r[i] + g[i]
            acc[i] = v
            cnt, bad, low, low_f = _visit(v, i, selecting, lo, thr, mask, f0, f1, g, n, predict, sh, shift, key0, nh,
                                          shift_f, key0_f, nf, rem, cnt, bad, low, low_f)
        return cnt, bad, low, low_f

    @cuda.jit
    def acc_count_hist(r, g, acc, lo, hi, thr, cs, block_counts, block_bad, mask, flo, fhi, predict, shift, key0,
                       nh, shift_f, key0_f, nf, hist, cstride):
        """``_acc_count`` plus ``hist[:nh + nf] +=`` the histograms over [flo, fhi) (zeroed before).

        The block's chunk of the selection range first (threads step by blockDim: coalesced), then
        the rest of the vector as two plain grid-stride ranges, [0, lo) and [hi, n), selecting
        nothing (every count is an integer sum, so how elements are spread over threads changes no
        bit). The coarse sample is ``i % cstride == 0``."""
        sh = cuda.shared.array(HIST_MAX, np.int32)
        _zero_shared_hist(sh, nh + nf)
        t = cuda.threadIdx.x
        b = cuda.blockIdx.x
        bd = cuda.blockDim.x
        n = acc.shape[0]
        e = min(lo + (b + 1) * cs, hi)
        # the forecast window inside this chunk: [f0, f1)
        f0 = max(flo, lo + b * cs)
        f1 = min(fhi, e)
        cnt, bad, low, low_f = _span(lo + b * cs + t, e, bd, True, r, g, acc, n, lo, thr, mask, f0, f1, predict, sh,
                                     shift, key0, nh, shift_f, key0_f, nf, cstride, 0, 0, 0, 0)
        stride = cuda.gridDim.x * bd
        first = b * bd + t
        _, bad, low, low_f = _span(first, lo, stride, False, r, g, acc, n, lo, thr, mask, flo, fhi, predict, sh,
                                   shift, key0, nh, shift_f, key0_f, nf, cstride, 0, bad, low, low_f)
        _, bad, low, low_f = _span(hi + first, n, stride, False, r, g, acc, n, lo, thr, mask, flo, fhi, predict, sh,
                                   shift, key0, nh, shift_f, key0_f, nf, cstride, 0, bad, low, low_f)
        _flush_hist(sh, nh, nf, low, low_f, hist)
        _block_total2(cnt, bad, block_counts, block_bad)

    @cuda.jit
    def hist_range(x, lo, hi, shift, key0, nh, hist):
        """``hist[:nh] +=`` the histogram of ``|x[lo:hi]|`` (zeroed before); x only read."""
        sh = cuda.shared.array(HIST_MAX, np.int32)
        _zero_shared_hist(sh, nh)
        low = 0
        low_f = 0
        i = lo + cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < hi:
            low, low_f = _put(x[i], sh, shift, key0, nh, 0, 0, 0, low, low_f, True)
            i += stride
        _flush_hist(sh, nh, 0, low, low_f, hist)

    @cuda.jit
    def hist_marked(x, lo, hi, mask, shift, key0, nh, hist):
        """``hist_range`` over the marked elements of [lo, hi) only (the mask is read, not changed):
        the same counts in buckets 1.. when every element at or above bucket 1's edge is marked;
        bucket 0 is then the range's length minus the rest (the caller's sum)."""
        sh = cuda.shared.array(HIST_MAX, np.int32)
        _zero_shared_hist(sh, nh)
        low = 0
        low_f = 0
        q = cuda.grid(1)
        w1 = (hi - lo + 31) >> 5
        while q < w1:
            rest = np.int64(mask[q])
            at = lo + (q << 5)
            while rest != 0:
                lowbit = rest & -rest
                low, low_f = _put(x[at + cuda.popc(lowbit - 1)], sh, shift, key0, nh, 0, 0, 0, low, low_f, True)
                rest ^= lowbit
            q += cuda.gridsize(1)
        _flush_hist(sh, nh, 0, low, low_f, hist)

    return acc_count_hist, hist_range, hist_marked


_acc_count_hist32, _hist_range32, _hist_marked32 = _make_hist_kernels(_bits32, 0x7FFFFFFF)
_acc_count_hist64, _hist_range64, _hist_marked64 = _make_hist_kernels(_bits64, 0x7FFFFFFFFFFFFFFF)

def _make_measure(bits, sign_off, warp):
    """The measuring pass for one float width; ``warp``: marks by warp ballot (real GPUs)."""

    @cuda.jit(device=True)
    def _measure(v, i, lo, mark, mask, sh, shift, key0, lo_c, at_c, top_c, shift_f, key0_f, lo_f, at_f, top_f,
                 cnt, bad, low, low_f):
        """One element of the measuring pass: non-finite, the mark, the fine bucket (every element)
        and the coarse one. Below a window's bucket 1 (``b < lo_*``, nearly every element) it is a
        register count: no shared atomic, no clamp; ``_bucket`` gives the same bucket (``b >= (key0
        + 1) << shift`` is ``key - key0 >= 1`` for the non-negative ``b``). A window this thread
        does not fill (no fine window; a coarse one it does not sample) has ``lo_*`` at the top of
        the int64 range, buckets ``at_*`` in a spare shared word and a register count dropped at
        the end: no test per element. ``warp``: marks by ballot (a GPU; lanes of a warp are
        consecutive elements, a mask word, and active as a prefix of the warp); else one atomic or
        per mark (the simulator, which has no warp intrinsics)."""
        if v - v != 0:  # inf and NaN give NaN; the CPU kernel uses the same test
            bad += 1
        hit = abs(v) >= mark
        if warp:   # the 32 lanes of a warp hold the 32 elements of one mask word: one store, no atomics
            word = cuda.ballot_sync(cuda.activemask(), hit)
            if word != 0 and cuda.laneid == 0:
                mask[(i - lo) >> 5] = word
        elif hit:
            _mark(mask, i, lo)
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
        """``acc_count_hist`` as the measured controller calls it (the histograms over [lo, hi), no
        forecast, marks ``|acc| >= mark`` as hits), specialised: the coarse sample is one test per
        thread (``cstride``, a power of two, divides ``blockDim``: a thread's elements keep their
        index mod ``cstride``), four elements in flight per thread (their eight loads issued before
        any use), and a bucket below bucket 1 costs a compare and a register add. Same words, same
        bits as ``acc_count_hist`` (every count is an integer sum)."""
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
        cnt = 0
        bad = 0
        low = 0
        low_f = 0
        # indices are cast to uint64 where they index: a signed index costs a wrap-around of negative
        # values (shift, and, add) on every access
        while i + 3 * bd < e:
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
            cnt, bad, low, low_f = _measure(v0, i, lo, mark, mask, sh, shift, key0, lo_c, at_c, top_c, shift_f, key0_f,
                                            lo_f, at_f, top_f, cnt, bad, low, low_f)
            cnt, bad, low, low_f = _measure(v1, i1, lo, mark, mask, sh, shift, key0, lo_c, at_c, top_c, shift_f,
                                            key0_f, lo_f, at_f, top_f, cnt, bad, low, low_f)
            cnt, bad, low, low_f = _measure(v2, i2, lo, mark, mask, sh, shift, key0, lo_c, at_c, top_c, shift_f,
                                            key0_f, lo_f, at_f, top_f, cnt, bad, low, low_f)
            cnt, bad, low, low_f = _measure(v3, i3, lo, mark, mask, sh, shift, key0, lo_c, at_c, top_c, shift_f,
                                            key0_f, lo_f, at_f, top_f, cnt, bad, low, low_f)
            i += 4 * bd
        while i < e:
            u0 = np.uint64(i)
            v0 = r[u0] + g[u0]
            acc[u0] = v0
            cnt, bad, low, low_f = _measure(v0, i, lo, mark, mask, sh, shift, key0, lo_c, at_c, top_c, shift_f, key0_f,
                                            lo_f, at_f, top_f, cnt, bad, low, low_f)
            i += bd
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


@cuda.jit
def _take_mean_zero_at(out, acc, idx, totals, p, ctl):
    """One rank's union is its own selection: ``out[i] = acc[i] / p`` and ``acc[i] = 0`` at its
    ``totals[0]`` indices (``gather`` then ``scatter_mean_zero``, to the bit), when ``ctl[0]``."""
    if ctl[0] == 0:
        return
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    n = totals[0]
    while j < n:
        i = idx[j]
        out[i] = acc[i] / p
        acc[i] = 0
        j += stride


# ---------------------------------------------------------------------------- launchers
class Scratch:
    """The small int64 buffers of one selection (block counts, block offsets, totals, histograms)
    and the hit mask (uint32, one bit per element of the selection range, all zero between calls).

    ``words`` is one int64 array of at least ``Scratch.size()`` elements, allocated by the caller
    (a CuPy array, a Numba device array, or NumPy under the simulator) and reused every step;
    ``zeros(n, dtype)`` allocates the mask (zeroed) the first time a range needs a larger one.
    One ``Scratch`` serves one stream of work at a time: the launchers leave results in it for the
    host to read (``CudaOps`` keeps one per device, stream and thread).
    """

    @staticmethod
    def size():
        return 3 * NB_MAX + 2 + HIST_MAX + 4

    def __init__(self, words, zeros=None):
        self.words = words
        self.block_counts = words[0:NB_MAX]
        self.block_bad = words[NB_MAX:2 * NB_MAX]
        self.offsets = words[2 * NB_MAX:3 * NB_MAX]
        self.totals = words[3 * NB_MAX:3 * NB_MAX + 2]
        # the histograms' device counts, right after totals: one copy reads [count, bad, hist...]
        self.hist = words[3 * NB_MAX + 2:3 * NB_MAX + 2 + HIST_MAX]
        self.totals_hist = words[3 * NB_MAX:3 * NB_MAX + 2 + HIST_MAX]
        # ``finish_fine_async``'s words: [settled, count] and the threshold's bits (its own word)
        at = 3 * NB_MAX + 2 + HIST_MAX
        self.ctl = words[at:at + 2]
        self.thr_word = words[at + 2:at + 3]
        self._zeros = zeros or _zeros
        self.mask = None
        self.marked = None  # (lo, hi, mark) while the mask holds a measuring pass's marks

    def mask_for(self, m, keep_marks=False):
        """The hit mask for a selection range of ``m`` elements (grown, never shrunk), all zero
        unless ``keep_marks`` (marks left by ``accumulate_measure_async`` that nobody consumed, a
        step that stopped after its measuring pass, are cleared here first)."""
        if self.marked is not None and not keep_marks:
            self.clear_marks()
        nw = max((m + 31) // 32, 1)
        if self.mask is None or self.mask.shape[0] < nw:
            grown = nw if self.mask is None else max(nw, 2 * self.mask.shape[0])
            self.mask = self._zeros(grown, np.uint32)
        return self.mask


    def clear_marks(self):
        """Zero the mask words the marks may use (queued on the stream of the pass that set them)."""
        lo, hi, _, stream = self.marked
        self.marked = None
        nw = (hi - lo + 31) // 32
        if nw:
            _go(_zero_words, *_shape(nw), stream, self.mask, nw)


def _zeros(n, dtype):
    if SIMULATOR:
        return np.zeros(n, dtype)
    return cuda.to_device(np.zeros(n, dtype))


def new_scratch():
    """A ``Scratch`` allocated with Numba (tests and one-off calls; ``CudaOps`` brings its own)."""
    return Scratch(_zeros(Scratch.size(), np.int64))


_views = {}


def _dev(a):
    """What to hand a kernel: CAI producers (CuPy) become Numba views without a stream sync.

    The caller launches on the producer's stream (CuPy's current stream), so ordering holds and
    Numba's default sync on the CAI ``stream`` key would only add a host round trip per launch.

    Views are kept by (pointer, shape, strides, dtype), without a reference to ``a``: building one
    costs tens of microseconds of host time (on an H100 the step was host-bound, with ~30 of them
    per step), and a view whose key matches the caller's live array describes exactly that memory.
    """
    if SIMULATOR or not hasattr(a, "__cuda_array_interface__"):
        return a
    if type(a).__module__.startswith("numba"):  # already a Numba device array
        return a
    cai = a.__cuda_array_interface__
    key = (cai["data"][0], cai["shape"], cai.get("strides"), cai["typestr"])
    got = _views.get(key)
    if got is None:
        if len(_views) > 1024:
            _views.clear()
        got = _views[key] = cuda.from_cuda_array_interface(cai, owner=None, sync=False)
    return got


_configs = {}


def _launch(kernel, nb, bd, stream):
    """``kernel[nb, bd, stream]``, made once and kept: numba-cuda warns on every launch
    configuration of fewer than 128 blocks (the scan, the zeroing of the histogram words, and
    gather/scatter of small selections are small on purpose), and building it costs host time."""
    if SIMULATOR:  # the simulator's kernel[...] reconfigures and returns the kernel itself: no caching
        return kernel[nb, bd, stream]
    key = (id(kernel), nb, bd, id(stream))
    got = _configs.get(key)
    if got is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NumbaPerformanceWarning)
            cfg = kernel[nb, bd, stream]
        if len(_configs) > 4096:
            _configs.clear()
        got = _configs[key] = (cfg, kernel, stream)  # the references keep the ids from being reused
    return got[0]


# ---------------------------------------------------------------------------- the launch path
# numba-cuda's ``kernel[cfg](*args)`` types every argument, wraps every array (``to_device``) and
# builds a launch config on every call: about 100 us of host time per launch on an H100 node, which
# made the step host-bound (docs/gpu.md). ``_go`` does that once per (kernel, shape, stream,
# argument kinds), then marshals the arguments exactly as numba's ``_Kernel._prepare_args`` does
# (an array is meminfo, parent, size, itemsize, data, shape, strides; a scalar a ctypes value of its
# Numba type) and calls ``cuda.core.launch`` itself. Anything it does not know takes Numba's path.
_FAST = os.environ.get("EXDYNA_CUDA_LAUNCH", "fast").strip().lower() != "numba"
_fast = {}
_CTYPES = {"int64": ctypes.c_int64, "int32": ctypes.c_int32, "uint32": ctypes.c_uint32,
           "uint64": ctypes.c_uint64, "float32": ctypes.c_float, "float64": ctypes.c_double}


def _kind(a):
    """What decides the compiled overload and the marshalling: a cheap key per argument."""
    t = type(a)
    if t is int or t is bool or t is float:
        return t
    dt = getattr(a, "dtype", None)
    return (t, dt.char if dt is not None else None)


class _FastLaunch:
    """One compiled overload, one launch shape, one stream: the arguments marshalled by hand."""

    def __init__(self, kernel, args, nb, bd, stream):
        from numba.cuda import types as nt

        argtypes = tuple(kernel.typeof_pyval(a) for a in args)
        kern = kernel.overloads[argtypes]
        self.fn = kern._codelibrary.get_cufunc().kernel
        self.plan = []
        for ty in kern.argument_types:
            if isinstance(ty, nt.Array) and ty.ndim == 1:
                self.plan.append(ty.layout)   # "C": the code assumes unit stride
            elif isinstance(ty, nt.Integer) or ty in (nt.float32, nt.float64):
                self.plan.append(_CTYPES[str(ty)])
            elif ty == nt.boolean:
                self.plan.append(bool)
            else:
                raise NotImplementedError(f"fast launch: argument type {ty}")
        self.stream = stream
        self.driver = None
        if _DRIVER:
            try:
                self.driver = _DriverLaunch(self.fn, self.plan, stream)
            except Exception as e:  # pragma: no cover - a driver or cuda.core without these entry points
                warnings.warn(f"exdyna_mpi: no raw driver launch ({e!r}); cuda.core's launch for {kernel.__name__}",
                              RuntimeWarning)
        if self.driver is None:
            from cuda.core import LaunchConfig, launch
            try:
                from numba.cuda._compat import CUDA_CORE_GE_1_0
            except ImportError:  # pragma: no cover - older numba-cuda
                CUDA_CORE_GE_1_0 = True
            coop = "is_cooperative" if CUDA_CORE_GE_1_0 else "cooperative_launch"
            self.config = LaunchConfig(grid=nb, block=bd, shmem_size=0, **{coop: False})
            self.shape = (nb, bd)
            self.launch = launch

    def __call__(self, args, nb, bd):
        """Launch; False (nothing launched) for a strided array where the overload wants unit stride.
        ``nb``, ``bd``: the driver path takes any shape; cuda.core's keeps the one it was made with."""
        if self.driver is not None:
            return self.driver(args, nb, bd)
        if (nb, bd) != self.shape:
            return False
        ka = []
        for how, v in zip(self.plan, args):
            if how.__class__ is str:
                ptr, n, stride, item = _array_fields(v)
                if stride != item and how == "C" and n > 1:
                    return False
                ka += (0, 0, n, item, ptr, n, stride)
            elif how is bool:
                ka.append(bool(v))
            else:
                ka.append(how(v))
        self.launch(self.stream, self.config, self.fn, *ka)
        return True


# ``cuLaunchKernel`` called through ctypes with a parameter block built once per launch shape: only
# the values change between calls. cuda.core's ``launch`` converts every argument on every call:
# 13-17 us (2 arguments) and 37-38 us (the 21-argument pass) of host time per launch on the H100 node
# against 9-12 and 20-25 us this way (bench_gpu.py's launch_costs; 8-11 launches per step).
# EXDYNA_CUDA_LAUNCH=core keeps cuda.core's launch, =numba Numba's own path.
_DRIVER = os.environ.get("EXDYNA_CUDA_LAUNCH", "fast").strip().lower() == "fast"
_cu = None


def _driver():
    """libcuda's ``cuLaunchKernel`` and ``cuKernelGetFunction`` with their C signatures."""
    global _cu
    if _cu is None:
        lib = ctypes.CDLL("libcuda.so.1")
        launch = lib.cuLaunchKernel
        launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        launch.restype = ctypes.c_int
        get = lib.cuKernelGetFunction
        get.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        get.restype = ctypes.c_int
        _cu = (launch, get)
    return _cu


def _handle(h):
    h = getattr(h, "handle", h)
    v = getattr(h, "value", None)   # a ctypes handle
    return int(v if v is not None else h)


class _DriverLaunch:
    """The parameter block of one kernel (Numba's layout: an array is meminfo, parent, size,
    itemsize, data, shape, strides; a scalar its C type) and a raw ``cuLaunchKernel``."""

    def __init__(self, kernel, plan, stream):
        launch, get = _driver()
        func = ctypes.c_void_p()
        rc = get(ctypes.byref(func), _handle(kernel))   # cuda.core loads kernels as CUkernel (a library's)
        if rc != 0:
            raise RuntimeError(f"cuKernelGetFunction failed ({rc})")
        self.func, self.launch = func, launch
        self.stream = ctypes.c_void_p(int(stream.__cuda_stream__()[1]) if stream else 0)
        self.slots, self.plan = [], []
        for how in plan:
            if how.__class__ is str:
                vals = [ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_int64(), ctypes.c_int64(),
                        ctypes.c_void_p(), ctypes.c_int64(), ctypes.c_int64()]
                self.plan.append((how, vals[2], vals[3], vals[4], vals[5], vals[6]))
            else:
                vals = [ctypes.c_bool() if how is bool else how()]
                self.plan.append((how, vals[0]))
            self.slots += vals
        self.params = (ctypes.c_void_p * len(self.slots))(*[ctypes.addressof(v) for v in self.slots])

    def __call__(self, args, nb, bd):
        for p, v in zip(self.plan, args):
            if p[0].__class__ is str:
                ptr, n, stride, item = _array_fields(v)
                if stride != item and p[0] == "C" and n > 1:
                    return False
                p[1].value, p[2].value, p[3].value, p[4].value, p[5].value = n, item, ptr, n, stride
            else:
                p[1].value = v
        rc = self.launch(self.func, nb, 1, 1, bd, 1, 1, 0, self.stream, self.params, None)
        if rc != 0:
            raise RuntimeError(f"exdyna_mpi: cuLaunchKernel failed with CUDA error {rc}")
        return True


def _array_fields(a):
    """(device pointer, length, stride in bytes, itemsize) of a 1-D device array."""
    data = getattr(a, "data", None)
    ptr = getattr(data, "ptr", None)
    if ptr is not None:  # CuPy
        return ptr, a.shape[0], a.strides[0], a.itemsize
    cai = a.__cuda_array_interface__
    item = np.dtype(cai["typestr"]).itemsize
    strides = cai.get("strides")
    return cai["data"][0], cai["shape"][0], strides[0] if strides else item, item


def _go(kernel, nb, bd, stream, *args):
    """``kernel[nb, bd, stream](*args)``: arrays as the caller holds them (CuPy, Numba, or NumPy
    under the simulator). The first call of a kind goes through Numba (it compiles); later ones
    take ``_FastLaunch``."""
    fast = _FAST and bool(stream) and not SIMULATOR
    f = None
    if fast:
        # the raw driver launch takes the grid per call: one entry per kernel and argument kinds,
        # whatever the shape (a shape that follows the selection's size was a new entry, through
        # Numba's launch, on a third of the steps)
        key = (id(kernel), id(stream), threading.get_ident()) + (() if _DRIVER else (nb, bd)) + tuple(
            map(_kind, args))
        f = _fast.get(key)
        if f and f(args, nb, bd):
            return
    dev = [_dev(a) if hasattr(a, "shape") else a for a in args]
    _launch(kernel, nb, bd, stream)(*dev)
    if fast and f is None:   # the first launch of its kind compiled the overload: fast from the next one
        try:
            f = _FastLaunch(kernel, dev, nb, bd, stream)
        except Exception as e:  # pragma: no cover - a numba-cuda whose internals moved
            warnings.warn(f"exdyna_mpi: Numba's launch path for {kernel.__name__}: {e!r}", RuntimeWarning)
            f = False
        if len(_fast) > 4096:
            _fast.clear()
        _fast[key] = f


def _shape(n_work, block=None):
    """(blocks, threads) for ``n_work`` elements: enough blocks for ITEMS elements per thread."""
    bd = block or BLOCK
    nb = max(1, min(GRID_MAX, math.ceil(n_work / (bd * ITEMS))))
    return nb, bd


def _chunk(m, nb, bd):
    """Elements of the selection range per block: a multiple of the block size and of 32 (a block's
    chunk starts on a mask word)."""
    per = math.ceil(m / nb) if m > 0 else 0
    unit = bd * 32 // math.gcd(bd, 32)
    return math.ceil(per / unit) * unit


def _compact_kernel(variant, guarded=False):
    v = variant or VARIANT
    if v == "fast":
        if SIMULATOR:
            raise RuntimeError("the 'fast' CUDA kernels need warp intrinsics, absent in the simulator")
        return _compact_fast_at if guarded else _compact_fast
    return _compact_safe_at if guarded else _compact_safe


def _read_totals(scratch, stream):
    t = scratch.totals
    if isinstance(t, np.ndarray):
        return int(t[0]), int(t[1])
    host = _dev(t).copy_to_host(stream=stream)
    if stream:
        stream.synchronize()
    return int(host[0]), int(host[1])


def _scan_compact(scratch, nb, lo, hi, cs, mask, idx, stream, variant, guarded=False):
    _go(_scan, 1, min(SCAN_THREADS, _round32(nb)), stream, scratch.block_counts, scratch.block_bad, nb,
        scratch.offsets, scratch.totals)
    if hi > lo:
        k = _compact_kernel(variant, guarded)
        extra = (scratch.ctl,) if guarded else ()
        _go(k, nb, BLOCK, stream, mask, lo, hi, cs, scratch.offsets, idx, *extra)


def accumulate_select_async(residual, grad, acc, lo, hi, thr, idx, scratch, stream=0, variant=None):
    """Launch the fused select; ``scratch.totals`` holds ``[count, nonfinite]`` when it completes."""
    n = acc.shape[0]
    m = hi - lo
    nb, bd = _shape(n)
    cs = _chunk(m, nb, bd)
    mask = scratch.mask_for(m)
    _go(_acc_count, nb, bd, stream, residual, grad, acc, lo, hi, thr, cs, scratch.block_counts, scratch.block_bad,
        mask)
    _scan_compact(scratch, nb, lo, hi, cs, mask, idx, stream, variant)


def select_range_async(x, lo, hi, thr, idx, scratch, stream=0, variant=None):
    """Launch ``select_range``; ``scratch.totals[0]`` holds the count when it completes."""
    m = hi - lo
    nb, bd = _shape(m)
    cs = _chunk(m, nb, bd)
    mask = scratch.mask_for(m)
    _go(_count, nb, bd, stream, x, lo, hi, thr, cs, scratch.block_counts, scratch.block_bad, mask, True)
    _scan_compact(scratch, nb, lo, hi, cs, mask, idx, stream, variant)


def select_marked_async(x, lo, hi, thr, idx, scratch, stream=0, variant=None):
    """``select_range_async`` after ``accumulate_measure_async(..., mark)`` over the same ``[lo, hi)``
    with ``mark <= thr``: every hit is marked, so this reads the mask and ``x`` at the marks only.
    Anything else (no marks, another range, ``thr < mark``) is a plain ``select_range_async``: marks
    are then hits, and setting a set bit again changes nothing."""
    marked = scratch.marked
    if marked is None or marked[:2] != (lo, hi) or not thr >= marked[2]:
        if marked is not None and marked[:2] == (lo, hi) and thr < marked[2]:
            scratch.marked = None  # every marked element is a hit: the select sets those bits anyway
        return select_range_async(x, lo, hi, thr, idx, scratch, stream, variant)  # (else: cleared first)
    scratch.marked = None
    m = hi - lo
    nb, bd = _shape(m)
    cs = _chunk(m, nb, bd)
    mask = scratch.mask_for(m, keep_marks=True)
    _go(_filter_marks, nb, bd, stream, x, lo, hi, thr, cs, scratch.block_counts, scratch.block_bad, mask)
    _scan_compact(scratch, nb, lo, hi, cs, mask, idx, stream, variant)


def finish_fine_async(acc, lo, hi, idx, out, p, k, tol, nh, fine, scratch, stream=0, variant=None):
    """The rest of a one-rank step of the measured controller, queued right after its measuring pass
    (``accumulate_measure_async`` with marks over ``[lo, hi)``) so the device need not wait for the
    host: ``_resolve_fine`` settles the threshold from the fine window's words when it can (the
    host's ``MeasuredController.fine_pick``, to the bit), and only then do the next kernels run: the
    select of the marks, ``out[:] = 0`` and ``out[idx] = acc[idx] / p``, ``acc[idx] = 0``. When it
    cannot (a zoom is needed, or non-finite values) they return at once and leave ``acc``, ``out``
    and the marks as they were: the host goes its own way. ``fine = (shift_f, key0_f, nf)``;
    ``scratch.ctl`` holds ``[settled, count]`` when it completes."""
    shift_f, key0_f, nf = (int(v) for v in fine)
    item = np.dtype(acc.dtype)
    ity = np.int32 if item == np.float32 else np.int64
    cap = (((1 << (8 * item.itemsize - 1)) - 1) >> shift_f) << shift_f
    thr_bits = scratch.thr_word.view(ity)[:1]
    thr_at = scratch.thr_word.view(item)[:1]
    hw = scratch.hist[nh:nh + nf]
    _go(_resolve_fine, 1, min(SCAN_THREADS, _round32(nf)), stream, hw, nf, int(k), shift_f, key0_f, cap,
        float(tol), scratch.totals, scratch.ctl, thr_bits)
    m = hi - lo
    nb, bd = _shape(m)
    cs = _chunk(m, nb, bd)
    mask = scratch.mask_for(m, keep_marks=True)
    _go(_filter_marks_at, nb, bd, stream, acc, lo, hi, thr_at, scratch.ctl, cs, scratch.block_counts,
        scratch.block_bad, mask, out)
    _scan_compact(scratch, nb, lo, hi, cs, mask, idx, stream, variant, guarded=True)
    _go(_take_mean_zero_at, *_shape(max(int(k), 1)), stream, out, acc, idx, scratch.totals, p, scratch.ctl)


def count_range_async(x, lo, hi, thr, scratch, stream=0):
    """Launch ``count_range``; ``scratch.totals[0]`` holds the count when it completes."""
    m = hi - lo
    nb, bd = _shape(m)
    cs = _chunk(m, nb, bd)
    bc, bb = scratch.block_counts, scratch.block_bad
    _go(_count, nb, bd, stream, x, lo, hi, thr, cs, bc, bb, scratch.mask_for(1), False)
    _go(_scan, 1, min(SCAN_THREADS, _round32(nb)), stream, bc, bb, nb, scratch.offsets, scratch.totals)


def _round32(n):
    return n if SIMULATOR else max(32, math.ceil(n / 32) * 32)


def accumulate_select(residual, grad, acc, lo, hi, thr, idx, scratch=None, stream=0, variant=None):
    """Like ``kernels.cpu.accumulate_select``: returns ``(count, nonfinite)`` as host ints."""
    scratch = scratch or new_scratch()
    accumulate_select_async(residual, grad, acc, lo, hi, thr, idx, scratch, stream, variant)
    return _read_totals(scratch, stream)


def select_range(x, lo, hi, thr, idx, scratch=None, stream=0, variant=None):
    """Like ``kernels.cpu.select_range``: hits in ``[lo, hi)`` ascending into ``idx``; the count."""
    scratch = scratch or new_scratch()
    select_range_async(x, lo, hi, thr, idx, scratch, stream, variant)
    return _read_totals(scratch, stream)[0]


def count_range(x, lo, hi, thr, scratch=None, stream=0):
    """Like ``kernels.cpu.count_range``."""
    scratch = scratch or new_scratch()
    count_range_async(x, lo, hi, thr, scratch, stream)
    return _read_totals(scratch, stream)[0]


def _elementwise(kernel, n, stream, *args):
    if n == 0:
        return
    nb, bd = _shape(n)
    _go(kernel, nb, bd, stream, *args)


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


# ---------------------------------------------------------------------------- histogram launchers
def _hist_kernels(dtype, marked=False):
    if np.dtype(dtype) == np.float32:
        return _acc_count_hist32, (_hist_marked32 if marked else _hist_range32)
    if np.dtype(dtype) == np.float64:
        return _acc_count_hist64, (_hist_marked64 if marked else _hist_range64)
    raise TypeError(f"histograms need float32 or float64, not {dtype}")


def _measure_kernel(dtype, variant=None):
    """The measuring pass for ``dtype``: marks by warp ballot with the ``fast`` variant (a GPU),
    by atomic or with ``safe`` (the simulator; a GPU fallback)."""
    warp = (variant or VARIANT) == "fast"
    if warp and SIMULATOR:
        raise RuntimeError("the 'fast' CUDA kernels need warp intrinsics, absent in the simulator")
    if np.dtype(dtype) == np.float32:
        return _acc_measure32_warp if warp else _acc_measure32
    if np.dtype(dtype) == np.float64:
        return _acc_measure64_warp if warp else _acc_measure64
    raise TypeError(f"histograms need float32 or float64, not {dtype}")


def _hist_words(scratch, nw):
    if nw > HIST_MAX:
        raise ValueError(f"{nw} histogram buckets: at most HIST_MAX = {HIST_MAX}")
    if scratch.hist.shape[0] < nw:
        raise ValueError("scratch has no histogram region (allocate Scratch.size() words)")
    return scratch.hist


def accumulate_select_hist_async(residual, grad, acc, lo, hi, thr, idx, shift, key0, nh, scratch, stream=0,
                                 variant=None, predict=False, fine=(0, 0, 0), forecast=None, stride=1):
    """``accumulate_select_async`` that also histograms ``[flo, fhi) = forecast`` (default ``[lo, hi)``).

    ``fine = (shift_f, key0_f, nf)`` (``nf`` may be 0); the coarse histogram counts only elements
    whose index is a multiple of ``stride``. When it completes, ``scratch.totals_hist``
    holds ``[count, nonfinite, coarse[0:nh], fine[0:nf], ...]`` (int64, this call's counts only).
    Four launches: zero the histogram words, count + histograms, scan, compaction; the histograms
    cost no extra pass over memory (see docs/gpu.md).
    """
    flo, fhi = forecast if forecast is not None else (lo, hi)
    nb, cs, mask = _hist_pass(residual, grad, acc, lo, hi, thr, shift, key0, nh, scratch, stream, predict, fine,
                              flo, fhi, stride)
    _scan_compact(scratch, nb, lo, hi, cs, mask, idx, stream, variant)


def _hist_pass(residual, grad, acc, lo, hi, thr, shift, key0, nh, scratch, stream, predict, fine, flo, fhi, stride,
               measure=None):
    """Zero the histogram words and launch ``_acc_count_hist*``; returns (blocks, chunk, mask).
    ``measure`` (a kernel variant; the measuring pass: no forecast, ``[flo, fhi) = [lo, hi)``): the
    specialised ``_acc_measure*`` instead, where the coarse stride divides the block."""
    m = hi - lo
    shift_f, key0_f, nf = fine
    hw = _hist_words(scratch, nh + nf)
    nb, bd = _shape(acc.shape[0])
    cs = _chunk(m, nb, bd)
    mask = scratch.mask_for(m)
    _go(_zero_words, 1, max(1, min(BLOCK, _round32(nh + nf))), stream, hw, nh + nf)
    if measure and stride > 0 and stride & (stride - 1) == 0 and bd % stride == 0:
        _go(_measure_kernel(acc.dtype, measure), nb, bd, stream, residual, grad, acc, lo, hi, thr, cs,
            scratch.block_counts, scratch.block_bad, mask, int(shift), int(key0), int(nh), int(shift_f), int(key0_f),
            int(nf), hw, int(stride))
        return nb, cs, mask
    kcount, _ = _hist_kernels(acc.dtype)
    _go(kcount, nb, bd, stream, residual, grad, acc, lo, hi, thr, cs, scratch.block_counts, scratch.block_bad, mask,
        int(flo), int(fhi), bool(predict), int(shift), int(key0), int(nh), int(shift_f), int(key0_f), int(nf), hw,
        int(stride))
    return nb, cs, mask


def accumulate_measure_async(residual, grad, acc, lo, hi, mark, shift, key0, nh, scratch, stream=0,
                             fine=(0, 0, 0), stride=1, variant=None):
    """The measuring pass: ``acc = residual + grad`` with the histograms of ``|acc|`` over [lo, hi)
    (``accumulate_select_hist_async`` without a forecast) and, instead of a selection, a mark in the
    hit mask on every element with ``|acc| >= mark`` (``mark`` NaN: none), kept for
    ``select_marked_async``. ``scratch.totals_hist`` holds ``[marked, nonfinite, hist...]`` when it
    completes. Three launches: zero the words, the pass, the scan (for the totals)."""
    nb, _, _ = _hist_pass(residual, grad, acc, lo, hi, mark, shift, key0, nh, scratch, stream, False, fine, lo, hi,
                          stride, measure=variant or VARIANT)
    _go(_scan, 1, min(SCAN_THREADS, _round32(nb)), stream, scratch.block_counts, scratch.block_bad, nb,
        scratch.offsets, scratch.totals)
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
    _, khist = _hist_kernels(x.dtype, marks)
    hw = _hist_words(scratch, nh)
    _go(_zero_words, 1, max(1, min(BLOCK, _round32(nh))), stream, hw, nh)
    if marks:  # a zoom inside the fine window: O(range / 32 + marks) instead of O(range)
        nw = (hi - lo + 31) // 32
        nb, bd = _shape(max(nw * 4, 1))
        _go(khist, nb, bd, stream, x, int(lo), int(hi), scratch.mask_for(hi - lo, keep_marks=True), int(shift),
            int(key0), int(nh), hw)
        return True
    nb, bd = _shape(max(hi - lo, 1))
    _go(khist, nb, bd, stream, x, int(lo), int(hi), int(shift), int(key0), int(nh), hw)
    return False


def read_totals_hist(scratch, nw, stream=0):
    """``[count, nonfinite, hist words[:nw]]`` as one host int64 array (one device->host copy)."""
    w = scratch.totals_hist[: 2 + nw]
    if isinstance(w, np.ndarray):
        return w.astype(np.int64, copy=True)
    host = _dev(w).copy_to_host(stream=stream)
    if stream:
        stream.synchronize()
    return host.astype(np.int64, copy=False)


def accumulate_select_hist(residual, grad, acc, lo, hi, thr, idx, shift, key0, hist, predict=False, fine=None,
                           forecast=None, scratch=None, stream=0, variant=None, stride=1):
    """Like ``kernels.cpu_controller.host_accumulate_select_hist``: returns ``(count, nonfinite)``.

    ``hist`` and ``fine = (shift_f, key0_f, hist_f)``'s ``hist_f`` are host int64 arrays, added to.
    """
    scratch = scratch or new_scratch()
    shift_f, key0_f, hist_f = fine if fine is not None else (0, 0, np.zeros(0, np.int64))
    nh, nf = hist.shape[0], hist_f.shape[0]
    accumulate_select_hist_async(residual, grad, acc, lo, hi, thr, idx, shift, key0, nh, scratch, stream, variant,
                                 predict, (shift_f, key0_f, nf), forecast, stride)
    w = read_totals_hist(scratch, nh + nf, stream)
    hist += w[2:2 + nh]
    hist_f += w[2 + nh:2 + nh + nf]
    return int(w[0]), int(w[1])


def hist_range(x, lo, hi, shift, key0, hist, scratch=None, stream=0):
    """Like ``kernels.cpu_controller.host_hist_range``: ``hist`` (host int64) ``+=`` the histogram."""
    scratch = scratch or new_scratch()
    nh = hist.shape[0]
    marks = hist_range_async(x, lo, hi, shift, key0, nh, scratch, stream)
    w = read_totals_hist(scratch, nh, stream)[2:2 + nh]
    if marks:
        w[0] = (hi - lo) - w[1:].sum()
    hist += w
