"""jobs/train.py --deadline-ms/--max-loss and jobs/bench_deadline.py run end to end on 2 ranks."""
import json

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed")
pytest.importorskip("sklearn", reason="scikit-learn is not installed")

from tests.launch import run_job  # noqa: E402


def test_train_with_deadline_flags(tmp_path):
    out = tmp_path / "out"
    stdout = run_job(2, "train.py", "--epochs", "1", "--max-steps", "4", "--width", "2", "--no-progress",
                     "--no-plot", "--deadline-ms", "20", "--max-loss", "0.5", "--out", str(out),
                     env_extra={"EXDYNA_TEST_SEND_DELAY_MS": "1:50"})
    runs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    runs = [r for r in runs if r["kind"] == "run"]
    assert len(runs) == 1 and runs[0]["params_identical"]
    assert "deadline_ms=20.0" in stdout and "max_loss=0.5" in stdout


def test_bench_deadline_runs(tmp_path):
    stdout = run_job(2, "bench_deadline.py", "--epochs", "1", "--width", "2", "--warmup", "1",
                     "--deadlines", "5:0.5,auto:0.5", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "bench_deadline.json").read_text())["runs"]
    assert [r["variant"] for r in rows][:3] == ["exact", "exact-p2p, no delay", "exact-p2p"]
    assert all(r["deferred_max"] <= r["options"].get("max_loss", 0) + 1e-12 for r in rows)
    assert all(r["pending_before_close"] >= 0 and 0 <= r["test_acc"] <= 1 for r in rows)
    assert rows[0]["test_acc"] == rows[1]["test_acc"] == rows[2]["test_acc"]   # the same bits
    assert "| exact-p2p |" in stdout
