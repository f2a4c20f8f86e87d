"""Bounded waits: every blocking MPI wait of the package ends the job after a timeout.

A rank that stops without dying (SIGSTOP, a stalled node, a debugger) leaves the others inside a
collective for ever, and an MPI collective cannot be cancelled. So every wait of the package is
marked (``watched``: the exchanges of the sparsifiers, WAGMA's rounds and joins, the deadline
exchange's flush, the DDP hook's wait for its worker), and one monitor thread per process aborts
the job when a wait has lasted longer than the timeout, after writing which wait, on which rank,
for how long. ``MPI_Abort`` ends every rank, the stopped one included.

The timeout: ``EXDYNA_TIMEOUT_S`` in the environment (seconds; 0 turns the watchdog off), else
``set_timeout(seconds)``, else 600 s (torch.distributed's default for its collectives). Raise it for
jobs where one rank may legitimately keep the others waiting longer (a long evaluation on rank 0
between steps).
"""
from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

DEFAULT_TIMEOUT_S = 600.0
ENV = "EXDYNA_TIMEOUT_S"

_lock = threading.Lock()
_waits: dict[int, tuple[str, float, Any]] = {}   # thread id -> (what, start, communicator)
_timeout: float | None = None
_monitor: threading.Thread | None = None
_stop = threading.Event()


def timeout() -> float:
    """The timeout in seconds (0: off)."""
    env = os.environ.get(ENV, "").strip()
    if env:
        try:
            return max(0.0, float(env))
        except ValueError:
            raise ValueError(f"{ENV}={env!r}: expected a number of seconds (0 turns the watchdog off)") from None
    return DEFAULT_TIMEOUT_S if _timeout is None else _timeout


def set_timeout(seconds: float) -> None:
    """Bound every later wait of the package by ``seconds`` (0: unbounded).

    Set the same value on every rank. ``EXDYNA_TIMEOUT_S`` in the environment takes precedence.
    Past the bound a monitor thread names the wait and the rank and aborts the job.

    Args:
        seconds: the bound, >= 0 (0 turns it off).

    Returns:
        None.

    Raises:
        ValueError: ``seconds`` is negative or not a number.
    """
    global _timeout
    if not seconds >= 0:
        raise ValueError(f"set_timeout: seconds must be >= 0, got {seconds!r}")
    _timeout = float(seconds)


def _rank(comm: Any) -> str:
    try:
        return str(comm.Get_rank())
    except Exception:   # noqa: BLE001 - a freed communicator: the message still goes out
        return "?"


def _watch() -> None:
    while not _stop.wait(0.5):
        limit = timeout()
        if not limit:
            continue
        now = time.monotonic()
        with _lock:
            late = [(what, now - t0, comm) for what, t0, comm in _waits.values() if now - t0 > limit]
        if late:
            what, waited, comm = max(late, key=lambda w: w[1])
            sys.stderr.write(f"exdyna_mpi: rank {_rank(comm)} has waited {waited:.0f} s in {what}, past the "
                             f"timeout of {limit:g} s: another rank stopped, hung or died without ending the job. "
                             f"Aborting the job (raise the bound with {ENV} or exdyna_mpi.set_timeout).\n")
            sys.stderr.flush()
            # MPI_Abort tears the launcher's output pipes down at once: give it a moment to forward
            # the message (seen lost without, once in a dozen runs of the SIGSTOP test)
            time.sleep(1.0)
            comm.Abort(3)
            return


def _stop_monitor() -> None:  # pragma: no cover - runs at interpreter exit
    _stop.set()
    if _monitor is not None:
        _monitor.join(2.0)


@contextmanager
def waiting(what: str, comm: Any) -> Iterator[None]:
    """Mark this thread as waiting in ``what`` on ``comm`` (the communicator to abort)."""
    global _monitor
    if _monitor is None:
        with _lock:
            if _monitor is None:
                _monitor = threading.Thread(target=_watch, name="exdyna-watchdog", daemon=True)
                _monitor.start()
                atexit.register(_stop_monitor)   # registered after mpi4py's finalizer: runs before it
    me = threading.get_ident()
    if me in _waits:   # nested: the outer wait's clock keeps running
        yield
        return
    with _lock:
        _waits[me] = (what, time.monotonic(), comm)
    try:
        yield
    finally:
        with _lock:
            _waits.pop(me, None)


def watched(fn: Callable) -> Callable:
    """Decorate a method of an object with ``.comm``: its call is a bounded wait."""
    name = fn.__qualname__

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with waiting(name, self.comm):
            return fn(self, *args, **kwargs)
    return wrapper
