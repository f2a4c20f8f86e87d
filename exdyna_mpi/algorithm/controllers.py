"""Algorithm layer: threshold controllers, behind one protocol.

A controller owns the global threshold. It sees only what every rank sees (the words of the step's
first collective), so every rank computes the same threshold sequence. The protocol
(``Controller``), one signature for every controller:

- ``plan(t, dtype) -> PassPlan``: what it needs from step ``t``'s pass (the threshold the pass
  selects with, or the histogram windows a measuring pass fills instead of selecting);
- ``PassPlan.n_words``: the words a measuring pass adds to the first collective (its histograms,
  summed over ranks);
- ``resolve(plan, sums, owned) -> PassPlan``: after the summed first collective, the plan of the
  step's selection (its ``threshold`` and ``expected`` count set); it may zoom through ``owned``
  (an ``OwnedRange`` the sparsifier passes in: owned-range reads and small Allreduces). It changes
  nothing: ``update`` takes the result;
- ``update(counts, plan=None)``: set the next threshold from the gathered counts ``(P,)`` and the
  step's (resolved) plan;
- ``state()`` / ``load_state(d)``; ``balance_rule``: the partner rule ``balance=True`` means.

Pure host logic: per-element work happens only in the sparsifier's pass and in ``owned``.
"""
from __future__ import annotations

import dataclasses
import math
import struct
from typing import NamedTuple, Protocol

import numpy as np

from .layout import Balance


def target_count(density, numel):
    """k = int(density * numel), at least 1 (the authors' code divides by it)."""
    return max(1, int(density * numel))


_EDGES: dict = {}   # (dtype char, shift, key0, nb) -> _edges(...), read-only
_I32, _F32, _I64, _F64 = (struct.Struct(f) for f in ("<i", "<f", "<q", "<d"))   # an edge's bits


class Window(NamedTuple):
    """A histogram window over ``|x|``, exact integer logic on the IEEE bits
    (exdyna_mpi/kernels/cpu_controller.py): ``buckets`` buckets, bucket ``j`` holding the values whose bits
    ``>> shift`` are ``key0 + j`` (the first and last also everything below / above)."""

    buckets: int
    shift: int
    key0: int


@dataclasses.dataclass(frozen=True, slots=True)
class PassPlan:
    """What a controller asks of step ``t``'s pass over the owned range, and, once ``resolve``d,
    what it settled on. Immutable: ``resolve`` returns a new one.

    ``threshold``: the level the pass selects with (``inf`` for a measuring pass until resolved);
    ``measure``: the pass only accumulates and histograms ``|acc|`` over the owned range (``hist``,
    every ``stride``-th element, and ``fine``, every element), the words are summed over ranks and
    ``resolve`` sets the threshold from them; ``expected``: the total count that threshold selects
    (exact); ``settled_fine``: it was picked in the fine window at once, with no zoom (the rule a
    device can apply on its own, ``MeasuredController.fine_pick``); ``zoom_words``: the words of
    each zoom's extra Allreduce.
    """

    t: int
    dtype: np.dtype
    threshold: float
    hist: Window | None = None
    fine: Window | None = None
    stride: int = 1
    measure: bool = False
    expected: int | None = None
    settled_fine: bool = False
    zoom_words: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    @property
    def n_words(self) -> int:
        """Words the pass adds to the first collective: the coarse then the fine histogram."""
        return (self.hist.buckets if self.hist else 0) + (self.fine.buckets if self.fine else 0)


class OwnedRange(Protocol):
    """This step's accumulator over the range this rank owns, passed to ``resolve`` for its zooms."""

    def histogram(self, window: Window) -> np.ndarray:
        """This rank's histogram of ``|acc|`` over its owned range (host int64; an O(N/P) read)."""

    def sum(self, words: np.ndarray) -> np.ndarray:
        """``words`` summed over ranks (one small Allreduce; the same exact sums on every rank)."""


class Controller:
    """The controller protocol (see the module docstring). Subclasses set ``threshold`` and
    implement ``update``; the defaults suit controllers that need only the counts."""

    name = "base"
    balance_rule = Balance.FAITHFUL   # what balance=True means with this controller
    threshold = 0.0
    picks_fine = False           # has fine_pick/fine_tol: picks the threshold from a fine window's words

    def plan(self, t: int, dtype) -> PassPlan:
        return PassPlan(t, dtype, self.threshold)

    def resolve(self, plan: PassPlan, sums: np.ndarray, owned: OwnedRange) -> PassPlan:
        return plan

    def mark(self, plan: PassPlan) -> float | None:   # only measuring plans (MeasuredController) use these two
        return None

    def local_count(self, plan: PassPlan, words) -> int | None:
        return None

    def update(self, counts_prev, plan: PassPlan | None = None) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def state(self) -> dict:
        return {"threshold": self.threshold}

    def load_state(self, d: dict) -> None:
        self.threshold = float(d["threshold"])


class FaithfulController(Controller):
    """The authors' rule (kljp/exdyna, cnn-lstm/gradient_reducers.py): thr0 = 1/(2 sqrt k), then
    x1.005 / x1.00125 / x0.995."""

    name = "faithful"
    up, creep, down = 1.005, 1.00125, 0.995
    band_hi, band_lo = 1.1, 0.909

    def __init__(self, numel, density):
        self.k = target_count(density, numel)
        self.threshold = 1.0 / (2.0 * math.sqrt(self.k))

    def update(self, counts_prev, plan=None):
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

    def update(self, counts_prev, plan=None):
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

    def update(self, counts_prev, plan=None):
        pass


# ---------------------------------------------------------------------------- bucket geometry
def _mantissa_bits(dtype):
    return 23 if np.dtype(dtype) == np.float32 else 52


def _key(value, dtype, shift):
    bits = np.array([abs(value)], dtype=dtype).view(np.int32 if np.dtype(dtype) == np.float32 else np.int64)
    return int(bits[0]) >> shift


def _edge(dtype, shift, key):
    """``_edges(dtype, shift, key0, nb)[key - key0]`` alone, as a Python float, with no array (a
    step needs one or two edges of a window that moves every step: the host time before a GPU
    step's first launch and after its words)."""
    if np.dtype(dtype) == np.float32:
        bits = min(max(key, 1) << shift, ((0x7FFFFFFF >> shift) << shift))
        return _F32.unpack(_I32.pack(bits))[0]
    bits = min(max(key, 1) << shift, ((0x7FFFFFFFFFFFFFFF >> shift) << shift))
    return _F64.unpack(_I64.pack(bits))[0]


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


class MeasuredController(Controller):
    """Measures this step's accumulator instead of forecasting it: the default controller.

    The step's one pass over the vector (``acc = residual + grad``) also histograms ``|acc|`` over
    the partition this rank owns *this* step; the owned ranges tile the vector, so the histograms
    summed over ranks (one Allreduce of a fixed number of int32 words, the same exact integer sums
    on every rank) count every element of the vector exactly once, as its owner will compare it.
    The threshold is then a bucket edge: ``|acc| >= edge`` selects exactly the summed count above
    that edge, known before anything is selected. Nothing is forecast, so correlated, constant or
    rotating streams and changes of scale are measured like any other.

    Buckets (exact integer logic on the IEEE bits, exdyna_mpi/kernels/cpu_controller.py): the pass fills a
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

    ``balance_rule`` is ``Balance.BLOCKS``: exact per-block counts of this step, taken from the gathered
    union of indices (no extra words), set next step's partition boundaries.
    """

    picks_fine = True
    name = "measured"
    balance_rule = Balance.BLOCKS
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
        self.zoom_words = []      # the words each zoom of the last step summed (a diagnostic)
        self._specs_key, self._specs = None, None   # window_specs' last answer

    # ------------------------------------------------------------------ geometry
    _mantissa_bits = staticmethod(_mantissa_bits)
    _key = staticmethod(_key)
    _edges = staticmethod(_edges)
    _edge = staticmethod(_edge)

    @property
    def zooms(self) -> int:
        """Extra owned-range passes of the last step (a diagnostic)."""
        return len(self.zoom_words)

    def wide_spec(self, dtype) -> Window:
        mb = self._mantissa_bits(dtype)
        bias = 127 if mb == 23 else 1023
        return Window(self.N_WIDE, mb, bias + self.WIDE_LOW)

    def window_specs(self, dtype) -> tuple[Window, Window]:
        """The coarse and fine windows of the measuring pass, centred on the previous threshold."""
        key = (np.dtype(dtype).char, self.threshold, self.n_fine, self.fine_bits)
        if key != self._specs_key:   # (asked for up to three times a step)
            mb = self._mantissa_bits(dtype)
            cs, fs = mb - self.COARSE_BITS, mb - self.fine_bits
            coarse = Window(self.N_COARSE, cs, self._key(self.threshold, dtype, cs) - self.N_COARSE // 2)
            fine = Window(self.n_fine, fs, self._key(self.threshold, dtype, fs) - self.n_fine // 2)
            self._specs_key, self._specs = key, (coarse, fine)
        return self._specs

    # ------------------------------------------------------------------ the protocol
    def plan(self, t: int, dtype) -> PassPlan:
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

    def _pick(self, above, j, edge) -> tuple[float, int]:
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

    def fine_pick(self, plan, words) -> tuple[float, int] | None:
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

    def resolve(self, plan: PassPlan, sums: np.ndarray, owned: OwnedRange) -> PassPlan:
        """The plan of this step's selection: ``plan`` with the ``threshold`` (and ``expected``
        count) the summed histograms ``sums`` give, and how it got there (``settled_fine``,
        ``zoom_words``). Changes nothing here: ``update`` makes it the next step's centre.

        The fine window's counts are exact; the coarse ones come from every ``stride``-th element,
        so they only locate the k-th value: the zoom that follows counts every element of the owned
        range over the coarse bucket that holds it and its two neighbours (through ``owned``). A
        zoom whose exact counts put the k-th value outside it starts again from the wide window, exact.
        """
        words = np.asarray(sums, dtype=np.int64)
        zooms: list[int] = []   # the words of each zoom's Allreduce
        picked = self.fine_pick(plan, words)
        if picked is not None:   # the common case, in one look (what the loop below does first)
            return self._done(plan, *picked, zooms, settled_fine=True)
        dtype, mb = plan.dtype, self._mantissa_bits(plan.dtype)
        assert plan.hist is not None      # a measuring plan (``plan``) has its window
        nb = plan.hist[0]
        spec, hist, exact = plan.hist, words[:nb] * plan.stride, plan.stride == 1
        if plan.fine is not None:
            j, _ = self._locate(words[nb:])
            if 0 < j < plan.fine[0] - 1:     # the fine window holds the k-th value: start there
                spec, hist, exact = plan.fine, words[nb:], True
        wide_spec = self.wide_spec(dtype)
        wide = spec == wide_spec
        best: tuple[float, int] | None = None
        for _ in range(self.MAX_ZOOMS):
            n, shift, key0 = spec
            j, above = self._locate(hist)
            edges = self._edges(dtype, shift, key0, n)
            if exact:
                best = self._pick(above, min(max(j, 1), n - 2), edges.__getitem__)
            if (j == 0 or j == n - 1) and (exact or not wide):
                if not wide:      # outside this window: one bucket per octave, every element
                    spec, wide, exact = wide_spec, True, True
                    hist = self._zoom(owned, spec, zooms)
                    continue
                if j == 0 and above[1] == 0:     # (nearly) nothing above 2**-40: select what is there
                    return self._done(plan, float(edges[1]), 0, zooms)
                assert best is not None           # exact here: picked above
                return self._done(plan, *best, zooms)
            if exact:
                assert best is not None
                thr, count = best
                if abs(count / self.k - 1.0) <= self._tol(shift, mb):
                    return self._done(plan, thr, count, zooms)
                a, b = j, j + 1                  # zoom into the bucket that holds the k-th value
            else:
                a, b = max(j - 1, 1), min(j + 2, n - 1)   # a sampled count: that bucket and its neighbours
            z = min(self.ZOOM_BITS, shift)
            spec = Window(((b - a) << z) + 2, shift - z, ((key0 + a) << z) - 1)   # below | sub-buckets | above
            wide, exact = False, True
            hist = self._zoom(owned, spec, zooms)
        assert best is not None                   # every pass after the first is exact
        return self._done(plan, *best, zooms)

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

    @staticmethod
    def _zoom(owned, spec, zooms):
        """One more read of the owned range and one more small Allreduce: ``spec``'s summed histogram."""
        zooms.append(spec.buckets)
        return owned.sum(owned.histogram(spec))

    @staticmethod
    def _done(plan, thr, count, zooms, settled_fine=False):
        return dataclasses.replace(plan, threshold=thr, expected=count, settled_fine=settled_fine,
                                   zoom_words=tuple(zooms))

    def update(self, counts_prev, plan: PassPlan | None = None) -> None:
        """A resolved measuring ``plan``: its threshold, measured this step, centres the next step's
        windows. Without one (e.g. a count-only model) a multiplicative step toward k does."""
        if plan is not None and plan.measure:
            self.threshold, self.seen, self.expected = plan.threshold, True, plan.expected
            self.zoom_words = list(plan.zoom_words)
            return
        n = float(sum(int(c) for c in counts_prev))
        self.threshold *= math.exp(max(-1.0, min(1.0, math.log(max(n, 0.5) / self.k))) / 4.0)

    def state(self):
        return {"threshold": self.threshold, "seen": self.seen}

    def load_state(self, d):
        self.threshold = float(d["threshold"])
        self.seen = bool(d.get("seen", True))


CONTROLLERS = {c.name: c for c in (FaithfulController, SymmetricController, MeasuredController)}


def make_controller(name, numel, density, nranks=1):
    if density >= 1.0:
        return DenseController(numel, density)
    if name == MeasuredController.name:
        return MeasuredController(numel, density, nranks)
    return CONTROLLERS[name](numel, density)
