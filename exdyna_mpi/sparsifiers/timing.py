"""Phase timing for the step's ``seconds`` dict: ``timed``, one ``perf_counter`` pair as a block."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def timed(sec: dict[str, float], key: str, *, add: bool = False) -> Iterator[None]:
    """Time the block with ``time.perf_counter`` and record its seconds in ``sec[key]``.

    The key is written only when the block ends normally: a block that raises leaves ``sec`` as it
    was (as a hand-written ``t0 = ...; ...; sec[key] = ... - t0`` pair would).

    Args:
        sec: the phase times of one step (``Step.sec``, which becomes ``Stats.seconds``).
        key: the phase's name, e.g. ``"select"``.
        add: add the block's seconds to ``sec[key]`` (0 when absent) instead of replacing it,
            for a phase timed in several pieces.

    Example::

        >>> sec = {}
        >>> with timed(sec, "select"):
        ...     pass
        >>> sorted(sec)
        ['select']
    """
    t0 = time.perf_counter()
    yield
    dt = time.perf_counter() - t0
    sec[key] = sec.get(key, 0.0) + dt if add else dt
