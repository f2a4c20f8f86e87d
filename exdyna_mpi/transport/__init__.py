"""Transport layer: every MPI call of the package and its adapters, with byte accounting.

- ``ExchangeProtocol`` (``exchange.py``): the exchange role of every sparsifier, every member the
  sparsifiers and adapters use (runtime-checkable).
- ``Exchange`` (``exchange.py``): its host implementation; ``Exchange(comm)``.
- ``ByteCounter`` (``exchange.py``): the bytes an exchange moved (``exchange.bytes``), one type for
  host and device.
- ``DeviceExchange`` (``device.py``, through ``device_exchange``): a subclass of ``Exchange`` whose
  array methods take CUDA buffers, direct (CUDA-aware MPI) or staged through pinned host memory; the
  CUDA-aware probe.
- ``bind_local_gpu`` (``binding.py``): the explicit node-local GPU binding.
- ``DeadlineTransport`` (``deadline.py``): versioned point-to-point chunks under a deadline, the
  agreement collective, and the send-delay test hook (``SendDelay``, ``set_send_delay``).
- ``Worker`` (``worker.py``): a worker thread with a private communicator, for adapters that run
  collectives off the caller's thread (the DDP hook), and ``abort_job``.
- ``agree_problems`` (``agreement.py``): one refusal on every rank, after each rank's own checks.
- ``broadcast``, ``world``: the seams the adapters use.

Knows nothing of which sparsifier runs. Imports ``arrays`` (device buffers) and mpi4py only.
"""
from .agreement import agree_problems
from .binding import bind_local_gpu
from .deadline import DeadlineTransport, SendDelay, set_send_delay
from .exchange import WORD, ByteCounter, Exchange, ExchangeProtocol, broadcast, node_ranks, world
from .worker import Worker, abort_job


def device_exchange(comm, cuda_aware=None):
    """A ``DeviceExchange`` over ``comm`` for CUDA buffers (loads numba.cuda, so only when a device is
    used). ``cuda_aware``: True, False, or None (``EXDYNA_CUDA_AWARE``, else the probe)."""
    from .device import DeviceExchange

    return DeviceExchange(comm, cuda_aware=cuda_aware)


__all__ = ["WORD", "ByteCounter", "DeadlineTransport", "Exchange", "ExchangeProtocol", "SendDelay", "Worker",
           "abort_job", "agree_problems", "bind_local_gpu", "broadcast", "device_exchange", "node_ranks",
           "set_send_delay", "world"]
