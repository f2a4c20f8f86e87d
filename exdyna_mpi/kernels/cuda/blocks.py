"""Device functions the selection and the measuring pass share: a block's two counts, and the mark
of a hit in the hit mask."""
import numpy as np
from numba import cuda


@cuda.jit(device=True)
def _block_total2(a, b, out_a, out_b):
    """Sum ``a`` and ``b`` over the block; thread 0 stores them at ``out_*[blockIdx.x]``.

    int32 shared counters (native atomics; int64 ones are CAS loops on sm_90): a block visits
    fewer than 2**31 elements (1024 blocks up to 2**40 elements)."""
    sh = cuda.shared.array(2, np.int32)
    t = cuda.threadIdx.x
    if t == 0:
        sh[0] = 0
        sh[1] = 0
    cuda.syncthreads()
    if a != 0:
        cuda.atomic.add(sh, 0, np.int32(a))
    if b != 0:
        cuda.atomic.add(sh, 1, np.int32(b))
    cuda.syncthreads()
    if t == 0:
        out_a[cuda.blockIdx.x] = np.int64(sh[0])
        out_b[cuda.blockIdx.x] = np.int64(sh[1])



@cuda.jit(device=True)
def _mark(mask, i, lo):
    """Set the bit of element ``i`` in the hit mask (word ``(i - lo) // 32``, bit ``(i - lo) % 32``).

    Hits are rare (a density of 1e-3..1e-2 of the range), so one global atomic per hit costs less
    than building every word (a ballot per 32 elements, absent in the simulator); the compaction
    reads these words instead of re-reading ``x`` (1/32 of the bytes) and zeroes the ones it used.
    """
    d = i - lo
    cuda.atomic.or_(mask, d >> 5, np.uint32(1) << np.uint32(d & 31))
