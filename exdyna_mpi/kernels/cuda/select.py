"""The ordered selection: hits ``|x| >= thr`` in ``[lo, hi)``, their indices written ascending.

Three launches (count, scan, compact: the stream-compaction pattern of Billeter et al. 2009):

1. ``_acc_count`` (the fused accumulate ``acc = r + g``), ``_count`` (``x`` as it is) or
   ``_filter_marks`` (the measuring pass's marks): block ``b`` owns the contiguous chunk
   ``[lo + b*cs, lo + (b+1)*cs) ∩ [lo, hi)`` of the selection range (threads stride through it in
   steps of ``blockDim``, so loads are coalesced), sets the bits of its hits in the hit mask and
   writes its count (and ``_acc_count``, over the whole vector, its non-finite count) per block.
2. ``_scan``: one block turns the block counts into block offsets and writes ``totals = [count,
   nonfinite]``, the only thing the host ever reads.
3. ``_compact``: each block walks its chunk's mask words in tiles of ``blockDim * ipt`` words;
   thread ``t`` counts the hits among its ``ipt`` consecutive words, a block-wide exclusive scan of
   those counts (``tile_scan``) gives its write position after ``offsets[b]``, and it writes them in
   order. ``ipt`` is a constant of the compiled kernel (``CONFIG.ipt``; one kernel per value,
   built once: ``_compact_kernel``).

Two variants of ``tile_scan``, picked at each launch (``CONFIG.variant``, env
``EXDYNA_CUDA_KERNELS=safe|fast``, or a launcher's ``variant`` argument):

- ``"fast"`` (real GPUs): ``shfl_up_sync`` scan inside each warp, warp totals through shared memory.
- ``"safe"`` (the Numba CUDA simulator, which has no warp intrinsics, and any GPU as a fallback):
  shared memory and two ``syncthreads`` only. Every other line of the kernels is shared, so CI under
  the simulator tests the exact ordering logic the GPU runs; the fast scan is compiled to PTX in CI
  (tests/cudasim/ptx_check.py) but only runs on a GPU.
"""
import numpy as np
from numba import cuda

from .blocks import _block_total2, _mark
from .config import CONFIG, FULL_MASK, check_variant
from .launch import _round32, chunk_size, device_view, grid_shape, launch_kernel
from .scratch import new_scratch


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


# ---------------------------------------------------------------------------- counts
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


# ---------------------------------------------------------------------------- scan and compaction
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


def _make_compact(tile_scan, ipt, guarded=False):
    """The compaction with ``tile_scan`` and ``ipt`` words per thread per tile, a constant of the
    compiled kernel (the loops over it unroll); ``guarded``: it runs only when ``ctl[0]``."""

    @cuda.jit(device=True)
    def _body(mask, lo, hi, cs, offsets, idx):
        """Write the hits of this block's chunk, ascending, at idx[offsets[b]:], from the hit mask.

        The chunk ``[lo + b*cs, ...)`` starts on a mask word (``cs`` is a multiple of 32). A tile is
        ``blockDim * ipt`` words; thread t takes the ipt consecutive words at t * ipt, counts their
        bits (``popc``), gets its rank in the tile from ``tile_scan`` (one block scan per
        ``32 * ipt * blockDim`` elements) and writes its hits lowest bit first; it zeroes every
        non-zero word it read, so the mask is all zero again for the next selection.
        """
        t = cuda.threadIdx.x
        b = cuda.blockIdx.x
        s = b * cs                      # offsets from lo
        e = min(s + cs, hi - lo)
        w0 = s >> 5
        w1 = (e + 31) >> 5 if e > s else w0
        tile = cuda.blockDim.x * ipt
        base = offsets[b]
        k = w0
        while k < w1:  # the same trip count on every thread of the block: tile_scan has barriers
            q0 = k + t * ipt
            c = 0
            for u in range(ipt):
                q = q0 + u
                if q < w1:
                    c += cuda.popc(mask[q])
            pre, tot = tile_scan(c)
            pos = base + pre
            if c > 0:
                for u in range(ipt):
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


# the default ``ipt``'s kernels, built at import (the static check and the PTX tests compile these)
_compact_safe = _make_compact(_tile_scan_shared, CONFIG.ipt)
_compact_fast = _make_compact(_tile_scan_warp, CONFIG.ipt)
_compact_safe_at = _make_compact(_tile_scan_shared, CONFIG.ipt, guarded=True)
_compact_fast_at = _make_compact(_tile_scan_warp, CONFIG.ipt, guarded=True)
# (fast, guarded, ipt) -> kernel: another ``ipt`` builds its kernels once, on first use
_compacts = {(False, False, CONFIG.ipt): _compact_safe, (True, False, CONFIG.ipt): _compact_fast,
             (False, True, CONFIG.ipt): _compact_safe_at, (True, True, CONFIG.ipt): _compact_fast_at}


# ---------------------------------------------------------------------------- launchers
def _compact_kernel(variant, guarded=False):
    """The compaction for ``variant`` (None: ``CONFIG.variant``) at ``CONFIG.ipt``."""
    key = (check_variant(variant) == "fast", guarded, CONFIG.ipt)
    k = _compacts.get(key)
    if k is None:
        k = _compacts[key] = _make_compact(_tile_scan_warp if key[0] else _tile_scan_shared, key[2], guarded)
    return k


def _read_totals(scratch, stream):
    t = scratch.totals
    if isinstance(t, np.ndarray):
        return int(t[0]), int(t[1])
    host = device_view(t).copy_to_host(stream=stream)
    if stream:
        stream.synchronize()
    return int(host[0]), int(host[1])


def scan_async(scratch, nb, stream=0):
    """Launch the block scan: ``scratch.offsets[:nb]`` = the exclusive scan of
    ``scratch.block_counts[:nb]``, ``scratch.totals`` = ``[sum of counts, sum of block_bad]``.

    Args:
        scratch: the ``Scratch`` a count pass wrote its block counts into.
        nb: blocks of that pass (at most ``NB_MAX``).
        stream: the stream to queue on.

    Returns:
        None.

    Raises:
        Nothing of its own.
    """
    launch_kernel(_scan, 1, min(CONFIG.scan_threads, _round32(nb)), stream, scratch.block_counts,
                  scratch.block_bad, nb, scratch.offsets, scratch.totals)


def compact_async(scratch, nb, lo, hi, cs, mask, idx, stream=0, variant=None):
    """Launch the mask compaction: the set bits of ``mask`` (element ``lo + i`` at bit ``i``) as
    ascending indices into ``idx``, each block's at ``scratch.offsets[b]``; the words read are
    zeroed. After a count pass and ``scan_async`` with the same ``nb`` and ``cs``.

    Args:
        scratch: the ``Scratch`` holding the block offsets.
        nb: blocks of the count pass.
        lo: the selection range's first element.
        hi: the end of the selection range (exclusive).
        cs: elements per block (``chunk_size``).
        mask: the hit mask (``scratch.mask_for``).
        idx: the index output (at least the count's length).
        stream: the stream to queue on.
        variant: ``"safe"``, ``"fast"`` or None for ``CONFIG.variant``.

    Returns:
        None.

    Raises:
        RuntimeError: ``"fast"`` under the simulator.
    """
    if hi > lo:
        launch_kernel(_compact_kernel(variant), nb, CONFIG.block, stream, mask, lo, hi, cs, scratch.offsets,
                      idx)


def _scan_compact(scratch, nb, lo, hi, cs, mask, idx, stream, variant, guarded=False):
    scan_async(scratch, nb, stream)
    if not guarded:
        compact_async(scratch, nb, lo, hi, cs, mask, idx, stream, variant)
    elif hi > lo:
        launch_kernel(_compact_kernel(variant, True), nb, CONFIG.block, stream, mask, lo, hi, cs, scratch.offsets,
                      idx, scratch.ctl)


def accumulate_select_async(residual, grad, acc, lo, hi, thr, idx, scratch, stream=0, variant=None):
    """Launch the fused select; ``scratch.totals`` holds ``[count, nonfinite]`` when it completes."""
    n = acc.shape[0]
    m = hi - lo
    nb, bd = grid_shape(n)
    cs = chunk_size(m, nb, bd)
    mask = scratch.mask_for(m)
    launch_kernel(_acc_count, nb, bd, stream, residual, grad, acc, lo, hi, thr, cs, scratch.block_counts,
                  scratch.block_bad, mask)
    _scan_compact(scratch, nb, lo, hi, cs, mask, idx, stream, variant)


def select_range_async(x, lo, hi, thr, idx, scratch, stream=0, variant=None):
    """Launch ``select_range``; ``scratch.totals[0]`` holds the count when it completes."""
    m = hi - lo
    nb, bd = grid_shape(m)
    cs = chunk_size(m, nb, bd)
    mask = scratch.mask_for(m)
    launch_kernel(_count, nb, bd, stream, x, lo, hi, thr, cs, scratch.block_counts, scratch.block_bad, mask, True)
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
    nb, bd = grid_shape(m)
    cs = chunk_size(m, nb, bd)
    mask = scratch.mask_for(m, keep_marks=True)
    launch_kernel(_filter_marks, nb, bd, stream, x, lo, hi, thr, cs, scratch.block_counts, scratch.block_bad,
                  mask)
    _scan_compact(scratch, nb, lo, hi, cs, mask, idx, stream, variant)


def count_range_async(x, lo, hi, thr, scratch, stream=0):
    """Launch ``count_range``; ``scratch.totals[0]`` holds the count when it completes."""
    m = hi - lo
    nb, bd = grid_shape(m)
    cs = chunk_size(m, nb, bd)
    bc, bb = scratch.block_counts, scratch.block_bad
    launch_kernel(_count, nb, bd, stream, x, lo, hi, thr, cs, bc, bb, scratch.mask_for(1), False)
    scan_async(scratch, nb, stream)


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
