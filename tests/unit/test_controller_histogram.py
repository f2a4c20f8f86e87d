"""The histogram controller on synthetic count sequences, and its kernel against NumPy."""
import math

import numpy as np
import pytest

from exdyna_mpi.algorithm.controllers import FaithfulController, HistogramController, PassPlan, make_controller
from exdyna_mpi.kernels import cpu_controller as kc


def _hist(x, spec):
    nb, shift, key0 = spec
    h = np.zeros(nb, np.int64)
    kc.host_hist_range(x, 0, x.shape[0], shift, key0, h)
    return h


def _sampled(x, spec, c):
    """The coarse histogram as the step's kernel makes it: every COARSE_STRIDE-th element."""
    return _hist(x[::c.COARSE_STRIDE], spec)


def _run(c, draw, steps):
    """Feed the controller the counts and histograms a fresh sample would give at its threshold."""
    x = draw(0)
    spec0 = c.hist_spec(x.dtype, 0)
    fs = c.refine_spec(x.dtype, _hist(x, spec0)[None])
    c.first_threshold(x.dtype, fs, _hist(x, fs)[None])
    ratios = []
    for t in range(steps):
        x = draw(t)
        spec = c.hist_spec(x.dtype, t + 1)
        n = int(np.sum(np.abs(x) >= np.float32(c.threshold)))
        ratios.append(n / c.k)
        c.update([n], _sampled(x, spec, c)[None], PassPlan(t + 1, x.dtype, c.threshold, spec))
    return np.array(ratios)


def test_kernel_histogram_and_selection_match_numpy():
    rng = np.random.default_rng(1)
    for dt, mb in ((np.float32, 23), (np.float64, 52)):
        r, g = rng.standard_normal((2, 50_000)).astype(dt)
        acc, idx, hist = np.empty(50_000, dt), np.empty(50_000, np.int64), np.zeros(64, np.int64)
        key0 = (int(np.array([1.5], dt).view(np.int32 if dt == np.float32 else np.int64)[0]) >> (mb - 3)) - 32
        c, bad = kc.host_accumulate_select_hist(r, g, acc, 1000, 40_000, dt(2.0), idx, mb - 3, key0, hist)
        a = np.abs(r + g)
        assert np.array_equal(acc, r + g) and bad == 0
        assert np.array_equal(idx[:c], 1000 + np.nonzero(a[1000:40_000] >= 2.0)[0])
        bits = a[1000:40_000].view(np.int32 if dt == np.float32 else np.int64) >> (mb - 3)
        assert np.array_equal(hist, np.bincount(np.clip(bits - key0, 0, 63), minlength=64))


def test_first_threshold_hits_the_target_on_a_fresh_vector():
    rng = np.random.default_rng(2)
    x = (rng.standard_t(3, 200_000) * 7.0).astype(np.float32)
    c = HistogramController(x.shape[0], 0.001)
    fs = c.refine_spec(x.dtype, _hist(x, c.hist_spec(x.dtype, 0))[None])
    thr = c.first_threshold(x.dtype, fs, _hist(x, fs)[None])
    assert abs(np.sum(np.abs(x) >= np.float32(thr)) / c.k - 1.0) < 0.05


@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e4])
def test_converges_and_holds_on_a_stationary_stream(scale):
    rng = np.random.default_rng(3)
    c = HistogramController(100_000, 0.01)        # k = 1000: count noise ~3 %
    ratios = _run(c, lambda t: (rng.standard_t(3, 100_000) * scale).astype(np.float32), 60)
    assert np.all(np.abs(ratios[5:] - 1.0) < 0.15), ratios
    assert abs(ratios[5:].mean() - 1.0) < 0.03


def test_does_not_oscillate():
    rng = np.random.default_rng(4)
    c = HistogramController(100_000, 0.01)
    ratios = _run(c, lambda t: rng.standard_normal(100_000).astype(np.float32), 80)
    dev = ratios[10:] - 1.0
    # an oscillating loop has strongly negative lag-1 correlation and growing swings
    assert np.corrcoef(dev[1:], dev[:-1])[0, 1] > -0.5
    assert np.abs(dev[-20:]).max() < 0.15


def test_follows_a_tenfold_scale_change_within_a_few_steps():
    rng = np.random.default_rng(5)
    c = HistogramController(100_000, 0.01)
    ratios = _run(c, lambda t: (rng.standard_normal(100_000) * (10.0 if t >= 30 else 1.0)).astype(np.float32), 60)
    assert np.all(np.abs(ratios[40:] - 1.0) < 0.15), ratios[28:45]


def test_zero_counts_lower_the_threshold_and_stay_finite():
    c = HistogramController(10_000, 0.01)
    c.threshold = 1.0
    x = np.full(10_000, 1e-3, np.float32)          # nothing near the threshold: every count 0
    for t in range(1, 6):
        spec = c.hist_spec(x.dtype, t)
        before = c.threshold
        c.update([0, 0], np.stack([_sampled(x, spec, c), np.zeros(spec[0], np.int64)]),
                 PassPlan(t, x.dtype, c.threshold, spec))
        assert math.isfinite(c.threshold) and 0 < c.threshold < before
    c.update([0])                                   # the counts-only fallback too
    assert math.isfinite(c.threshold) and c.threshold > 0


def test_counts_only_fallback_converges_on_a_power_law_count_model():
    c = HistogramController(1_000_000, 0.001)      # starts at 1/(2 sqrt k), far too low here
    counts = []
    for _ in range(80):
        n = int(c.k * (0.5 / c.threshold) ** 3)    # count ~ thr^-3 with the target at thr = 0.5
        counts.append(n / c.k)
        c.update([n])
    assert abs(counts[-1] - 1.0) < 0.05 and abs(counts[-2] - 1.0) < 0.05


def test_faithful_is_untouched_and_factory_knows_the_new_name():
    assert make_controller("faithful", 1000, 0.01).__class__ is FaithfulController
    assert make_controller("histogram", 1000, 0.01).__class__ is HistogramController


def test_state_round_trip():
    rng = np.random.default_rng(6)
    a = HistogramController(50_000, 0.01)
    _run(a, lambda t: rng.standard_normal(50_000).astype(np.float32), 5)
    b = HistogramController(50_000, 0.01)
    b.load_state(a.state())
    assert b.state() == a.state()


def _buckets(x, shift, key0, nb, dt):
    bits = np.abs(x).view(np.int32 if dt == np.float32 else np.int64) >> shift
    return np.bincount(np.clip(bits - key0, 0, nb - 1), minlength=nb)


@pytest.mark.parametrize("dt,mb", [(np.float32, 23), (np.float64, 52)])
def test_forecast_histograms_match_numpy(dt, mb):
    """predict: histogram of p = (selected ? 0 : acc) + neighbour's grad, coarse and fine windows."""
    rng = np.random.default_rng(7)
    n, lo, hi, thr = 30_000, 2_000, 21_000, dt(1.9)
    r, g = rng.standard_normal((2, n)).astype(dt)
    acc, idx = np.empty(n, dt), np.empty(n, np.int64)
    key = int(np.array([1.9], dt).view(np.int32 if dt == np.float32 else np.int64)[0])
    spec = (64, mb - 3, (key >> (mb - 3)) - 32)
    fine = (64, mb - 9, (key >> (mb - 9)) - 32)
    hist, hist_f = np.zeros(64, np.int64), np.zeros(64, np.int64)
    c, bad = kc.host_accumulate_select_hist(r, g, acc, lo, hi, thr, idx, spec[1], spec[2], hist, predict=True,
                                            fine=(fine[1], fine[2], hist_f))
    a = r + g
    seg = a[lo:hi]
    sel = np.abs(seg) >= thr
    p = np.where(sel, 0, seg).astype(dt) + g[lo + 1:hi + 1]     # the next element's gradient
    assert c == sel.sum() and bad == 0 and np.array_equal(acc, a)
    assert np.array_equal(hist, _buckets(p, spec[1], spec[2], 64, dt))
    assert np.array_equal(hist_f, _buckets(p, fine[1], fine[2], 64, dt))


@pytest.mark.parametrize("flo,fhi", [(25_000, 30_000), (10_000, 26_000), (0, 3_000), (29_999, 30_000)])
def test_forecast_covers_the_next_owners_range(flo, fhi):
    """The histogram covers [flo, fhi) (next step's partition): selection zeroes only inside [lo, hi)."""
    rng = np.random.default_rng(8)
    n, lo, hi, thr = 30_000, 2_000, 21_000, np.float32(1.9)
    r, g = rng.standard_normal((2, n)).astype(np.float32)
    acc, idx = np.empty(n, np.float32), np.empty(n, np.int64)
    key0 = (int(np.array([1.9], np.float32).view(np.int32)[0]) >> 20) - 32
    hist = np.zeros(64, np.int64)
    c, _ = kc.host_accumulate_select_hist(r, g, acc, lo, hi, thr, idx, 20, key0, hist, predict=True,
                                          forecast=(flo, fhi))
    a = r + g
    sel = np.zeros(n, bool)
    sel[lo:hi] = np.abs(a[lo:hi]) >= thr
    nbr = np.concatenate([g[1:], g[-2:-1]])          # the vector's last element takes the one before
    p = (np.where(sel, 0, a).astype(np.float32) + nbr)[flo:fhi]
    assert np.array_equal(idx[:c], lo + np.flatnonzero(np.abs(a[lo:hi]) >= thr))
    assert np.array_equal(hist, _buckets(p, 20, key0, 64, np.float32))


def test_count_above_inverts_quantile():
    edges = HistogramController._edges(np.float32, 20, (127 << 3) - 32, 64)
    hist = np.random.default_rng(0).integers(0, 500, 64)
    for target in (3.0, 57.0, 900.0, 5000.0):
        q = HistogramController._quantile(hist, edges, target)
        if edges[1] < q < edges[-2]:
            assert abs(HistogramController._count_above(hist, edges, q) / target - 1) < 1e-9


def _ef_run(scale_of_step, steps, numel=1 << 17, density=0.01):
    """Density / target per step of real ExDyna (P=1, error feedback) on a Student-t stream."""
    from mpi4py import MPI

    import exdyna_mpi

    rng = np.random.default_rng(11)
    pool = rng.standard_t(3, numel + (1 << 16)).astype(np.float32)
    sp = exdyna_mpi.ExDyna(numel, density, MPI.COMM_SELF)
    out = []
    for t in range(steps):
        s = int(rng.integers(0, 1 << 16))
        sp.step(pool[s:s + numel] * np.float32(scale_of_step(t) * (1 if rng.integers(2) else -1)))
        out.append(sp.stats.density / density)
    return np.array(out)


def test_holds_target_from_the_first_steps_with_error_feedback():
    d = _ef_run(lambda t: 1.0, 120)
    assert np.all(np.abs(d[:3] - 1) < 0.25), d[:3]          # step 0 and 1 already near the target
    assert np.mean(np.abs(d[20:] - 1) > 0.1) < 0.05, d[20:]  # rare count-noise excursions only (k=655)
    assert abs(d[20:].mean() - 1) < 0.03


def test_recovers_from_tenfold_drop_and_rise_within_20_steps():
    """A learning-rate drop leaves a pile of residual under the threshold; the forecast sees it."""
    d = _ef_run(lambda t: 0.1 if 60 <= t < 120 else 1.0, 180)
    for change in (60, 120):
        after = d[change + 20:change + 60]
        assert np.mean(np.abs(after - 1) > 0.1) < 0.1, (change, after)
        assert abs(after.mean() - 1) < 0.05, (change, after.mean())
