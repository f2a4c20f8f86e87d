"""The sparse reduce-scatter on the (simulated) device: the kernels of exdyna_mpi/kernels/cuda/shard.py give
the host kernels' bits, and ``DeviceExchange.reduce_scatter_mean``, staged and direct (CUDA-aware),
gives ``Exchange.reduce_scatter_mean``'s means, kept values and byte counts over the same two-rank
exchange."""
import numpy as np
import pytest
from mpi4py import MPI

from exdyna_mpi.arrays.half import WireFormat, narrow
from exdyna_mpi.kernels import cpu_shard as ks
from exdyna_mpi.kernels import cuda as kc
from exdyna_mpi.transport import Exchange
from exdyna_mpi.transport import device as dt


def test_owner_mean_kernels_match_the_host():
    rng = np.random.default_rng(4)
    p, me, c = 4, 2, 257
    recv = rng.standard_normal((p, c)).astype(np.float32)
    own = rng.standard_normal(c).astype(np.float32)
    own_h, own_d = own.copy(), own.copy()
    m_h, m_d = np.empty(c, np.float32), np.empty(c, np.float32)
    ks.owner_mean32(recv, own_h, me, p, m_h)
    kc.owner_mean32(recv, own_d, me, p, m_d)
    assert m_h.tobytes() == m_d.tobytes() and not own_h.any() and not own_d.any()
    for name in ("bfloat16", "float16"):
        fmt = WireFormat.of(name)
        r16 = narrow(rng.standard_normal((p, c)).astype(np.float32).ravel(), name).view(np.uint16).reshape(p, c)
        own_h, own_d = own.copy(), own.copy()
        ks.owner_mean16(r16, own_h, me, p, fmt.mode, fmt.table, m_h)
        kc.owner_mean16(r16, own_d, me, p, fmt.mode, m_d)
        assert m_h.tobytes() == m_d.tobytes(), name
    idx = np.sort(rng.choice(np.arange(100, 900), c, replace=False)).astype(np.int64)
    out_h, out_d = np.zeros(800, np.float32), np.zeros(800, np.float32)
    ks.scatter_run(out_h, idx, 100, m_h)
    kc.scatter_run(out_d, idx, 100, m_d)
    assert out_h.tobytes() == out_d.tobytes() and out_h[idx - 100].tobytes() == m_h.tobytes()


class _TwoRanks:
    """The ``Alltoallv`` of a two-rank communicator whose other rank sends ``theirs`` (by dtype)."""

    def __init__(self, rank, theirs):
        self.rank, self.theirs, self.seen = rank, theirs, []

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return 2

    def Alltoallv(self, send, recv):
        (sbuf, _), (rbuf, (rcounts, rdispls)) = send, recv
        self.seen.append(sbuf)
        o = 1 - self.rank
        c, d = int(rcounts[o]), int(rdispls[o])
        rbuf.reshape(-1)[d: d + c] = self.theirs[np.dtype(rbuf.dtype).str][:c]


@pytest.mark.parametrize("aware", [False, True], ids=["staged", "direct"])
@pytest.mark.parametrize("wire", [None, "bfloat16", "float16"])
@pytest.mark.parametrize("rank", [0, 1])
def test_the_device_reduce_scatter_equals_the_host(rank, wire, aware):
    rng = np.random.default_rng([rank, 5])
    n, counts = 300, np.array([120, 180], np.int64)
    theirs = {np.dtype(np.float32).str: rng.standard_normal(n).astype(np.float32),
              np.dtype(np.uint16).str: narrow(rng.standard_normal(n).astype(np.float32), "bfloat16").view(np.uint16)}
    vals = rng.standard_normal(n).astype(np.float32)
    fmt = None if wire is None else WireFormat.of(wire)
    host = Exchange(_TwoRanks(rank, theirs))
    dcomm = _TwoRanks(rank, theirs)
    dev = dt.DeviceExchange(dcomm, cuda_aware=aware)
    vh, vd = vals.copy(), vals.copy()
    mh = host.reduce_scatter_mean(vh, counts, fmt)
    md = dev.reduce_scatter_mean(vd, counts, fmt)
    assert np.asarray(md).tobytes() == mh.tobytes() and np.asarray(vd).tobytes() == vh.tobytes()
    assert (dev.bytes_sent, dev.bytes_received) == (host.bytes_sent, host.bytes_received) != (0, 0)
    if wire is None:       # staged: MPI read the pinned copy; direct: the device buffer itself
        read = dcomm.seen[0]
        assert read is vd if aware else read.base is dev._pinned[("vals", np.dtype(np.float32).str)]


def test_one_rank_keeps_its_own_mean():
    x = dt.DeviceExchange(MPI.COMM_SELF, cuda_aware=True)
    vals = np.arange(5, dtype=np.float32)
    got = x.reduce_scatter_mean(vals, [5])
    assert np.asarray(got).tolist() == [0, 1, 2, 3, 4] and not np.asarray(vals).any()
    assert (x.bytes_sent, x.bytes_received) == (0, 0)
