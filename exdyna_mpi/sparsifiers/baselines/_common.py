"""What the baselines share: threshold words, local top-k thresholds.

Pure host logic on NumPy arrays (vectorised; the per-element passes go through ``HostOps``).
"""
import dataclasses

import numpy as np

from ...algorithm.controllers import target_count
from ..roles import Selection

__all__ = ["target_count", "float_to_word", "word_to_float", "kth_largest_magnitude", "positive_floor",
           "ThresholdSelection"]


@dataclasses.dataclass(eq=False)
class ThresholdSelection(Selection):
    """A selection of ``|acc| >= thr`` (``thr`` in acc's dtype): what ``combine`` reports."""

    thr: float = 0.0


def float_to_word(x):
    """A float64 as an int64 word (bit cast), so it can ride in the count exchange."""
    return int(np.array([x], dtype=np.float64).view(np.int64)[0])


def word_to_float(w):
    return np.asarray(w, dtype=np.int64).view(np.float64)


def positive_floor(dtype):
    """The smallest positive value of ``dtype``: a threshold that selects every nonzero."""
    return np.nextafter(dtype.type(0), dtype.type(1))


def kth_largest_magnitude(x, k):
    """The k-th largest ``|x|`` in ``x``'s dtype (O(n) selection, no sort).

    Never 0: when fewer than k values are nonzero the smallest positive value is returned, so a
    ``|x| >= thr`` selection takes the nonzeros and not every zero besides.
    """
    n = x.shape[0]
    if k >= n:
        return positive_floor(x.dtype)
    mag = np.abs(x)
    mag.partition(n - k)
    kth = mag[n - k]
    return kth if kth > 0 else positive_floor(x.dtype)
