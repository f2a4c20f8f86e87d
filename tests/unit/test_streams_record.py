"""The stream recorder (jobs/streams.py ``record``): every recorded model, a tiny recording made
twice. The bytes must repeat (recordings are regenerated, never committed), each rank's gradient
must be its own minibatch's, and the replay must hand back what was written."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import models  # noqa: E402  (jobs/models.py, jobs/streams.py: pytest.ini puts jobs/ on the path)
import streams  # noqa: E402


@pytest.mark.parametrize("name", ["cnn16", "lstm"])
def test_recording_is_deterministic_and_per_rank(tmp_path, name):
    a = streams.record(name, ranks=2, steps=2, out=str(tmp_path / "a.npy"), quiet=True)
    b = streams.record(name, ranks=2, steps=2, out=str(tmp_path / "b.npy"), quiet=True)
    da, db = np.load(a), np.load(b)
    assert da.tobytes() == db.tobytes()
    if name == "lstm":
        torch.manual_seed(0)
        assert da.shape[2] == sum(p.numel() for p in models.CharLSTM().parameters())
    assert da.shape[:2] == (2, 2) and np.isfinite(da).all()
    assert np.count_nonzero(da[0, 0]) > 0
    assert not np.array_equal(da[0, 0], da[1, 0]), "both ranks recorded the same minibatch"
    assert not np.array_equal(da[0, 0], da[0, 1]), "the model did not move between steps"
    replay = streams.Recorded(name, 1, 2, path=a)
    assert replay.next().tobytes() == da[1, 0].tobytes()
