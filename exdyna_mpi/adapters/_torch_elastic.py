"""Shrink and continue after a lost rank (``elastic=True``): the recovery every elastic torch entry
point goes through (``DistributedOptimizer``, ``DiLoCo``).

When an MPI call of a step reports a lost rank (or a communicator another survivor revoked), the
entry point calls ``recover``, on every survivor:

1. revoke the communicator and shrink it to the survivors (``transport.ulfm.shrink``);
2. gather every survivor's progress (steps completed) and state dict over the new communicator;
   the most advanced survivor (the lowest new rank among those with the most steps) is the root;
3. broadcast the root's parameters (and the buffers the entry point keeps alike) to every survivor;
4. rebuild the exchange for the ranks left (partitions recomputed for P - 1) and load the gathered
   dicts through the entry point's resharding (``reshard`` with ``complete=False``): what the ranks
   held alike comes from the root, the residuals are recombined by the resharding rule
   (``sum of the survivors' residuals / P_old``: the dead rank's share is lost);
5. raise ``RanksLost`` on every survivor, the same step count on each.

What is exact: every survivor ends with the root's parameters, optimizer state and step count, bit
for bit, and later steps keep them identical. What is lost: the dead rank's residual (its gradient
mass not yet sent) and its data since the last step; the step in which the failure struck, on every
survivor that had not completed it (its gradient); for DiLoCo, the dead rank's local steps since the
last outer step (and those of a survivor that had not completed the failed outer step).

A second failure while shrinking is retried once; one during the rest of the recovery is raised
(the launcher then ends the job, as for any error on one rank).
"""
from __future__ import annotations

import time
from typing import Any, Protocol

from exdyna_mpi import transport
from exdyna_mpi._errors import RanksLost
from exdyna_mpi.transport import ulfm

from ._torch_common import broadcast_parameters

__all__ = ["Elastic", "ElasticTarget", "elastic_problem", "recover"]


class ElasticTarget(Protocol):
    """What an elastic entry point hands ``recover``."""

    def _elastic_comm(self) -> Any: ...

    def _elastic_state(self) -> dict[str, Any]: ...

    def _elastic_shared(self) -> list[Any]: ...

    def _elastic_rebuild(self, comm: Any, dicts: list[dict[str, Any]]) -> None: ...


class Elastic:
    """An elastic entry point's membership: the steps completed and the losses recovered from.

    Attributes:
        steps: steps (outer steps for DiLoCo) completed on this rank since construction or the
            last load.
        history: one ``RanksLost`` per recovery, oldest first.
    """

    __slots__ = ("steps", "history")

    def __init__(self) -> None:
        self.steps = 0
        self.history: list[RanksLost] = []


def elastic_problem(elastic: Any, who: str, *, overlap: bool = False,
                    options: dict[str, Any] | None = None) -> str | None:
    """This rank's problem with ``elastic=`` (None: none); not collective (the entry point agrees)."""
    if not isinstance(elastic, bool):
        return f"{who}: elastic must be True or False, got {elastic!r}"
    if not elastic:
        return None
    problem = ulfm.fault_tolerance_problem()
    if problem is not None:
        return f"{who}: elastic=True needs an MPI that survives a lost rank: {problem}"
    if overlap:
        return f"{who}: elastic=True does not run with overlap=True (its worker's exchange is not recovered)"
    if options and options.get("deadline_ms") is not None:
        return f"{who}: elastic=True does not run with deadline_ms (its late messages are not recovered)"
    return None


def _shrink(comm: Any) -> ulfm.Shrunk:
    try:
        return ulfm.shrink(comm)
    except BaseException as e:   # noqa: BLE001 - another rank lost while shrinking: once more
        if not ulfm.is_rank_failure(e, comm):
            raise
        return ulfm.shrink(comm)


def recover(target: ElasticTarget, elastic: Elastic) -> RanksLost:
    """Recover ``target`` on this survivor after a lost rank (collective over the survivors; see
    the module docstring). Returns the ``RanksLost`` to raise; ``elastic`` records it."""
    t0 = time.perf_counter()
    shrunk = _shrink(target._elastic_comm())
    ex = transport.Exchange(shrunk.comm)
    got = ex.gather_objects((elastic.steps, target._elastic_state()))
    steps = [int(s) for s, _ in got]
    root = steps.index(max(steps))
    broadcast_parameters(target._elastic_shared(), shrunk.comm, root=root)
    dicts = [got[root][1]] + [d for i, (_, d) in enumerate(got) if i != root]
    target._elastic_rebuild(shrunk.comm, dicts)
    elastic.steps = steps[root]
    lost = RanksLost(shrunk.comm, shrunk.lost, shrunk.old_ranks, ex.rank, steps[root], time.perf_counter() - t0)
    elastic.history.append(lost)
    return lost


def guarded_step(target: ElasticTarget, elastic: Elastic | None, body: Any, count: bool = True) -> Any:
    """Run ``body()`` (one step; ``count``: count it when it completes). A lost rank during it:
    ``recover``, then raise ``RanksLost`` on every survivor. ``elastic`` None: just ``body()``."""
    if elastic is None:
        return body()
    try:
        result = body()
    except BaseException as e:   # noqa: BLE001 - only MPI's report of a lost rank is recovered
        if not ulfm.is_rank_failure(e, target._elastic_comm()):
            raise
        raise recover(target, elastic) from None
    if count:
        elastic.steps += 1
    return result
