"""A sparsifier in 40 lines, to copy: top-k of each rank's accumulator, summed at the union.

The template (``exdyna_mpi.Sparsifier.step``) does the rest: argument agreement, error feedback
(``acc = residual + grad``, the residual kept where nothing was sent), the count exchange that
also refuses bad input on every rank at once, 16-bit and device buffers, stats and state dicts.
A method supplies three things: ``report_size`` (words of its own in the count exchange),
``select`` (this rank's choice) and ``combine`` (the exchange and the average). Register it and
``exdyna_mpi.make``, the adapters and the contract tests use it::

    exdyna_mpi.register(ExampleTopK)
    sp = exdyna_mpi.make("example_topk", numel, 0.01)
"""
import numpy as np

import exdyna_mpi
from exdyna_mpi.arrays import threshold_for
from exdyna_mpi.sparsifiers.roles import Selection


class ExampleTopK(exdyna_mpi.Sparsifier):
    name = "example_topk"
    OPTIONS: dict = {}   # option name -> (default, check(value) returning an error text or None)

    def report_size(self, step):
        return 0   # no words of its own beside the count

    def select(self, step, grad, acc):
        bad = self.accumulate(grad, acc)                   # acc = residual + grad
        k = max(1, int(self.density * self.numel))
        kth = self.ops.xp.partition(self.ops.xp.abs(acc), self.numel - k)[self.numel - k] if k < self.numel else 0
        tiny = np.nextafter(self._dtype.type(0), self._dtype.type(1))   # take nonzeros only
        self._thr = threshold_for(max(float(kth), float(tiny)), self._dtype)
        if getattr(self, "_idx", None) is None:
            self._idx = self.ops.empty(self.numel, np.int32)
        count = 0 if bad else self.ops.select_range(acc, 0, self.numel, self._thr, self._idx)
        return Selection(acc, count, (), bad)              # bad > 0: refused on every rank

    def combine(self, step, sel, words):
        counts = words.counts                              # every rank's count, rank order
        spans = np.tile(np.array([0, self.numel], dtype=np.int64), (self.nranks, 1))
        union = np.unique(self.gather_selection(self._idx[:counts[self.rank]], counts, spans))
        out = self.average_at(sel.acc, union, step.out, step.sec)   # sum / P at the union
        return out, dict(counts=counts, selected=len(union), density=len(union) / self.numel,
                         threshold=float(self._thr), bounds=None, owned=None)
