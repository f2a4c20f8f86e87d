"""The measured controller (ExDyna's default) and its host kernels, at P=1, against NumPy."""
import numpy as np
import pytest
from mpi4py import MPI

import exdyna_mpi
from exdyna_mpi.algorithm.controllers import MeasuredController
from exdyna_mpi.arrays.ops import HostOps
from exdyna_mpi.kernels import cpu_controller as kc


def _vec(rng, n, dtype):
    x = (rng.standard_t(3, n) * 0.01).astype(dtype)
    x[:: 97] = 0
    return x


def _ref_hists(acc, lo, hi, coarse, fine, stride):
    """NumPy: the histograms of |acc| over [lo, hi) the measuring pass makes (the bucket rule of
    exdyna_mpi/kernels/cpu_controller.py), the coarse one of every ``stride``-th element (global index)."""
    bits, sign_off = kc.int_view(acc)

    def hist(b, w):
        j = ((b & sign_off) >> w.shift).astype(np.int64) - w.key0
        return np.bincount(np.clip(j, 0, w.buckets - 1), minlength=w.buckets)

    return hist(bits[-(-lo // stride) * stride:hi:stride], coarse), hist(bits[lo:hi], fine)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("stride", [1, 16])
def test_measuring_pass_equals_numpy(dtype, stride):
    """accumulate_measure: acc, and the words of the histograms of |acc| over the owned range."""
    rng = np.random.default_rng(1)
    n, lo, hi = 50_001, 7_003, 31_777
    r, g = _vec(rng, n, dtype), _vec(rng, n, dtype)
    c = MeasuredController(n, 0.01)
    c.threshold, c.seen = 0.05, True
    coarse, fine = c.window_specs(dtype)
    a1 = np.empty(n, dtype)
    h1, f1 = np.zeros(coarse[0], np.int64), np.zeros(fine[0], np.int64)
    bad1 = HostOps.accumulate_measure(r, g, a1, lo, hi, (coarse[1], coarse[2], h1), (fine[1], fine[2], f1), stride)
    h2, f2 = _ref_hists(r + g, lo, hi, coarse, fine, stride)
    assert a1.tobytes() == (r + g).tobytes()
    assert bad1 == 0
    assert (h1 == h2).all() and (f1 == f2).all()
    assert f1.sum() == hi - lo and h1.sum() == len(range(-(-lo // stride) * stride, hi, stride))
    g[[3, 40_000]] = np.inf
    g[20_000] = np.nan
    assert HostOps.accumulate_measure(r, g, a1, lo, hi, (coarse[1], coarse[2], h1), None, stride) == 3


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_band_histogram_equals_the_plain_one(dtype):
    rng = np.random.default_rng(2)
    x = _vec(rng, 30_000, dtype)
    x[[5, 6]] = [np.nan, -np.inf]
    bits, sign_off = kc.int_view(x)
    mb = 23 if dtype == np.float32 else 52
    key = int(np.array([0.02], dtype).view(bits.dtype)[0])
    for nb, shift in ((66, mb - 9), (194, mb - 9), (66, mb - 6), (64, mb - 3)):
        key0 = (key >> shift) - nb // 2
        want, got = np.zeros(nb, np.int64), np.zeros(nb, np.int64)
        kc.hist_range(bits, 11, 29_000, sign_off, bits.dtype.type(shift), bits.dtype.type(key0), want)
        HostOps.hist_range(x, 11, 29_000, shift, key0, got)
        assert (want == got).all(), (nb, shift)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_threshold_selects_exactly_the_measured_count_near_k(dtype):
    """P=1: every step selects the count the summed histogram gave, within 3 % of k on a smooth
    vector (the pile error feedback leaves after a drop of scale can put ~2 % of k in one fine
    bucket), whether the fine window holds the k-th value or a zoom is needed (scale x0.1, x30)."""
    n, d = 200_000, 0.005
    sp = exdyna_mpi.ExDyna(n, d, MPI.COMM_SELF)
    rng = np.random.default_rng(3)
    k = int(n * d)
    for t, scale in enumerate((1, 1, 1, 0.1, 0.1, 30, 30, 1)):
        g = (rng.standard_normal(n) * scale).astype(dtype)
        acc = sp.residual + g
        sp.step(g)
        s = sp.stats
        assert s.selected == sp.controller.expected == int(np.count_nonzero(np.abs(acc) >= s.threshold)), t
        assert abs(s.selected / k - 1) <= 0.03, (t, s.selected / k, sp.controller.zooms)


def test_sparse_and_zero_accumulators():
    """Fewer non-zeros than k: all of them are selected; an all-zero vector selects nothing."""
    n = 10_000
    sp = exdyna_mpi.ExDyna(n, 0.01, MPI.COMM_SELF)           # k = 100
    g = np.zeros(n, np.float32)
    g[[3, 500, 9_000]] = [1e-3, -2.0, 7e5]
    sp.step(g)
    assert sp.stats.selected == 3
    sp.step(np.zeros(n, np.float32))
    assert sp.stats.selected == 0


def test_state_round_trip_resumes_bit_exactly():
    n = 20_000
    rng = np.random.default_rng(4)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(6)]
    a = exdyna_mpi.ExDyna(n, 0.01, MPI.COMM_SELF)
    for g in grads[:3]:
        a.step(g)
    b = exdyna_mpi.ExDyna(n, 0.01, MPI.COMM_SELF)
    b.load_state_dict(a.state_dict())
    for g in grads[3:]:
        assert a.step(g).tobytes() == b.step(g).tobytes()
        assert a.stats.threshold == b.stats.threshold


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_one_edge_is_the_edges_entry(dtype):
    # _edge (a step's one or two edges, no array) against _edges, where keys fit the dtype's width
    mb, width = (23, 32) if dtype == np.float32 else (52, 64)
    top = (1 << (width - 1)) - 1
    for shift in (mb, mb - 3, mb - 7, mb - 12, 1, 0):
        for key0 in (-5, 0, 1, 100, (top >> shift) - 8, (top >> shift) - 12):
            edges = MeasuredController._edges(dtype, shift, key0, 8)
            for j in range(9):
                one = MeasuredController._edge(dtype, shift, key0 + j)
                assert type(one) is float
                assert one == edges[j] or (np.isnan(one) and np.isnan(edges[j])), (shift, key0, j)


def test_locate_finds_the_last_edge_with_k_above():
    # _locate's search against the definition: the largest j >= 1 with above[j] >= k, else 0
    c = MeasuredController(10**6, 0.001)
    rng = np.random.default_rng(3)
    for _ in range(3000):
        n = int(rng.integers(2, 40))
        hist = rng.integers(0, 3, n) * rng.integers(0, 2000, n)
        c.k = int(rng.integers(1, 3000))
        above = np.cumsum(hist[::-1])[::-1]
        ok = [j for j in range(1, n) if above[j] >= c.k]
        j, got_above = c._locate(hist)
        assert j == (ok[-1] if ok else 0)
        assert np.array_equal(got_above, above)


def _aligned(n, dtype, offset):
    """``n`` elements of ``dtype`` starting ``offset`` elements after a 64-byte boundary."""
    item = np.dtype(dtype).itemsize
    raw = np.empty((n + offset) * item + 64, np.uint8)
    at = (-raw.ctypes.data) % 64 + offset * item
    return raw[at:at + n * item].view(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [0, 1, 4, 16])
def test_measuring_pass_at_every_alignment_of_acc(dtype, offset):
    # the pass's fused vector loop runs where acc's chunk starts on 64 bytes, the copy path
    # elsewhere: the same words, marks and values either way, against NumPy
    rng = np.random.default_rng(offset)
    n, lo, hi = 40_000, 4_096, 37_000        # lo: a multiple of 32, as block partitions are
    r, g = _vec(rng, n, dtype), _vec(rng, n, dtype)
    g[[5_000, 9_999]] = [np.inf, np.nan]      # inside the owned range: marked, counted
    c = MeasuredController(n, 0.01)
    c.threshold, c.seen = 0.05, True
    coarse, fine = c.window_specs(dtype)
    acc = _aligned(n, dtype, offset)
    h1, f1 = np.zeros(coarse[0], np.int64), np.zeros(fine[0], np.int64)
    marks, vals = np.full(hi - lo, -1, np.int64), np.full(hi - lo, -1, dtype)
    bad, nm = kc.host_accumulate_measure(r, g, acc, lo, hi, (coarse[1], coarse[2], h1), (fine[1], fine[2], f1), 16,
                                         marks, 1, vals)
    want = r + g
    h2, f2 = _ref_hists(want, lo, hi, coarse, fine, 16)
    assert acc.tobytes() == want.tobytes()
    assert (h1 == h2).all() and (f1 == f2).all() and bad == 2
    bits, sign_off = kc.int_view(want)
    low = (int(fine[2]) + 1) << int(fine[1])
    where = lo + np.flatnonzero((bits[lo:hi] & sign_off) >= low)
    assert nm == where.size and np.array_equal(marks[:nm], where)
    assert vals[:nm].tobytes() == want[where].tobytes()
