"""CPU kernels of the sparse reduce-scatter (``Exchange.reduce_scatter_mean``), ``@njit``.

Every rank holds the same union of positions; the positions that fall in rank ``r``'s shard form a
run, and rank ``r`` receives every rank's values of its run. The owner adds them in float32 in rank
order (its own values at its own turn), whatever MPI's reduction order would be, so the mean is
the same bits under any MPI and equals a rank-order sum computed anywhere else; it stays in
float32 (nothing is gathered, so nothing rounds it). The owner's own values are consumed: zero
afterwards, as what its residual keeps of them. The CUDA twins are ``exdyna_mpi/kernels/cuda/shard.py``.
"""
import numpy as np
from numba import njit

from .cpu_half import _widen_bits


@njit(cache=True, nogil=True)
def owner_mean32(recv, own, me, p, out):
    """``out[i]`` = (sum over ranks ``r`` of ``recv[r, i]``, ``own[i]`` at ``r == me``) / ``p``, the
    float32 sum in rank order; ``own`` (this rank's float32 values of its run) becomes 0. ``recv``
    (p, c) float32: row ``r`` from rank ``r`` (row ``me`` unused)."""
    c = own.shape[0]
    pf = np.float32(p)
    for i in range(c):
        s = np.float32(0.0)
        for r in range(p):
            if r == me:
                s += own[i]
            else:
                s += recv[r, i]
        out[i] = s / pf
        own[i] = 0.0


@njit(cache=True, nogil=True)
def owner_mean16(recv, own, me, p, mode, table_bits, out):
    """``owner_mean32`` with ``recv`` (p, c) the 16-bit patterns (``mode``: ``cpu_half.MODE_BF16`` or
    ``MODE_F16``; ``table_bits``: ``cpu_half.f16_table()`` as uint32) the other ranks sent, widened
    exactly before the float32 sum."""
    c = own.shape[0]
    pf = np.float32(p)
    w = np.empty(1, np.uint32)
    wf = w.view(np.float32)
    for i in range(c):
        s = np.float32(0.0)
        for r in range(p):
            if r == me:
                s += own[i]
            else:
                w[0] = _widen_bits(recv[r, i], mode, table_bits)
                s += wf[0]
        out[i] = s / pf
        own[i] = 0.0


@njit(cache=True, nogil=True)
def scatter_run(out, idx, lo, vals):
    """``out[idx[j] - lo] = vals[j]``: a run's values into its shard's dense buffer (``out``
    starts at global position ``lo``)."""
    for j in range(idx.shape[0]):
        out[idx[j] - lo] = vals[j]
