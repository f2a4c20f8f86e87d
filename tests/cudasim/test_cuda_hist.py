"""The CUDA histogram kernels the measured controller uses (exdyna_mpi/kernels/cuda/measure.py: the zoom's
``hist_range``, the measuring pass through CudaOps) under the simulator, bit for bit against the
CPU kernels of exdyna_mpi/kernels/cpu_controller.py and HostOps; and ExDyna's default controller through
CudaOps."""
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

import exdyna_mpi
from exdyna_mpi.arrays import HostOps
from exdyna_mpi.arrays.cuda_ops import CudaOps
from exdyna_mpi.kernels import cpu_controller as cpu
from exdyna_mpi.kernels import cuda as kc
from exdyna_mpi.kernels.cuda.select import _count

from .simdevice import simulated, step_both

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
    """Values over many octaves (the window clamps at both ends), a cluster near ``thr`` (many
    buckets filled), exact zeros of both signs, subnormals, and non-finite entries."""
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


def test_cuda_ops_hist_range_matches_hostops():
    """``Ops.hist_range`` on CudaOps runs the CUDA kernel and reads back one block of words,
    bit-identical to HostOps."""
    r, g = _inputs(256, np.float64, seed=11, thr=1.0)
    acc = r + g
    win, _ = _windows(np.float64, 1.0, False)
    res = []
    for ops in (HostOps, CudaOps):
        h = np.zeros(64, np.int64)
        ops.hist_range(acc, 3, 250, win[0], win[1], h)
        res.append(h.tolist())
    assert res[0] == res[1] and sum(res[0]) == 247


def test_too_many_buckets_refused():
    x = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="HIST_MAX"):
        kc.hist_range(x, 0, 10, 20, 0, np.zeros(kc.HIST_MAX + 1, np.int64))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exdyna_measured_controller_matches_cpu(dtype):
    """ExDyna (the default measured controller) through CudaOps equals the CPU ExDyna over 5 steps
    at P=1, through a drop of gradient scale, and the device path runs the CUDA measuring pass."""
    launches, full_selects = [], []

    def seen(kernel, blocks, threads, args):
        if kernel is kc.measure_kernel(dtype):
            launches.append(1)
        elif kernel is _count and args[-1]:   # a full select's count pass (count_range's has no marks)
            full_selects.append(1)

    with kc.configured(on_launch=seen):
        _steps(dtype)
    assert len(launches) >= 5
    # steps 1..4 select from the pass's marks, except a zoom below them
    assert len(full_selects) <= 2, full_selects


def _steps(dtype):
    n = 1500
    ref = exdyna_mpi.ExDyna(n, 0.02, MPI.COMM_SELF, device="cpu", n_blocks=16, block_align=32)
    dev = simulated(exdyna_mpi.ExDyna, n, 0.02, MPI.COMM_SELF, n_blocks=16, block_align=32)
    assert ref.options["controller"] == "measured"
    rng = np.random.default_rng(5)
    for step in range(5):
        g = (rng.standard_normal(n) * (0.04 if step < 3 else 0.004)).astype(dtype)
        step_both(ref, dev, g, step)
        assert dev.stats.selected == ref.stats.selected and dev.stats.threshold == ref.stats.threshold
    assert dev.state_dict()["controller_state"] == ref.state_dict()["controller_state"]


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
