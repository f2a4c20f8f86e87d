"""Transport for WAGMA-SGD group model averaging: every MPI call ``GroupAverager`` makes.

Three kinds of exchange, each counted into the transport's one ``ByteCounter`` (``bytes``: what
crosses this rank's link):

- ``group_sum``: a blocking recursive-doubling sum over a set of rank bits (sync mode), on the
  averager's private communicator. One message per bit, sent with ``Sendrecv``; each message
  carries a small header (round, and per member: snapshot version, error code, error detail) in
  front of the payload, so input errors travel with the exchange. Recursive doubling yields the
  same bits on every member: step j adds two partial sums that the two partners hold with the
  same bits (lower rank's operand first; IEEE addition is commutative anyway).
- ``global_sum``: the sum over all ranks, bit-identical everywhere (Reduce_scatter + Allgatherv,
  ``Exchange.sum_identical``), and ``agree`` (Allgather of a few words).
- ``AsyncRounds``: wait-avoiding group rounds run by a progress thread on a second private
  communicator. See its docstring. A round's bytes travel in its ``RoundResult``: the main thread
  that takes the result adds them to the transport's counter (``bytes.add``).
"""
import threading
import time

import numpy as np
from mpi4py import MPI

from .accounting import ByteCounter, CountsBytes
from .exchange import Exchange
from .watchdog import waiting, watched

WORD = np.int64
#: Versioned tags: round v, recursive-doubling step j -> tag (v mod TAG_WINDOW) * TAG_STEPS + j.
TAG_STEPS = 32
TAG_WINDOW = 1 << 14
#: The largest sync period the wait-avoiding mode accepts: the rounds that can be in flight
#: between two ranks at once must have distinct tags (they span fewer than 2 * sync_every rounds).
MAX_SYNC_EVERY = TAG_WINDOW // 4


def tag_window(comm):
    """The version window this MPI's tags allow: TAG_WINDOW, halved until the largest tag fits
    ``MPI_TAG_UB`` (the standard promises only 32767; MPICH and Open MPI give 2**31 - 1, some
    fabrics' builds less). ``window // 4`` is then the largest wait-avoiding sync period."""
    ub = comm.Get_attr(MPI.TAG_UB)
    window = TAG_WINDOW
    while ub is not None and window > 4 and window * TAG_STEPS - 1 > ub:
        window //= 2
    return window

# Header words: [round, then for each group member m: version_m, errcode_m, errdetail_m].
_PER_MEMBER = 3


def head_words(group_size):
    return 1 + _PER_MEMBER * group_size


class Message:
    """One send or receive buffer: int64 header words, then the payload vector, in one block."""

    def __init__(self, numel, dtype, group_size):
        self.nhead = head_words(group_size)
        hb = self.nhead * 8
        self.buf = np.zeros(hb + numel * np.dtype(dtype).itemsize, dtype=np.uint8)
        self.head = self.buf[:hb].view(WORD)
        self.vec = self.buf[hb:].view(dtype)

    def reset_head(self, rnd):
        self.head[0] = rnd
        m = self.head[1:].reshape(-1, _PER_MEMBER)
        m[:, 0] = -1
        m[:, 1:] = 0

    def members(self):
        """(S, 3) view: version, error code, error detail of each group member."""
        return self.head[1:].reshape(-1, _PER_MEMBER)


def member_index(rank, bits):
    """This rank's index inside its group: its own values of ``bits``, bit j of the index = bits[j]."""
    return sum(((rank >> b) & 1) << j for j, b in enumerate(bits))


def _combine(mine, other, rank, partner):
    """Sum two partial sums into ``other`` (lower rank's operand first), merge the headers."""
    if rank < partner:
        np.add(mine.vec, other.vec, out=other.vec)
    else:
        np.add(other.vec, mine.vec, out=other.vec)
    np.maximum(mine.head[1:], other.head[1:], out=other.head[1:])


class GroupTransport(CountsBytes):
    """The MPI side of one ``GroupAverager``: private communicators and the ``ByteCounter`` of what
    they moved (``bytes``; its collectives run through an ``Exchange`` that counts into it)."""

    def __init__(self, comm):
        self.comm = comm
        self.tag_window = tag_window(comm)
        self.max_sync_every = self.tag_window // 4
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.bytes = ByteCounter(self.rank, self.size)
        self.xch = Exchange(comm, self.bytes)  # for the argument check, before any Dup
        self.private = None
        self.async_comm = None

    # -------------------------------------------------------------- setup and teardown
    @watched
    def agree(self, words):
        """Allgather a few int64 words per rank: a (P, len(words)) array, the same on every rank."""
        return self.xch.agree(words)

    @watched
    def gather_objects(self, obj):
        """Every rank's picklable ``obj`` as a list in rank order (error texts; not on the hot path)."""
        return self.comm.allgather(obj)

    def open(self, need_async):
        """Private duplicates of the user's communicator (collective): one for the blocking
        exchanges, one for the progress thread's wait-avoiding rounds."""
        with waiting("Comm.Dup (private communicators)", self.comm):
            self.private = self.comm.Dup()
            self.xch = Exchange(self.private, self.bytes)
            if need_async:
                self.async_comm = self.comm.Dup()

    def free(self):
        """Free the private communicators (collective; call only when nothing is in flight)."""
        for c in (self.private, self.async_comm):
            if c is not None and c != MPI.COMM_NULL:
                c.Free()
        self.private = self.async_comm = None

    # -------------------------------------------------------------- blocking exchanges
    @watched
    def group_sum(self, msg, spare, bits, rnd):
        """Recursive doubling over ``bits``: ``msg`` ends holding the group's sum and merged header,
        the same bits on every member. ``spare`` is a same-shaped receive buffer. Returns the
        message object that holds the result (``msg`` or ``spare``)."""
        comm = self.private
        for j, b in enumerate(bits):
            partner = self.rank ^ (1 << b)
            tag = (rnd % self.tag_window) * TAG_STEPS + j
            comm.Sendrecv(msg.buf, partner, tag, spare.buf, partner, tag)
            self.bytes.add(msg.buf.nbytes, spare.buf.nbytes)
            _combine(msg, spare, self.rank, partner)
            msg, spare = spare, msg
        return msg

    def global_sum(self, vec):
        """Sum of ``vec`` over all ranks, in place, bit-identical on every rank."""
        return self.xch.sum_identical(vec)


class RoundResult:
    __slots__ = ("sum", "members", "own", "own_version", "bytes_sent", "bytes_received", "seconds")


class AsyncRounds:
    """Wait-avoiding group rounds: a progress thread per rank, nonblocking point-to-point, Test loops.

    - The main thread *publishes* its vector (a copy under a lock, with its step index as version)
      and marks round v as *arrived*.
    - The progress thread runs rounds in increasing order. Round v starts when it is *activated*:
      this rank's main thread arrived at v, or any message for a round >= v is waiting (``Iprobe``;
      a round's messages are all consumed within the round, so any waiting message is for the
      current round or a later one). So the first member to arrive activates its group: its step-0
      message activates its partner, which then runs the doubling too, and so on; a member whose
      main thread is late (computing, sleeping) serves the round from its thread with the last
      snapshot its main thread published.
    - The round is recursive doubling over the phase's bits with ``Isend``/``Irecv`` and a ``Test``
      loop (short naps, so a polling thread does not starve computing ranks of CPU). Tags are
      versioned, ``(v mod tag_window) * TAG_STEPS + j``, and matched exactly, so a message of one
      round can never be taken for another. The result (sum, each member's snapshot version) waits
      in ``results`` until the main thread collects it.
    - Shutdown (``stop``) is collective in effect: every rank's thread finishes every round up to
      the last one any main thread arrived at (all ranks have called step equally often), then
      exits; every request it posted has completed, so nothing is pending.
    """

    def __init__(self, comm, rank, numel, dtype, first_version, vec, schedule_bits):
        self.comm = comm
        self.tag_window = tag_window(comm)
        self.rank = rank
        self.numel = numel
        self.dtype = np.dtype(dtype)
        self._bits_of = schedule_bits  # round -> tuple of bits, or None for a global step
        self._lock = threading.Lock()
        self._cv = threading.Condition()
        self._slot = np.array(vec, dtype=self.dtype, copy=True)
        self._slot_version = int(first_version)
        self._arrived = -1
        self._done = -1  # every group round <= _done is finished
        self._stop_after = None
        self._error = None
        self.results = {}
        self.pending = 0
        self._msgs = {}
        self._thread = threading.Thread(target=self._run, name="exdyna-wagma-progress", daemon=True)

    def start(self, first_round):
        self._next = first_round
        self._thread.start()

    # -------------------------------------------------------------- main thread side
    def publish(self, vec, version):
        with self._lock:
            self._slot[...] = vec
            self._slot_version = int(version)

    def arrive(self, rnd):
        with self._cv:
            self._arrived = max(self._arrived, rnd)

    @watched
    def wait_done(self, rnd):
        """Block until every group round <= ``rnd`` is finished (or the thread failed)."""
        with self._cv:
            while self._done < rnd and self._error is None and self._thread.is_alive():
                self._cv.wait(0.5)
            if self._error is not None:
                raise RuntimeError(f"wagma progress thread failed: {self._error!r}") from self._error
            if self._done < rnd:
                raise RuntimeError("wagma progress thread stopped before finishing round "
                                   f"{rnd} (done up to {self._done})")

    def take(self, rnd):
        self.wait_done(rnd)
        with self._cv:
            return self.results.pop(rnd)

    @watched
    def stop(self, last_round):
        """Finish every round <= ``last_round``, then end the thread. Returns pending requests (0)."""
        with self._cv:
            self._stop_after = last_round
            self._arrived = max(self._arrived, last_round)
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"wagma progress thread failed: {self._error!r}") from self._error
        self.results.clear()
        return self.pending

    @property
    def alive(self):
        return self._thread.is_alive()

    # -------------------------------------------------------------- progress thread side
    @staticmethod
    def _nap(k):
        time.sleep(0 if k < 8 else min(1e-3, 2e-5 * (k - 7)))

    def _run(self):
        try:
            v = self._next
            while True:
                bits = self._bits_of(v)
                if bits is None or not bits:
                    v += 1
                    continue
                k = 0
                while True:
                    with self._cv:
                        stop_after = self._stop_after
                        arrived = self._arrived
                    if stop_after is not None and v > stop_after:
                        return
                    if arrived >= v or self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG):
                        break
                    self._nap(k)
                    k += 1
                res = self._round(v, bits)
                with self._cv:
                    self.results[v] = res
                    self._done = v
                    self._cv.notify_all()
                v += 1
        except BaseException as exc:  # surfaced on the main thread by wait_done/stop
            with self._cv:
                self._error = exc
                self._cv.notify_all()

    def _buffers(self, s):
        if s not in self._msgs:
            self._msgs[s] = (Message(self.numel, self.dtype, s), Message(self.numel, self.dtype, s))
        return self._msgs[s]

    @watched
    def _wait(self, reqs):
        self.pending += len(reqs)
        k = 0
        while True:
            if MPI.Request.Testall(reqs):
                break
            self._nap(k)
            k += 1
        self.pending -= len(reqs)

    def _round(self, v, bits):
        t0 = time.perf_counter()
        s = 1 << len(bits)
        msg, spare = self._buffers(s)
        msg.reset_head(v)
        with self._lock:
            msg.vec[...] = self._slot
            ver = self._slot_version
        me = member_index(self.rank, bits)
        msg.members()[me, 0] = ver
        own = msg.vec.copy()
        sent = recv = 0
        for j, b in enumerate(bits):
            partner = self.rank ^ (1 << b)
            tag = (v % self.tag_window) * TAG_STEPS + j
            reqs = [self.comm.Irecv(spare.buf, partner, tag), self.comm.Isend(msg.buf, partner, tag)]
            self._wait(reqs)
            sent += msg.buf.nbytes
            recv += spare.buf.nbytes
            _combine(msg, spare, self.rank, partner)
            msg, spare = spare, msg
        r = RoundResult()
        r.sum = msg.vec.copy()
        r.members = msg.members()[:, 0].copy()
        r.own = own
        r.own_version = ver
        r.bytes_sent, r.bytes_received = sent, recv
        r.seconds = time.perf_counter() - t0
        return r
