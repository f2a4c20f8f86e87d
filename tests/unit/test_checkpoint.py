"""jobs/checkpoint.py: a format that loads without running code, exact NumPy bits, the previous
format still read, two complete generations kept, a corrupt newest one passed over.
(The multi-rank side, one rank's file corrupt, runs in tests/unit/test_train_cli.py.)"""
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


def _state(step):
    rng = np.random.RandomState(step)
    nan = np.array([np.nan], dtype=np.float32).view(np.uint32) | np.uint32(0x12345)   # a NaN payload
    return {"config": CONFIG, "job_step": step,
            "arrays": [rng.standard_normal(7).astype(np.float32), np.arange(5, dtype=np.uint32), nan.view(np.float32),
                       np.zeros((0, 3)), np.array(3.5), rng.standard_normal((2, 3))],
            "scalars": (np.float32(1.25), np.int64(-7), np.bool_(True), 2 ** 70, 0.1, None, "text", b"raw"),
            "tensor": torch.arange(4.0), "rng": {"numpy": np.random.RandomState(step).get_state()}}


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
    checkpoint.write(path, _state(3))
    assert _same(checkpoint.read(path), _state(3))


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


def test_version_1_files_still_load(tmp_path):
    """Version 1: torch.save of the state itself, NumPy objects pickled inside."""
    path = str(tmp_path / "v1.pt")
    torch.save(_state(5), path)
    assert _same(checkpoint.read(path), _state(5))


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
