"""``sparsifiers.timing.timed``: the step's phase timer."""
import types

import pytest

from exdyna_mpi.sparsifiers import timing
from exdyna_mpi.sparsifiers.timing import timed


def _clock(monkeypatch, *readings):
    """Make ``timing``'s ``time.perf_counter`` return ``readings`` in order."""
    it = iter(readings)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: next(it)))


def test_writes_the_blocks_seconds(monkeypatch):
    _clock(monkeypatch, 1.0, 3.5)
    sec = {"other": 7.0}
    with timed(sec, "select"):
        pass
    assert sec == {"other": 7.0, "select": 2.5}


def test_replaces_by_default(monkeypatch):
    _clock(monkeypatch, 1.0, 3.5)
    sec = {"select": 10.0}
    with timed(sec, "select"):
        pass
    assert sec == {"select": 2.5}


def test_add_accumulates(monkeypatch):
    _clock(monkeypatch, 1.0, 3.5, 10.0, 10.25)
    sec: dict[str, float] = {}
    with timed(sec, "reduce", add=True):   # absent: starts from 0
        pass
    assert sec == {"reduce": 2.5}
    with timed(sec, "reduce", add=True):
        pass
    assert sec == {"reduce": 2.75}


def test_a_raising_block_leaves_the_dict_unchanged():
    sec = {"gather": 1.0}
    with pytest.raises(ValueError, match="boom"):
        with timed(sec, "select"):
            raise ValueError("boom")
    with pytest.raises(KeyError):
        with timed(sec, "gather", add=True):
            raise KeyError("x")
    assert sec == {"gather": 1.0}


def test_the_real_clock_gives_a_non_negative_float():
    sec: dict[str, float] = {}
    with timed(sec, "total"):
        sum(range(100))
    assert isinstance(sec["total"], float) and sec["total"] >= 0.0
