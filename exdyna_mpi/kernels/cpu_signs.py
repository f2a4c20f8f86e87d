"""CPU kernels of the 2-bit sign codes (``exdyna_mpi/transport/signs.py``), ``@njit`` on NumPy buffers:
one pass each way, no temporaries (the vectorised NumPy form made five passes and an array of a
byte per code).

Code 0 is zero, 1 positive, 2 negative, 3 NaN; four codes to a byte, the first in the lowest bits.
"""
from numba import njit


@njit(cache=True, nogil=True)
def encode(x, out):
    """``out`` (uint8, ``(len(x) + 3) // 4``) = the packed codes of float array ``x`` (the unused
    codes of the last byte 0)."""
    n = x.shape[0]
    for b in range(out.shape[0]):
        v = 0
        for s in range(4):
            i = 4 * b + s
            if i < n:
                xi = x[i]
                if xi > 0:
                    v |= 1 << (2 * s)
                elif xi < 0:
                    v |= 2 << (2 * s)
                elif xi != xi:
                    v |= 3 << (2 * s)
        out[b] = v


@njit(cache=True, nogil=True)
def decode(packed, n, table, out):
    """``out[:n]`` = ``table[code]`` of the first ``n`` codes of ``packed``."""
    for i in range(n):
        out[i] = table[(packed[i >> 2] >> (2 * (i & 3))) & 3]
