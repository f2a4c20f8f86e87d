"""jobs/train.py end to end under mpiexec: metrics and plot; a failing rank ends the job; a killed
job resumes from its checkpoint to the same bits as an uninterrupted one.

The job runs in a subprocess (its own mpiexec), with PMI variables of any enclosing launch removed so
the child starts its own MPI world.
"""
import glob
import json
import os
import re
import subprocess
import time

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed")
pytest.importorskip("sklearn", reason="scikit-learn is not installed")
pytest.importorskip("matplotlib", reason="matplotlib is not installed")

from tests.launch import ROOT, child_env, launch_train  # noqa: E402


_launch = launch_train


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _run(tmp_path, *args):
    out = tmp_path / "out"
    proc = _launch(out, *args)
    return proc.stdout, out, _records(out)


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


TINY = ("--width", "4", "--epochs", "2", "--max-steps", "5", "--compare", "dense,exdyna", "--density", "0.05")


def test_a_failing_rank_ends_the_job_through_the_launcher(tmp_path):
    """The README's launcher, 3 ranks, rank 1 raises at step 2: the job ends non-zero, fast, and the
    output carries that rank's traceback (without the abort the others would wait in a collective)."""
    env = child_env()
    env.update(NP="3", TRAIN_TIMEOUT="120")
    t0 = time.monotonic()
    proc = subprocess.run(["bash", os.path.join(ROOT, "jobs", "run_train.sh"), "--out", str(tmp_path / "out"),
                           "--no-progress", "--fail-at", "1:2", *TINY], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=200)
    took, end = time.monotonic() - t0, time.time()
    text = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124, 137), f"rc {proc.returncode}\n{text[-3000:]}"
    assert took < 30, f"the job took {took:.1f} s in all"
    m = re.search(r"fault drill \(--fail-at\): rank 1 fails at step 2 \(time ([0-9.]+)\)", text)
    assert "Traceback" in text and m, text[-3000:]
    assert end - float(m.group(1)) < 10, f"the job took {end - float(m.group(1)):.1f} s to end after rank 1 failed"


def _final_hashes(out):
    return {r["run"]: r["params_sha256"] for r in _records(out) if r["kind"] == "run"}


@pytest.mark.parametrize("n,how", [(2, "signal"), (3, "kill")])
def test_interrupted_job_resumes_to_the_same_bits(tmp_path, n, how):
    """Checkpoint every 4 steps; at job step 13 (the exdyna run, mid-epoch) one rank is killed with
    SIGKILL, or gets SIGUSR1 (checkpoint now, exit 75). --resume then ends with the parameters
    (sha256) and the per-step metrics of an uninterrupted run with the same flags."""
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    _launch(straight, *TINY, n=n)
    rank = n - 1
    proc = _launch(broken, *TINY, "--checkpoint-every", "4", "--fail-at", f"{rank}:13:{how}", n=n,
                   expect=75 if how == "signal" else None)
    assert proc.returncode != 0
    marker = json.loads((broken / "checkpoints" / "COMPLETE").read_text())
    assert marker["step"] == (14 if how == "signal" else 12) and marker["nranks"] == n
    gens = marker["generations"]   # the newest and the one before it, nothing older
    assert [g["step"] for g in gens] == [marker["step"], (12 if how == "signal" else 8)]
    assert gens[0]["files"] == marker["files"]
    assert sorted(os.path.basename(p) for p in glob.glob(str(broken / "checkpoints" / "*.pt"))) \
        == sorted(f for g in gens for f in g["files"])
    assert not (broken / "train.png").exists()
    proc = _launch(broken, *TINY, "--checkpoint-every", "4", "--resume", n=n)
    assert f"resumed from job step {marker['step']}" in proc.stdout
    want, got = _final_hashes(straight), _final_hashes(broken)
    assert list(want) == ["dense", "exdyna d=0.05"] and got == want
    def steps(out):
        return [(r["run"], r["step"], r["density"], r["loss"]) for r in _records(out) if r["kind"] == "step"]

    assert steps(broken) == steps(straight)
    assert (broken / "train.png").exists()


def test_a_corrupt_newest_checkpoint_on_one_rank_resumes_from_the_one_before(tmp_path):
    """The last rank's newest file is cut short: every rank passes over that generation together,
    resumes from the previous one and still ends with the uninterrupted run's bits."""
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    _launch(straight, *TINY, n=2)
    _launch(broken, *TINY, "--checkpoint-every", "4", "--fail-at", "1:13:kill", n=2, expect=None)
    marker = json.loads((broken / "checkpoints" / "COMPLETE").read_text())
    newest = broken / "checkpoints" / marker["files"][1]
    newest.write_bytes(newest.read_bytes()[:100])
    proc = _launch(broken, *TINY, "--checkpoint-every", "4", "--resume", n=2)
    prev = marker["generations"][1]["step"]
    assert f"resumed from job step {prev}" in proc.stdout, proc.stdout[-2000:]
    assert f"passed over the checkpoint of step {marker['step']}: rank 1 cannot read" in proc.stderr, \
        proc.stderr[-2000:]
    assert _final_hashes(broken) == _final_hashes(straight)


def test_resume_with_other_settings_is_refused_on_every_rank(tmp_path):
    out = tmp_path / "out"
    _launch(out, *TINY, "--fail-at", "0:3:signal", n=2, expect=75)
    proc = _launch(out, *TINY[:-1], "0.1", "--resume", n=2, expect=None)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert re.search(r"--resume refused on all 2 ranks: .*runs=.*'exdyna', 0.05.*now.*'exdyna', 0.1", proc.stderr), \
        proc.stderr[-2000:]


def test_every_launcher_runs_ranks_under_mpi4py():
    """Launch lines in jobs/ and the docs start python ranks with `-m mpi4py` (abort on exception)."""
    files = glob.glob(os.path.join(ROOT, "jobs", "*.sh")) + glob.glob(os.path.join(ROOT, "jobs", "*.sbatch")) \
        + glob.glob(os.path.join(ROOT, "docs", "*.md")) + [os.path.join(ROOT, "README.md")] \
        + glob.glob(os.path.join(ROOT, "jobs", "**", "*.py"), recursive=True)
    bad = []
    for path in files:
        for i, line in enumerate(open(path), 1):
            m = re.search(r"\b(mpiexec|srun)\b.*?\bpython3?\s+(\S+)", line)
            if m and m.group(2) != "-m" and m.group(2).endswith(".py"):
                bad.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
    assert not bad, "launched without -m mpi4py:\n" + "\n".join(bad)
