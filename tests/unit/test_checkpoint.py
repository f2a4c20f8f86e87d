"""jobs/checkpoint.py: a format that loads without running code, exact NumPy bits, older formats
refused saying why, two complete generations kept, and a newest generation passed over when its
marker entry is malformed or this rank's file is unreadable, another rank's, another step's, edited
after the write, non-finite or written with another shared part.
(The multi-rank side runs in tests/mpi/test_job_checkpoint_mpi.py and tests/unit/test_train_cli.py.)"""
import importlib.util
import json
import os
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
from mpi4py import MPI  # noqa: E402

from tests.launch import ROOT  # noqa: E402

_spec = importlib.util.spec_from_file_location("exdyna_jobs_checkpoint", os.path.join(ROOT, "jobs", "checkpoint.py"))
checkpoint = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checkpoint)

CONFIG = {"runs": [["exdyna", 0.05]], "model": "cnn"}


def _state(step, payload=False):
    """A job-like state; ``payload`` adds a NaN with a payload (bits a round trip must keep, but that
    ``load_latest`` refuses)."""
    rng = np.random.RandomState(step)
    nan = np.array([np.nan], dtype=np.float32).view(np.uint32) | np.uint32(0x12345)
    arrays = [rng.standard_normal(7).astype(np.float32), np.arange(5, dtype=np.uint32), np.zeros((0, 3)),
              np.array(3.5), rng.standard_normal((2, 3))] + ([nan.view(np.float32)] if payload else [])
    return {"config": CONFIG, "job_step": step, "arrays": arrays,
            "scalars": (np.float32(1.25), np.int64(-7), np.bool_(True), 2 ** 70, 0.1, None, "text", b"raw"),
            "model": {"w": torch.from_numpy(rng.standard_normal((3, 4)).astype(np.float32)), "b": torch.arange(4.0)},
            "rng": {"numpy": np.random.RandomState(step).get_state()}}


def _model(state):
    return state["model"]


def _same(a, b):
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return type(a) is type(b) and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b and type(a) is type(b)


def test_round_trip_keeps_every_bit(tmp_path):
    path = str(tmp_path / "x.pt")
    checkpoint.write(path, _state(3, payload=True), rank=2, nranks=4, step=3)
    header, state = checkpoint.read(path)
    assert _same(state, _state(3, payload=True))
    assert header == {"rank": 2, "nranks": 4, "step": 3, "shared": None}


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {_Payload.target}",))


def test_a_file_that_would_run_code_is_refused_without_running_it(tmp_path):
    _Payload.target = str(tmp_path / "pwned")
    path = str(tmp_path / "evil.pt")
    torch.save({"config": CONFIG, "x": _Payload()}, path)
    with pytest.raises(pickle.UnpicklingError):
        checkpoint.read(path)
    assert not os.path.exists(_Payload.target)
    wrapped = str(tmp_path / "evil2.pt")
    torch.save({"format": checkpoint.FORMAT, "version": 2, "state": {"config": CONFIG, "x": _Payload()}}, wrapped)
    with pytest.raises(pickle.UnpicklingError):
        checkpoint.read(wrapped)
    assert not os.path.exists(_Payload.target)


@pytest.mark.parametrize("version", [1, 2])
def test_older_versions_are_refused_saying_why(tmp_path, version):
    """Version 1 (torch.save of the state, NumPy objects inside) and 2 (no rank, step or digest):
    nothing in them can be checked, so they are refused by name, by read and by load_latest."""
    out = str(tmp_path)
    checkpoint.save(MPI.COMM_SELF, out, 4, _state(4))
    path = os.path.join(checkpoint.folder(out), "step00000004.rank0.pt")
    if version == 1:
        torch.save(_state(4), path)
    else:
        torch.save({"format": checkpoint.FORMAT, "version": 2, "state": checkpoint.encode(_state(4))}, path)
    words = f"format version {version}: it records neither the rank that wrote it nor a digest"
    with pytest.raises(ValueError, match=words):
        checkpoint.read(path)
    with pytest.raises(checkpoint.CheckpointError, match=f"step 4: rank 0 cannot read step00000004.rank0.pt .*{words}"):
        checkpoint.load_latest(MPI.COMM_SELF, out, CONFIG)


def test_objects_the_format_cannot_hold_are_refused_at_save(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="cannot be checkpointed"):
        checkpoint.save(MPI.COMM_SELF, str(tmp_path), 1, {"config": CONFIG, "x": object()})
    assert not os.path.exists(os.path.join(checkpoint.folder(str(tmp_path)), checkpoint.MARKER))


def test_two_generations_kept_and_a_corrupt_newest_passed_over(tmp_path):
    out = str(tmp_path)
    d = checkpoint.folder(out)
    for step in (4, 8, 12):
        checkpoint.save(MPI.COMM_SELF, out, step, _state(step))
    marker = json.load(open(os.path.join(d, checkpoint.MARKER)))
    assert [g["step"] for g in marker["generations"]] == [12, 8] and marker["version"] == checkpoint.VERSION
    assert sorted(f for f in os.listdir(d) if f.endswith(".pt")) == ["step00000008.rank0.pt", "step00000012.rank0.pt"]
    assert _same(checkpoint.load_latest(MPI.COMM_SELF, out, CONFIG), _state(12))
    newest = os.path.join(d, "step00000012.rank0.pt")
    with open(newest, "r+b") as f:
        f.truncate(64)
    report = []
    assert _same(checkpoint.load_latest(MPI.COMM_SELF, out, CONFIG, report=report), _state(8))
    assert len(report) == 1 and report[0].startswith("step 12: rank 0 cannot read"), report
    os.remove(os.path.join(d, "step00000008.rank0.pt"))
    with pytest.raises(checkpoint.CheckpointError, match=r"step 12: .* \| step 8: rank 0's file .* is missing"):
        checkpoint.load_latest(MPI.COMM_SELF, out, CONFIG)


def test_other_settings_are_refused(tmp_path):
    out = str(tmp_path)
    checkpoint.save(MPI.COMM_SELF, out, 4, _state(4))
    with pytest.raises(checkpoint.CheckpointError, match="other settings: model='cnn' \\(now 'mlp'\\)"):
        checkpoint.load_latest(MPI.COMM_SELF, out, dict(CONFIG, model="mlp"))
    assert checkpoint.load_latest(MPI.COMM_SELF, str(tmp_path / "none"), CONFIG) is None


def _two_generations(tmp_path, shared=_model):
    """Checkpoints of steps 8 and 12 under ``tmp_path``; returns (out, folder)."""
    out = str(tmp_path)
    for step in (8, 12):
        checkpoint.save(MPI.COMM_SELF, out, step, _state(step), shared=shared)
    return out, checkpoint.folder(out)


def _falls_back(out, words, shared=_model):
    """load_latest passes over step 12 saying ``words`` and gives step 8's state, bit for bit."""
    report = []
    got = checkpoint.load_latest(MPI.COMM_SELF, out, CONFIG, report=report, shared=shared)
    assert _same(got, _state(8))
    assert len(report) == 1 and report[0].startswith("step 12: ") and words in report[0], report


def _rewrite(path, edit):
    """Load a file as the format holds it, ``edit`` it and save it back with torch.save."""
    raw = torch.load(path, weights_only=True)
    edit(raw)
    torch.save(raw, path)


@pytest.mark.parametrize("what", ["weight", "residual", "rank"])
def test_a_file_edited_after_the_write_is_passed_over(tmp_path, what):
    """One finite weight, one bit of a NumPy array, or the header's rank changed after the write:
    the file no longer matches the digest written with it."""
    out, d = _two_generations(tmp_path)

    def edit(raw):
        if what == "weight":
            raw["state"]["model"]["w"][1, 2] += 0.5
        elif what == "residual":
            raw["state"]["arrays"][0]["data"][3] ^= 1
        else:
            raw["rank"] = 1
    _rewrite(os.path.join(d, "step00000012.rank0.pt"), edit)
    _falls_back(out, "do not match the digest written with them")


@pytest.mark.parametrize("header,words", [
    ({"rank": 1}, "rank 0's file step00000012.rank0.pt was written by rank 1"),
    ({"nranks": 2}, "was written by a run of 2 ranks, this job has 1"),
    ({"step": 8}, "holds step 8, not 12"),
])
def test_a_consistent_file_of_another_rank_run_or_step_is_passed_over(tmp_path, header, words):
    """A file whose digest matches but that another rank, run size or step wrote (copied over
    this rank's file) is refused by what its header records."""
    out, d = _two_generations(tmp_path, shared=None)
    at = dict({"rank": 0, "nranks": 1, "step": 12}, **header)
    checkpoint.write(os.path.join(d, "step00000012.rank0.pt"), _state(at["step"]), **at)
    _falls_back(out, words, shared=None)


def test_a_non_finite_value_is_refused_at_save_and_at_load(tmp_path):
    out, d = _two_generations(tmp_path, shared=None)
    bad = _state(16)
    bad["model"]["w"][2, 1] = float("inf")
    words = "writing step 16 refused: rank 0: a non-finite value in model/w"
    with pytest.raises(checkpoint.CheckpointError, match=words):
        checkpoint.save(MPI.COMM_SELF, out, 16, bad)
    assert json.load(open(os.path.join(d, checkpoint.MARKER)))["step"] == 12
    assert not os.path.exists(os.path.join(d, "step00000016.rank0.pt"))
    nan = _state(12)
    nan["arrays"][4][1, 0] = np.nan
    checkpoint.write(os.path.join(d, "step00000012.rank0.pt"), nan, rank=0, nranks=1, step=12)
    _falls_back(out, "holds a non-finite value in arrays/4", shared=None)


def test_a_file_written_with_another_shared_part_is_passed_over(tmp_path):
    out, d = _two_generations(tmp_path, shared=None)
    checkpoint.save(MPI.COMM_SELF, out, 12, _state(12), shared=_model)
    _falls_back(out, "is not the one it was written with", shared=None)


def _two_generations_with_marker_edited(tmp_path, edit):
    """``_two_generations``'s run folder, its ``COMPLETE`` marker rewritten after ``edit(marker)``."""
    out, d = _two_generations(tmp_path)
    path = os.path.join(d, checkpoint.MARKER)
    with open(path) as f:
        marker = json.load(f)
    edit(marker)
    with open(path, "w") as f:
        json.dump(marker, f)
    return out


@pytest.mark.parametrize("edit,words", [
    (lambda m: m["generations"][0].update(files=[]), "lists 0 files for 1 ranks"),
    (lambda m: m["generations"][0].update(files="step00000012.rank0.pt"), "has no list of files"),
    (lambda m: m["generations"][0].update(files=["step00000008.rank0.pt"]),
     "names 'step00000008.rank0.pt' as rank 0's file, not 'step00000012.rank0.pt'"),
    (lambda m: m["generations"][0].update(files=[7]), "names 7 as rank 0's file"),
    (lambda m: m["generations"][0].pop("files"), "has no list of files (None)"),
    (lambda m: m["generations"][0].update(step="12"), "has step '12'"),
    (lambda m: m["generations"][0].pop("step"), "has step None"),
    (lambda m: m["generations"].__setitem__(0, [12]), "is not an object ([12])"),
    (lambda m: m.update(files=[]), "its step and files disagree with its newest generation"),
])
def test_a_malformed_marker_entry_refuses_that_generation_only(tmp_path, edit, words):
    out = _two_generations_with_marker_edited(tmp_path, edit)
    report = []
    got = checkpoint.load_latest(MPI.COMM_SELF, out, CONFIG, report=report, shared=_model)
    assert _same(got, _state(8))
    heads = ("step 12: rank 0: COMPLETE: its ", "generation 1: rank 0: COMPLETE: its ")   # its step unreadable
    assert len(report) == 1 and report[0].startswith(heads) and words in report[0], report


@pytest.mark.parametrize("edit,words", [
    (lambda m: m.pop("nranks"), "it has no number of ranks"),
    (lambda m: m.update(nranks="1"), "it has no number of ranks"),
    (lambda m: m.update(generations={}), "its generations are not a non-empty list"),
    (lambda m: m.update(generations=[]), "its generations are not a non-empty list"),
    (lambda m: m.clear(), "it has no number of ranks"),
])
def test_a_marker_without_usable_generations_is_refused(tmp_path, edit, words):
    out = _two_generations_with_marker_edited(tmp_path, edit)
    with pytest.raises(checkpoint.CheckpointError, match=f"cannot resume from .*COMPLETE: rank 0: {words}"):
        checkpoint.load_latest(MPI.COMM_SELF, out, CONFIG, shared=_model)


def test_a_marker_that_is_not_an_object_is_refused(tmp_path):
    out, d = _two_generations(tmp_path)
    with open(os.path.join(d, checkpoint.MARKER), "w") as f:
        json.dump([12, 8], f)
    with pytest.raises(checkpoint.CheckpointError, match=r"COMPLETE: rank 0: it is not a JSON object \(\[12, 8\]\)"):
        checkpoint.load_latest(MPI.COMM_SELF, out, CONFIG, shared=_model)


# ---------------------------------------------------------------------------- load_all: every old rank's file
def _old_run(tmp_path, nranks=3, steps=(8, 12), shared=_model):
    """Generations ``steps`` of a run of ``nranks`` ranks, written file by file as its ranks would
    (the same model, a residual of each rank's own), with their marker; returns (out, folder)."""
    out = str(tmp_path)
    d = checkpoint.folder(out)
    os.makedirs(d, exist_ok=True)
    for step in steps:
        for r in range(nranks):
            checkpoint.write(os.path.join(d, f"step{step:08d}.rank{r}.pt"), _rank_state(step, r),
                             rank=r, nranks=nranks, step=step, shared=shared)
    gens = [{"step": s, "files": [f"step{s:08d}.rank{r}.pt" for r in range(nranks)]} for s in reversed(steps)]
    with open(os.path.join(d, checkpoint.MARKER), "w") as f:
        json.dump({"version": checkpoint.VERSION, "step": gens[0]["step"], "nranks": nranks,
                   "files": gens[0]["files"], "generations": gens}, f)
    return out, d


def _rank_state(step, rank):
    return dict(_state(step), residual=np.random.RandomState(100 * step + rank).standard_normal(6))


def test_load_all_gives_every_old_ranks_state_in_rank_order(tmp_path):
    out, _ = _old_run(tmp_path)
    got = checkpoint.load_all(MPI.COMM_SELF, out, CONFIG, shared=_model)
    assert len(got) == 3 and all(_same(g, _rank_state(12, r)) for r, g in enumerate(got))
    assert not _same(got[0]["residual"], got[1]["residual"])
    # this job's own number of ranks as well (one rank, a checkpoint that save wrote)
    one = tmp_path / "one"
    checkpoint.save(MPI.COMM_SELF, str(one), 4, _state(4), shared=_model)
    got = checkpoint.load_all(MPI.COMM_SELF, str(one), CONFIG, shared=_model)
    assert len(got) == 1 and _same(got[0], _state(4))
    assert checkpoint.load_all(MPI.COMM_SELF, str(tmp_path / "none"), CONFIG) is None


def test_load_latest_still_refuses_a_checkpoint_of_another_number_of_ranks(tmp_path):
    out, _ = _old_run(tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match="it was written by 3 ranks, this job has 1"):
        checkpoint.load_latest(MPI.COMM_SELF, out, CONFIG, shared=_model)


def _all_falls_back(out, words, shared=_model):
    report = []
    got = checkpoint.load_all(MPI.COMM_SELF, out, CONFIG, report=report, shared=shared)
    assert len(got) == 3 and all(_same(g, _rank_state(8, r)) for r, g in enumerate(got))
    assert len(report) == 1 and report[0].startswith("step 12: ") and words in report[0], report


@pytest.mark.parametrize("damage,words", [
    ("truncate", "rank 1 cannot read step00000012.rank1.pt"),
    ("missing", "rank 1's file"),
    ("copied", "rank 1's file step00000012.rank1.pt was written by rank 2"),
    ("run size", "rank 1's file step00000012.rank1.pt was written by a run of 4 ranks, its marker names 3"),
    ("edited", "do not match the digest written with them"),
    ("model", "its files: the state that must be identical on every rank differs between ranks: ranks 0, 2: "),
])
def test_load_all_passes_over_a_generation_with_one_bad_file(tmp_path, damage, words):
    """One old rank's file of the newest generation is cut short, missing, another rank's, of
    another run size, edited after the write, or holds other parameters: the whole generation is
    passed over and the one before is given, every file of it."""
    out, d = _old_run(tmp_path)
    path = os.path.join(d, "step00000012.rank1.pt")
    if damage == "truncate":
        with open(path, "r+b") as f:
            f.truncate(64)
    elif damage == "missing":
        os.remove(path)
    elif damage == "copied":
        with open(os.path.join(d, "step00000012.rank2.pt"), "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data)
    elif damage == "run size":
        checkpoint.write(path, _rank_state(12, 1), rank=1, nranks=4, step=12, shared=_model)
    elif damage == "edited":
        def flip(raw):
            raw["state"]["residual"]["data"][5] ^= 1
        _rewrite(path, flip)
    else:
        other = _rank_state(12, 1)
        other["model"]["b"] = other["model"]["b"] + 1
        checkpoint.write(path, other, rank=1, nranks=3, step=12, shared=_model)
    _all_falls_back(out, words)


def test_load_all_compares_the_settings_but_those_it_ignores(tmp_path):
    out, _ = _old_run(tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match=r"other settings: model='cnn' \(now 'lm'\)"):
        checkpoint.load_all(MPI.COMM_SELF, out, dict(CONFIG, model="lm"), shared=_model)
    with pytest.raises(checkpoint.CheckpointError, match=r"other settings: ranks=None \(now 1\)"):
        checkpoint.load_all(MPI.COMM_SELF, out, dict(CONFIG, ranks=1), shared=_model)
    got = checkpoint.load_all(MPI.COMM_SELF, out, dict(CONFIG, ranks=1), shared=_model, ignore=("ranks",))
    assert len(got) == 3
    single = tmp_path / "single"
    checkpoint.save(MPI.COMM_SELF, str(single), 4, dict(_state(4), config=dict(CONFIG, ranks=4)))
    assert _same(checkpoint.load_latest(MPI.COMM_SELF, str(single), dict(CONFIG, ranks=1), ignore=("ranks",)),
                 dict(_state(4), config=dict(CONFIG, ranks=4)))
