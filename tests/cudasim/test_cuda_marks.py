"""The measuring pass's marks (exdyna_mpi/kernels/cuda: ``accumulate_measure_async`` marks ``|acc| >= mark``
in the hit mask, ``select_marked_async`` selects from the marks) under the simulator: the selection
equals ``select_range`` over ``acc`` whatever the threshold, and marks a step never used are gone
before the next selection; and the measured controller's exact local count from its fine window."""
import dataclasses

import numpy as np
import pytest

from exdyna_mpi.algorithm.controllers import MeasuredController
from exdyna_mpi.kernels import cpu
from exdyna_mpi.kernels import cuda as kc
from exdyna_mpi.kernels.cuda.measure import _marks_cover


def _values(n, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-6, 3, n))).astype(np.float32)
    x[::97] = 0.0
    x[5::89] = -0.0
    return x


def _measure(acc, lo, hi, mark, scratch):
    res = np.zeros_like(acc)
    kc.accumulate_measure_async(res, acc.copy(), acc.copy(), lo, hi, np.float32(mark), 10, 100, 4, scratch)
    return scratch


def _ref(acc, lo, hi, thr):
    idx = np.empty(max(hi - lo, 1), np.int32)
    c = cpu.select_range(acc, lo, hi, np.float32(thr), idx)
    return idx[:c].copy()


@pytest.mark.parametrize("lo,hi", [(0, 700), (37, 611), (64, 64), (1, 2)])
@pytest.mark.parametrize("rel", [1.0, 1.7, 0.6, np.nan])
def test_select_marked_equals_select_range(lo, hi, rel):
    acc = _values(700, 3)
    mark = float(np.quantile(np.abs(acc[lo:hi]), 0.9)) if hi > lo else 0.5
    thr = mark * rel   # at, above, below the mark; NaN selects nothing
    s = kc.new_scratch()
    _measure(acc, lo, hi, mark, s)
    want = _ref(acc, lo, hi, thr)
    idx = np.full(max(hi - lo, 1), -1, np.int32)
    kc.select_marked_async(acc, lo, hi, np.float32(thr), idx, s)
    count = int(s.totals[0])
    assert count == want.size and np.array_equal(idx[:count], want)
    assert s.marked is None and not s.mask.any()   # consumed: the mask is all zero again


def test_unused_marks_are_cleared_before_another_selection():
    """A step that stops after its pass (a non-finite gradient) leaves marks; the next selection,
    over another range, must not see them."""
    acc = _values(900, 4)
    s = kc.new_scratch()
    _measure(acc, 0, 900, 0.01, s)
    assert s.marked is not None and s.mask.any()
    want = _ref(acc, 300, 650, 0.5)
    idx = np.full(900, -1, np.int32)
    kc.select_marked_async(acc, 300, 650, np.float32(0.5), idx, s)   # another range: a full select
    assert np.array_equal(idx[:int(s.totals[0])], want) and not s.mask.any()
    _measure(acc, 0, 900, 0.01, s)
    idx[:] = -1
    kc.select_range_async(acc, 100, 400, np.float32(0.2), idx, s)
    assert np.array_equal(idx[:int(s.totals[0])], _ref(acc, 100, 400, 0.2)) and not s.mask.any()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_local_count_is_exact_at_fine_edges(dtype):
    """local_count (the select's count without a device read) equals the count of |x| >= edge for
    every edge of the fine window, and is None for a threshold that is not one."""
    from exdyna_mpi.kernels import cpu_controller as kcc

    n = 5000
    ctl = MeasuredController(n, 0.01)
    ctl.threshold, ctl.seen = 0.3, True
    plan = ctl.plan(1, dtype)
    x = (np.random.default_rng(6).standard_normal(n) * 0.2).astype(dtype)
    x[:40] = 0.3   # a pile at the centre edge
    coarse = np.zeros(plan.hist[0], np.int64)
    fine = np.zeros(plan.fine[0], np.int64)
    acc = np.empty_like(x)
    kcc.host_accumulate_measure(np.zeros_like(x), x, acc, 0, n, (plan.hist[1], plan.hist[2], coarse),
                                (plan.fine[1], plan.fine[2], fine), plan.stride)
    words = np.concatenate([coarse, fine])
    edges = ctl._edges(dtype, plan.fine[1], plan.fine[2], plan.fine[0])
    for e in edges[1:plan.fine[0]]:
        at = dataclasses.replace(plan, threshold=float(e))
        assert ctl.local_count(at, words) == int(np.count_nonzero(np.abs(x) >= e))
    off = dataclasses.replace(plan, threshold=float(edges[5]) * 1.0001)
    assert ctl.local_count(off, words) is None
    assert ctl.mark(off) == float(edges[1])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("where", ["above", "at", "below"])
def test_zoom_histogram_from_marks_equals_hist_range(dtype, where):
    """A zoom whose window starts at or above the mark histograms the marked elements only
    (bucket 0 from the range's length); one that starts below reads the range. Either way the
    histogram equals ``hist_range`` over the range, and the marks are still there for the select."""
    n, lo, hi = 3000, 200, 2700
    x = (np.random.default_rng(7).standard_normal(n) * 0.1).astype(dtype)
    mb = 23 if dtype == np.float32 else 52
    ity = np.int32 if dtype == np.float32 else np.int64
    mark = dtype(np.quantile(np.abs(x[lo:hi]), 0.95))
    shift = mb - 10
    key_mark = int(np.array([mark], dtype).view(ity)[0]) >> shift
    key0 = {"above": key_mark + 3, "at": key_mark, "below": key_mark - 40}[where]   # bucket 1 at key0 + 1
    nh = 40
    want = np.zeros(nh, np.int64)
    kc.hist_range(x, lo, hi, shift, key0, want)
    s = kc.new_scratch()
    kc.accumulate_measure_async(np.zeros_like(x), x.copy(), x.copy(), lo, hi, mark, 10, 100, 4, s)
    got = np.zeros(nh, np.int64)
    used = _marks_cover(s, x, lo, hi, shift, key0)
    assert used == (where != "below")
    kc.hist_range(x, lo, hi, shift, key0, got, scratch=s)
    assert np.array_equal(got, want)
    assert s.marked is not None
    idx = np.empty(hi - lo, np.int32)
    kc.select_marked_async(x, lo, hi, mark, idx, s)
    c = int(s.totals[0])
    assert np.array_equal(idx[:c], _ref(x, lo, hi, mark)) and not s.mask.any()
