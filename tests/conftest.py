"""Shared test helpers: collective asserts and communicators to parametrise over.

A multi-rank test must not let one rank leave a test early while the others wait in a collective:
compute local checks, then call ``mpi_assert`` (an allreduce), which fails on every rank together.
"""
import importlib
import os
import sys

import numpy as np
import pytest
from mpi4py import MPI


def require(module, reason=None):
    """``pytest.importorskip``, except in a lane that promises the module: there, missing, it fails.

    ``EXDYNA_REQUIRE`` lists the promised modules, comma-separated (the frameworks lane of
    tests/run_all.sh sets ``jax,tensorflow``), so the tests that lane exists for cannot skip.
    """
    if module in os.environ.get("EXDYNA_REQUIRE", "").split(","):
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=reason or f"{module} is not installed")


def pytest_configure(config):
    # Under mpiexec every rank runs pytest; give each rank its own JUnit file.
    rank = MPI.COMM_WORLD.Get_rank()
    xml = getattr(config.option, "xmlpath", None)
    if xml and rank > 0:
        config.option.xmlpath = f"{xml}.rank{rank}"


def init_gloo(comm=MPI.COMM_WORLD):
    """A torch.distributed gloo process group over ``comm``'s ranks, on loopback.

    Rank 0 opens the rendezvous store on port 0 and broadcasts the port the kernel gave it:
    probing for a free port and closing it first leaves a window in which a concurrent job can
    take it (EADDRINUSE)."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=120)
    store = None
    if comm.Get_rank() == 0:
        store = dist.TCPStore("127.0.0.1", 0, comm.Get_size(), is_master=True, timeout=timeout,
                              wait_for_workers=False)
    port = comm.bcast(store.port if store is not None else None, root=0)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, comm.Get_size(), is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=comm.Get_rank(), world_size=comm.Get_size())


@pytest.fixture(scope="module")
def gloo():
    """One gloo process group over the MPI ranks for a whole test module (``usefixtures("gloo")``);
    skips where torch.distributed is not available."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    init_gloo()
    yield
    dist.destroy_process_group()


def backward_error(net, x, y):
    """The text of the ``RuntimeError`` that ``backward()`` of ``net``'s cross-entropy on ``(x, y)``
    raises (DDP wraps a communication hook's error in one), or ``""`` when it raises none."""
    import torch

    try:
        torch.nn.functional.cross_entropy(net(x), y).backward()
    except RuntimeError as e:
        return str(e)
    return ""


def mpi_assert(ok, msg="", comm=MPI.COMM_WORLD):
    """Assert ``ok`` on every rank: all ranks fail together if any rank's ``ok`` is false."""
    flags = comm.allgather(bool(ok))
    if not all(flags):
        bad = [r for r, f in enumerate(flags) if not f]
        raise AssertionError(f"failed on ranks {bad}: {msg}")


def same_error_everywhere(call, comm=MPI.COMM_WORLD):
    """Run ``call()``, which must raise ``ValueError`` on every rank with the same message; returns it."""
    msg = ""
    try:
        call()
    except ValueError as e:
        msg = str(e)
    msgs = comm.allgather(msg)
    mpi_assert(msgs[0] and all(m == msgs[0] for m in msgs), f"errors differ or missing: {msgs}", comm)
    return msgs[0]


def state_content(d):
    """A state dict as plain values and bytes, for comparing two of them (a pickled tensor also
    holds its storage's address): tensors and arrays by dtype, shape and raw bytes."""
    if isinstance(d, dict):
        return {k: state_content(v) for k, v in d.items()}
    if isinstance(d, (list, tuple)):
        return [state_content(v) for v in d]
    if isinstance(d, np.ndarray):
        return ("ndarray", d.dtype.str, d.shape, np.ascontiguousarray(d).tobytes())
    if isinstance(d, np.generic):
        return d.item()
    torch = sys.modules.get("torch")   # a tensor exists only where its test imported torch
    if torch is not None and isinstance(d, torch.Tensor):
        t = d.detach().cpu().contiguous().reshape(-1)
        return ("tensor", str(d.dtype), tuple(d.shape), t.view(torch.uint8).numpy().tobytes())
    return d


def allgather_array(x, comm=MPI.COMM_WORLD):
    """Every rank's copy of ``x`` stacked as a (P, ...) array, on every rank."""
    return np.stack(comm.allgather(np.asarray(x)))


def _split_half(comm):
    return comm.Split(comm.Get_rank() % 2, comm.Get_rank())


COMMS = {
    "world": lambda: MPI.COMM_WORLD,
    "dup": lambda: MPI.COMM_WORLD.Dup(),
    "self": lambda: MPI.COMM_SELF,
    "split": lambda: _split_half(MPI.COMM_WORLD),
}


@pytest.fixture(params=sorted(COMMS))
def comm(request):
    """Each communicator kind a sparsifier must work on (a Dup and a Split are freed after)."""
    c = COMMS[request.param]()
    yield c
    if request.param in ("dup", "split"):
        c.Free()


@pytest.fixture
def wcomm():
    """A private duplicate of COMM_WORLD, so one test's messages never meet another's."""
    c = MPI.COMM_WORLD.Dup()
    yield c
    c.Free()
