"""The CUDA histogram kernels (kernels/cuda.py) under the simulator, bit for bit against the CPU
kernels of kernels/cpu_controller.py; and ExDyna's default controller through CudaOps."""
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

import exdyna_mpi
from exdyna_mpi.arrays.cuda_ops import CudaOps
from exdyna_mpi.arrays import HostOps
from exdyna_mpi.kernels import cpu_controller as cpu
from exdyna_mpi.kernels import cuda as kc

from .simdevice import simulated

HERE = os.path.dirname(__file__)


def _ity(dtype):
    return np.int32 if dtype == np.float32 else np.int64


def _mb(dtype):
    return 23 if dtype == np.float32 else 52


def _key(x, dtype, shift):
    return int(np.array([x], dtype).view(_ity(dtype))[0]) >> shift


def _bits(a):
    return a.view(_ity(a.dtype))


def _inputs(n, dtype, seed, thr, bad=()):
    """Values over many octaves (both windows clamp at both ends), a cluster near ``thr`` (the fine
    window sees many buckets), exact zeros of both signs, subnormals, a last element whose forecast
    shows which neighbour it took, and non-finite entries."""
    rng = np.random.default_rng(seed)
    span = 30 if dtype == np.float32 else 200
    r = (rng.standard_normal(n) * 2.0 ** rng.integers(-span, span, n)).astype(dtype)
    g = (rng.standard_normal(n) * 2.0 ** rng.integers(-span, 4, n)).astype(dtype)
    near = rng.random(n) < 0.4
    r[near] = (thr * (1 + 0.004 * rng.standard_normal(near.sum()))).astype(dtype)
    g[near] = (thr * 1e-3 * rng.standard_normal(near.sum())).astype(dtype)
    sub = np.finfo(dtype).smallest_subnormal
    special = [(0.0, 0.0), (-0.0, 0.0), (-0.0, -0.0), (sub * 3, 0.0), (0.0, -sub * 7), (sub * 2 ** 20, sub),
               (np.finfo(dtype).tiny, -sub)]
    for k, (a, b) in enumerate(special):
        if 2 * k + 1 < n:
            r[2 * k + 1], g[2 * k + 1] = a, b
    if n >= 2:  # the last element: acc = 0, and its two candidate neighbours in different buckets
        g[-2], g[-1] = dtype(3 * thr), dtype(0.5 * thr)
        r[-1] = -g[-1]
    for i, v in bad:
        g[i] = v
    return r, g


def _windows(dtype, thr, fine, where="thr"):
    """(shift, key0, nh) and the fine (shift_f, key0_f, nf) as the controller builds them around
    ``thr``; ``where="bottom"`` puts the coarse window on the subnormals, ``"top"`` on inf/NaN."""
    shift = _mb(dtype) - 3
    key0 = {"thr": _key(thr, dtype, shift) - 32, "bottom": -5,
            "top": (int(np.iinfo(_ity(dtype)).max) >> shift) - 40}[where]
    fshift = _mb(dtype) - 9
    return (shift, key0, 64), ((fshift, _key(thr, dtype, fshift) - 32, 64) if fine else None)


def _run_both(r, g, lo, hi, thr, win, fwin, predict, forecast, scratch=None, stride=1):
    """The CPU kernel and the CUDA one on the same inputs; returns both results."""
    n, dtype = r.shape[0], r.dtype
    out = []
    for impl in ("cpu", "cuda"):
        acc = np.full(n, 7, dtype)
        idx = np.full(max(hi - lo, 1), -1, _ity(dtype))
        hist = np.full(win[2], 5, np.int64)  # added to, not overwritten
        fine = (fwin[0], fwin[1], np.full(fwin[2], 3, np.int64)) if fwin else None
        args = (r, g, acc, lo, hi, dtype.type(thr), idx, win[0], win[1], hist, predict, fine, forecast)
        if impl == "cpu":
            c, bad = cpu.host_accumulate_select_hist(*args, stride=stride)
        else:
            c, bad = kc.accumulate_select_hist(*args, scratch=scratch, stride=stride)
        out.append(dict(c=c, bad=bad, acc=_bits(acc).copy(), idx=idx[:c].copy(), hist=hist,
                        fine=fine[2] if fine else None))
    return out


def _assert_same(want, got):
    assert (got["c"], got["bad"]) == (want["c"], want["bad"])
    np.testing.assert_array_equal(got["acc"], want["acc"])
    np.testing.assert_array_equal(got["idx"], want["idx"])
    np.testing.assert_array_equal(got["hist"], want["hist"])
    if want["fine"] is not None:
        np.testing.assert_array_equal(got["fine"], want["fine"])


# (n, lo, hi, forecast, fine, non-finite): simulator launches are 2 blocks of 32 threads, so
# 37..211 starts and ends mid-block; the forecast range is the selection range (None), overlaps it,
# is disjoint from it, holds the vector's last element (its neighbour is the one before), is 1 or 2
# elements, or empty; the vector is 1 or 2 elements. Non-finite entries sit in the selection range
# or outside the forecast (see test_inf_forecast_outside_selection for the one case between).
CASES = [
    (300, 37, 211, None, True, ()),
    (300, 37, 211, None, False, ((50, np.nan), (120, np.inf), (290, -np.inf))),
    (300, 37, 211, (100, 300), True, ()),
    (300, 150, 299, (0, 150), False, ((160, -np.inf),)),
    (300, 0, 300, (299, 300), True, ()),
    (300, 64, 66, (298, 300), True, ()),
    (300, 64, 65, (64, 65), False, ()),
    (300, 100, 100, (100, 100), True, ((7, np.nan),)),
    (300, 100, 100, (10, 90), True, ()),
    (1, 0, 1, None, True, ()),
    (2, 0, 2, (1, 2), True, ()),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("predict", [False, True], ids=["acc", "predict"])
@pytest.mark.parametrize("n,lo,hi,forecast,fine,bad", CASES)
def test_accumulate_select_hist_matches_cpu(n, lo, hi, forecast, fine, bad, predict, dtype):
    thr = 1.0
    r, g = _inputs(n, dtype, seed=n + lo + hi, thr=thr, bad=bad)
    r0, g0 = r.copy(), g.copy()
    win, fwin = _windows(dtype, thr, fine)
    want, got = _run_both(r, g, lo, hi, thr, win, fwin, predict, forecast)
    _assert_same(want, got)
    assert want["bad"] == len(bad)
    flo, fhi = forecast or (lo, hi)
    assert want["hist"].sum() - 5 * 64 == fhi - flo  # every forecast element counted once
    np.testing.assert_array_equal(_bits(r), _bits(r0))  # inputs only read
    np.testing.assert_array_equal(_bits(g), _bits(g0))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("where", ["bottom", "top"])
def test_windows_at_the_ends_of_the_float_range(dtype, where):
    """Subnormals and zeros in distinct buckets (bottom); inf and NaN by their exact bits (top)."""
    n, lo, hi = 200, 10, 190
    r, g = _inputs(n, dtype, seed=3, thr=1.0, bad=((20, np.nan), (21, np.inf), (22, -np.inf)))
    if where == "bottom":
        r[100:160] = np.finfo(dtype).smallest_subnormal * np.arange(60) * 2 ** (_mb(dtype) - 6)  # keys 0..7
        g[100:160] = 0
    win, _ = _windows(dtype, 1.0, False, where)
    for predict in (False, True):
        want, got = _run_both(r, g, lo, hi, 1.0, win, None, predict, None)
        _assert_same(want, got)
        if where == "bottom":  # the window really spreads them out
            assert np.count_nonzero(want["hist"] - 5) > 4
        else:  # inf and NaN in their own buckets, below the top one
            for v in (np.inf, np.nan):
                assert want["hist"][_key(v, dtype, win[0]) - win[1]] > 5


def test_scratch_reused_and_launch_shapes(monkeypatch):
    """A reused scratch leaks nothing between calls; 3 blocks of 48 threads (not whole warps)."""
    monkeypatch.setattr(kc, "BLOCK", 48)
    monkeypatch.setattr(kc, "GRID_MAX", 3)
    monkeypatch.setattr(kc, "IPT", 5)
    r, g = _inputs(400, np.float32, seed=9, thr=0.5)
    win, fwin = _windows(np.float32, 0.5, True)
    scratch = kc.new_scratch()
    for forecast in [(30, 370), None]:
        want, got = _run_both(r, g, 45, 333, 0.5, win, fwin, True, forecast, scratch=scratch)
        _assert_same(want, got)


@pytest.mark.parametrize("stride,forecast", [(8, (0, 300)), (8, (101, 277)), (3, (37, 211))])
def test_coarse_stride_samples_by_global_index(stride, forecast):
    """The coarse histogram counts only indices divisible by ``stride``; the fine one counts all."""
    r, g = _inputs(300, np.float32, seed=9, thr=1.0)
    win, fwin = _windows(np.float32, 1.0, True)
    want, got = _run_both(r, g, 37, 211, 1.0, win, fwin, True, forecast, stride=stride)
    _assert_same(want, got)
    full, _ = _run_both(r, g, 37, 211, 1.0, win, fwin, True, forecast, stride=1)
    n_coarse = len([i for i in range(*forecast) if i % stride == 0])
    assert want["hist"].sum() - 5 * win[2] == n_coarse        # (hist starts at 5 per bucket)
    assert full["hist"].sum() - 5 * win[2] == forecast[1] - forecast[0]


def test_inf_forecast_outside_selection():
    """An infinite acc outside [lo, hi) is never selected, on either device (a refused step, but
    the counts and the forecast must still agree)."""
    r, g = _inputs(300, np.float32, seed=4, thr=1.0, bad=((250, np.inf),))
    win, fwin = _windows(np.float32, 1.0, True)
    want, got = _run_both(r, g, 37, 211, 1.0, win, fwin, True, (100, 300))
    _assert_same(want, got)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("lo,hi,where", [(0, 300, "thr"), (33, 34, "bottom"), (5, 5, "thr"), (17, 290, "top")])
def test_hist_range_matches_cpu(dtype, lo, hi, where):
    r, g = _inputs(300, dtype, seed=lo, thr=2.0, bad=((40, np.nan), (41, -np.inf)))
    x = r + g
    x0 = x.copy()
    (shift, key0, nh), _ = _windows(dtype, 2.0, False, where)
    want, got = np.zeros(nh, np.int64), np.full(nh, 2, np.int64)
    cpu.host_hist_range(x, lo, hi, shift, key0, want)
    kc.hist_range(x, lo, hi, shift, key0, got)
    np.testing.assert_array_equal(got - 2, want)
    assert want.sum() == hi - lo
    np.testing.assert_array_equal(_bits(x), _bits(x0))


def test_cuda_ops_dispatch_matches_cpu():
    """The histogram ops of the ``Ops`` protocol on CudaOps run the CUDA kernels and read back one
    block of words, bit-identical to HostOps."""
    r, g = _inputs(256, np.float64, seed=11, thr=1.0)
    win, fwin = _windows(np.float64, 1.0, True)
    res = []
    for ops in (HostOps, CudaOps):
        acc, idx = np.empty(256, np.float64), np.full(200, -1, np.int64)
        h, hf = np.zeros(64, np.int64), np.zeros(64, np.int64)
        c = ops.accumulate_select_hist(r, g, acc, 20, 220, np.float64(1.0), idx, win[0], win[1], h,
                                       True, (fwin[0], fwin[1], hf), (0, 256))
        h2 = np.zeros(64, np.int64)
        ops.hist_range(acc, 3, 250, win[0], win[1], h2)
        res.append((c, _bits(acc).tobytes(), idx[:c[0]].tolist(), h.tolist(), hf.tolist(), h2.tolist()))
    assert res[0] == res[1]
    assert res[0][0][0] > 0


def test_too_many_buckets_refused():
    x = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="HIST_MAX"):
        kc.hist_range(x, 0, 10, 20, 0, np.zeros(kc.HIST_MAX + 1, np.int64))


@pytest.mark.parametrize("controller", ["measured", "histogram"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exdyna_histogram_controllers_match_cpu(monkeypatch, dtype, controller):
    """ExDyna (the default measured controller, and the forecasting one) through CudaOps equals
    the CPU ExDyna over 5 steps at P=1, through a drop of gradient scale, and the device path runs
    the CUDA histogram kernel."""
    launches, full_selects = [], []
    name = "accumulate_measure_async" if controller == "measured" else "accumulate_select_hist_async"
    real, real_select = getattr(kc, name), kc.select_range_async
    monkeypatch.setattr(kc, name, lambda *a, **k: launches.append(1) or real(*a, **k))
    monkeypatch.setattr(kc, "select_range_async", lambda *a, **k: full_selects.append(1) or real_select(*a, **k))
    n = 1500
    opts = {} if controller == "measured" else {"controller": controller}
    ref = exdyna_mpi.ExDyna(n, 0.02, MPI.COMM_SELF, device="cpu", n_blocks=16, block_align=32, **opts)
    dev = simulated(exdyna_mpi.ExDyna, n, 0.02, MPI.COMM_SELF, n_blocks=16, block_align=32, **opts)
    assert ref.options["controller"] == controller
    rng = np.random.default_rng(5)
    for step in range(5):
        g = (rng.standard_normal(n) * (0.04 if step < 3 else 0.004)).astype(dtype)
        want = ref.step(g.copy())
        got = dev.step(g.copy())
        assert got.tobytes() == want.tobytes(), f"step {step}"
        assert dev.residual.tobytes() == ref.residual.tobytes()
        assert dev.stats.selected == ref.stats.selected and dev.stats.threshold == ref.stats.threshold
    assert dev.state_dict()["controller_state"] == ref.state_dict()["controller_state"]
    assert len(launches) >= 5
    if controller == "measured":   # steps 1..4 select from the pass's marks, except a zoom below them
        assert len(full_selects) <= 2, full_selects


def test_hist_kernels_compile_for_sm90():
    """The GPU side the simulator cannot run: register bitcast, shared atomics, no approx math."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    p = subprocess.run([sys.executable, os.path.join(HERE, "ptx_check_hist.py")], env=env,
                       capture_output=True, text=True, timeout=300)
    if p.returncode == 77:
        pytest.skip(p.stdout.strip())
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "PTX HIST OK" in p.stdout


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_accumulate_measure_matches_hostops(dtype):
    """The measured controller's pass: CudaOps (composed) gives HostOps' (fused) acc, words and
    non-finite count."""
    from exdyna_mpi.algorithm.controllers import MeasuredController
    from exdyna_mpi.arrays import HostOps
    from exdyna_mpi.arrays.cuda_ops import CudaOps

    rng = np.random.default_rng(9)
    n, lo, hi = 700, 130, 610
    r = (rng.standard_normal(n) * 0.05).astype(dtype)
    g = (rng.standard_normal(n) * 0.05).astype(dtype)
    g[[3, 400]] = [np.inf, np.nan]
    c = MeasuredController(n, 0.02)
    c.threshold, c.seen = 0.08, True
    (nb, cs, ck), (nf, fs, fk) = c.window_specs(dtype)
    words = {}
    for ops in (HostOps, CudaOps):
        h, f = np.zeros(nb, np.int64), np.zeros(nf, np.int64)
        acc = ops.empty(n, dtype)
        bad = ops.accumulate_measure(ops.from_host(r), ops.from_host(g), acc, lo, hi, (cs, ck, h), (fs, fk, f), 4)
        words[ops.device] = (np.array(ops.to_host(acc)).tobytes(), h.tolist(), f.tolist(), bad)
    assert words["cpu"] == words["cuda"] and words["cpu"][3] == 2
