"""Transport layer: every MPI call of the package and its adapters, with byte accounting.

- ``Exchange`` (``exchange.py``): host buffers; the exchange role of every sparsifier.
- ``DeviceExchange`` (``device.py``): the same methods on CUDA buffers, direct (CUDA-aware MPI) or
  staged through pinned host memory; the CUDA-aware probe; node-local GPU binding.
- ``DeadlineTransport`` (``deadline.py``): versioned point-to-point chunks under a deadline, the
  agreement collective, and the send-delay test hook (``SendDelay``, ``set_send_delay``).
- ``Worker`` (``worker.py``): a worker thread with a private communicator, for adapters that run
  collectives off the caller's thread (the DDP hook), and ``abort_job``.
- ``agree_problems`` (``agreement.py``): one refusal on every rank, after each rank's own checks.
- ``broadcast``, ``world``: the seams the adapters use.

Knows nothing of which sparsifier runs. Imports ``arrays`` (device buffers) and mpi4py only.
"""
from .agreement import agree_problems
from .deadline import DeadlineTransport, SendDelay, set_send_delay
from .exchange import WORD, Exchange, broadcast, node_ranks, world
from .worker import Worker, abort_job


def device_exchange(host_exchange, cuda_aware=None):
    """Wrap a host ``Exchange`` for CUDA buffers (loads numba.cuda, so only when a device is used)."""
    from .device import DeviceExchange

    return DeviceExchange(host_exchange, cuda_aware=cuda_aware)


__all__ = ["WORD", "DeadlineTransport", "Exchange", "SendDelay", "Worker", "abort_job", "agree_problems", "broadcast",
           "device_exchange", "node_ranks", "set_send_delay", "world"]
