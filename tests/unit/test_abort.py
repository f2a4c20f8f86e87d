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
