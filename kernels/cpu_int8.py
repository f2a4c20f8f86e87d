"""CPU kernels of 8-bit values on the wire (``wire_dtype="int8"``), ``@njit`` on NumPy buffers.

A run of ``c`` float32 values travels as ``share_bytes(c)`` bytes: the int8 codes ``q`` (padded to
4 bytes), then one float32 scale per block of ``BLOCK`` values. A block's scale is its largest
magnitude / 127, ``q = rint(v / scale)`` (ties to even) and the value it stands for is
``q * scale``, both IEEE float32 operations, so every rank that decodes the bytes gets the same bits.
A block of zeros (or whose scale underflows to 0) sends zeros. What the rounding lost,
``v - q * scale`` (exact in float32 for all but the smallest scales, and finite), stays with the
sender's residual.
"""
import numpy as np
from numba import njit

#: values per scale: 4 bytes of scale over 128 values is 0.03 bytes a value
BLOCK = 128


@njit(cache=True, nogil=True)
def share_bytes(c):
    """Bytes of ``c`` values: the codes padded to 4 bytes, then a float32 scale per block."""
    return (c + 3) // 4 * 4 + 4 * ((c + BLOCK - 1) // BLOCK)


@njit(cache=True, nogil=True)
def quantize(v, out, lost):
    """``v`` (float32, c) into ``out`` (uint8, ``share_bytes(c)``); ``lost[i] = v[i] - q * scale``
    (``lost`` may be ``v``)."""
    c = v.shape[0]
    pad = (c + 3) // 4 * 4
    q = out[:c].view(np.int8)
    out[c:pad] = 0
    scales = out[pad:pad + 4 * ((c + BLOCK - 1) // BLOCK)].view(np.float32)
    for b in range(scales.shape[0]):
        lo = b * BLOCK
        hi = min(lo + BLOCK, c)
        amax = np.float32(0.0)
        for i in range(lo, hi):
            a = abs(v[i])
            if a > amax:
                amax = a
        s = np.float32(amax / np.float32(127.0))
        scales[b] = s
        for i in range(lo, hi):
            x = v[i]
            k = np.float32(0.0)
            if s > 0:
                k = np.float32(np.rint(np.float32(x / s)))
                k = min(max(k, np.float32(-127.0)), np.float32(127.0))
            q[i] = np.int8(k)
            lost[i] = np.float32(x - np.float32(k * s))


@njit(cache=True, nogil=True)
def dequantize(buf, c, out):
    """``out[:c]`` = the float32 values ``q * scale`` of ``c`` values encoded in ``buf``."""
    pad = (c + 3) // 4 * 4
    q = buf[:c].view(np.int8)
    scales = buf[pad:pad + 4 * ((c + BLOCK - 1) // BLOCK)].view(np.float32)
    for i in range(c):
        out[i] = np.float32(np.float32(q[i]) * scales[i // BLOCK])


@njit(cache=True, nogil=True)
def owner_sum(recv, offs, own, me, p, out):
    """The float32 sum in rank order of this rank's share: ``own`` (c,) its own float32 values, rank
    ``r``'s 8-bit ones at ``recv[offs[r]:]`` (uint8, a multiple of 4 bytes; offsets too; row ``me``
    unused) into ``out`` (c,)."""
    c = own.shape[0]
    pad = (c + 3) // 4 * 4
    q = recv.view(np.int8)
    f = recv.view(np.float32)
    for i in range(c):
        s = np.float32(0.0)
        blk = i // BLOCK
        for r in range(p):
            if r == me:
                s = np.float32(s + own[i])
            else:
                o = offs[r]
                s = np.float32(s + np.float32(np.float32(q[o + i]) * f[(o + pad) // 4 + blk]))
        out[i] = s
