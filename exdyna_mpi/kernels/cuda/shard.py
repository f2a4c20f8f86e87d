"""The device side of the sparse reduce-scatter: the owner's float32 mean of its run in rank order
(``owner_mean32``, ``owner_mean16``) and a run's values into its shard's dense buffer
(``scatter_run``); the same bits as ``exdyna_mpi/kernels/cpu_shard.py`` (tests/cudasim/test_shard_cuda.py).
The kernels read the (p, c) rows flat (row r at ``r * c``): the launchers take either shape."""
import numpy as np
from numba import cuda

from .half import _value16
from .launch import _elementwise


@cuda.jit
def _owner_mean32(recv, own, me, p, out):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    pf = np.float32(p)
    while i < own.shape[0]:
        s = np.float32(0.0)
        for r in range(p):
            if r == me:
                s = np.float32(s + own[i])
            else:
                s = np.float32(s + recv[r * own.shape[0] + i])
        out[i] = np.float32(s / pf)
        own[i] = np.float32(0.0)
        i += stride


@cuda.jit
def _owner_mean16(recv, own, me, p, mode, out):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    pf = np.float32(p)
    while i < own.shape[0]:
        s = np.float32(0.0)
        for r in range(p):
            if r == me:
                s = np.float32(s + own[i])
            else:
                s = np.float32(s + _value16(np.int64(recv[r * own.shape[0] + i]), mode))
        out[i] = np.float32(s / pf)
        own[i] = np.float32(0.0)
        i += stride


@cuda.jit
def _scatter_run(out, idx, lo, vals):
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    while j < idx.shape[0]:
        out[idx[j] - lo] = vals[j]
        j += stride


def owner_mean32(recv, own, me, p, out, stream=0):
    """``kernels.cpu_shard.owner_mean32``: the float32 mean of the run in rank order into ``out``;
    ``own`` becomes 0."""
    _elementwise(_owner_mean32, own.shape[0], stream, recv.reshape(-1), own, me, p, out)


def owner_mean16(recv, own, me, p, mode, out, stream=0):
    """``kernels.cpu_shard.owner_mean16``: ``recv`` holds 16-bit patterns in ``mode``."""
    _elementwise(_owner_mean16, own.shape[0], stream, recv.reshape(-1), own, me, p, mode, out)


def scatter_run(out, idx, lo, vals, stream=0):
    """``out[idx[j] - lo] = vals[j]``."""
    _elementwise(_scatter_run, idx.shape[0], stream, out, idx, lo, vals)
