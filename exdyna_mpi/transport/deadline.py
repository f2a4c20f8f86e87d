"""Transport for the deadline-bounded exchange (the DLCP analogue): every MPI call it makes.

``DeadlineTransport`` owns a private duplicate of the sparsifier's communicator and moves the
chunks of one step point-to-point, with versioned tags, under a deadline:

- ``start_round(t, sends, recvs)`` posts this step's receives (``Irecv``, every expected
  (sender, chunk)) and its sends (``Isend``, in the caller's order: highest priority first).
- ``run_until(rnd, deadline_at)`` makes progress (a ``Testsome`` loop with short naps) until every
  receive of the round has completed and every send of the round has been posted, or the deadline
  passes. ``run_until(rnd, None, need_recv=..., need_send=...)`` waits, with no deadline, for a
  given subset only (the chunks the loss bound makes mandatory).
- ``agree(words)``: the small collective (``Allgather`` of a few int64 words per rank).
- ``end_round(rnd)``: the round's unfinished receives stay posted, as *stale* requests.

Versioned tags: chunk ``c`` of step ``t`` travels with tag ``(t mod window) * n_chunks + c`` and is
matched by exact source and tag, so a message of step ``t`` can only ever complete step ``t``'s
receive. A late message completes its own stale receive in a later ``progress`` call and is
discarded there (``stale_received`` counts them): drained by tag version, never applied to a later
step. Before step ``t`` posts, every request of step ``t - window`` or older is completed (its
sends are posted at once), so a tag is never reused while its old receive is still posted.
``window = min(MAX_WINDOW, (TAG_UB + 1) // n_chunks)``.

No request leaks: ``pending_requests`` counts the posted requests not yet completed,
``scheduled_sends`` the sends the test hook holds back. ``flush()`` (collective in effect: every
rank calls it) posts every held-back send and completes every request; ``close()`` flushes and
frees the private communicator. Sends are never cancelled (``MPI_Cancel`` on sends is deprecated
in MPI-4), and receives need not be: every chunk of every step is sent exactly once, so every
posted receive is matched eventually.

Test hook (a slow or jittery link, injected without blocking the process): ``set_send_delay`` or
the environment variable ``EXDYNA_TEST_SEND_DELAY_MS="rank:ms[:jitter_ms[:per_chunk_ms[:dest]]]"``
holds back the chunk sends of ``rank`` (to every destination, or to ``dest`` only). Chunk ``c``
of a step is released ``ms + U(0, jitter_ms) + c * per_chunk_ms`` milliseconds after the step
posted it (``U`` drawn from a generator seeded by the step, the same on every run). A held-back
send is posted by the first ``progress`` call after its release time: the delayed rank keeps
taking part in the step (the deadline loop, the agreement, the value sum), only its chunk traffic
is late. Per-chunk delays model a slow link (the chunks trickle in priority order); a large
``ms`` models a stalled one.
"""
import os
import time

import numpy as np
from mpi4py import MPI

from .accounting import ByteCounter, CountsBytes
from .watchdog import waiting, watched

WORD = np.int64
MAX_WINDOW = 1 << 12
ENV_DELAY = "EXDYNA_TEST_SEND_DELAY_MS"
SPIN_POLLS = 5000


class SendDelay:
    """Hold back ``rank``'s chunk sends (to ``dest``, or to every destination when None)."""

    def __init__(self, rank, ms, jitter_ms=0.0, per_chunk_ms=0.0, dest=None, seed=0):
        self.rank, self.ms, self.jitter_ms = int(rank), float(ms), float(jitter_ms)
        self.per_chunk_ms, self.dest, self.seed = float(per_chunk_ms), dest, int(seed)
        if min(self.ms, self.jitter_ms, self.per_chunk_ms) < 0:
            raise ValueError("send delays must be >= 0 ms")

    @classmethod
    def parse(cls, text):
        """``"rank:ms[:jitter_ms[:per_chunk_ms[:dest]]]"`` (the environment variable's format)."""
        parts = [p.strip() for p in str(text).split(":")]
        if not 2 <= len(parts) <= 5 or not all(parts):
            raise ValueError(f"{ENV_DELAY} must be rank:ms[:jitter_ms[:per_chunk_ms[:dest]]], got {text!r}")
        nums = [float(p) for p in parts[1:4]]
        nums += [0.0] * (3 - len(nums))
        dest = int(parts[4]) if len(parts) == 5 else None
        return cls(int(parts[0]), *nums, dest=dest)

    def release(self, t, chunk, dest, posted_at):
        """When chunk ``chunk`` of step ``t`` to ``dest`` may leave (perf_counter seconds)."""
        if self.dest is not None and dest != self.dest:
            return posted_at
        jitter = 0.0
        if self.jitter_ms > 0:
            jitter = float(np.random.default_rng((self.seed, t)).uniform(0.0, self.jitter_ms))
        return posted_at + (self.ms + jitter + chunk * self.per_chunk_ms) / 1e3

    def __repr__(self):
        return (f"SendDelay(rank={self.rank}, ms={self.ms}, jitter_ms={self.jitter_ms}, "
                f"per_chunk_ms={self.per_chunk_ms}, dest={self.dest})")


_DELAY = {"set": False, "value": None}


def set_send_delay(delay):
    """Test hook: a ``SendDelay`` (or its text form) for every later step, or None for none.
    Call it on every rank with the same value (it only affects the rank it names)."""
    _DELAY["set"] = True
    _DELAY["value"] = SendDelay.parse(delay) if isinstance(delay, str) else delay


def send_delay():
    """The active ``SendDelay``: the one set by ``set_send_delay``, else the environment's, else None."""
    if _DELAY["set"]:
        return _DELAY["value"]
    text = os.environ.get(ENV_DELAY, "").strip()
    return SendDelay.parse(text) if text else None


class Round:
    """The receives of one step: ``keys[i] = (src, chunk)``, ``bufs``, ``reqs``, ``done``, ``done_at``
    (seconds after ``posted_at``). Its sends are in the transport's pending and held-back lists."""

    def __init__(self, t, posted_at):
        self.t, self.posted_at = t, posted_at
        self.keys, self.bufs, self.reqs = [], [], []
        self.done = np.zeros(0, bool)
        self.done_at = np.zeros(0)


def _nap(k):
    """Between polls: none for the first ``SPIN_POLLS`` (a Python sleep, even ``sleep(0)``, costs
    milliseconds on a loaded node; MPICH's own blocking waits spin too, and yield when
    ``MPIR_CVAR_CH4_PROGRESS_THROTTLE`` is set), then 100 us naps for long waits."""
    if k >= SPIN_POLLS:
        time.sleep(1e-4)


class DeadlineTransport(CountsBytes):
    """The MPI side of one deadline exchange: a private communicator, versioned point-to-point,
    the agreement collective, and the ``ByteCounter`` of what they moved (``bytes``; a receive
    counts when it completes, a stale one too). Host (NumPy) buffers only."""

    def __init__(self, comm, n_chunks):
        with waiting("Comm.Dup (the deadline exchange's communicator)", comm):
            self.comm = comm.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.n_chunks = int(n_chunks)
        tag_ub = self.comm.Get_attr(MPI.TAG_UB) or 32767
        self.window = max(2, min(MAX_WINDOW, (int(tag_ub) + 1) // self.n_chunks))
        self._pending = []     # [step, request, buffer, is_receive]
        self._scheduled = []   # [release time, step, dest, chunk, buffer]
        self.stale_received = 0
        self.bytes = ByteCounter(self.rank, self.size)
        self.delay = None

    # ------------------------------------------------------------------ bookkeeping
    @property
    def pending_requests(self):
        """Posted requests (sends and receives, of any step) not completed yet."""
        return len(self._pending)

    @property
    def scheduled_sends(self):
        """Sends the test hook still holds back."""
        return len(self._scheduled)

    def tag(self, t, chunk):
        return (t % self.window) * self.n_chunks + chunk

    def _isend(self, t, dest, chunk, buf):
        req = self.comm.Isend(buf, dest=dest, tag=self.tag(t, chunk))
        self._pending.append([t, req, buf, False])
        self.bytes.add(buf.nbytes, 0)

    def _post_due(self, now, upto_step=None):
        """Post the held-back sends whose time has come (all of steps <= ``upto_step`` if given)."""
        if not self._scheduled:
            return
        keep = []
        for item in self._scheduled:
            rel, t, dest, chunk, buf = item
            if rel <= now or (upto_step is not None and t <= upto_step):
                self._isend(t, dest, chunk, buf)
            else:
                keep.append(item)
        self._scheduled = keep

    def _test_pending(self):
        if not self._pending:
            return
        reqs = [p[1] for p in self._pending]
        idx = MPI.Request.Testsome(reqs)
        if not idx:
            return
        done = set(idx)
        for i in idx:
            if self._pending[i][3]:        # a stale receive completed: drained, data discarded
                self.stale_received += 1
                self.bytes.add(0, self._pending[i][2].nbytes)
        self._pending = [p for i, p in enumerate(self._pending) if i not in done]

    def progress(self, rnd=None):
        """Post due sends, test the round's receives and every older request."""
        now = time.perf_counter()
        self._post_due(now)
        self._test_pending()
        if rnd is not None and rnd.reqs and not rnd.done.all():
            idx = MPI.Request.Testsome(rnd.reqs)
            if idx:
                rnd.done[idx] = True
                rnd.done_at[idx] = now - rnd.posted_at
                for i in idx:
                    self.bytes.add(0, rnd.bufs[i].nbytes)

    @watched
    def _retire(self, upto_step):
        """Complete every request of steps <= ``upto_step`` (their held-back sends go out now)."""
        self._post_due(time.perf_counter(), upto_step)
        k = 0
        while any(p[0] <= upto_step for p in self._pending):
            self._test_pending()
            _nap(k)
            k += 1

    # ------------------------------------------------------------------ one step
    def start_round(self, t, sends, recvs):
        """Post step ``t``: ``recvs`` = [(src, chunk, n, dtype)], ``sends`` = [(dest, chunk, array)]
        in the order they should leave (priority first). Returns the ``Round``."""
        self._retire(t - self.window)
        now = time.perf_counter()
        rnd = Round(t, now)
        for src, chunk, n, dtype in recvs:
            buf = np.empty(int(n), dtype=dtype)
            rnd.keys.append((src, chunk))
            rnd.bufs.append(buf)
            rnd.reqs.append(self.comm.Irecv(buf, source=src, tag=self.tag(t, chunk)))
        rnd.done = np.zeros(len(rnd.reqs), bool)
        rnd.done_at = np.full(len(rnd.reqs), np.nan)
        delay = self.delay if self.delay is not None else send_delay()
        mine = delay is not None and delay.rank == self.rank
        for dest, chunk, buf in sends:
            rel = delay.release(t, chunk, dest, now) if mine else now
            if rel <= now:
                self._isend(t, dest, chunk, buf)
            else:
                self._scheduled.append([rel, t, dest, chunk, buf])
        return rnd

    def _held(self, t, chunks=None):
        return any(s[1] == t and (chunks is None or s[3] in chunks) for s in self._scheduled)

    @watched
    def run_until(self, rnd, deadline_at, need_recv=None, need_send=None):
        """Progress until the round is complete (every receive done, no send of it held back) or
        ``deadline_at`` (perf_counter seconds) passes. With ``deadline_at=None``: until the
        receives in the boolean mask ``need_recv`` are done and no send of a chunk in
        ``need_send`` is held back (no deadline: those chunks are mandatory)."""
        k = 0
        while True:
            self.progress(rnd)
            if deadline_at is None:
                if rnd.done[need_recv].all() and not self._held(rnd.t, need_send):
                    return
            else:
                if rnd.done.all() and not self._held(rnd.t):
                    return
                if time.perf_counter() >= deadline_at:
                    return
            _nap(k)
            k += 1

    def end_round(self, rnd):
        """The round's unfinished receives stay posted as stale requests (drained when they land)."""
        for i, req in enumerate(rnd.reqs):
            if not rnd.done[i]:
                self._pending.append([rnd.t, req, rnd.bufs[i], True])
        rnd.reqs = []

    @watched
    def agree(self, words):
        """Allgather a few int64 words per rank: a (P, len(words)) array, the same on every rank."""
        send = np.ascontiguousarray(words, dtype=WORD)
        recv = np.empty((self.size, send.shape[0]), dtype=WORD)
        self.comm.Allgather(send, recv)
        self.bytes.allgather(np.full(self.size, send.shape[0]), send.itemsize)
        return recv

    # ------------------------------------------------------------------ teardown
    @watched
    def flush(self):
        """Post every held-back send and complete every request (collective in effect)."""
        self._post_due(time.perf_counter(), upto_step=float("inf"))
        k = 0
        while self._pending:
            self._test_pending()
            _nap(k)
            k += 1

    def close(self):
        """``flush``, then free the private communicator (collective)."""
        if self.comm is None:
            return
        self.flush()
        self.comm.Free()
        self.comm = None
