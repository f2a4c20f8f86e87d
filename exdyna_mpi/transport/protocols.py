"""The exchange roles, as typed protocols: what a sparsifier may ask of its exchange.

- ``ExchangeProtocol``: the collectives every sparsifier and adapter uses (the word agreement of the
  first collective, the error texts behind a refusal, ``allgatherv`` and compact indices,
  bit-identical sums, signs and 16-bit means, broadcast) and the ``ByteCounter`` they count into.
- ``PointToPointProtocol``: Ok-Topk's split-and-reduce (an ``Alltoall`` of counts, then rotating
  ``Isend``/``Irecv`` rounds); ``point_to_point`` hands a sparsifier its exchange in that role.

``Exchange`` implements both on host (NumPy) buffers, ``device.DeviceExchange`` on CUDA buffers.
Both protocols are runtime-checkable; tests/unit/test_exchange_protocol.py checks that they list
every member the package uses, and that both exchanges satisfy both.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence, Union, runtime_checkable

import numpy as np
from numpy.typing import DTypeLike

from .accounting import ByteCounter, Counts

if TYPE_CHECKING:
    import cupy
    from mpi4py import MPI

    from ..arrays.half import WireFormat

__all__ = ["Buffer", "Counts", "ExchangeProtocol", "PointToPointProtocol", "Words", "point_to_point"]

#: a buffer an exchange moves: a NumPy array on the host; a CuPy array on a CUDA device (a NumPy
#: array under the Numba simulator)
Buffer = Union[np.ndarray, "cupy.ndarray"]
#: a few integer words per rank (the agreement of a step's first collective)
Words = Union[np.ndarray, Sequence[int]]


@runtime_checkable
class ExchangeProtocol(Protocol):
    """The exchange role: the collectives every sparsifier and adapter uses (``Exchange`` on host
    buffers, ``DeviceExchange`` on CUDA buffers). Every rank of ``comm`` calls each method, with the
    same sizes where the docstrings say so; each counts its bytes into ``bytes``."""

    comm: MPI.Comm
    rank: int
    size: int
    bytes: ByteCounter

    @property
    def bytes_sent(self) -> int: ...

    @property
    def bytes_received(self) -> int: ...

    def reset_counters(self) -> None: ...

    def agree(self, words: Words) -> np.ndarray: ...

    def sum_words(self, words: Words, dtype: DTypeLike = np.int64) -> np.ndarray: ...

    def gather_objects(self, obj: object) -> list[Any]: ...

    def allgatherv(self, send: Buffer, counts: Counts, out: Buffer | None = None) -> Buffer: ...

    def allgather_indices(self, idx: Buffer, counts: Counts, spans: np.ndarray,
                          out: Buffer | None = None) -> Buffer: ...

    def sum_identical(self, vals: Buffer) -> Buffer: ...

    def sum_signs(self, vals: Buffer) -> Buffer: ...

    def mean_wire(self, vals: Buffer, fmt: WireFormat, signs: bool = False) -> Buffer: ...

    def mean_8bit(self, vals: Buffer, code: str, signs: bool = False) -> Buffer: ...

    def reduce_scatter_mean(self, vals: Buffer, counts: Counts, fmt: WireFormat | None = None) -> Buffer: ...

    def bcast_from(self, buf: Buffer, root: int) -> Buffer: ...


#: what one round sends to rank ``dst``: one host array per entry of the rounds' ``dtypes``
Parts = Callable[[int], Sequence[np.ndarray]]


@runtime_checkable
class PointToPointProtocol(Protocol):
    """Ok-Topk's point-to-point rounds (host buffers), beside the collectives of
    ``ExchangeProtocol``: ``Exchange`` and ``DeviceExchange`` implement both."""

    def alltoall_counts(self, send_counts: Counts) -> np.ndarray: ...

    def rotating_rounds(self, parts: Parts, recv_counts: Counts, dtypes: Sequence[DTypeLike],
                        tags: Sequence[int], bucket: int = 4) -> Iterator[tuple[np.ndarray, ...]]: ...


def point_to_point(exchange: ExchangeProtocol) -> PointToPointProtocol:
    """``exchange`` in its point-to-point role (Ok-Topk's split-and-reduce).

    Args:
        exchange: a sparsifier's exchange.

    Returns:
        The same object, typed as a ``PointToPointProtocol``.

    Raises:
        TypeError: the exchange has no point-to-point rounds.

    Example::

        >>> p2p = point_to_point(self.exchange)
        >>> recv_counts = p2p.alltoall_counts(send_counts)
    """
    if not isinstance(exchange, PointToPointProtocol):
        raise TypeError(f"{type(exchange).__name__} has no point-to-point rounds (PointToPointProtocol)")
    return exchange
