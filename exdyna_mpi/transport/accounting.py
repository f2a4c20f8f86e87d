"""Byte accounting: what one rank's transport moved over its link, by the ring model.

Every transport of the package (``Exchange`` and its device subclass, ``GroupTransport``,
``DeadlineTransport``) owns one ``ByteCounter``, as ``bytes``, and reads its ``bytes_sent`` and
``bytes_received`` from it (``CountsBytes``); only the transport's own calls add to it. A figure
counted elsewhere joins a counter through its methods (``add``, ``add_from``), never by assignment.

Byte counts follow the bandwidth-optimal ring algorithms (Thakur, Rabenseifner, Gropp 2005): what
crosses this rank's link in each direction, the same model for every sparsifier.
"""
from __future__ import annotations

from typing import Sequence, Union

import numpy as np

__all__ = ["ByteCounter", "CountsBytes"]

#: elements per rank, in rank order (an integer array or sequence)
Counts = Union[np.ndarray, Sequence[int]]


class ByteCounter:
    """The bytes one rank's transport moved over its link since the last ``reset``, by the ring model.

    ``sent`` and ``received`` (ints); ``allgather`` and ``reduce`` add a collective's bytes as the
    bandwidth-optimal ring moves them, ``add`` what a point-to-point call moved, ``add_from`` what
    another counter holds. The host and device exchanges own one each and count the same calls the
    same way, so a device step reports the host step's bytes.

    Args:
        rank: this rank's index in the communicator.
        size: the communicator's size (P).

    Raises:
        Nothing of its own.

    Example::

        >>> c = ByteCounter(rank=1, size=4)
        >>> c.allgather([3, 5, 2, 7], 8)     # all but its own (5) in, all but its successor's (2) out
        >>> (c.sent, c.received)
        (120, 96)
    """

    __slots__ = ("rank", "size", "sent", "received")

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = int(rank), int(size)
        self.sent = 0
        self.received = 0

    def reset(self) -> None:
        """Start counting again from zero (the template does at the start of every step)."""
        self.sent = 0
        self.received = 0

    def add(self, sent: int, received: int) -> None:
        """Add ``sent`` and ``received`` bytes (point-to-point calls, a progress thread's round)."""
        self.sent += int(sent)
        self.received += int(received)

    def add_from(self, other: ByteCounter) -> None:
        """Add what ``other`` counted (another transport's bytes, reported as this one's)."""
        self.add(other.sent, other.received)

    def allgather(self, counts: Counts, itemsize: int) -> None:
        """An ``Allgather(v)`` of ``counts[r]`` elements of ``itemsize`` bytes from each rank r: a
        ring receives everything but its own and sends everything but its successor's."""
        p = self.size
        if p == 1:
            return
        total = int(np.sum(counts))
        self.received += (total - int(counts[self.rank])) * itemsize
        self.sent += (total - int(counts[(self.rank + 1) % p])) * itemsize

    def reduce(self, n: int, itemsize: int) -> None:
        """A sum of ``n`` elements over the ranks (Reduce_scatter + Allgatherv, or an Allreduce):
        2 (P - 1) / P of the vector each way."""
        p = self.size
        if p == 1:
            return
        b = 2 * (p - 1) * n * itemsize // p
        self.sent += b
        self.received += b


class CountsBytes:
    """The byte figures of a transport, read from the ``ByteCounter`` it owns (``bytes``).

    A base class: the transport sets ``bytes`` in its constructor; ``bytes_sent`` and
    ``bytes_received`` are read-only, so only the counter's methods change them.
    """

    __slots__ = ()
    bytes: ByteCounter

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent since the last ``reset_counters`` (``bytes.sent``)."""
        return self.bytes.sent

    @property
    def bytes_received(self) -> int:
        """Bytes this rank received since the last ``reset_counters`` (``bytes.received``)."""
        return self.bytes.received

    def reset_counters(self) -> None:
        """Zero the byte counter."""
        self.bytes.reset()
