"""The 16-bit formats on the device: float16 and bfloat16 gradients widened to float32 and outputs
rounded back, on their 16-bit patterns (uint16 views: numba-cuda's bfloat16 is incomplete), the
conversion in registers (the rounding is ``exdyna_mpi/kernels/cpu_half.py``'s own Python, compiled for the
device); and the device side of 16-bit values on the wire (``wire_round``,
``owner_sum`` + ``owner_round``, ``scatter_wire``). The integer logic of ``exdyna_mpi/kernels/cpu_half.py``
(round-to-nearest-even, NaN kept quiet, inf beyond range, saturation on the wire), so device and
host give the same bits (tests/cudasim/test_half_cuda.py); float16 is widened arithmetically here
(the host reads a table; both are exact).

Numba has no scalar bit cast: the wire kernels take a float32's pattern apart with ``frexp`` and
build a 16-bit pattern's value with ``ldexp`` (both exact; the wire carries finite values, and an
owner's sum that overflowed to inf). The kernels take no two views of one buffer: the simulator
copies each argument back after a launch, so aliased arguments would undo each other's writes.
"""
import math

import numpy as np
from numba import cuda

from ..cpu_half import bf16_round_bits, f16_round_bits
from .launch import _elementwise

MODE_BF16 = 1
MODE_F16 = 2


_bf16_round = cuda.jit(device=True, inline=True)(bf16_round_bits)
_f16_round = cuda.jit(device=True, inline=True)(f16_round_bits)


@cuda.jit(device=True, inline=True)
def _round_sat(b, mode):
    """``b`` (a float32's pattern) rounded to 16 bits, a finite value beyond range to the largest
    finite one (``kernels.cpu_half``'s logic, compiled here)."""
    if mode == MODE_BF16:
        return _bf16_round(b, True)
    return _f16_round(b, True)


@cuda.jit(device=True, inline=True)
def _bits32(v):
    """The pattern (int64) of float32 ``v``: finite or infinite (no NaN on the wire)."""
    neg = math.copysign(1.0, v) < 0
    a = abs(v)
    if math.isinf(a):
        b = 0x7F800000
    elif a == 0:
        b = 0
    else:
        m, e = math.frexp(a)                   # a = m 2^e, 0.5 <= m < 1
        if e >= -125:                          # a normal float32
            b = ((e + 126) << 23) | (int(m * 16777216.0) - 0x800000)
        else:                                  # a subnormal one: a = k 2^-149
            b = int(math.ldexp(a, 149))
    return b | 0x80000000 if neg else b


@cuda.jit(device=True, inline=True)
def _value16(h, mode):
    """The float32 value of a finite 16-bit pattern ``h``."""
    if mode == MODE_BF16:
        e = (h >> 7) & 0xFF
        m = h & 0x7F
        v = math.ldexp(np.float32(m), -133) if e == 0 else math.ldexp(np.float32(128 + m), int(e - 134))
    else:
        e = (h >> 10) & 0x1F
        m = h & 0x3FF
        v = math.ldexp(np.float32(m), -24) if e == 0 else math.ldexp(np.float32(1024 + m), int(e - 25))
    v = np.float32(v)
    return -v if (h & 0x8000) != 0 else v


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
            out[j] = _bf16_round(b, False)
        else:
            out[j] = _f16_round(b, False)
        j += stride


def widen16(h, out_bits, mode, stream=0):
    """``out_bits`` (uint32 view of float32) = the values of the 16-bit patterns ``h``."""
    _elementwise(_widen16, h.shape[0], stream, h, out_bits, mode)


def narrow16(x_bits, out, mode, stream=0):
    """``out`` (uint16) = float32 patterns ``x_bits`` rounded to nearest even (inf beyond range)."""
    _elementwise(_narrow16, x_bits.shape[0], stream, x_bits, out, mode)


@cuda.jit
def _wire_round(vals, mode, sent, lo, hi):
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    while j < vals.shape[0]:
        if j < lo or j >= hi:
            v = vals[j]
            h = _round_sat(_bits32(v), mode)
            sent[j] = h
            vals[j] = np.float32(v - _value16(h, mode))
        j += stride


@cuda.jit
def _owner_mean(recv, own, me, p, mode, mean_out):
    # the float32 sum in rank order; own becomes what the mean's rounding lost
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    pf = np.float32(p)
    while i < own.shape[0]:
        s = np.float32(0.0)
        for r in range(p):
            if r == me:
                s = np.float32(s + own[i])
            else:
                s = np.float32(s + _value16(np.int64(recv[r, i]), mode))
        m = np.float32(s / pf)
        h = _round_sat(_bits32(m), mode)
        mean_out[i] = h
        own[i] = np.float32(s - np.float32(pf * _value16(h, mode)))
        i += stride


@cuda.jit
def _scatter_wire(out, residual, idx, means, err, mode):
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    while j < idx.shape[0]:
        i = idx[j]
        out[i] = _value16(np.int64(means[j]), mode)
        residual[i] = err[j]
        j += stride


def wire_round(vals, mode, sent, lo, hi, stream=0):
    """Outside ``[lo, hi)``: ``sent`` = ``vals`` rounded to 16 bits (saturating), ``vals`` = what the
    rounding lost (``kernels.cpu_half.wire_round``)."""
    _elementwise(_wire_round, vals.shape[0], stream, vals, mode, sent, lo, hi)


def owner_mean(recv, own, me, p, mode, mean_out, stream=0):
    """``kernels.cpu_half.owner_mean`` with ``err`` = ``own``: the float32 sum in rank order, the
    16-bit mean into ``mean_out``, and in ``own`` what the mean's rounding lost."""
    _elementwise(_owner_mean, own.shape[0], stream, recv, own, me, p, mode, mean_out)


def scatter_wire(out, residual, idx, means, err, mode, stream=0):
    """``out[idx[j]]`` = the value of 16-bit ``means[j]``, ``residual[idx[j]] = err[j]``."""
    _elementwise(_scatter_wire, idx.shape[0], stream, out, residual, idx, means, err, mode)
