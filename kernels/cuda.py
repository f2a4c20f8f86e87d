"""CUDA kernels: Numba ``@cuda.jit`` on CUDA device buffers, bit-identical to ``kernels.cpu``.

Same semantics as the CPU kernels: ``acc = residual + grad`` (``residual`` and ``grad`` only read),
``|acc| >= thr`` selected inside ``[lo, hi)``, indices written in ascending order, non-finite values
counted over the whole vector with the same ``x - x != 0`` test, ``out[i] = sums[j] / p`` in out's
dtype. No fastmath anywhere, so every compare, add and divide is IEEE round-to-nearest as on the CPU.

The ordered selection is three launches (pattern A of specs/anchors.md §3.4):

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

Launchers (``accumulate_select``, ``select_range``, ``count_range``, ``gather``, ``scatter``,
``zero_at``, ``scatter_mean_zero``) take arrays the kernels accept (Numba device arrays, any object
with ``__cuda_array_interface__`` such as CuPy arrays, or NumPy arrays under the simulator), a
``stream`` and, for the selection, a ``Scratch`` of small int64 buffers so nothing is allocated per
step. The ``*_async`` forms leave the counts in ``scratch.totals`` on the device; the plain forms
copy those two words to the host and return them, like ``kernels.cpu``.
"""
import math
import os

import numpy as np
from numba import cuda

try:  # numba-cuda (the NVIDIA package) keeps its config here; numba's built-in target elsewhere
    from numba.cuda.core import config as _config
except ImportError:  # pragma: no cover - numba's deprecated built-in CUDA target
    from numba.core import config as _config

#: True when the Numba CUDA simulator runs these kernels (NUMBA_ENABLE_CUDASIM=1 before import).
SIMULATOR = bool(_config.ENABLE_CUDASIM)

NB_MAX = 1024          # most blocks a selection uses; the scan runs one block of up to NB_MAX threads
WARPS_MAX = 32         # blockDim <= 1024
FULL_MASK = 0xFFFFFFFF

# Launch shapes. The simulator runs one OS thread per CUDA thread and each syncthreads is a Python
# barrier, so it gets tiny grids; the loops in every kernel cover any length with any grid.
if SIMULATOR:
    BLOCK, GRID_MAX, SCAN_THREADS, ITEMS, IPT = 32, 2, 8, 1, 32
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
    """Sum ``a`` and ``b`` over the block; thread 0 stores them at ``out_*[blockIdx.x]``."""
    sh = cuda.shared.array(2, np.int64)
    t = cuda.threadIdx.x
    if t == 0:
        sh[0] = 0
        sh[1] = 0
    cuda.syncthreads()
    if a != 0:
        cuda.atomic.add(sh, 0, a)
    if b != 0:
        cuda.atomic.add(sh, 1, b)
    cuda.syncthreads()
    if t == 0:
        out_a[cuda.blockIdx.x] = sh[0]
        out_b[cuda.blockIdx.x] = sh[1]


# ---------------------------------------------------------------------------- kernels
@cuda.jit
def _acc_count(r, g, acc, lo, hi, thr, cs, block_counts, block_bad):
    """acc = r + g over the whole vector; per block: hits in its chunk of [lo, hi), non-finite acc."""
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
def _count(x, lo, hi, thr, cs, block_counts, block_bad):
    """Per block: hits ``|x| >= thr`` in its chunk of [lo, hi) (block_bad gets 0)."""
    t = cuda.threadIdx.x
    b = cuda.blockIdx.x
    bd = cuda.blockDim.x
    cnt = 0
    e = min(lo + (b + 1) * cs, hi)
    i = lo + b * cs + t
    while i < e:
        if abs(x[i]) >= thr:
            cnt += 1
        i += bd
    _block_total2(cnt, 0, block_counts, block_bad)


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


def _make_compact(tile_scan):
    @cuda.jit
    def _compact(x, lo, hi, thr, cs, ipt, offsets, idx):
        """Write the hits of this block's chunk, ascending, at idx[offsets[b]:].

        A tile is blockDim * ipt elements; thread t takes the ipt consecutive ones at t * ipt,
        counts its hits, gets its rank in the tile from ``tile_scan`` and writes them in order.
        """
        t = cuda.threadIdx.x
        b = cuda.blockIdx.x
        tile = cuda.blockDim.x * ipt
        s = lo + b * cs
        e = min(s + cs, hi)
        base = offsets[b]
        k = s
        while k < e:  # the same trip count on every thread of the block: tile_scan has barriers
            i0 = k + t * ipt
            i1 = min(i0 + ipt, e)
            c = 0
            for i in range(i0, i1):
                if abs(x[i]) >= thr:
                    c += 1
            pre, tot = tile_scan(c)
            pos = base + pre
            for i in range(i0, i1):
                if abs(x[i]) >= thr:
                    idx[pos] = i
                    pos += 1
            base += tot
            k += tile

    return _compact


_compact_safe = _make_compact(_tile_scan_shared)
_compact_fast = _make_compact(_tile_scan_warp)


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


# ---------------------------------------------------------------------------- launchers
class Scratch:
    """The small int64 buffers of one selection: block counts, block offsets, totals.

    ``words`` is one int64 array of at least ``Scratch.size()`` elements, allocated by the caller
    (a CuPy array, a Numba device array, or NumPy under the simulator) and reused every step.
    """

    @staticmethod
    def size():
        return 3 * NB_MAX + 2

    def __init__(self, words):
        self.words = words
        self.block_counts = words[0:NB_MAX]
        self.block_bad = words[NB_MAX:2 * NB_MAX]
        self.offsets = words[2 * NB_MAX:3 * NB_MAX]
        self.totals = words[3 * NB_MAX:3 * NB_MAX + 2]


def new_scratch():
    """A ``Scratch`` allocated with Numba (tests and one-off calls; ``CudaOps`` brings its own)."""
    if SIMULATOR:
        return Scratch(np.zeros(Scratch.size(), np.int64))
    return Scratch(cuda.device_array(Scratch.size(), np.int64))


def _dev(a):
    """What to hand a kernel: CAI producers (CuPy) become Numba views without a stream sync.

    The caller launches on the producer's stream (CuPy's current stream), so ordering holds and
    Numba's default sync on the CAI ``stream`` key would only add a host round trip per launch.
    """
    if SIMULATOR or not hasattr(a, "__cuda_array_interface__"):
        return a
    if type(a).__module__.startswith("numba"):  # already a Numba device array
        return a
    return cuda.as_cuda_array(a, sync=False)


def _shape(n_work, block=None):
    """(blocks, threads) for ``n_work`` elements: enough blocks for ITEMS elements per thread."""
    bd = block or BLOCK
    nb = max(1, min(GRID_MAX, math.ceil(n_work / (bd * ITEMS))))
    return nb, bd


def _chunk(m, nb, bd):
    """Elements of the selection range per block, a multiple of the block size."""
    per = math.ceil(m / nb) if m > 0 else 0
    return math.ceil(per / bd) * bd


def _compact_kernel(variant):
    v = variant or VARIANT
    if v == "fast":
        if SIMULATOR:
            raise RuntimeError("the 'fast' CUDA kernels need warp intrinsics, absent in the simulator")
        return _compact_fast
    return _compact_safe


def _read_totals(scratch, stream):
    t = scratch.totals
    if isinstance(t, np.ndarray):
        return int(t[0]), int(t[1])
    host = _dev(t).copy_to_host(stream=stream)
    if stream:
        stream.synchronize()
    return int(host[0]), int(host[1])


def accumulate_select_async(residual, grad, acc, lo, hi, thr, idx, scratch, stream=0, variant=None):
    """Launch the fused select; ``scratch.totals`` holds ``[count, nonfinite]`` when it completes."""
    n = acc.shape[0]
    m = hi - lo
    nb, bd = _shape(n)
    cs = _chunk(m, nb, bd)
    r, g, a, ix = _dev(residual), _dev(grad), _dev(acc), _dev(idx)
    bc, bb, off, tot = (_dev(scratch.block_counts), _dev(scratch.block_bad), _dev(scratch.offsets),
                        _dev(scratch.totals))
    _acc_count[nb, bd, stream](r, g, a, lo, hi, thr, cs, bc, bb)
    _scan[1, min(SCAN_THREADS, _round32(nb)), stream](bc, bb, nb, off, tot)
    if m > 0:
        _compact_kernel(variant)[nb, bd, stream](a, lo, hi, thr, cs, IPT, off, ix)


def select_range_async(x, lo, hi, thr, idx, scratch, stream=0, variant=None):
    """Launch ``select_range``; ``scratch.totals[0]`` holds the count when it completes."""
    m = hi - lo
    nb, bd = _shape(m)
    cs = _chunk(m, nb, bd)
    xd, ix = _dev(x), _dev(idx)
    bc, bb, off, tot = (_dev(scratch.block_counts), _dev(scratch.block_bad), _dev(scratch.offsets),
                        _dev(scratch.totals))
    _count[nb, bd, stream](xd, lo, hi, thr, cs, bc, bb)
    _scan[1, min(SCAN_THREADS, _round32(nb)), stream](bc, bb, nb, off, tot)
    if m > 0:
        _compact_kernel(variant)[nb, bd, stream](xd, lo, hi, thr, cs, IPT, off, ix)


def count_range_async(x, lo, hi, thr, scratch, stream=0):
    """Launch ``count_range``; ``scratch.totals[0]`` holds the count when it completes."""
    m = hi - lo
    nb, bd = _shape(m)
    cs = _chunk(m, nb, bd)
    bc, bb, off, tot = (_dev(scratch.block_counts), _dev(scratch.block_bad), _dev(scratch.offsets),
                        _dev(scratch.totals))
    _count[nb, bd, stream](_dev(x), lo, hi, thr, cs, bc, bb)
    _scan[1, min(SCAN_THREADS, _round32(nb)), stream](bc, bb, nb, off, tot)


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
    kernel[nb, bd, stream](*[_dev(a) if hasattr(a, "shape") else a for a in args])


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
