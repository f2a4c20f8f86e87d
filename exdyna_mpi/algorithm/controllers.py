"""Algorithm layer: threshold controllers, behind one protocol.

A controller owns the global threshold. It sees only what every rank sees (the gathered words of
the step's first collective), so every rank computes the same threshold sequence. The protocol
(``Controller``), one signature for every controller:

- ``plan(t, dtype) -> PassPlan``: what it needs from step ``t``'s fused pass (the threshold the pass
  selects with, and the histograms, if any, the same pass should fill);
- ``PassPlan.n_words``: the words it adds to the first collective (those histograms);
- ``resolve(plan, words, fused) -> (plan, words)``: after the first collective; a controller may
  need more before the step can select (the histogram controller at step 0: a refined histogram,
  one extra collective, then a second pass, all through ``fused``, the ``FusedPass`` the sparsifier
  lends it). The returned plan and words are those of the pass that made the step's selection;
- ``update(counts, words=None, plan=None)``: set the next threshold from the gathered counts
  ``(P,)`` and its words ``(P, plan.n_words)``;
- ``state()`` / ``load_state(d)``; ``balance_rule``: the partner rule ``balance=True`` means.

Pure host logic: per-element work happens only inside the ``FusedPass`` (the sparsifier's ops).
"""
import math
import struct
import time

import numpy as np


def target_count(density, numel):
    """k = int(density * numel), at least 1 (the authors' code divides by it)."""
    return max(1, int(density * numel))


_EDGES = {}   # (dtype char, shift, key0, nb) -> _edges(...), read-only
_I32, _F32, _I64, _F64 = (struct.Struct(f) for f in ("<i", "<f", "<q", "<d"))   # an edge's bits


class PassPlan:
    """What a controller asks of step ``t``'s fused pass (accumulate + select in the owned range).

    ``threshold``: the level the pass selects with (``inf``: select nothing); ``hist``/``fine``:
    ``(n_buckets, shift, key0)`` of the coarse and fine histograms to fill, or None; ``predict``:
    histogram the forecast ``|p|`` instead of ``|acc|``; ``forecast_step``: histogram the range this
    rank owns at that step (None: the range it selects in); ``stride``: coarse histogram stride.
    """

    __slots__ = ("t", "dtype", "threshold", "hist", "fine", "predict", "forecast_step", "stride", "measure",
                 "expected")

    def __init__(self, t, dtype, threshold, hist=None, fine=None, predict=False, forecast_step=None, stride=1,
                 measure=False):
        self.t, self.dtype, self.threshold = t, np.dtype(dtype), threshold
        self.hist, self.fine, self.predict = hist, fine, predict
        self.forecast_step, self.stride = forecast_step, stride
        # measure: the pass only accumulates and histograms |acc| over the owned range; the words
        # are summed over ranks (one Allreduce) and ``resolve`` sets the threshold from them
        self.measure = measure
        self.expected = None    # measure: the total count the chosen threshold selects (exact)

    @property
    def n_words(self):
        """Words the pass adds to the first collective: the coarse then the fine histogram."""
        return (self.hist[0] if self.hist else 0) + (self.fine[0] if self.fine else 0)

    def split(self, words):
        """``words`` (P, n_words) as (coarse, fine) histograms (None where not asked for)."""
        if self.hist is None:
            return None, None
        nb = self.hist[0]
        return words[:, :nb], (words[:, nb:] if self.fine else None)


class FusedPass:
    """What a sparsifier lends its controller for one step (documentation of the interface).

    ``run(plan) -> (count, nonfinite, words)`` the pass; ``rerun(plan) -> words``: the pass again on
    the same ``acc`` and a second exchange of the new count and words (``counts`` then holds the
    gathered counts); ``histogram(spec) -> host int64 array`` of ``|acc|`` over the owned range;
    ``agree(words) -> (P, n)``: one extra small collective; ``sum(words) -> (n,)``: one extra small
    Allreduce (the same exact integer sums on every rank); ``sec``: phase timings.
    """


class Controller:
    """The controller protocol (see the module docstring). Subclasses set ``threshold`` and
    implement ``update``; the defaults suit controllers that need only the counts."""

    name = "base"
    balance_rule = "faithful"    # what balance=True means with this controller
    threshold = 0.0

    def plan(self, t, dtype):
        return PassPlan(t, dtype, self.threshold)

    def resolve(self, plan, words, fused):
        return plan, words

    def mark(self, plan):   # only measuring plans (MeasuredController) use these two
        return None

    def local_count(self, plan, words):
        return None

    def update(self, counts_prev, words=None, plan=None):  # pragma: no cover - abstract
        raise NotImplementedError

    def state(self):
        return {"threshold": self.threshold}

    def load_state(self, d):
        self.threshold = float(d["threshold"])


class FaithfulController(Controller):
    """The authors' rule (kljp/exdyna, cnn-lstm/gradient_reducers.py): thr0 = 1/(2 sqrt k), then x1.005 / x1.00125 / x0.995."""

    name = "faithful"
    up, creep, down = 1.005, 1.00125, 0.995
    band_hi, band_lo = 1.1, 0.909

    def __init__(self, numel, density):
        self.k = target_count(density, numel)
        self.threshold = 1.0 / (2.0 * math.sqrt(self.k))

    def update(self, counts_prev, words=None, plan=None):
        r = sum(int(c) for c in counts_prev) / self.k
        if r > self.band_hi:
            self.threshold *= self.up
        elif r > self.band_lo:
            self.threshold *= self.creep
        else:
            self.threshold *= self.down


class SymmetricController(FaithfulController):
    """The rule the authors' dead branch suggests: x1.00125 above target, x0.9987 below, inside the band."""

    name = "symmetric"

    def update(self, counts_prev, words=None, plan=None):
        r = sum(int(c) for c in counts_prev) / self.k
        if r > self.band_hi:
            self.threshold *= self.up
        elif r > 1.0:
            self.threshold *= self.creep
        elif r > self.band_lo:
            self.threshold *= 0.9987
        else:
            self.threshold *= self.down


class DenseController(Controller):
    """density = 1: select everything (threshold 0), whatever the controller asked for."""

    name = "dense"

    def __init__(self, numel, density):
        self.threshold = 0.0

    def update(self, counts_prev, words=None, plan=None):
        pass


class HistogramController(Controller):
    """Holds the target density from the first step: a histogram quantile plus an integral trim.

    Every step each rank histograms ``|acc|`` over the partition it owns, in the same pass that
    selects (``kernels/cpu_controller.py``), in ``N_BUCKETS`` buckets ``2**SUB_BITS`` per octave,
    centred on the threshold in use. The histograms travel in the step's first collective with the
    counts, so every rank sums the same ``(P, N_BUCKETS)`` words: the histogram of the whole
    vector as its owners saw it. The next threshold is the level the summed histogram puts
    ``k * exp(-trim)`` elements above (log-log interpolation inside a bucket); ``trim`` integrates
    ``log(selected / k)``, which removes the bias that error feedback adds (mass left below the
    threshold keeps growing, so next step's tail is heavier than this step's). A 10x change of
    gradient scale shows in the very next histogram, so the threshold follows it in one step.

    Step 0 has no history (``resolve``): the first pass selects nothing and histograms the whole
    exponent range (``hist_spec(dtype, 0)``: one bucket per octave); the controller refines around
    that estimate (``refine_spec``, 16 buckets per octave, one extra small Allgather and one read of
    the owned range, at step 0 only), sets ``first_threshold`` and has the pass run again.

    Without a histogram (``update(counts)`` alone, e.g. jobs/simulate.py) it falls back to a
    multiplicative step on ``log(selected / k)`` with an assumed tail slope.

    Example::

        >>> c = HistogramController(numel=1 << 20, density=0.001)
        >>> plan = c.plan(t, np.float32)                       # kernel arguments for this step
        >>> c.update(counts, words, plan)                      # gathered (P,) and (P, plan.n_words)
        >>> c.threshold                                        # next step's, same on every rank
    """

    name = "histogram"
    balance_rule = "adaptive"
    N_BUCKETS = 64
    SUB_BITS = 3            # 8 buckets per octave: the window spans 8 octaves around the threshold
    REFINE_BITS = 4         # step 0: 16 buckets per octave over 4 octaves
    FINE_BUCKETS = 64       # and a fine window, 512 buckets per octave (0.14 %) around the threshold:
    FINE_BITS = 9           # after a drop of scale the count can double for a 1 % lower threshold
    # The coarse forecast may count only every n-th element (kernels honour it bit-identically on CPU
    # and CUDA). Measured: n = 8 makes the CPU pass ~25 % faster but doubles the worst open-loop
    # density miss (0.12 -> 0.24 in tests/unit/test_controller_histogram.py), so every element.
    COARSE_STRIDE = 1
    COARSE_BUCKETS = 64
    COARSE_LOW = -40        # step 0 coarse window: one bucket per octave from 2**-40 to 2**24
    BETA = 1.0              # fraction of the way (in log count) from the count now to the aim
    GAIN = 0.1              # smoothing of the forecast's calibration, log(count / forecast)
    JUMP = 0.5              # two calibration misses beyond this (in log), same side: a new regime
    TRIM_MAX = 2.0          # |trim| bound (a factor e**2 on the aimed count)
    SLOPE = 4.0             # histogram-less fallback: assumed d log(count) / d log(threshold)

    def __init__(self, numel, density):
        self.k = target_count(density, numel)
        self.numel = numel
        self.threshold = 1.0 / (2.0 * math.sqrt(self.k))   # a placeholder until step 0 is seen
        self.trim = 0.0           # log(count / forecast), smoothed: the forecast's calibration
        self.forecast = None      # the uncalibrated count the last histogram gave for the next threshold
        self.pending = None       # a large calibration miss waiting for confirmation by the next one

    # ------------------------------------------------------------------ bucket geometry
    @staticmethod
    def _mantissa_bits(dtype):
        return 23 if np.dtype(dtype) == np.float32 else 52

    @staticmethod
    def _key(value, dtype, shift):
        bits = np.array([abs(value)], dtype=dtype).view(np.int32 if np.dtype(dtype) == np.float32 else np.int64)
        return int(bits[0]) >> shift

    @staticmethod
    def _edge(dtype, shift, key):
        """``_edges(dtype, shift, key0, nb)[key - key0]`` alone, as a Python float, with no array (a
        step needs one or two edges of a window that moves every step: the host time before a GPU
        step's first launch and after its words)."""
        if np.dtype(dtype) == np.float32:
            bits = min(max(key, 1) << shift, ((0x7FFFFFFF >> shift) << shift))
            return _F32.unpack(_I32.pack(bits))[0]
        bits = min(max(key, 1) << shift, ((0x7FFFFFFFFFFFFFFF >> shift) << shift))
        return _F64.unpack(_I64.pack(bits))[0]

    @staticmethod
    def _edges(dtype, shift, key0, nb):
        """Lower edges of buckets 0..nb (float64): the floats whose bits are ``(key0 + j) << shift``.
        Read-only, and kept: a step asks for the same few windows several times (its host time
        is on a GPU step's critical path)."""
        key = (np.dtype(dtype).char, int(shift), int(key0), int(nb))
        got = _EDGES.get(key)
        if got is None:
            ity = np.int32 if np.dtype(dtype) == np.float32 else np.int64
            keys = np.clip(np.arange(key0, key0 + nb + 1, dtype=np.int64), 1, None)
            cap = (1 << (31 if ity is np.int32 else 63)) - 1
            bits = np.minimum(keys << shift, (cap >> shift) << shift).astype(ity)
            got = bits.view(np.dtype(dtype)).astype(np.float64)
            got.flags.writeable = False
            if len(_EDGES) >= 256:
                _EDGES.clear()
            _EDGES[key] = got
        return got

    # ------------------------------------------------------------------ the protocol
    def plan(self, t, dtype):
        if t == 0:   # histogram the whole exponent range, select nothing yet
            return PassPlan(0, dtype, math.inf, self.hist_spec(dtype, 0))
        return self._forecasting_plan(t, dtype)

    def _forecasting_plan(self, t, dtype):
        """Select with the threshold; histogram the forecast of the range owned at step t + 1."""
        return PassPlan(t, dtype, self.threshold, self.hist_spec(dtype, 1), self.fine_spec(dtype, 1),
                        predict=True, forecast_step=t + 1, stride=self.COARSE_STRIDE)

    def resolve(self, plan, words, fused):
        """Step 0: refine the first threshold from the coarse histograms ``words``, then select."""
        if plan.t != 0:
            return plan, words
        t0 = time.perf_counter()
        spec = self.refine_spec(plan.dtype, words)
        fine_all = fused.agree(fused.histogram(spec).tolist())
        self.first_threshold(plan.dtype, spec, fine_all)
        # acc = residual + grad again: the same bits, so acc is unchanged; this pass selects and forecasts.
        plan = self._forecasting_plan(0, plan.dtype)
        words = fused.rerun(plan)
        fused.sec["first_threshold"] = time.perf_counter() - t0
        return plan, words

    # ------------------------------------------------------------------ bucket geometry (continued)
    def hist_spec(self, dtype, t):
        """``(n_buckets, shift, key0)`` for the kernel at step ``t`` (same on every rank)."""
        mb = self._mantissa_bits(dtype)
        if t == 0:
            bias = 127 if mb == 23 else 1023
            return self.COARSE_BUCKETS, mb, bias + self.COARSE_LOW
        shift = mb - self.SUB_BITS
        return self.N_BUCKETS, shift, self._key(self.threshold, dtype, shift) - self.N_BUCKETS // 2

    def fine_spec(self, dtype, t):
        """``(n_buckets, shift, key0)`` of the fine window at step ``t``, or None (step 0)."""
        if t == 0:
            return None
        shift = self._mantissa_bits(dtype) - self.FINE_BITS
        return self.FINE_BUCKETS, shift, self._key(self.threshold, dtype, shift) - self.FINE_BUCKETS // 2

    def refine_spec(self, dtype, coarse_hist):
        """Step 0: a finer window around the coarse estimate, and that estimate."""
        nb, shift, key0 = self.hist_spec(dtype, 0)
        guess = self._quantile(np.asarray(coarse_hist).sum(axis=0), self._edges(dtype, shift, key0, nb), self.k)
        fshift = self._mantissa_bits(dtype) - self.REFINE_BITS
        return self.COARSE_BUCKETS, fshift, self._key(guess, dtype, fshift) - self.COARSE_BUCKETS // 2

    def first_threshold(self, dtype, spec, fine_hist):
        nb, shift, key0 = spec
        self.threshold = self._quantile(np.asarray(fine_hist).sum(axis=0), self._edges(dtype, shift, key0, nb),
                                        self.k)
        return self.threshold

    # ------------------------------------------------------------------ estimates
    @staticmethod
    def _quantile(hist, edges, target):
        """The level with ``target`` elements above it, from bucket counts (log-log interpolation).

        ``hist[j]`` counts values in ``[edges[j], edges[j+1])``; the last bucket also holds
        everything above, the first everything below. Beyond the window: a factor 2 past its edge.
        """
        hist = np.asarray(hist, dtype=np.float64)
        nb = hist.shape[0]
        above = np.cumsum(hist[::-1])[::-1]            # above[j]: count at or above edges[j]
        target = max(float(target), 0.5)
        if above[nb - 1] >= target:                    # inside the open top bucket
            return float(edges[nb - 1] * 2.0)
        j = int(np.nonzero(above >= target)[0][-1]) if above[0] >= target else 0
        if j == 0:                                     # the open bottom bucket: below the window
            return float(edges[1] * 0.5) if above[0] >= target else float(edges[0] * 0.5)
        a_hi = above[j + 1]
        lo_e, hi_e = math.log(edges[j]), math.log(edges[j + 1])
        if a_hi > 0:
            frac = (math.log(target) - math.log(a_hi)) / (math.log(above[j]) - math.log(a_hi))
        else:
            frac = target / above[j]
        return float(math.exp(hi_e + frac * (lo_e - hi_e)))

    @staticmethod
    def _count_above(hist, edges, level):
        """Inverse of ``_quantile``: the count the histogram puts at or above ``level``."""
        hist = np.asarray(hist, dtype=np.float64)
        above = np.cumsum(hist[::-1])[::-1]
        nb = hist.shape[0]
        if level <= edges[1]:
            return float(above[0])
        if level >= edges[nb - 1]:
            return float(above[nb - 1]) * (edges[nb - 1] / level)
        j = int(np.searchsorted(edges, level, side="right")) - 1
        a_lo, a_hi = above[j], above[j + 1]
        frac = (math.log(edges[j + 1]) - math.log(level)) / (math.log(edges[j + 1]) - math.log(edges[j]))
        if a_hi > 0:
            return float(math.exp(math.log(a_hi) + frac * (math.log(a_lo) - math.log(a_hi))))
        return float(a_lo * frac)

    # ------------------------------------------------------------------ the loop
    def update(self, counts_prev, words=None, plan=None):
        """Set the next threshold from the gathered counts and histograms (``plan``: this step's).

        The histograms are of the next step's accumulator as this step foresees it
        (kernels/cpu_controller.py, ``predict``), summed over ranks: ``N(x)``, the count expected
        above level ``x`` next step. That forecast is biased (it stands this step's gradient in
        for the next one, and the next owner of a partition is another rank), so it is calibrated:
        ``trim`` tracks ``log(count / forecast)``, the ratio between the count a step really
        selected and the count the previous forecast gave for that step's threshold. The next
        threshold aims at ``N(x) = k * exp(-trim)`` (``BETA`` < 1 would stop part of the way, in log
        count). Calibrating the forecast, rather than integrating the miss, cannot wind up during a
        large transient such as a 10x drop of gradient scale; and because the forecast already
        holds the pile of residual mass under the threshold, the full step lands there too.
        """
        hists, fine_hists = plan.split(words) if (plan is not None and words is not None) else (None, None)
        dtype = plan.dtype if plan is not None else np.dtype(np.float32)
        spec, fine = (plan.hist, plan.fine) if plan is not None else (None, None)
        n = float(sum(int(c) for c in counts_prev))
        err = math.log(max(n, 0.5) / self.k)
        if hists is None:
            self.threshold *= math.exp(max(-1.0, min(1.0, err)) / self.SLOPE)
            return
        if self.forecast is not None:
            miss = max(-self.TRIM_MAX, min(self.TRIM_MAX, math.log(max(n, 0.5) / max(self.forecast, 0.5))))
            if abs(miss - self.trim) <= self.JUMP:
                self.trim += self.GAIN * (miss - self.trim)
                self.pending = None
            elif self.pending is not None and (self.pending - self.trim) * (miss - self.trim) > 0:
                self.trim = miss      # two large misses in a row: the forecast's bias really changed
                self.pending = None
            else:
                self.pending = miss   # one large miss: the data changed under the forecast, an outlier
        nb, shift, key0 = spec
        hist = np.asarray(hists, dtype=np.int64).sum(axis=0) * self.COARSE_STRIDE
        edges = self._edges(dtype, shift, key0, nb)
        aim = self.k * math.exp(-self.trim)
        if fine is not None:
            # the fine window (exact counts) decides whenever the aim lies strictly inside it
            fhist = np.asarray(fine_hists, dtype=np.int64).sum(axis=0)
            above = np.cumsum(fhist[::-1])[::-1]
            if above[-1] < aim < above[1]:
                hist, edges = fhist, self._edges(dtype, fine[1], fine[2], fine[0])
        # Damped in count space: the slope of count against threshold ranges from ~3 (a fresh
        # heavy tail) to ~100 (the pile error feedback leaves under the threshold after a drop of
        # scale), so a fixed fraction of the way in threshold would over- or under-shoot by that.
        now = max(self._count_above(hist, edges, self.threshold), 0.5)
        goal = math.exp(math.log(now) + self.BETA * (math.log(aim) - math.log(now)))
        thr = self._quantile(hist, edges, goal)
        if n == 0:
            # nothing selected: always move down, even where a histogram bucket hides where
            thr = min(thr, self.threshold * 0.5)
        self.threshold = thr
        self.forecast = self._count_above(hist, edges, self.threshold)

    def state(self):
        return {"threshold": self.threshold, "trim": self.trim, "forecast": self.forecast, "pending": self.pending}

    def load_state(self, d):
        self.threshold = float(d["threshold"])
        self.trim = float(d.get("trim", 0.0))
        f, q = d.get("forecast"), d.get("pending")
        self.forecast = None if f is None else float(f)
        self.pending = None if q is None else float(q)


class MeasuredController(Controller):
    """Measures this step's accumulator instead of forecasting it: the default controller.

    The step's one pass over the vector (``acc = residual + grad``) also histograms ``|acc|`` over
    the partition this rank owns *this* step; the owned ranges tile the vector, so the histograms
    summed over ranks (one Allreduce of a fixed number of int32 words, the same exact integer sums
    on every rank) count every element of the vector exactly once, as its owner will compare it.
    The threshold is then a bucket edge: ``|acc| >= edge`` selects exactly the summed count above
    that edge, known before anything is selected. Nothing is forecast, so correlated, constant or
    rotating streams and changes of scale are measured like any other.

    Buckets (exact integer logic on the IEEE bits, kernels/cpu_controller.py): the pass fills a
    coarse window (``N_COARSE`` buckets, 8 per octave, counting every ``stride``-th element) and a
    fine one (``n_fine``: 64 buckets at 256 per octave, up to 256 at 1024 per octave where k is
    large, every element) both centred on the previous threshold. If the k-th largest ``|acc|`` lies inside the fine
    window the threshold is picked there (no extra work). Otherwise ``resolve`` zooms: the coarse
    bucket that holds it (and its neighbours: the coarse counts are a sample) is re-histogrammed
    over the owned range only (``2**ZOOM_BITS`` sub-buckets each, an O(N/P) read and one more
    small Allreduce) until the resolution is 256 per octave or the count at an edge is within
    ``TOL`` of k; outside the coarse window (and at step 0) it starts from one bucket per octave
    over 2**-40 .. 2**24, every element. Of the two edges around the k-th value it takes
    the one whose count is nearer to k in ratio, never one that selects nothing while the
    accumulator holds a value above 2**-40.

    ``balance_rule`` is ``"blocks"``: exact per-block counts of this step, taken from the gathered
    union of indices (no extra words), set next step's partition boundaries.
    """

    name = "measured"
    balance_rule = "blocks"
    N_COARSE, COARSE_BITS = 64, 3     # 8 octaves around the previous threshold
    N_FINE, FINE_BITS = 64, 8         # +-8.8 % around it, 0.27 % per bucket (at least; see __init__)
    FINE_MORE = 2                     # up to 4x as many fine buckets, as fine, where k is large
    ZOOM_BITS = 5                     # a zoom splits a coarse bucket into 32: the fine resolution
    WIDE_LOW, N_WIDE = -40, 64        # step 0 / out of window: one bucket per octave, 2**-40 .. 2**24
    TOL = 0.01                        # stop zooming when an edge's count is this close to k,
    FINE_TOL = 0.05                   # or this close at the fine resolution (else a pile of equal
    DEEP_BITS = 13                    # values: zoom into the fine bucket, down to 8192 per octave)
    SAMPLE = 1 << 16                  # the coarse window counts about this many elements per rank
    MAX_STRIDE = 64                   # (every stride-th): it only locates the k-th value
    MAX_ZOOMS = 8

    def __init__(self, numel, density, nranks=1):
        self.k = target_count(density, numel)
        self.numel = numel
        self.threshold = 1.0 / (2.0 * math.sqrt(self.k))   # a placeholder until step 0 is measured
        self.seen = False
        stride = 1
        while stride < self.MAX_STRIDE and numel // (nranks * stride * 2) >= self.SAMPLE:
            stride *= 2
        self.stride = stride      # the same on every rank: numel and P are
        # A finer fine window (same +-8.8 % span) while its words stay under half of k: at d = 0.001 a
        # 0.27 % bucket moves the count by 3-5 %, so on correlated streams half the steps needed a
        # zoom (another read and small Allreduce) to land within FINE_TOL; 0.07 % buckets rarely do.
        # At small k (where the words are most of the bytes) it stays at 64.
        more = 0
        while more < self.FINE_MORE and (self.N_FINE << (more + 1)) <= self.k // 2:
            more += 1
        self.n_fine, self.fine_bits = self.N_FINE << more, self.FINE_BITS + more
        self.expected = None      # the total count the last threshold selects (exact, from the sums)
        self.zooms = 0            # extra owned-range passes of the last step (a diagnostic)
        self.settled_fine = False  # the last resolve settled in the fine window at once (fine_pick)
        self.zoom_words = []      # and the words each of them summed
        self._specs_key, self._specs = None, None   # window_specs' last answer

    # ------------------------------------------------------------------ geometry
    _mantissa_bits = staticmethod(HistogramController._mantissa_bits)
    _key = staticmethod(HistogramController._key)
    _edges = staticmethod(HistogramController._edges)
    _edge = staticmethod(HistogramController._edge)

    def wide_spec(self, dtype):
        mb = self._mantissa_bits(dtype)
        bias = 127 if mb == 23 else 1023
        return self.N_WIDE, mb, bias + self.WIDE_LOW

    def window_specs(self, dtype):
        """The coarse and fine windows of the fused pass, centred on the previous threshold."""
        key = (np.dtype(dtype).char, self.threshold, self.n_fine, self.fine_bits)
        if key != self._specs_key:   # (asked for up to three times a step)
            mb = self._mantissa_bits(dtype)
            cs, fs = mb - self.COARSE_BITS, mb - self.fine_bits
            coarse = (self.N_COARSE, cs, self._key(self.threshold, dtype, cs) - self.N_COARSE // 2)
            fine = (self.n_fine, fs, self._key(self.threshold, dtype, fs) - self.n_fine // 2)
            self._specs_key, self._specs = key, (coarse, fine)
        return self._specs

    # ------------------------------------------------------------------ the protocol
    def plan(self, t, dtype):
        if not self.seen:
            return PassPlan(t, dtype, math.inf, self.wide_spec(dtype), stride=self.stride, measure=True)
        coarse, fine = self.window_specs(dtype)
        return PassPlan(t, dtype, math.inf, coarse, fine, stride=self.stride, measure=True)

    def _locate(self, hist):
        """``j`` with ``above[j] >= k > above[j + 1]`` among the exact edges 1..nb-1 of an open-ended
        histogram: 0 when the k-th value lies below edge 1, nb - 1 when at or above the top edge."""
        rising = np.cumsum(np.asarray(hist, dtype=np.int64)[::-1])   # rising[m] = above[nb - 1 - m]
        above = rising[::-1]
        # the largest j >= 1 with above[j] >= k: the first m with rising[m] >= k, j = nb - 1 - m
        j = rising.shape[0] - 1 - int(np.searchsorted(rising, self.k))
        return (j if j >= 1 else 0), above

    def _pick(self, above, j, edge):
        """Edge j (count >= k) or edge j + 1 (count < k), whichever is nearer to k in ratio; never
        an edge that selects nothing when the other selects something. ``edge(j)``: edge j's level."""
        a, b = int(above[j]), int(above[j + 1])
        if b == 0 or a * b <= self.k * self.k:   # a / k <= k / b, in exact integers (as on the device)
            return float(edge(j)), a
        return float(edge(j + 1)), b

    def _tol(self, shift, mb):
        """How far (in ratio) from k an exact edge's count may be and still settle the threshold, at
        a window of bucket width ``shift``: TOL; FINE_TOL at the fine resolution; anything deeper."""
        if shift <= mb - self.DEEP_BITS:
            return math.inf
        return self.FINE_TOL if shift <= mb - self.FINE_BITS else self.TOL

    def fine_pick(self, plan, words):
        """What ``resolve`` settles on from the fine window alone, with no zoom: ``(threshold,
        count)``, or None (no fine window, the k-th value outside it, or the nearest edge's count
        further than ``_tol`` from k). ``kernels.cuda._resolve_fine`` computes the same on the device,
        so a one-rank GPU step can go on before the host has read the words (``fine_tol``)."""
        if plan.fine is None:
            return None
        n, shift, key0 = plan.fine
        nb = plan.hist[0]
        j, above = self._locate(np.asarray(words, dtype=np.int64)[nb:nb + n])
        if not 0 < j < n - 1:
            return None
        thr, count = self._pick(above, j, lambda i: self._edge(plan.dtype, shift, key0 + i))
        if abs(count / self.k - 1.0) <= self._tol(shift, self._mantissa_bits(plan.dtype)):
            return thr, count
        return None

    def fine_tol(self, plan):
        """``_tol`` of the plan's fine window: ``fine_pick``'s bound, for the device."""
        return self._tol(plan.fine[1], self._mantissa_bits(plan.dtype))

    def resolve(self, plan, words, fused):
        """Set ``plan.threshold`` (and ``plan.expected``) from the summed histograms ``words``.

        The fine window's counts are exact; the coarse ones come from every ``COARSE_STRIDE``-th
        element, so they only locate the k-th value: the zoom that follows counts every element of
        the owned range over the coarse bucket that holds it and its two neighbours. A zoom whose
        exact counts put the k-th value outside it starts again from the wide window, exact.
        """
        words = np.asarray(words, dtype=np.int64)
        self.zooms, self.zoom_words = 0, []
        picked = self.fine_pick(plan, words)
        self.settled_fine = picked is not None
        if picked is not None:   # the common case, in one look (what the loop below does first)
            return self._done(plan, *picked)
        dtype, mb = plan.dtype, self._mantissa_bits(plan.dtype)
        nb = plan.hist[0]
        spec, hist, exact = plan.hist, words[:nb] * plan.stride, plan.stride == 1
        if plan.fine is not None:
            j, _ = self._locate(words[nb:])
            if 0 < j < plan.fine[0] - 1:     # the fine window holds the k-th value: start there
                spec, hist, exact = plan.fine, words[nb:], True
        wide_spec = self.wide_spec(dtype)
        wide = spec == wide_spec
        best = None
        for _ in range(self.MAX_ZOOMS):
            n, shift, key0 = spec
            j, above = self._locate(hist)
            edges = self._edges(dtype, shift, key0, n)
            if exact:
                best = self._pick(above, min(max(j, 1), n - 2), edges.__getitem__)
            if (j == 0 or j == n - 1) and (exact or not wide):
                if not wide:      # outside this window: one bucket per octave, every element
                    spec, wide, exact = wide_spec, True, True
                    hist = self._zoom(fused, spec)
                    continue
                if j == 0 and above[1] == 0:     # (nearly) nothing above 2**-40: select what is there
                    return self._done(plan, float(edges[1]), 0)
                return self._done(plan, *best)
            if exact:
                thr, count = best
                if abs(count / self.k - 1.0) <= self._tol(shift, mb):
                    return self._done(plan, thr, count)
                a, b = j, j + 1                  # zoom into the bucket that holds the k-th value
            else:
                a, b = max(j - 1, 1), min(j + 2, n - 1)   # a sampled count: that bucket and its neighbours
            z = min(self.ZOOM_BITS, shift)
            spec = (((b - a) << z) + 2, shift - z, ((key0 + a) << z) - 1)   # below | sub-buckets | above
            wide, exact = False, True
            hist = self._zoom(fused, spec)
        return self._done(plan, *best)

    def mark(self, plan):
        """The lowest edge of the fine window (None without one): the select that follows a
        measuring pass is at or above it unless a zoom went lower, so the pass may mark every element
        from there up (``Ops.accumulate_measure``'s ``mark``)."""
        if plan.fine is None:
            return None
        n, shift, key0 = plan.fine
        return self._edge(plan.dtype, shift, key0 + 1)

    def local_count(self, plan, words):
        """This rank's count at ``plan.threshold`` from its own words of the measuring pass, exact
        when the threshold is an edge of the fine window (every element of the owned range is in
        that histogram, and ``|x| >= edge j`` is ``bucket >= j`` for finite x); else None."""
        if plan.fine is None or words is None:
            return None
        n, shift, key0 = plan.fine
        edges = self._edges(plan.dtype, shift, key0, n)
        j = np.flatnonzero(edges[1:n] == plan.threshold)
        if j.size == 0:
            return None
        nb = plan.hist[0]
        return int(np.asarray(words[nb + 1 + int(j[0]):nb + n], dtype=np.int64).sum())

    def edges_below(self, plan, words, need):
        """Thresholds under ``plan.threshold``, highest first, at which this rank's own words of the
        measuring pass put at least ``need`` elements of its owned range: ``[(edge, count), ...]``,
        ``count`` exact from the fine window, None where only the sampled coarse window says so; the
        last is 0.0 (every element). What a rank given a larger quota selects at (``quota.quotas``)."""
        w = np.asarray(words, dtype=np.int64)
        nb = plan.hist[0]
        if plan.fine is not None:
            n, shift, key0 = plan.fine
            edges = self._edges(plan.dtype, shift, key0, n)
            above = np.cumsum(w[nb:nb + n][::-1])[::-1]
            ok = np.flatnonzero((edges[1:n] < plan.threshold) & (above[1:n] >= need))
            if ok.size:
                j = int(ok[-1]) + 1
                return [(float(edges[j]), int(above[j]))]
        n, shift, key0 = plan.hist
        edges = self._edges(plan.dtype, shift, key0, n)
        above = np.cumsum(w[:n][::-1])[::-1] * plan.stride
        ok = np.flatnonzero((edges[1:n] < plan.threshold) & (above[1:n] >= need))[::-1] + 1
        return [(float(edges[j]), None) for j in ok] + [(0.0, None)]

    def _zoom(self, fused, spec):
        """One more read of the owned range and one more small Allreduce: ``spec``'s summed histogram."""
        self.zooms += 1
        self.zoom_words.append(spec[0])
        return fused.sum(fused.histogram(spec))

    def _done(self, plan, thr, count):
        plan.threshold, plan.expected = thr, count
        self.threshold, self.seen, self.expected = thr, True, count
        return plan, None

    def update(self, counts_prev, words=None, plan=None):
        """Nothing to learn: ``resolve`` measured this step's threshold. Without histograms (e.g. a
        count-only model) a multiplicative step toward k keeps the next window centred."""
        if plan is None or not plan.measure:
            n = float(sum(int(c) for c in counts_prev))
            self.threshold *= math.exp(max(-1.0, min(1.0, math.log(max(n, 0.5) / self.k))) / 4.0)

    def state(self):
        return {"threshold": self.threshold, "seen": self.seen}

    def load_state(self, d):
        self.threshold = float(d["threshold"])
        self.seen = bool(d.get("seen", True))


CONTROLLERS = {c.name: c for c in (FaithfulController, SymmetricController, HistogramController,
                                   MeasuredController)}


def make_controller(name, numel, density, nranks=1):
    if density >= 1.0:
        return DenseController(numel, density)
    if name == MeasuredController.name:
        return MeasuredController(numel, density, nranks)
    return CONTROLLERS[name](numel, density)
