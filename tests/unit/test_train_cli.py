"""jobs/train.py end to end: a tiny 2-rank run under mpiexec writes its metrics and its plot.

The job runs in a subprocess (its own mpiexec), with PMI variables of any enclosing launch removed so
the child starts its own MPI world.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed")
pytest.importorskip("sklearn", reason="scikit-learn is not installed")
pytest.importorskip("matplotlib", reason="matplotlib is not installed")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


def _run(tmp_path, *args):
    if MPIEXEC is None:
        pytest.skip("no mpiexec on PATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPI_LOCAL"))}
    env.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")
    env.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT", "16")
    out = tmp_path / "out"
    cmd = ["timeout", "300", MPIEXEC, "-n", "2", sys.executable, os.path.join(ROOT, "jobs", "train.py"),
           "--out", str(out), "--no-progress", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=320)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return proc.stdout, out, recs


def test_compare_dense_exdyna_writes_metrics_and_plot(tmp_path):
    stdout, out, recs = _run(tmp_path, "--compare", "dense,exdyna", "--epochs", "2", "--max-steps", "4",
                             "--width", "4", "--density", "0.05")
    runs = [r for r in recs if r["kind"] == "run"]
    assert [r["run"] for r in runs] == ["dense", "exdyna d=0.05"]
    assert all(r["params_identical"] and r["ranks"] == 2 and r["steps"] == 8 for r in runs)
    steps = [r for r in recs if r["kind"] == "step" and r["sparsifier"] == "exdyna"]
    epochs = [r for r in recs if r["kind"] == "epoch" and r["sparsifier"] == "exdyna"]
    assert len(steps) == 8 and len(epochs) == 2
    dense = next(r for r in runs if r["sparsifier"] == "dense")
    sparse = next(r for r in runs if r["sparsifier"] == "exdyna")
    # Bytes: dense is the ring-allreduce volume (plus the count words); ExDyna sends less than dense.
    assert dense["bytes_ratio"] >= 1.0 and sparse["bytes_sent_per_step"] < dense["bytes_sent_per_step"]
    assert 0 < sparse["density"] < 1 and dense["density"] == 1.0
    assert all(k in steps[0] for k in ("loss", "density", "imbalance", "bytes_sent", "t_compute",
                                       "t_select", "t_exchange"))
    assert (out / "train.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bit-identical on all 2 ranks" in stdout and "| run" in stdout


def test_big_model_path_runs(tmp_path):
    # --model big at width 1 (~0.3M parameters) exercises the synthetic-data path quickly.
    stdout, out, recs = _run(tmp_path, "--model", "big", "--width", "1", "--epochs", "1", "--max-steps", "2",
                             "--no-plot", "--sparsifier", "micro", "--opt", "controller=faithful")
    run = next(r for r in recs if r["kind"] == "run")
    assert run["sparsifier"] == "micro" and run["steps"] == 2 and run["params_identical"]
    assert not (out / "train.png").exists()
