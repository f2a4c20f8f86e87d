"""A sparsifier in 40 lines, to copy: top-k of each rank's accumulator, summed at the union.

The template (``exdyna_mpi.Sparsifier.step``) does the rest: argument agreement, error feedback
(``acc = residual + grad``, the residual kept where nothing was sent), the count exchange that
also refuses bad input on every rank at once, 16-bit and device buffers, stats and state dicts.
A method supplies three things: ``report_size`` (words of its own in the count exchange),
``select`` (this rank's choice: a ``Selection``, here with the threshold it used) and ``combine``
(the exchange and the average); its options are declared in ``OPTIONS`` (name ->
``Option(default, check, doc)``). Register it and ``exdyna_mpi.make``, the adapters and the
contract tests use it::

    exdyna_mpi.register(ExampleTopK)
    sp = exdyna_mpi.make("example_topk", numel, 0.01)
"""
import dataclasses

import numpy as np

from exdyna_mpi.arrays import threshold_for
from exdyna_mpi.sparsifiers import Option, Selection, Sparsifier


@dataclasses.dataclass(eq=False)
class TopKSelection(Selection):
    thr: float = 0.0   # this rank's threshold, for the stats


class ExampleTopK(Sparsifier):
    name = "example_topk"
    OPTIONS: dict[str, Option] = {}   # e.g. {"period": Option(32, positive_int, "steps between ...")}

    def report_size(self, step):
        return 0   # no words of its own beside the count

    def select(self, step, grad, acc):
        bad = self.accumulate(grad, acc)                   # acc = residual + grad
        n, k, xp = self.numel, max(1, int(self.density * self.numel)), self.ops.xp
        kth = xp.partition(xp.abs(acc), n - k)[n - k] if k < n else 0
        tiny = np.nextafter(self.dtype.type(0), self.dtype.type(1))   # take nonzeros only
        thr = threshold_for(max(float(kth), float(tiny)), self.dtype)
        idx = self.index_buffer(n)                         # kept across steps, on the device
        count = 0 if bad else self.ops.select_range(acc, 0, n, thr, idx)
        return TopKSelection(acc, count, (), bad, thr=thr)   # bad > 0: refused on every rank

    def combine(self, step, sel, words):
        counts = words.counts                              # every rank's count, rank order
        spans = np.tile(np.array([0, self.numel], dtype=np.int64), (self.nranks, 1))
        mine = self.index_buffer(self.numel)[:counts[self.rank]]
        union = self.ops.xp.unique(self.gather_selection(mine, counts, spans))
        out = self.average_at(sel.acc, union, step.out, step.sec)   # sum / P at the union
        return out, dict(counts=counts, selected=len(union), density=len(union) / self.numel,
                         threshold=float(sel.thr), bounds=None, owned=None)
