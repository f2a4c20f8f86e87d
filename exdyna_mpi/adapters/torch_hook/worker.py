"""The hook's worker thread and its two communicators.

``comm`` is the user's (the ranks of the exchange, ``MPI.COMM_WORLD`` unless given); the worker
makes a private duplicate of it at the first iteration (or load), so the user's own calls on
``comm`` never meet the hook's collectives. The thread and the duplicate are ``transport.Worker``'s:
this object adds the user's communicator and the hook's name in the messages.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from exdyna_mpi import transport

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["HookWorker"]


class HookWorker:
    """The worker thread of one ``ExDynaHookState``, the user's ``comm`` and the private communicator.

    Args:
        comm: the user's communicator, or None for ``MPI.COMM_WORLD``.

    Raises:
        RuntimeError: from ``set_comm``: the private communicator exists.
    """

    __slots__ = ("_thread", "_user_comm")

    def __init__(self, comm: MPI.Comm | None) -> None:
        self._thread = transport.Worker("exdyna-ddp-hook")   # the thread and the private communicator
        self._user_comm = comm

    @property
    def comm(self) -> MPI.Comm:
        """The ranks of the exchange (``MPI.COMM_WORLD`` unless given)."""
        return transport.world() if self._user_comm is None else self._user_comm

    def set_comm(self, comm: MPI.Comm) -> None:
        """Set ``comm`` (before the first iteration or a load, or after ``close()``).

        Raises:
            RuntimeError: the private communicator exists.
        """
        if self.private is not None:
            raise RuntimeError("ExDynaHookState.comm: set it before the first iteration (or after close())")
        self._user_comm = comm

    @property
    def private(self) -> MPI.Comm | None:
        """The worker's private communicator (None before the first iteration or load)."""
        return self._thread.comm

    @property
    def working(self) -> MPI.Comm:
        """The private communicator once it exists, else ``comm`` (a call before the first iteration)."""
        private = self.private
        return private if private is not None else self.comm

    @property
    def running(self) -> bool:
        """Whether the thread is running (it starts at the first submission)."""
        return self._thread.running

    def open(self) -> MPI.Comm:
        """The private communicator, made at the first call (collective over ``comm`` then)."""
        return self._thread.open(self.comm)

    def submit(self, fn: Callable[[], None]) -> None:
        """Queue ``fn`` on the thread, after everything queued before."""
        self._thread.submit(fn)

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the thread after the work queued so far (directly when it is not running);
        its exception is raised here.

        Returns:
            What ``fn`` returned.
        """
        return self._thread.call(fn, self.comm, "ExDynaHookState: the worker's queued exchanges")

    def free(self) -> None:
        """Free the private communicator (collective over it; on the thread)."""
        self._thread.free()

    def stop(self) -> None:
        """End the thread after its queued work (not collective)."""
        self._thread.stop(None)

    def abort(self, e: BaseException, where: str) -> None:
        """End the MPI job for an error on this rank alone: other ranks may wait for it in a collective."""
        transport.abort_job(self.comm, e, "ExDynaHookState", where)
