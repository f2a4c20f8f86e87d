"""jobs/checkpoint.py across ranks: a file copied from another rank, a weight edited in one rank's
file, a marker that lists fewer files than ranks, and parameters that differ between ranks. Each
makes every rank fall back to the previous generation together, or, with no generation left, raise
the same CheckpointError on every rank; an untouched checkpoint resumes to the bit."""
import importlib.util
import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

from tests.conftest import mpi_assert  # noqa: E402
from tests.launch import ROOT  # noqa: E402

_spec = importlib.util.spec_from_file_location("exdyna_jobs_checkpoint", os.path.join(ROOT, "jobs", "checkpoint.py"))
checkpoint = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checkpoint)

pytestmark = pytest.mark.mpi(min_size=2)
CONFIG = {"runs": [["exdyna", 0.05]], "model": "cnn"}


def _state(step, rank):
    """A job-like state: a model that every rank holds bit for bit, and a residual of its own."""
    same, own = np.random.RandomState(step), np.random.RandomState(1000 * step + rank)
    return {"config": CONFIG, "job_step": step,
            "model": {"w": torch.from_numpy(same.standard_normal((4, 5)).astype(np.float32)),
                      "b": torch.from_numpy(same.standard_normal(5))},
            "residual": own.standard_normal(9).astype(np.float32), "rng": own.get_state()}


def _model(state):
    return state["model"]


def _same(a, b):
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b and type(a) is type(b)


@pytest.fixture
def out(wcomm, tmp_path):
    """One folder that every rank sees: rank 0's tmp_path."""
    return wcomm.bcast(str(tmp_path), root=0)


def _save(comm, out, steps):
    for step in steps:
        checkpoint.save(comm, out, step, _state(step, comm.Get_rank()), shared=_model)


def _on_rank_0(comm, change):
    """``change()`` on rank 0 only (a user editing the shared folder), seen by every rank after
    (the collective assert waits for rank 0, and fails on every rank if the change did)."""
    error = ""
    if comm.Get_rank() == 0:
        try:
            change()
        except Exception as e:   # noqa: BLE001 - reported on every rank, not left to hang the others
            error = repr(e)
    mpi_assert(not error, f"changing the checkpoint failed on rank 0: {error}", comm)


def _load(comm, out):
    """(state, report, error text) of ``load_latest`` on this rank."""
    report = []
    try:
        return checkpoint.load_latest(comm, out, CONFIG, report=report, shared=_model), report, ""
    except checkpoint.CheckpointError as e:
        return None, report, str(e)


def _path(out, step, rank):
    return os.path.join(checkpoint.folder(out), f"step{step:08d}.rank{rank}.pt")


def _edit_weight(path):
    """One finite weight changed, written back with torch.save in the same format."""
    raw = torch.load(path, weights_only=True)
    raw["state"]["model"]["w"][1, 2] += 0.25
    torch.save(raw, path)


def _reseal_with_other_weight(out, step, rank, nranks):
    """The same edit, with the file's own digests recomputed: a file consistent in itself whose
    parameters are not those of the other ranks."""
    def change():
        _, state = checkpoint.read(_path(out, step, rank))
        state["model"]["w"][1, 2] += 0.25
        checkpoint.write(_path(out, step, rank), state, rank=rank, nranks=nranks, step=step, shared=_model)
    return change


def _short_marker(out):
    """The marker's newest generation (and its top-level copy) lists one file for P ranks."""
    path = os.path.join(checkpoint.folder(out), checkpoint.MARKER)
    with open(path) as f:
        marker = json.load(f)
    marker["files"] = marker["generations"][0]["files"] = marker["files"][:1]
    with open(path, "w") as f:
        json.dump(marker, f)


def _case(case, out, newest, P):
    last = P - 1
    if case == "copied":
        return (lambda: shutil.copyfile(_path(out, newest, 0), _path(out, newest, 1)),
                f"rank 1's file step{newest:08d}.rank1.pt was written by rank 0")
    if case == "edited":
        return (lambda: _edit_weight(_path(out, newest, last)),
                f"rank {last} cannot read step{newest:08d}.rank{last}.pt (ValueError: its contents do not match "
                "the digest written with them")
    if case == "resealed":
        others = "rank 0" if P == 2 else "ranks " + ", ".join(map(str, range(last)))
        return (_reseal_with_other_weight(out, newest, last, P),
                f"the state that must be identical on every rank differs between ranks: {others}: sha256 ")
    if case == "short marker":
        return (lambda: _short_marker(out),
                f"every rank: COMPLETE: its entry for this generation lists 1 file for {P} ranks")
    raise AssertionError(case)


CASES = ["copied", "edited", "resealed", "short marker"]


def test_an_untouched_checkpoint_resumes_bit_exactly(wcomm, out):
    rank = wcomm.Get_rank()
    _save(wcomm, out, (4, 8))
    state, report, error = _load(wcomm, out)
    mpi_assert(error == "" and report == [], f"refused: {error} {report}", wcomm)
    mpi_assert(_same(state, _state(8, rank)), "the resumed state is not the one written", wcomm)


@pytest.mark.parametrize("case", CASES)
def test_a_bad_newest_generation_on_one_rank_falls_back_on_every_rank(wcomm, out, case):
    rank, P = wcomm.Get_rank(), wcomm.Get_size()
    _save(wcomm, out, (4, 8))
    change, words = _case(case, out, 8, P)
    _on_rank_0(wcomm, change)
    state, report, error = _load(wcomm, out)
    reports = wcomm.allgather(report)
    mpi_assert(error == "", f"refused: {error}", wcomm)
    mpi_assert(_same(state, _state(4, rank)), "not step 4's state of this rank", wcomm)
    mpi_assert(all(r == reports[0] for r in reports) and len(report) == 1 and report[0].startswith("step 8: ")
               and words in report[0], f"reports {reports}, expected {words!r}", wcomm)


@pytest.mark.parametrize("case", CASES)
def test_a_bad_only_generation_raises_the_same_error_on_every_rank(wcomm, out, case):
    P = wcomm.Get_size()
    _save(wcomm, out, (4,))
    change, words = _case(case, out, 4, P)
    _on_rank_0(wcomm, change)
    state, _, error = _load(wcomm, out)
    errors = wcomm.allgather(error)
    mpi_assert(state is None and all(e == errors[0] for e in errors), f"errors differ: {errors}", wcomm)
    mpi_assert(errors[0].startswith("cannot resume from ") and f"step 4: {words}" in errors[0],
               f"error {errors[0]!r}, expected {words!r}", wcomm)


@pytest.mark.parametrize("bad", ["weight", "nan"])
def test_save_refuses_on_every_rank_what_load_would_refuse(wcomm, out, bad):
    """Parameters that differ on one rank, or a NaN in one rank's residual: no rank writes step
    12, every rank raises the same error, and the marker still names step 8 (nothing pushed out)."""
    rank, P = wcomm.Get_rank(), wcomm.Get_size()
    _save(wcomm, out, (4, 8))
    state = _state(12, rank)
    if rank == P - 1:
        if bad == "weight":
            state["model"]["w"][0, 0] += 1.0
        else:
            state["residual"][3] = np.nan
    error = ""
    try:
        checkpoint.save(wcomm, out, 12, state, shared=_model)
    except checkpoint.CheckpointError as e:
        error = str(e)
    errors = wcomm.allgather(error)
    words = (f"rank {P - 1}: a non-finite value in residual" if bad == "nan"
             else "the state that must be identical on every rank differs between ranks")
    mpi_assert(all(e == errors[0] for e in errors) and errors[0].startswith("writing step 12 refused: ")
               and words in errors[0], f"errors {errors}", wcomm)
    with open(os.path.join(checkpoint.folder(out), checkpoint.MARKER)) as f:
        marker = json.load(f)
    mpi_assert(marker["step"] == 8 and not os.path.exists(_path(out, 12, rank)), f"marker {marker}", wcomm)
    loaded, report, error = _load(wcomm, out)
    mpi_assert(error == "" and report == [] and _same(loaded, _state(8, rank)), "step 8 no longer resumes", wcomm)
