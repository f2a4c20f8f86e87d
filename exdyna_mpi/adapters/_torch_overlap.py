"""``DistributedOptimizer(overlap=True)``: each step's exchange runs while the next gradient is computed.

On a slow link a sparse exchange can take as long as a step's compute. With ``overlap=True`` the
exchange of step ``t``'s gradient runs on a worker thread (``transport.Worker``, on a private
duplicate of the communicator) while the caller runs forward and backward for step ``t + 1``; the
next ``step()`` waits for it, applies its result and hands the new gradient to the worker. A step
then costs about ``max(compute, exchange)`` instead of their sum, and each update is applied one
step late: the gradient of step ``t + 1`` is computed on parameters that lack the update of step
``t`` (one step of staleness, as in pipelined SGD and SCAPE's late masks). Everything else is the
synchronous step's: the same recipe, Adam path and sparsifier run on the same bits in the same
order, only the parameters they see are one update behind. ``flush()`` applies the update still
in flight (before evaluating the final model); ``state_dict()`` waits for it and saves it unapplied,
so a resumed run continues bit for bit.

On a CUDA device the caller's stream is synchronised before the hand-over and the device after the
exchange, so neither thread depends on how the other's streams are ordered.

The protocol between the caller's thread and the worker is strict alternation: the caller touches
the sparsifier, the recipe's and the Adam path's state only while no exchange is in flight (after
``wait``, before ``submit``), so nothing is shared while the worker runs. An error that every rank
raises together (``CollectiveError``: a refused step) is raised by the next ``step()``/``flush()``
on every rank, with nothing applied; any other error in the worker ends the MPI job, since the
other ranks may wait for this one in a collective.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

import exdyna_mpi

from .. import transport
from ..transport import watchdog
from ._torch_common import _torch

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI

OVERLAP_KEY = "exdyna_overlap"


class _InFlight:
    """One exchange handed to the worker: set ``done`` when it ends, with its sparsifier or its error."""

    __slots__ = ("done", "sp", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.sp: Any = None
        self.error: BaseException | None = None


class OverlappedExchange:
    """The worker, the buffers and the update in flight of ``DistributedOptimizer(overlap=True)``.

    Args:
        numel, dtype, device: the flat gradient's.

    The buffer ``buf`` holds the gradient being exchanged while an exchange is in flight, and its
    result afterwards, until ``take`` hands the result to the caller.
    """

    def __init__(self, numel: int, dtype: Any, device: Any) -> None:
        self.worker = transport.Worker("exdyna-overlap")
        self.buf: torch.Tensor = _torch().zeros(numel, dtype=dtype, device=device)
        self.spare: torch.Tensor | None = None   # made at the first step that needs it (the wrapped optimizer's)
        self._flight: _InFlight | None = None
        #: a finished exchange whose result (in ``buf``) is not applied yet: the sparsifier that ran it
        #: (None: nothing pending), and whether it skipped the step (``nonfinite="skip"``)
        self.pending: Any = None
        self.skipped = False

    def open(self, comm: MPI.Comm) -> MPI.Comm:
        """The worker's private communicator (collective over ``comm`` at the first call)."""
        return self.worker.open(comm)

    @property
    def has_pending(self) -> bool:
        """Whether a finished exchange's result waits in ``buf`` to be applied."""
        return self.pending is not None

    def submit(self, run: Callable[[Any], Any]) -> None:
        """Start ``run(buf)`` (the exchange, in place; returns the sparsifier that ran) on the worker."""
        assert self._flight is None and not self.has_pending   # strict alternation (module docstring)
        flight = self._flight = _InFlight()
        comm = self.worker.comm
        assert comm is not None   # opened at construction
        buf = self.buf
        cuda = buf.is_cuda
        if cuda:
            # the caller's stream wrote buf (the copy of the gradient); the worker's streams are others
            _torch().cuda.current_stream(buf.device).synchronize()

        def job() -> None:
            try:
                flight.sp = run(buf)
                if cuda:   # the result, and the residual's decay, complete before the caller reads them
                    _torch().cuda.synchronize(buf.device)
            except BaseException as e:   # noqa: BLE001 - raised by the caller's next wait, or fatal below
                if not isinstance(e, exdyna_mpi.CollectiveError):
                    transport.abort_job(comm, e, "DistributedOptimizer", "the overlapped exchange")
                flight.error = e
            flight.done.set()

        self.worker.submit(job)

    def wait(self, comm: MPI.Comm) -> None:
        """Wait for the exchange in flight (if any); its result becomes ``pending``. Raises its
        ``CollectiveError`` (on every rank: the exchange agreed on it), leaving nothing pending."""
        flight = self._flight
        if flight is None:
            return
        with watchdog.waiting("the overlapped exchange", comm):
            flight.done.wait()
        self._flight = None
        if flight.error is not None:
            raise flight.error
        self.pending, self.skipped = flight.sp, bool(flight.sp.stats.skipped)

    def take(self) -> tuple[Any, Any, bool]:
        """``(buf, the sparsifier that ran, skipped)`` of the pending result; nothing is pending afterwards."""
        assert self.has_pending
        sp, self.pending = self.pending, None
        return self.buf, sp, self.skipped

    def state_dict(self) -> dict[str, Any]:
        """The pending result (None when nothing is pending) and whether its exchange skipped the
        step; call ``wait`` first."""
        return {"pending": self.buf.clone() if self.has_pending else None, "skipped": self.skipped}

    def check(self, d: Any, numel: int) -> None:
        """Raise ``ValueError`` if ``d`` cannot be loaded; changes nothing."""
        torch = _torch()
        if not isinstance(d, dict) or "pending" not in d:
            raise ValueError(f"the dict's {OVERLAP_KEY!r} is not an overlap state (a dict with 'pending')")
        if not isinstance(d.get("skipped"), bool):
            raise ValueError(f"{OVERLAP_KEY}.skipped is {d.get('skipped')!r}, not a bool")
        p = d["pending"]
        if p is None:
            return
        if not isinstance(p, torch.Tensor) or p.numel() != numel:
            n = p.numel() if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(f"{OVERLAP_KEY}.pending has {n} elements, the model {numel}")
        if not bool(torch.isfinite(p).all()):
            raise ValueError(f"{OVERLAP_KEY}.pending holds non-finite values")

    def load_state_dict(self, d: dict[str, Any], sp: Any) -> None:
        """Load a dict that ``check`` accepted (call ``wait`` first); ``sp``: the sparsifier the
        pending result is credited to."""
        p = d["pending"]
        if p is None:
            self.pending, self.skipped = None, False
        else:
            self.buf.copy_(p.to(self.buf.device, self.buf.dtype))
            self.pending, self.skipped = sp, bool(d["skipped"])
