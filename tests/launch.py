"""Launching a job in its own MPI world from a test: ``timeout mpiexec -n N python -m mpi4py ...``.

The child gets the environment without the PMI variables of any enclosing launch (so it starts its
own world) and with MPICH's progress throttle (the lanes oversubscribe 2 cores).
"""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


def child_env(extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPI_LOCAL"))}
    env.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")
    env.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT", "16")
    env.update(extra or {})
    return env


def run_job(n, script, *args, env_extra=None):
    """``jobs/SCRIPT ARGS`` on ``n`` ranks (240 s at most); asserts exit 0 and returns its stdout."""
    if MPIEXEC is None:
        pytest.skip("no mpiexec on PATH")
    cmd = ["timeout", "-k", "5", "240", MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py",
           os.path.join(ROOT, "jobs", script), *args]
    p = subprocess.run(cmd, cwd=ROOT, env=child_env(env_extra), capture_output=True, text=True,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def launch_train(out, *args, n=2, expect=0):
    """``mpiexec -n N python -m mpi4py jobs/train.py --out OUT ...``; returns the completed process
    (``expect``: the exit status asserted, None: none)."""
    if MPIEXEC is None:
        pytest.skip("no mpiexec on PATH")
    cmd = ["timeout", "-k", "5", "300", MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py",
           os.path.join(ROOT, "jobs", "train.py"), "--out", str(out), "--no-progress", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=320)
    if expect is not None:
        assert proc.returncode == expect, f"rc {proc.returncode}\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
