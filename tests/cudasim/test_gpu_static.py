"""The static sm_90 check (jobs/gpu_static.py) passes: every kernel compiles with ptxas, no spill,
registers and SASS instructions per element within jobs/gpu_budgets.json, every kernel budgeted.

The toolchain comes from PyPI wheels in the ``test`` extra (nvidia-nvvm, nvidia-cuda-nvcc,
nvidia-cuda-nvdisasm); the check skips only where they cannot be found (exit 77)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "jobs", "gpu_static.py")


def _run(*args):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    p = subprocess.run([sys.executable, TOOL, *args], env=env, capture_output=True, text=True, timeout=600)
    if p.returncode == 77:
        pytest.skip(p.stdout.strip())
    return p


def test_static_check_within_budgets(tmp_path):
    out = tmp_path / "static.json"
    p = _run("--json", str(out))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "STATIC OK" in p.stdout
    rows = json.loads(out.read_text())["rows"]
    budgets = json.load(open(os.path.join(ROOT, "jobs", "gpu_budgets.json")))["kernels"]
    assert {r["kernel"] for r in rows} == set(budgets)
    assert all(r["spill_stores"] == 0 and r["spill_loads"] == 0 for r in rows)


def test_unbudgeted_kernel_fails_loudly(tmp_path):
    """A kernel added to any module of the package without a budget entry fails the check, by name
    (one the package does not re-export included)."""
    # the whole kernels folder: the CUDA package imports the host kernels beside it
    shutil.copytree(os.path.join(ROOT, "exdyna_mpi", "kernels"), tmp_path / "kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    pkg = tmp_path / "kernels" / "cuda"
    with open(pkg / "scatter_gather.py", "a") as f:
        f.write("\n\n@cuda.jit\ndef _added_later(x):\n    x[0] = 1\n")
    p = _run("--kernels", str(pkg), "--names-only")
    assert p.returncode == 1
    assert "_added_later: a CUDA kernel with no entry" in p.stdout
