"""Union-exchange baselines: every rank selects from its WHOLE accumulator; the union is summed.

One step on rank r (``TopK``, ``HardThreshold``, ``GaussianK``, ``DGC``):

1. ``acc = residual + grad``; the method picks a threshold ``thr_r`` from ``acc`` (its own rule);
   the local selection is ``S_r = {i : |acc[i]| >= thr_r}`` (ascending indices).
2. The count exchange carries ``|S_r|``, the error word and ``thr_r`` (so stats and tests see every
   rank's threshold); ``Allgatherv`` of the indices; ``U = unique(concat S_r)``.
3. Every rank's ``acc[U]`` is summed (``sum_identical``, bit-identical on all ranks); ``out[U] = sum / P``.
4. ``residual = acc`` with ``U`` zeroed (error feedback).

``|U|`` grows with P when the ranks pick different indices: the gradient build-up that ExDyna's
exclusive partitions avoid. ``stats.union`` and ``stats.build_up = |U| / k`` report it.
``CLTK`` differs only in step 1-2: the leader ``t mod P`` alone selects top-k and broadcasts.

``topk``, ``cltk`` and ``threshold`` take ``deadline_ms``/``max_loss``: step 2's ``Allgatherv`` becomes
the deadline-bounded, priority-ordered exchange (``sparsifiers/deadline.py``); ``U`` is then the
unique union of the chunks every rank received, and the deferred mass it reports is an upper bound
(an index two ranks selected is applied if either one's chunk arrived).

At ``density = 1`` every method selects everything (threshold 0) and ``out`` is the dense average.
"""
import math
import statistics

import numpy as np

from ...arrays import threshold_for
from ..capabilities import Capabilities
from ..base import Sparsifier
from ..config import Option
from ..deadline import OPTIONS as DEADLINE_OPTIONS, DeadlineOption
from ..reshard import fresh_deadline_state
from ..timing import timed
from ._common import (ThresholdSelection, float_to_word, kth_largest_magnitude, positive_floor, target_count,
                      word_to_float)


class UnionSparsifier(DeadlineOption, Sparsifier):
    """Base of the union-exchange methods; subclasses implement ``_threshold(acc)``."""

    CAPABILITIES = Capabilities(wire_half=True, wire_8bit=True, sign_output=True)

    def __init__(self, numel, density, comm=None, **kw):
        super().__init__(numel, density, comm, **kw)
        self.k = target_count(self.density, self.numel)
        self._index_dtype = np.dtype(np.int32) if self.numel < 2**31 else np.dtype(np.int64)

    # -- the rule a subclass supplies -------------------------------------------------------
    def _threshold(self, acc):
        """This rank's threshold for ``acc`` (pure: must not change state; a refusal may follow)."""
        raise NotImplementedError

    def _selects(self, t):
        """Whether this rank selects at step ``t`` (all do, except in CLTK)."""
        return True

    # -- the step ------------------------------------------------------------------------------
    def _local_threshold(self, acc):
        if self.density >= 1.0:
            return self._dtype.type(0)
        thr = self._threshold(acc)
        return threshold_for(max(float(thr), float(positive_floor(self._dtype))), self._dtype)

    def _exchange_indices(self, counts, t):
        spans = np.tile(np.array([0, self.numel], dtype=np.int64), (self.nranks, 1))
        return self.gather_selection(self.index_buffer(self.numel)[:counts[self.rank]], counts, spans)

    def report_size(self, step):
        return 1   # this rank's threshold, as a float64 bit pattern

    def select(self, step, grad, acc):
        count, thr = 0, 0.0
        bad = self.accumulate(grad, acc)
        if not bad and self._selects(step.t):
            thr = self._local_threshold(acc)
            count = self.ops.select_range(acc, 0, self.numel, thr, self.index_buffer(self.numel))
        return ThresholdSelection(acc, count, [float_to_word(thr)], bad, thr=thr)

    def combine(self, step, sel, words):
        counts = words.counts
        with timed(step.sec, "indices"):
            idx = self.index_buffer(self.numel)[:counts[self.rank]]
            gathered, report = self.gather_union(step.t, sel.acc, idx, counts,
                                                 lambda: self._exchange_indices(counts, step.t))
            # each rank's indices are ascending, so one rank's (or disjoint) lists need no unique
            union = gathered if np.count_nonzero(counts) <= 1 else np.unique(gathered)
        res = self.average_at(sel.acc, union, step.out, step.sec)
        selected = int(union.shape[0])
        return res, dict(counts=counts, selected=selected, density=selected / self.numel, threshold=float(sel.thr),
                         bounds=None, owned=None, thresholds=word_to_float(words.report[:, 0]).copy(), union=selected,
                         build_up=selected / self.k, **({"deadline": report} if report is not None else {}))

    def extra_state(self):
        return self._deadline_extra_state()

    def load_extra_state(self, d):
        self._deadline_load_state(d)

    def check_extra_state(self, d):
        self._deadline_check_state(d)

    def reshard_extra_state(self, dicts):
        """At another rank count: the deadline option's history fresh (it timed the old rank
        count's exchanges); nothing else is kept between steps."""
        return fresh_deadline_state(self)


class TopK(UnionSparsifier):
    """Exact local top-k of ``|acc|`` (O(n) selection, no sort), union exchange.

    The threshold is the k-th largest ``|acc|``; ties at it are all taken (so a rank may select a
    few more than k), and zeros never are.

    Example::

        >>> sp = exdyna_mpi.make("topk", numel, 0.01, comm)
        >>> avg = sp.step(flat_grad); sp.stats.union, sp.stats.build_up
    """

    name = "topk"
    OPTIONS = dict(DEADLINE_OPTIONS)

    def _threshold(self, acc):
        return kth_largest_magnitude(acc, self.k)


class CLTK(TopK):
    """Chief-leader top-k: rank ``t mod P`` picks its top-k; the others sum their acc there.

    The leader's indices go out by ``Bcast`` (its count rides in the count exchange), so the
    union is exactly the leader's top-k: no build-up, but the other ranks' large values wait.

    Example::

        >>> sp = exdyna_mpi.make("cltk", numel, 0.01, comm)
    """

    name = "cltk"

    def _selects(self, t):
        return self.rank == t % self.nranks

    def _exchange_indices(self, counts, t):
        leader = t % self.nranks
        buf = self.index_buffer(self.numel)[:counts[leader]]
        return self.exchange.bcast_from(buf, leader)


def _positive_float_or_none(v):
    if v is None:
        return
    try:
        ok = float(v) > 0 and math.isfinite(float(v))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError("must be a positive finite number or None")


class HardThreshold(UnionSparsifier):
    """A fixed hard threshold (default ``1/(2 sqrt k)``, the authors' ExDyna start), union exchange.

    The achieved density follows the gradients' scale: nothing steers it.

    Example::

        >>> sp = exdyna_mpi.make("threshold", numel, 0.01, comm, threshold=1e-3)
    """

    name = "threshold"
    OPTIONS = {"threshold": Option(None, _positive_float_or_none, "a fixed threshold instead of 1/(2 sqrt k)"),
               **DEADLINE_OPTIONS}

    def _threshold(self, acc):
        thr = self.options["threshold"]
        return 1.0 / (2.0 * math.sqrt(self.k)) if thr is None else float(thr)


class GaussianK(UnionSparsifier):
    """Gaussian-k: the threshold from a normal fit of ``acc``, then an adjust loop.

    ``thr = |mean| + std * z`` with ``z`` the normal quantile at ``1 - density/2`` (two-sided);
    then up to 20 times: x1.02 while the count is above 5k/4, /1.02 while below 3k/4 (the Ok-Topk
    repository's gaussiank). Heavy tails make the first guess select too much.

    Example::

        >>> sp = exdyna_mpi.make("gaussiank", numel, 0.01, comm)
    """

    name = "gaussiank"
    OPTIONS: dict[str, Option] = {}
    factor, tries = 1.02, 20

    def _threshold(self, acc):
        mean = float(np.mean(acc, dtype=np.float64))
        std = float(np.std(acc, dtype=np.float64))
        z = statistics.NormalDist().inv_cdf(1.0 - self.density / 2.0)
        thr = abs(mean) + std * z
        if thr <= 0:
            return kth_largest_magnitude(acc, self.k)
        lo, hi = 0.75 * self.k, 1.25 * self.k
        for _ in range(self.tries):
            c = self.ops.count_range(acc, 0, self.numel, threshold_for(thr, self._dtype))
            if c > hi:
                thr *= self.factor
            elif c < lo:
                thr /= self.factor
            else:
                break
        return thr


def _sample_ratio(v):
    if not (isinstance(v, float) and 0 < v <= 1):
        raise ValueError("must be a float in (0, 1]")


class DGC(UnionSparsifier):
    """Deep Gradient Compression's threshold: top-k on a strided ~1 % sample, then a correction loop.

    Sample: every ``stride``-th element (stride = 1/sample_ratio), starting at ``t mod stride``;
    threshold = the ``ceil(k * sample/numel)``-th largest sampled ``|acc|``. Correction (<= 10
    rounds, as in synxlin/deep-gradient-compression): above 1.3 k, exact top-k among the selected
    (the threshold becomes their k-th largest); below 0.8 k, lower the threshold by 0.8.

    Example::

        >>> sp = exdyna_mpi.make("dgc", numel, 0.01, comm, sample_ratio=0.01)
    """

    name = "dgc"
    OPTIONS = {"sample_ratio": Option(0.01, _sample_ratio, "share of the elements sampled for the threshold")}
    upper, lower, rounds = 1.3, 0.8, 10

    def _threshold(self, acc):
        stride = max(1, int(round(1.0 / self.options["sample_ratio"])))
        sample = acc[self.iteration % stride::stride]
        ks = max(1, int(math.ceil(self.k * sample.shape[0] / self.numel)))
        thr = float(kth_largest_magnitude(sample, ks))
        for _ in range(self.rounds):
            t = threshold_for(thr, self._dtype)
            c = self.ops.count_range(acc, 0, self.numel, t)
            if c > self.upper * self.k:
                sel = self.ops.empty(c, self._index_dtype)
                self.ops.select_range(acc, 0, self.numel, t, sel)
                return float(kth_largest_magnitude(acc[sel], self.k))
            if c < self.lower * self.k:
                thr *= self.lower
            else:
                break
        return thr
