"""Transport layer: the host exchange of a sparsifier, and the seams the adapters use.

``Exchange`` implements both exchange roles (``protocols.py``) on host (NumPy) buffers: the
collectives of ``ExchangeProtocol`` (the word agreement of the first collective, ``agree`` and
``sum_words``; the error texts behind a refusal, ``gather_objects``; ``allgatherv``; bit-identical
sums, ``sum_identical``; broadcast, ``bcast_from``) and the point-to-point calls of Ok-Topk's
split-and-reduce (``PointToPointProtocol``: ``alltoall_counts``, ``rotating_rounds``), each counted
into its ``ByteCounter`` (``accounting.py``). ``device.DeviceExchange`` subclasses it for CUDA
buffers. ``broadcast`` (rank 0's parameters at start-up), ``world`` and ``thread_multiple`` are the
seams the adapters use.

``allgather_indices`` sends each rank's selection in the smallest of three compact forms (uint32
offsets, a bitmap of the rank's span, or Elias-Fano: within 0.6 bits an index of the entropy floor
``log2 C(span, count)``; chosen from the agreed counts and spans alone, ``exdyna_mpi/kernels/cpu_index.py``).
``mean_wire`` averages values that travel in 16 bits (``wire_dtype``): each rank's values are
rounded to the 16-bit format for the ranks that reduce them (the rounding stays with the sender),
the owner of each share sums in float32 in rank order, and the 16-bit mean is gathered, so every
rank holds the same bits. ``sum_signs`` and
``mean_wire(signs=True)`` gather only the sign of each sum as a 2-bit code (``signs.py``), for
receivers that use nothing else (``adam="demo"``): a quarter byte a value on the gathering half.

Vector collectives use exact counts (no padding; zero counts are legal). Sums that every rank must
hold bit-identically are computed as Reduce_scatter + Allgatherv: each element is reduced on one
rank only and then copied, so the bits cannot differ between ranks (MPI does not promise that for
Allreduce). Bytes are counted by the ring model (``ByteCounter``): what crosses this rank's link in
each direction, the same model for every sparsifier.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np
from mpi4py import MPI
from numpy.typing import DTypeLike

from ..arrays.half import narrow, widen
from ..kernels import cpu_half as _kh
from ..kernels import cpu_index as _ki
from ..kernels import cpu_8bit as _k8
from ..kernels import cpu_shard as _ks
from . import signs as _signs
from .accounting import ByteCounter, Counts, CountsBytes
from .protocols import Buffer, Parts, Words
from .watchdog import waiting, watched

if TYPE_CHECKING:
    from ..arrays.half import WireFormat

WORD = np.int64


def world():
    """``MPI.COMM_WORLD``: the communicator a sparsifier uses when none is given."""
    return MPI.COMM_WORLD


def thread_multiple() -> bool:
    """Whether MPI was initialised with ``MPI_THREAD_MULTIPLE`` (mpi4py's default): what a worker or
    progress thread that calls MPI beside the caller's thread needs."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def broadcast(buf, comm=None, root=0):
    """Broadcast host buffer ``buf`` in place from ``root`` over ``comm`` (default COMM_WORLD): a
    bounded wait (the watchdog aborts the job when the root never comes)."""
    comm = world() if comm is None else comm
    with waiting("broadcast", comm):
        comm.Bcast(buf, root=root)
    return buf


#: environment variables that launchers set to the number of ranks on this node
_NODE_RANKS_ENV = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE",
                   "SLURM_NTASKS_PER_NODE")


def node_ranks(comm):
    """Ranks of the job on this node: what the launcher says (MPICH's hydra, Open MPI, MVAPICH, Slurm),
    else the ranks of ``comm`` that share this node's memory (a collective over ``comm``: call it
    where every rank of ``comm`` does, as sparsifier construction is)."""
    for key in _NODE_RANKS_ENV:
        v = os.environ.get(key, "")
        if v.isdigit() and int(v) > 0:
            return int(v)
    with waiting("Comm.Split_type (the ranks of this node)", comm):
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size()
    finally:
        node.Free()


def _starts(counts):
    """Exclusive prefix sums of ``counts`` (int64): the displacements of a vector collective."""
    out = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=out[1:])
    return out


def shard_runs(union: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """How many positions of the ascending ``union`` fall in each shard ``[bounds[r], bounds[r+1])``
    (``bounds``: P + 1 ascending positions): the ``counts`` of ``Exchange.reduce_scatter_mean``.
    O(P log k)."""
    return np.diff(np.searchsorted(union, np.asarray(bounds, dtype=np.int64))).astype(np.int64)


class Exchange(CountsBytes):
    """The MPI side of one sparsifier on host (NumPy) buffers: one communicator and the
    ``ByteCounter`` of what it moved (``ExchangeProtocol`` and ``PointToPointProtocol``).

    ``device.DeviceExchange`` subclasses it for CUDA buffers: it inherits the host-word methods and
    overrides the array ones with staged or direct versions around these.

    Args:
        comm: the communicator (an ``mpi4py`` ``Comm``).
        counter: the ``ByteCounter`` to count into: a transport that runs collectives through this
            exchange passes its own, so one counter holds all it moved; a new one when None.

    Raises:
        Nothing of its own (MPI errors from ``Get_rank``/``Get_size``).

    Example::

        >>> xch = Exchange(MPI.COMM_WORLD)
        >>> words = xch.agree([count, 7])          # (P, 2) int64, the same on every rank
        >>> xch.sum_identical(vals)                # in place, the same bits on every rank
        >>> xch.bytes_sent, xch.bytes_received     # by the ring model, since reset_counters()
    """

    def __init__(self, comm: MPI.Comm, counter: ByteCounter | None = None) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.bytes = ByteCounter(self.rank, self.size) if counter is None else counter

    @watched
    def agree(self, words: Words) -> np.ndarray:
        """Allgather a few int64 words per rank; returns a (P, len(words)) array, same on every rank."""
        send = np.ascontiguousarray(words, dtype=WORD)
        if self.size == 1:
            return send.reshape(1, -1).copy()
        recv = np.empty((self.size, send.shape[0]), dtype=WORD)
        self.comm.Allgather(send, recv)
        self.bytes.allgather(np.full(self.size, send.shape[0]), send.itemsize)
        return recv

    @watched
    def sum_words(self, words: Words, dtype: DTypeLike = np.int64) -> np.ndarray:
        """Allreduce (sum) of a fixed number of integer words: the same exact sum on every rank
        (integer addition is associative). ``dtype`` int32 where the sums fit. Returns a 1-D array."""
        send = np.ascontiguousarray(words, dtype=dtype)
        recv = np.empty_like(send)
        if self.size == 1:
            recv[:] = send
            return recv
        self.comm.Allreduce(send, recv, op=MPI.SUM)
        self.bytes.reduce(send.shape[0], send.itemsize)
        return recv

    @watched
    def gather_objects(self, obj: object) -> list[Any]:
        """Every rank's picklable ``obj`` as a list in rank order (error texts; not on the hot path)."""
        return self.comm.allgather(obj)

    @watched
    def allgatherv(self, send: Buffer, counts: Counts, out: Buffer | None = None) -> Buffer:
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
        self.bytes.allgather(counts, send.itemsize)
        return out

    @watched
    def sum_identical(self, vals: np.ndarray) -> np.ndarray:
        """Elementwise sum of ``vals`` over ranks, in place, identical to the bit on every rank."""
        n = vals.shape[0]
        p = self.size
        if p == 1 or n == 0:
            return vals
        counts, displs = self._shares(n, p)
        mine = np.empty(int(counts[self.rank]), dtype=vals.dtype)
        self.comm.Reduce_scatter(vals, mine, counts, op=MPI.SUM)
        self.comm.Allgatherv(mine, [vals, (counts, displs)])
        self.bytes.reduce(n, vals.itemsize)
        return vals

    @watched
    def sum_signs(self, vals: np.ndarray) -> np.ndarray:
        """``sign(sum over ranks / P)`` of ``vals`` elementwise, in place (1, -1, 0 or NaN in
        ``vals``' dtype), identical on every rank; the sign of ``sum_identical``'s result / P to the bit
        (but a negative zero, which comes back as +0).

        The sum is ``sum_identical``'s Reduce_scatter (each share summed on its owner, in MPI's
        order); the owner divides its share by P in the values' dtype and gathers the signs as 2-bit
        codes (``Allgatherv``): (P-1)/P x (itemsize + 1/4) bytes a value each way, against
        ``sum_identical``'s 2 (P-1)/P x itemsize.
        """
        n, p, me = vals.shape[0], self.size, self.rank
        div = vals.dtype.type(p)
        if p == 1 or n == 0:
            np.divide(vals, div, out=vals)
            np.sign(vals, out=vals)
            return vals
        counts, displs = self._shares(n, p)
        mine = np.empty(int(counts[me]), dtype=vals.dtype)
        self.comm.Reduce_scatter(vals, mine, counts, op=MPI.SUM)
        half = (p - 1) * n * vals.itemsize // p
        self.bytes.add(half, half)
        np.divide(mine, div, out=mine)
        self._gather_signs(mine, counts, displs, _signs.sign_table(vals.dtype), vals)
        return vals

    def _gather_signs(self, mine, counts, displs, table, out):
        """Every rank's share's sign codes (``mine``: this rank's share of ``counts``), decoded
        through ``table`` into ``out`` at the shares' ``displs``: one ``Allgatherv`` of packed codes."""
        nbytes = _signs.packed_size(counts)
        bdispls = np.zeros(self.size, dtype=np.int64)
        np.cumsum(nbytes[:-1], out=bdispls[1:])
        recv = np.empty(int(nbytes.sum()), dtype=np.uint8)
        self.comm.Allgatherv(_signs.encode(mine), [recv, (nbytes, bdispls)])
        self.bytes.allgather(nbytes, 1)
        for r in range(self.size):
            c, d, b = int(counts[r]), int(displs[r]), int(bdispls[r])
            _signs.decode(recv[b: b + int(nbytes[r])], c, table, out[d: d + c])

    @staticmethod
    def _shares(n, p):
        """Equal shares of ``n`` elements over ``p`` ranks: (counts, displacements)."""
        counts = np.full(p, n // p, dtype=np.int64)
        counts[: n % p] += 1
        displs = np.zeros(p, dtype=np.int64)
        np.cumsum(counts[:-1], out=displs[1:])
        return counts, displs

    def _to_owners(self, sent, counts, displs, recv):
        """``Alltoallv`` of equal shares (``_shares``): share j of ``sent`` to rank j, except this
        rank's own; ``recv`` (P x its share, flat or 2-D) gets rank s's values in row s (its own row
        untouched). Host or device buffers (a CUDA-aware MPI reads the latter)."""
        p, me = self.size, self.rank
        c = int(counts[me])
        scounts = counts.copy()
        scounts[me] = 0
        rcounts = np.full(p, c, dtype=np.int64)
        rcounts[me] = 0
        self.comm.Alltoallv([sent, (scounts, displs)], [recv, (rcounts, np.arange(p, dtype=np.int64) * c)])
        self.bytes.add(int(scounts.sum()) * sent.itemsize, int(rcounts.sum()) * sent.itemsize)

    @watched
    def allgather_indices(self, idx: np.ndarray, counts: Counts, spans: np.ndarray,
                          out: np.ndarray | None = None) -> np.ndarray:
        """Every rank's selection in rank order, as ``allgatherv(idx, counts)`` gives it, sent in
        compact form. ``spans`` (P, 2): each rank's ``[lo, hi)``, which holds all its indices (the
        same on every rank); ``idx[:counts[rank]]`` ascending. Spans below 2**32 elements."""
        counts = np.asarray(counts, dtype=np.int64)
        total = int(counts.sum())
        if out is None:
            out = np.empty(total, dtype=idx.dtype)
        if self.size == 1:
            out[:total] = idx[:total]
            return out
        lo = spans[:, 0].astype(np.int64)
        span = (spans[:, 1] - spans[:, 0]).astype(np.int64)
        nbytes = np.array([_ki.index_form(int(c), int(s))[1] for c, s in zip(counts, span)], dtype=np.int64)
        me = self.rank
        send = np.empty(int(nbytes[me]), dtype=np.uint8)
        _ki.encode_indices(idx[: int(counts[me])], int(lo[me]), int(span[me]), send)
        bdispls = np.zeros(self.size, dtype=np.int64)
        np.cumsum(nbytes[:-1], out=bdispls[1:])
        recv = np.empty(int(nbytes.sum()), dtype=np.uint8)
        self.comm.Allgatherv(send, [recv, (nbytes, bdispls)])
        self.bytes.allgather(nbytes, 1)
        at = 0
        for r in range(self.size):
            c = int(counts[r])
            _ki.decode_indices(recv[bdispls[r]: bdispls[r] + nbytes[r]], c, int(lo[r]), int(span[r]),
                               out[at: at + c])
            at += c
        return out

    @watched
    def mean_wire(self, vals: np.ndarray, fmt: WireFormat, signs: bool = False) -> np.ndarray:
        """The mean over ranks of float32 ``vals`` (n,), its values travelling in the 16-bit
        ``fmt`` (``arrays.half.WireFormat``); returns the means' 16-bit patterns (n,), the same on
        every rank. ``vals`` becomes what this rank's residual keeps: outside its own share, what
        rounding its values to 16 bits lost; inside, what rounding the mean lost (sum - P x mean).
        ``signs``: the patterns of each mean's sign instead (1, -1, 0 or NaN in ``fmt``; the same
        ``vals``), gathered as 2-bit codes (``sum_signs``).

        Share ``j`` (an equal split, as ``sum_identical``'s) is reduced on rank ``j``: every other
        rank sends it its 16-bit values (``Alltoallv``), rank ``j`` adds them to its own float32
        values in float32, in rank order, and the 16-bit means are gathered (``Allgatherv``).
        """
        n, p, me = vals.shape[0], self.size, self.rank
        counts, displs = self._shares(n, p)
        c, d = int(counts[me]), int(displs[me])
        means = np.empty(n, dtype=np.uint16)
        if p == 1 or n == 0:
            _kh.owner_mean(np.empty((1, n), np.uint16), vals, 0, 1, fmt.mode, fmt.table, means, vals)
            if signs:
                _signs.decode(_signs.encode(self._widened(means, fmt)), n, self._sign_patterns(fmt), means)
            return means
        sent = np.empty(n, dtype=np.uint16)
        _kh.wire_round(vals, fmt.mode, fmt.table, sent, d, d + c)
        recv = np.empty((p, c), dtype=np.uint16)
        self._to_owners(sent, counts, displs, recv)
        mine = np.empty(c, dtype=np.uint16)
        own = vals[d: d + c]
        _kh.owner_mean(recv, own, me, p, fmt.mode, fmt.table, mine, own)
        if signs:
            self._gather_signs(self._widened(mine, fmt), counts, displs, self._sign_patterns(fmt), means)
            return means
        self.comm.Allgatherv(mine, [means, (counts, displs)])
        self.bytes.allgather(counts, 2)
        return means

    def _runs(self, counts: Counts, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``reduce_scatter_mean``'s ``counts`` checked to cut ``n`` values into P runs: (counts,
        displacements), int64."""
        counts = np.asarray(counts, dtype=np.int64)
        if int(counts.sum()) != n or counts.shape[0] != self.size or (counts < 0).any():
            raise ValueError(f"reduce_scatter_mean: counts {counts.tolist()} must be P non-negative runs of {n}")
        return counts, _starts(counts)

    @watched
    def reduce_scatter_mean(self, vals: np.ndarray, counts: Counts, fmt: WireFormat | None = None) -> np.ndarray:
        """The sparse reduce-scatter: every rank's values of this rank's run, averaged, on this rank only.

        ``vals`` (n,) float32: this rank's values at the n positions of a union every rank holds in
        the same order, cut into P consecutive runs of ``counts`` (run ``r``: the positions in rank
        ``r``'s shard, ``shard_runs``; the same ``counts`` on every rank). Each rank sends each other
        rank its run (one ``Alltoallv``, exact counts), in float32 or, with ``fmt``
        (``arrays.half.WireFormat``), in 16 bits. Returns (``counts[rank]``,) float32: the sum in
        rank order (``exdyna_mpi/kernels/cpu_shard.py``), divided by P, the same bits under any MPI. ``vals``
        becomes what this rank's residual keeps: what the rounding to 16 bits lost outside its run,
        zero inside it and everywhere in float32.
        """
        n, p, me = vals.shape[0], self.size, self.rank
        counts, displs = self._runs(counts, n)
        c, d = int(counts[me]), int(displs[me])
        mine = np.empty(c, dtype=np.float32)
        own = vals[d: d + c]
        if fmt is None:
            recv = np.empty((p, c), dtype=np.float32)
            if p > 1:
                self._to_owners(vals, counts, displs, recv)
            _ks.owner_mean32(recv, own, me, p, mine)
            vals[:] = 0.0
            return mine
        sent = np.empty(n, dtype=np.uint16)
        _kh.wire_round(vals, fmt.mode, fmt.table, sent, d, d + c)
        recv16 = np.empty((p, c), dtype=np.uint16)
        if p > 1:
            self._to_owners(sent, counts, displs, recv16)
        _ks.owner_mean16(recv16, own, me, p, fmt.mode, fmt.table, mine)
        return mine

    @watched
    def mean_8bit(self, vals: np.ndarray, code: str, signs: bool = False) -> np.ndarray:
        """The mean over ranks of float32 ``vals`` (n,), its values travelling as 8-bit ``code``
        (``"int8"`` or ``"float8_e4m3fn"``) with a float32 scale per block of 128
        (``exdyna_mpi/kernels/cpu_8bit.py``); returns the means (n,) float32, the same bits on every rank.
        ``vals`` becomes what this rank's residual keeps: outside its own share, what the 8-bit
        rounding of its values lost; inside, what the rounding of the mean lost (sum - P x mean).
        ``signs``: the sign of each mean instead (1, -1, 0 or NaN), gathered as 2-bit codes, and the
        share keeps nothing (as ``sum_signs``).

        Share ``j`` (``sum_identical``'s equal split) is reduced on rank ``j``: every other rank sends
        it its 8-bit values (``Alltoallv``); rank ``j`` adds them to its own float32 values in
        float32, in rank order; the means travel back in the same code (``Allgatherv``), or as signs.
        """
        n, p, me = vals.shape[0], self.size, self.rank
        kind = _k8.CODES[code]
        table = _k8.TABLES[kind]
        counts, displs = self._shares(n, p)
        c, d = int(counts[me]), int(displs[me])
        own = vals[d: d + c]
        sums = np.empty(c, dtype=np.float32)
        size = np.array([_k8.share_bytes(int(x)) for x in counts], dtype=np.int64)
        if p > 1:
            scounts = size.copy()
            scounts[me] = 0
            rcounts = np.full(p, size[me], dtype=np.int64)
            rcounts[me] = 0
            send = np.empty(int(scounts.sum()), dtype=np.uint8)
            sdispls, rdispls = _starts(scounts), _starts(rcounts)
            for j in range(p):
                if j != me:
                    v = vals[displs[j]: displs[j] + counts[j]]
                    _k8.quantize(v, send[sdispls[j]: sdispls[j] + size[j]], v, kind, table)
            recv = np.empty(int(rcounts.sum()), dtype=np.uint8)
            self.comm.Alltoallv([send, (scounts, sdispls)], [recv, (rcounts, rdispls)])
            self.bytes.add(int(scounts.sum()), int(rcounts.sum()))
            _k8.owner_sum(recv, rdispls, own, me, p, table, sums)
        else:
            sums[:] = own
        mean = sums / np.float32(p)
        means = np.empty(n, dtype=np.float32)
        if signs:
            own[:] = 0
            if p == 1:
                return _signs.decode(_signs.encode(mean), n, _signs.sign_table(np.float32), means)
            self._gather_signs(mean, counts, displs, _signs.sign_table(np.float32), means)
            return means
        mine = np.empty(int(size[me]), dtype=np.uint8)
        _k8.quantize(mean, mine, own, kind, table)     # own: scratch here, overwritten below
        _k8.dequantize(mine, c, table, own)
        np.subtract(sums, np.float32(p) * own, out=own)   # sum - P x mean: the owner keeps it
        if p == 1:
            _k8.dequantize(mine, c, table, means)
            return means
        recv = np.empty(int(size.sum()), dtype=np.uint8)
        starts = _starts(size)
        self.comm.Allgatherv(mine, [recv, (size, starts)])
        self.bytes.allgather(size, 1)
        for r in range(p):
            _k8.dequantize(recv[starts[r]: starts[r] + size[r]], int(counts[r]), table,
                           means[displs[r]: displs[r] + counts[r]])
        return means

    @staticmethod
    def _widened(bits, fmt):
        """float32 values of 16-bit patterns ``bits`` in ``fmt``."""
        return widen(bits, fmt.name, np.empty(bits.shape, dtype=np.float32))

    @staticmethod
    def _sign_patterns(fmt):
        """The 16-bit patterns in ``fmt`` of the sign codes' values (0, 1, -1, NaN)."""
        return narrow(_signs.sign_table(np.float32), fmt.name).view(np.uint16)

    @watched
    def bcast_from(self, buf: Buffer, root: int) -> Buffer:
        """Broadcast ``buf`` in place from ``root``."""
        if self.size > 1:
            self.comm.Bcast(buf, root=root)
            n = buf.size * buf.itemsize
            root_sends = self.rank == root
            self.bytes.add(n if root_sends else 0, 0 if root_sends else n)
        return buf

    # ------------------------------------------------------------------ point-to-point (Ok-Topk)
    @watched
    def alltoall_counts(self, send_counts: Counts) -> np.ndarray:
        """``recv[s]`` = what rank s sends this rank: an int64 ``Alltoall`` of one word per pair."""
        send = np.ascontiguousarray(send_counts, dtype=np.int64)
        recv = np.empty(self.size, dtype=np.int64)
        self.comm.Alltoall(send, recv)
        self.bytes.add((self.size - 1) * 8, (self.size - 1) * 8)
        return recv

    @watched
    def rotating_rounds(self, parts: Parts, recv_counts: Counts, dtypes: Sequence[DTypeLike],
                        tags: Sequence[int], bucket: int = 4) -> Iterator[tuple[np.ndarray, ...]]:
        """P-1 rounds of point-to-point with destination rotation; yields what arrives, in round order.

        Round s (1..P-1) sends ``parts(dst)`` (a tuple of arrays, one per ``dtypes``/``tags`` entry)
        to ``dst = rank + s`` and receives ``recv_counts[src]`` elements of each from
        ``src = rank - s``. Rounds are posted ``bucket`` at a time (Isend/Irecv, one Waitall per
        bucket); after each bucket its rounds' received tuples are yielded in round order, so a
        caller that adds them up gets the same order, and the same bits, for any ``bucket``.
        """
        p, r = self.size, self.rank
        sizes = [np.dtype(d).itemsize for d in dtypes]
        for first in range(1, p, bucket):
            reqs, got = [], []
            for s in range(first, min(first + bucket, p)):
                dst, src = (r + s) % p, (r - s) % p
                n_in = int(recv_counts[src])
                bufs = tuple(np.empty(n_in, dtype=d) for d in dtypes)
                for b, tag in zip(bufs, tags):
                    reqs.append(self.comm.Irecv(b, source=src, tag=tag))
                out = parts(dst)
                for b, tag in zip(out, tags):
                    reqs.append(self.comm.Isend(b, dest=dst, tag=tag))
                n_out = out[0].shape[0] if out else 0
                self.bytes.add(int(n_out * sum(sizes)), int(n_in * sum(sizes)))
                got.append(bufs)
            MPI.Request.Waitall(reqs)
            yield from got
