"""jobs/train.py --deadline-ms/--max-loss and jobs/bench_deadline.py run end to end on 2 ranks."""
import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed")
pytest.importorskip("sklearn", reason="scikit-learn is not installed")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


def _mpiexec(n, script, *args, env_extra=None):
    if MPIEXEC is None:
        pytest.skip("no mpiexec on PATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPI_LOCAL"))}
    env.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")
    env.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT", "16")
    env.update(env_extra or {})
    cmd = ["timeout", "-k", "5", "240", MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py",
           os.path.join(ROOT, "jobs", script), *args]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def test_train_with_deadline_flags(tmp_path):
    out = tmp_path / "out"
    stdout = _mpiexec(2, "train.py", "--epochs", "1", "--max-steps", "4", "--width", "2", "--no-progress",
                      "--no-plot", "--deadline-ms", "20", "--max-loss", "0.5", "--out", str(out),
                      env_extra={"EXDYNA_TEST_SEND_DELAY_MS": "1:50"})
    runs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    runs = [r for r in runs if r["kind"] == "run"]
    assert len(runs) == 1 and runs[0]["params_identical"]
    assert "deadline_ms=20.0" in stdout and "max_loss=0.5" in stdout


def test_bench_deadline_runs(tmp_path):
    stdout = _mpiexec(2, "bench_deadline.py", "--epochs", "1", "--width", "2", "--warmup", "1",
                      "--deadlines", "5:0.5,auto:0.5", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "bench_deadline.json").read_text())["runs"]
    assert [r["variant"] for r in rows][:3] == ["exact", "exact-p2p, no delay", "exact-p2p"]
    assert all(r["deferred_max"] <= r["options"].get("max_loss", 0) + 1e-12 for r in rows)
    assert all(r["pending_before_close"] >= 0 and 0 <= r["test_acc"] <= 1 for r in rows)
    assert rows[0]["test_acc"] == rows[1]["test_acc"] == rows[2]["test_acc"]   # the same bits
    assert "| exact-p2p |" in stdout
