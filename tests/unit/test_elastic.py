"""Shrink and continue (``elastic=True``): a rank of 4 is killed (SIGKILL) and the survivors go on at
P=3, under Open MPI with ULFM (the ``openmpi`` lane of tests/run_all.sh runs this file and allows no
skip: ``EXDYNA_REQUIRE_ULFM=1``). Each case launches tests/elastic_job.py in its own world as
``mpiexec --with-ft ulfm --mca pml ob1 --mca btl tcp,self -n 4 python -m mpi4py ...`` and checks:
the job ends with status 0; the three survivors hold bit-identical parameters; the recovery names
the dead rank and ended within 10 s of the kill; every step before it ran at 4 ranks and every step
after at 3; the loss of the whole global batch (the same on every rank) continues without a spike
against an uninterrupted 4-rank run of the same data."""
import json
import os
import re
import subprocess
import sys

import pytest

from tests.launch import MPIEXEC, ROOT, child_env

ULFM = ["--with-ft", "ulfm", "--mca", "pml", "ob1", "--mca", "btl", "tcp,self"]


def _open_mpi_with_ulfm():
    """Whether this venv's mpiexec is Open MPI's (the wheel is built with ULFM)."""
    if MPIEXEC is None:
        return False
    p = subprocess.run([MPIEXEC, "--version"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    text = p.stdout + p.stderr
    return "Open MPI" in text or "prte" in text.lower()


def _need_ulfm():
    if _open_mpi_with_ulfm():
        return
    if os.environ.get("EXDYNA_REQUIRE_ULFM") == "1":
        pytest.fail("EXDYNA_REQUIRE_ULFM=1 but this venv's mpiexec is not Open MPI's")
    pytest.skip("needs Open MPI with ULFM (the openmpi lane of tests/run_all.sh runs it)")


def _run(tmp_path, entry, victim, step, where):
    out = tmp_path / f"{entry}-{where}-{victim}"
    out.mkdir()
    cmd = ["timeout", "-k", "5", "240", MPIEXEC, *ULFM, "-n", "4", sys.executable, "-m", "mpi4py",
           os.path.join(ROOT, "tests", "elastic_job.py"), entry, str(victim), str(step), where, str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=child_env({"EXDYNA_TIMEOUT_S": "120"}), capture_output=True, text=True,
                       stdin=subprocess.DEVNULL)
    text = p.stdout + p.stderr
    assert p.returncode == 0, f"rc {p.returncode}\n{text[-4000:]}"
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4) if (out / f"rank{r}.json").exists()]
    return ranks, text


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 4-rank run of each entry point (computed once)."""
    _need_ulfm()
    base = tmp_path_factory.mktemp("reference")
    runs = {}
    for entry in ("optimizer", "adamw", "zoo", "diloco"):
        ranks, _ = _run(base, entry, -1, -1, "none")
        assert len(ranks) == 4 and len({r["sha256"] for r in ranks}) == 1
        runs[entry] = ranks[0]
    return runs


CASES = [
    ("optimizer", 3, 10, "exchange"),   # the last rank dies inside a gradient exchange
    ("optimizer", 0, 10, "compute"),    # rank 0 dies between steps: the others are in the exchange
    ("adamw", 1, 10, "exchange"),       # AdamW's default Adam path
    ("zoo", 2, 7, "exchange"),          # BatchNorm, tied and frozen weights, an unused parameter, clipping
    ("diloco", 2, 10, "outer"),         # inside DiLoCo's outer step
]


@pytest.mark.parametrize("entry,victim,step,where", CASES, ids=[f"{e}-{w}-rank{v}" for e, v, _, w in CASES])
def test_a_killed_rank_leaves_three_survivors_that_go_on(tmp_path, reference, entry, victim, step, where):
    _need_ulfm()
    ranks, text = _run(tmp_path, entry, victim, step, where)
    assert len(ranks) == 3, f"{len(ranks)} survivors wrote their results\n{text[-3000:]}"
    assert len({r["sha256"] for r in ranks}) == 1, "the survivors' parameters differ"
    killed = [float(t) for t in re.findall(r"victim \d+: SIGKILL [^\n]* at (\d+\.\d+)", text)]
    assert len(killed) == 1, text[-3000:]
    for r in ranks:
        assert len(r["recoveries"]) == 1, r["recoveries"]
        rec = r["recoveries"][0]
        assert rec["lost"] == [victim] and rec["nranks"] == 3
        assert rec["at"] - killed[0] < 10.0, f"the survivors went on {rec['at'] - killed[0]:.1f} s after the kill"
    first = ranks[0]
    agreed = first["recoveries"][0]["agreed"] * (4 if entry == "diloco" else 1)
    assert all(n == 4 for n in first["ranks"][:agreed]) and all(n == 3 for n in first["ranks"][agreed:]), first["ranks"]
    # the loss of the global batch (identical on every rank): no spike after the loss of a rank, and
    # the end within reach of the uninterrupted run's
    ref, got = reference[entry]["full"], first["full"]
    assert got[:agreed] == ref[:agreed], "the steps before the failure must be the uninterrupted run's"
    window = max(ref[max(0, agreed - 4):agreed + 4])
    assert max(got[agreed:agreed + 4]) <= 1.05 * window, (got[agreed - 4:agreed + 4], ref[agreed - 4:agreed + 4])
    tail, ref_tail = sum(got[-4:]) / 4, sum(ref[-4:]) / 4
    assert tail <= 1.03 * ref_tail, (tail, ref_tail)


def test_a_lost_rank_is_told_by_its_class_or_by_the_failure_detector():
    """``is_rank_failure``: the ULFM classes count; another MPI error counts only where the
    communicator's failure detector knows a dead rank (Open MPI's ``Alltoallv`` reports one as
    ``ERR_OTHER``; the adamw and zoo cases above die inside it), so here, with nobody dead, not."""
    from mpi4py import MPI

    from exdyna_mpi.transport import ulfm

    for name in ("ERR_PROC_FAILED", "ERR_REVOKED"):
        if hasattr(MPI, name):
            assert ulfm.is_rank_failure(MPI.Exception(getattr(MPI, name))), name
    other = MPI.Exception(MPI.ERR_OTHER)
    assert not ulfm.is_rank_failure(other)
    assert not ulfm.is_rank_failure(other, MPI.COMM_WORLD)
    assert not ulfm.is_rank_failure(ValueError("not MPI's"), MPI.COMM_WORLD)
