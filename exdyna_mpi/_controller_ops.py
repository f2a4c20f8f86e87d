"""Arrays layer for the histogram controller: its per-element ops and its step-0 procedure.

``accumulate_select_hist`` is ``HostOps.accumulate_select`` that also fills a histogram of
``|acc|`` (or of the forecast ``|p|``) over a range (kernels/cpu_controller.py documents the bucket
semantics exactly). On the CPU it runs the ``@njit`` kernel of kernels/cpu_controller.py; on a CUDA
device, the fused kernel of kernels/cuda.py (through exdyna_mpi/_cuda_ops.py), bit-identical to it
(the same pass as the plain select, the histograms built in shared memory, one device->host copy of
counts and histograms).
"""
import time

import numpy as np

from ._arrays import threshold_for
from .kernels import cpu_controller as _kc


def accumulate_select_hist(ops, residual, grad, acc, lo, hi, thr, idx, shift, key0, hist, predict=False, fine=None,
                           forecast=None, stride=1):
    """``(count, nonfinite)`` as ``ops.accumulate_select``; adds to ``hist`` (and ``fine``'s) the
    histogram over ``forecast = (flo, fhi)`` (default ``(lo, hi)``) of ``|acc|``, or with ``predict``
    of the forecast ``|p|`` (kernels/cpu_controller.py gives the exact rule). ``hist`` and ``fine[2]``
    are host int64 arrays on every device."""
    if ops.device == "cpu":
        return _kc.host_accumulate_select_hist(residual, grad, acc, lo, hi, thr, idx, shift, key0, hist, predict,
                                               fine, forecast, stride)
    from . import _cuda_ops   # only device besides the CPU; imported here so a CPU run never loads numba.cuda
    return _cuda_ops.accumulate_select_hist(residual, grad, acc, lo, hi, thr, idx, shift, key0, hist, predict, fine,
                                            forecast, stride)


def hist_range(ops, x, lo, hi, shift, key0, hist):
    """``hist += histogram(|x[lo:hi]|)`` (read only; ``hist`` a host int64 array)."""
    if ops.device == "cpu":
        _kc.host_hist_range(x, lo, hi, shift, key0, hist)
        return
    from . import _cuda_ops
    _cuda_ops.hist_range(x, lo, hi, shift, key0, hist)


def first_step(sp, grad, acc, lo, hi, coarse, sec):
    """Step 0 of ExDyna with the histogram controller, after the first collective succeeded.

    ``coarse`` is the gathered (P, nb) one-bucket-per-octave histogram of ``|acc|`` that the first
    pass made (it selected nothing). Refine: a finer histogram of the owned range around the coarse
    estimate, one extra Allgather of it, the threshold from the sum. Then select, in a pass that also
    makes the forecast histograms for step 1 (``predict``), as every later step's pass does.
    Step 0 only. Returns ``(threshold, local count, spec, fine spec, histogram words)`` for step 1's
    update; the caller exchanges the count and the words.
    """
    t0 = time.perf_counter()
    ctl, dtype = sp.controller, sp._dtype
    spec = ctl.refine_spec(dtype, coarse)
    fine = np.zeros(spec[0], dtype=np.int64)
    hist_range(sp._ops, acc, lo, hi, spec[1], spec[2], fine)
    fine_all = sp.xch.agree(fine.tolist())
    thr = ctl.first_threshold(dtype, spec, fine_all)
    spec1, fspec1 = ctl.hist_spec(dtype, 1), ctl.fine_spec(dtype, 1)
    hist = np.zeros(spec1[0] + fspec1[0], dtype=np.int64)
    # acc = residual + grad again: the same bits, so acc is unchanged; this pass selects and forecasts.
    count, _ = accumulate_select_hist(sp._ops, sp._residual, grad, acc, lo, hi, threshold_for(thr, dtype),
                                      sp._idx_buffer(hi - lo), spec1[1], spec1[2], hist[: spec1[0]], predict=True,
                                      fine=(fspec1[1], fspec1[2], hist[spec1[0]:]), forecast=sp._forecast_range(0),
                                      stride=ctl.COARSE_STRIDE)
    sec["first_threshold"] = time.perf_counter() - t0
    return thr, int(count), spec1, fspec1, hist
