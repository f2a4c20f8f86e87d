"""The watchdog's settings (the bounded waits themselves: tests/unit/test_abort.py)."""
import threading

import pytest

from exdyna_mpi.transport import watchdog


def test_timeout_from_the_environment_first(monkeypatch):
    monkeypatch.setattr(watchdog, "_timeout", None)
    monkeypatch.delenv(watchdog.ENV, raising=False)
    assert watchdog.timeout() == watchdog.DEFAULT_TIMEOUT_S
    watchdog.set_timeout(30)
    assert watchdog.timeout() == 30
    monkeypatch.setenv(watchdog.ENV, "0")
    assert watchdog.timeout() == 0
    monkeypatch.setenv(watchdog.ENV, "soon")
    with pytest.raises(ValueError, match="EXDYNA_TIMEOUT_S='soon'"):
        watchdog.timeout()
    with pytest.raises(ValueError, match=">= 0"):
        watchdog.set_timeout(-1)
    with pytest.raises(ValueError, match=">= 0"):
        watchdog.set_timeout(float("nan"))


def test_a_nested_wait_keeps_the_outer_clock(monkeypatch):
    class Comm:
        def Get_rank(self):
            return 0

    comm = Comm()
    with watchdog.waiting("outer", comm):
        start = watchdog._waits[threading.get_ident()][1]
        with watchdog.waiting("inner", comm):
            assert watchdog._waits[threading.get_ident()][:2] == ("outer", start)
        assert threading.get_ident() in watchdog._waits
    assert threading.get_ident() not in watchdog._waits
