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
between steps). Either takes a finite number of seconds >= 0 and nothing else: a negative, NaN or
infinite value is an error, not a silent "off" (an unbounded wait is spelled 0). The sparsifiers'
construction checks the environment's value collectively (``timeout_problem``), so a bad value on
any rank is the same ``CollectiveError`` on every rank before any step. The bound holds to within
one poll of the monitor (half a second).

The monitor thread never dies quietly: should it fail (a bad value set after construction, or any
other exception), it writes the rank and the cause to stderr and aborts the job, since no wait of
its rank would be bounded after.
"""
from __future__ import annotations

import atexit
import functools
import math
import numbers
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Concatenate, Iterator, ParamSpec, Protocol, TypeVar

from mpi4py import MPI

DEFAULT_TIMEOUT_S = 600.0
ENV = "EXDYNA_TIMEOUT_S"
#: how often the monitor looks at the waits (seconds)
POLL_S = 0.5

_lock = threading.Lock()
_waits: dict[int, tuple[str, float, Any]] = {}   # thread id -> (what, start, communicator)
_timeout: float | None = None
_monitor: threading.Thread | None = None
_stop = threading.Event()


def _seconds(value: Any) -> float | None:
    """``value`` as a bound in seconds, or None when it is not a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return seconds + 0.0   # -0.0 reads as 0.0 (off)


def _from_env() -> float | None:
    """``EXDYNA_TIMEOUT_S`` in seconds, None when unset or blank.

    Raises:
        ValueError: the value is not a finite number of seconds >= 0.
    """
    env = os.environ.get(ENV, "").strip()
    if not env:
        return None
    try:
        seconds = _seconds(float(env))
    except ValueError:
        seconds = None
    if seconds is None:
        raise ValueError(f"{ENV}={env!r}: expected a finite number of seconds >= 0 (0 turns the watchdog off)")
    return seconds


def timeout() -> float:
    """The timeout in seconds (0: off).

    Returns:
        ``EXDYNA_TIMEOUT_S`` when set, else what ``set_timeout`` set, else ``DEFAULT_TIMEOUT_S``.

    Raises:
        ValueError: ``EXDYNA_TIMEOUT_S`` is set to anything but a finite number of seconds >= 0.
    """
    env = _from_env()
    if env is not None:
        return env
    return DEFAULT_TIMEOUT_S if _timeout is None else _timeout


def timeout_problem() -> str | None:
    """What is wrong with this process's ``EXDYNA_TIMEOUT_S`` (the text ``timeout`` raises), or None.

    Local (no communication): the sparsifiers' construction adds it to the arguments every rank
    checks together, so a bad value on one rank refuses the construction on all.
    """
    try:
        _from_env()
    except ValueError as e:
        return str(e)
    return None


def set_timeout(seconds: float) -> None:
    """Bound every later wait of the package by ``seconds`` (0: unbounded).

    Set the same value on every rank. ``EXDYNA_TIMEOUT_S`` in the environment takes precedence.
    Past the bound a monitor thread names the wait and the rank and aborts the job.

    Args:
        seconds: the bound, a finite number >= 0 (0 turns it off).

    Returns:
        None.

    Raises:
        ValueError: ``seconds`` is negative, NaN, infinite, a bool or not a number.
    """
    global _timeout
    value = _seconds(seconds)
    if value is None:
        raise ValueError(f"set_timeout: seconds must be a finite number >= 0 (0 turns the watchdog off), "
                         f"got {seconds!r}")
    _timeout = value


def _rank(comm: Any) -> str:
    try:
        return str(comm.Get_rank())
    except Exception:   # noqa: BLE001 - a freed communicator: the message still goes out
        return "?"


def _watch() -> None:
    try:
        while not _stop.wait(POLL_S):
            if _check():
                return
    except BaseException as e:   # noqa: BLE001 - a dead monitor would leave every later wait unbounded
        _fail(e)


def _check() -> bool:
    """Abort the job when a wait is past the timeout; True once the abort was asked for."""
    now = time.monotonic()
    with _lock:
        waits = [(what, now - t0, comm) for what, t0, comm in _waits.values()]
    # the timeout is read only while a wait is older than one poll: the bound holds to within a
    # poll anyway, and a construction refusing a bad EXDYNA_TIMEOUT_S on every rank (a short wait
    # in its agreement) is not then made an abort by this rank's monitor
    if not waits or max(w[1] for w in waits) <= POLL_S:
        return False
    limit = timeout()
    if not limit:
        return False
    late = [w for w in waits if w[1] > limit]
    if not late:
        return False
    what, waited, comm = max(late, key=lambda w: w[1])
    _say_and_abort(comm, f"exdyna_mpi: rank {_rank(comm)} has waited {waited:.0f} s in {what}, past the "
                   f"timeout of {limit:g} s: another rank stopped, hung or died without ending the job. "
                   f"Aborting the job (raise the bound with {ENV} or exdyna_mpi.set_timeout).\n")
    return True


def _fail(error: BaseException) -> None:
    """The monitor failed: end the job rather than leave this rank's waits unbounded."""
    if _stop.is_set():   # the interpreter is exiting: nothing is waiting any more
        return
    with _lock:
        waits = sorted(_waits.values(), key=lambda w: w[1])
    comm = waits[0][2] if waits else MPI.COMM_WORLD
    what = f" while waiting in {waits[0][0]}" if waits else ""
    _say_and_abort(comm, f"exdyna_mpi: rank {_rank(comm)}: the watchdog failed{what} "
                   f"({type(error).__name__}: {error}), so no wait of this rank would be bounded. "
                   f"Aborting the job.\n")


def _say_and_abort(comm: Any, message: str) -> None:
    try:
        sys.stderr.write(message)
        sys.stderr.flush()
    except Exception:   # noqa: BLE001 - a closed stderr must not keep the job from ending
        pass
    # MPI_Abort tears the launcher's output pipes down at once: give it a moment to forward
    # the message (seen lost without, once in a dozen runs of the SIGSTOP test)
    time.sleep(1.0)
    try:
        comm.Abort(3)
    except BaseException:   # noqa: BLE001 - a freed communicator: the whole job goes instead
        try:
            MPI.COMM_WORLD.Abort(3)
        finally:
            os._exit(3)


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


class _HasComm(Protocol):
    comm: Any


_Owner = TypeVar("_Owner", bound=_HasComm)
_Params = ParamSpec("_Params")
_Result = TypeVar("_Result")


def watched(fn: Callable[Concatenate[_Owner, _Params], _Result]) -> Callable[Concatenate[_Owner, _Params], _Result]:
    """Decorate a method of an object with ``.comm``: its call is a bounded wait (the method's
    signature is kept, for the type checker too)."""
    name = fn.__qualname__

    @functools.wraps(fn)
    def wrapper(self: _Owner, *args: _Params.args, **kwargs: _Params.kwargs) -> _Result:
        with waiting(name, self.comm):
            return fn(self, *args, **kwargs)
    return wrapper
