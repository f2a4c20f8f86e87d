"""Arrays layer for the histogram controller: its per-element ops and its step-0 procedure.

``accumulate_select_hist`` is ``HostOps.accumulate_select`` that also fills a histogram of
``|acc|`` over ``[lo, hi)`` (kernels/cpu_controller.py documents the bucket semantics exactly).
On a CUDA device it falls back to the existing select plus a histogram in array ops (one extra
read of the owned range) until a CUDA kernel with the same semantics exists.
"""
import math
import time

import numpy as np

from ._arrays import threshold_for
from .kernels import cpu_controller as _kc


def accumulate_select_hist(ops, residual, grad, acc, lo, hi, thr, idx, shift, key0, hist, predict=False, fine=None,
                           forecast=None):
    """``(count, nonfinite)`` as ``ops.accumulate_select``; adds to ``hist`` (and ``fine``'s) the
    histogram over ``forecast = (flo, fhi)`` (default ``(lo, hi)``) of ``|acc|``, or with ``predict``
    of the forecast ``|p|`` (kernels/cpu_controller.py gives the exact rule)."""
    if ops.device == "cpu":
        return _kc.host_accumulate_select_hist(residual, grad, acc, lo, hi, thr, idx, shift, key0, hist, predict,
                                               fine, forecast)
    count, bad = ops.accumulate_select(residual, grad, acc, lo, hi, thr, idx)
    flo, fhi = forecast if forecast is not None else (lo, hi)
    seg = acc[flo:fhi]
    if predict and fhi > flo:
        xp, n = ops.xp, grad.shape[0]
        nb = grad[flo + 1:min(fhi + 1, n)]
        if nb.shape[0] < fhi - flo:          # the vector's last element takes the one before it
            nb = xp.concatenate([nb, grad[max(n - 2, 0):n - 1] if n > 1 else grad[:1]])
        pos = xp.arange(flo, fhi)
        sel = (pos >= lo) & (pos < hi) & (xp.abs(seg) >= thr)
        seg = xp.where(sel, 0, seg).astype(seg.dtype) + nb
    for sh, k0, h in [(shift, key0, hist)] + ([fine] if fine is not None else []):
        hist_range(ops, seg, 0, fhi - flo, sh, k0, h)
    return count, bad


def hist_range(ops, x, lo, hi, shift, key0, hist):
    """``hist += histogram(|x[lo:hi]|)`` (read only)."""
    if ops.device == "cpu":
        _kc.host_hist_range(x, lo, hi, shift, key0, hist)
        return
    xp = ops.xp
    seg = x[lo:hi]
    ity, mask = (xp.int32, 0x7FFFFFFF) if seg.dtype == np.float32 else (xp.int64, 0x7FFFFFFFFFFFFFFF)
    keys = ((seg.view(ity) & mask) >> shift).astype(xp.int64) - key0
    hist += np.asarray(ops.to_host(xp.bincount(xp.clip(keys, 0, hist.shape[0] - 1), minlength=hist.shape[0])),
                       dtype=np.int64)


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
                                      fine=(fspec1[1], fspec1[2], hist[spec1[0]:]), forecast=sp._forecast_range(0))
    sec["first_threshold"] = time.perf_counter() - t0
    return thr, int(count), spec1, fspec1, hist
