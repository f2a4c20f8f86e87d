"""jobs/train.py --model lm, and ``--resume --reshard``: the language model trains (AdamW, clipping)
with a global batch that does not depend on the number of ranks, and a job checkpointed at one
number of ranks goes on at another, from the checkpoint's step, the ranks identical at the end.

The resumes at another number of ranks need ``DistributedOptimizer.load_state_dict(states,
reshard=True)``; they are skipped where the library does not take it yet.
"""
import json
import math
import shutil

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
pytest.importorskip("sklearn", reason="scikit-learn is not installed")
pytest.importorskip("matplotlib", reason="matplotlib is not installed")

from tests.launch import launch_train  # noqa: E402

LM = ("--model", "lm", "--d-model", "32", "--layers", "1", "--heads", "2", "--context", "16",
      "--epochs", "2", "--max-steps", "4", "--batch-size", "2", "--no-plot")
CNN = ("--width", "4", "--epochs", "2", "--max-steps", "5", "--compare", "dense,exdyna", "--density", "0.05",
       "--no-plot")




_launch = launch_train


def _records(out, kind=None):
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if kind is None or r["kind"] == kind]


def test_lm_trains_and_its_loss_does_not_depend_on_the_number_of_ranks(tmp_path):
    """Two ranks of 2 windows and one rank of 4 train on the same global batches: with the dense
    exchange the step losses agree to rounding, and the validation loss falls."""
    two, one = tmp_path / "two", tmp_path / "one"
    _launch(two, *LM, "--sparsifier", "dense", n=2)
    _launch(one, *LM[:-3], "--batch-size", "4", "--no-plot", "--sparsifier", "dense", n=1)
    run = _records(two, "run")[0]
    epochs = _records(two, "epoch")
    assert run["ranks"] == 2 and run["steps"] == 8 and run["params_identical"]
    assert all(math.isfinite(e["val_loss"]) for e in epochs) and len(epochs) == 2
    assert epochs[-1]["val_loss"] < run["initial_val_loss"] and run["val_loss"] == epochs[-1]["val_loss"]
    assert abs(run["initial_val_loss"] - math.log(256)) < 0.5   # an untrained byte model: about uniform
    a, b = _records(two, "step"), _records(one, "step")
    assert [r["ranks"] for r in a] == [2] * 8 and [r["ranks"] for r in b] == [1] * 8
    assert a[0]["loss"] == pytest.approx(b[0]["loss"], rel=1e-5)   # the same batch, the same parameters
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-3)


def test_resume_at_another_number_of_ranks_needs_reshard(tmp_path):
    out = tmp_path / "out"
    _launch(out, *CNN, "--fail-at", "0:3:signal", n=2, expect=75)
    proc = _launch(out, *CNN, "--resume", n=3, expect=2)
    assert "--resume refused on all 3 ranks" in proc.stderr and "it was written by 2 ranks, this job has 3" \
        in proc.stderr and "--resume --reshard continues it" in proc.stderr, proc.stderr[-2000:]
    proc = _launch(out, *CNN, "--reshard", n=1, expect=2)
    assert "--reshard goes with --resume" in proc.stderr


def test_reshard_at_the_same_number_of_ranks_resumes_to_the_same_bits(tmp_path):
    """``--resume --reshard`` where the checkpoint has this job's number of ranks is the exact resume."""
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    _launch(straight, *CNN, n=2)
    _launch(broken, *CNN, "--checkpoint-every", "4", "--fail-at", "1:13:signal", n=2, expect=75)
    proc = _launch(broken, *CNN, "--checkpoint-every", "4", "--resume", "--reshard", n=2)
    assert "resumed from job step 14" in proc.stdout and "resharded" not in proc.stdout
    assert not _records(broken, "reshard")

    def final(out):
        return {r["run"]: r["params_sha256"] for r in _records(out, "run")}
    assert final(broken) == final(straight) and len(final(straight)) == 2


def test_reshard_refuses_a_model_averaging_run(tmp_path):
    out = tmp_path / "out"
    args = ("--method", "local", "--width", "4", "--epochs", "1", "--max-steps", "6", "--no-plot")
    _launch(out, *args, "--fail-at", "0:2:signal", n=2, expect=75)
    proc = _launch(out, *args, "--resume", "--reshard", n=3, expect=2)
    assert "inside a local run" in proc.stderr, proc.stderr[-2000:]


def _steps(out):
    return [(r["run"], r["step"], r["ranks"]) for r in _records(out, "step")]


def test_lm_checkpointed_at_four_ranks_goes_on_at_three_two_and_back_at_four(tmp_path):
    """A 4-rank lm run leaves a checkpoint at step 6 (epoch 1, its third step) and runs on to the end.
    ``--resume --reshard`` at 3 and at 2 ranks ends the run with identical ranks; the first step
    after the reshard is step 6, on the checkpoint's parameters and the same global batch as the
    4-rank run's step 6 (the same loss, to rounding). From 3 ranks, checkpointed again at step 7
    (SIGUSR1), the run goes back to 4."""
    base = tmp_path / "base"
    _launch(base, *LM, "--checkpoint-every", "6", n=4)
    want = _records(base, "step")
    for n in (3, 2):
        out = tmp_path / f"p{n}"
        shutil.copytree(base, out)
        extra = ("--fail-at", "0:6:signal") if n == 3 else ()
        proc = _launch(out, *LM, "--resume", "--reshard", *extra, n=n, expect=75 if n == 3 else 0)
        assert "resumed from job step 6" in proc.stdout and f"resharded from 4 to {n} ranks" in proc.stdout
        [rs] = _records(out, "reshard")
        assert (rs["job_step"], rs["step"], rs["from_ranks"], rs["to_ranks"], rs["start_ranks"]) == (6, 6, 4, n, 4)
        got = _records(out, "step")
        assert [r["step"] for r in got] == list(range(len(got))) and [r["ranks"] for r in got[:6]] == [4] * 6
        assert [(r["step"], r["loss"]) for r in got[:6]] == [(r["step"], r["loss"]) for r in want[:6]]
        assert got[6]["ranks"] == n and got[6]["loss"] == pytest.approx(want[6]["loss"], rel=1e-5)
    done = _records(tmp_path / "p2", "run")
    assert len(done) == 1 and done[0]["params_identical"] and done[0]["ranks"] == 2 and done[0]["steps"] == 8
    back = tmp_path / "p3"
    proc = _launch(back, *LM, "--resume", "--reshard", n=4)
    assert "resumed from job step 7" in proc.stdout and "resharded from 3 to 4 ranks" in proc.stdout
    assert [r["ranks"] for r in _records(back, "step")] == [4] * 6 + [3] + [4]
    assert [(r["from_ranks"], r["to_ranks"], r["start_ranks"]) for r in _records(back, "reshard")] \
        == [(4, 3, 4), (3, 4, 4)]
    [run] = _records(back, "run")
    assert run["params_identical"] and run["ranks"] == 4 and run["steps"] == 8


def test_cnn_checkpointed_at_three_ranks_goes_on_at_two(tmp_path):
    """The digits CNN re-shards its data (every P-th example at the new P) and goes on at the same
    epoch and in-epoch step: the exdyna run's steps 4.. run at 2 ranks, the dense run done before
    the checkpoint stays as it was."""
    out = tmp_path / "out"
    _launch(out, *CNN, "--fail-at", "0:13:signal", n=3, expect=75)
    proc = _launch(out, *CNN, "--resume", "--reshard", n=2)
    assert "resumed from job step 14" in proc.stdout
    [rs] = _records(out, "reshard")
    assert (rs["run"], rs["step"], rs["from_ranks"], rs["to_ranks"]) == ("exdyna", 4, 3, 2)
    want = [("dense", s, 3) for s in range(10)] + [("exdyna d=0.05", s, 3 if s < 4 else 2) for s in range(10)]
    assert _steps(out) == want
    runs = {r["run"]: r for r in _records(out, "run")}
    assert runs["dense"]["ranks"] == 3 and runs["exdyna d=0.05"]["ranks"] == 2
    assert all(r["params_identical"] for r in runs.values())
    assert [e["epoch"] for e in _records(out, "epoch") if e["sparsifier"] == "exdyna"] == [0, 1]
