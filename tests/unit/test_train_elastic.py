"""``jobs/train.py --elastic``: the main job loses ranks of 4 and finishes with the survivors (Open
MPI with ULFM, the ``openmpi-elastic`` lane of tests/run_all.sh, where ``EXDYNA_REQUIRE_ULFM=1``
allows no skip), and refuses the flag where the MPI cannot shrink (every lane).

Each LM case trains a small byte-level GPT (AdamW, clipping) for 16 steps and checks, from the
job's own records: every step recorded exactly once, at the ranks left at each point; the
survivors' parameters bit-identical; the losses before the failure exactly the uninterrupted run's
(the global batch does not depend on the number of ranks) and no spike after it."""
import json
import os
import subprocess
import sys

import pytest

from tests.launch import MPIEXEC, ROOT, child_env, launch_train
from tests.unit.test_elastic import ULFM, _need_ulfm

LM = ["--model", "lm", "--d-model", "32", "--layers", "1", "--heads", "2", "--context", "32",
      "--batch-size", "4", "--epochs", "2", "--max-steps", "8", "--no-plot", "--no-progress"]
STEPS = 16


def _train(out, *args, n=4, ulfm=True):
    cmd = ["timeout", "-k", "5", "240", MPIEXEC, *(ULFM if ulfm else []), "-n", str(n), sys.executable, "-m",
           "mpi4py", os.path.join(ROOT, "jobs", "train.py"), "--out", str(out), *LM, *args]
    p = subprocess.run(cmd, cwd=ROOT, env=child_env({"EXDYNA_TIMEOUT_S": "120"}), capture_output=True, text=True,
                       stdin=subprocess.DEVNULL)
    text = p.stdout + p.stderr
    assert p.returncode == 0, f"rc {p.returncode}\n{text[-4000:]}"
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return recs, text


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 4-rank run."""
    _need_ulfm()
    out = tmp_path_factory.mktemp("train-reference")
    recs, text = _train(out, "--elastic")
    assert "bit-identical on all 4 ranks" in text
    return [r["loss"] for r in recs if r["kind"] == "step"]


CASES = [
    (["0:6:kill"], []),                            # rank 0 (which writes the log) dies between steps
    (["2:9:kill"], []),                            # in the second epoch
    (["3:4:save"], ["--checkpoint-every", "4"]),   # inside the checkpoint written after job step 8
    (["3:5:kill", "1:11:kill"], []),               # two losses, one after the other: 4, 3, then 2 ranks
    (["1:7:exchanged"], []),                       # after its exchange, before the step's record
]


@pytest.mark.parametrize("drills,extra", CASES, ids=["+".join(d).replace(":", "-") for d, _ in CASES])
def test_the_job_loses_ranks_and_finishes_with_the_survivors(tmp_path, reference, drills, extra):
    _need_ulfm()
    args = [a for d in drills for a in ("--fail-at", d)]
    recs, text = _train(tmp_path, "--elastic", *args, *extra)
    left = 4 - len(drills)
    assert f"bit-identical on all {left} ranks" in text, text[-3000:]
    lost = [r for r in recs if r["kind"] == "ranks_lost"]
    assert [r["to_ranks"] for r in lost] == list(range(3, left - 1, -1)), lost
    # a victim is named by its rank at launch; the ranks below it keep theirs in every shrink
    assert [r["lost"] for r in lost] == [[int(d.split(":")[0])] for d in drills], lost
    at = [r["step"] for r in lost]
    steps = [r for r in recs if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(STEPS)), "every step recorded exactly once"
    bounds = [0] + at + [STEPS]
    assert [r["ranks"] for r in steps] == [n for i, n in enumerate(range(4, left - 1, -1))
                                           for _ in range(bounds[i + 1] - bounds[i])]
    assert len([r for r in recs if r["kind"] == "epoch"]) == 2
    loss = [r["loss"] for r in steps]
    # a step's record is the ranks' mean loss of the rank-independent global batch: the uninterrupted
    # run's, bit for bit, before the first loss; at the first step after it the same parameters give
    # the same loss up to float32 rounding (the batch is split three ways instead of four)
    first = at[0]
    # a step completed but not logged before the loss is logged from the survivors' own losses
    guessed = [r["step"] for r in steps if r.get("survivors")]
    assert guessed == ([first - 1] if drills[0].endswith("exchanged") else []), guessed
    exact = [i for i in range(first) if i not in guessed]
    assert [loss[i] for i in exact] == [reference[i] for i in exact], (loss, reference)
    assert loss[first] == pytest.approx(reference[first], rel=1e-5), (loss[first], reference[first])
    assert max(loss[first:]) <= 1.05 * max(reference[first:]), (loss[first:], reference[first:])
    run = [r for r in recs if r["kind"] == "run"][0]
    assert run["ranks"] == left and run["params_identical"]


def test_the_cnn_survivors_reshard_their_data_and_finish(tmp_path):
    """``--model cnn`` (momentum SGD, each rank on a shard of its own): the survivors take the data
    of a run of 3 from the next step on and finish every epoch, bit-identical."""
    _need_ulfm()
    cmd = ["timeout", "-k", "5", "240", MPIEXEC, *ULFM, "-n", "4", sys.executable, "-m", "mpi4py",
           os.path.join(ROOT, "jobs", "train.py"), "--out", str(tmp_path), "--epochs", "2", "--max-steps", "6",
           "--width", "8", "--elastic", "--fail-at", "1:8:kill", "--no-plot", "--no-progress"]
    p = subprocess.run(cmd, cwd=ROOT, env=child_env({"EXDYNA_TIMEOUT_S": "120"}), capture_output=True, text=True,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 0 and "bit-identical on all 3 ranks" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["kind"] == "step"]
    assert [(r["epoch"], r["ranks"]) for r in steps] == [(0, 4)] * 6 + [(1, 4)] * 2 + [(1, 3)] * 4
    assert [r["epoch"] for r in recs if r["kind"] == "epoch"] == [0, 1]


def test_a_checkpoint_rewritten_by_the_survivors_resumes_at_three(tmp_path, reference):
    """The checkpoint a rank died in is written again by the three survivors; a plain resume from it
    at ``-n 3`` (no ULFM, no --elastic) trains the rest bit for bit as the elastic run did."""
    _need_ulfm()
    _, text = _train(tmp_path, "--elastic", "--fail-at", "1:4:save", "--checkpoint-every", "8")
    final = text.split("bit-identical on all 3 ranks (sha256 ")[1][:16]
    folder = tmp_path / "checkpoints"
    marker = json.loads((folder / "COMPLETE").read_text())
    assert marker["nranks"] == 3 and marker["step"] == STEPS, marker
    gens = {g["step"]: g["files"] for g in marker["generations"]}
    assert sorted(gens) == [8, STEPS] and len(gens[8]) == 3, "the generation the rank died in, written again"
    for name in gens[STEPS]:   # the newest generation lost: the resume takes the survivors' one
        (folder / name).unlink()
    _, text = _train(tmp_path, "--resume", "--checkpoint-every", "8", n=3, ulfm=False)
    assert "resumed from job step 8" in text and f"(sha256 {final}" in text, text[-3000:]


def test_elastic_is_refused_where_the_mpi_cannot_shrink(tmp_path):
    """``mpiexec`` without ``--with-ft ulfm`` (MPICH, or Open MPI launched plainly): refused on
    every rank with the launch line, exit status 2, nothing trained."""
    if MPIEXEC is None:
        pytest.skip("no mpiexec on PATH")
    p = launch_train(tmp_path, *LM, "--elastic", n=2, expect=2)
    assert "--elastic refused on all 2 ranks" in p.stderr and "--with-ft ulfm" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "metrics.jsonl").exists()
