"""ExDyna and MiCRO: exclusive partitions, one owner per partition per step, a global threshold."""
import math
import time

import numpy as np

from ..algorithm.controllers import CONTROLLERS, make_controller
from ..algorithm.layout import BlockLayout, EqualLayout, owners, partition_of
from ..algorithm.quota import quotas
from ..arrays import threshold_for
from . import deadline as _deadline
from .base import Selection, Sparsifier
from .roles import StepWords


def _positive_int(v):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v <= 0:
        return "must be a positive integer"
    return None


def _is_bool(v):
    return None if isinstance(v, (bool, np.bool_)) else "must be True or False"


def _balance(v):
    ok = isinstance(v, (bool, np.bool_)) or v in ("faithful", "adaptive", "blocks")
    return None if ok else "must be True, False, 'faithful', 'adaptive' or 'blocks'"


def _max_imbalance(v):
    if v is None:
        return None
    ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
    return None if ok and 0.0 <= float(v) < math.inf else "must be None or a number >= 0"


def _controller_name(v):
    return None if v in CONTROLLERS else f"must be one of {sorted(CONTROLLERS)}"


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
    """

    name = "exdyna"
    OPTIONS = {
        "controller": ("measured", _controller_name),
        "balance": (True, _balance),
        "n_blocks": (1024, _positive_int),
        "block_align": (32, _positive_int),
        "max_imbalance": (None, _max_imbalance),
        **_deadline.OPTIONS,
    }

    def __init__(self, numel, density, comm=None, *, controller="measured", balance=True,
                 n_blocks=1024, block_align=32, max_imbalance=None, device="auto", nonfinite="raise", **unknown):
        super().__init__(numel, density, comm, device=device, nonfinite=nonfinite, controller=controller,
                         balance=balance, n_blocks=n_blocks, block_align=block_align,
                         max_imbalance=max_imbalance, **unknown)
        if max_imbalance is not None and controller != "measured":   # options agree on every rank: same error
            raise ValueError(f"exdyna: max_imbalance needs controller='measured' (it moves selections "
                             f"below the measured threshold), got controller={controller!r}")
        self.layout = self._make_layout()
        self.controller = make_controller(self.options["controller"], self.numel, self.density, self.nranks)
        self._index_dtype = np.dtype(np.int32) if self.numel < 2**31 else np.dtype(np.int64)
        self._idx = None

    def _make_layout(self):
        o = self.options
        return BlockLayout(self.numel, self.nranks, o["n_blocks"], o["block_align"])

    @property
    def threshold(self):
        """The threshold the next step will use (the measured controller: the last one used, the
        centre of the next step's histogram windows; the next step measures its own)."""
        return self.controller.threshold

    def _range_at(self, t):
        """The element range this rank owns at step ``t`` (with today's bounds)."""
        return self.layout.range_of(partition_of(self.rank, t, self.nranks))

    def _idx_buffer(self, n):
        if self._idx is None or self._idx.shape[0] < n:
            self._idx = self.ops.empty(max(n, 1), self._index_dtype)
        return self._idx

    # ------------------------------------------------------------------ the selector
    def _plan_of(self, step):
        """The controller's plan of ``step`` (the one ``select`` ran, when it did: asked again only
        for its shape, which ``choose`` does not change)."""
        plan = getattr(step, "plan", None)   # (a caller's own step object may have no such slot)
        return plan if plan is not None else self.controller.plan(step.t, step.dtype)

    def report_size(self, step):
        """The controller's words (its histograms, if any) ride in the first collective, gathered;
        a measuring controller's are summed instead (``sum_size``)."""
        plan = self._plan_of(step)
        return 0 if plan.measure else plan.n_words

    def sum_size(self, step):
        """A measuring controller's histograms, summed over ranks in the first collective."""
        plan = self._plan_of(step)
        return plan.n_words if plan.measure else 0

    def select(self, step, grad, acc):
        """acc = residual + grad; select ``|acc| >= threshold`` in the owned partition, in one pass
        that also fills whatever the controller's plan asks for. A measuring plan selects nothing
        here: the pass histograms ``|acc|`` over the owned range, ``choose`` selects."""
        lo, hi = self._range_at(step.t)
        fused = _FusedPass(self, grad, acc, lo, hi, step.sec, step.out)
        plan = step.plan = self.controller.plan(step.t, step.dtype)
        count, bad, words = fused.run(plan)
        if fused.plan.measure:
            return Selection(acc, 0, (), bad, sums=words, fused=fused)
        return Selection(acc, count, words, bad, fused=fused)

    def choose(self, step, sel, sums):
        """The threshold from the summed histograms (the controller may zoom: owned-range reads and
        small Allreduces), then select in the owned range (an O(N/P) read)."""
        fused = sel.fused
        plan, _ = self.controller.resolve(fused.plan, sums, fused)
        fused.plan = plan
        if fused.finish is not None and self.controller.settled_fine:
            # fine_pick settled it, so the device did too (kernels.cuda._resolve_fine, the same
            # integer logic: tests/cudasim/test_finish_ahead.py) and finished the step behind the pass
            self.ops.finish_settled()
            fused.count = sel.count = plan.expected
            self.memory.output(fused.finish[1], zeroed=True)
            sel.words, sel.done = (), True
            return sel
        t0 = time.perf_counter()
        thr = threshold_for(plan.threshold, plan.dtype)
        idx = self._idx_buffer(fused.hi - fused.lo)
        expect = self.controller.local_count(plan, fused.local) if fused.mark is not None else None
        fused.count = sel.count = self.ops.select_marked(sel.acc, fused.lo, fused.hi, thr, idx, expect,
                                                         keep=self._quota_bound() is not None)
        if self.ops.device != "cpu":
            # grad is consumed: the device zeroes the output while the host goes on to the exchange.
            # Queued after the select, not before the resolve: a zoom's read (or a count the host
            # must read) would wait behind this O(N) memset (+1 ms a zoom step at 400M on an H100)
            self.memory.output(step.out)
        step.sec["select_range"] = time.perf_counter() - t0
        sel.words = ()
        return sel

    def combine(self, step, sel, words):
        t, fused = step.t, sel.fused
        fused.counts = words[:, 0].copy()
        if fused.plan.measure:
            plan, cwords = fused.plan, None
        else:
            plan, cwords = self.controller.resolve(fused.plan, words[:, StepWords.N:], fused)
        counts = fused.counts
        bounds = self.layout.bounds()   # this step's, before any rebalancing
        bound = self._quota_bound() if plan.measure else None
        moved = 0
        if bound is not None:
            t0 = time.perf_counter()
            at_threshold = counts
            counts = fused.counts = self._meet_quota(step, fused, sel, counts, bound, bounds)
            moved = int(np.abs(counts - at_threshold).sum()) // 2
            step.sec["quota"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        idx = self._idx[:fused.count]
        union, report = self.gather_union(t, sel.acc, idx, counts, lambda: self.exchange.allgatherv(idx, counts))
        step.sec["indices"] = time.perf_counter() - t0
        bal = self.options.get("balance", False)
        if bal is True:   # True: the controller's own partner rule; the authors' for theirs
            bal = self.controller.balance_rule
        if bal == "blocks" and self.layout.moves_blocks():   # exact per-block counts of this step, from
            t0 = time.perf_counter()                          # the union, where it lives (KBs move, not k)
            counts_blk = self.ops.to_host(self.layout.block_counts(union, self.ops.xp))
            self.layout.rebalance_blocks(None, t + 1, counts=counts_blk)
            step.sec["balance"] = time.perf_counter() - t0
        res = self.average_at(sel.acc, union, step.out, step.sec, done=getattr(sel, "done", False))
        selected = int(counts.sum())
        stats = dict(counts=counts, selected=selected, density=selected / self.numel, threshold=plan.threshold,
                     bounds=bounds, owned=np.array(owners(t, self.nranks)), quota_moved=moved)
        if report is not None:
            stats["deadline"] = report
        self.controller.update(counts, cwords, plan)
        if bal == "faithful":
            self.layout.rebalance_faithful(counts, t + 1)
        elif bal == "adaptive":
            self.layout.rebalance_adaptive(counts, t + 1)
        return res, stats

    def _finish_ahead(self, plan, fused):
        """``(idx, out, p, k, tol)`` when the device can finish this step behind its measuring pass
        without waiting for the host (``Ops.accumulate_measure_finish``): one rank (nothing to
        exchange), the measured controller with a fine window and marks, the exact exchange; else
        None. The host waits for the pass's words, not for the pass's whole step: on an H100 the
        host's resolve and launches after that wait were a third of a 100M-element step."""
        ops = self.ops
        if (self.nranks != 1 or not plan.measure or plan.fine is None or fused.mark is None
                or not hasattr(ops, "accumulate_measure_finish") or not hasattr(self.controller, "fine_pick")
                or self._deadline_mode() is not None or self.numel >= 2**31):
            return None
        out = fused.out if fused.out is not None else ops.empty(self.numel, plan.dtype)
        return (self._idx_buffer(fused.hi - fused.lo), out, 1, self.controller.k, self.controller.fine_tol(plan))

    def _quota_bound(self):
        """The ``max_imbalance`` in force (None: off, or one rank)."""
        v = self.options.get("max_imbalance")   # (MiCRO has no such option)
        return None if v is None or self.nranks < 2 else float(v)

    def _meet_quota(self, step, fused, sel, counts, bound, bounds):
        """This step's quotas from the gathered counts (the same on every rank); this rank selects
        exactly its own: its largest values, from below the threshold where its quota is larger."""
        capacity = np.diff(bounds)[owners(step.t, self.nranks)]
        want = quotas(counts, capacity, bound)
        mine, have = int(want[self.rank]), int(counts[self.rank])
        ops, acc, idx = self.ops, sel.acc, self._idx
        if mine > have:   # a lower threshold from this rank's own words, then its `mine` largest
            plan = fused.plan
            for edge, exact in self.controller.edges_below(plan, fused.local, mine):
                got = ops.select_marked(acc, fused.lo, fused.hi, threshold_for(edge, plan.dtype), idx, exact,
                                        keep=True)
                if got >= mine:
                    have = got
                    break
        ops.release_marks()
        if have > mine:
            self._keep_largest(acc, idx, have, mine)
        fused.count = sel.count = mine
        return want

    def _keep_largest(self, acc, idx, n, m):
        """``idx[:m]``: the ``m`` of ``idx[:n]`` with the largest ``|acc|`` (equal values: the lower
        index), in increasing index order, where they stay (O(n log n) over the selection only)."""
        xp = self.ops.xp
        sel = idx[:n]
        keys = xp.stack((sel.astype(xp.float64), -xp.abs(acc[sel]).astype(xp.float64)))
        order = xp.lexsort(keys)[:m]
        idx[:m] = xp.sort(sel[order])

    def _extra_state(self):
        return {"controller_state": self.controller.state(), "layout": self.layout.state(),
                **self._deadline_extra_state()}

    def _load_extra_state(self, d):
        self.controller.load_state(d["controller_state"])
        self.layout.load_state(d["layout"])
        self._deadline_load_state(d)


class _FusedPass:
    """The per-element pass of one ExDyna step over the owned range ``[lo, hi)``, lent to the
    controller (``algorithm.controllers.FusedPass`` documents the interface)."""

    def __init__(self, sp, grad, acc, lo, hi, sec, out=None):
        self.sp, self.grad, self.acc, self.lo, self.hi, self.sec, self.out = sp, grad, acc, lo, hi, sec, out
        self.plan, self.count, self.counts = None, 0, None
        self.mark, self.local = None, None   # a measuring pass's mark and this rank's own words
        self.finish = None                   # what the device was given to finish the step with

    def run(self, plan):
        sp, ops = self.sp, self.sp.ops
        self.plan = plan
        idx = sp._idx_buffer(self.hi - self.lo)
        thr = threshold_for(plan.threshold, plan.dtype)
        hist = np.zeros(plan.n_words, dtype=np.int64)
        if plan.measure:   # the measuring pass: acc and the owned range's histograms, no selection
            nb = plan.hist[0]
            fine = (plan.fine[1], plan.fine[2], hist[nb:]) if plan.fine else None
            self.mark = sp.controller.mark(plan)
            coarse = (plan.hist[1], plan.hist[2], hist[:nb])
            self.finish = sp._finish_ahead(plan, self)
            if self.finish is not None:
                bad = ops.accumulate_measure_finish(sp.memory.residual, self.grad, self.acc, self.lo, self.hi, coarse,
                                                    fine, plan.stride, self.mark, self.finish)
            else:
                bad = ops.accumulate_measure(sp.memory.residual, self.grad, self.acc, self.lo, self.hi, coarse, fine,
                                             plan.stride, self.mark, sp.threads)
            self.local = hist
            count = 0
        elif plan.hist is None:
            count, bad = ops.accumulate_select(sp.memory.residual, self.grad, self.acc, self.lo, self.hi, thr, idx)
        else:   # the same pass also histograms |acc| (or the forecast) for the controller
            nb = plan.hist[0]
            fine = (plan.fine[1], plan.fine[2], hist[nb:]) if plan.fine else None
            forecast = sp._range_at(plan.forecast_step) if plan.forecast_step is not None else None
            count, bad = ops.accumulate_select_hist(sp.memory.residual, self.grad, self.acc, self.lo, self.hi, thr,
                                                    idx, plan.hist[1], plan.hist[2], hist[:nb], predict=plan.predict,
                                                    fine=fine, forecast=forecast, stride=plan.stride)
        self.count = int(count)
        # a measuring pass's words are summed as an array; the others join the gathered word list
        return self.count, bad, (hist if plan.measure else hist.tolist())

    def rerun(self, plan):
        count, _, words = self.run(plan)
        got = self.sp.exchange.agree(StepWords.make(count, None, 0) + words)
        self.counts = got[:, 0].copy()
        return got[:, StepWords.N:]

    def histogram(self, spec):
        hist = np.zeros(spec[0], dtype=np.int64)
        self.sp.ops.hist_range(self.acc, self.lo, self.hi, spec[1], spec[2], hist)
        return hist

    def agree(self, words):
        return self.sp.exchange.agree(words)

    def sum(self, words):
        return self.sp._host_exchange().sum_words(words, self.sp._word_dtype())


class MiCRO(ExDyna):
    """MiCRO: ExDyna without blocks or rebalancing (P fixed, equal element partitions)."""

    name = "micro"
    OPTIONS = {"controller": ("faithful", _controller_name), **_deadline.OPTIONS}

    def __init__(self, numel, density, comm=None, *, controller="faithful", device="auto",
                 nonfinite="raise", **unknown):
        Sparsifier.__init__(self, numel, density, comm, device=device, nonfinite=nonfinite,
                            controller=controller, **unknown)
        self.layout = self._make_layout()
        self.controller = make_controller(self.options["controller"], self.numel, self.density, self.nranks)
        self._index_dtype = np.dtype(np.int32) if self.numel < 2**31 else np.dtype(np.int64)
        self._idx = None

    def _make_layout(self):
        return EqualLayout(self.numel, self.nranks)
