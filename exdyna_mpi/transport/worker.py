"""A worker thread with a private communicator: where an adapter runs collectives off the caller's thread.

The DDP hook (``adapters/torch_hook/``) queues one exchange per bucket from the backward thread
and lets ``Worker`` run them in FIFO order, so every rank issues its collectives in the same order
while backward goes on. The collectives run on a private duplicate of the user's communicator, so
the user's own calls on it never meet them. The MPI calls of that arrangement (``Dup``, ``Free``,
``Abort``) live here, in the transport layer, with the thread's life cycle: the thread starts at the
first submission, ends after its queue when stopped, when its owner is dropped, or at interpreter
exit (before ``MPI_Finalize``).
"""
from __future__ import annotations

import atexit
import queue
import sys
import threading
import traceback
import weakref
from typing import Any, Callable

from mpi4py import MPI  # imported before the exit hook below is registered: it runs before MPI_Finalize

from . import watchdog

__all__ = ["EXIT_JOIN_S", "Worker", "abort_job"]

#: workers whose thread is running, for the exit hook below
_LIVE: weakref.WeakSet[Worker] = weakref.WeakSet()
#: how long interpreter exit waits for a worker to finish its queued calls
EXIT_JOIN_S = 60.0


@atexit.register
def _stop_workers_at_exit() -> None:  # pragma: no cover - exercised by a launched job (test_ddp_hook)
    """A process that ends without stopping its workers: end their threads here.

    atexit runs handlers last-registered first, and this module imports mpi4py before it
    registers this one, so it runs before MPI is finalized. A worker thread
    still alive when the interpreter finalizes is stopped wherever it stands, which aborted such
    processes ("terminate called without an active exception", exit code 6, about half the runs
    with three DDP hook states at P=3). Nothing collective happens here (the ranks need not exit
    together): the private communicators are left to ``MPI_Finalize``."""
    for worker in list(_LIVE):
        worker.stop(EXIT_JOIN_S)


def _loop(q: queue.SimpleQueue) -> None:
    while True:
        fn = q.get()
        if fn is None:
            return
        fn()


class Worker:
    """One thread that runs submitted calls in order, and the private communicator they use.

    Args:
        name: the thread's name (shown in tracebacks and debuggers).

    Example::

        >>> w = Worker("exdyna-ddp-hook")
        >>> comm = w.open(MPI.COMM_WORLD)        # collective: a private duplicate, made once
        >>> w.submit(lambda: exchange(comm))     # runs on the worker, in submission order
        >>> w.call(lambda: 42, MPI.COMM_WORLD, "the queued exchanges")   # waits for the queue: 42
        >>> w.call(w.free, MPI.COMM_WORLD, "freeing")   # collective: on the worker, after its queue
        >>> w.stop(None)
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._comm: MPI.Comm | None = None
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None

    @property
    def comm(self) -> MPI.Comm | None:
        """The private communicator, or None before ``open`` (and after ``free``)."""
        return self._comm

    @property
    def running(self) -> bool:
        """Whether the thread is running (it starts at the first ``submit``)."""
        return self._thread is not None

    def open(self, comm: MPI.Comm) -> MPI.Comm:
        """The private duplicate of ``comm``, made at the first call. Collective over ``comm`` then.

        Returns:
            The private communicator.
        """
        if self._comm is None:
            with watchdog.waiting("Comm.Dup (a private communicator)", comm):
                self._comm = comm.Dup()
        return self._comm

    def free(self) -> None:
        """Free the private communicator (collective over it); a no-op without one."""
        if self._comm is not None:
            self._comm.Free()
            self._comm = None

    def submit(self, fn: Callable[[], None] | None) -> None:
        """Queue ``fn`` to run on the thread after everything queued before (starting the thread)."""
        if self._thread is None:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=_loop, args=(self._queue,), daemon=True, name=self.name)
            self._thread.start()
            weakref.finalize(self, self._queue.put, None)   # a worker dropped without stop(): end its thread
            _LIVE.add(self)
        assert self._queue is not None        # made with the thread
        self._queue.put(fn)

    def call(self, fn: Callable[[], Any], comm: MPI.Comm, what: str) -> Any:
        """``fn()`` on the thread after the calls queued so far (directly when it is not running),
        its result returned and its exception raised here.

        Args:
            fn: the call.
            comm: the communicator the watchdog names (and aborts) should the wait pass the timeout.
            what: the wait, as the watchdog's message names it.

        Returns:
            What ``fn`` returned.
        """
        if self._thread is None:
            return fn()
        done, box = threading.Event(), {}

        def job():
            try:
                box["value"] = fn()
            except BaseException as e:   # noqa: BLE001 - handed to the caller
                box["error"] = e
            done.set()

        self.submit(job)
        with watchdog.waiting(what, comm):
            done.wait()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def stop(self, timeout: float | None) -> None:
        """End the thread after its queued calls (not collective); waits up to ``timeout`` seconds
        (None: for ever). A thread still busy then is left running, and stays registered."""
        thread, q = self._thread, self._queue
        if thread is None:
            return
        assert q is not None                  # made with the thread
        q.put(None)
        thread.join(timeout)
        if not thread.is_alive():
            self._thread = self._queue = None
            _LIVE.discard(self)


def abort_job(comm: MPI.Comm, e: BaseException, who: str, where: str) -> None:
    """End the MPI job for an error on this rank alone (not agreed): the other ranks may be waiting
    for this one in a collective, and would wait for ever. Writes the traceback and
    "``who``: a non-collective error in ``where`` on rank R: aborting the job" (one write: the
    launcher may drop what a rank writes after another rank's abort began), then ``MPI_Abort``."""
    sys.stderr.write("".join(traceback.format_exception(type(e), e, e.__traceback__))
                     + f"{who}: a non-collective error in {where} on rank {comm.Get_rank()}: aborting the job\n")
    sys.stderr.flush()
    comm.Abort(1)
