"""Signs on the wire: 2-bit codes, four to a byte, for an exchange whose receivers use only the sign
of each value (``Exchange.sum_signs``, ``Exchange.mean_wire(signs=True)``; a sparsifier's
``output="sign"``).

Code 0 is zero, 1 positive, 2 negative, 3 NaN, so ``decode(encode(x))`` is ``sign(x)`` to the bit on
every element but a negative zero (it comes back as +0). Host (NumPy) arrays; one ``@njit`` pass
each way (``exdyna_mpi/kernels/cpu_signs.py``).
"""
from __future__ import annotations

import numpy as np

from ..kernels import cpu_signs as _ks


def packed_size(n):
    """Bytes that ``n`` codes take (an int, or an integer array of counts)."""
    return (n + 3) // 4


def encode(x: np.ndarray) -> np.ndarray:
    """The 2-bit sign codes of the float array ``x``, packed four to a byte (``packed_size(len(x))``
    uint8; the unused codes of the last byte are 0)."""
    out = np.empty(packed_size(x.shape[0]), dtype=np.uint8)
    _ks.encode(x, out)
    return out


def decode(packed: np.ndarray, n: int, table: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[:n]`` = ``table[code]`` of the first ``n`` codes in ``packed``; ``table`` holds the
    value of each code (``sign_table``, or its 16-bit patterns)."""
    _ks.decode(packed, int(n), table, out)
    return out


def sign_table(dtype) -> np.ndarray:
    """The values of codes 0-3 in ``dtype``: 0, 1, -1, NaN."""
    return np.array([0.0, 1.0, -1.0, np.nan], dtype=dtype)
