"""Transport layer: every MPI call of the package and its adapters, with byte accounting.

- ``ExchangeProtocol`` (``protocols.py``): the exchange role of every sparsifier, the collectives
  the sparsifiers and adapters use, typed (runtime-checkable); ``PointToPointProtocol``: Ok-Topk's
  point-to-point rounds, which ``point_to_point(exchange)`` hands out.
- ``Exchange`` (``exchange.py``): the host implementation of both; ``Exchange(comm)``; its
  ``reduce_scatter_mean`` is the sparse reduce-scatter of the sharded path (``shard_runs`` cuts a
  union into the shards' runs).
- ``ByteCounter`` (``accounting.py``): the bytes a transport moved, one per transport, as ``bytes``
  (``Exchange``, ``DeviceExchange``, ``GroupTransport``, ``DeadlineTransport``), whose
  ``bytes_sent``/``bytes_received`` read it (``CountsBytes``).
- ``DeviceExchange`` (``device.py``, through ``device_exchange``): a subclass of ``Exchange`` whose
  array methods take CUDA buffers, direct (CUDA-aware MPI) or staged through pinned host memory; the
  CUDA-aware probe.
- ``bind_local_gpu`` (``binding.py``): the explicit node-local GPU binding.
- ``DeadlineTransport`` (``deadline.py``): versioned point-to-point chunks under a deadline, the
  agreement collective, and the send-delay test hook (``SendDelay``, ``set_send_delay``).
- ``Worker`` (``worker.py``): a worker thread with a private communicator, for adapters that run
  collectives off the caller's thread (the DDP hook), and ``abort_job``.
- ``agree_problems`` (``agreement.py``): one refusal on every rank, after each rank's own checks.
- ``broadcast``, ``world``, ``thread_multiple``: the seams the adapters use.

Knows nothing of which sparsifier runs. Imports ``arrays`` (device buffers) and mpi4py only.
"""
from .agreement import agree_problems
from .binding import bind_local_gpu
from .deadline import DeadlineTransport, SendDelay, set_send_delay
from .accounting import ByteCounter, CountsBytes
from .exchange import WORD, Exchange, broadcast, node_ranks, shard_runs, thread_multiple, world
from .protocols import ExchangeProtocol, PointToPointProtocol, point_to_point
from .worker import Worker, abort_job


def device_exchange(comm, cuda_aware=None):
    """A ``DeviceExchange`` over ``comm`` for CUDA buffers (loads numba.cuda, so only when a device is
    used). ``cuda_aware``: True, False, or None (``EXDYNA_CUDA_AWARE``, else the probe)."""
    from .device import DeviceExchange

    return DeviceExchange(comm, cuda_aware=cuda_aware)


__all__ = ["WORD", "ByteCounter", "CountsBytes", "DeadlineTransport", "Exchange", "ExchangeProtocol",
           "PointToPointProtocol", "SendDelay", "Worker", "abort_job", "agree_problems", "bind_local_gpu", "broadcast",
           "device_exchange", "node_ranks", "point_to_point", "set_send_delay", "shard_runs", "thread_multiple",
           "world"]
