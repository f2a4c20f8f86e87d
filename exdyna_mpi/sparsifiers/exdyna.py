"""ExDyna and MiCRO: exclusive partitions, one owner per partition per step, a global threshold."""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, NamedTuple

import numpy as np

from .._errors import CollectiveError
from ..algorithm.controllers import CONTROLLERS, PassPlan, Window, make_controller
from ..algorithm.layout import Balance, BlockLayout, BlockLoad, EqualLayout, owners, partition_of
from ..algorithm.quota import quotas
from ..arrays import threshold_for
from ..arrays.ops import Marks
from . import deadline as _deadline, reshard as _reshard
from .base import Selection, Sparsifier
from .capabilities import Capabilities
from .config import Option, positive_int
from .timing import timed


def _max_imbalance(v):
    if v is None:
        return
    ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
    if not (ok and 0.0 <= float(v) < math.inf):
        raise ValueError("must be None or a number >= 0")


#: controllers that were removed, and why 'measured' replaces them (asking for one is a bad argument)
REMOVED_CONTROLLERS = {
    "histogram": "it forecast the next step's histogram of |acc|; the measured controller measures this step's",
}


def _controller_name(v):
    if isinstance(v, str) and v in REMOVED_CONTROLLERS:
        raise ValueError(f"{v!r} was removed ({REMOVED_CONTROLLERS[v]}); use controller='measured' (the default)")
    if v not in CONTROLLERS:
        raise ValueError(f"must be one of {sorted(CONTROLLERS)}")


#: ``controller``'s line, ExDyna's and MiCRO's (their defaults differ)
_CONTROLLER_DOC = "the threshold controller: 'measured', 'faithful' or 'symmetric' (docs/controller.md)"


class FinishAhead(NamedTuple):
    """What a one-rank device step is given to finish behind its measuring pass
    (``Ops.accumulate_measure_finish``): the index buffer, the output buffer, P, k and the fine
    window's tolerance (``MeasuredController.fine_tol``)."""

    idx: Any
    out: Any
    p: int
    k: int
    tol: float


@dataclasses.dataclass(eq=False)
class ExDynaStep(Selection):
    """One ExDyna step's state on this rank, from ``select`` through ``choose`` to ``combine`` (the
    template passes it on as the step's ``Selection``; ``count`` is this rank's selection in the
    ``index_buffer``).

    ``lo``, ``hi``: the range this rank owns this step. ``plan``: the controller's plan of the pass;
    from ``choose`` on, the resolved one (the step's threshold). ``local``: this rank's own words of
    a measuring pass (its histograms, before the sum). ``mark``: the level from which that pass kept
    the elements at or above it (None: it kept none); ``marks``: where the host keeps them (the
    sparsifier's ``Marks``; a device keeps its own). ``finish``: what the device was given to finish
    the step behind its pass (None: the host finishes it).
    """

    lo: int = 0
    hi: int = 0
    plan: PassPlan | None = None
    local: np.ndarray | None = None
    mark: float | None = None
    marks: Marks | None = None
    finish: FinishAhead | None = None


class _OwnedRange:
    """This step's ``acc`` over the owned range, passed to the controller's ``resolve`` for its zooms
    (``algorithm.controllers.OwnedRange``): reads through the step's marks, sums over ranks."""

    __slots__ = ("sp", "st")

    def __init__(self, sp: ExDyna, st: ExDynaStep):
        self.sp, self.st = sp, st

    def histogram(self, window: Window) -> np.ndarray:
        hist = np.zeros(window.buckets, dtype=np.int64)
        st = self.st
        self.sp.ops.hist_range(st.acc, st.lo, st.hi, window.shift, window.key0, hist, st.marks)
        return hist

    def sum(self, words: np.ndarray) -> np.ndarray:
        return self.sp.exchange.sum_words(words, self.sp._word_dtype())


class ExDyna(_deadline.DeadlineOption, Sparsifier):
    """ExDyna sparsification with exact ``Allgatherv`` exchange.

    One step on rank r: ``acc = residual + grad``; select ``|acc| >= threshold`` inside the
    partition rank r owns this step; all-gather the selected indices (disjoint across ranks); sum
    every rank's ``acc`` at the union; ``out`` is that sum / P at the union and 0 elsewhere;
    ``residual = acc`` with the union zeroed. Then the partition boundaries move (``balance``) and
    the controller sets the next threshold, from the gathered counts, identically on every rank.

    Example::

        >>> sp = exdyna_mpi.ExDyna(numel, density=0.001)        # collective over COMM_WORLD
        >>> avg = sp.step(flat_grad)                           # same kind and device as flat_grad
        >>> sp.stats.density, sp.stats.counts

    ``max_imbalance`` (None: off; a number, e.g. 0.05, with ``controller="measured"``): after the
    counts are gathered, a rank above ``(1 + max_imbalance)`` times the mean count keeps only its
    largest values up to that bound and the lowest ranks select as many more, their next largest
    (``algorithm/quota.py``): the total stays the threshold's and the slowest sender of the index
    exchange sends at most that much over the mean, but a rank's selection is then its quota's largest
    values, not ``|acc| >= threshold`` (``stats.quota_moved``: how many selections the step moved).
    ``balance`` moves the partition boundaries; the quotas bound what a step sends when the load moves
    faster than boundaries can follow (real gradients: docs/controller.md).

    ``deadline_ms`` (None: the exact exchange above; a number of ms, or ``"auto"``) and
    ``max_loss`` (default 0.01) choose the deadline-bounded, priority-ordered index exchange with a
    loss bound instead (``sparsifiers/deadline.py``, docs/deadline.md): selected mass that misses
    the deadline stays in the residual, at most ``max_loss`` of a step's selected mass; every rank
    applies the same union. ``sp.deadline`` is that exchange (None in exact mode), ``stats.deadline``
    its report; ``sp.close()`` (collective) completes its late messages.

    Args:
        numel, density, comm, device, nonfinite: as for ``Sparsifier``.
        controller: the threshold controller, ``"measured"`` (default), ``"faithful"``, ``"symmetric"``.
        balance: how the partition boundaries move, a ``Balance`` (``exdyna_mpi.sparsifiers``) or its
            spelling: ``True`` (``Balance.AUTO``, the controller's rule), ``False`` (``OFF``),
            ``"faithful"``, ``"adaptive"``, ``"blocks"``; kept as given in ``options`` (and the
            agreed ``config.text``), resolved once into ``rebalancing``.
        n_blocks, block_align: the fine-grained blocks the partitions are made of.
        max_imbalance: the per-rank quotas' bound (above), None for off.
        **unknown: ``deadline_ms``, ``max_loss``, ``wire_dtype``, ``output``, ``memory``, ``exchange``
            (docs/reference.md).

    Raises:
        CollectiveError: bad or disagreeing arguments on any rank (on every rank).
    """

    name = "exdyna"
    CAPABILITIES = Capabilities(wire_half=True, wire_8bit=True, sign_output=True, tuned_defaults=True)
    OPTIONS = {
        "controller": Option("measured", _controller_name, _CONTROLLER_DOC),
        "balance": Option(True, Balance.of, "how the partition boundaries follow the load (a Balance)"),
        "n_blocks": Option(1024, positive_int, "fine-grained blocks the partitions are made of"),
        "block_align": Option(32, positive_int, "block boundaries are multiples of this many elements"),
        "max_imbalance": Option(None, _max_imbalance, "per-rank quotas' bound over the mean count (None: off)"),
        **_deadline.OPTIONS,
    }

    def __init__(self, numel: int, density: float, comm: Any = None, *, controller: str = "measured",
                 balance: Balance | bool | str = True, n_blocks: int = 1024, block_align: int = 32,
                 max_imbalance: float | None = None, device: str = "auto", nonfinite: str = "raise",
                 **unknown: Any) -> None:
        super().__init__(numel, density, comm, device=device, nonfinite=nonfinite, controller=controller,
                         balance=balance, n_blocks=n_blocks, block_align=block_align,
                         max_imbalance=max_imbalance, **unknown)
        if max_imbalance is not None and controller != "measured":   # options agree on every rank: same error
            raise CollectiveError(f"exdyna: max_imbalance needs controller='measured' (it moves selections "
                             f"below the measured threshold), got controller={controller!r}")
        self._init_selector()

    def _init_selector(self):
        """What the selector keeps across steps (after the arguments were agreed)."""
        self.layout = self._make_layout()
        self.controller = make_controller(self.options["controller"], self.numel, self.density, self.nranks)
        self.rebalancing = Balance.of(self.options.get("balance", False), self.controller.balance_rule)
        self._marks = Marks()   # the host's marks of each measuring pass, passed to the select and zooms

    def _make_layout(self):
        o = self.options
        return BlockLayout(self.numel, self.nranks, o["n_blocks"], o["block_align"])

    @property
    def threshold(self) -> float:
        """The threshold the next step will use (the measured controller: the last one used, the
        centre of the next step's histogram windows; the next step measures its own)."""
        return self.controller.threshold

    def _range_at(self, t):
        """The element range this rank owns at step ``t`` (with today's bounds)."""
        return self.layout.range_of(partition_of(self.rank, t, self.nranks))

    # ------------------------------------------------------------------ the selector
    def sum_size(self, step):
        """A measuring controller's histograms, summed over ranks in the first collective (a
        count-only controller reports nothing beyond the count: ``report_size`` is 0)."""
        plan = self.controller.plan(step.t, step.dtype)   # (select asks for the same plan)
        return plan.n_words if plan.measure else 0

    def select(self, step, grad, acc):
        """acc = residual + grad; select ``|acc| >= threshold`` in the owned partition, in one pass.
        A measuring plan selects nothing here: the pass histograms ``|acc|`` over the owned range
        (this rank's ``sums``), ``choose`` selects."""
        lo, hi = self._range_at(step.t)
        plan = self.controller.plan(step.t, step.dtype)
        st = ExDynaStep(acc, lo=lo, hi=hi, plan=plan)
        ops, residual = self.ops, self.memory.residual
        idx = self.index_buffer(hi - lo)
        if not plan.measure:
            count, st.nonfinite = ops.accumulate_select(residual, grad, acc, lo, hi,
                                                        threshold_for(plan.threshold, plan.dtype), idx)
            st.count = int(count)
            return st
        # the measuring pass: acc and the owned range's histograms, no selection
        hist = np.zeros(plan.n_words, dtype=np.int64)
        nb = plan.hist.buckets
        coarse = (plan.hist.shift, plan.hist.key0, hist[:nb])
        fine = (plan.fine.shift, plan.fine.key0, hist[nb:]) if plan.fine else None
        st.mark, st.marks = self.controller.mark(plan), self._marks
        st.finish = self._finish_ahead(plan, st, step.out)
        if st.finish is not None:
            st.nonfinite = ops.accumulate_measure_finish(residual, grad, acc, lo, hi, coarse, fine, plan.stride,
                                                         st.mark, st.finish)
        else:
            st.nonfinite = ops.accumulate_measure(residual, grad, acc, lo, hi, coarse, fine, plan.stride, st.mark,
                                                  self.threads, st.marks)
        st.local = st.sums = hist
        return st

    def choose(self, step, sel: ExDynaStep, sums):   # type: ignore[override]  # its own select's
        """The threshold from the summed histograms (the controller may zoom: owned-range reads and
        small Allreduces), then select in the owned range (an O(N/P) read)."""
        st = sel
        plan = st.plan = self.controller.resolve(st.plan, sums, _OwnedRange(self, st))
        if st.finish is not None and plan.settled_fine:
            # fine_pick settled it, so the device did too (kernels.cuda._resolve_fine, the same
            # integer logic: tests/cudasim/test_finish_ahead.py) and finished the step behind the pass
            self.ops.finish_settled()
            st.count = plan.expected
            self.memory.output(st.finish.out, zeroed=True)
            st.words, st.done = (), True
            return st
        with timed(step.sec, "select_range"):
            thr = threshold_for(plan.threshold, plan.dtype)
            idx = self.index_buffer(st.hi - st.lo)
            expect = self.controller.local_count(plan, st.local) if st.mark is not None else None
            st.count = self.ops.select_marked(st.acc, st.lo, st.hi, thr, idx, expect,
                                              keep=self._quota_bound() is not None, marks=st.marks)
            if self.ops.device != "cpu":
                # grad is consumed: the device zeroes the output while the host goes on to the exchange.
                # Queued after the select, not before the resolve: a zoom's read (or a count the host
                # must read) would wait behind this O(N) memset (+1 ms a zoom step at 400M on an H100)
                self.memory.output(step.out)
        st.words = ()
        return st

    def combine(self, step, sel: ExDynaStep, words):   # type: ignore[override]  # its own select's
        t, st = step.t, sel
        plan = st.plan   # resolved by choose (a measuring plan), else the one the pass selected with
        assert plan is not None
        counts = words.counts
        bounds = self.layout.bounds()   # this step's, before any rebalancing
        bound = self._quota_bound() if plan.measure else None
        moved = 0
        if bound is not None:
            with timed(step.sec, "quota"):
                at_threshold = counts
                counts = self._meet_quota(step, st, counts, bound, bounds)
                moved = int(np.abs(counts - at_threshold).sum()) // 2
        with timed(step.sec, "indices"):
            idx = self.index_buffer(st.hi - st.lo)[:st.count]
            own = np.asarray(owners(t, self.nranks))
            spans = np.stack((bounds[own], bounds[own + 1]), axis=1)
            union, report = self.gather_union(t, st.acc, idx, counts,
                                              lambda: self.gather_selection(idx, counts, spans))
        load = None
        if self.rebalancing.needs_load and self.layout.moves_blocks():   # exact per-block counts of this
            with timed(step.sec, "balance"):   # step, from the union, where it lives (KBs move, not k)
                scale = None
                if moved:   # the load at the threshold, not the quotas' equal shares (docs/controller.md)
                    num, den = np.zeros(self.nranks, np.int64), np.ones(self.nranks, np.int64)
                    num[own], den[own] = at_threshold, np.maximum(counts, 1)
                    scale = (num, den)
                load = BlockLoad(self.ops.to_host(self.layout.block_counts(union, self.ops.xp)), scale)
        # the sum is checked in there before anything is committed: the layout and the controller move after it
        res = self.average_at(st.acc, union, step.out, step.sec, done=st.done)
        selected = int(counts.sum())
        stats = dict(counts=counts, selected=selected, density=selected / self.numel, threshold=plan.threshold,
                     bounds=bounds, owned=np.array(owners(t, self.nranks)), quota_moved=moved)
        if report is not None:
            stats["deadline"] = report
        self.controller.update(counts, plan)
        with timed(step.sec, "balance", add=True) if load is not None else contextlib.nullcontext():
            self.rebalancing.rebalance(self.layout, counts, t + 1, load)
        return res, stats

    def _finish_ahead(self, plan, st, out):
        """A ``FinishAhead`` when the device can finish this step behind its measuring pass
        without waiting for the host (``Ops.accumulate_measure_finish``): one rank (nothing to
        exchange), the measured controller with a fine window and marks, the exact exchange; else
        None. The host waits for the pass's words, not for the pass's whole step: on an H100 the
        host's resolve and launches after that wait were a third of a 100M-element step."""
        ops = self.ops
        if (self.nranks != 1 or self.output == "sign" or not plan.measure or plan.fine is None or st.mark is None
                or not ops.finishes_ahead or not self.controller.picks_fine
                or self._deadline_mode() is not None or self.numel >= 2**31):
            return None
        out = out if out is not None else ops.empty(self.numel, plan.dtype)
        return FinishAhead(self.index_buffer(st.hi - st.lo), out, 1, self.controller.k, self.controller.fine_tol(plan))

    def _quota_bound(self):
        """The ``max_imbalance`` in force (None: off, or one rank)."""
        v = self.options.get("max_imbalance")   # (MiCRO has no such option)
        return None if v is None or self.nranks < 2 else float(v)

    def _meet_quota(self, step, st, counts, bound, bounds):
        """This step's quotas from the gathered counts (the same on every rank); this rank selects
        exactly its own: its largest values, from below the threshold where its quota is larger."""
        capacity = np.diff(bounds)[owners(step.t, self.nranks)]
        want = quotas(counts, capacity, bound)
        mine, have = int(want[self.rank]), int(counts[self.rank])
        ops, acc, idx = self.ops, st.acc, self.index_buffer(st.hi - st.lo)
        if mine > have:   # a lower threshold from this rank's own words, then its `mine` largest
            plan = st.plan
            for edge, exact in self.controller.edges_below(plan, st.local, mine):
                got = ops.select_marked(acc, st.lo, st.hi, threshold_for(edge, plan.dtype), idx, exact,
                                        keep=True, marks=st.marks)
                if got >= mine:
                    have = got
                    break
        ops.release_marks(st.marks)
        if have > mine:
            self._keep_largest(acc, idx, have, mine)
        st.count = mine
        return want

    def _keep_largest(self, acc, idx, n, m):
        """``idx[:m]``: the ``m`` of ``idx[:n]`` with the largest ``|acc|`` (equal values: the lower
        index), in increasing index order, where they stay (O(n log n) over the selection only)."""
        xp = self.ops.xp
        sel = idx[:n]
        keys = xp.stack((sel.astype(xp.float64), -xp.abs(acc[sel]).astype(xp.float64)))
        order = xp.lexsort(keys)[:m]
        idx[:m] = xp.sort(sel[order])

    def extra_state(self):
        return {"controller_state": self.controller.state(), "layout": self.layout.state(),
                **self._deadline_extra_state()}

    def load_extra_state(self, d):
        self.controller.load_state(d["controller_state"])
        self.layout.load_state(d["layout"])
        self._deadline_load_state(d)

    def reshard_extra_state(self, dicts):
        """At another rank count: the controller's state (its threshold: a global one) from the
        first dict, every dict's equal; the layout's partitions this sparsifier's own for its rank
        count, with the per-block load (``blk_load``, independent of P) carried; the deadline
        option's history fresh (it timed the old rank count's exchanges)."""
        first = dicts[0]
        for d in dicts[1:]:
            for key, part in (("controller_state", None), ("layout", "blk_load")):
                a, b = first[key], d[key]
                if part is not None:
                    a, b = a.get(part), b.get(part)
                    a, b = None if a is None else list(a), None if b is None else list(b)
                if a != b:
                    raise ValueError(f"old rank {d['rank']}'s {key}{'.' + part if part else ''} differs from "
                                     f"old rank {first['rank']}'s: shared state must be equal on every old rank")
        layout = {k: v for k, v in self.layout.state().items() if k != "blk_load"}
        load = first["layout"].get("blk_load")
        if load is not None and "blk_part" in layout:
            layout["blk_load"] = [int(x) for x in load]
        return {"controller_state": dict(first["controller_state"]), "layout": layout,
                **_reshard.fresh_deadline_state(self)}

    def check_extra_state(self, d):
        thr = float(d["controller_state"]["threshold"])
        if not math.isfinite(thr) or thr < 0:
            raise ValueError(f"controller threshold {thr!r} is not a finite number >= 0")
        self.layout.check_state(d["layout"])
        self._deadline_check_state(d)


class MiCRO(ExDyna):
    """MiCRO: ExDyna without blocks or rebalancing (P fixed, equal element partitions).

    Args:
        numel, density, comm, device, nonfinite: as for ``Sparsifier``.
        controller: the threshold controller (``"faithful"``, MiCRO's own rule, by default).
        **unknown: ``deadline_ms``, ``max_loss``, ``wire_dtype``, ``output``, ``memory``, ``exchange``
            (docs/reference.md).

    Raises:
        CollectiveError: bad or disagreeing arguments on any rank (on every rank).
    """

    name = "micro"
    CAPABILITIES = Capabilities(wire_half=True, wire_8bit=True, sign_output=True)   # the defaults were tuned on ExDyna
    OPTIONS = {"controller": Option("faithful", _controller_name, _CONTROLLER_DOC), **_deadline.OPTIONS}

    def __init__(self, numel: int, density: float, comm: Any = None, *, controller: str = "faithful",
                 device: str = "auto", nonfinite: str = "raise", **unknown: Any) -> None:
        Sparsifier.__init__(self, numel, density, comm, device=device, nonfinite=nonfinite,
                            controller=controller, **unknown)
        self._init_selector()

    def _make_layout(self):
        return EqualLayout(self.numel, self.nranks)
