"""``exdyna_hook``: the DDP communication hook, ``ddp.register_comm_hook(ExDynaHookState(...), exdyna_hook)``."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .state import ExDynaHookState

__all__ = ["exdyna_hook"]


# ``bucket`` and the return value carry no annotation: DDP's register_comm_hook compares them with
# the classes ``dist.GradBucket`` and ``Future[Tensor]``, and this module's postponed annotations are
# strings (torch is not imported when the module is).
def exdyna_hook(state: ExDynaHookState, bucket):  # -> torch.futures.Future[torch.Tensor]
    """DDP communication hook (``bucket``: a ``torch.distributed.GradBucket``; returns a
    ``torch.futures.Future[torch.Tensor]``): the bucket's gradient averaged over the ranks (the mean, as DDP's
    default allreduce hook gives) through ``state``'s sparsifier(s).

    Returns at once with a future that ``state``'s worker thread completes: with ``scope="bucket"``
    as soon as this bucket's exchange is done; with ``scope="model"`` after the iteration's last
    bucket has arrived and the one model-wide exchange is done (no overlap with backward for the
    exchange itself, but the backward thread never waits for it). A refused step (``StepError``:
    say, NaN in one rank's gradient) makes ``backward()`` raise on every rank; any other error in the
    exchange prints its traceback and aborts the MPI job rather than leave other ranks waiting.

    Args:
        state: the hook's ``ExDynaHookState`` (sparsifiers, recipe, worker thread).
        bucket: DDP's ``GradBucket``.

    Returns:
        A ``torch.futures.Future`` of the bucket's averaged gradient.

    Raises:
        Nothing itself: a refused step sets ``StepError`` on the future (``backward()`` raises it on
        every rank); any other error aborts the job.

    Example::

        >>> # xdoctest: +SKIP
        >>> state = ExDynaHookState("exdyna", density=0.01, scope="model")
        >>> ddp_model.register_comm_hook(state, exdyna_hook)
    """
    return state.exchange(bucket)
