"""jobs/train.py --compare dense,wagma,local on 2 ranks, and jobs/bench_straggler.py runs end to end."""
import json

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed")
pytest.importorskip("sklearn", reason="scikit-learn is not installed")

from tests.launch import run_job  # noqa: E402


def test_train_compare_dense_wagma_local(tmp_path):
    out = tmp_path / "out"
    stdout = run_job(2, "train.py", "--compare", "dense,wagma,local", "--epochs", "2", "--max-steps", "3",
                     "--width", "2", "--sync-every", "4", "--group-size", "2", "--no-progress", "--no-plot",
                     "--out", str(out))
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    runs = [r for r in recs if r["kind"] == "run"]
    assert [r["sparsifier"] for r in runs] == ["dense", "wagma", "local"]
    # After the epoch-end global average every rank holds the same model.
    assert all(r["params_identical"] and r["steps"] == 6 for r in runs)
    assert "wagma S=2 T=4 wait_avoiding" in stdout and "local T=4" in stdout


def test_bench_straggler_runs(tmp_path):
    stdout = run_job(2, "bench_straggler.py", "--steps", "12", "--width", "2", "--sync-every", "4",
                     "--out", str(tmp_path))
    rows = json.loads((tmp_path / "P2_rotating1.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["allreduce", "local", "wagma-sync", "wagma-wa"]
    assert all(r["steps"] == 12 and r["steps_per_s"] > 0 and 0 <= r["test_acc"] <= 1 for r in rows)
    assert all(r["max_staleness"] <= 3 for r in rows) and "| wagma-wa |" in stdout
