"""The watchdog: its settings, a failure of its monitor thread, the broadcast's bound (the
sparsifiers' bounded waits: tests/unit/test_abort.py)."""
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from exdyna_mpi.transport import watchdog
from tests.launch import MPIEXEC, ROOT, child_env


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


@pytest.mark.parametrize("value", ["abc", "-1", "-0.5", "nan", "inf", "-inf", "1e999", "5 s"])
def test_a_bad_environment_value_is_refused(monkeypatch, value):
    """Anything but a finite number of seconds >= 0 is an error: before, ``-1`` and ``nan`` turned
    the bound off without a word, and ``inf`` meant an unbounded wait that 0 already spells."""
    monkeypatch.setattr(watchdog, "_timeout", None)
    monkeypatch.setenv(watchdog.ENV, value)
    with pytest.raises(ValueError, match=f"{watchdog.ENV}={value!r}"):
        watchdog.timeout()
    problem = watchdog.timeout_problem()
    assert problem is not None and f"{watchdog.ENV}={value!r}" in problem and "0 turns" in problem


@pytest.mark.parametrize("value,expected", [(" 5 ", 5.0), ("0", 0.0), ("2.5", 2.5), ("1e3", 1000.0)])
def test_a_good_environment_value_is_the_timeout(monkeypatch, value, expected):
    monkeypatch.setattr(watchdog, "_timeout", 30.0)
    monkeypatch.setenv(watchdog.ENV, value)
    assert watchdog.timeout() == expected
    assert watchdog.timeout_problem() is None


@pytest.mark.parametrize("value", [None, "", "   "])
def test_an_unset_or_blank_environment_value_leaves_the_set_timeout(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(watchdog.ENV, raising=False)
    else:
        monkeypatch.setenv(watchdog.ENV, value)
    monkeypatch.setattr(watchdog, "_timeout", None)
    assert watchdog.timeout() == watchdog.DEFAULT_TIMEOUT_S and watchdog.timeout_problem() is None
    watchdog.set_timeout(7)
    assert watchdog.timeout() == 7.0 and watchdog.timeout_problem() is None


@pytest.mark.parametrize("seconds", [-1, -1e-9, float("nan"), float("inf"), True, False, "5", None, [5]])
def test_set_timeout_refuses_anything_but_a_finite_number_of_seconds(monkeypatch, seconds):
    monkeypatch.setattr(watchdog, "_timeout", 12.0)
    monkeypatch.delenv(watchdog.ENV, raising=False)
    with pytest.raises(ValueError, match="set_timeout: seconds must be a finite number >= 0"):
        watchdog.set_timeout(seconds)
    assert watchdog.timeout() == 12.0


@pytest.mark.parametrize("seconds,expected", [(0, 0.0), (3, 3.0), (0.25, 0.25), (np.float32(2), 2.0),
                                              (np.int64(9), 9.0)])
def test_set_timeout_takes_finite_numbers(monkeypatch, seconds, expected):
    monkeypatch.setattr(watchdog, "_timeout", None)
    monkeypatch.delenv(watchdog.ENV, raising=False)
    watchdog.set_timeout(seconds)
    assert watchdog.timeout() == expected and type(watchdog.timeout()) is float


# A job whose rank 1 waits (marked, for the watchdog) for a message that never comes while rank 0
# blocks unmarked: only an abort from rank 1's monitor thread ends it.
_MONITOR_FAILS = """
import os
import sys

from mpi4py import MPI

from exdyna_mpi.transport import watchdog

how = sys.argv[1]
comm = MPI.COMM_WORLD
if comm.Get_rank() == 1:
    with watchdog.waiting("the drill's wait", comm):
        # the monitor thread starts with the wait; what it reads goes bad after
        if how == "env":
            os.environ[watchdog.ENV] = "abc"
        else:
            def broken():
                raise RuntimeError("drill: the timeout cannot be read")
            watchdog.timeout = broken
        print("fault drill: rank 1 waits", flush=True)
        comm.recv(source=0)
else:
    comm.recv(source=1)
print("finished without the abort", flush=True)
"""

# The root (the last rank) stops for ever before a broadcast that the others wait in.
_BROADCAST_STALLS = """
import os
import signal

import numpy as np
from mpi4py import MPI

from exdyna_mpi import transport

comm = MPI.COMM_WORLD
root = comm.Get_size() - 1
if comm.Get_rank() == root:
    print(f"fault drill: rank {root} stops before the broadcast", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
transport.broadcast(np.zeros(1000, np.float32), comm, root)
print("finished without the abort", flush=True)
"""


def _launch(tmp_path, n, source, *args, env=None):
    if MPIEXEC is None:
        pytest.skip("no mpiexec on PATH")
    script = tmp_path / "job.py"
    script.write_text(source)
    cmd = ["timeout", "-k", "5", "120", MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", str(script), *args]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=child_env(env), capture_output=True, text=True, stdin=subprocess.DEVNULL)
    return p, time.monotonic() - t0, p.stdout + p.stderr


@pytest.mark.parametrize("how,cause", [("env", f"{watchdog.ENV}='abc'"),
                                       ("raise", "RuntimeError: drill: the timeout cannot be read")])
def test_a_failing_monitor_thread_aborts_the_job(tmp_path, how, cause):
    """The monitor thread fails while a wait is marked (a bad ``EXDYNA_TIMEOUT_S`` read after the
    construction check, or any exception): it aborts the job naming the rank and the cause, instead
    of dying and leaving the wait unbounded."""
    p, took, text = _launch(tmp_path, 2, _MONITOR_FAILS, how, env={watchdog.ENV: "30"})
    assert p.returncode not in (0, 124, 137) and took < 60, f"rc {p.returncode} after {took:.0f} s\n{text[-3000:]}"
    assert "fault drill: rank 1 waits" in text, text[-3000:]
    assert "exdyna_mpi: rank 1: the watchdog failed" in text and cause in text, text[-3000:]
    assert "finished without the abort" not in text


@pytest.mark.parametrize("n", [2, 3])
def test_a_stalled_root_of_a_broadcast_ends_the_job_within_the_timeout(tmp_path, n):
    """``transport.broadcast`` (rank 0's parameters in the torch adapters and DiLoCo) is a bounded
    wait: with its root stopped (SIGSTOP), the others' monitor threads abort the job."""
    p, took, text = _launch(tmp_path, n, _BROADCAST_STALLS, env={watchdog.ENV: "4"})
    assert p.returncode not in (0, 124, 137) and took < 60, f"rc {p.returncode} after {took:.0f} s\n{text[-3000:]}"
    assert f"rank {n - 1} stops before the broadcast" in text, text[-3000:]
    assert "s in broadcast, past the timeout of 4 s" in text, text[-3000:]
    assert "finished without the abort" not in text
