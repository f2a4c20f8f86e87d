"""CPU kernels of 8-bit values on the wire (``wire_dtype="int8"`` or ``"float8_e4m3fn"``), ``@njit``
on NumPy buffers.

A run of ``c`` float32 values travels as ``share_bytes(c)`` bytes: one byte code per value (padded
to 4 bytes), then one float32 scale per block of ``BLOCK`` values. A block's scale is its largest
magnitude over the code's top (``TOP``: 127 for int8, 448 for float8 e4m3fn), so the largest value
lands on the top code. A value ``v`` is coded from ``y = v / scale`` (a float32 division):

- ``INT8``: ``q = rint(y)`` (ties to even) in [-127, 127], the byte its two's complement;
- ``E4M3``: ``y`` rounded to the nearest float8 e4m3fn (OCP FP8: 4 exponent bits, bias 7, 3 mantissa
  bits, subnormals, no infinities; ties to even), saturated at 448. Its relative step is 1/8 down to
  ``2**-6`` and its range 2**17.8, where int8 keeps a step of ``scale`` at every magnitude: a value
  100x below its block's largest keeps two significant bits in e4m3, none in int8.

The value a byte stands for is ``TABLES[code][byte] * scale`` (a float32 product), so every rank that
decodes the bytes gets the same bits. A block of zeros (or whose scale underflows to 0) sends zeros.
What the rounding lost, ``v - TABLES[code][byte] * scale`` (finite), stays with the sender's residual.
"""
import math

import numpy as np
from numba import njit

#: values per scale: 4 bytes of scale over 128 values is 0.03 bytes a value
BLOCK = 128
#: the codes: 8-bit integers, float8 e4m3fn
INT8, E4M3 = 0, 1
#: ``wire_dtype`` names of the codes
CODES = {"int8": INT8, "float8_e4m3fn": E4M3}
#: the largest magnitude of each code; a block's scale is its maximum over this
TOP = (127.0, 448.0)


def _e4m3_table():
    mag = np.empty(128, np.float64)
    for b in range(128):
        e, m = b >> 3, b & 7
        mag[b] = m * 2.0 ** -9 if e == 0 else (1.0 + m / 8.0) * 2.0 ** (e - 7)
    mag[127] = np.nan                       # 0x7f / 0xff: e4m3fn's NaN
    return np.concatenate([mag, -mag]).astype(np.float32)


#: the float32 value of each byte, per code
TABLES = (np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float32), _e4m3_table())


@njit(cache=True, nogil=True)
def share_bytes(c):
    """Bytes of ``c`` values: the codes padded to 4 bytes, then a float32 scale per block."""
    return (c + 3) // 4 * 4 + 4 * ((c + BLOCK - 1) // BLOCK)


@njit(cache=True, nogil=True, inline="always")
def _e4m3(y):
    """The e4m3fn byte nearest float32 ``y`` (ties to even), saturated at +-448; NaN to 0x7f."""
    a = abs(np.float64(y))
    sign = 0x80 if math.copysign(1.0, y) < 0 else 0
    if a != a:
        return 0x7F
    if a >= 448.0:
        return sign | 0x7E
    if a < 2.0 ** -6:                        # subnormal: steps of 2**-9 (8 rounds up to the first normal)
        return sign | int(np.rint(a * 512.0))
    m, e = math.frexp(a)                     # a = m 2**e, m in [0.5, 1): the binade is e - 1
    b = ((e - 1 + 7) << 3) + int(np.rint((2.0 * m - 1.0) * 8.0))   # a mantissa carry moves the binade
    return sign | min(b, 0x7E)


@njit(cache=True, nogil=True)
def quantize(v, out, lost, code, table):
    """``v`` (float32, c) into ``out`` (uint8, ``share_bytes(c)``) in ``code`` (``INT8`` or ``E4M3``;
    ``table``: ``TABLES[code]``); ``lost[i] = v[i] - table[byte] * scale`` (``lost`` may be ``v``)."""
    c = v.shape[0]
    pad = (c + 3) // 4 * 4
    out[c:pad] = 0
    scales = out[pad:pad + 4 * ((c + BLOCK - 1) // BLOCK)].view(np.float32)
    top = np.float32(127.0) if code == INT8 else np.float32(448.0)
    for b in range(scales.shape[0]):
        lo = b * BLOCK
        hi = min(lo + BLOCK, c)
        amax = np.float32(0.0)
        for i in range(lo, hi):
            a = abs(v[i])
            if a > amax:
                amax = a
        s = np.float32(amax / top)
        scales[b] = s
        for i in range(lo, hi):
            x = v[i]
            byte = 0
            if s > 0:
                y = np.float32(x / s)
                if code == INT8:
                    k = min(max(np.float32(np.rint(y)), np.float32(-127.0)), np.float32(127.0))
                    byte = int(k) & 0xFF
                else:
                    byte = _e4m3(y)
            out[i] = byte
            lost[i] = np.float32(x - np.float32(table[byte] * s))


@njit(cache=True, nogil=True)
def dequantize(buf, c, table, out):
    """``out[:c]`` = the float32 values ``table[byte] * scale`` of ``c`` values encoded in ``buf``."""
    pad = (c + 3) // 4 * 4
    scales = buf[pad:pad + 4 * ((c + BLOCK - 1) // BLOCK)].view(np.float32)
    for i in range(c):
        out[i] = np.float32(table[buf[i]] * scales[i // BLOCK])


@njit(cache=True, nogil=True)
def owner_sum(recv, offs, own, me, p, table, out):
    """The float32 sum in rank order of this rank's share: ``own`` (c,) its own float32 values, rank
    ``r``'s 8-bit ones at ``recv[offs[r]:]`` (uint8, a multiple of 4 bytes; offsets too; row ``me``
    unused) into ``out`` (c,)."""
    c = own.shape[0]
    pad = (c + 3) // 4 * 4
    f = recv.view(np.float32)
    for i in range(c):
        s = np.float32(0.0)
        blk = i // BLOCK
        for r in range(p):
            if r == me:
                s = np.float32(s + own[i])
            else:
                o = offs[r]
                s = np.float32(s + np.float32(table[recv[o + i]] * f[(o + pad) // 4 + blk]))
        out[i] = s
