"""CUDA kernels under the simulator, bit for bit against the CPU kernels on small random inputs."""
import numpy as np
import pytest

from exdyna_mpi.kernels import cpu
from exdyna_mpi.kernels import cuda as kc
from exdyna_mpi.kernels.cuda.select import _compact_kernel, _compacts, _scan


def _bits(a):
    return a.view(np.int64 if a.dtype == np.float64 else np.int32)


def _inputs(n, dtype, seed, nonfinite=()):
    rng = np.random.default_rng(seed)
    r = rng.standard_normal(n).astype(dtype)
    g = rng.standard_normal(n).astype(dtype)
    for i, v in nonfinite:
        g[i] = v
    return r, g


# (n, lo, hi, thr, non-finite entries): ranges that start and end mid-block (32-element blocks,
# 32 * 32-element tiles), empty ranges, an empty selection, everything selected, n below one block.
CASES = [
    (1500, 0, 1500, 1.5, ()),
    (1500, 37, 1011, 1.0, ((5, np.inf), (700, np.nan), (1499, -np.inf))),
    (1500, 100, 100, 0.5, ((3, np.nan),)),
    (1500, 1490, 1500, 0.0, ()),
    (1500, 500, 517, 1e30, ()),
    (29, 3, 20, 0.7, ()),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n,lo,hi,thr,bad", CASES)
def test_accumulate_select_matches_cpu(n, lo, hi, thr, bad, dtype):
    r, g = _inputs(n, dtype, seed=n + lo + hi, nonfinite=bad)
    r0, g0 = r.copy(), g.copy()
    t = dtype(thr)
    acc_c, idx_c = np.empty(n, dtype), np.empty(max(hi - lo, 1), np.int32)
    acc_g, idx_g = np.full(n, 7, dtype), np.full(max(hi - lo, 1), -1, np.int32)
    c_cpu, bad_cpu = cpu.accumulate_select(r, g, acc_c, lo, hi, t, idx_c)
    c_gpu, bad_gpu = kc.accumulate_select(r, g, acc_g, lo, hi, t, idx_g)
    assert (c_gpu, bad_gpu) == (c_cpu, bad_cpu)
    assert bad_cpu == len(bad)
    np.testing.assert_array_equal(idx_g[:c_gpu], idx_c[:c_cpu])
    np.testing.assert_array_equal(_bits(acc_g), _bits(acc_c))
    # inputs only read: a refused step must lose nothing
    np.testing.assert_array_equal(_bits(r), _bits(r0))
    np.testing.assert_array_equal(_bits(g), _bits(g0))


def _select_twice(seed):
    """``accumulate_select`` twice on one scratch (nothing may leak from the previous call), each
    equal to the CPU kernel's."""
    n, lo, hi = 700, 45, 611
    r, g = _inputs(n, np.float32, seed=seed, nonfinite=((650, np.inf),))
    t = np.float32(0.8)
    acc_c, idx_c = np.empty(n, np.float32), np.empty(hi - lo, np.int32)
    acc_g, idx_g = np.empty(n, np.float32), np.full(hi - lo, -1, np.int32)
    want = cpu.accumulate_select(r, g, acc_c, lo, hi, t, idx_c)
    scratch = kc.new_scratch()
    for _ in range(2):
        got = kc.accumulate_select(r, g, acc_g, lo, hi, t, idx_g, scratch=scratch)
        assert got == want
        np.testing.assert_array_equal(idx_g[: got[0]], idx_c[: want[0]])
        np.testing.assert_array_equal(_bits(acc_g), _bits(acc_c))


@pytest.mark.parametrize("block,grid,ipt", [(64, 3, 4), (48, 1, 1), (32, 2, 5)])
def test_other_launch_shapes(block, grid, ipt):
    """Several warps per block, a block that is not a whole number of warps, 3 blocks, ipt 1."""
    launched = []
    with kc.configured(block=block, grid_max=grid, ipt=ipt, items=1,
                       on_launch=lambda k, nb, bd, args: launched.append((k, nb, bd))):
        _select_twice(seed=block)
    # the configured shape, and the compaction built for this ipt, were what ran
    assert (_compacts[(False, False, ipt)], grid, block) in launched
    assert all(nb <= grid for _, nb, _ in launched)


@pytest.mark.parametrize("lo,hi,thr", [(0, 900, 1.0), (33, 805, 2.0), (400, 400, 0.1), (10, 40, 99.0)])
def test_select_and_count_range(lo, hi, thr):
    x = np.random.default_rng(lo).standard_normal(900).astype(np.float64)
    t = np.float64(thr)
    idx_c, idx_g = np.empty(900, np.int64), np.full(900, -1, np.int64)
    c = cpu.select_range(x, lo, hi, t, idx_c)
    assert kc.select_range(x, lo, hi, t, idx_g) == c
    np.testing.assert_array_equal(idx_g[:c], idx_c[:c])
    assert kc.count_range(x, lo, hi, t) == cpu.count_range(x, lo, hi, t) == c


@pytest.mark.parametrize("nb,threads", [(1, 1), (2, 8), (7, 3), (13, 4), (1024, 8)])
def test_scan(nb, threads):
    rng = np.random.default_rng(nb)
    s = kc.new_scratch()
    s.block_counts[:nb] = rng.integers(0, 50, nb)
    s.block_bad[:nb] = rng.integers(0, 3, nb)
    _scan[1, threads](s.block_counts, s.block_bad, nb, s.offsets, s.totals)
    want = np.concatenate([[0], np.cumsum(s.block_counts[:nb])[:-1]])
    np.testing.assert_array_equal(s.offsets[:nb], want)
    assert list(s.totals) == [s.block_counts[:nb].sum(), s.block_bad[:nb].sum()]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k", [0, 1, 77])
def test_gather_scatter_zero(dtype, k):
    rng = np.random.default_rng(k)
    n = 300
    src = rng.standard_normal(n).astype(dtype)
    idx = np.sort(rng.choice(n, k, replace=False)).astype(np.int32)
    vals = rng.standard_normal(k).astype(dtype)

    out_c, out_g = np.empty(k, dtype), np.empty(k, dtype)
    cpu.gather(src, idx, out_c)
    kc.gather(src, idx, out_g)
    np.testing.assert_array_equal(_bits(out_g), _bits(out_c))

    a_c, a_g = src.copy(), src.copy()
    cpu.scatter(a_c, idx, vals)
    kc.scatter(a_g, idx, vals)
    np.testing.assert_array_equal(_bits(a_g), _bits(a_c))

    cpu.zero_at(a_c, idx)
    kc.zero_at(a_g, idx)
    np.testing.assert_array_equal(_bits(a_g), _bits(a_c))

    o_c, o_g = np.zeros(n, dtype), np.zeros(n, dtype)
    r_c, r_g = src.copy(), src.copy()
    p = dtype(3)  # a divide that rounds: the CUDA kernel must round the same way
    cpu.scatter_mean_zero(o_c, r_c, idx, vals, p)
    kc.scatter_mean_zero(o_g, r_g, idx, vals, p)
    np.testing.assert_array_equal(_bits(o_g), _bits(o_c))
    np.testing.assert_array_equal(_bits(r_g), _bits(r_c))
    if k:
        assert not r_g[idx].any() and o_g[idx].any()


def test_variant_choice():
    assert kc.SIMULATOR and kc.CONFIG.variant == "safe"
    with pytest.raises(RuntimeError, match="warp intrinsics"):
        _compact_kernel("fast")
    with pytest.raises(RuntimeError, match="warp intrinsics"):
        kc.select_range(np.ones(8, np.float32), 0, 8, np.float32(0.5), np.empty(8, np.int32), variant="fast")
    with pytest.raises(RuntimeError, match="warp intrinsics"):
        kc.CONFIG.variant = "fast"
    assert kc.CONFIG.variant == "safe"


def test_configured_sets_and_restores():
    before = kc.CONFIG.values()
    seen = []
    with kc.configured(block=64, scan_threads=1, on_launch=lambda k, nb, bd, args: seen.append((nb, bd))) as cfg:
        assert cfg is kc.CONFIG and (cfg.block, cfg.scan_threads) == (64, 1)
        assert kc.grid_shape(10_000) == (kc.CONFIG.grid_max, 64)
        kc.count_range(np.ones(300, np.float32), 0, 300, np.float32(0.5))
    assert kc.CONFIG.values() == before
    assert seen == [(kc.CONFIG.grid_max, 64), (1, 1)]   # the count pass, then the scan
    with pytest.raises(ZeroDivisionError):
        with kc.configured(block=96):
            1 / 0
    assert kc.CONFIG.values() == before   # restored after an exception too


@pytest.mark.parametrize("changes,err", [
    (dict(block=0), ValueError), (dict(block=2048), ValueError), (dict(grid_max=kc.NB_MAX + 1), ValueError),
    (dict(scan_threads=0), ValueError), (dict(items=1.5), ValueError), (dict(ipt=True), ValueError),
    (dict(variant="quick"), ValueError), (dict(launch="cupy"), ValueError), (dict(on_launch=3), TypeError),
    (dict(blocks=64), TypeError)])
def test_config_refuses_bad_values(changes, err):
    before = kc.CONFIG.values()
    with pytest.raises(err):
        with kc.configured(**changes):
            pass
    with pytest.raises(err):
        kc.CONFIG.update(**changes)
    assert kc.CONFIG.values() == before


def test_other_ipt_builds_its_kernels_once():
    """The default ipt's kernels are those built at import; another ipt compiles its own once."""
    default = kc.CONFIG.ipt
    assert _compact_kernel(None) is _compacts[(False, False, default)]
    with kc.configured(ipt=default + 3):
        k = _compact_kernel(None)
        assert k is not _compacts[(False, False, default)] and _compact_kernel(None) is k
    assert _compact_kernel(None) is _compacts[(False, False, default)]
