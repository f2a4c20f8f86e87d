"""state_dict resumes bit-exactly in fresh processes: interrupted after step 7 vs uninterrupted."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = "tests.resume_job"   # run as a module from ROOT, so it imports tests.reference


def _mpiexec(n, *args):
    exe = shutil.which("mpiexec")
    if exe is None:
        pytest.fail("mpiexec is not on PATH: run the tests through tests/run_all.sh (it activates the venv)")
    cmd = ["timeout", "-k", "5", "240", exe, "-n", str(n), sys.executable, "-m", JOB, *args]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"{' '.join(cmd)} -> rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"


@pytest.mark.parametrize("nranks", [2, 3])
def test_resume_after_step_7_in_new_processes(tmp_path, nranks):
    d = str(tmp_path)
    _mpiexec(nranks, "--mode", "full", "--dir", d)
    _mpiexec(nranks, "--mode", "first", "--dir", d)
    _mpiexec(nranks, "--mode", "resume", "--dir", d)
    for r in range(nranks):
        full = np.load(os.path.join(d, f"full{r}.npz"))
        resumed = np.load(os.path.join(d, f"resume{r}.npz"))
        assert sorted(full.files, key=int) == [str(t) for t in range(8, 21)]
        for t in full.files:
            assert full[t].tobytes() == resumed[t].tobytes(), f"rank {r} step {t} differs"
        assert any(np.count_nonzero(full[t]) for t in full.files), "outputs are all zero: nothing was tested"
