"""Dense allreduce: the average of every rank's gradient (the accuracy and bytes baseline)."""
import numpy as np

from ..capabilities import Capabilities
from ..base import Selection, Sparsifier
from ..config import Option
from ..timing import timed


class DenseAllreduce(Sparsifier):
    """``out = sum_r grad_r / P`` everywhere; no selection, so the residual stays zero.

    The sum is ``Exchange.sum_identical`` (reduce-scatter + allgatherv), so ``out`` is identical to
    the bit on every rank; its bytes are those of a ring allreduce, 2 (P-1)/P n words per rank.
    With 16-bit values (``wire_dtype``, or a half gradient) the sum is ``Exchange.mean_wire`` and
    the residual keeps what rounding to 16 bits lost (error feedback, as DDP's bf16 hook has not).

    Example::

        >>> sp = exdyna_mpi.make("dense", numel, 1.0, comm)
        >>> avg = sp.step(flat_grad)
    """

    name = "dense"
    OPTIONS: dict[str, Option] = {}
    # 16-bit values with error feedback: the residual keeps what rounding lost
    CAPABILITIES = Capabilities(wire_half=True)

    def select(self, step, grad, acc):
        # residual is all zeros, so acc is a copy of grad with its non-finite values counted
        return Selection(acc, self.numel, (), self.accumulate(grad, acc))

    def combine(self, step, sel, words):
        acc = sel.acc
        if self._wire is not None:
            with timed(step.sec, "reduce"):
                means = self.exchange.mean_wire(acc, self._wire)   # acc becomes the rounding this rank kept
                self.check_wire(means)
            res = self.memory.commit(acc, step.out)
            self.ops.widen_half(means, self._wire.name, res)
            return res, dict(counts=words.counts, selected=self.numel, density=1.0, threshold=0.0,
                             bounds=None, owned=None)
        with timed(step.sec, "reduce"):
            self.exchange.sum_identical(acc)
            self.check_sums(acc, self.nranks)   # the exchanged values are all N here
        res = step.out if step.out is not None else self.ops.empty(self.numel, self._dtype)
        np.divide(acc, self._dtype.type(self.nranks), out=res)
        self.memory.keep(acc)   # the residual stays zero; acc is the next step's buffer
        return res, dict(counts=words.counts, selected=self.numel, density=1.0, threshold=0.0, bounds=None,
                         owned=None)
