"""ExDyna through CudaOps + DeviceExchange (simulated device) equals the CPU ExDyna, bit for bit."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

import exdyna_mpi
from .simdevice import simulated, step_both

HERE = os.path.dirname(__file__)


def _pair(cls, n, density, aware, **kw):
    ref = cls(n, density, MPI.COMM_SELF, device="cpu", **kw)
    dev = simulated(cls, n, density, MPI.COMM_SELF, cuda_aware=aware, **kw)
    assert dev.device == "cuda" and dev.exchange.cuda_aware is aware
    return ref, dev


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("aware", [False, True], ids=["staged", "direct"])
def test_exdyna_p1_matches_cpu(dtype, aware):
    n = 2000
    ref, dev = _pair(exdyna_mpi.ExDyna, n, 0.02, aware, n_blocks=16, block_align=32)
    rng = np.random.default_rng(5)
    total = 0
    for step in range(4):
        g = (rng.standard_normal(n) * 0.04).astype(dtype)
        _, got = step_both(ref, dev, g, step)
        assert got.dtype == dtype
        assert dev.stats.selected == ref.stats.selected
        total += dev.stats.selected
        assert dev.stats.threshold == ref.stats.threshold
    assert total > 0
    assert dev.state_dict()["controller_state"] == ref.state_dict()["controller_state"]


def test_micro_and_out_buffer_match_cpu():
    n = 1200
    ref, dev = _pair(exdyna_mpi.MiCRO, n, 0.05, False)
    rng = np.random.default_rng(8)
    for _ in range(3):
        g = (rng.standard_normal(n) * 0.05).astype(np.float32)
        o1, o2 = np.empty(n, np.float32), np.empty(n, np.float32)
        ref.step(g.copy(), out=o1)
        dev.step(g.copy(), out=o2)
        assert o1.tobytes() == o2.tobytes()
        assert dev.residual.tobytes() == ref.residual.tobytes()


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_nonfinite_refused_state_untouched(policy):
    n = 800
    ref, dev = _pair(exdyna_mpi.ExDyna, n, 0.05, False, n_blocks=8, block_align=32)
    ref = exdyna_mpi.ExDyna(n, 0.05, MPI.COMM_SELF, device="cpu", nonfinite=policy, n_blocks=8, block_align=32)
    dev = simulated(exdyna_mpi.ExDyna, n, 0.05, MPI.COMM_SELF, nonfinite=policy, n_blocks=8, block_align=32)
    rng = np.random.default_rng(2)
    g = (rng.standard_normal(n) * 0.05).astype(np.float32)
    ref.step(g.copy())
    dev.step(g.copy())
    before = dev.residual.copy()
    bad = g.copy()
    bad[[3, 700]] = [np.nan, np.inf]  # one inside the owned range at P=1, one too
    if policy == "raise":
        with pytest.raises(exdyna_mpi.StepError,
                           match="(?i)non-finite|nonfinite"):
            dev.step(bad)
    else:
        out = dev.step(bad)
        assert dev.stats.skipped and not out.any()
    assert dev.residual.tobytes() == before.tobytes() and dev.iteration == 1
    # and the next good step still matches the CPU path
    g2 = (rng.standard_normal(n) * 0.05).astype(np.float32)
    assert dev.step(g2.copy()).tobytes() == ref.step(g2.copy()).tobytes()


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec")
def test_two_ranks_under_mpiexec():
    """The simulated device path at P=2 (staged and direct) equals the CPU path on both ranks, also
    with per-rank quotas (``max_imbalance``) moving selections, 16-bit values and ``output="sign"``."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", MPIR_CVAR_CH4_PROGRESS_THROTTLE="1",
               MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT="16")
    cmd = ["timeout", "300", "mpiexec", "-n", "2", sys.executable,
           os.path.join(HERE, "sim_exdyna_run.py")]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=330)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "SIM-EXDYNA OK P = 2" in p.stdout


def test_deadline_mode_on_the_device_matches_cpu_exact():
    """The deadline exchange on device buffers (host copies of indices/values, a device union):
    the exact exchange's bits on the CPU (P=1: every chunk is its own)."""
    n = 2000
    ref = exdyna_mpi.ExDyna(n, 0.02, MPI.COMM_SELF, device="cpu", n_blocks=16, block_align=32)
    dev2 = simulated(exdyna_mpi.ExDyna, n, 0.02, MPI.COMM_SELF, cuda_aware=False, n_blocks=16, block_align=32,
                     deadline_ms=1000, max_loss=0.0)
    rng = np.random.default_rng(9)
    for step in range(3):
        g = (rng.standard_normal(n) * 0.04).astype(np.float32)
        step_both(ref, dev2, g, step)
        assert dev2.stats.deadline["deferred"] == 0.0
    dev2.close()


@pytest.mark.parametrize("aware", [False, True], ids=["staged", "direct"])
def test_sign_output_p1_matches_cpu(aware):
    n = 2000
    ref, dev = _pair(exdyna_mpi.ExDyna, n, 0.02, aware, n_blocks=16, block_align=32, output="sign")
    rng = np.random.default_rng(6)
    for step in range(4):
        g = (rng.standard_normal(n) * 0.04).astype(np.float32)
        _, got = step_both(ref, dev, g, step)
        assert np.isin(np.asarray(got), (-1.0, 0.0, 1.0)).all() and np.asarray(got).any()
