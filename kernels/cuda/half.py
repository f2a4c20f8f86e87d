"""The 16-bit formats on the device: float16 and bfloat16 gradients widened to float32 and outputs
rounded back, on their 16-bit patterns (uint16 views: numba-cuda's bfloat16 is incomplete), the
conversion in registers. The integer logic of ``kernels/cpu_half.py`` (round-to-nearest-even, NaN
kept quiet, inf beyond range), so device and host give the same bits (tests/cudasim/test_half_cuda.py);
float16 is widened arithmetically here (the host reads a table; both are exact).
"""
import numpy as np
from numba import cuda

from .launch import _elementwise

MODE_BF16 = 1
MODE_F16 = 2


@cuda.jit(device=True, inline=True)
def _bf16_round(b):
    a = b & 0x7FFFFFFF
    if a > 0x7F800000:
        return (b >> 16) | 0x0040
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


@cuda.jit(device=True, inline=True)
def _f16_round(b):
    sign = (b >> 16) & 0x8000
    a = b & 0x7FFFFFFF
    if a >= 0x7F800000:
        if a == 0x7F800000:
            return sign | 0x7C00
        h = 0x7C00 + ((a & 0x7FFFFF) >> 13)
        if h == 0x7C00:
            h += 1
        return sign | h
    if a >= 0x477FF000:
        return sign | 0x7C00
    if a >= 0x38800000:
        return sign | ((a - 0x38000000 + 0xFFF + ((a >> 13) & 1)) >> 13)
    if a >= 0x33000000:
        e = a >> 23
        m = (a & 0x7FFFFF) | 0x800000
        shift = 126 - e
        h = m >> shift
        rem = m & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and (h & 1) == 1):
            h += 1
        return sign | h
    return sign


@cuda.jit(device=True, inline=True)
def _f16_widen(h):
    s = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        if m == 0:
            return s
        e2 = 113
        while (m & 0x400) == 0:
            m <<= 1
            e2 -= 1
        return s | (e2 << 23) | ((m & 0x3FF) << 13)
    if e == 31:
        return s | 0x7F800000 | (m << 13)
    return s | ((e + 112) << 23) | (m << 13)


@cuda.jit
def _widen16(h, out_bits, mode):
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    while j < h.shape[0]:
        v = np.int64(h[j])
        if mode == MODE_BF16:
            out_bits[j] = v << 16
        else:
            out_bits[j] = _f16_widen(v)
        j += stride


@cuda.jit
def _narrow16(x_bits, out, mode):
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    while j < x_bits.shape[0]:
        b = np.int64(x_bits[j])
        if mode == MODE_BF16:
            out[j] = _bf16_round(b)
        else:
            out[j] = _f16_round(b)
        j += stride


def widen16(h, out_bits, mode, stream=0):
    """``out_bits`` (uint32 view of float32) = the values of the 16-bit patterns ``h``."""
    _elementwise(_widen16, h.shape[0], stream, h, out_bits, mode)


def narrow16(x_bits, out, mode, stream=0):
    """``out`` (uint16) = float32 patterns ``x_bits`` rounded to nearest even (inf beyond range)."""
    _elementwise(_narrow16, x_bits.shape[0], stream, x_bits, out, mode)
