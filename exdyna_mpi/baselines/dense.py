"""Dense allreduce: the average of every rank's gradient (the accuracy and bytes baseline)."""
import time

import numpy as np

from .._base import Sparsifier, Stats
from .._errors import InputCode
from ._common import accumulate


class DenseAllreduce(Sparsifier):
    """``out = sum_r grad_r / P`` everywhere; no selection, so the residual stays zero.

    The sum is ``Exchange.sum_identical`` (reduce-scatter + allgatherv), so ``out`` is identical to
    the bit on every rank; its bytes are those of a ring allreduce, 2 (P-1)/P n words per rank.

    Example::

        >>> sp = exdyna_mpi.make("dense", numel, 1.0, comm)
        >>> avg = sp.step(flat_grad)
    """

    name = "dense"
    OPTIONS = {}

    def _step(self, inp, err, out):
        sec = {}
        t = self.iteration
        acc = None
        if err is None:
            self._bind(inp)
            t0 = time.perf_counter()
            # residual is all zeros, so acc is a copy of grad with its non-finite values counted
            acc, bad = accumulate(self, inp.array)
            sec["select"] = time.perf_counter() - t0
            if bad:
                err = (InputCode.NONFINITE, bad)
        words = self.xch.agree(self._words(self.numel if err is None else 0, err))
        if self._verdict(words, err, acc):
            return self._skip(inp, out)
        t0 = time.perf_counter()
        self.xch.sum_identical(acc)
        sec["reduce"] = time.perf_counter() - t0
        res = out if out is not None else self._ops.empty(self.numel, self._dtype)
        np.divide(acc, self._dtype.type(self.nranks), out=res)
        self._spare = acc
        counts = words[:, 0].copy()
        self.stats = Stats(
            iteration=t, counts=counts, selected=self.numel, density=1.0, threshold=0.0, bounds=None,
            owned=None, bytes_sent=self.xch.bytes_sent, bytes_received=self.xch.bytes_received,
            seconds=sec, skipped=False, imbalance=0.0)
        self.iteration = t + 1
        return inp.wrap(res)
