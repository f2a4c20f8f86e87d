"""Range-based low-bit floats: codes relative to the message maximum.

Bit layout of one ``b``-bit code (``b`` in {8, 16}; codes are byte-aligned uint8 / uint16):

    bit b-1        : sign
    bits m..b-2    : d, ``e_bits`` wide: the value's binade below the message's top binade
    bits 0..m-1    : mantissa q, ``m = b - 1 - e_bits`` bits, implicit leading 1

Header, per message (it rides in the count exchange, two int64 words): ``e_max`` and ``e_bits``.
A value ``v`` with ``E = floor(log2 |v|)`` is coded as ``d = e_max - E`` and
``q = round_half_even((|v| / 2^E - 1) * 2^m)`` (a carry ``q = 2^m`` moves to ``d - 1, q = 0``).
The code ``d = 2^e_bits - 1`` is zero. Decoding: ``(-1)^s 2^(e_max - d) (1 + q / 2^m)``.

Choice of ``e_max`` and ``e_bits`` (``encode``): ``e_max = floor(log2 max|v|)``, raised by one when
the maximum itself would round up into the next binade (so a carry never needs ``d = -1``);
``e_bits`` is the smallest width with ``2^e_bits - 2 >= e_max - floor(log2 floor)`` for the caller's
``floor`` (the smallest magnitude it wants kept), clamped to ``[1, b - 2]``.

Error bound (tested in tests/unit/test_fft_format.py): with ``e_min = e_max - (2^e_bits - 2)``,

    |v| >= 2^e_min :  |decode(encode(v)) - v| <= 2^-(m+1) |v|      (round to nearest, same sign)
    |v| <  2^e_min :  decode(encode(v)) is 0 or 2^e_min * sign(v), so the error is < 2^e_min

(a value just below ``2^e_min`` may round up into the lowest binade; either way the error is below
``2^e_min``). 8-bit codes with e_bits = 3 keep 4 mantissa bits: 3.1 % worst-case relative error
over a dynamic range of 2^6.
"""
import numpy as np

CODE_DTYPES = {8: np.uint8, 16: np.uint16}


def _binade(a):
    """floor(log2 a) and a / 2^floor(log2 a) - 1 in [0, 1), for a > 0 (exact, via frexp)."""
    f, e = np.frexp(a)
    return e.astype(np.int64) - 1, 2.0 * f - 1.0


def _width(span, bits):
    e_bits = 1
    while (1 << e_bits) - 2 < span and e_bits < bits - 2:
        e_bits += 1
    return e_bits


def choose_format(vmax, floor, bits):
    """(e_max, e_bits, m_bits) for a message whose largest magnitude is ``vmax`` (> 0)."""
    top, frac = _binade(np.float64(vmax))
    e_max = int(top)
    e_lo = int(_binade(np.float64(min(floor, vmax)))[0])
    e_bits = _width(e_max - e_lo, bits)
    if np.rint(frac * 2.0 ** (bits - 1 - e_bits)) == 2.0 ** (bits - 1 - e_bits):
        # the maximum rounds up into the next binade: make room for it (d = 0 there)
        e_max += 1
        e_bits = _width(e_max - e_lo, bits)
    return e_max, e_bits, bits - 1 - e_bits


def encode(v, bits=8, floor=None):
    """Codes for the float array ``v``; returns (codes, e_max, e_bits). Vectorised, no loops over v.

    ``floor``: the smallest magnitude worth keeping (sets the exponent width); default the smallest
    nonzero ``|v|``.
    """
    v = np.asarray(v, dtype=np.float64)
    dtype = CODE_DTYPES[bits]
    a = np.abs(v)
    vmax = float(a.max()) if a.size else 0.0
    if vmax == 0.0:
        e_bits = 1
        zero = (1 << e_bits) - 1
        return np.full(v.shape, zero << (bits - 1 - e_bits), dtype=dtype), 0, e_bits
    if floor is None or floor <= 0:
        floor = float(a[a > 0].min())
    e_max, e_bits, m_bits = choose_format(vmax, floor, bits)
    zero_d = (1 << e_bits) - 1
    nz = a > 0
    E, frac = _binade(np.where(nz, a, 1.0))
    d = e_max - E
    q = np.rint(frac * 2.0 ** m_bits).astype(np.int64)
    carry = q == (1 << m_bits)
    q[carry] = 0
    d[carry] -= 1
    flush = (~nz) | (d > zero_d - 1)
    d[flush] = zero_d
    q[flush] = 0
    sign = (v < 0) & ~flush
    codes = (sign.astype(np.int64) << (bits - 1)) | (d << m_bits) | q
    return codes.astype(dtype), e_max, e_bits


def decode(codes, e_max, e_bits, bits=8, out_dtype=np.float64):
    """Values of ``codes`` (from ``encode``) as ``out_dtype``."""
    c = np.asarray(codes).astype(np.int64)
    m_bits = bits - 1 - e_bits
    zero_d = (1 << e_bits) - 1
    d = (c >> m_bits) & zero_d
    q = c & ((1 << m_bits) - 1)
    s = (c >> (bits - 1)) & 1
    mag = np.ldexp(1.0 + q / float(1 << m_bits), (e_max - d).astype(np.int32))
    mag[d == zero_d] = 0.0
    return np.where(s == 1, -mag, mag).astype(out_dtype)


def error_bound(v, e_max, e_bits, bits=8):
    """The documented per-value bound on ``|decode(encode(v)) - v|`` for this format."""
    a = np.abs(np.asarray(v, dtype=np.float64))
    m_bits = bits - 1 - e_bits
    e_min = e_max - ((1 << e_bits) - 2)
    return np.where(a >= 2.0 ** e_min, a * 2.0 ** -(m_bits + 1), 2.0 ** e_min)
