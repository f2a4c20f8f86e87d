"""Signs on the wire: 2-bit codes, four to a byte, for an exchange whose receivers use only the sign
of each value (``Exchange.sum_signs``, ``Exchange.mean_wire(signs=True)``; a sparsifier's
``output="sign"``).

Code 0 is zero, 1 positive, 2 negative, 3 NaN, so ``decode(encode(x))`` is ``sign(x)`` to the bit on
every element but a negative zero (it comes back as +0). Host (NumPy) arrays; vectorised, O(n).
"""
from __future__ import annotations

import numpy as np

#: the bit offsets of the four codes in a byte, lowest first
_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)


def packed_size(n):
    """Bytes that ``n`` codes take (an int, or an integer array of counts)."""
    return (n + 3) // 4


def encode(x: np.ndarray) -> np.ndarray:
    """The 2-bit sign codes of the float array ``x``, packed four to a byte (``packed_size(len(x))``
    uint8; the unused codes of the last byte are 0)."""
    n = x.shape[0]
    codes = np.zeros(packed_size(n) * 4, dtype=np.uint8)
    c = codes[:n]
    c[x > 0] = 1
    c[x < 0] = 2
    c[np.isnan(x)] = 3
    return np.bitwise_or.reduce(codes.reshape(-1, 4) << _SHIFTS, axis=1)


def decode(packed: np.ndarray, n: int, table: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[:n]`` = ``table[code]`` of the first ``n`` codes in ``packed``; ``table`` holds the
    value of each code (``sign_table``, or its 16-bit patterns)."""
    codes = (packed[:, None] >> _SHIFTS) & np.uint8(3)
    np.take(table, codes.reshape(-1)[:n], out=out[:n])
    return out


def sign_table(dtype) -> np.ndarray:
    """The values of codes 0-3 in ``dtype``: 0, 1, -1, NaN."""
    return np.array([0.0, 1.0, -1.0, np.nan], dtype=dtype)
