"""jobs/bit_hashes.py on the CPU backend with the lane schedule of the CUDA measuring pass's `fast`
variant before the split-warp fix replayed: a mark is dropped where the kernel's lane 0 did not
store it (a lane that reaches the one-wide loop after its warp's lower lanes finished the four-wide
one, with the GPU's launch shapes: block 256, grid up to 1024, 8 items per thread), and
`select_marked` returns the histogram's count, leaving the rest of the index buffer as it was, as
the CUDA ops do. Run as bit_hashes.py: `mpiexec -n 2 python -m mpi4py replay.py --streams cnn16
--steps 20 --sparsifiers exdyna`. Stale indices may point anywhere: a run can crash."""
import math, sys, os
import numpy as np
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "jobs"))
from exdyna_mpi.arrays import ops as O

BLOCK, GRID_MAX, ITEMS = 256, 1024, 8
STATS = {"lost_calls": 0, "lost_marks": 0}

def lost_positions(numel, lo, hi, stride):
    bd = BLOCK * stride // math.gcd(BLOCK, stride)
    nb = max(1, min(GRID_MAX, math.ceil(numel / (bd * ITEMS))))
    m = hi - lo
    per = math.ceil(m / nb) if m > 0 else 0
    unit = bd * 32 // math.gcd(bd, 32)
    cs = math.ceil(per / unit) * unit
    out = []
    if cs == 0:
        return np.zeros(0, np.int64)
    t = np.arange(bd)
    lane = t % 32
    for b in range(nb):
        start = lo + b * cs
        e = min(start + cs, hi)
        if e <= start:
            continue
        def n_unrolled(o):
            r = e - start - o - 3 * bd
            return np.where(r > 0, (r + 4 * bd - 1) // (4 * bd), 0)
        n = n_unrolled(t)
        n0 = n_unrolled(t - lane)
        for tt in np.flatnonzero(n != n0):
            i = start + tt + 4 * bd * n[tt]
            while i < e:
                out.append(i)
                i += bd
    return np.array(sorted(out), np.int64)

_orig_measure = O.HostOps.accumulate_measure
_orig_select_marked = O.HostOps.select_marked

def accumulate_measure(residual, grad, acc, lo, hi, coarse, fine, stride, mark=None, threads=1, marks=None):
    bad = _orig_measure(residual, grad, acc, lo, hi, coarse, fine, stride, mark, threads, marks)
    held = marks.of(acc, lo, hi) if marks is not None else None
    if held is not None:
        lost = lost_positions(acc.shape[0], lo, hi, stride)
        keep = ~np.isin(marks.index, lost)
        if not keep.all():
            STATS["lost_calls"] += 1
            STATS["lost_marks"] += int((~keep).sum())
        n = int(keep.sum())
        idx, val = marks.index[keep].copy(), marks.value[keep].copy()
        marks._index_buf[:n] = idx
        marks._value_buf[:n] = val
        marks.index, marks.value = marks._index_buf[:n], marks._value_buf[:n]
    return bad

def select_marked(x, lo, hi, thr, idx, expect=None, keep=False, marks=None):
    held = marks.of(x, lo, hi) if marks is not None else None
    c = _orig_select_marked(x, lo, hi, thr, idx, expect, keep, marks)
    if held is not None and thr >= held[0] and expect is not None:
        if c != int(expect):
            full = np.flatnonzero(np.abs(x[lo:hi]) >= thr) + lo
            miss = np.setdiff1d(full, idx[:c])
            print("EMU short", dict(lo=lo, hi=hi, found=c, expect=int(expect), missing=miss.tolist(),
                  stale=idx[c:int(expect)].tolist()), file=sys.stderr, flush=True)
        return int(expect)
    return c

O.HostOps.accumulate_measure = staticmethod(accumulate_measure)
O.HostOps.select_marked = staticmethod(select_marked)
import bit_hashes
try:
    bit_hashes.main(sys.argv[1:])
finally:
    print("emulation:", STATS, file=sys.stderr)
