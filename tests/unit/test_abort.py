"""An exception on one rank ends the whole job, whichever MPI runs it (the MPICH lanes and the
Open MPI lane run this file): launched as ``python -m mpi4py``, the failing rank aborts the world
instead of leaving the others in a collective."""
import os
import subprocess
import sys
import time

import pytest

from tests.launch import MPIEXEC, ROOT, child_env


@pytest.mark.parametrize("n,fail_rank", [(2, 1), (3, 2)])
def test_an_exception_on_one_rank_ends_every_rank(n, fail_rank):
    if MPIEXEC is None:
        pytest.skip("no mpiexec on PATH")
    cmd = ["timeout", "-k", "5", "120", MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py",
           os.path.join(ROOT, "tests", "fault_job.py"), str(fail_rank), "3"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, stdin=subprocess.DEVNULL)
    took = time.monotonic() - t0
    text = p.stdout + p.stderr
    assert p.returncode not in (0, 124, 137), f"rc {p.returncode} after {took:.0f} s\n{text[-3000:]}"
    assert f"fault drill: rank {fail_rank} fails at step 3" in text and "Traceback" in text, text[-3000:]
    assert "finished without the fault" not in text


@pytest.mark.parametrize("n,what", [(2, "exdyna"), (3, "exdyna"), (2, "wagma")])
def test_a_stopped_rank_ends_the_job_within_the_timeout(n, what):
    """One rank stops (SIGSTOP) without dying: the others' waits are bounded (EXDYNA_TIMEOUT_S=4),
    so the job ends soon after, with a message that names the wait, the rank and the bound."""
    if MPIEXEC is None:
        pytest.skip("no mpiexec on PATH")
    stopped = n - 1
    cmd = ["timeout", "-k", "5", "120", MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py",
           os.path.join(ROOT, "tests", "fault_job.py"), str(stopped), "3", "stop", what]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=child_env({"EXDYNA_TIMEOUT_S": "4"}), capture_output=True, text=True,
                       stdin=subprocess.DEVNULL)
    took = time.monotonic() - t0
    text = p.stdout + p.stderr
    assert p.returncode not in (0, 124, 137) and took < 60, f"rc {p.returncode} after {took:.0f} s\n{text[-3000:]}"
    assert f"rank {stopped} stops at step 3" in text, text[-3000:]
    assert "has waited" in text and "past the timeout of 4 s" in text, text[-3000:]
    assert "finished without the fault" not in text
