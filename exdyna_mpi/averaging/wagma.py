"""WAGMA-SGD: wait-avoiding group model averaging (Li et al., IEEE TPDS 2021; specs/seed_systems.md §B).

    ga = exdyna_mpi.GroupAverager(numel, comm, group_size=2, sync_every=10, mode="wait_avoiding")
    w = ga.step(w)          # a flat parameter vector (any DLPack producer), same kind back
    ga.stats.kind, ga.stats.group, ga.stats.staleness, ga.stats.bytes_sent
    ga.close()              # collective; or use ``with GroupAverager(...) as ga:``

Schedule (pure functions below, checked by the tests). P ranks and the group size S are powers of
two, S <= P; g = log2 S, L = log2 P, R = ceil(L / g) phases (R = 1 when g = 0 or L = 0). Call t
(0-based) is a *global* average over all ranks when (t + 1) % sync_every == 0; otherwise a *group*
average in phase s = t mod R, over the ranks that differ from this one only in bits
[s*g, min((s+1)*g, L)), computed by recursive doubling over those bits in increasing order.
Group size 1 makes every group step the identity: that is local SGD with period sync_every.

mode="sync": a blocking group average. Every member ends with the same bits (recursive doubling
adds two partial sums that both partners hold bit-identically), equal to the group mean within
rounding; the global average is bit-identical on every rank (Reduce_scatter + Allgatherv).

mode="wait_avoiding": the group rounds run on a per-rank progress thread (``transport/group.py``, ``
AsyncRounds``; needs MPI_THREAD_MULTIPLE, mpi4py's default). The first member of a group to arrive
activates the round; a member whose main thread is late (still computing) takes part from its
thread with the last snapshot it published, so no rank waits for a straggler's computation, only
for its thread's reply. Each round returns the group sum of the snapshots used and their versions
(the step index at which each was published). A rank whose own snapshot was stale substitutes its
fresh vector for it: result = (group sum - own snapshot + own vector) / S, so its local progress is
kept (the authors' code instead adds the fresh vector once more and divides by S + 1); members whose
own snapshot was fresh get the same bits. ``stats.staleness`` = t - (oldest version used) <=
sync_every - 1: a global step is a blocking collective into which every rank publishes first, and no
rank starts a later group round before every rank has entered it. Tags are versioned by round,
every round's requests complete inside the round, and ``close()`` ends the thread after the last
round, so nothing is pending (``pending_requests`` counts live requests).

Input errors: the first step (after construction or ``load_state_dict``) and every global step check
the input collectively, so all ranks raise the same ``StepError`` and nothing changes. A sync-mode
group step carries the error words in the exchange's header: every member of that group raises the
same ``StepError`` and the round is used up (the vector is left unchanged), so the schedules stay in
step. A wait-avoiding group step refuses bad input on the offending rank only (a collective check
would wait for stragglers); nothing changes there and the rank is simply late for the round.
"""
from __future__ import annotations

import atexit
import time
import weakref
import zlib
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .. import transport
from ..arrays.dlpack import DTYPE_NAMES, FULL_DTYPES, as_input, check_vector, dtype_code
from ..sparsifiers.base import Stats
from .._errors import CollectiveError, InputCode, StepError, refusal
from ..transport.group import AsyncRounds, GroupTransport, Message, member_index

if TYPE_CHECKING:
    from mpi4py import MPI

#: ``(kind, phase, bits, group)`` of one call: ``"global"`` or ``"group"``, the phase (None on a
#: global step), the rank bits the group spans, and its sorted ranks
Schedule = tuple[str, int | None, tuple[int, ...], list[int]]

MODES = ("sync", "wait_avoiding")


def _one_refusal(rank, err, numel):
    """The cause of this rank's own refusal (a local step: no collective)."""
    return refusal([(rank, *err)], numel, DTYPE_NAMES, accepted=FULL_DTYPES).split(": ", 1)[1]


# ---------------------------------------------------------------------- schedule (pure)
def is_pow2(n: object) -> bool | np.bool_:   # np.bool_ for a NumPy integer
    return isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 1 and (n & (n - 1)) == 0


def n_phases(nranks: int, group_size: int) -> int:
    """R = ceil(log2 P / log2 S); 1 when there is nothing to rotate (P = 1 or S = 1)."""
    L, g = int(nranks).bit_length() - 1, int(group_size).bit_length() - 1
    return 1 if g == 0 or L == 0 else -(-L // g)


def step_kind(t: int, sync_every: int) -> str:
    return "global" if (t + 1) % sync_every == 0 else "group"


def phase_of(t: int, nranks: int, group_size: int) -> int:
    return t % n_phases(nranks, group_size)


def group_bits(phase: int, nranks: int, group_size: int) -> tuple[int, ...]:
    """The rank bits a group of ``phase`` spans: [phase*g, min((phase+1)*g, log2 P))."""
    L, g = int(nranks).bit_length() - 1, int(group_size).bit_length() - 1
    return tuple(range(phase * g, min((phase + 1) * g, L)))


def group_of(rank: int, t: int, nranks: int, group_size: int, sync_every: int) -> list[int]:
    """Sorted ranks that average with ``rank`` at call ``t`` (all ranks on a global step)."""
    if step_kind(t, sync_every) == "global":
        return list(range(nranks))
    bits = group_bits(phase_of(t, nranks, group_size), nranks, group_size)
    base = rank
    for b in bits:
        base &= ~(1 << b)
    out = []
    for i in range(1 << len(bits)):
        r = base
        for j, b in enumerate(bits):
            if (i >> j) & 1:
                r |= 1 << b
        out.append(r)
    return sorted(out)


def schedule(t: int, rank: int, nranks: int, group_size: int, sync_every: int) -> Schedule:
    """(kind, phase or None, bits, group) of call ``t`` on ``rank``."""
    kind = step_kind(t, sync_every)
    if kind == "global":
        return kind, None, tuple(range(int(nranks).bit_length() - 1)), list(range(nranks))
    s = phase_of(t, nranks, group_size)
    return kind, s, group_bits(s, nranks, group_size), group_of(rank, t, nranks, group_size, sync_every)


def _fingerprint(text):
    return (zlib.crc32(text.encode()) | (zlib.adler32(text.encode()) << 32)) & 0x7FFFFFFFFFFFFFFF


_LIVE: weakref.WeakSet[GroupAverager] = weakref.WeakSet()


@atexit.register
def _stop_threads_at_exit():  # pragma: no cover - exercised by the exit test in a subprocess
    for ga in list(_LIVE):
        ga._stop_thread()


class GroupAverager:
    """One rank's end of WAGMA group model averaging (see the module docstring).

    Construction, ``step``, ``average_all``, ``load_state_dict`` and ``close`` are collective over
    ``comm`` (``step`` in the sense that all ranks call it equally often); bad arguments on any rank
    raise the same ``ValueError`` on every rank.

    Args:
        numel: the flat parameter vector's length, the same on every rank.
        comm: the communicator (``MPI.COMM_WORLD`` when None).
        group_size: ranks per averaging group (a power of two, at most P; P a power of two).
        sync_every: steps between global averages.
        mode: ``"sync"`` or ``"wait_avoiding"`` (docs/wagma.md).

    Raises:
        ValueError: bad or disagreeing arguments on any rank (on every rank).
    """

    name = "wagma"

    def __init__(self, numel: int, comm: MPI.Comm | None = None, *, group_size: int = 2, sync_every: int = 10,
                 mode: Literal["sync", "wait_avoiding"] = "sync") -> None:
        comm = transport.world() if comm is None else comm
        self.tx = GroupTransport(comm)
        self.comm = comm
        self.rank, self.nranks = self.tx.rank, self.tx.size
        P = self.nranks
        errors = [p for p in [transport.watchdog.timeout_problem()] if p]   # the bound on every later wait
        if isinstance(numel, (bool, np.bool_)) or not isinstance(numel, (int, np.integer)) or numel <= 0:
            errors.append(f"numel must be a positive integer, got {numel!r}")
        if not is_pow2(P):
            errors.append(f"the communicator has {P} ranks; WAGMA needs a power of two")
        if not is_pow2(group_size):
            errors.append(f"group_size must be a power of two, got {group_size!r}")
        elif group_size > P:
            errors.append(f"group_size={group_size} is larger than the {P} ranks")
        if isinstance(sync_every, bool) or not isinstance(sync_every, (int, np.integer)) or sync_every < 1:
            errors.append(f"sync_every must be a positive integer, got {sync_every!r}")
        elif mode == "wait_avoiding" and sync_every > self.tx.max_sync_every:
            errors.append(f"sync_every must be <= {self.tx.max_sync_every} in wait_avoiding mode (this MPI's "
                          f"MPI_TAG_UB allows {self.tx.tag_window} tag versions), got {sync_every}")
        if mode not in MODES:
            errors.append(f"mode must be one of {MODES}, got {mode!r}")
        elif mode == "wait_avoiding" and P > 1 and not transport.thread_multiple():
            errors.append("mode='wait_avoiding' needs MPI initialised with MPI_THREAD_MULTIPLE")
        config = f"numel={numel!r} group_size={group_size!r} sync_every={sync_every!r} mode={mode!r}"
        got = transport.agree_problems(self.tx, "; ".join(errors), "GroupAverager: bad arguments",
                                       [_fingerprint(config)])
        if (got[:, 0] != got[0, 0]).any():
            configs = self.tx.gather_objects(config)
            raise CollectiveError("GroupAverager: ranks disagree on the arguments: "
                             + "; ".join(f"rank {r}: {c}" for r, c in enumerate(configs)))
        self.numel = int(numel)
        self.group_size = int(group_size)
        self.sync_every = int(sync_every)
        self.mode = mode
        self.n_phases = n_phases(P, self.group_size)
        self._threaded = mode == "wait_avoiding" and P > 1 and self.group_size > 1
        self.tx.open(self._threaded)
        self.tx.reset_counters()
        self.iteration = 0
        self._dtype: Any = None  # np.dtype, fixed by the first step (or a loaded state)
        self._checked = False  # the first step after construction/load checks collectively
        self._rounds: AsyncRounds | None = None
        self._msgs: dict[int, tuple[Message, Message]] = {}
        self._closed = False
        self.stats: Stats | None = None
        _LIVE.add(self)

    # ------------------------------------------------------------------ properties
    @property
    def dtype(self) -> np.dtype:
        return self._dtype or np.dtype(np.float32)

    @property
    def pending_requests(self) -> int:
        """MPI requests posted and not yet completed (0 between rounds and after ``close``)."""
        return 0 if self._rounds is None else self._rounds.pending

    @property
    def thread_alive(self) -> bool:
        return self._rounds is not None and self._rounds.alive

    def schedule(self, t: int | None = None) -> Schedule:
        """(kind, phase, bits, group) of call ``t`` (default: the next call) on this rank."""
        t = self.iteration if t is None else t
        return schedule(t, self.rank, self.nranks, self.group_size, self.sync_every)

    def _bits_of_round(self, v):
        if step_kind(v, self.sync_every) == "global":
            return None
        return group_bits(phase_of(v, self.nranks, self.group_size), self.nranks, self.group_size)

    # ------------------------------------------------------------------ input
    def _take(self, vec, out):
        inp = as_input(vec)
        err = check_vector(inp, self.numel, self._dtype, "cpu")
        out_arr = None
        if err is None and out is not None:
            o = as_input(out)
            e2 = check_vector(o, self.numel, np.dtype(inp.array.dtype), "cpu")
            if e2 is not None:
                err = (InputCode.BAD_OUT, 0)
            else:
                out_arr = o.array
        return inp, err, out_arr

    def _collective_check(self, inp, err):
        """Allgather error words and dtypes; raise the same StepError everywhere if any is bad."""
        code, detail = err if err is not None else (InputCode.OK, 0)
        dt = dtype_code(inp.dtype) if err is None else 0
        words = self.tx.agree([int(code), int(detail), dt])
        if words[:, 0].any():
            bad = [(r, int(words[r, 0]), int(words[r, 1])) for r in range(self.nranks) if words[r, 0]]
            raise StepError("GroupAverager: " + refusal(bad, self.numel, DTYPE_NAMES, accepted=FULL_DTYPES))
        if (words[:, 2] != words[0, 2]).any():
            names = ", ".join(f"rank {r}: {DTYPE_NAMES.get(int(d), '?')}" for r, d in enumerate(words[:, 2]))
            raise StepError(f"GroupAverager: step refused on all ranks, state unchanged: "
                            f"ranks pass different dtypes ({names})")

    def _sync_msgs(self, s):
        if s not in self._msgs:
            self._msgs[s] = (Message(self.numel, self._dtype, s), Message(self.numel, self._dtype, s))
        return self._msgs[s]

    # ------------------------------------------------------------------ step
    def step(self, vec: Any, out: Any = None) -> Any:
        """Average ``vec`` as the schedule says for this call; return the result as the same kind of
        object (``out``, if given, receives it: same dtype, may be ``vec`` itself)."""
        if self._closed:
            raise RuntimeError("GroupAverager: step() after close()")
        t0 = time.perf_counter()
        self.tx.reset_counters()
        t = self.iteration
        kind, phase, bits, group = self.schedule(t)
        inp, err, out_arr = self._take(vec, out)
        wait = 0.0
        staleness, versions = 0, None
        if not self._checked or kind == "global":
            self._collective_check(inp, err)
            if self._dtype is None:
                self._dtype = np.dtype(inp.array.dtype)
            self._checked = True
        a = inp.array
        if self._threaded and self._rounds is None:
            # Started right after a collective check, so no peer waits for a late rank's thread.
            self._start_thread(a, t)
        if out_arr is None:
            out_arr = np.empty(self.numel, dtype=self._dtype)
        if kind == "global":
            if self._rounds is not None:
                self._rounds.publish(a, t)
            tw = time.perf_counter()
            buf = np.array(a, dtype=self._dtype, copy=True)
            self.tx.global_sum(buf)
            wait = time.perf_counter() - tw
            np.divide(buf, self._dtype.type(self.nranks), out=out_arr)
        elif not bits:  # a group of one: the identity
            if err is not None:
                if self.mode == "sync":
                    self.iteration = t + 1  # used up, as on a larger group: schedules stay in step
                raise StepError(f"GroupAverager: group step {t} refused on rank {self.rank} (a group of "
                                "one), vector unchanged: "
                                + _one_refusal(self.rank, err, self.numel))
            out_arr[...] = a
        elif self.mode == "sync":
            tw = time.perf_counter()
            res = self._sync_group(a, err, bits, t)
            wait = time.perf_counter() - tw
            np.divide(res.vec, self._dtype.type(len(group)), out=out_arr)
        else:
            if err is not None:
                raise StepError("GroupAverager: step refused on rank "
                                f"{self.rank} only (wait-avoiding group step), state unchanged: "
                                + _one_refusal(self.rank, err, self.numel))
            tw = time.perf_counter()
            assert self._rounds is not None  # wait-avoiding on a group of two or more: started above
            self._rounds.publish(a, t)
            self._rounds.arrive(t)
            r = self._rounds.take(t)
            wait = time.perf_counter() - tw
            s = self._dtype.type(len(group))
            if r.own_version == t:
                np.divide(r.sum, s, out=out_arr)
            else:
                tmp = r.sum - r.own
                tmp += a
                np.divide(tmp, s, out=out_arr)
            self.tx.bytes.add(r.bytes_sent, r.bytes_received)
            staleness = int(t - r.members.min())
            versions = {rk: int(r.members[member_index(rk, bits)]) for rk in group}
        self.iteration = t + 1
        self.stats = Stats(iteration=t, kind=kind, phase=phase, group=group, staleness=staleness,
                           versions=versions, mode=self.mode, density=1.0, counts=None, selected=None,
                           threshold=None, bounds=None, owned=None, skipped=False,
                           bytes_sent=self.tx.bytes_sent, bytes_received=self.tx.bytes_received,
                           seconds={"exchange": wait, "total": time.perf_counter() - t0})
        return inp.wrap(out_arr)

    def _sync_group(self, a, err, bits, t):
        msg, spare = self._sync_msgs(1 << len(bits))
        msg.reset_head(t)
        me = member_index(self.rank, bits)
        if err is None:
            msg.vec[...] = a
            msg.members()[me, 0] = t
        else:
            msg.vec.fill(0)
            msg.members()[me, 1:] = (int(err[0]), int(err[1]))
        res = self.tx.group_sum(msg, spare, bits, t)
        m = res.members()
        if m[:, 1].any():
            self.iteration = t + 1  # the round is used up on the whole group: schedules stay in step
            group = sorted(self.schedule(t)[3])
            by_index = {member_index(rk, bits): rk for rk in group}
            bad = [(by_index[i], int(m[i, 1]), int(m[i, 2])) for i in range(m.shape[0]) if m[i, 1]]
            raise StepError(f"GroupAverager: group step {t} refused on its group {group}, vector "
                            "unchanged, round used up: "
                            + refusal(bad, self.numel, DTYPE_NAMES, accepted=FULL_DTYPES).split(": ", 1)[1])
        return res

    def _start_thread(self, a, t):
        self._rounds = AsyncRounds(self.tx.async_comm, self.rank, self.numel, self._dtype, t, a,
                                   self._bits_of_round)
        self._rounds.start(t)

    def average_all(self, vec: Any, out: Any = None) -> Any:
        """A global average outside the schedule (e.g. before evaluating). Collective; the call
        counter does not move."""
        inp, err, out_arr = self._take(vec, out)
        self._collective_check(inp, err)
        if self._dtype is None:
            self._dtype = np.dtype(inp.array.dtype)
        buf = np.array(inp.array, dtype=self._dtype, copy=True)
        self.tx.global_sum(buf)
        if out_arr is None:
            out_arr = np.empty(self.numel, dtype=self._dtype)
        np.divide(buf, self._dtype.type(self.nranks), out=out_arr)
        if self._rounds is not None:
            with self._rounds._lock:
                v = self._rounds._slot_version
            self._rounds.publish(out_arr, v)
        return inp.wrap(out_arr)

    # ------------------------------------------------------------------ lifecycle
    def _stop_thread(self):
        if self._rounds is not None:
            self._rounds.stop(self.iteration - 1)
            self._rounds = None

    def _agree_iteration(self, what):
        got = self.tx.agree([self.iteration])
        if (got[:, 0] != got[0, 0]).any():
            raise CollectiveError(f"GroupAverager: {what} refused: ranks have made different numbers of "
                             f"calls {got[:, 0].tolist()}")

    def close(self) -> None:
        """End the progress thread (after the last round any rank needs) and free the private
        communicators. Collective; idempotent."""
        if self._closed:
            return
        self._agree_iteration("close")
        self._stop_thread()
        self.tx.free()
        self._closed = True
        _LIVE.discard(self)

    def __enter__(self) -> GroupAverager:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "numel": self.numel, "nranks": self.nranks, "rank": self.rank,
                "group_size": self.group_size, "sync_every": self.sync_every, "mode": self.mode,
                "iteration": self.iteration, "dtype": None if self._dtype is None else self._dtype.str}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output (the schedule position). Collective, all or nothing:
        every rank checks its dict before one agreement; any rank's problem raises the same
        ``ValueError`` on every rank, naming the ranks, and no rank's state changes."""
        self._load(d, None)

    def _load(self, d: Any, problem: str | None) -> None:
        """``load_state_dict`` with a problem found by the caller on this rank (a wrapper's own
        state refused), which joins the agreement."""
        it, dtype = -1, None
        try:
            for key in ("name", "numel", "nranks", "rank", "group_size", "sync_every", "mode"):
                mine = getattr(self, key)
                if problem is None and d[key] != mine:
                    problem = f"state_dict has {key}={d[key]!r}, this averager has {mine!r}"
            it = int(d["iteration"])
            if it < 0 and problem is None:
                problem = f"state_dict has iteration={it}"
            dtype = None if d["dtype"] is None else np.dtype(d["dtype"])
            if dtype is not None and dtype.kind != "f" and problem is None:
                problem = f"state_dict has dtype={d['dtype']!r}, not a floating-point dtype"
        except (KeyError, TypeError, ValueError) as e:
            problem = problem or f"state_dict is malformed ({e!r})"
        got = transport.agree_problems(self.tx, problem,
                                       "GroupAverager: load_state_dict refused on all ranks, state unchanged",
                                       [it, self.iteration])
        if (got != got[0]).any():
            raise CollectiveError("GroupAverager: load_state_dict refused on all ranks, state unchanged: ranks hold "
                                  f"different iterations (loaded {got[:, 0].tolist()}, current {got[:, 1].tolist()})")
        self._stop_thread()
        self.iteration = it
        self._dtype = dtype
        self._msgs = {}
        self._checked = False
        self.stats = None
