"""One refusal on every rank: the pattern behind every collective check of arguments and state dicts.

Each rank checks its own input first (no communication), then one agreement tells every rank
whether any rank found a problem; only then are the texts gathered, so the good path costs one
small ``Allgather``. Every rank raises the same ``CollectiveError``, naming each rank and its
problem, before anything changed.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np

from .._errors import CollectiveError

__all__ = ["Agreeing", "agree_problems"]


class Agreeing(Protocol):
    """What ``agree_problems`` needs of a transport (``Exchange``, ``DeviceExchange``, ``GroupTransport``)."""

    def agree(self, words: Sequence[int]) -> np.ndarray: ...

    def gather_objects(self, obj: Any) -> list[Any]: ...


def agree_problems(exchange: Agreeing, problem: str | None, what: str, words: Sequence[int] = ()) -> np.ndarray:
    """Raise the same ``CollectiveError`` on every rank when any rank has a problem. Collective.

    Args:
        exchange: the transport whose communicator spans the ranks that must agree.
        problem: this rank's problem (a text), or None.
        what: the message's head, e.g. ``"topk: load_state_dict refused"``.
        words: integers every rank contributes to the same agreement (iteration, a fingerprint),
            for the caller to compare.

    Returns:
        The ranks' ``words``, a (P, len(words)) int64 array, the same on every rank.

    Raises:
        CollectiveError: ``"{what}: rank r: problem; ..."`` (the ranks that found one), on every rank.
    """
    got = exchange.agree([1 if problem else 0, *words])
    if got[:, 0].any():
        msgs = exchange.gather_objects(problem)
        raise CollectiveError(f"{what}: " + "; ".join(f"rank {r}: {m}" for r, m in enumerate(msgs) if m))
    return got[:, 1:]
