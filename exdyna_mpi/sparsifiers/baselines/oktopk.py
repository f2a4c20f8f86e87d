"""Ok-Topk's sparse allreduce (Li & Hoefler, PPoPP'22; the authors' Shigangli/Ok-Topk allreducer.py), over mpi4py.

One step on rank r (t = step counter, k = density * numel):

1. ``acc = residual + grad``. Local threshold: the exact k-th largest ``|acc|`` every
   ``local_period`` steps, otherwise last step's threshold raised by x1.03 (<= 5 times) until at
   most 4k/3 values pass. ``L_r = {i : |acc[i]| >= thr_r}``.
2. Every ``region_period`` steps the regions are repartitioned so each holds about the same share
   of the selected values: rank r proposes the cuts ``L_r[j |L_r| / P]``, j = 1..P-1 (quantiles of
   its own selection); the new bounds are the integer mean of all ranks' cuts. The cuts ride in the
   count exchange (the first collective), so repartitioning costs no extra message.
3. Split and reduce: ``L_r`` is split by region; counts go by ``Alltoall``; then P-1 point-to-point
   rounds with destination rotation (round s: send to r+s, receive from r-s), posted in buckets of
   4 rounds; the region owner adds what it receives into a dense region buffer, its own part first
   and then in rotation order. Indices travel as int32 offsets inside the region (int64 only when
   numel >= 2^31), values in the gradient's dtype: two messages, never an index cast into floats.
   The local threshold is then adjusted: /1.012 below 2k/3 selected, x1.012 above 5k/4 (VGG).
4. Global selection: every ``global_period`` steps each owner sends ALL its reduced nonzeros and
   every rank takes the exact top-k of the gathered values (the global threshold is their k-th
   largest magnitude); otherwise each owner keeps ``|R| >= global_thr`` and the global threshold is
   adjusted /1.008 below 2k/3, x1.008 above 4k/3. Both by ``Allgatherv`` (indices, then values).
   An owner whose region holds a sum that is not finite (finite values that overflow) sends its
   count as ``-1 - count``: every rank sees it in the gathered counts, and the step is a non-finite
   one on every rank (``nonfinite`` policy), before anything is committed.
5. ``out[G] = value / P``; ``residual = acc`` zeroed on ``L_r ∩ G`` (only what entered the sum).

``out`` is bit-identical on every rank: each global value is summed on its owner alone and then
copied by ``Allgatherv``. The balancing step of the paper's second phase (commented out in the
authors' code) is not done: owners ``Allgatherv`` their own selections, as the released code does.

Byte accounting: the count exchange, Alltoall, point-to-point and Allgatherv bytes that cross this
rank's link, the same model for every call; all of it, and every MPI call, in ``transport.Exchange``.
"""
import math

import numpy as np

from ...arrays import threshold_for
from ...transport import point_to_point
from ..capabilities import Capabilities
from ..base import Sparsifier
from ..config import Option, nonneg_int, positive_int
from ..roles import SumNotFinite
from ..timing import timed
from ._common import (ThresholdSelection, float_to_word, kth_largest_magnitude, positive_floor, target_count,
                      word_to_float)

_TAG_IDX, _TAG_VAL = 0x4F6B, 0x4F6C
_BUCKET = 4


def equal_bounds(numel, nparts):
    """``[0, n/P, 2n/P, ..., n]`` (integer division), length P+1."""
    return (np.arange(nparts + 1, dtype=np.int64) * numel) // nparts


def proposed_cuts(selected, numel, nparts):
    """This rank's P-1 cut proposals: the positions ``selected[j * len // P]``, j = 1..P-1.

    ``selected`` is ascending. With nothing selected the equal cuts are proposed.
    """
    c = selected.shape[0]
    if c == 0:
        return equal_bounds(numel, nparts)[1:-1]
    j = np.arange(1, nparts, dtype=np.int64)
    return selected[(j * c) // nparts].astype(np.int64)


def region_bounds(cuts_by_rank, numel):
    """Region bounds from every rank's cuts (a (P, P-1) int array): ``[0, mean cuts..., numel]``.

    The mean is an integer floor of the sum / P, identical on every rank; each rank's cuts are
    ascending, so their mean is too.
    """
    cuts = np.asarray(cuts_by_rank, dtype=np.int64)
    nparts = cuts.shape[0]
    b = np.empty(nparts + 1, dtype=np.int64)
    b[0], b[-1] = 0, numel
    b[1:-1] = cuts.sum(axis=0) // nparts
    return b


class OkTopk(Sparsifier):
    """Ok-Topk: threshold-based top-k, balanced regions, sparse reduce-scatter, global top-k.

    Options (defaults from the authors' VGG runs): ``local_period=32``, ``global_period=32``,
    ``region_period=64``, ``warmup=0`` (dense steps before sparsifying; the authors use 512 on VGG).

    Example::

        >>> sp = exdyna_mpi.make("oktopk", numel, 0.01, comm)
        >>> avg = sp.step(flat_grad); sp.stats.global_threshold, sp.stats.bounds
    """

    name = "oktopk"
    #: host NumPy code in its step (region sorts and the sparse reduce-scatter): refused on a real CUDA device
    CAPABILITIES = Capabilities(device_step=False)
    OPTIONS = {
        "local_period": Option(32, positive_int, "steps between exact local top-k thresholds"),
        "global_period": Option(32, positive_int, "steps between exact global selections"),
        "region_period": Option(64, positive_int, "steps between repartitions of the reduction regions"),
        "warmup": Option(0, nonneg_int, "dense steps before sparsifying"),
    }
    local_raise, local_tries = 1.03, 5
    local_adjust, global_adjust = 1.012, 1.008

    def __init__(self, numel, density, comm=None, **kw):
        super().__init__(numel, density, comm, **kw)
        self.k = target_count(self.density, self.numel)
        self._index_dtype = np.dtype(np.int32) if self.numel < 2**31 else np.dtype(np.int64)
        self.local_thr = None
        self.global_thr = None
        self.bounds = equal_bounds(self.numel, self.nranks)

    # ------------------------------------------------------------------ local part (pure)
    def _local_threshold(self, acc, t, dense):
        """(threshold in acc's dtype, next step's proposal before the count adjustment)."""
        dt = self._dtype
        if dense:
            return dt.type(0)
        if t % self.options["local_period"] == 0 or self.local_thr is None:
            return threshold_for(float(kth_largest_magnitude(acc, self.k)), dt)
        thr = max(self.local_thr, float(positive_floor(dt)))
        for _ in range(self.local_tries):
            if self.ops.count_range(acc, 0, self.numel, threshold_for(thr, dt)) <= 4 * self.k / 3:
                break
            thr *= self.local_raise
        return threshold_for(thr, dt)

    # ------------------------------------------------------------------ communication
    def _split_reduce(self, sel, vals, bounds):
        """Send each region's part of (sel, vals) to its owner; return this rank's reduced region."""
        p, r = self.nranks, self.rank
        lo, hi = int(bounds[r]), int(bounds[r + 1])
        cut = np.searchsorted(sel, bounds)
        send_counts = np.diff(cut).astype(np.int64)
        # offsets inside the destination region, int32 (never cast into the value buffer)
        local = (sel - np.repeat(bounds[:-1], send_counts)).astype(self._index_dtype)
        region = np.zeros(hi - lo, dtype=self._dtype)
        touched = np.zeros(hi - lo, dtype=np.bool_)
        a, b = cut[r], cut[r + 1]
        region[local[a:b]] += vals[a:b]
        touched[local[a:b]] = True
        if p == 1:
            return region, touched
        p2p = point_to_point(self.exchange)
        recv_counts = p2p.alltoall_counts(send_counts)

        def parts(dst):
            return local[cut[dst]:cut[dst + 1]], vals[cut[dst]:cut[dst + 1]]

        rounds = p2p.rotating_rounds(parts, recv_counts, (self._index_dtype, self._dtype), (_TAG_IDX, _TAG_VAL),
                                     bucket=_BUCKET)
        # a sum that overflows is found (and refused on every rank) in _global_select: no warning here
        with np.errstate(over="ignore", invalid="ignore"):
            for ri, rv in rounds:  # in rotation order; one sender's offsets are distinct, so += is a scatter-add
                region[ri] += rv
                touched[ri] = True
        return region, touched

    def _global_select(self, region, touched, lo, exact, dense):
        """(G indices, G values, global threshold used, owner counts), identical on every rank."""
        cand = np.flatnonzero(touched)
        cvals = region[cand]
        # a region's sums live on its owner alone: a sum that is not finite travels as a negative
        # count (-1 - count) in the count words every rank gathers next, so all ranks see it at once
        overflow = not bool(np.isfinite(cvals).all())
        gthr = self.global_thr
        if not (exact or dense):
            keep = np.abs(cvals) >= threshold_for(gthr, self._dtype)
            cand, cvals = cand[keep], cvals[keep]
        mine = (cand + lo).astype(self._index_dtype)
        counts = self.exchange.agree([-1 - mine.shape[0] if overflow else mine.shape[0]])[:, 0].copy()
        if (counts < 0).any():
            owners = ", ".join(str(r) for r in np.flatnonzero(counts < 0))
            raise SumNotFinite(f"the sum over ranks is not finite in the regions of ranks {owners} "
                               f"(finite gradients whose sum overflows {self._dtype})")
        gi = self.exchange.allgatherv(mine, counts)
        gv = self.exchange.allgatherv(cvals, counts)
        if dense:
            return gi, gv, 0.0, counts
        if exact:
            if gv.shape[0] > self.k:
                gthr = float(kth_largest_magnitude(gv, self.k))
            else:  # fewer candidates than k: all pass; remember the smallest as the threshold
                mag = np.abs(gv)
                gthr = float(mag[mag > 0].min()) if (mag > 0).any() else float(positive_floor(self._dtype))
            keep = np.abs(gv) >= self._dtype.type(gthr)
            # what each owner contributed to the global set
            offs = np.concatenate(([0], np.cumsum(counts)))
            kept = np.concatenate(([0], np.cumsum(keep)))
            counts = kept[offs[1:]] - kept[offs[:-1]]
            gi, gv = gi[keep], gv[keep]
        return gi, gv, gthr, counts

    # ------------------------------------------------------------------ the step
    def _modes(self, t):
        """(dense, repartition, exact) of step ``t``."""
        dense = t < self.options["warmup"] or self.density >= 1.0
        repartition = not dense and t % self.options["region_period"] == 0
        exact = t % self.options["global_period"] == 0 or self.global_thr is None
        return dense, repartition, exact

    def report_size(self, step):
        """The local threshold, and the P-1 proposed cuts on a repartitioning step."""
        return 1 + (self.nranks - 1 if self._modes(step.t)[1] else 0)

    def select(self, step, grad, acc):
        dense, repartition, _ = self._modes(step.t)
        count, thr = 0, 0.0
        cuts = np.zeros(self.nranks - 1, dtype=np.int64)
        bad = self.accumulate(grad, acc)
        if not bad:
            idx = self.index_buffer(self.numel)
            thr = self._local_threshold(acc, step.t, dense)
            count = self.ops.select_range(acc, 0, self.numel, thr, idx)
            if repartition:
                cuts = proposed_cuts(idx[:count], self.numel, self.nranks)
        words = [float_to_word(thr)] + (cuts.tolist() if repartition else [])
        return ThresholdSelection(acc, count, words, bad, thr=thr)

    def combine(self, step, sel, words):
        t, sec, acc, thr, count = step.t, step.sec, sel.acc, sel.thr, sel.count
        dense, repartition, exact = self._modes(t)
        counts = words.counts   # report: the local threshold, then the proposed cuts
        bounds = region_bounds(words.report[:, 1:], self.numel) if repartition else self.bounds
        sel_idx = self.index_buffer(self.numel)[:count]
        with timed(sec, "split_reduce"):
            vals = self.ops.empty(count, self._dtype)
            self.ops.gather(acc, sel_idx, vals)
            region, touched = self._split_reduce(sel_idx, vals, bounds)
        with timed(sec, "allgatherv"):
            lo = int(bounds[self.rank])
            gi, gv, gthr, owner_counts = self._global_select(region, touched, lo, exact, dense)
            self.check_sums(gv, self.nranks)   # the global set's sums, the same on every rank
        with timed(sec, "scatter"):
            res = self.memory.commit(acc, step.out)
            self.ops.scatter(res, gi, gv / self._dtype.type(self.nranks))
            both = np.intersect1d(sel_idx, gi, assume_unique=True)
            self.ops.zero_at(self.memory.residual, both)

        # state for the next step (committed only now: a refused step changed nothing)
        k = self.k
        if not dense:
            nxt = float(thr)
            if count < 2 * k / 3:
                nxt /= self.local_adjust
            elif count > 5 * k / 4:
                nxt *= self.local_adjust
            self.local_thr = nxt
            if exact:
                self.global_thr = gthr
            elif gi.shape[0] < 2 * k / 3:
                self.global_thr = gthr / self.global_adjust
            elif gi.shape[0] > 4 * k / 3:
                self.global_thr = gthr * self.global_adjust
        self.bounds = bounds
        selected = int(gi.shape[0])
        return res, dict(
            counts=counts, selected=selected, density=selected / self.numel, threshold=float(thr),
            bounds=bounds.copy(), owned=np.arange(self.nranks), loads=owner_counts,
            thresholds=word_to_float(words.report[:, 0]).copy(), global_threshold=float(gthr),
            owner_counts=owner_counts, exact_global=bool(exact or dense), repartitioned=repartition)

    # ------------------------------------------------------------------ state
    def extra_state(self):
        return {"local_thr": self.local_thr, "global_thr": self.global_thr, "bounds": self.bounds.tolist()}

    def check_extra_state(self, d):
        for key in ("local_thr", "global_thr"):
            if d[key] is not None and not math.isfinite(float(d[key])):
                raise ValueError(f"{key} {d[key]!r} is not finite")
        b = np.asarray(d["bounds"], dtype=np.int64)
        if b.shape != (self.nranks + 1,) or b[0] != 0 or b[-1] != self.numel or (np.diff(b) < 0).any():
            raise ValueError("oktopk: state_dict bounds do not fit this sparsifier")

    def reshard_extra_state(self, dicts):
        """At another rank count: a fresh state, as at step 0. The local threshold is each old
        rank's own and the regions' bounds are per rank; with both thresholds None the next step
        computes them exactly (as its first step does), so nothing carried is needed."""
        return {"local_thr": None, "global_thr": None, "bounds": equal_bounds(self.numel, self.nranks).tolist()}

    def load_extra_state(self, d):
        self.check_extra_state(d)
        self.local_thr = d["local_thr"]
        self.global_thr = d["global_thr"]
        self.bounds = np.asarray(d["bounds"], dtype=np.int64)
