"""CPU kernels against NumPy, and the exact-threshold rounding."""
import numpy as np
import pytest

from exdyna_mpi.arrays.dlpack import threshold_for
from exdyna_mpi.kernels import cpu


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n,lo,hi", [(10_007, 1_234, 8_765), (5_000, 0, 5_000), (4_097, 4_096, 4_097),
                                     (300, 150, 150), (1, 0, 1)])
def test_accumulate_select_matches_numpy(dtype, n, lo, hi):
    rng = np.random.default_rng(n + lo)
    r = rng.standard_normal(n).astype(dtype)
    g = rng.standard_normal(n).astype(dtype)
    acc = np.full(n, -7, dtype)
    idx = np.full(max(hi - lo, 1), -1, np.int32)
    thr = threshold_for(1.7, np.dtype(dtype))
    c, bad = cpu.accumulate_select(r, g, acc, lo, hi, thr, idx)
    ref = r + g
    assert acc.tobytes() == ref.tobytes()
    want = lo + np.flatnonzero(np.abs(ref[lo:hi]) >= 1.7)
    assert c == want.size and np.array_equal(idx[:c], want)
    assert bad == 0


def test_accumulate_select_counts_nonfinite_everywhere_and_leaves_inputs():
    r = np.zeros(100, np.float32)
    g = np.ones(100, np.float32)
    g[[3, 50, 99]] = [np.nan, np.inf, -np.inf]
    r[10] = np.float32(3e38)
    g[10] = np.float32(3e38)        # finite + finite overflowing to inf counts too
    r0, g0 = r.copy(), g.copy()
    acc = np.empty_like(r)
    idx = np.empty(100, np.int32)
    c, bad = cpu.accumulate_select(r, g, acc, 40, 60, np.float32(0.5), idx)
    assert bad == 4
    assert r.tobytes() == r0.tobytes() and g.tobytes() == g0.tobytes()


def test_threshold_rounding_is_exact_for_every_neighbour():
    # |x| >= t32 in float32 must agree with |x| >= thr in float64 for floats right around thr.
    for thr in (0.1, 1 / (2 * np.sqrt(11_173)), 3e-8, 1.0, 12345.678):
        t32 = threshold_for(thr, np.dtype(np.float32))
        x = np.float32(thr)
        xs = [np.nextafter(x, np.float32(-np.inf)), x, np.nextafter(x, np.float32(np.inf))]
        for v in xs:
            assert (abs(v) >= t32) == (float(abs(v)) >= thr)


def test_gather_scatter_zero():
    src = np.arange(10, dtype=np.float32)
    idx = np.array([1, 4, 9], np.int32)
    out = np.empty(3, np.float32)
    cpu.gather(src, idx, out)
    assert out.tolist() == [1, 4, 9]
    dst = np.zeros(10, np.float32)
    res = np.ones(10, np.float32)
    cpu.scatter_mean_zero(dst, res, idx, np.array([3, 6, 9], np.float32), np.float32(3))
    assert dst.tolist() == [0, 1, 0, 0, 2, 0, 0, 0, 0, 3]
    assert res.tolist() == [1, 0, 1, 1, 0, 1, 1, 1, 1, 0]
    cpu.zero_at(src, idx)
    assert src[[1, 4, 9]].tolist() == [0, 0, 0]
    assert cpu.count_range(np.array([-2, 1, 3], np.float32), 0, 3, np.float32(2)) == 2


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_host_fill_zero_writes_exactly_its_view(dtype):
    # HostOps.fill_zero memsets a contiguous buffer: +0.0 bits, nothing outside the view
    from exdyna_mpi.arrays import HostOps

    base = np.full(1003, -2.5, dtype)
    HostOps.fill_zero(base[7:1000])
    assert not base[7:1000].any() and not np.signbit(base[7:1000]).any()
    assert (base[:7] == -2.5).all() and (base[1000:] == -2.5).all()
    strided = np.full(20, 3.0, dtype)
    HostOps.fill_zero(strided[::3])
    assert not strided[::3].any() and (np.delete(strided, np.arange(0, 20, 3)) == 3.0).all()
    HostOps.fill_zero(np.empty(0, dtype))
