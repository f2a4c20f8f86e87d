"""Arrays layer: the ``Ops`` protocol, the per-element operations a sparsifier calls, and ``HostOps``.

One protocol, two implementations: ``HostOps`` runs the ``@njit`` kernels (``exdyna_mpi/kernels/cpu.py``,
``exdyna_mpi/kernels/cpu_controller.py``) on NumPy buffers; ``CudaOps`` (``cuda_ops.py``) runs the CUDA kernels
on CUDA buffers, bit-identical. Sparsifiers call these methods only, never a
kernel directly, so one sparsifier body serves both devices. tests/unit/test_layers.py checks that
both implement every method of ``Ops`` with the same signature. A device backend may add the methods
of ``DEVICE_ONLY`` (work it queues ahead of the host; ``CudaOps`` documents them) and says so with
``finishes_ahead = True``; callers read that flag, never probe for the methods.
"""
from __future__ import annotations

import ctypes
import os
from typing import Protocol, cast, runtime_checkable

import numpy as np

from ..kernels import cpu as _k
from ..kernels import cpu_controller as _kc
from ..kernels import cpu_index as _ki
from . import half as _half


class Marks:
    """Where a measuring pass (``HostOps.accumulate_measure``) found ``|acc| >= level`` in its range
    ``[lo, hi)``: the indices, ascending, and their values. The ``select_marked`` and ``hist_range``
    calls that follow over the same buffer and range read these instead of the range. The caller
    owns one and passes it to each of those calls; a device backend keeps its marks in its own
    scratch and ignores it.

    One per caller, reused every step: its buffers keep their pages mapped (pages are touched only
    where marks land). ``acc`` is held until ``clear``: a buffer that comes back two steps later (the
    residual and ``acc`` rotate) must not find the old marks, so a select consumes them.
    """

    __slots__ = ("_index_buf", "_value_buf", "acc", "lo", "hi", "level", "index", "value")
    acc: np.ndarray | None
    level: float | None
    index: np.ndarray | None
    value: np.ndarray | None

    def __init__(self):
        self._index_buf = self._value_buf = None
        self.clear()

    def buffers(self, m: int, dtype) -> tuple[np.ndarray, np.ndarray]:
        """(indices, values) buffers of capacity ``m`` for the pass to fill."""
        if self._index_buf is None or self._index_buf.shape[0] < m:
            self._index_buf = np.empty(max(m, 1), np.int64)
        if self._value_buf is None or self._value_buf.shape[0] < m or self._value_buf.dtype != dtype:
            self._value_buf = np.empty(max(m, 1), dtype)
        return self._index_buf[:m], self._value_buf[:m]

    def hold(self, acc: np.ndarray, lo: int, hi: int, level: float, n: int) -> None:
        """The pass over ``acc[lo:hi]`` put its ``n`` marks, every value at or above ``level``, in
        ``buffers``."""
        self.acc, self.lo, self.hi, self.level = acc, int(lo), int(hi), level
        self.index, self.value = self._index_buf[:n], self._value_buf[:n]

    def of(self, x, lo, hi) -> tuple[float, np.ndarray, np.ndarray] | None:
        """``(level, indices, values)`` of the pass over ``x[lo:hi]``, else None."""
        if self.acc is not x or self.lo != lo or self.hi != hi:
            return None
        # held (``hold``): the level and the marks are set
        return cast("tuple[float, np.ndarray, np.ndarray]", (self.level, self.index, self.value))

    def clear(self) -> None:
        self.acc, self.lo, self.hi, self.level, self.index, self.value = None, 0, 0, None, None, None


ALIGN = 64   # bytes: the start of every buffer HostOps makes


def _aligned(make, n, dtype):
    """``make(n, dtype)`` starting on ``ALIGN`` bytes. The measuring pass's fused vector loop
    (``kernels.cpu_stream.add_mask_groups``) runs where a chunk of ``acc`` starts on 64 bytes, and
    block partitions start on multiples of 32 elements: NumPy's large buffers start 16 bytes past
    a page, where it would never run."""
    dtype = np.dtype(dtype)
    raw = make(n * dtype.itemsize + ALIGN, np.uint8)
    at = (-raw.ctypes.data) % ALIGN
    return raw[at:at + n * dtype.itemsize].view(dtype)


#: Methods only a device backend has: it can queue the rest of a one-rank step behind the measuring
#: pass, so the device need not wait while the host reads the pass's words and resolves.
DEVICE_ONLY = ("accumulate_measure_finish", "finish_settled")


@runtime_checkable
class Ops(Protocol):
    """Per-element work on one device's buffers. Thresholds are in the buffers' dtype
    (``dlpack.threshold_for``); counts come back as host ints, histograms as host int64 arrays."""

    device: str   # "cpu" or "cuda"
    xp: object    # the array namespace of the buffers (NumPy or CuPy)
    finishes_ahead: bool   # has the DEVICE_ONLY methods (a one-rank step finished behind its pass)

    def empty(self, n, dtype): ...

    def zeros(self, n, dtype): ...

    def fill_zero(self, x): ...

    def accumulate_select(self, residual, grad, acc, lo, hi, thr, idx):
        """``acc = residual + grad``; select ``|acc| >= thr`` in [lo, hi) into ``idx`` (ascending);
        return ``(count, nonfinite)``."""

    def select_range(self, x, lo, hi, thr, idx):
        """Indices of ``|x| >= thr`` in [lo, hi) into ``idx``; return the count."""

    def count_range(self, x, lo, hi, thr):
        """The count of ``|x| >= thr`` in [lo, hi)."""

    def gather(self, src, idx, out):
        """``out = src[idx]``."""

    def scatter(self, out, idx, vals):
        """``out[idx] = vals``."""

    def zero_at(self, x, idx):
        """``x[idx] = 0``."""

    def scatter_mean_zero(self, out, residual, idx, sums, p):
        """``out[idx] = sums / p``; ``residual[idx] = 0``."""

    def widen_half(self, a, name, out):
        """``out`` (float32) = the values of half array ``a`` (dtype ``name``; bfloat16 as uint16)."""

    def narrow_half(self, x, name, out):
        """``out`` (half ``name``; bfloat16 as uint16) = float32 ``x`` rounded to nearest even."""

    def scatter_wire(self, out, residual, idx, means, err, fmt):
        """``out[idx]`` = the values of 16-bit ``means`` (``fmt``: ``arrays.half.WireFormat``);
        ``residual[idx] = err``."""

    def hist_range(self, x, lo, hi, shift, key0, hist, marks=None):
        """``hist += histogram(|x[lo:hi]|)`` (read only; ``hist`` a host int64 array): the bucket
        rule of exdyna_mpi/kernels/cpu_controller.py. ``marks``: the ``Marks`` of the measuring pass over
        ``x[lo:hi]``, if any (a window at or above their level reads only those)."""

    def accumulate_measure(self, residual, grad, acc, lo, hi, coarse, fine, stride, mark=None, threads=1,
                           marks=None):
        """``acc = residual + grad``; over [lo, hi) the histograms of ``|acc|`` (``coarse``/``fine``:
        ``(shift, key0, host int64 hist)``, the coarse one every ``stride``-th element, ``fine`` may
        be None; exdyna_mpi/kernels/cpu_controller.py gives the bucket rule); selects nothing. Returns the
        number of non-finite values of ``acc``. The measured controller's pass. ``mark``: the backend
        may remember where ``|acc| >= mark`` for the ``select_marked`` that follows (the host in
        ``marks``, a device in its scratch). ``threads``: host threads the pass may use
        (``host_threads``; the same result with any number)."""

    def select_marked(self, x, lo, hi, thr, idx, expect=None, keep=False, marks=None):
        """``select_range`` right after ``accumulate_measure`` over the same range (the same result;
        a backend that kept the marks reads only those when ``thr >= mark``). ``expect``: the count,
        when the caller knows it exactly (a backend may return it without reading its own).
        ``keep``: a backend may keep the marks for one more ``select_marked`` (at a lower threshold)
        until ``release_marks``. ``marks``: what the pass was given."""

    def release_marks(self, marks=None):
        """Forget the marks of the last measuring pass (``marks``: what the pass was given)."""

    def to_host(self, x):
        """A host (NumPy) view or copy of ``x``."""

    def from_host(self, a):
        """A device buffer holding host array ``a``."""

    def synchronize(self):
        """Wait for queued device work (a no-op on the host)."""

    def encode_indices(self, idx, lo, span, out):
        """Ascending ``idx`` inside ``[lo, lo + span)`` into the uint8 buffer ``out`` in the form
        ``kernels.cpu_index.index_form`` picks (the same bytes on every backend); returns the bytes
        written."""

    def decode_indices(self, buf, count, lo, span, out):
        """The ``count`` indices ``encode_indices`` wrote into ``buf`` into ``out``, ascending."""


class HostOps:
    """``Ops`` on NumPy buffers, with the ``@njit`` kernels."""

    device = "cpu"
    xp = np
    finishes_ahead = False

    @staticmethod
    def empty(n, dtype):
        return _aligned(np.empty, n, dtype)

    @staticmethod
    def zeros(n, dtype):
        return _aligned(np.zeros, n, dtype)   # (calloc: the OS zero-fills pages when first written)

    @staticmethod
    def fill_zero(x):
        # memset for a contiguous buffer: glibc streams large ones past the cache (no read of the
        # old contents), 2.2-2.6x faster than ``fill(0)`` on 40 MB here; the bits are the same (+0.0)
        if x.flags.c_contiguous and x.flags.writeable and x.nbytes:
            ctypes.memset(x.ctypes.data, 0, x.nbytes)
        else:
            x.fill(0)

    @staticmethod
    def accumulate_select(residual, grad, acc, lo, hi, thr, idx):
        c, bad = _k.accumulate_select(residual, grad, acc, lo, hi, thr, idx)
        return int(c), int(bad)

    @staticmethod
    def select_range(x, lo, hi, thr, idx):
        return int(_k.select_range(x, lo, hi, thr, idx))

    @staticmethod
    def count_range(x, lo, hi, thr):
        return int(_k.count_range(x, lo, hi, thr))

    @staticmethod
    def gather(src, idx, out):
        _k.gather(src, idx, out)

    @staticmethod
    def scatter(out, idx, vals):
        _k.scatter(out, idx, vals)

    @staticmethod
    def zero_at(x, idx):
        _k.zero_at(x, idx)

    @staticmethod
    def scatter_mean_zero(out, residual, idx, sums, p):
        _k.scatter_mean_zero(out, residual, idx, sums, p)

    @staticmethod
    def widen_half(a, name, out):
        return _half.widen(a, name, out)

    @staticmethod
    def narrow_half(x, name, out):
        return _half.narrow(x, name, out)

    @staticmethod
    def scatter_wire(out, residual, idx, means, err, fmt):
        _half.scatter_wire(out, residual, idx, means, err, fmt)

    @staticmethod
    def hist_range(x, lo, hi, shift, key0, hist, marks=None):
        marks = marks.of(x, lo, hi) if marks is not None else None
        if marks is not None:   # a zoom at or above the mark: every element it bins is marked
            bits, sign_off = _kc.int_view(x)
            if (int(key0) + 1) << int(shift) >= int(np.array([marks[0]], x.dtype).view(bits.dtype)[0]):
                part = np.zeros(hist.shape[0], np.int64)
                _kc.hist_marks(marks[2].view(bits.dtype), sign_off, bits.dtype.type(shift), bits.dtype.type(key0),
                               part)
                part[0] = (hi - lo) - part[1:].sum()   # every value is finite when the controller zooms
                hist += part
                return
        _kc.host_hist_range(x, lo, hi, shift, key0, hist)

    @staticmethod
    def accumulate_measure(residual, grad, acc, lo, hi, coarse, fine, stride, mark=None, threads=1, marks=None):
        # one fused kernel (exdyna_mpi/kernels/cpu_controller.py: accumulate_measure, or it on threads); it
        # finds the elements at or above the fine window's first edge anyway: with ``mark`` (that
        # edge) and ``marks`` their indices are kept there
        if marks is not None:
            marks.clear()
        keep = mark is not None and fine is not None and marks is not None
        buf, vals = marks.buffers(hi - lo, acc.dtype) if keep else (None, None)
        bad, n = _kc.host_accumulate_measure(residual, grad, acc, lo, hi, coarse, fine, stride, buf, threads, vals)
        if keep:   # the marks hold every value at or above the window's edge: a lower mark cannot be kept
            bits, _ = _kc.int_view(acc)
            edge = float(np.array([(int(fine[1]) + 1) << int(fine[0])], bits.dtype).view(acc.dtype)[0])
            marks.hold(acc, lo, hi, max(float(mark), edge), n)
        return bad

    @staticmethod
    def select_marked(x, lo, hi, thr, idx, expect=None, keep=False, marks=None):
        held = marks.of(x, lo, hi) if marks is not None else None
        if marks is not None and not keep:
            marks.clear()
        if held is not None and thr >= held[0]:
            return int(_kc.select_marks(held[2], held[1], thr, idx))   # O(marks), not O(hi - lo)
        return HostOps.select_range(x, lo, hi, thr, idx)

    @staticmethod
    def release_marks(marks=None):
        if marks is not None:
            marks.clear()

    @staticmethod
    def to_host(x):
        return x

    @staticmethod
    def from_host(a):
        return a

    @staticmethod
    def synchronize():
        pass

    @staticmethod
    def encode_indices(idx, lo, span, out):
        return int(_ki.encode_indices(idx, int(lo), int(span), out))

    @staticmethod
    def decode_indices(buf, count, lo, span, out):
        _ki.decode_indices(buf, int(count), int(lo), int(span), out)
        return out


def host_threads(node_ranks):
    """Threads one rank's host kernels may use: the cores it may run on (its affinity) shared among
    the ``node_ranks`` ranks of its node, at most ``NUMBA_NUM_THREADS`` (read from the config: asking
    Numba for its thread count would start its threading layer, whose OpenMP flavour resizes the
    pool of a torch in the same process), at least 1: one when the node's ranks fill its cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    from numba import config
    return max(1, min(cores // max(1, int(node_ranks)), int(config.NUMBA_NUM_THREADS)))


def ops_for(device):
    """The ``Ops`` of ``device`` ("cpu" or "cuda"; "cuda" loads numba.cuda and the backend)."""
    if device == "cpu":
        return HostOps
    from .cuda_ops import CudaOps

    return CudaOps


def gpu_available():
    """True when CuPy can allocate on a CUDA device (a successful import is not enough)."""
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


def cuda_simulated():
    """True when ``device="cuda"`` runs in the Numba CUDA simulator (NumPy device buffers)."""
    from numba.core import config

    if not getattr(config, "ENABLE_CUDASIM", False):
        return False
    from .device import SIMULATOR

    return SIMULATOR


def cuda_available():
    """True when ``device="cuda"`` can run: a CUDA device CuPy sees, or the Numba CUDA simulator
    (``NUMBA_ENABLE_CUDASIM=1``; its device buffers are NumPy arrays)."""
    return gpu_available() or cuda_simulated()
