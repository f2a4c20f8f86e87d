"""The deadline-bounded, priority-ordered index exchange with a loss bound (the DLCP analogue).

DLCP (arXiv 2008.08445) lets gradient traffic lose a bounded amount, prioritises packets by
gradient magnitude and balances load per packet, all inside switches. This is a software analogue
over MPI for the sparsifiers whose step ends in a *union average* (``Sparsifier.average_at``:
every rank contributes its own ``acc`` at the union of the ranks' selections, summed
bit-identically). It replaces one thing, the ``Allgatherv`` of the selected indices, and keeps the
value sum exactly as it is. One step, ``deadline_ms`` set (``ExDyna(..., deadline_ms=50,
max_loss=0.01)``):

1. **Chunks by priority.** Rank ``s`` orders its selected indices by ``|acc_s|``, largest first,
   and cuts them into ``CHUNKS`` chunks of near-equal length (the first ``count % CHUNKS`` one
   longer). Every rank knows every chunk's length from the counts of the step's first collective.
   The chunks go point-to-point (``transport.deadline``), highest priority first, to every other
   rank, with versioned tags.
2. **Deadline.** A rank stops waiting when it holds every chunk addressed to it (and has sent all
   of its own), or ``D`` ms after it posted, whichever is first. ``D`` is ``deadline_ms``, or with
   ``deadline_ms="auto"``: ``AUTO_START_MS`` until ``AUTO_MIN_SAMPLES`` steps are seen, then
   ``clamp(AUTO_FACTOR x quantile_{AUTO_QUANTILE}(last AUTO_WINDOW samples), AUTO_MIN_MS,
   AUTO_MAX_MS)``. A sample is computed from agreed words only (so ``D`` is the same on every
   rank): each rank reports the median over its senders of the time until a sender's chunks had
   all arrived (censored at the end of its wait: a typical link that misses the deadline raises
   the next one), and the sample is the largest of those, so the deadline covers every rank's
   typical link but not one slow link (at P=2 a rank has one sender, and a slow link is its
   typical link).
3. **Agreement.** One small collective (``Allgather``; per rank: that time, the masses
   ``sum |acc_s|`` of its own chunks as float64, and a bitmap of the (sender, chunk) pairs it
   holds). A chunk is *held by all* when every rank other than its sender has it.
4. **Bounded loss.** ``deferred = sum of the masses of the chunks not held by all``, as a fraction
   of the step's selected mass ``sum_s sum_{i in S_s} |acc_s[i]|``. If it exceeds ``max_loss``, the
   missing chunks are made mandatory, largest mass first (ties by sender, then chunk), until the
   rest fits the bound, and every rank waits (no deadline) for its mandatory receives and sends.
   All of this is computed from the agreed words, identically on every rank; no second agreement
   is needed, because every rank waits until it holds every mandatory chunk.
5. **Apply.** The applied set ``A_s`` of sender ``s`` is the union of its included chunks, sorted
   ascending; the union is ``A_0 ++ A_1 ++ ... ++ A_{P-1}`` (rank order) and goes to the caller's
   value sum (``average_at``: Reduce_scatter + Allgatherv, bit-identical on every rank). When every
   chunk is included, ``A_s`` is rank ``s``'s ascending selection and the union is exactly the
   ``Allgatherv`` result of the exact exchange: the output, the residual and every later step are
   bit-identical to the exact exchange (the controller and the partitions are fed the *selected*
   counts in both modes).
6. **Nothing is lost.** The residual is ``acc`` with the applied union zeroed on every rank, so a
   deferred element keeps its whole ``acc`` (the sender's selected value and every other rank's
   value there) in the residual: delayed, not dropped. Per rank, exactly (bit for bit):
   ``residual_before + grad == residual_after + where(i in A, acc, 0)``, and
   ``out[A] = sum_r acc_r[A] / P``, ``out = 0`` elsewhere.

A step refused after its exchange (a sum that is not finite, ``Sparsifier.check_sums``) takes back
what the exchange recorded (``DeadlineOption._undo_exchange``: the history the next deadline comes
from, the last report), so the next step's deadline is the one it would have been.

Late chunks: their receives stay posted under their own step's tag and complete (and are
discarded) whenever they land; they can never match a later step's receive
(``transport.deadline`` explains the tag window). ``close()`` completes everything
(collective); ``pending_requests`` counts what is in flight.

Sparsifiers gain the mode through ``DeadlineOption`` (a mixin: the options, the exchange built on
first use, ``close``, the state). ExDyna and MiCRO (disjoint selections) and the union baselines
``topk``, ``cltk`` and ``threshold`` use it. For the union baselines, selections overlap: the applied
union is ``unique(A_0 ++ ... ++ A_{P-1})``, an index selected by two senders is applied when
either sender's chunk is included, so the deferred mass reported is an upper bound of the mass
actually deferred; the conservation rule is the same.
"""
import time

import numpy as np

from ..transport.deadline import DeadlineTransport
from .config import Option

CHUNKS = 16
AUTO_START_MS = 100.0
AUTO_MIN_SAMPLES = 3
AUTO_WINDOW = 20
AUTO_QUANTILE = 0.9
AUTO_FACTOR = 3.0
AUTO_MIN_MS = 2.0
AUTO_MAX_MS = 2000.0


def check_deadline_ms(v):
    """``deadline_ms``'s ``Option.check``: None, ``"auto"`` or a positive finite number of ms."""
    if v is None or v == "auto":
        return
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)) \
            or not (np.isfinite(v) and v > 0):
        raise ValueError("must be None, 'auto' or a positive number of milliseconds")


def check_max_loss(v):
    """``max_loss``'s ``Option.check``: a number in [0, 1]."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)) \
            or not 0.0 <= float(v) <= 1.0:
        raise ValueError("must be a number in [0, 1]")


#: the options a sparsifier gains (``deadline_ms=None``: the exact exchange)
OPTIONS = {
    "deadline_ms": Option(None, check_deadline_ms, "a number of ms or 'auto': the deadline-bounded index exchange"),
    "max_loss": Option(0.01, check_max_loss, "with deadline_ms: the largest share of a step's selected mass deferred"),
}
#: their defaults
DEFAULTS = {k: o.default for k, o in OPTIONS.items()}


def public_options(options):
    """``options`` without the deadline options at their defaults (so the state of an exact-mode
    sparsifier is what it was before the deadline options existed)."""
    return {k: v for k, v in options.items() if not (k in DEFAULTS and v == DEFAULTS[k]
                                                       and type(v) is type(DEFAULTS[k]))}


def chunk_sizes(count, n_chunks=CHUNKS):
    base, extra = divmod(int(count), n_chunks)
    return np.array([base + (1 if c < extra else 0) for c in range(n_chunks)], dtype=np.int64)


def _pack_bits(bits):
    b = np.packbits(bits.astype(np.uint8), bitorder="little")
    b = np.concatenate([b, np.zeros((-b.size) % 8, np.uint8)])
    return b.view(np.int64)


def _unpack_bits(words, n):
    return np.unpackbits(np.ascontiguousarray(words, dtype=np.int64).view(np.uint8), bitorder="little")[:n].astype(bool)


class DeadlineExchange:
    """The deadline exchange of one sparsifier: chunking, agreement, loss bound, adaptive deadline.

    ``union(t, idx, vals, counts)`` is collective; ``close()`` is collective. Attributes for tests
    and jobs: ``pending_requests``, ``scheduled_sends``, ``stale_received``, ``applied`` (the last
    applied union, host), ``last`` (the last step's report, also ``stats.deadline``), ``history``.
    """

    def __init__(self, comm, deadline_ms, max_loss, n_chunks=CHUNKS):
        self.transport = DeadlineTransport(comm, n_chunks)
        self.rank, self.size = self.transport.rank, self.transport.size
        self.deadline_ms = deadline_ms
        self.max_loss = float(max_loss)
        self.n_chunks = n_chunks
        self.history = []
        self.applied = None
        self.last = None

    # ------------------------------------------------------------------ status
    @property
    def pending_requests(self):
        return self.transport.pending_requests

    @property
    def scheduled_sends(self):
        return self.transport.scheduled_sends

    @property
    def stale_received(self):
        return self.transport.stale_received

    def current_ms(self):
        """The deadline of the next step, in ms (the same on every rank)."""
        if self.deadline_ms != "auto":
            return float(self.deadline_ms)
        if len(self.history) < AUTO_MIN_SAMPLES:
            return AUTO_START_MS
        q = float(np.quantile(np.asarray(self.history[-AUTO_WINDOW:], dtype=np.float64), AUTO_QUANTILE))
        return float(min(max(AUTO_FACTOR * q, AUTO_MIN_MS), AUTO_MAX_MS))

    # ------------------------------------------------------------------ one step
    def union(self, t, idx, vals, counts):
        """Collective. ``idx``: this rank's selected indices (host, ascending), ``vals``: its
        ``acc`` there; ``counts``: every rank's count (agreed). Returns the applied union (host,
        rank order, each sender's part ascending); the step's report is in ``self.last``."""
        t_start = time.perf_counter()
        P, me, K = self.size, self.rank, self.n_chunks
        counts = np.asarray(counts, dtype=np.int64)
        self.transport.reset_counters()
        D = self.current_ms()
        sizes = np.stack([chunk_sizes(c, K) for c in counts])
        ends = np.cumsum(sizes[me])
        mag = np.abs(np.asarray(vals, dtype=np.float64))
        order = np.argsort(-mag, kind="stable")
        mine = [np.ascontiguousarray(idx[order[e - n:e]]) for n, e in zip(sizes[me], ends)]
        masses = np.array([mag[order[e - n:e]].sum() for n, e in zip(sizes[me], ends)], dtype=np.float64)
        sends = [((me + k) % P, c, mine[c]) for c in range(K) if sizes[me, c] for k in range(1, P)]
        recvs = [(s, c, sizes[s, c], idx.dtype) for s in range(P) if s != me for c in range(K) if sizes[s, c]]
        rnd = self.transport.start_round(t, sends, recvs)
        self.transport.run_until(rnd, rnd.posted_at + D / 1e3)
        wait_s = time.perf_counter() - rnd.posted_at

        # what this rank holds, and how long each sender's chunks took to land
        held = np.ones((P, K), bool)
        where = {}
        for i, (s, c) in enumerate(rnd.keys):
            held[s, c] = rnd.done[i]
            where[(s, c)] = i
        link = []
        for s in range(P):
            sel = [i for i, (src, _) in enumerate(rnd.keys) if src == s]
            if sel:
                link.append(np.max(rnd.done_at[sel]) if rnd.done[sel].all() else wait_s)
        link_us = int(round(float(np.median(link)) * 1e6)) if link else -1
        words = np.concatenate([[link_us], masses.view(np.int64), _pack_bits(held.ravel())])
        got = self.transport.agree(words)

        # the decision, from agreed words only: the same on every rank
        M = np.ascontiguousarray(got[:, 1:1 + K]).view(np.float64)
        have = _unpack_bits(np.bitwise_and.reduce(got[:, 1 + K:], axis=0), P * K).reshape(P, K)
        have |= sizes == 0
        total = float(M.sum())
        bound = self.max_loss * total
        include = have.copy()
        late = int((~have).sum())
        waited = False
        if float(M[~include].sum()) > bound:
            missing = sorted(zip(*np.nonzero(~include)), key=lambda sc: (-M[sc], sc[0], sc[1]))
            need = set()
            for s, c in missing:
                if float(M[~include].sum()) <= bound:
                    break
                include[s, c] = True
                need.add((int(s), int(c)))
            need_recv = np.array([k in need for k in rnd.keys], dtype=bool)
            need_send = {c for s, c in need if s == me}
            self.transport.run_until(rnd, None, need_recv=need_recv, need_send=need_send)
            waited = True
        self.transport.end_round(rnd)

        parts = []
        for s in range(P):
            cs = [c for c in range(K) if include[s, c] and sizes[s, c]]
            if s == me:
                got_s = [mine[c] for c in cs]
            else:
                got_s = [rnd.bufs[where[(s, c)]] for c in cs]
            part = np.sort(np.concatenate(got_s)) if got_s else np.empty(0, idx.dtype)
            parts.append(part.astype(idx.dtype, copy=False))
        union = np.concatenate(parts) if parts else np.empty(0, idx.dtype)
        self.applied = union

        deferred_mass = float(M[~include].sum())
        times = got[:, 0]
        times = times[times >= 0]
        if times.size:
            self.history.append(float(times.max()) / 1e3)
            del self.history[:-AUTO_WINDOW]
        self.last = {
            "ms": D, "deferred": deferred_mass / total if total > 0 else 0.0,
            "deferred_mass": deferred_mass, "selected_mass": total, "waited": waited,
            "late_chunks": late, "deferred_chunks": int((~include & (sizes > 0)).sum()),
            "applied": np.array([p.size for p in parts], dtype=np.int64),
            "seconds": time.perf_counter() - t_start,
            "stale_received": self.transport.stale_received,
            "pending_requests": self.transport.pending_requests,
        }
        return union

    def union_for(self, sp, t, acc, idx, counts):
        """``union`` on a sparsifier's buffers (any backend): host copies in, a backend union out;
        the bytes moved go into the sparsifier's exchange counters."""
        ops = sp.ops
        vals = ops.empty(idx.shape[0], acc.dtype)
        ops.gather(acc, idx, vals)
        union = self.union(t, np.asarray(ops.to_host(idx)), np.asarray(ops.to_host(vals)), counts)
        sp.exchange.bytes.add_from(self.transport.bytes)
        return ops.from_host(union)

    # ------------------------------------------------------------------ state and teardown
    def state(self):
        return {"history": list(self.history)}

    def load(self, d):
        """Restore ``state()`` output (collective: completes what is in flight first)."""
        self.transport.flush()
        self.history = [float(x) for x in (d or {}).get("history", [])]

    def flush(self):
        self.transport.flush()

    def close(self):
        """Complete every request and free the private communicator (collective)."""
        self.transport.close()


class DeadlineOption:
    """Mixin for a ``Sparsifier`` whose step ends in a union average: ``deadline_ms`` and
    ``max_loss`` (add ``OPTIONS`` to the class's), the exchange (``deadline``, built on the first
    step, collectively), ``close()``, and the state it carries across steps."""

    #: the deadline exchange, built on the first step when ``deadline_ms`` is set
    deadline = None
    _deadline_state: dict = {"history": []}
    #: (exchange, history, applied, last) before this step's exchange ran (``_undo_exchange``)
    _deadline_undo: tuple | None = None

    def _deadline_mode(self):
        """The deadline exchange (built on first use, collectively), or None in exact mode."""
        if self.deadline is None and self.options.get("deadline_ms") is not None:
            self.deadline = DeadlineExchange(self.comm, self.options["deadline_ms"], self.options["max_loss"])
            self.deadline.load(self._deadline_state)
        return self.deadline

    def gather_union(self, t, acc, idx, counts, exact):
        """The indices of every rank, in rank order: ``exact()`` in exact mode, else the deadline
        exchange's applied union. Returns ``(indices, report or None)``."""
        dl = self._deadline_mode()
        if dl is None:
            return exact(), None
        # the step may still be refused after the exchange (a sum that is not finite): _undo_exchange
        self._deadline_undo = (dl, list(dl.history), dl.applied, dl.last)
        return dl.union_for(self, t, acc, idx, counts), dl.last

    def _undo_exchange(self):
        """A step refused after its deadline exchange ran: the exchange's history (what later
        deadlines are computed from) and its last report are as they were before the step."""
        undo, self._deadline_undo = self._deadline_undo, None
        if undo is not None and undo[0] is self.deadline:
            _, self.deadline.history, self.deadline.applied, self.deadline.last = undo

    def close(self):
        """Collective: complete the deadline exchange's late messages and free its communicator
        (nothing to do in exact mode). The sparsifier can step again afterwards."""
        if self.deadline is not None:
            self._deadline_state = self.deadline.state()
            self.deadline.close()
            self.deadline = None

    def _deadline_extra_state(self):
        """State entries (``state_dict`` need not be collective, so nothing is built here)."""
        extra = {"options": public_options(self.options)}
        if self.options.get("deadline_ms") is not None:
            extra["deadline"] = self.deadline.state() if self.deadline is not None else self._deadline_state
        return extra

    def _deadline_check_state(self, d):
        if self.options.get("deadline_ms") is not None:
            [float(x) for x in (d.get("deadline") or {}).get("history", [])]

    def _deadline_load_state(self, d):
        if self.options.get("deadline_ms") is not None:
            self._deadline_state = d.get("deadline") or {"history": []}
            if self.deadline is not None:
                self.deadline.load(self._deadline_state)
