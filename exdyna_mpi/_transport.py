"""Transport layer: every MPI call a sparsifier makes, with byte accounting.

Vector collectives use exact counts (no padding; zero counts are legal). Sums that every rank must
hold bit-identically are computed as Reduce_scatter + Allgatherv: each element is reduced on one
rank only and then copied, so the bits cannot differ between ranks (MPI does not promise that for
Allreduce). Byte counts follow the bandwidth-optimal ring algorithms (Thakur, Rabenseifner, Gropp
2005): what crosses this rank's link in each direction, the same model for every sparsifier.
"""
import numpy as np
from mpi4py import MPI

WORD = np.int64


def world():
    return MPI.COMM_WORLD


class Exchange:
    """The MPI side of one sparsifier: one communicator, counters of bytes moved.

    Host (NumPy) buffers only; the CUDA transport stages or passes device buffers (see
    ``_device_transport``) and calls the same methods.
    """

    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.bytes_sent = 0
        self.bytes_received = 0

    def reset_counters(self):
        self.bytes_sent = 0
        self.bytes_received = 0

    def _account_allgather(self, counts, itemsize):
        p = self.size
        if p == 1:
            return
        total = int(np.sum(counts))
        self.bytes_received += (total - int(counts[self.rank])) * itemsize
        self.bytes_sent += (total - int(counts[(self.rank + 1) % p])) * itemsize

    def _account_reduce(self, n, itemsize):
        p = self.size
        if p == 1:
            return
        b = 2 * (p - 1) * n * itemsize // p
        self.bytes_sent += b
        self.bytes_received += b

    def agree(self, words):
        """Allgather a few int64 words per rank; returns a (P, len(words)) array, same on every rank."""
        send = np.ascontiguousarray(words, dtype=WORD)
        recv = np.empty((self.size, send.shape[0]), dtype=WORD)
        self.comm.Allgather(send, recv)
        self._account_allgather(np.full(self.size, send.shape[0]), send.itemsize)
        return recv

    def allgatherv(self, send, counts, out=None):
        """Concatenate every rank's ``send[:counts[r]]`` in rank order into one array."""
        counts = np.asarray(counts, dtype=np.int64)
        total = int(counts.sum())
        if out is None:
            out = np.empty(total, dtype=send.dtype)
        if self.size == 1:
            out[:total] = send[:total]
            return out
        displs = np.zeros(self.size, dtype=np.int64)
        np.cumsum(counts[:-1], out=displs[1:])
        mine = send[: int(counts[self.rank])]
        self.comm.Allgatherv(mine, [out, (counts, displs)])
        self._account_allgather(counts, send.itemsize)
        return out

    def sum_identical(self, vals):
        """Elementwise sum of ``vals`` over ranks, in place, identical to the bit on every rank."""
        n = vals.shape[0]
        p = self.size
        if p == 1 or n == 0:
            return vals
        counts = np.full(p, n // p, dtype=np.int64)
        counts[: n % p] += 1
        displs = np.zeros(p, dtype=np.int64)
        np.cumsum(counts[:-1], out=displs[1:])
        mine = np.empty(int(counts[self.rank]), dtype=vals.dtype)
        self.comm.Reduce_scatter(vals, mine, counts, op=MPI.SUM)
        self.comm.Allgatherv(mine, [vals, (counts, displs)])
        self._account_reduce(n, vals.itemsize)
        return vals

    def bcast_from(self, buf, root):
        """Broadcast ``buf`` in place from ``root``."""
        if self.size > 1:
            self.comm.Bcast(buf, root=root)
            n = buf.size * buf.itemsize
            if self.rank == root:
                self.bytes_sent += n
            else:
                self.bytes_received += n
        return buf
