"""CPU kernels of the 16-bit formats: half values on the wire, ``@njit`` on NumPy buffers.

Half values travel as their 16-bit patterns (uint16): Numba has no bfloat16 type and its float16
support is partial, so the conversions are integer operations on the patterns, round-to-nearest-
even, the same bits as NumPy's ``astype(np.float16)`` and ``ml_dtypes.bfloat16``
(tests/unit/test_half_kernels.py). ``MODE_BF16`` / ``MODE_F16`` name the format; widening float16
reads a 65,536-entry table (``f16_table``), exact by construction.

Wire rounding *saturates*: a finite float32 beyond the format's range is sent as its largest finite
value, not inf, so the rounding error a rank keeps in its residual stays finite.

The compact index forms are ``exdyna_mpi/kernels/cpu_index.py``.
"""
import numpy as np
from numba import njit

MODE_BF16 = 1
MODE_F16 = 2


def f16_table():
    """float32 value of every float16 pattern (65,536 entries, exact)."""
    return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


# ---------------------------------------------------------------------------- scalar conversions
# The rounding logic is plain Python, compiled for both targets: here with ``njit`` and in
# exdyna_mpi/kernels/cuda/half.py as ``cuda.jit`` device functions, so host and device cannot drift apart.
def bf16_round_bits(b, saturate):
    """The bfloat16 pattern of the float32 pattern ``b`` (an int64, 0 .. 2**32 - 1), round to
    nearest even; NaN stays a quiet NaN, inf stays inf; ``saturate``: a finite value beyond range
    becomes the largest finite one instead of inf."""
    a = b & 0x7FFFFFFF
    if a > 0x7F800000:                      # NaN: keep sign and top payload, make it quiet
        return (b >> 16) | 0x0040
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    if saturate and (r & 0x7FFF) == 0x7F80 and a != 0x7F800000:
        r = (r & 0x8000) | 0x7F7F
    return r & 0xFFFF


def f16_round_bits(b, saturate):
    """The float16 pattern of the float32 pattern ``b``, as NumPy's cast makes it (NaN: the top of
    the payload, never inf), round to nearest even; ``saturate`` as ``bf16_round_bits``."""
    sign = (b >> 16) & 0x8000
    a = b & 0x7FFFFFFF
    if a >= 0x7F800000:
        if a == 0x7F800000:
            return sign | 0x7C00
        h = 0x7C00 + ((a & 0x7FFFFF) >> 13)
        if h == 0x7C00:
            h += 1
        return sign | h
    if a >= 0x477FF000:                     # rounds to inf
        return sign | (0x7BFF if saturate else 0x7C00)
    if a >= 0x38800000:                     # a normal float16
        return sign | ((a - 0x38000000 + 0xFFF + ((a >> 13) & 1)) >> 13)
    if a >= 0x33000000:                     # a subnormal float16 (or the smallest normal, by carry)
        e = a >> 23
        m = (a & 0x7FFFFF) | 0x800000
        shift = 126 - e
        h = m >> shift
        rem = m & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and (h & 1) == 1):
            h += 1
        return sign | h
    return sign                             # rounds to a signed zero


_bf16_round = njit(cache=True, nogil=True, inline="always")(bf16_round_bits)
_f16_round = njit(cache=True, nogil=True, inline="always")(f16_round_bits)


@njit(cache=True, nogil=True, inline="always")
def _round(b, mode, saturate):
    if mode == MODE_BF16:
        return _bf16_round(b, saturate)
    return _f16_round(b, saturate)


@njit(cache=True, nogil=True, inline="always")
def _widen_bits(h, mode, table):
    # the float32 pattern (int64) of 16-bit pattern h
    if mode == MODE_BF16:
        return np.int64(h) << 16
    return np.int64(table[h])


# ---------------------------------------------------------------------------- whole-vector passes
@njit(cache=True, nogil=True)
def widen(h, mode, table_bits, out_bits):
    """``out_bits`` (the uint32 view of a float32 array) = the values of the 16-bit patterns ``h``.
    ``table_bits``: ``f16_table().view(np.uint32)`` (read for float16 only)."""
    for i in range(h.shape[0]):
        out_bits[i] = _widen_bits(h[i], mode, table_bits)


@njit(cache=True, nogil=True)
def narrow(x_bits, mode, out):
    """``out`` (uint16) = float32 patterns ``x_bits`` rounded to nearest even (inf beyond range)."""
    for i in range(x_bits.shape[0]):
        out[i] = _round(np.int64(x_bits[i]), mode, False)


@njit(cache=True, nogil=True)
def wire_round(vals, mode, table_bits, sent, lo, hi):
    """Outside ``[lo, hi)``: ``sent[i]`` = ``vals[i]`` rounded (saturating) and ``vals[i]`` becomes
    what the rounding lost, ``vals[i] - sent[i]`` (exact in float32). ``[lo, hi)`` (this rank's own
    share, reduced here in float32) is left as it is."""
    vb = vals.view(np.uint32)
    w = np.empty(1, np.uint32)
    wf = w.view(np.float32)
    for i in range(vals.shape[0]):
        if i >= lo and i < hi:
            continue
        h = _round(np.int64(vb[i]), mode, True)
        sent[i] = h
        w[0] = _widen_bits(h, mode, table_bits)
        vals[i] = vals[i] - wf[0]


@njit(cache=True, nogil=True)
def owner_mean(recv, own, me, p, mode, table_bits, mean_out, err):
    """The reduction of this rank's share: ``recv`` (p, c) the 16-bit values every rank sent (row
    ``me`` unused), ``own`` (c,) this rank's float32 values. The float32 sum in rank order, the mean
    sum / p rounded to 16 bits (saturating) into ``mean_out``, and into ``err`` what the rounding of
    the mean lost, ``sum - p * mean`` (this rank's residual keeps it). ``err`` may be ``own``."""
    c = own.shape[0]
    pf = np.float32(p)
    w = np.empty(1, np.uint32)
    wf = w.view(np.float32)
    for i in range(c):
        s = np.float32(0.0)
        for r in range(p):
            if r == me:
                s += own[i]
            else:
                w[0] = _widen_bits(recv[r, i], mode, table_bits)
                s += wf[0]
        wf[0] = s / pf
        h = _round(np.int64(w[0]), mode, True)
        mean_out[i] = h
        w[0] = _widen_bits(h, mode, table_bits)
        err[i] = s - pf * wf[0]


@njit(cache=True, nogil=True)
def scatter_wire(out, residual, idx, means, err, mode, table_bits):
    """``out[idx[j]]`` = the value of 16-bit ``means[j]``, ``residual[idx[j]] = err[j]``: the end of
    a step whose values travelled in 16 bits (one pass over the union)."""
    ob = out.view(np.uint32)
    for j in range(idx.shape[0]):
        i = idx[j]
        ob[i] = _widen_bits(means[j], mode, table_bits)
        residual[i] = err[j]
