"""Arrays layer, CUDA side: ``CudaOps``, the ``Ops`` protocol on CUDA buffers.

Every per-element operation is a Numba CUDA kernel (``kernels.cuda``) launched on the backend's
stream (CuPy's current stream on a GPU), so the kernels order correctly with whatever the user's
framework queued there and the host never waits, except for the count words ``accumulate_select`` /
``select_range`` / ``count_range`` return (one small device->host copy each), and for the histogram
ops, the same words followed by the histograms (one copy of ``2 + buckets`` int64 words).

Simulator or GPU is ``device.BACKEND``'s business: this module never branches on it.
"""
import threading

import numpy as np

from ..kernels import cpu_index as _ki
from ..kernels import cuda as _k
from ..kernels.cuda import index as _kidx
from .device import BACKEND

_HALF_MODES = {"bfloat16": _k.MODE_BF16, "float16": _k.MODE_F16}
_local = threading.local()  # per thread: (device, stream) -> kernels.cuda.Scratch, reused every step


def _scratch_here():
    """The scratch of this thread, device and stream: two sparsifiers (or threads) stepping on
    different streams never share the block counts, totals, histograms or hit mask. On one stream
    in one thread, calls run one after the other and each reads its words back before returning."""
    table = getattr(_local, "scratch", None)
    if table is None:
        table = _local.scratch = {}
    key = (BACKEND.device_key(), BACKEND.stream_key())
    s = table.get(key)
    if s is None:
        s = table[key] = _k.Scratch(CudaOps.zeros(_k.Scratch.size(), np.int64), zeros=CudaOps.zeros)
    return s


def _totals(scratch):
    """``[count, nonfinite]`` as host ints: the one device->host read of a selection."""
    host = BACKEND.read_words(scratch.totals)
    return int(host[0]), int(host[1])


def _words(scratch, nw):
    """``[count, nonfinite, hist[:nw]]`` as one host int64 array: a single device->host read."""
    return BACKEND.read_words(scratch.totals_hist[: 2 + nw])


def _measure_async(residual, grad, acc, lo, hi, coarse, fine, stride, mark):
    """Queue the measuring pass (``CudaOps.accumulate_measure``); (its scratch, histogram words)."""
    s = _scratch_here()
    shift_f, key0_f, hist_f = fine if fine is not None else (0, 0, np.zeros(0, np.int64))
    nh, nf = coarse[2].shape[0], hist_f.shape[0]
    thr = acc.dtype.type(np.nan if mark is None else mark)
    _k.accumulate_measure_async(residual, grad, acc, int(lo), int(hi), thr, coarse[0], coarse[1], nh, s,
                                BACKEND.stream(), (shift_f, key0_f, nf), stride)
    return s, nh + nf


def _add_measure_words(w, coarse, fine):
    """Add the pass's words ``[marked, nonfinite, coarse..., fine...]`` to the host histograms;
    the non-finite count."""
    nh = coarse[2].shape[0]
    coarse[2][:] += w[2:2 + nh]
    if fine is not None:
        fine[2][:] += w[2 + nh:2 + nh + fine[2].shape[0]]
    return int(w[1])


class CudaOps:
    """Per-element ops on CUDA buffers: the ``Ops`` protocol (``arrays/ops.py``).

    Example::

        >>> from exdyna_mpi.arrays import ops_for
        >>> ops = ops_for("cuda")
        >>> acc = ops.empty(n, np.float32)
        >>> count, bad = ops.accumulate_select(residual, grad, acc, lo, hi, thr, idx)
    """

    finishes_ahead = True   # accumulate_measure_finish, finish_settled (DEVICE_ONLY)
    device = "cuda"
    xp = BACKEND.xp

    @staticmethod
    def empty(n, dtype):
        return BACKEND.xp.empty(n, dtype=dtype)

    @staticmethod
    def zeros(n, dtype):
        return BACKEND.xp.zeros(n, dtype=dtype)

    @staticmethod
    def fill_zero(x):
        BACKEND.fill_zero(x)  # CuPy: cudaMemsetAsync on the current stream (write-only, no kernel)

    @staticmethod
    def accumulate_select(residual, grad, acc, lo, hi, thr, idx):
        s = _scratch_here()
        _k.accumulate_select_async(residual, grad, acc, int(lo), int(hi), thr, idx, s, BACKEND.stream())
        return _totals(s)

    @staticmethod
    def select_range(x, lo, hi, thr, idx):
        s = _scratch_here()
        _k.select_range_async(x, int(lo), int(hi), thr, idx, s, BACKEND.stream())
        return _totals(s)[0]

    @staticmethod
    def count_range(x, lo, hi, thr):
        s = _scratch_here()
        _k.count_range_async(x, int(lo), int(hi), thr, s, BACKEND.stream())
        return _totals(s)[0]

    @staticmethod
    def gather(src, idx, out):
        _k.gather(src, idx, out, BACKEND.stream())

    @staticmethod
    def scatter(out, idx, vals):
        _k.scatter(out, idx, vals, BACKEND.stream())

    @staticmethod
    def zero_at(x, idx):
        _k.zero_at(x, idx, BACKEND.stream())

    @staticmethod
    def scatter_mean_zero(out, residual, idx, sums, p):
        _k.scatter_mean_zero(out, residual, idx, sums, p, BACKEND.stream())

    @staticmethod
    def widen_half(a, name, out):
        """``out`` (float32) = the values of half array ``a`` (its 16-bit patterns)."""
        _k.widen16(a.view(np.uint16), out.view(np.uint32), _HALF_MODES[name], BACKEND.stream())
        return out

    @staticmethod
    def scatter_wire(out, residual, idx, means, err, fmt):
        """``out[idx]`` = the values of 16-bit ``means`` (``fmt``: an ``arrays.half.WireFormat``),
        ``residual[idx] = err``."""
        _k.scatter_wire(out, residual, idx, means, err, fmt.mode, BACKEND.stream())

    @staticmethod
    def narrow_half(x, name, out):
        """``out`` (half ``name``; bfloat16 as uint16) = float32 ``x`` rounded to nearest even."""
        _k.narrow16(x.view(np.uint32), out.view(np.uint16), _HALF_MODES[name], BACKEND.stream())
        return out

    @staticmethod
    def accumulate_measure(residual, grad, acc, lo, hi, coarse, fine, stride, mark=None, threads=1, marks=None):
        # histograms, and the marks (hit-mask bits) of |acc| >= mark kept in this stream's scratch
        # (``marks``, the host's buffer, and ``threads``, host threads, have nothing to do with the device)
        s, nw = _measure_async(residual, grad, acc, lo, hi, coarse, fine, stride, mark)
        return _add_measure_words(_words(s, nw), coarse, fine)

    @staticmethod
    def accumulate_measure_finish(residual, grad, acc, lo, hi, coarse, fine, stride, mark, finish):
        """``accumulate_measure`` for one rank with the rest of the step queued behind it before the
        host reads the words (``kernels.cuda.finish_fine_async``): ``finish = (idx, out, p, k, tol)``.
        The device settles the threshold from the fine window when ``MeasuredController.fine_pick``
        would, and then selects, zeroes ``out`` and writes the mean while the host resolves on its
        own; the caller calls ``finish_settled`` when it did. Returns the non-finite count."""
        s, nw = _measure_async(residual, grad, acc, lo, hi, coarse, fine, stride, mark)
        pending = BACKEND.read_words_async(s.totals_hist[: 2 + nw])
        idx, out, p, k, tol = finish
        _k.finish_fine_async(acc, int(lo), int(hi), idx, out, acc.dtype.type(p), k, tol, coarse[2].shape[0],
                             (fine[0], fine[1], fine[2].shape[0]), s, BACKEND.stream())
        return _add_measure_words(BACKEND.wait_words(pending), coarse, fine)

    @staticmethod
    def finish_settled():
        """After ``accumulate_measure_finish``, when the host's ``fine_pick`` settled (so the device
        did): the device's select consumed the marks. (Otherwise they stand for the host's select.)"""
        _scratch_here().marked = None

    @staticmethod
    def select_marked(x, lo, hi, thr, idx, expect=None, keep=False, marks=None):
        # the marks of the measuring pass over [lo, hi) hold every hit when thr >= mark: read the
        # mask, not x; ``expect`` (the count the caller knows exactly) spares the host a wait. The
        # select consumes the marks whatever ``keep`` says: a second one is a full select_range
        s = _scratch_here()
        _k.select_marked_async(x, int(lo), int(hi), thr, idx, s, BACKEND.stream())
        return int(expect) if expect is not None else _totals(s)[0]

    @staticmethod
    def release_marks(marks=None):
        pass   # the select consumed them; Scratch clears unused marks before the next selection

    @staticmethod
    def hist_range(x, lo, hi, shift, key0, hist, marks=None):
        s = _scratch_here()
        nh = hist.shape[0]
        from_marks = _k.hist_range_async(x, int(lo), int(hi), shift, key0, nh, s, BACKEND.stream())
        w = _words(s, nh)[2:2 + nh]
        if from_marks:   # read the marks only: bucket 0 is the rest of the range (every value is finite here)
            w[0] = (int(hi) - int(lo)) - w[1:].sum()
        hist += w

    @staticmethod
    def encode_indices(idx, lo, span, out):
        """``idx`` (ascending, inside ``[lo, lo + span)``) into the uint8 device buffer ``out`` in
        ``kernels.cpu_index.index_form``, the host encoder's bytes; returns the bytes written."""
        count = int(idx.shape[0])
        form, nbytes = _ki.index_form(count, span)
        if nbytes == 0:
            return 0
        words = out[:nbytes].view(np.uint32)
        if form != _ki.FORM_RAW:
            BACKEND.fill_zero(words)
        low, lower = _ki.ef_shape(count, span)[:2] if form == _ki.FORM_EF else (0, 0)
        _kidx.encode(idx, int(lo), int(low), int(form), lower // 4, words, BACKEND.stream())
        return int(nbytes)

    @staticmethod
    def decode_indices(buf, count, lo, span, out):
        """The ``count`` indices the host or device encoder wrote into the uint8 device buffer
        ``buf`` (``index_form(count, span)``) into ``out``, ascending."""
        form, nbytes = _ki.index_form(int(count), span)
        if count == 0:
            return out
        words = buf[:nbytes].view(np.uint32)
        stream = BACKEND.stream()
        if form == _ki.FORM_RAW:
            _kidx.raw_decode(words, int(lo), out[:count], stream)
            return out
        low, lower = _ki.ef_shape(int(count), span)[:2] if form == _ki.FORM_EF else (0, 0)
        nw = (nbytes - lower) // 4
        cnt = BACKEND.xp.empty(nw, dtype=np.int64)
        _kidx.popcounts(words, lower // 4, nw, cnt, stream)
        start = BACKEND.xp.cumsum(cnt) - cnt   # exclusive scan: the indices before each word
        _kidx.emit(words, lower // 4, nw, start, int(count), int(lo), int(low), int(form), out, stream)
        return out

    @staticmethod
    def to_host(x):
        """A NumPy copy of ``x`` (user-facing reads such as ``residual``; never on the step path)."""
        return BACKEND.to_host(x)

    @staticmethod
    def from_host(a):
        return BACKEND.from_host(a)

    @staticmethod
    def synchronize():
        """Wait for the current stream: call once before a device buffer goes to MPI."""
        BACKEND.synchronize()
