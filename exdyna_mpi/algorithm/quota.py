"""Algorithm layer: per-rank selection quotas that bound the load imbalance of one step.

Under one global threshold a rank selects what its own accumulator holds above it in the partition
it owns. On real training gradients that count differs between ranks by far more than any cut of
the partitions can follow: each rank's residual holds its own minibatches, so a rank whose recent
batches gave large gradients selects more *everywhere*, and which rank that is changes from step to
step (recorded digits CNN, P = 4: 40 % spread of the per-rank counts at the same threshold).
``quotas`` keeps the step's total and moves only the excess: a rank above ``(1 + max_imbalance)``
times the mean gives its smallest selections back, and the lowest ranks take as many more, their
next-largest values, so the slowest rank of the index exchange sends at most that much over the mean.
Integer logic on the gathered counts: the same quotas on every rank.
"""
import math

import numpy as np


def quotas(counts, capacity, max_imbalance):
    """Per-rank selection counts with the same total as ``counts`` and ``max · P / total - 1 <=
    max_imbalance``, or the lowest maximum the partitions can hold where they are too small for that.

    ``counts``: what each rank selected at the global threshold; ``capacity``: the size of each
    rank's owned range (a rank cannot select more). Ranks above the bound drop to it; the excess
    goes to the lowest ranks, raised to one common level (water-filling), ties to the lower rank.
    Returns a new int64 array; ``counts`` itself when nothing is over the bound.
    """
    c = np.asarray(counts, dtype=np.int64)
    p = c.shape[0]
    total = int(c.sum())
    if p < 2 or total == 0:
        return c
    cap = np.maximum(np.asarray(capacity, dtype=np.int64), c)
    bound = max(-(-total // p), int(math.floor(total * (1.0 + float(max_imbalance)) / p)))
    if int(np.minimum(cap, bound).sum()) < total:   # small partitions: the lowest bound they can hold
        lo, hi = bound, int(cap.max())
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if int(np.minimum(cap, mid).sum()) >= total else (mid, hi)
        bound = hi
    lim = np.minimum(cap, bound)
    if (c <= lim).all():
        return c
    base = np.minimum(c, lim)

    def filled(level):
        return np.maximum(base, np.minimum(level, lim))

    lo, hi = int(base.min()), int(lim.max())
    while hi - lo > 1:   # the lowest level that places the whole excess
        mid = (lo + hi) // 2
        if int(filled(mid).sum()) >= total:
            hi = mid
        else:
            lo = mid
    q = filled(hi)
    surplus = int(q.sum()) - total
    if surplus:   # the ranks raised to exactly that level give one back each, from the last rank down
        raised = np.flatnonzero((q == hi) & (q > base))
        q[raised[::-1][:surplus]] -= 1
    return q
