"""HostOps keeps the measuring pass's marks (the indices at or above the fine window's first edge)
in the ``Marks`` the caller passes, so the select and the zooms that follow read those instead of the
owned range: same results as ``select_range`` / ``hist_range`` over the range, for any threshold,
and never another pass's."""
import numpy as np
import pytest

from exdyna_mpi.algorithm.controllers import MeasuredController
from exdyna_mpi.arrays import HostOps
from exdyna_mpi.arrays.ops import Marks
from exdyna_mpi.kernels import cpu_controller as kc

MARKS = Marks()   # one caller's, reused by every pass here (as a sparsifier reuses its own)


def _measure(x, lo, hi, dtype, threshold, mark=True, marks=MARKS):
    ctl = MeasuredController(x.shape[0], 0.01)
    ctl.threshold, ctl.seen = threshold, True
    plan = ctl.plan(1, dtype)
    nb = plan.hist[0]
    w = np.zeros(plan.n_words, np.int64)
    acc = np.empty_like(x)
    bad = HostOps.accumulate_measure(np.zeros_like(x), x, acc, lo, hi, (plan.hist[1], plan.hist[2], w[:nb]),
                                     (plan.fine[1], plan.fine[2], w[nb:]), plan.stride,
                                     ctl.mark(plan) if mark else None, 1, marks)
    return acc, ctl, plan, w, bad


def _values(n, dtype, seed=1):
    x = (np.random.default_rng(seed).standard_normal(n) * 0.1).astype(dtype)
    x[::50] = 0
    x[7::61] = -x[7::61]
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rel", [1.0, 1.3, 0.95, 0.5])
def test_select_marked_equals_select_range(dtype, rel):
    n, lo, hi = 20000, 3000, 17001
    x = _values(n, dtype)
    acc, ctl, plan, _, bad = _measure(x, lo, hi, dtype, 0.25)
    assert bad == 0
    mark = ctl.mark(plan)
    marks = MARKS.of(acc, lo, hi)
    assert marks is not None and marks[0] == mark
    assert np.array_equal(marks[1], lo + np.flatnonzero(np.abs(acc[lo:hi]) >= mark))   # ascending, all of them
    thr = dtype(mark * rel)
    want = np.empty(hi - lo, np.int32)
    c = HostOps.select_range(acc, lo, hi, thr, want)
    got = np.full(hi - lo, -1, np.int32)
    assert HostOps.select_marked(acc, lo, hi, thr, got, marks=MARKS) == c
    assert np.array_equal(got[:c], want[:c])
    assert MARKS.of(acc, lo, hi) is None   # consumed


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [3, 0, -30])
def test_zoom_histogram_from_marks_equals_the_range(dtype, offset):
    n, lo, hi = 20000, 1000, 19000
    x = _values(n, dtype, 2)
    acc, ctl, plan, _, _ = _measure(x, lo, hi, dtype, 0.25)
    mb = 23 if dtype == np.float32 else 52
    shift = mb - 12
    key = MeasuredController._key(ctl.mark(plan), dtype, shift)
    spec = (50, shift, key + offset)
    want = np.zeros(50, np.int64)
    kc.host_hist_range(acc, lo, hi, *spec[1:], want)
    got = np.zeros(50, np.int64)
    HostOps.hist_range(acc, lo, hi, spec[1], spec[2], got, MARKS)
    assert np.array_equal(got, want)
    assert MARKS.of(acc, lo, hi) is not None   # a zoom leaves them for the select


def test_marks_of_another_buffer_or_range_are_not_used():
    n = 8000
    x = _values(n, np.float32, 3)
    acc, ctl, plan, _, _ = _measure(x, 0, n, np.float32, 0.25)
    other = acc.copy()
    other[::3] = 1.0   # many more hits than the marks hold
    thr = np.float32(ctl.mark(plan))
    want = np.empty(n, np.int32)
    c = HostOps.select_range(other, 0, n, thr, want)
    got = np.empty(n, np.int32)
    assert HostOps.select_marked(other, 0, n, thr, got, marks=MARKS) == c and np.array_equal(got[:c], want[:c])
    acc, ctl, plan, _, _ = _measure(x, 0, n, np.float32, 0.25)
    c = HostOps.select_range(acc, 100, 5000, thr, want)
    assert HostOps.select_marked(acc, 100, 5000, thr, got, marks=MARKS) == c and np.array_equal(got[:c], want[:c])
    acc, ctl, plan, _, _ = _measure(x, 0, n, np.float32, 0.25, mark=False)
    assert MARKS.of(acc, 0, n) is None
    acc, ctl, plan, _, _ = _measure(x, 0, n, np.float32, 0.25)
    other = Marks()   # another caller's marks, or none: the range is read
    c = HostOps.select_range(acc, 0, n, thr, want)
    assert HostOps.select_marked(acc, 0, n, thr, got, marks=other) == c and np.array_equal(got[:c], want[:c])
    assert HostOps.select_marked(acc, 0, n, thr, got) == c and np.array_equal(got[:c], want[:c])
    assert MARKS.of(acc, 0, n) is not None   # neither touched the pass's own


def test_a_mark_below_the_window_edge_is_raised_to_it():
    """The pass marks from the fine window's first edge up: a caller's lower mark cannot be
    honoured, so the kept mark is the edge and a select below it reads the range."""
    n = 8000
    x = _values(n, np.float32, 4)
    ctl = MeasuredController(n, 0.01)
    ctl.threshold, ctl.seen = 0.25, True
    plan = ctl.plan(1, np.float32)
    nb = plan.hist[0]
    w = np.zeros(plan.n_words, np.int64)
    acc = np.empty_like(x)
    edge = ctl.mark(plan)
    HostOps.accumulate_measure(np.zeros_like(x), x, acc, 0, n, (plan.hist[1], plan.hist[2], w[:nb]),
                               (plan.fine[1], plan.fine[2], w[nb:]), plan.stride, edge / 2, marks=MARKS)
    assert MARKS.of(acc, 0, n)[0] == edge
    thr = np.float32(edge * 0.75)
    want, got = np.empty(n, np.int32), np.empty(n, np.int32)
    c = HostOps.select_range(acc, 0, n, thr, want)
    assert HostOps.select_marked(acc, 0, n, thr, got, marks=MARKS) == c and np.array_equal(got[:c], want[:c])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nonfinite_in_the_owned_range_is_counted_and_marked(dtype):
    # the pass finds non-finite values of the owned range among its marks (no per-element max there)
    n, lo, hi = 20000, 3000, 17001
    x = _values(n, dtype, 4)
    x[[3001, 9000, 16999]] = [np.inf, np.nan, -np.inf]
    acc, ctl, plan, _, bad = _measure(x, lo, hi, dtype, 0.25)
    assert bad == 3
    marks = MARKS.of(acc, lo, hi)
    assert {3001, 9000, 16999} <= set(marks[1].tolist())
    _, _, _, _, clean = _measure(_values(n, dtype, 4), lo, hi, dtype, 0.25)
    assert clean == 0
