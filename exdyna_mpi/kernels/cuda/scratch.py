"""``Scratch``: the small device words of one stream of selections (block counts, offsets, totals,
histogram words, the finish's control words) and the hit mask, reused every step."""
import numpy as np
from numba import cuda

from .config import HIST_MAX, NB_MAX, SIMULATOR
from .scatter_gather import zero_words


class Scratch:
    """The small int64 buffers of one selection (block counts, block offsets, totals, histograms)
    and the hit mask (uint32, one bit per element of the selection range, all zero between calls).

    ``words`` is one int64 array of at least ``Scratch.size()`` elements, allocated by the caller
    (a CuPy array, a Numba device array, or NumPy under the simulator) and reused every step;
    ``zeros(n, dtype)`` allocates the mask (zeroed) the first time a range needs a larger one.
    One ``Scratch`` serves one stream of work at a time: the launchers leave results in it for the
    host to read (``CudaOps`` keeps one per device, stream and thread).
    """

    @staticmethod
    def size():
        return 3 * NB_MAX + 2 + HIST_MAX + 4

    def __init__(self, words, zeros=None):
        self.words = words
        self.block_counts = words[0:NB_MAX]
        self.block_bad = words[NB_MAX:2 * NB_MAX]
        self.offsets = words[2 * NB_MAX:3 * NB_MAX]
        self.totals = words[3 * NB_MAX:3 * NB_MAX + 2]
        # the histograms' device counts, right after totals: one copy reads [count, bad, hist...]
        self.hist = words[3 * NB_MAX + 2:3 * NB_MAX + 2 + HIST_MAX]
        self.totals_hist = words[3 * NB_MAX:3 * NB_MAX + 2 + HIST_MAX]
        # ``finish_fine_async``'s words: [settled, count] and the threshold's bits (its own word)
        at = 3 * NB_MAX + 2 + HIST_MAX
        self.ctl = words[at:at + 2]
        self.thr_word = words[at + 2:at + 3]
        self._zeros = zeros or _zeros
        self.mask = None
        self.marked = None  # (lo, hi, mark, stream) while the mask holds a measuring pass's marks

    def mask_for(self, m, keep_marks=False):
        """The hit mask for a selection range of ``m`` elements (grown, never shrunk), all zero
        unless ``keep_marks`` (marks left by ``accumulate_measure_async`` that nobody consumed, a
        step that stopped after its measuring pass, are cleared here first)."""
        if self.marked is not None and not keep_marks:
            self.clear_marks()
        nw = max((m + 31) // 32, 1)
        if self.mask is None or self.mask.shape[0] < nw:
            grown = nw if self.mask is None else max(nw, 2 * self.mask.shape[0])
            self.mask = self._zeros(grown, np.uint32)
        return self.mask

    def clear_marks(self):
        """Zero the mask words the marks may use (queued on the stream of the pass that set them)."""
        lo, hi, _, stream = self.marked
        self.marked = None
        nw = (hi - lo + 31) // 32
        zero_words(self.mask, nw, stream)


def _zeros(n, dtype):
    if SIMULATOR:
        return np.zeros(n, dtype)
    return cuda.to_device(np.zeros(n, dtype))


def new_scratch():
    """A ``Scratch`` allocated with Numba (tests and one-off calls; ``CudaOps`` brings its own)."""
    return Scratch(_zeros(Scratch.size(), np.int64))
