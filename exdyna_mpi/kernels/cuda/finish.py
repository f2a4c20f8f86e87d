"""The rest of a one-rank step of the measured controller, queued on the device right behind its
measuring pass so the device need not wait for the host: the threshold from the fine window's words
(``_resolve_fine``), then, only when it settled one, the select of the marks, ``out[:] = 0`` and
``out[idx] = acc[idx] / p``, ``acc[idx] = 0``."""
import numpy as np
from numba import cuda

from .config import CONFIG, HIST_MAX
from .launch import _round32, chunk_size, grid_shape, launch_kernel
from .select import _filter, _scan_compact


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
    launch_kernel(_resolve_fine, 1, min(CONFIG.scan_threads, _round32(nf)), stream, hw, nf, int(k), shift_f,
                  key0_f, cap, float(tol), scratch.totals, scratch.ctl, thr_bits)
    m = hi - lo
    nb, bd = grid_shape(m)
    cs = chunk_size(m, nb, bd)
    mask = scratch.mask_for(m, keep_marks=True)
    launch_kernel(_filter_marks_at, nb, bd, stream, acc, lo, hi, thr_at, scratch.ctl, cs, scratch.block_counts,
                  scratch.block_bad, mask, out)
    _scan_compact(scratch, nb, lo, hi, cs, mask, idx, stream, variant, guarded=True)
    launch_kernel(_take_mean_zero_at, *grid_shape(max(int(k), 1)), stream, out, acc, idx, scratch.totals, p,
                  scratch.ctl)
