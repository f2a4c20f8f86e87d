"""The sharded end of a union step: a sparse reduce-scatter instead of a shared average.

``sharded(cls)`` gives a subclass of a sparsifier whose step ends in ``average_at`` (ExDyna, MiCRO,
the union baselines) that takes ``bounds`` (P + 1 ascending positions: rank r owns
``[bounds[r], bounds[r+1])``) and ends its step with ``Exchange.reduce_scatter_mean``: the output
holds this rank's shard of the averaged sparse gradient and zeros everywhere else (the other
shards included). Selection, threshold, rotation, the words and the union are the base class's,
unchanged; only the last collective differs (one ``Alltoallv``, no gather). The residual is the
base class's too: the accumulator with the union zeroed, or what the 16-bit rounding lost there.

The means exist on their owner only, so their check is agreed: one small sum of each rank's count
of non-finite means (``sum_words``) before anything is committed, and every rank refuses or skips
the same way. The design, and what it costs in memory: docs/sharded.md.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..transport import shard_runs
from .roles import SumNotFinite
from .timing import timed

_CLASSES: dict[type, type] = {}


class ShardedAverage:
    """Mixin: ``average_at`` as a sparse reduce-scatter over ``bounds`` (see the module)."""

    bounds: np.ndarray

    def __init__(self, numel: int, density: float, comm: Any = None, *, bounds: Any, **kw: Any) -> None:
        super().__init__(numel, density, comm, **kw)   # type: ignore[call-arg]
        b = np.asarray(bounds, dtype=np.int64)
        p = self.nranks                                # type: ignore[attr-defined]
        if b.shape != (p + 1,) or b[0] != 0 or b[-1] != numel or (np.diff(b) < 0).any():
            raise ValueError(f"{type(self).__name__}: bounds must be {p + 1} ascending positions from 0 to "
                             f"{numel}, got {b.tolist()}")
        if self.output == "sign" or self.wire_dtype in ("int8", "float8_e4m3fn"):   # type: ignore[attr-defined]
            raise ValueError(f"{type(self).__name__}: a sharded step sends float32 or 16-bit values and "
                             f"returns means (output='mean', wire_dtype None, 'bfloat16' or 'float16')")
        if getattr(self, "deadline_ms", None) is not None:
            raise ValueError(f"{type(self).__name__}: a sharded step has no deadline exchange (deadline_ms=None)")
        self.bounds = b

    def average_at(self, acc: Any, union: Any, out: Any, sec: dict[str, float], done: bool = False) -> Any:
        """The owner's shard of the mean at ``union`` into the zeroed output, the rest zero; ``acc``
        becomes the residual (the union zeroed, or what the 16-bit rounding lost there)."""
        if done or self.nranks == 1:                   # type: ignore[attr-defined]
            return super().average_at(acc, union, out, sec, done)   # type: ignore[misc]
        ops, me = self.ops, self.rank                  # type: ignore[attr-defined]
        # the union comes in rank order, and ExDyna's partitions rotate, so it is ascending only
        # piecewise: sorted (the same order on every rank), the shards' runs are consecutive
        union = ops.xp.sort(union)
        host_union = union if isinstance(union, np.ndarray) else ops.xp.asnumpy(union)
        counts = shard_runs(host_union, self.bounds)
        start = int(counts[:me].sum())
        with timed(sec, "gather"):
            vals = self._vals_buffer(union.shape[0], self._dtype)   # type: ignore[attr-defined]
            ops.gather(acc, union, vals)
        with timed(sec, "reduce"):
            means = self.exchange.reduce_scatter_mean(vals, counts, self._wire)   # type: ignore[attr-defined]
            bad = int(means.shape[0]) - int(ops.xp.count_nonzero(ops.xp.isfinite(means)))
            total = int(self.exchange.sum_words([bad])[0])   # type: ignore[attr-defined]
            if total:
                raise SumNotFinite(f"the sum over ranks is not finite at {total} of the {int(union.shape[0])} "
                                   f"values exchanged (finite gradients whose sum overflows float32)")
        with timed(sec, "scatter"):
            res = self.memory.commit(acc, out)         # type: ignore[attr-defined]
            ops.scatter(res, union[start: start + int(counts[me])], means)
            ops.scatter(self.memory.residual, union, vals)   # type: ignore[attr-defined]
        return res


def sharded(cls: Any) -> type:
    """The sharded subclass of sparsifier class ``cls`` (one per class, kept): its constructor takes
    ``bounds=`` beside ``cls``'s arguments.

    Raises:
        TypeError: ``cls`` does not end its step in a union average.
    """
    if not getattr(cls.CAPABILITIES, "wire_half", False) or cls.name == "dense":
        raise TypeError(f"{cls.__name__} does not end its step in a union average: it cannot be sharded")
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Sharded{cls.__name__}", (ShardedAverage, cls), {"__module__": __name__})
    return _CLASSES[cls]
